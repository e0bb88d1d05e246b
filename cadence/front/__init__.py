"""The front process's engine side: request checking and tokenization, per-request state,
and the `EngineClient` interface every adapter (HTTP, gRPC, the in-process `Engine`) uses.

Imports nothing heavy (no torch): the HTTP adapter loads it on its own.
"""
