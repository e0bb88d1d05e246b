"""Every user error of specs/http.md is a 400 naming the field, decided in the front process.

Proof that the scheduler never sees a bad request: its process is stopped (SIGSTOP) while
the bad requests are sent. Anything that had to reach it would hang; every one of them
must still be answered 400 at once. After SIGCONT, /v1/loads shows that nothing was queued.
"""

from __future__ import annotations

import os
import signal

import pytest
from e2e_server import is_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def sp(**params) -> dict:
    return {"text": "Hello", "sampling_params": params}


# (expected param, request body)
BAD_GENERATE = [
    ("max_new_tokens", sp(max_new_tokens=-1)),
    ("max_new_tokens", sp(max_new_tokens=2.5)),
    ("min_new_tokens", sp(min_new_tokens=-1)),
    ("min_new_tokens", sp(min_new_tokens=9, max_new_tokens=4)),
    ("temperature", sp(temperature=-0.1)),
    ("temperature", sp(temperature="hot")),
    ("top_p", sp(top_p=0)),
    ("top_p", sp(top_p=1.01)),
    ("top_k", sp(top_k=0)),
    ("top_k", sp(top_k=-2)),
    ("min_p", sp(min_p=-0.01)),
    ("min_p", sp(min_p=1.5)),
    ("frequency_penalty", sp(frequency_penalty=2.01)),
    ("presence_penalty", sp(presence_penalty=-2.5)),
    ("repetition_penalty", sp(repetition_penalty=-0.1)),
    ("repetition_penalty", sp(repetition_penalty=2.5)),
    ("n", sp(n=0)),
    ("stop", sp(stop=7)),
    ("stop", sp(stop=["ok", 3])),
    ("stop_token_ids", sp(stop_token_ids=[49152])),
    ("stop_token_ids", sp(stop_token_ids=[-1])),
    ("logit_bias", sp(logit_bias={"49152": 1.0})),
    ("json_schema", sp(regex="a+", json_schema="{}")),
    ("ignore_eos", sp(ignore_eos="yes")),
    ("skip_special_tokens", sp(skip_special_tokens=1)),
    ("spaces_between_special_tokens", sp(spaces_between_special_tokens="no")),
    ("no_stop_trim", sp(no_stop_trim=0)),
    ("seed", sp(seed="abc")),
    ("seed", sp(seed=1.5)),
    ("not_a_param", sp(not_a_param=1)),
    ("text", {}),
    ("text", {"text": "Hello", "input_ids": [1, 2]}),
    ("text", {"text": ""}),
    ("input_ids", {"input_ids": []}),
    ("input_ids", {"input_ids": [5, 49152]}),
    ("input_ids", {"input_ids": [-3]}),
    ("text", {"text": "hello " * 9000}),  # at least the context length (8192)
    (
        "max_new_tokens",
        {"text": "Hello", "sampling_params": {"max_new_tokens": 8192}},
    ),  # prompt + max > context
    ("image_data", {"text": "Hello", "image_data": "http://example.com/cat.png"}),
    ("audio_data", {"text": "Hello", "audio_data": "clip.wav"}),
    ("video_data", {"text": "Hello", "video_data": "clip.mp4"}),
    ("rid", {"text": ["a", "b"], "rid": ["same", "same"]}),
    ("rid", {"text": ["a", "b"], "rid": ["only-one"]}),
    ("sampling_params", {"text": ["a", "b"], "sampling_params": [{}]}),
    ("sampling_params", {"text": "a", "sampling_params": 5}),
    ("logprob_start_len", {"text": "a", "return_logprob": True, "logprob_start_len": 50}),
    ("top_logprobs_num", {"text": "a", "return_logprob": True, "top_logprobs_num": -1}),
    ("token_ids_logprob", {"text": "a", "return_logprob": True, "token_ids_logprob": [49152]}),
    ("token_ids_logprob", {"text": "a", "return_logprob": True, "token_ids_logprob": [-1]}),
    ("stream", {"text": "a", "stream": "yes"}),
    ("return_logprob", {"text": "a", "return_logprob": "yes"}),
]


@pytest.fixture
def stopped_scheduler(server):
    """The shared server with its scheduler process frozen for the duration of the test."""
    pid = server.child_pid("scheduler")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        os.kill(pid, signal.SIGCONT)
    assert is_idle(server.wait_idle(5)), "a rejected request reached the scheduler"


@pytest.mark.parametrize(
    "param,body", BAD_GENERATE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_GENERATE)]
)
def test_bad_generate_request_is_400_naming_the_field(stopped_scheduler, param, body):
    with stopped_scheduler.client(timeout=10) as client:
        r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert param in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400


def test_bad_streaming_request_is_a_plain_400_not_a_stream(stopped_scheduler):
    with stopped_scheduler.client(timeout=10) as client:
        r = client.post(
            "/generate", json={"text": "Hello", "stream": True, "sampling_params": {"top_k": 0}}
        )
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "top_k"


def test_body_that_is_not_json_is_400(stopped_scheduler):
    with stopped_scheduler.client(timeout=10) as client:
        r = client.post(
            "/generate", content=b"{text: oops", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_unknown_route_is_404_json(server):
    with server.client() as client:
        r = client.get("/no/such/route")
    assert r.status_code == 404
    assert "/no/such/route" in r.json()["error"]["message"]


def test_stream_the_scheduler_refuses_is_a_plain_400_at_once(overload_server):
    """Past the edge checks, a request whose KV need exceeds the whole pool (2048 tokens here)
    is refused by the scheduler before its first token: streamed or not, it is a 400 at once."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4000}}
    with overload_server.client(timeout=10) as client:
        for stream in (False, True):
            r = client.post("/generate", json={**body, "stream": stream})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
            assert "max_new_tokens" in r.json()["error"]["message"]
    assert is_idle(overload_server.wait_idle())
