"""The native gRPC API: `sglang.runtime.v1.SglangService`, served beside HTTP.

Generated stubs ship in this package, so clients need neither protoc nor grpcio-tools:

    import grpc
    from cadence.grpc import sglang_pb2, sglang_pb2_grpc

    channel = grpc.insecure_channel("127.0.0.1:40000")        # --grpc-port, default --port + 10000
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    print(stub.Tokenize(sglang_pb2.TokenizeRequest(text="Hello")).tokens)

The stubs come from `proto/sglang/runtime/v1/sglang.proto`; after changing the proto, run
`python scripts/gen_grpc_stubs.py` (a unit test fails while they are stale).

The same port serves SGLang's scheduler service `sglang.grpc.scheduler.SglangScheduler`,
which SGLang's model gateway (SMG) drives with token ids (`scheduler_servicer`; stubs
`sglang_scheduler_pb2*` and `smg_common_pb2`, from proto/sglang/grpc/scheduler/ and
proto/smg/grpc/common/; docs/grpc.md, "SGLang's scheduler service").

The generated modules live in `cadence.grpc.stubs`; their public names stay
`cadence.grpc.<stub>`, loaded on first use. This module imports nothing: `server`
(grpc.aio) is loaded by the front process only.
"""

import importlib

SERVICE_NAME = "sglang.runtime.v1.SglangService"
STUBS = frozenset(
    {
        "sglang_pb2",
        "sglang_pb2_grpc",
        "sglang_scheduler_pb2",
        "sglang_scheduler_pb2_grpc",
        "smg_common_pb2",
    }
)


def __getattr__(name: str):
    if name in STUBS:
        module = importlib.import_module(f"cadence.grpc.stubs.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'cadence.grpc' has no attribute {name!r}")
