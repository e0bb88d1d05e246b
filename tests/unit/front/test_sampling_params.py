"""SamplingParams: defaults, type checks, the range table of specs/http.md, greedy detection."""

import math
import subprocess
import sys

import msgspec
import pytest

from cadence.errors import InvalidParameter
from cadence.front.sampling_checks import check_sampling_params, coerce_field, parse_sampling_params
from cadence.io_struct import SamplingParams


def check(d, vocab_size=None):
    params = parse_sampling_params(d)
    check_sampling_params(params, vocab_size)
    return params


def test_defaults_match_spec_table():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens) == (128, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.n == 1
    assert p.stop is p.stop_token_ids is p.logit_bias is None
    assert p.regex is p.json_schema is p.ebnf is p.seed is None
    assert (p.ignore_eos, p.skip_special_tokens) == (False, True)
    assert (p.spaces_between_special_tokens, p.no_stop_trim) == (True, False)
    check_sampling_params(p, vocab_size=10)  # the defaults themselves are valid


def test_from_dict_none_and_empty_give_defaults():
    assert parse_sampling_params(None) == SamplingParams()
    assert parse_sampling_params({}) == SamplingParams()


def test_none_value_means_default():
    p = check({"temperature": None, "max_new_tokens": None, "stop": None})
    assert p.temperature == 1.0 and p.max_new_tokens == 128 and p.stop is None


# (field, value): valid boundary values from the spec table.
VALID = [
    ("max_new_tokens", 0),
    ("max_new_tokens", 1),
    ("max_new_tokens", 100_000),
    ("min_new_tokens", 0),
    ("min_new_tokens", 128),  # == default max_new_tokens
    ("temperature", 0.0),
    ("temperature", 1e-7),
    ("temperature", 100.0),
    ("top_p", 1e-9),
    ("top_p", 1.0),
    ("top_k", -1),
    ("top_k", 1),
    ("top_k", 50),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.0),
    ("n", 1),
    ("n", 16),
    ("stop", "###"),
    ("stop", ["a", "bb"]),
    ("stop", []),
    ("stop_token_ids", [0, 99]),
    ("stop_token_ids", []),
    ("logit_bias", {"0": -100, "99": 5.5}),
    ("regex", "[a-z]+"),
    ("json_schema", '{"type": "object"}'),
    ("ebnf", 'root ::= "yes" | "no"'),
    ("ignore_eos", True),
    ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False),
    ("no_stop_trim", True),
    ("seed", 0),
    ("seed", -5),
    ("seed", 2**63 - 1),
]


@pytest.mark.parametrize("field,value", VALID)
def test_valid_boundary_values_pass(field, value):
    p = check({field: value}, vocab_size=100)
    assert getattr(p, field) is not None


# (field, value, text the message must contain): one value past each boundary.
INVALID_RANGE = [
    ("max_new_tokens", -1, ">= 0"),
    ("min_new_tokens", -1, ">= 0"),
    ("min_new_tokens", 129, "<= max_new_tokens (128)"),
    ("temperature", -0.01, ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.0001, "in (0, 1]"),
    ("top_p", -0.5, "in (0, 1]"),
    ("top_k", 0, "-1"),
    ("top_k", -2, "-1"),
    ("min_p", -0.01, "in [0, 1]"),
    ("min_p", 1.01, "in [0, 1]"),
    ("frequency_penalty", -2.01, "in [-2, 2]"),
    ("frequency_penalty", 2.01, "in [-2, 2]"),
    ("presence_penalty", -2.01, "in [-2, 2]"),
    ("presence_penalty", 2.01, "in [-2, 2]"),
    ("repetition_penalty", -0.01, "in [0, 2]"),
    ("repetition_penalty", 2.01, "in [0, 2]"),
    ("n", 0, ">= 1"),
    ("n", -3, ">= 1"),
    ("stop", "", "must not be empty"),
    ("stop", ["ok", ""], "stop[1] must not be empty"),
    ("stop_token_ids", [-1], "[0, 100)"),
    ("stop_token_ids", [5, 100], "[0, 100)"),
    ("logit_bias", {"100": 1.0}, "[0, 100)"),
    ("logit_bias", {"-1": 1.0}, "[0, 100)"),
    ("json_schema", "{not json", "JSON"),
]


@pytest.mark.parametrize("field,value,expected", INVALID_RANGE)
def test_out_of_range_raises_naming_field(field, value, expected):
    with pytest.raises(ValueError) as info:
        check({field: value}, vocab_size=100)
    message = str(info.value)
    assert message.startswith(field), message
    assert expected in message
    assert info.value.param == field
    assert isinstance(info.value, InvalidParameter)


def test_message_says_valid_range_and_value_got():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0$"):
        check({"top_p": 0})
    with pytest.raises(ValueError, match=r"^repetition_penalty must be in \[0, 2\].*got 2\.5$"):
        check({"repetition_penalty": 2.5})
    # Never rounded into looking valid.
    with pytest.raises(ValueError, match=r"got 2\.0000001$"):
        check({"presence_penalty": 2.0000001})


def test_min_new_tokens_checked_against_given_max():
    check({"max_new_tokens": 5, "min_new_tokens": 5})
    with pytest.raises(ValueError, match=r"^min_new_tokens .*max_new_tokens \(5\), got 6"):
        check({"max_new_tokens": 5, "min_new_tokens": 6})


def test_token_ids_only_bounded_below_without_vocab():
    assert check({"stop_token_ids": [10**9], "logit_bias": {"123456": 1}}).stop_token_ids == [10**9]
    with pytest.raises(ValueError, match="^stop_token_ids"):
        check({"stop_token_ids": [-1]})


