"""Drop-in for SGLang's clients: lenient requests, SGLang's extras (rid, stop_regex, priority,
hidden states, named logit processors, continuous usage), model names, info shapes, the
chat stream's null fields and the delta stream of --incremental-streaming-output.

`server` is the shared server (defaults); `fuzz_server` runs with the extras' flags on, the
test logit processors installed, --strict-model-name and two served names.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from e2e_server import is_idle, sse_events
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 6}
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c
    assert is_idle(server.wait_idle())


@pytest.fixture
def fuzz(fuzz_server):
    with fuzz_server.client() as c:
        yield c
    assert is_idle(fuzz_server.wait_idle())


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# ---- leniency ---------------------------------------------------------------------------


def test_generate_accepts_the_fields_smg_adds(http):
    body = {"text": PROMPT, "sampling_params": GREEDY, "model": "default", "log_metrics": True,
            "background": False, "no_logs": True, "return_bytes": False, "return_entropy": False,
            "sampling_params_extra": {"x": 1}}  # fmt: skip
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    plain = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    assert r.json()["text"] == plain["text"]
    # A field the server implements still gets a 400 for a bad value.
    assert error(http.post("/generate", json={**body, "stream": "yes"}))["param"] == "stream"


def test_chat_accepts_every_sdk_field(client, model):
    reply = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, temperature=0, top_p=1, n=1, seed=1,
        presence_penalty=0, frequency_penalty=0, logit_bias={"1": 0}, logprobs=True,
        top_logprobs=1, stop=["\n\n"], user="u", store=False, metadata={"k": "v"},
        parallel_tool_calls=None, reasoning_effort="low", prompt_cache_key="k",
        safety_identifier="s", verbosity="low", modalities=["text"], service_tier="auto",
        stream_options=None, tools=None, tool_choice="none", response_format={"type": "text"},
        extra_body={"functions": None, "function_call": None, "prediction": None, "audio": None,
                    "some_future_field": {"a": 1}},
    )  # fmt: skip
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, max_tokens=2, top_p=7)
    assert e.value.body["param"] == "top_p"


# ---- SGLang's extras -----------------------------------------------------------------------


def test_rid_on_openai_routes_names_the_request_for_abort(server, http):
    body = {"messages": USER, "max_tokens": 400, "stream": True, "rid": "my-chat-7",
            "extra": None, "ignore_eos": True}  # fmt: skip
    seen: list = []

    def consume():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            seen.extend(sse_events(r.iter_lines()))

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 30
    while server.load()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": "my-chat-7"}).status_code == 200
    reader.join(30)
    finished = [
        c["choices"][0] for c in seen[:-1] if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finished and finished[-1]["finish_reason"] == "abort"
    assert all(c["id"] == "chatcmpl-my-chat-7" for c in seen[:-1])


def test_a_duplicate_rid_says_duplicate_request_id(http):
    long = {"max_new_tokens": 2000, "ignore_eos": True}
    body = {"text": PROMPT, "rid": "dup-rid", "sampling_params": long, "stream": True}
    with http.stream("POST", "/generate", json=body) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        again = {"text": PROMPT, "rid": "dup-rid", "sampling_params": GREEDY}
        e = error(http.post("/generate", json=again))
        assert e["param"] == "rid" and "Duplicate request ID 'dup-rid'" in e["message"]
        assert http.post("/abort_request", json={"rid": "dup-rid"}).status_code == 200
        assert sse_events(lines)[-1] == "[DONE]"
    batch = {"text": [PROMPT, PROMPT], "rid": ["x", "x"], "sampling_params": GREEDY}
    e = error(http.post("/generate", json=batch))
    assert e["param"] == "rid" and "Duplicate request ID 'x'" in e["message"]


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)


def test_a_constrained_json_batch_answers_every_item(http):
    """A /generate batch with json_schema in sampling_params (mixed with unconstrained items,
    and with n > 1): every item has text, output_ids and meta_info, and each constrained one
    that finished is JSON of the schema."""
    texts = ["Give me a person as JSON:", "Say hi.", "A famous person as JSON:", "Count to 3."]
    constrained = {"temperature": 0, "max_new_tokens": 48, "json_schema": SCHEMA}
    params = [constrained, {**GREEDY}, constrained, {**GREEDY}]
    n2 = {"text": texts[0], "sampling_params": {**constrained, "temperature": 0.7, "n": 2}}
    for body in ({"text": texts, "sampling_params": params}, n2):
        r = http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert isinstance(out, list) and len(out) in (2, 4)
        assert all({"text", "output_ids", "meta_info"} <= item.keys() for item in out), out
        for item, p in zip(out, params if len(out) == 4 else [constrained] * 2):
            if "json_schema" in p and item["meta_info"]["finish_reason"]["type"] == "stop":
                value = json.loads(item["text"])
                assert isinstance(value["name"], str) and isinstance(value["age"], int)
    with http.stream("POST", "/generate", json={"text": texts, "sampling_params": params,
                                               "stream": True}) as r:  # fmt: skip
        events = sse_events(r.iter_lines())
    last = {e["index"]: e for e in events[:-1]}
    assert sorted(last) == [0, 1, 2, 3]
    assert all({"text", "output_ids", "meta_info"} <= e.keys() for e in last.values())
    assert all(e["meta_info"]["finish_reason"] is not None for e in last.values())


def test_stop_regex_ends_generation_with_the_pattern(http):
    params = {"temperature": 0, "max_new_tokens": 40, "stop_regex": [r"\d{4}"]}
    body = {"text": "The year the Eiffel Tower was finished:", "sampling_params": params}
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d{4}"}, out
    bad = error(http.post("/generate", json={"text": "hi", "sampling_params": {"stop_regex": "("}}))
    assert bad["param"] == "stop_regex" and "regular expression" in bad["message"]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "stop_regex": "Paris", "max_tokens": 30, "temperature": 0},
    ).json()
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == "Paris"


def test_extras_that_need_a_flag_say_so(http):
    for field, value in (("return_hidden_states", True), ("custom_logit_processor", "ban_tokens")):
        e = error(http.post("/generate", json={"text": PROMPT, field: value}))
        assert e["param"] == field and "--enable-" in e["message"]
    # priority without --enable-priority-scheduling is accepted and ignored, as SGLang does
    assert (
        http.post(
            "/generate", json={"text": PROMPT, "priority": 5, "sampling_params": GREEDY}
        ).status_code
        == 200
    )
    assert error(http.post("/generate", json={"text": PROMPT, "priority": "high"}))["param"] == (
        "priority"
    )


def test_hidden_states_have_sglangs_shape(fuzz):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                "ignore_eos": True},
            "return_hidden_states": True}  # fmt: skip
    out = fuzz.post("/generate", json=body).json()
    hidden = out["meta_info"]["hidden_states"]
    num_prompt = out["meta_info"]["prompt_tokens"]
    assert len(hidden[0]) == num_prompt and len({len(v) for v in hidden[0]}) == 1
    width = len(hidden[0][0])
    assert width == 576  # SmolLM2-135M's hidden size
    assert len(hidden) == 1 + 3 and all(len(v) == width for v in hidden[1:])
    chat = fuzz.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 3, "temperature": 0, "return_hidden_states": True},
    ).json()
    assert len(chat["choices"][0]["hidden_states"]) == width


def test_named_logit_processors_change_tokens_and_fail_alone(fuzz):
    body = {"text": PROMPT, "sampling_params": GREEDY}
    plain = fuzz.post("/generate", json=body).json()
    banned = plain["output_ids"][0]
    params = {**GREEDY, "custom_params": {"token_ids": [banned]}}
    out = fuzz.post(
        "/generate",
        json={**body, "sampling_params": params, "custom_logit_processor": "ban_tokens"},
    ).json()
    assert out["output_ids"][0] != banned and banned not in out["output_ids"]
    unknown = error(fuzz.post("/generate", json={**body, "custom_logit_processor": "nope"}))
    assert unknown["param"] == "custom_logit_processor" and "ban_tokens" in unknown["message"]
    dill = json.dumps({"callable": "80049526000000000000008c0a6275696c74696e73"})
    code = error(fuzz.post("/generate", json={**body, "custom_logit_processor": dill}))
    assert "never run" in code["message"]
    failed = fuzz.post("/generate", json={**body, "custom_logit_processor": "explode"})
    assert failed.status_code == 500 and failed.headers.get("x-cadence-fault") == "request"
    assert fuzz.post("/generate", json=body).json()["output_ids"] == plain["output_ids"]


def test_continuous_usage_stats(http):
    body = {"messages": USER, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert all(c["usage"] is not None for c in chunks)  # SGLang's test: usage >= content chunks
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all(c["usage"]["completion_tokens"] >= 1 for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


# ---- stream shapes --------------------------------------------------------------------------


def test_every_chat_chunk_has_content_and_the_last_sglangs_null_fields(http, client, model):
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=4,
                                                 temperature=0, stream=True))  # fmt: skip
    last = chunks[-1].choices[0]
    assert last.finish_reason in ("stop", "length")
    assert isinstance(last.delta.content, str) and last.delta.tool_calls is None
    assert last.delta.reasoning_content is None  # typed clients see the attribute
    assert chunks[0].choices[0].delta.role == "assistant"
    # A client reading the raw JSON finds delta.content, a string, on every chunk.
    body = {"messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = sse_events(r.iter_lines())[:-1]
    assert raw and all(isinstance(c["choices"][0]["delta"]["content"], str) for c in raw)


def test_incremental_streaming_output_sends_deltas(fuzz):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    whole = fuzz.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    with fuzz.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": params,
                                                "stream": True}) as r:  # fmt: skip
        chunks = sse_events(r.iter_lines())[:-1]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]


# ---- model names and info -------------------------------------------------------------------


def test_strict_model_names_and_aliases(fuzz):
    cards = fuzz.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-alias"]
    assert all(c["root"] == "tiny" for c in cards)
    assert fuzz.get("/v1/models/tiny-alias").json()["root"] == "tiny"
    assert fuzz.get("/v1/models/gpt-4").status_code == 404
    body = {"messages": USER, "max_tokens": 2}
    assert fuzz.post("/v1/chat/completions", json={**body, "model": "tiny-alias"}).json()[
        "model"
    ] == ("tiny-alias")
    refused = error(fuzz.post("/v1/chat/completions", json={**body, "model": "gpt-4"}), 404)
    assert refused["param"] == "model"


def test_served_name_not_a_path(http, server):
    card = http.get("/v1/models").json()["data"][0]
    assert "/" not in card["id"] and card["root"] == card["id"]
    assert http.get("/model_info").json()["model_path"].endswith(".gguf")


def test_server_info_has_sglangs_keys(http, server):
    info = http.get("/server_info").json()
    assert info["max_total_num_tokens"] == 16384 and info["max_req_input_len"] > 0
    assert info["status"] == "ready" and info["version"]
    (rank,) = info["internal_states"]
    assert "last_gen_throughput" in rank and rank["memory_usage"]["token_capacity"] == 16384
    assert "api_key" not in info and info["chunked_prefill_size"] == 512
    grpc_info = json.loads(stub(server).GetServerInfo(pb.GetServerInfoRequest()).json_info)
    assert grpc_info["max_total_num_tokens"] == 16384 and grpc_info["internal_states"]


def test_tokenize_accepts_messages(http):
    out = http.post("/v1/tokenize", json={"messages": USER}).json()
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()
    assert out["count"] == len(out["tokens"]) == chat["usage"]["prompt_tokens"]
    raw = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()
    assert raw["count"] < out["count"]  # without the assistant header
    assert (
        error(http.post("/tokenize", json={"messages": USER, "prompt": "x"}))["param"] == "prompt"
    )


def test_grpc_abort_of_an_unknown_rid_succeeds(server):
    assert stub(server).Abort(pb.AbortRequest(rid="never-was")).success is True
    with pytest.raises(grpc.RpcError) as e:
        stub(server).Abort(pb.AbortRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
