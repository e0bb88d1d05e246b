"""The house's size limits, kept true by a test rather than by memory: no function of
Cadence's own code longer than 80 lines (generated gRPC stubs aside), and
`launch_server.py` holding the command line and the process plan only (200 lines at most)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cadence"
GENERATED = PACKAGE / "grpc" / "stubs"  # protoc's output, regenerated, never edited
MAX_FUNCTION_LINES = 80
MAX_LAUNCH_SERVER_LINES = 200


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_80_lines():
    sources = [p for p in PACKAGE.rglob("*.py") if GENERATED not in p.parents]
    assert len(sources) > 100, "the package's sources were not found"
    too_long = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({length} lines)"
        for path in sources
        for name, line, length in _functions(path)
        if length > MAX_FUNCTION_LINES
    ]
    assert not too_long, "split these into named steps:\n" + "\n".join(too_long)


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"def long():\n{body}\n")
    [(name, _, length)] = list(_functions(path))
    assert (name, length) == ("long", MAX_FUNCTION_LINES + 1)


def test_launch_server_keeps_to_the_cli_and_the_process_plan():
    lines = (PACKAGE / "launch_server.py").read_text().count("\n")
    assert lines <= MAX_LAUNCH_SERVER_LINES, f"launch_server.py has {lines} lines"
