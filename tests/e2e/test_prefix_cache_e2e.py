"""The prefix cache and sessions from outside, on the shared server: cached_tokens over the
OpenAI API, /generate and gRPC; /v1/loads and GetLoad report the cache; flush empties it;
sessions over HTTP, and over gRPC's session_id."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_server import is_idle
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SYSTEM = (
    "You are the help desk of a public library. You answer questions about borrowing, "
    "returns, fines, opening hours, reading rooms and the catalogue in one short sentence. "
) * 3


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
    assert is_idle(server.wait_idle()), "a request outlived its test"


def flush(http) -> None:
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text


def load(http) -> dict:
    return http.get("/v1/loads").json()["loads"][0]


def test_openai_usage_reports_the_cached_prompt_and_the_answer_is_the_same(client, model, http):
    flush(http)
    assert load(http)["num_cached_tokens"] == 0

    def ask(question):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
        )

    first, again = ask("When do you open?"), ask("When do you open?")
    other = ask("Can I renew a book online?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert other.usage.prompt_tokens_details.cached_tokens >= 48  # the shared system prompt
    entry = load(http)
    assert entry["num_cached_tokens"] >= first.usage.prompt_tokens - 16
    assert 0 < entry["cache_hit_rate"] <= 1
    assert entry["num_used_tokens"] == 0  # cached pages nobody holds are not "used"
    flush(http)
    assert load(http)["num_cached_tokens"] == 0


def test_generate_meta_info_and_the_stream_carry_cached_tokens(http):
    body = {"text": SYSTEM + "Fines?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    http.post("/generate", json=body).raise_for_status()
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["cached_tokens"] > 0 and meta["cached_tokens"] < meta["prompt_tokens"]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["cached_tokens"] == meta["cached_tokens"]


def test_sessions_over_http(http):
    r = http.post("/open_session", json={"capacity_of_str_len": 1000})
    assert r.status_code == 200
    sid = r.json()
    assert isinstance(sid, str) and sid
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = http.post(
        "/generate",
        json={
            "text": "Hello, library.",
            "rid": "s-1",
            "session_params": {"id": sid},
            "sampling_params": params,
        },
    ).json()["meta_info"]
    two = http.post(
        "/generate",
        json={
            "text": " What time is it?",
            "rid": "s-2",
            "session_params": {"id": sid, "rid": "s-1"},
            "sampling_params": params,
        },
    ).json()["meta_info"]
    history = one["prompt_tokens"] + one["completion_tokens"]
    assert two["prompt_tokens"] > history  # the history came first, then the new input
    assert two["cached_tokens"] == (history - 1) // 16 * 16
    assert load(http)["num_used_tokens"] > 0  # pinned while the session is open
    # A taken id, a bad rid and an unknown session are 400s naming what is wrong.
    taken = http.post("/open_session", json={"session_id": sid})
    assert taken.status_code == 400 and "already open" in taken.text
    bad = http.post(
        "/generate",
        json={"text": "x", "session_params": {"id": sid, "rid": "nope"}, "sampling_params": params},
    )
    assert bad.status_code == 400 and "session_params" in bad.text
    unknown = http.post(
        "/generate", json={"text": "x", "session_params": {"id": "nope"}, "sampling_params": params}
    )
    assert unknown.status_code == 400 and "not open" in unknown.text
    shape = http.post("/generate", json={"text": "x", "session_params": {"rid": "s-1"}})
    assert shape.status_code == 400 and "session_params" in shape.text
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert load(http)["num_used_tokens"] == 0
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert http.post("/close_session", json={}).status_code == 400


def test_grpc_session_id_continues_a_streaming_session_and_get_load_reports_the_cache(server, http):
    sid = http.post("/open_session", json={"streaming": True, "timeout": 60}).json()
    rpc = stub(server)
    sp = pb.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    metas = []
    for text in ("A long question about the reading rooms and their hours, please.", " And?"):
        (msg,) = list(
            rpc.TextGenerate(pb.TextGenerateRequest(text=text, sampling_params=sp, session_id=sid))
        )
        metas.append({k: json.loads(v) for k, v in msg.meta_info.items()})
    first, second = metas
    history = first["prompt_tokens"] + first["completion_tokens"]
    assert second["prompt_tokens"] > history
    assert second["cached_tokens"] == (history - 1) // 16 * 16 > 0
    (entry,) = json.loads(rpc.GetLoad(pb.GetLoadRequest()).json_info)
    assert entry["num_cached_tokens"] > 0 and entry["num_used_tokens"] > 0
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert rpc.FlushCache(pb.FlushCacheRequest()).success
    (entry,) = json.loads(rpc.GetLoad(pb.GetLoadRequest()).json_info)
    assert entry["num_cached_tokens"] == 0 and entry["num_used_tokens"] == 0
