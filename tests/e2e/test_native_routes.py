"""The native HTTP routes of specs/http.md against one launched server of the default model.

Information routes, /generate in every shape (single, batch, n > 1, logprobs, SSE), and the
tokenizer routes with their /v1 aliases. Each test ends with the server idle again.
"""

from __future__ import annotations

import json
import math

import pytest
from e2e_server import is_idle, sse_events, tried

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    assert is_idle(server.wait_idle()), "a request outlived its test"


# ---- information routes -----------------------------------------------------------------


def test_health_and_health_generate(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_model_info_and_its_alias(client):
    info = client.get("/model_info")
    assert info.status_code == 200
    body = info.json()
    assert body["model_path"].endswith(".gguf")
    assert body["is_generation"] is True
    assert body["max_context_length"] == 8192  # SmolLM2-135M
    assert body["vocab_size"] == 49152
    # The default GGUF is served at its own types (docs/quantization.md).
    assert body["weight_types"]["Q4_1"] == {"tensors": 210, "served_as": "Q4_1"}
    assert body["weight_types"]["Q8_0"] == {"tensors": 1, "served_as": "Q8_0"}
    assert client.get("/get_model_info").json() == body


def test_server_info_and_its_alias(server, client):
    body = client.get("/server_info").json()
    assert body["port"] == server.port
    assert body["max_total_tokens"] == 16384
    assert body["chunked_prefill_size"] == 512
    assert body["dtype"] == "float32"
    assert "api_key" not in body
    # Served without --model-path (the default model): the paths and name of what was loaded,
    # as SGLang's server_info always has them, and the same as /model_info's.
    model = client.get("/model_info").json()
    assert body["model_path"] == model["model_path"] and body["model_path"].endswith(".gguf")
    assert body["tokenizer_path"] == model["tokenizer_path"]
    assert body["served_model_name"] == model["served_model_name"]
    alias = client.get("/get_server_info").json()
    assert alias["port"] == server.port and alias.keys() == body.keys()


def test_get_load_is_one_entry_per_rank(client):
    r = client.get("/get_load")
    assert r.status_code == 200
    (entry,) = r.json()
    assert entry == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_v1_loads_json_filter_and_prometheus(client):
    body = client.get("/v1/loads").json()
    assert {"timestamp", "version", "loads"} <= body.keys()
    (entry,) = body["loads"]
    assert {
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "num_cached_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
    } <= entry.keys()
    assert entry["dp_rank"] == 0 and entry["max_total_num_tokens"] == 16384
    assert entry["num_used_tokens"] == 0 and entry["token_usage"] == 0.0

    assert [
        e["dp_rank"] for e in client.get("/v1/loads", params={"dp_rank": 0}).json()["loads"]
    ] == [0]
    assert client.get("/v1/loads", params={"dp_rank": 3}).json()["loads"] == []
    for rank in ("first", "--1", "-1", "1.5", "9" * 5000):  # "--1" and 5,000 digits were a 500
        bad = client.get("/v1/loads", params={"dp_rank": rank})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dp_rank", bad.text

    prom = client.get("/v1/loads", params={"format": "prometheus"})
    assert prom.status_code == 200 and prom.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in prom.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    running = [v for k, v in samples.items() if "num_running_reqs" in k and 'dp_rank="0"' in k]
    total = [v for k, v in samples.items() if "max_total_num_tokens" in k]
    assert running == [0.0] and total == [16384.0]


# ---- /generate -------------------------------------------------------------------------


def test_generate_single_is_greedy_and_bounded(client):
    first = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert first.status_code == 200
    body = first.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert 1 <= meta["completion_tokens"] == len(body["output_ids"]) <= GREEDY["max_new_tokens"]
    assert meta["prompt_tokens"] == len(
        client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    )
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert "Paris" in body["text"]
    assert (
        client.post("/detokenize", json={"tokens": body["output_ids"]}).json()["text"]
        == body["text"]
    )
    again = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    assert again["output_ids"] == body["output_ids"]  # greedy is deterministic
    assert again["meta_info"]["id"] != meta["id"]


def test_generate_input_ids_and_ignore_eos_length(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
        },
    ).json()
    assert len(body["output_ids"]) == 7
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_generate_batch_answers_a_list_in_order(client):
    prompts = [PROMPT, "One, two, three,"]
    batch = client.post(
        "/generate", json={"text": prompts, "sampling_params": GREEDY, "rid": ["b-0", "b-1"]}
    )
    assert batch.status_code == 200
    out = batch.json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["b-0", "b-1"]
    singles = [
        client.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()
        for p in prompts
    ]
    assert [o["output_ids"] for o in out] == [s["output_ids"] for s in singles]


def test_generate_batch_with_per_item_sampling_params(client):
    out = client.post(
        "/generate",
        json={
            "text": [PROMPT, PROMPT],
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
                {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            ],
        },
    ).json()
    assert [len(o["output_ids"]) for o in out] == [2, 5]
    assert out[1]["output_ids"][:2] == out[0]["output_ids"]


