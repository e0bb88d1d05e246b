"""The docstring under each field of a configuration dataclass: one source for `--help`.

Server arguments and router configuration both document every field where it is declared;
their command lines read the help text from here. Imports nothing of Cadence.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import fields, is_dataclass


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of `cls`, by field name; a dataclass field without
    one is a RuntimeError (its flag would have no help)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    if is_dataclass(cls):
        missing = {f.name for f in fields(cls)} - set(docs)
        if missing:
            raise RuntimeError(f"{cls.__name__} fields without a docstring: {sorted(missing)}")
    return docs
