"""Tool-call parsers: whole texts become calls, and streams of any chunking add up to the
same calls (arguments as JSON text fragments, as OpenAI streams them)."""

from __future__ import annotations

import json

import pytest

from cadence.parsers import tool_call_parser
from cadence.parsers.tool_calls import (
    JsonArrayParser,
    NamedParser,
    ToolCallStream,
    finished_calls,
)

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, 2], "note": "a } and a ] in \\"text\\""}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
ARRAY = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


def stream(parser, text: str, step: int, max_calls=None):
    s = ToolCallStream(parser, max_calls)
    content, names, args = "", {}, {}
    for end in range(step, len(text) + step, step):
        c, deltas = s.update(text[:end], end >= len(text))
        content += c
        for d in deltas:
            if "id" in d:
                assert d["type"] == "function" and d["id"].startswith("call_")
                assert d["function"]["arguments"] == "" and d["index"] not in names
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return content, names, args


@pytest.mark.parametrize(
    "parser, text, content",
    [
        (tool_call_parser("hermes"), HERMES, "Let me check.\n"),
        (tool_call_parser("llama3"), LLAMA, ""),
        (JsonArrayParser(), ARRAY, ""),
    ],
)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streams_add_up_to_the_whole_answer(parser, text, content, step):
    got_content, names, args = stream(parser, text, step)
    calls = finished_calls(parser.extract(text, is_final=True))
    assert got_content == content
    assert [names[i] for i in sorted(names)] == [c.name for c in calls]
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.arguments) for c in calls]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments)["city"] == "Paris"


def test_text_without_calls_is_content_and_a_marker_start_is_held_back():
    parser = tool_call_parser("hermes")
    assert parser.extract("Hello <tool", is_final=False).content == "Hello "
    assert parser.extract("Hello <tool", is_final=True).content == "Hello <tool"
    assert parser.extract("a <b> c", is_final=False).content == "a <b> c"
    assert finished_calls(parser.extract("no calls here", True)) == []


def test_broken_or_unfinished_calls_are_not_calls():
    hermes = tool_call_parser("hermes")
    assert finished_calls(hermes.extract('<tool_call>\n{"name": "f", "argu', True)) == []
    assert finished_calls(hermes.extract("<tool_call>not json</tool_call>", True)) == []
    llama = tool_call_parser("llama3")
    assert llama.extract("The answer is 4.", True).content == "The answer is 4."
    only = finished_calls(llama.extract('{"name": "f", "parameters": {"x": 1}}', True))
    assert [(c.name, json.loads(c.arguments)) for c in only] == [("f", {"x": 1})]


def test_named_choice_reads_the_arguments_alone():
    text = '{"city": "Paris", "unit": "celsius"}'
    content, names, args = stream(NamedParser("get_weather"), text, 2)
    assert (
        content == "" and names == {0: "get_weather"} and json.loads(args[0])["unit"] == "celsius"
    )


def test_max_calls_drops_later_calls():
    _, names, _ = stream(JsonArrayParser(), ARRAY, 5, max_calls=1)
    assert names == {0: "get_weather"}