def test_generate_n_samples_one_prompt(client):
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 11, "ignore_eos": True}
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": params, "rid": "nsamp"})
    assert r.status_code == 200
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["nsamp-0", "nsamp-1", "nsamp-2"]
    assert all(len(o["output_ids"]) == 6 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1, (
        "n samples of one seeded prompt must differ"
    )
    again = client.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out], (
        "a seed makes n samples reproducible"
    )


def test_generate_logprobs(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "token_ids_logprob": [11, 42],
            "return_text_in_logprobs": True,
        },
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    out = meta["output_token_logprobs"]
    assert [t for _, t, _ in out] == body["output_ids"]
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in out)
    for (lp, token, _), top in zip(out, meta["output_top_logprobs"]):
        assert len(top) == 3
        assert top[0][1] == token and math.isclose(
            top[0][0], lp, abs_tol=1e-4
        )  # greedy picks the top one
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
    assert [[t for _, t, _ in row] for row in meta["output_token_ids_logprobs"]] == [[11, 42]] * 4
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids
    assert inp[0][0] is None and all(lp <= 0 for lp, _, _ in inp[1:])


def test_generate_stream_is_sse_ending_with_done(client):
    """SGLang's default stream shape: every event carries the text and output ids so far."""
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    whole = client.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()

    def streamed() -> list:
        with client.stream(
            "POST", "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
        assert raw.endswith("data: [DONE]\n\n")
        events = sse_events(raw.split("\n"))
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        return events[:-1]

    chunks = tried(streamed, lambda chunks: len(chunks) >= 2)
    assert len(chunks) >= 2, "a 10-token generation streams in several chunks"
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [
        len(c["output_ids"]) for c in chunks
    ]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_a_client_loop_written_as_sglang_documents_it_prints_the_text(client):
    """SGLang's docs read a /generate stream with `text[len(prev):]`."""
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    whole = client.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    printed, prev = [], 0
    with client.stream(
        "POST", "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                data = json.loads(line[5:].strip())
                printed.append(data["text"][prev:])
                prev = len(data["text"])
    assert "".join(printed) == whole["text"]


def test_generate_stream_batch_and_logprobs_so_far(client):
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    body = {
        "text": [PROMPT, "Hello"],
        "sampling_params": params,
        "stream": True,
        "return_logprob": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        chunks = [e for e in events[:-1] if e["index"] == index]
        assert len(chunks[-1]["output_ids"]) == 5
        for c in chunks:
            lps = [t for _, t, _ in c["meta_info"]["output_token_logprobs"]]
            assert lps == c["output_ids"], "streamed logprobs cover every token so far"
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stream_never_splits_a_multi_byte_character(client):
    """Byte-level tokens of CJK text: the text waits until its character is complete."""
    body = {
        "text": "你好，我的朋友。今天天气",
        "sampling_params": {"temperature": 0, "max_new_tokens": 16},
    }
    whole = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert chunks[-1]["text"] == whole["text"]
    assert any(
        len(b["output_ids"]) > len(a["output_ids"]) and b["text"] == a["text"]
        for a, b in zip(chunks, chunks[1:])
    ), "no token was held back: not a multi-byte case"
    assert all("\ufffd" not in c["text"] for c in chunks)


def test_stop_string_is_trimmed_and_reported(client):
    params = {"temperature": 0, "max_new_tokens": 24, "stop": ["answer"]}
    body = client.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "answer"}
    assert "Paris" in body["text"] and "answer" not in body["text"]
    kept = client.post(
        "/generate", json={"text": PROMPT, "sampling_params": {**params, "no_stop_trim": True}}
    ).json()
    assert kept["text"].endswith("answer") and kept["text"].startswith(body["text"])


# ---- tokenizer routes --------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip(client, prefix):
    one = client.post(f"{prefix}/tokenize", json={"prompt": "Hello world"})
    assert one.status_code == 200
    body = one.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 8192
    text = client.post(f"{prefix}/detokenize", json={"tokens": body["tokens"]}).json()["text"]
    assert text == "Hello world"

    many = client.post(f"{prefix}/tokenize", json={"prompt": ["a b", "Hello world"]}).json()
    assert many["tokens"][1] == body["tokens"] and many["count"] == [len(t) for t in many["tokens"]]
    texts = client.post(f"{prefix}/detokenize", json={"tokens": many["tokens"]}).json()["text"]
    assert texts == ["a b", "Hello world"]


def test_tokenizer_routes_reject_bad_input(client):
    cases = [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/v1/detokenize", {"tokens": [[1], [-4]]}, "tokens"),
    ]
    for route, body, param in cases:
        r = client.post(route, json=body)
        assert r.status_code == 400, (route, body, r.text)
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    # Fields the server does not implement are ignored, as on every route.
    assert client.post("/tokenize", json={"prompt": "x", "extra": 1}).json()["count"] == 1


def test_tokenizer_routes_reject_bodies_that_are_not_json_objects(client):
    for route in ("/tokenize", "/v1/detokenize"):
        r = client.post(route, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
        r = client.post(route, json=["a", "list"])
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], r.text
    # GET is not a tokenizer route: the framework's 405 still answers.
    assert client.get("/tokenize").status_code == 405
