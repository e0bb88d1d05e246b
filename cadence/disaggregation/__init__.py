"""Prefill/decode disaggregation: the transfer agents that move a request's KV pages between a
prefill server and a decode server (docs/disaggregation.md)."""
