"""The edge's bounds on client JSON: nesting depth (measured without recursion, strings
skipped) and integers outside int64 (named by their path), as `decode_json` applies them."""

from __future__ import annotations

import pytest

from cadence.errors import InvalidParameter
from cadence.json_limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    IntegerTooLarge,
    TooDeep,
    check_depth,
    check_integers,
)
from cadence.serving.errors import decode_json, loads_bounded


def nested(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


@pytest.mark.parametrize("depth", [0, 1, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_depths_up_to_the_limit_pass(depth):
    check_depth(nested(depth))
    check_depth('{"a": ' + nested(depth - 1 if depth else 0) + "}")


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_deeper_texts_are_refused_without_recursion(depth):
    with pytest.raises(TooDeep):
        check_depth(nested(depth))
    with pytest.raises(TooDeep):
        check_depth('{"a": ' + '{"b": ' * depth + "1" + "}" * depth + "}")


def test_brackets_inside_strings_do_not_count():
    text = '{"prompt": "' + "[" * 10_000 + '\\"]]' + '", "x": [[1]]}'
    check_depth(text)
    check_depth(text.encode())


def test_many_brackets_side_by_side_are_not_depth():
    check_depth("[" + ",".join(["[1]"] * 100_000) + "]")


def test_the_top_level_key_of_a_too_deep_value_is_named():
    text = '{"a": 1, "b": "s", "messages": [{"role": "user"}], "x": ' + nested(200) + "}"
    with pytest.raises(TooDeep) as e:
        check_depth(text)
    assert e.value.key == "x"
    with pytest.raises(TooDeep) as e:
        check_depth(nested(200))
    assert e.value.key is None


def test_decode_json_answers_400s_naming_the_field():
    with pytest.raises(InvalidParameter) as e:
        decode_json(('{"text": "hi", "x": ' + nested(1000) + "}").encode())
    assert e.value.param == "x" and "nested too deep" in str(e.value)
    with pytest.raises(InvalidParameter) as e:
        decode_json(b'{"sampling_params": {"seed": 100000000000000000000000}}')
    assert e.value.param == "seed" and "sampling_params.seed" in str(e.value)
    with pytest.raises(InvalidParameter) as e:
        decode_json(b'{"input_ids": [1, 2, -100000000000000000000000]}')
    assert e.value.param == "input_ids" and "input_ids[2]" in str(e.value)
    assert decode_json(b'{"x": "100000000000000000000000"}') == {"x": "100000000000000000000000"}


@pytest.mark.parametrize("value", [INT64_MIN, INT64_MAX, 0, -1])
def test_int64_itself_is_accepted(value):
    text = f'{{"v": [{value}]}}'
    check_integers(text, {"v": [value]})


@pytest.mark.parametrize("value", [INT64_MIN - 1, INT64_MAX + 1, 2**64, 10**40])
def test_integers_past_int64_are_refused(value):
    with pytest.raises(IntegerTooLarge) as e:
        check_integers(str(value), {"a": {"b": [0, value]}})
    assert e.value.path == "a.b[1]" and e.value.key == "b"


def test_loads_bounded_names_the_field():
    with pytest.raises(InvalidParameter) as e:
        loads_bounded(nested(500), "arguments")
    assert e.value.param == "arguments" and "nested too deep" in str(e.value)
    with pytest.raises(InvalidParameter) as e:
        loads_bounded("{not json", "arguments")
    assert "not valid JSON" in str(e.value)
    assert loads_bounded('{"a": [1]}', "arguments") == {"a": [1]}
