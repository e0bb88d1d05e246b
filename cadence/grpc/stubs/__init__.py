"""Generated protobuf and gRPC modules (`python scripts/gen_grpc_stubs.py`; never edited by
hand). Imported through `cadence.grpc` (`from cadence.grpc import sglang_pb2`), which loads
them on first use."""
