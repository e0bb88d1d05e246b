"""What constrained decoding asks of a grammar engine, whichever engine it is.

A request carries at most one constraint (`json_schema`, `regex` or `ebnf` in its sampling
parameters). Its life has three stages, each in the process that owns it:

- the front checks it (`GrammarBackend.check`, no tokenizer needed) and refuses a bad one
  with a 400 naming the field, before the scheduler sees the request;
- the scheduler compiles it against the model's vocabulary (`GrammarBackend.compile`, slow,
  on a worker thread, cached per distinct key) and gives the request its own `Grammar`;
- every step, the sampler asks the request's `Grammar` which tokens may come next
  (`fill_mask`), and the scheduler advances it with the token chosen (`accept`).

Token masks are bitmasks in one layout, whatever the engine: an int32 tensor of shape
[rows, words_per_row(vocab_size)] on the host, where bit b (least significant first) of word
w allows token 32 * w + b. Tokens beyond the engine's vocabulary are never allowed.

Imports nothing heavy: the front and the scheduler import this module on their own; an
engine's own module is imported only when a backend of that engine is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# The sampling fields that carry a constraint, in the order the edge reports them.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# Longest constraint text accepted at the edge: a grammar is compiled and kept in memory.
MAX_GRAMMAR_CHARS = 128 * 1024


@dataclass(frozen=True)
class GrammarKey:
    """One distinct constraint: which field it came from and its text. Equal keys share one
    compiled grammar."""

    field: str  # "json_schema" | "regex" | "ebnf"
    text: str


def grammar_key(params: Any) -> GrammarKey | None:
    """The constraint of a request's SamplingParams, or None when it has none."""
    for name in GRAMMAR_FIELDS:
        text = getattr(params, name, None)
        if text:
            return GrammarKey(name, text)
    return None


class InvalidGrammar(ValueError):
    """The engine refused a constraint; `field` is the sampling field, `reason` the engine's
    own words (without its source-file prefixes)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def words_per_row(vocab_size: int) -> int:
    """int32 words of one token bitmask row."""
    return (vocab_size + 31) // 32


class Grammar(ABC):
    """One request's position in its compiled grammar.

    Owned by one request and touched by the scheduler's thread only: `fill_mask` reads the
    state (it may be called any number of times between two `accept`s), `accept` advances it
    by exactly the token the request produced. After `is_terminated()` is true, neither may
    be called again.
    """

    @abstractmethod
    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Writes the tokens allowed next into row `row` of `bitmask` (int32, the layout of
        this module's docstring); other rows are left alone."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advances by `token_id`; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and accepted its end (the model's end-of-sequence token):
        the request must end."""

    def allows_nothing(self) -> bool:
        """No token may come next: the constraint has reached a dead end (a schema with no
        finite value, e.g. a $ref that only refers to itself). An engine that cannot tell
        answers False."""
        return False

    supports_rollback: bool = False
    """`rollback` works: speculative decoding may then draft for the request (a draft is cut
    at its first token the grammar forbids, and a verify step advances the grammar through
    the tokens it accepts, then steps back)."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class GrammarBackend(ABC):
    """A grammar engine bound to one model's vocabulary.

    `check` is a classmethod and needs no vocabulary: the front calls it. `compile` may run
    on any thread, several at once; `new_grammar` and everything a `Grammar` does run on the
    scheduler's thread.
    """

    name: str

    @classmethod
    @abstractmethod
    def check(cls, key: GrammarKey) -> None:
        """Raises InvalidGrammar when the engine cannot serve `key`, or when `key` admits no
        output at all. Cheap (no model vocabulary)."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """The compiled form of `key` (opaque; shared by every request with that key).
        Raises InvalidGrammar for a constraint the engine refuses."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> Grammar:
        """A fresh `Grammar` at the start of `compiled`."""

    def compiled_size(self, compiled: Any) -> int:
        """Bytes `compiled` holds, for the cache's budget."""
        return 0
