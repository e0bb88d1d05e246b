"""Regenerate the checked-in gRPC stubs from proto/sglang/runtime/v1/sglang.proto.

    python scripts/gen_grpc_stubs.py            # rewrite cadence/grpc/sglang_pb2*.py(i)
    python scripts/gen_grpc_stubs.py --check    # exit 1 if the checked-in stubs are stale

Needs grpcio-tools (a build/test dependency; users of the package never run protoc).
protoc names the generated modules after the proto's path (`sglang.runtime.v1`), so the
import in sglang_pb2_grpc.py is rewritten to point at `cadence.grpc`. The descriptor keeps
the canonical file name `sglang/runtime/v1/sglang.proto`, which reflection reports.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO_FILE = "sglang/runtime/v1/sglang.proto"
PACKAGE_DIR = REPO / "cadence" / "grpc"
STUBS = ("sglang_pb2.py", "sglang_pb2.pyi", "sglang_pb2_grpc.py")
_GENERATED_IMPORT = "from sglang.runtime.v1 import sglang_pb2 as"
_PACKAGE_IMPORT = "from cadence.grpc import sglang_pb2 as"


def generate(out_dir: Path) -> dict[str, str]:
    """Runs protoc into `out_dir`; returns {stub file name: text}, imports rewritten."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed (exit {code}) on {PROTO_FILE}")
    gen_dir = out_dir / Path(PROTO_FILE).parent
    stubs = {name: (gen_dir / name).read_text() for name in STUBS}
    stubs["sglang_pb2_grpc.py"] = stubs["sglang_pb2_grpc.py"].replace(
        _GENERATED_IMPORT, _PACKAGE_IMPORT
    )
    return stubs


def stale_stubs() -> list[str]:
    """The stub files whose checked-in text differs from a fresh generation, with a diff each."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    problems = []
    for name, text in fresh.items():
        path = PACKAGE_DIR / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = "".join(
                difflib.unified_diff(
                    current.splitlines(True),
                    text.splitlines(True),
                    f"checked-in/{name}",
                    f"generated/{name}",
                    n=1,
                )
            )
            problems.append(f"{name} is stale:\n{diff[:4000]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_stubs()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python scripts/gen_grpc_stubs.py", file=sys.stderr)
        return 1 if problems else 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (PACKAGE_DIR / name).write_text(text)
            print(f"wrote {PACKAGE_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
