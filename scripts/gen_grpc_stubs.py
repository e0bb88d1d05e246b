"""Regenerate the checked-in gRPC stubs from the protos under proto/.

    python scripts/gen_grpc_stubs.py            # rewrite cadence/grpc/stubs/*_pb2*.py(i)
    python scripts/gen_grpc_stubs.py --check    # exit 1 if the checked-in stubs are stale

Needs grpcio-tools (a build/test dependency; users of the package never run protoc).
The protos and the stub modules generated from them:

- sglang/runtime/v1/sglang.proto (`sglang.runtime.v1.SglangService`): sglang_pb2*.
- sglang/grpc/scheduler/sglang_scheduler.proto (`sglang.grpc.scheduler.SglangScheduler`,
  the service SGLang's model gateway drives): sglang_scheduler_pb2*.
- smg/grpc/common/common.proto (the messages that service shares with the gateway's other
  backends): smg_common_pb2* (named for its package: a bare `common_pb2` says nothing).

protoc names the generated modules after the proto's path (`sglang.runtime.v1`, ...), so
the imports between them are rewritten to point at `cadence.grpc.stubs`. Each descriptor keeps
its proto's path as its file name (`sglang/runtime/v1/sglang.proto`, ...), which
reflection reports. The modules of the scheduler service start with a line that keeps
ruff's linter and formatter off them (pyproject.toml's exclude list names the older ones).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO_FILES = (
    "sglang/runtime/v1/sglang.proto",
    "smg/grpc/common/common.proto",
    "sglang/grpc/scheduler/sglang_scheduler.proto",
)
PACKAGE_DIR = REPO / "cadence" / "grpc" / "stubs"
# generated file (relative to the output directory) -> its name in cadence/grpc/stubs
STUBS = {
    "sglang/runtime/v1/sglang_pb2.py": "sglang_pb2.py",
    "sglang/runtime/v1/sglang_pb2.pyi": "sglang_pb2.pyi",
    "sglang/runtime/v1/sglang_pb2_grpc.py": "sglang_pb2_grpc.py",
    "smg/grpc/common/common_pb2.py": "smg_common_pb2.py",
    "smg/grpc/common/common_pb2.pyi": "smg_common_pb2.pyi",
    "sglang/grpc/scheduler/sglang_scheduler_pb2.py": "sglang_scheduler_pb2.py",
    "sglang/grpc/scheduler/sglang_scheduler_pb2.pyi": "sglang_scheduler_pb2.pyi",
    "sglang/grpc/scheduler/sglang_scheduler_pb2_grpc.py": "sglang_scheduler_pb2_grpc.py",
}
# (import protoc writes, the same import of the module in cadence.grpc)
_IMPORTS = (
    ("from sglang.runtime.v1 import sglang_pb2 as", "from cadence.grpc.stubs import sglang_pb2 as"),
    (
        "from smg.grpc.common import common_pb2 as",
        "from cadence.grpc.stubs import smg_common_pb2 as",
    ),
    (
        "from sglang.grpc.scheduler import sglang_scheduler_pb2 as",
        "from cadence.grpc.stubs import sglang_scheduler_pb2 as",
    ),
)
_UNLINTED = ("smg_common_pb2", "sglang_scheduler_pb2")
_HEADER = "# ruff: noqa\n# fmt: off\n"


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
            *(str(PROTO_ROOT / name) for name in PROTO_FILES),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed (exit {code}) on {', '.join(PROTO_FILES)}")
    stubs = {}
    for generated, name in STUBS.items():
        text = (out_dir / generated).read_text()
        for written, ours in _IMPORTS:
            text = text.replace(written, ours)
        if name.startswith(_UNLINTED):
            text = _HEADER + text
        stubs[name] = text
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
