"""openai_protocol: request checks and their error params, the mapping to native sampling
parameters, chat messages and template options, and the logprob and usage shapes."""

from __future__ import annotations

import pytest

from cadence.errors import InvalidParameter
from cadence.serving import openai_protocol as proto
from cadence.serving.openai_protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(**fields) -> ChatCompletionRequest:
    return proto.parse_request(ChatCompletionRequest, {"messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return proto.parse_request(CompletionRequest, {"prompt": "Hi", **fields})


def param_of(cls, body) -> str | None:
    with pytest.raises(InvalidParameter) as info:
        proto.parse_request(cls, body)
    return info.value.param


def test_parse_accepts_json_bytes_and_keeps_every_field():
    req = proto.parse_request(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": "Hi"}], '
        b'"temperature": 0, "n": 2, "stop": "x", "seed": 7, '
        b'"logprobs": true, "top_logprobs": 3, "top_k": 5}',
    )
    assert (
        req.temperature,
        req.n,
        req.stop,
        req.seed,
        req.logprobs,
        req.top_logprobs,
        req.top_k,
    ) == (0.0, 2, "x", 7, True, 3, 5)
    assert not req.is_stream and not req.include_usage


def test_top_logprobs_zero_needs_no_logprobs():
    assert chat(top_logprobs=0).top_logprobs == 0


def test_nulls_mean_not_given():
    req = chat(n=None, temperature=None, stream=None, max_tokens=None)
    assert proto.sampling_params(req, 10) == {"max_new_tokens": 10}


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (ChatCompletionRequest, {"messages": USER, "temperature": "hot"}, "temperature"),
        (ChatCompletionRequest, {"messages": USER, "temperature": 2.5}, "temperature"),
        (ChatCompletionRequest, {"messages": USER, "temperature": -0.1}, "temperature"),
        (ChatCompletionRequest, {"messages": USER, "n": 1.5}, "n"),
        (
            ChatCompletionRequest,
            {"messages": USER, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options",
        ),
        (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (
            ChatCompletionRequest,
            {"messages": USER, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (ChatCompletionRequest, {"messages": USER, "logit_bias": {"5": 101}}, "logit_bias"),
        (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
        (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "custom"}]}, "tools"),
        (ChatCompletionRequest, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
        (
            ChatCompletionRequest,
            {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function"}},
            "tool_choice",
        ),
        (
            ChatCompletionRequest,
            {
                "messages": USER,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            "tool_choice",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "tools": [TOOL], "tool_choice": "required", "regex": "a"},
            "tool_choice",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "tools": [TOOL], "parallel_tool_calls": "yes"},
            "parallel_tool_calls",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        (
            ChatCompletionRequest,
            {
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": "yes"},
                },
            },
            "response_format",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            ChatCompletionRequest,
            {"messages": USER, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
        ),
        (ChatCompletionRequest, {}, "messages"),
        (ChatCompletionRequest, {"messages": "Hi"}, "messages"),
        (CompletionRequest, {"prompt": "Hi", "logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        (CompletionRequest, {"prompt": "Hi", "suffix": "!"}, "suffix"),
        (CompletionRequest, {"prompt": "Hi", "best_of": 3}, "best_of"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
        (CompletionRequest, {"prompt": []}, "prompt"),
        (CompletionRequest, {"prompt": None}, "prompt"),
    ],
)
def test_bad_requests_name_the_openai_field(cls, body, param):
    assert param_of(cls, body) == param


def test_unknown_fields_are_accepted_and_ignored():
    """As OpenAI, SGLang and vLLM: what the server does not implement is ignored, including
    the SDK's newer fields and the ones it sends as null."""
    extras = {
        "foo": 1,
        "reasoning_effort": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "verbosity": "low",
        "modalities": ["text"],
        "functions": None,
        "function_call": None,
        "prediction": None,
        "audio": None,
    }
    req = proto.parse_request(ChatCompletionRequest, {"messages": USER, "temperature": 0, **extras})
    assert req.temperature == 0.0
    assert proto.parse_request(CompletionRequest, {"prompt": "Hi", "foo": [1]}).prompt == "Hi"


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'"text"'])
def test_body_must_be_a_json_object(body):
    assert param_of(ChatCompletionRequest, body) is None


def test_sampling_params_map_openai_names_to_native_ones():
    req = chat(
        max_tokens=5,
        max_completion_tokens=9,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        n=3,
        stop=["\n"],
        seed=11,
        logit_bias={"42": -100},
        ignore_eos=True,
        stop_token_ids=[7],
        skip_special_tokens=False,
        no_stop_trim=True,
        regex="a+",
    )
    field, value = proto.requested_max_tokens(req)
    assert (field, value) == ("max_completion_tokens", 9)
    assert proto.sampling_params(req, value) == {
        "max_new_tokens": 9,
        "min_new_tokens": 2,
        "n": 3,
        "stop": ["\n"],
        "seed": 11,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100.0},
        "ignore_eos": True,
        "stop_token_ids": [7],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "regex": "a+",
    }
    assert proto.native_names(req)["max_new_tokens"] == "max_completion_tokens"
    assert proto.native_names(chat(max_tokens=5))["max_new_tokens"] == "max_tokens"


def test_response_format_becomes_a_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert (
        proto.sampling_params(req, 4)["json_schema"]
        == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    )
    assert proto.native_names(req)["json_schema"] == "response_format"
    assert (
        proto.sampling_params(chat(response_format={"type": "json_object"}), 4)["json_schema"]
        == '{"type":"object"}'
    )
    assert "json_schema" not in proto.sampling_params(chat(response_format={"type": "text"}), 4)
    assert (
        proto.sampling_params(completion(json_schema={"type": "string"}), 4)["json_schema"]
        == '{"type":"string"}'
    )


@pytest.mark.parametrize(
    "prompt, fields",
    [
        ("Hi", {"text": "Hi"}),
        (["a", "b"], {"text": ["a", "b"]}),
        ([1, 2, 3], {"input_ids": [1, 2, 3]}),
        ([[1], [2, 3]], {"input_ids": [[1], [2, 3]]}),
    ],
)
def test_prompt_forms(prompt, fields):
    assert proto.prompt_fields(prompt) == fields


def test_chat_messages_flatten_text_parts_and_map_developer_to_system():
    messages = proto.chat_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "u",
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "u"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "must not be empty"),
        (["Hi"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user"}], r"messages\[0\].content is required"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "does not accept image_url",
        ),
        ([{"role": "user", "content": 5}], "must be a string or a list"),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(InvalidParameter, match=match) as info:
        proto.chat_messages(messages)
    assert info.value.param == "messages"


def test_template_options():
    assert proto.template_options(chat()) == {
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
    assert proto.template_options(
        chat(add_generation_prompt=False, chat_template_kwargs={"x": 1})
    ) == {"x": 1, "add_generation_prompt": False, "continue_final_message": False}
    # chat_template_kwargs may carry the switches too (as some clients send them), and
    # continuing the final message never opens a new turn.
    assert proto.template_options(chat(chat_template_kwargs={"continue_final_message": True})) == {
        "add_generation_prompt": False,
        "continue_final_message": True,
    }


def test_finish_reasons():
    assert proto.finish_reason(None) is None
    assert proto.finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert proto.finish_reason({"type": "length", "length": 4}) == "length"
    assert proto.finish_reason({"type": "abort", "message": "x"}) == "abort"
    assert proto.matched_stop({"type": "stop", "matched": "\n"}) == "\n"
    assert proto.matched_stop({"type": "length", "length": 4}) is None


def test_usage_totals():
    assert proto.usage(5, 3, 2) == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_chat_logprobs_shape():
    out = proto.chat_logprobs(
        [[-0.1, 7, "é"], [-0.2, 8, "x"]], [[[-0.1, 7, "é"], [-2.0, 9, "y"]], []]
    )
    assert out["content"][0] == {
        "token": "é",
        "logprob": -0.1,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "é", "logprob": -0.1, "bytes": [195, 169]},
            {"token": "y", "logprob": -2.0, "bytes": [121]},
        ],
    }
    assert out["content"][1]["top_logprobs"] == []


def test_completion_logprobs_offsets_index_the_text():
    text = "ab, c"
    out = proto.completion_logprobs(
        [[None, 1, "ab"], [-0.5, 2, ","], [-0.7, 3, " c"]],
        [[], [[-0.5, 2, ","], [-1.0, 4, "."]], [[-0.7, 3, " c"]]],
        1,
        0,
    )
    assert out["tokens"] == ["ab", ",", " c"]
    assert out["token_logprobs"] == [None, -0.5, -0.7]
    assert out["top_logprobs"] == [None, {",": -0.5}, {" c": -0.7}]
    assert [text[o : o + len(t)] for o, t in zip(out["text_offset"], out["tokens"])] == out[
        "tokens"
    ]
    assert proto.completion_logprobs([[-0.5, 2, ","]], None, 0, 3)["top_logprobs"] is None
