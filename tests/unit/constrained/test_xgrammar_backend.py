"""The xgrammar engine behind GrammarBackend, on a tiny character-level vocabulary: checks
at the edge name the field and the engine's reason, and a compiled grammar's masks allow
exactly what the constraint allows, end included."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

from cadence.constrained import (  # noqa: E402
    GrammarKey,
    InvalidGrammar,
    check_grammar,
    create_backend,
    grammar_key,
    words_per_row,
)
from cadence.io_struct import SamplingParams  # noqa: E402

EOS = 0
WORDS = ['{"', '":', '", "', '"}', "yes", "no", "name", "12"]


@pytest.fixture(scope="module")
def vocab():
    """A WordLevel tokenizer: every printable character, a few words, <eos> at 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {"<eos>": EOS}
    for piece in list(string.printable[:95]) + WORDS:
        ids.setdefault(piece, len(ids))
    tok = Tokenizer(models.WordLevel(ids, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"), ids


@pytest.fixture(scope="module")
def backend(vocab):
    return create_backend("xgrammar", vocab[0], 128, [EOS])


def allowed(grammar, ids) -> set[str]:
    mask = torch.zeros(1, words_per_row(128), dtype=torch.int32)
    grammar.fill_mask(mask, 0)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:128]
    names = {v: k for k, v in ids.items()}
    return {names[i] for i in range(128) if bits[i] and i in names}


def feed(grammar, ids, text: str) -> None:
    for ch in text:
        assert grammar.accept(ids[ch]), ch


def test_grammar_key_takes_the_one_constraint():
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(regex="a+")) == GrammarKey("regex", "a+")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')).field == "ebnf"


@pytest.mark.parametrize(
    "field, text, words",
    [
        ("json_schema", '{"type": "objekt"}', 'Unsupported type "objekt"'),
        ("json_schema", "[1, 2]", "Schema should be an object or bool"),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum greater"),
        ("regex", "(a|b", "parenthesis is not closed"),
        ("regex", "(?<=a)b", "Lookbehind is not supported"),
        ("ebnf", 'start ::= "a"', 'root rule with name "root" is not found'),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ],
)
def test_bad_constraints_name_the_field_and_the_reason(field, text, words):
    with pytest.raises(InvalidGrammar) as e:
        check_grammar("xgrammar", GrammarKey(field, text))
    assert e.value.field == field and words in e.value.reason
    assert "/project/" not in e.value.reason and "Check failed" not in e.value.reason


def test_too_long_and_switched_off_are_refused():
    with pytest.raises(InvalidGrammar, match="characters"):
        check_grammar("xgrammar", GrammarKey("regex", "a" * 200_000))
    with pytest.raises(InvalidGrammar, match="grammar-backend none"):
        check_grammar("none", GrammarKey("regex", "a"))


def test_regex_masks_then_ends_with_eos(backend, vocab):
    _, ids = vocab
    grammar = backend.new_grammar(backend.compile(GrammarKey("regex", "(yes|no)!")))
    assert allowed(grammar, ids) == {"y", "n", "yes", "no"}
    assert not grammar.accept(ids["x"])  # refused, state unchanged
    assert grammar.accept(ids["yes"])
    assert allowed(grammar, ids) == {"!"}
    assert grammar.accept(ids["!"]) and not grammar.is_terminated()
    assert allowed(grammar, ids) == {"<eos>"}  # complete: only the end may follow
    assert grammar.accept(EOS) and grammar.is_terminated()


def test_json_schema_is_compact_and_follows_the_schema(backend, vocab):
    _, ids = vocab
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = backend.new_grammar(backend.compile(GrammarKey("json_schema", json.dumps(schema))))
    feed(grammar, ids, '{"a": 1')
    assert "2" in allowed(grammar, ids) and "}" in allowed(grammar, ids)
    assert "\n" not in allowed(grammar, ids)  # no free whitespace by default
    feed(grammar, ids, "}")
    assert allowed(grammar, ids) == {"<eos>"}


def test_ebnf(backend, vocab):
    _, ids = vocab
    key = GrammarKey("ebnf", 'root ::= "a" ("b" | "c")+')
    grammar = backend.new_grammar(backend.compile(key))
    assert allowed(grammar, ids) == {"a"}
    feed(grammar, ids, "ab")
    assert allowed(grammar, ids) == {"b", "c", "<eos>"}


@pytest.mark.parametrize(
    "key",
    [
        GrammarKey("json_schema", json.dumps({"$ref": "#"})),
        GrammarKey("ebnf", "root ::= root"),
    ],
)
def test_a_constraint_with_no_output_at_all_is_refused_at_the_edge(key):
    with pytest.raises(InvalidGrammar) as e:
        check_grammar("xgrammar", key)
    assert e.value.field == key.field and "admits no output" in e.value.reason


def test_a_recursive_schema_with_a_finite_value_is_served():
    finite = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    }
    check_grammar("xgrammar", GrammarKey("json_schema", json.dumps(finite)))


def test_a_grammar_that_dead_ends_midway_says_it_allows_nothing(backend, vocab):
    _, ids = vocab
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "required": ["a"],
        "$defs": {"x": {"$ref": "#/$defs/x"}},
    }
    key = GrammarKey("json_schema", json.dumps(schema))
    check_grammar("xgrammar", key)  # its start allows `{`: the edge cannot see the dead end
    grammar = backend.new_grammar(backend.compile(key))
    assert not grammar.allows_nothing()
    for piece in ['{"', "a", '":', " "]:
        assert grammar.accept(ids[piece]), piece
    assert grammar.allows_nothing()