# (field, value): wrong types, each must name the field.
INVALID_TYPE = [
    ("max_new_tokens", 1.5),
    ("max_new_tokens", "128"),
    ("max_new_tokens", True),
    ("max_new_tokens", 2**64),
    ("min_new_tokens", [1]),
    ("temperature", "0.7"),
    ("temperature", True),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", "1"),
    ("top_k", 2.5),
    ("top_k", False),
    ("min_p", {}),
    ("frequency_penalty", "0"),
    ("presence_penalty", [0.1]),
    ("repetition_penalty", True),
    ("n", "2"),
    ("n", 1.2),
    ("stop", 5),
    ("stop", ["a", 3]),
    ("stop", {"a": 1}),
    ("stop_token_ids", 5),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.5]),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {"5": "high"}),
    ("logit_bias", {"5": float("nan")}),
    ("regex", 5),
    ("json_schema", {"type": "object"}),
    ("ebnf", ["x"]),
    ("ignore_eos", "false"),
    ("ignore_eos", 0),
    ("skip_special_tokens", 1),
    ("spaces_between_special_tokens", "yes"),
    ("no_stop_trim", "true"),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
]


@pytest.mark.parametrize("field,value", INVALID_TYPE)
def test_wrong_type_raises_naming_field(field, value):
    with pytest.raises(ValueError) as info:
        parse_sampling_params({field: value})
    assert str(info.value).startswith(field), str(info.value)
    assert info.value.param == field


def test_integral_float_accepted_as_int():
    p = parse_sampling_params({"max_new_tokens": 16.0, "top_k": 5.0, "seed": 3.0})
    assert p.max_new_tokens == 16 and type(p.max_new_tokens) is int
    assert p.top_k == 5 and type(p.top_k) is int
    assert p.seed == 3 and type(p.seed) is int


def test_int_accepted_as_float():
    p = parse_sampling_params({"temperature": 1, "top_p": 1})
    assert type(p.temperature) is float and type(p.top_p) is float


def test_unknown_field_named_with_suggestion():
    with pytest.raises(ValueError) as info:
        parse_sampling_params({"temprature": 0.5})
    assert str(info.value).startswith("unknown sampling parameter 'temprature'")
    assert "'temperature'" in str(info.value)
    assert info.value.param == "temprature"


def test_unknown_field_with_none_value_still_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter 'logprobs'"):
        parse_sampling_params({"logprobs": None})


def test_non_dict_rejected():
    with pytest.raises(ValueError, match="^sampling_params must be an object") as info:
        parse_sampling_params([{"temperature": 0}])
    assert info.value.param == "sampling_params"


def test_stop_string_normalized_to_list():
    assert parse_sampling_params({"stop": "\n"}).stop == ["\n"]
    assert parse_sampling_params({"stop": ("a", "b")}).stop == ["a", "b"]


def test_logit_bias_keys_normalized_to_int():
    p = check({"logit_bias": {"5": 1, "7": -2.5}}, vocab_size=10)
    assert p.logit_bias == {5: 1.0, 7: -2.5}
    assert all(type(k) is int for k in p.logit_bias)


@pytest.mark.parametrize(
    "a,b", [("regex", "json_schema"), ("regex", "ebnf"), ("json_schema", "ebnf")]
)
def test_constraints_mutually_exclusive(a, b):
    values = {"regex": "x+", "json_schema": "{}", "ebnf": 'root ::= "x"'}
    with pytest.raises(ValueError) as info:
        check({a: values[a], b: values[b]})
    assert str(info.value).startswith(b)
    assert a in str(info.value) and "at most one" in str(info.value)


def test_verify_checks_directly_built_params():
    # The in-process API may build SamplingParams without from_dict.
    with pytest.raises(ValueError, match="^temperature must be a number"):
        check_sampling_params(SamplingParams(temperature="hot"))
    with pytest.raises(ValueError, match="^top_k must be"):
        check_sampling_params(SamplingParams(top_k=0))
    with pytest.raises(ValueError, match="^max_new_tokens must not be null"):
        check_sampling_params(SamplingParams(max_new_tokens=None))
    p = SamplingParams(stop="END", logit_bias={"3": 1})
    check_sampling_params(p, vocab_size=4)
    assert p.stop == ["END"] and p.logit_bias == {3: 1.0}


@pytest.mark.parametrize(
    "d,greedy",
    [
        ({}, False),
        ({"temperature": 0}, True),
        ({"temperature": 9e-7}, True),
        ({"temperature": 1e-6}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2, "temperature": 0.5}, False),
    ],
)
def test_is_greedy(d, greedy):
    assert check(d).is_greedy is greedy


def test_coerce_field_passes_none_and_rejects_unknown():
    assert coerce_field("seed", None) is None
    assert coerce_field("n", 3.0) == 3
    with pytest.raises(ValueError, match="unknown sampling parameter 'nn'"):
        coerce_field("nn", 1)


def test_msgpack_round_trip():
    p = check({"stop": ["x"], "logit_bias": {"5": 2}, "seed": 7, "temperature": 0.3}, 10)
    data = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(data, type=SamplingParams) == p


def test_every_field_has_a_docstring():
    source = open(sys.modules[SamplingParams.__module__].__file__).read()
    for name in SamplingParams.__struct_fields__:
        # A field line followed by its attribute docstring.
        assert f"    {name}: " in source
        after = source.split(f"    {name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), name


def test_no_heavy_imports():
    code = (
        "import sys, cadence.front.sampling_checks; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_nan_never_passes_a_range_check():
    # NaN compares false to everything; it must be caught as a type error, not slip through.
    for field in ("temperature", "top_p", "min_p", "repetition_penalty"):
        with pytest.raises(ValueError, match=f"^{field}"):
            check({field: math.nan})
