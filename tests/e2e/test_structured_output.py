"""Structured output, tool calling and reasoning on a launched server, through real clients
(the openai SDK, httpx on the native routes, the generated gRPC stubs), with the real model.

The default model is tiny: left alone it rarely writes valid JSON and never calls tools
well, which is the point of the first test (the constraint does the work). Its schemas
bound strings and numbers, as a tiny model under greedy decoding otherwise repeats a digit
or a word until max_tokens."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from e2e_server import is_idle, tried
from grpc_support import stub
from pydantic import BaseModel, Field

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAMES = ("person", "city", "book", "order", "device", "planet", "recipe", "car", "movie", "song")
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
# Sums of up to four terms; a term is a number below 100 or a bracketed sum of two digits.
ARITHMETIC = (
    'root ::= term (("+" | "-") term){0,3}\nterm ::= [1-9] [0-9]? | "(" [1-9] "+" [1-9] ")"'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def schemas() -> list[dict]:
    """50 schemas: nested objects, arrays, enums, bounded numbers, required fields."""
    text = {"type": "string", "maxLength": 24}
    out = []
    for name in NAMES:
        out += [
            {
                "type": "object",
                "properties": {
                    "name": text,
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "id"],
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": [name, "other"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 10},
                    "tags": {"type": "array", "items": text, "maxItems": 3},
                },
                "required": ["kind", "score", "tags"],
            },
            {
                "type": "object",
                "properties": {
                    name: {
                        "type": "object",
                        "properties": {
                            "title": text,
                            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                        },
                        "required": ["title", "year"],
                    },
                    "valid": {"type": "boolean"},
                },
                "required": [name, "valid"],
            },
            {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "label": text,
                                "count": {"type": "integer", "minimum": 1, "maximum": 99},
                            },
                            "required": ["label", "count"],
                        },
                        "minItems": 1,
                        "maxItems": 3,
                    }
                },
                "required": ["items"],
            },
            {
                "type": "object",
                "properties": {
                    "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["answer", "confidence"],
            },
        ]
    return out


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture
def sclient(structured_server):
    with openai.OpenAI(
        base_url=structured_server.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c
    assert is_idle(structured_server.wait_idle()), "a request outlived its test"


async def test_fifty_schemas_validate_and_unconstrained_mostly_do_not(structured_server):
    async def ask(aclient, i: int, schema: dict | None) -> str:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
        }
        r = await aclient.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Describe a {NAMES[i // 5]} as JSON."}],
            temperature=0,
            max_tokens=120,  # the same for both: unconstrained answers are not cut shorter
            **({"response_format": fmt} if schema else {}),
        )
        return r.choices[0].message.content

    cases = schemas()
    async with openai.AsyncOpenAI(
        base_url=structured_server.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as aclient:
        constrained = await asyncio.gather(*(ask(aclient, i, s) for i, s in enumerate(cases)))
        # Unconstrained, ten of them (each object name once, the kinds of schema in turn):
        # what the constraint changed.
        sample = [5 * k + k % 5 for k in range(len(cases) // 5)]
        free = await asyncio.gather(*(ask(aclient, i, None) for i in sample))
    bad = [(s, t) for s, t in zip(cases, constrained) if not is_valid(t, s)]
    assert not bad, f"{len(bad)} answers do not validate, e.g. {bad[0][1]!r}"
    assert sum(is_valid(t, cases[i]) for i, t in zip(sample, free)) <= len(free) // 5, free[:3]
    assert is_idle(structured_server.wait_idle())


def test_regex_and_ebnf_outputs_match_their_grammar(structured_server):
    with structured_server.client() as http:
        prompts = ["Call me at", "My phone number:", "Dial"]
        out = http.post(
            "/generate",
            json={"text": prompts, "sampling_params": {"regex": PHONE, "max_new_tokens": 30}},
        ).json()
        assert all(re.fullmatch(PHONE, o["text"]) for o in out), [o["text"] for o in out]
        free = http.post(
            "/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 20}}
        )
        assert not any(re.fullmatch(PHONE, o["text"]) for o in free.json())
        sums = ["Compute:", "An arithmetic expression:", "2+2 is an expression; here is another:"]
        params = {"ebnf": ARITHMETIC, "max_new_tokens": 40, "temperature": 0.8, "seed": 7}
        out = http.post("/generate", json={"text": sums, "sampling_params": params}).json()
        for o in out:  # parses with the grammar: digits, + and -, parentheses, nothing else
            tree = ast.parse(o["text"], mode="eval")
            kinds = {type(n).__name__ for n in ast.walk(tree)}
            assert kinds <= {"Expression", "BinOp", "Add", "Sub", "Constant"}, o["text"]
            assert o["meta_info"]["finish_reason"]["type"] == "stop"


def test_n_streaming_logprobs_and_stop_strings_with_a_constraint(sclient, structured_server):
    with structured_server.client() as http:
        r = http.post(
            "/generate",
            json={
                "text": "Pick one:",
                "sampling_params": {
                    "regex": "(red|green|blue)-[0-9]{2}",
                    "n": 4,
                    "temperature": 1.0,
                },
                "return_logprob": True,
                "top_logprobs_num": 3,
            },
        ).json()
        assert len(r) == 4 and all(re.fullmatch("(red|green|blue)-[0-9]{2}", o["text"]) for o in r)
        for o in r:
            logprobs = o["meta_info"]["output_token_logprobs"]
            assert len(logprobs) == o["meta_info"]["completion_tokens"]
            assert all(-9999.0 <= lp <= 0 for lp, _, _ in logprobs)
        stopped = http.post(
            "/generate",
            json={
                "text": "Code:",
                "sampling_params": {"regex": "AB-CD-EF", "stop": ["-EF"], "temperature": 0},
            },
        ).json()
        assert (
            stopped["text"] == "AB-CD" and stopped["meta_info"]["finish_reason"]["type"] == "stop"
        )
    stream = sclient.completions.create(
        model="m",
        prompt="The date today is",
        max_tokens=20,
        stream=True,
        extra_body={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", text), text


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"json_schema": '{"type": "objekt"}'}, "json_schema", 'Unsupported type "objekt"'),
        ({"regex": "(a|b"}, "regex", "parenthesis is not closed"),
        ({"ebnf": 'start ::= "a"'}, "ebnf", '"root" is not found'),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 3, "maximum": 1},
                    },
                }
            },
            "response_format",
            "minimum greater than maximum",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(sclient, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        sclient.chat.completions.create(
            model="m", messages=ASK_WEATHER, max_tokens=5, extra_body=body
        )
    assert e.value.status_code == 400 and e.value.param == param and words in e.value.message


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population: int = Field(ge=0, le=50_000_000)


def test_openai_parse_with_a_pydantic_model(sclient):
    r = sclient.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"


def test_required_and_named_tool_calls_then_a_round_trip(sclient):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = sclient.chat.completions.create(
            model="m",
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = sclient.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None  # auto: the model answered in text


def test_streamed_tool_calls_reassemble_in_the_client(sclient):
    tool = openai.pydantic_function_tool(City, name="record_city")

    def streamed() -> tuple[list, object]:
        with sclient.chat.completions.stream(
            model="m",
            messages=[{"role": "user", "content": "Record Paris."}],
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
        ) as stream:
            fragments = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
            return fragments, stream.get_final_completion()

    fragments, final = tried(streamed, lambda got: len(got[0]) > 3)
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, City) and len(fragments) > 3
    assert final.choices[0].finish_reason == "tool_calls"


def test_reasoning_content_is_split_out(sclient):
    think = {"regex": "<think>[a-z ]{3,20}</think>(Hello|Hi)!"}
    r = sclient.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hi"}],
        temperature=0,
        max_tokens=40,
        extra_body=think,
    )
    message = r.choices[0].message
    assert message.content in ("Hello!", "Hi!") and message.reasoning_content
    reasoning = content = ""
    for chunk in sclient.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hi"}],
        temperature=0,
        max_tokens=40,
        stream=True,
        extra_body=think,
    ):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_grpc_text_generate_and_chat_complete(structured_server):
    rpc = stub(structured_server)
    schema = json.dumps(schemas()[0])
    cases = [
        ({"json_schema": schema}, lambda t: is_valid(t, schemas()[0])),
        ({"regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
        ({"ebnf": ARITHMETIC}, lambda t: ast.parse(t, mode="eval")),
    ]
    for constraint, check in cases:
        params = pb.SamplingParams(max_new_tokens=60, temperature=0, **constraint)
        (done,) = rpc.TextGenerate(pb.TextGenerateRequest(text="Answer:", sampling_params=params))
        assert done.finished and check(done.text), (constraint, done.text)
    with pytest.raises(grpc.RpcError) as e:
        list(
            rpc.TextGenerate(
                pb.TextGenerateRequest(text="x", sampling_params=pb.SamplingParams(regex="(a"))
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
    body = {
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    (chunk,) = rpc.ChatComplete(pb.OpenAIRequest(json_body=json.dumps(body).encode()))
    answer = json.loads(chunk.json_chunk)["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    assert json.loads(answer["message"]["tool_calls"][0]["function"]["arguments"])["unit"] in (
        "celsius",
        "fahrenheit",
    )
    chunks = list(
        rpc.ChatComplete(pb.OpenAIRequest(json_body=json.dumps({**body, "stream": True}).encode()))
    )
    deltas = [
        c
        for ch in chunks
        for c in json.loads(ch.json_chunk)["choices"]
        if c["delta"].get("tool_calls")
    ]
    arguments = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in deltas)
    assert json.loads(arguments) == json.loads(
        answer["message"]["tool_calls"][0]["function"]["arguments"]
    )
