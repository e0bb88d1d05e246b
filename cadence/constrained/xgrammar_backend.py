"""The xgrammar engine behind `GrammarBackend` (the default: see docs/structured_output.md
for how it was chosen).

JSON schemas are compiled with the whitespace of `json.dumps` (", " and ": ", no newlines)
unless the backend is built with `any_whitespace`: a small model left free to emit
whitespace tends to emit nothing else. `ebnf` is xgrammar's EBNF (GBNF: `root ::= ...`), the
dialect SGLang's `ebnf` field speaks.
"""

from __future__ import annotations

import functools
import re

import xgrammar

from cadence.constrained.base import Grammar, GrammarBackend, GrammarKey, InvalidGrammar

# "[04:29:00] /project/cpp/regex_converter.cc:83: " and "Check failed: (x) is false: "
_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: |Check failed: \(.*?\) is false: ")
MAX_REASON_CHARS = 400


def _reason(error: Exception) -> str:
    text = _NOISE.sub("", str(error)).strip()
    text = text.split("The JSON string is:")[0].strip()  # never echo the whole schema
    return text[:MAX_REASON_CHARS] or type(error).__name__


@functools.cache
def _byte_compiler() -> xgrammar.GrammarCompiler:
    """A compiler over a vocabulary of the 256 single bytes and one stop token: enough to ask
    what a grammar allows first, with no model's tokenizer at hand."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgrammar.TokenizerInfo(vocab, vocab_size=len(vocab), stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _admits_output(grammar: xgrammar.Grammar) -> bool:
    """False when `grammar` allows no first byte and cannot end either: every request under
    it would dead-end at its first token."""
    matcher = xgrammar.GrammarMatcher(_byte_compiler().compile_grammar(grammar))
    bitmask = xgrammar.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


class XGrammarGrammar(Grammar):
    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def fill_mask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    supports_rollback = True  # matchers are made with no bound on rollback

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def allows_nothing(self) -> bool:
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        any_whitespace: bool = False,
        num_threads: int = 1,
    ):
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        # Our own cache (GrammarQueue) keeps compiled grammars; xgrammar's would hold a
        # second copy of each.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace

    @classmethod
    def check(cls, key: GrammarKey) -> None:
        try:
            if key.field == "json_schema":
                grammar = xgrammar.Grammar.from_json_schema(key.text)
            elif key.field == "regex":
                grammar = xgrammar.Grammar.from_regex(key.text)
            else:
                grammar = xgrammar.Grammar.from_ebnf(key.text)
            admits_output = _admits_output(grammar)
        except Exception as e:  # the engine raises RuntimeError, and ValueError for some input
            raise InvalidGrammar(key.field, _reason(e)) from None
        if not admits_output:
            raise InvalidGrammar(
                key.field,
                "it admits no output at all (a rule that only refers to itself, such as a "
                'schema {"$ref": "#"})',
            )

    def compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        try:
            if key.field == "json_schema":
                return self.compiler.compile_json_schema(
                    key.text, any_whitespace=self.any_whitespace
                )
            if key.field == "regex":
                return self.compiler.compile_regex(key.text)
            return self.compiler.compile_grammar(key.text)
        except Exception as e:
            raise InvalidGrammar(key.field, _reason(e)) from None

    def new_grammar(self, compiled: xgrammar.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(xgrammar.GrammarMatcher(compiled), self.vocab_size)

    def compiled_size(self, compiled: xgrammar.CompiledGrammar) -> int:
        return int(getattr(compiled, "memory_size_bytes", 0))
