"""Constrained decoding: JSON schema, regex and EBNF constraints on a request's output.

`base` states what a grammar engine must do (`GrammarBackend`, `Grammar`); `xgrammar_backend`
is the engine Cadence ships; `grammar_queue` compiles off the scheduler's thread and caches.
This module picks an engine by name (`--grammar-backend`) and checks constraints at the edge.
Imports no engine until one is used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cadence.constrained.base import (
    GRAMMAR_FIELDS,
    MAX_GRAMMAR_CHARS,
    Grammar,
    GrammarBackend,
    GrammarKey,
    InvalidGrammar,
    grammar_key,
    words_per_row,
)

# --grammar-backend values; "none" turns constrained decoding off (constraints get a 400).
GRAMMAR_BACKENDS = ("xgrammar", "none")

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_FIELDS",
    "MAX_GRAMMAR_CHARS",
    "Grammar",
    "GrammarBackend",
    "GrammarKey",
    "InvalidGrammar",
    "backend_class",
    "check_grammar",
    "create_backend",
    "create_grammar_queue",
    "grammar_key",
    "words_per_row",
]


def backend_class(name: str) -> type[GrammarBackend] | None:
    """The engine class of a --grammar-backend name (None for "none")."""
    if name == "none":
        return None
    if name == "xgrammar":
        from cadence.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    raise ValueError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {name!r}")


def create_backend(
    name: str, tokenizer, vocab_size: int, eos_token_ids: list[int], **options
) -> GrammarBackend | None:
    """The engine `name` bound to a model's tokenizer and vocabulary (None for "none")."""
    cls = backend_class(name)
    return None if cls is None else cls(tokenizer, vocab_size, eos_token_ids, **options)


def create_grammar_queue(
    name: str,
    load_tokenizer: Callable[[], Any],
    vocab_size: int,
    eos_token_ids: list[int],
    **options,
):
    """The scheduler's GrammarQueue for engine `name` (None for "none"); the engine is bound
    to the vocabulary at the first constraint, on the queue's worker thread, with the
    transformers tokenizer `load_tokenizer()` returns then. Nothing of the engine is
    imported before that (xgrammar brings transformers: ~1 s of CPU at each start of a
    server that may never see a constraint)."""
    if name == "none":
        return None
    if name not in GRAMMAR_BACKENDS:
        backend_class(name)  # raises, naming the engines there are
    from cadence.constrained.grammar_queue import GrammarQueue

    def bind() -> GrammarBackend:
        return create_backend(name, load_tokenizer(), vocab_size, eos_token_ids, **options)

    return GrammarQueue(name, bind)


def check_grammar(backend: str, key: GrammarKey) -> None:
    """Raises InvalidGrammar when `key` cannot be served by the engine `backend` (or when
    constrained decoding is off). Results are remembered: the n samples of one request, and
    clients that send the same schema again, pay once."""
    if len(key.text) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammar(
            key.field, f"it has {len(key.text)} characters; at most {MAX_GRAMMAR_CHARS} are served"
        )
    error = _check(backend, key)
    if error is not None:
        raise InvalidGrammar(key.field, error)


@functools.lru_cache(maxsize=1024)
def _check(backend: str, key: GrammarKey) -> str | None:
    cls = backend_class(backend)
    if cls is None:
        return "constrained decoding is off on this server (--grammar-backend none)"
    try:
        cls.check(key)
    except InvalidGrammar as e:
        return e.reason
    return None
