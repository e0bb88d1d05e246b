"""Poison requests on every JSON route, over both protocols: JSON nested far deeper than any
decoder can recurse, integers past every machine width, and constraints that admit no output
(a schema whose `$ref` refers only to itself, found at the edge or after a few tokens).

Each must be the client's own 4xx naming what to change, never a 5xx (which a router would
retry and hold against the server), and the server serves normally right after.
The JSON routes are read from the server's own OpenAPI document, so a route added later is
covered without touching this file.
"""

from __future__ import annotations

import functools
import json

import grpc
import httpx
import pytest
from e2e_server import is_idle
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb
from cadence.json_limits import MAX_JSON_DEPTH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEEP = 1000  # levels: far past the interpreter's stack, 2 KB on the wire
HUGE = 10**23  # past uint64
CHAT = [{"role": "user", "content": "hi"}]
# A body each route accepts, so that a poisoned field is what the server has to judge.
VALID_BODIES: dict[str, dict] = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/invocations": {"messages": CHAT, "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/v1/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/open_session": {"capacity_of_str_len": 10},
    "/start_profile": {"num_steps": 1},
}
# A constraint with no finite value: refused at the edge.
SELF_REF = {"$ref": "#"}
# ... and one that dead-ends only after `{"a": ` (its $defs entry refers to itself).
LATE_DEAD_END = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/x"}},
    "required": ["a"],
    "$defs": {"x": {"$ref": "#/$defs/x"}},
}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_schema(levels: int) -> dict:
    """An object schema `levels` objects deep (two JSON levels each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@functools.cache
def openapi_document(url: str) -> dict:
    return httpx.get(url + "/openapi.json", timeout=30).json()


@pytest.fixture
def json_routes(server) -> list[str]:
    document = openapi_document(server.url)
    routes = [
        path
        for path, ops in document["paths"].items()
        # (a route on one stored object, such as a response's cancel, reads no body)
        if "post" in ops
        and "{" not in path
        and "application/json" in ops["post"].get("requestBody", {}).get("content", {})
    ]
    assert {"/generate", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank"} <= set(routes)
    return routes


@pytest.fixture
def integer_fields(server) -> dict[str, list[list[str]]]:
    """route -> paths of the integer fields its body schema declares (sampling_params'
    fields included), read from the OpenAPI document."""
    document = openapi_document(server.url)
    schemas = document["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        while "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def is_integer(schema: dict) -> bool:
        schema = resolve(schema)
        options = schema.get("anyOf", []) + schema.get("oneOf", []) + [schema]
        return any(resolve(o).get("type") == "integer" for o in options)

    out = {}
    for path, ops in document["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {})
        if "application/json" not in body:
            continue
        schema = resolve(body["application/json"]["schema"])
        fields = []
        for name, prop in schema.get("properties", {}).items():
            if is_integer(prop):
                fields.append([name])
            inner = resolve(prop)
            for option in [inner, *inner.get("anyOf", [])]:
                for sub, sub_prop in resolve(option).get("properties", {}).items():
                    if is_integer(sub_prop):
                        fields.append([name, sub])
        out[path] = fields
    return out


@pytest.fixture
def srv(server):
    yield server
    with server.client() as client:  # whatever the test sent, the server still serves
        client.post("/continue_generation")
        client.post("/stop_profile")
        r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    assert is_idle(server.wait_idle())


def post(client: httpx.Client, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def test_json_nested_past_the_limit_is_a_400_on_every_json_route(srv, json_routes):
    bad = []
    with srv.client() as client:
        for path in json_routes:
            base = json.dumps(VALID_BODIES.get(path, {"model": "m"}))
            poisoned = {
                "an extra field": (base[:-1] + ', "x": ' + nested(DEEP) + "}", "x"),
                "the whole body": (nested(DEEP), None),
                "one past the limit": (base[:-1] + ', "x": ' + nested(MAX_JSON_DEPTH) + "}", "x"),
            }
            for what, (body, param) in poisoned.items():
                r = post(client, path, body.encode())
                error = r.json().get("error", {}) if r.status_code == 400 else {}
                if r.status_code != 400 or error.get("param") != param:
                    bad.append(f"{path} ({what}): {r.status_code} {r.text[:200]}")
                elif "nested too deep" not in error["message"]:
                    bad.append(f"{path} ({what}): the message does not say why: {error}")
            # The limit itself is accepted: as deep as allowed is not an error of nesting.
            r = post(
                client, path, (base[:-1] + ', "x": ' + nested(MAX_JSON_DEPTH - 1) + "}").encode()
            )
            if r.status_code >= 500 or "nested too deep" in r.text:
                bad.append(f"{path} (at the limit): {r.status_code} {r.text[:200]}")
    assert not bad, "\n".join(bad)


def test_integers_past_every_width_are_never_a_server_error(srv, integer_fields):
    bad = []
    with srv.client() as client:
        for path, fields in integer_fields.items():
            for field in fields:
                for value in (HUGE, -HUGE, 2**63, 2**64):
                    body = json.loads(json.dumps(VALID_BODIES.get(path, {})))
                    target = body
                    for name in field[:-1]:
                        target = target.setdefault(name, {})
                        if not isinstance(target, dict):
                            break
                    else:
                        target[field[-1]] = value
                        r = post(client, path, body)
                        if r.status_code >= 500:
                            bad.append(
                                f"{path} {'.'.join(field)}={value}: {r.status_code} {r.text[:200]}"
                            )
    assert not bad, "\n".join(bad)
    assert any(fields for fields in integer_fields.values())


def test_a_huge_integer_in_a_control_message_fails_alone_and_at_once(srv):
    with srv.client(timeout=10) as client:
        r = post(client, "/open_session", {"capacity_of_str_len": HUGE})
        assert r.status_code == 400, r.text
        r = post(client, "/open_session", {"capacity_of_str_len": 10})
        assert r.status_code == 200, r.text
        post(client, "/close_session", {"session_id": r.json()})


CONSTRAINED = {
    "/generate json_schema": (
        "/generate",
        lambda schema: {
            "text": "hi",
            "sampling_params": {"max_new_tokens": 16, "json_schema": json.dumps(schema)},
        },
        "json_schema",
    ),
    "/v1/chat/completions response_format": (
        "/v1/chat/completions",
        lambda schema: {
            "messages": CHAT,
            "max_tokens": 16,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        },
        "response_format",
    ),
    "/v1/completions json_schema": (
        "/v1/completions",
        lambda schema: {"prompt": "hi", "max_tokens": 16, "json_schema": json.dumps(schema)},
        "json_schema",
    ),
}


@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_constraints_without_a_finite_value_are_the_clients_400(srv, case):
    path, make, param = CONSTRAINED[case]
    with srv.client() as client:
        for schema in (SELF_REF, LATE_DEAD_END, deep_schema(40)):
            r = post(client, path, make(schema))
            assert r.status_code == 400, (schema, r.text)
            error = r.json()["error"]
            assert error["param"] == param, error
            assert "admits no" in error["message"] or "nested too deep" in error["message"]
        # A recursive schema with a finite value is served (it may run to its length).
        finite = {
            "type": "object",
            "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["next"],
        }
        r = post(client, path, make(finite))
        assert r.status_code == 200, r.text


def test_a_constraint_that_dead_ends_midway_ends_a_stream_with_a_400_event(srv):
    body = {
        "text": "hi",
        "stream": True,
        "sampling_params": {"max_new_tokens": 32, "json_schema": json.dumps(LATE_DEAD_END)},
    }
    with srv.client() as client:
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[-1]["code"] == 400 and errors[-1]["param"] == "json_schema", events


def test_tool_schemas_and_arguments_nested_too_deep_are_400s(srv):
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(40)}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(DEEP)}}
    bodies = {
        "tools": {"messages": CHAT, "max_tokens": 2, "tools": [tool]},
        "messages": {
            "messages": [
                *CHAT,
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
            ],
            "max_tokens": 2,
        },
    }
    with srv.client() as client:
        for param, body in bodies.items():
            r = post(client, "/v1/chat/completions", body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
            assert "nested too deep" in r.json()["error"]["message"]


def test_grpc_poison_is_invalid_argument(srv):
    s = stub(srv)
    deep_body = (
        '{"messages": [{"role": "user", "content": "hi"}], "x": ' + nested(DEEP) + "}"
    ).encode()
    for rpc in (s.ChatComplete, s.Complete):
        with pytest.raises(grpc.RpcError) as e:
            list(rpc(pb.OpenAIRequest(json_body=deep_body), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "nested too deep" in e.value.details()
    for rpc in (s.OpenAIEmbed, s.Score, s.Rerank, s.OpenAIClassify):
        with pytest.raises(grpc.RpcError) as e:
            rpc(pb.OpenAIRequest(json_body=deep_body), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, e.value.details())
    for schema in (SELF_REF, LATE_DEAD_END, deep_schema(40)):
        request = pb.TextGenerateRequest(
            text="hi",
            sampling_params=pb.SamplingParams(max_new_tokens=16, json_schema=json.dumps(schema)),
        )
        with pytest.raises(grpc.RpcError) as e:
            list(s.TextGenerate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "json_schema" in e.value.details()
