"""HTTP and gRPC served at the same time by one process and one engine: requests over both
share batches and give the same answers, and a busy protocol never blocks the other."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from e2e_server import is_idle, wait_until
from grpc_support import long_stream, stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "The best way to learn is",
    "Water boils at",
]


@pytest.fixture
def rpc(server):
    assert is_idle(server.wait_idle())
    yield stub(server)
    assert is_idle(server.wait_idle()), "a request outlived its test"


def _grpc_stream(rpc, prompt: str) -> str:
    req = pb.TextGenerateRequest(
        text=prompt,
        stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    )
    msgs = list(rpc.TextGenerate(req))
    assert msgs[-1].finished
    return "".join(m.text for m in msgs)


def _http_stream(server, prompt: str) -> str:
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    text = ""
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/generate", json=body) as r,
    ):
        for line in r.iter_lines():
            if line and line != "data: [DONE]":
                # SGLang's /generate stream: each event carries the whole text so far.
                text = json.loads(line[len("data: ") :])["text"]
    return text


def test_streams_over_both_protocols_at_once_give_the_same_text(server, rpc):
    with concurrent.futures.ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        grpc_futures = [pool.submit(_grpc_stream, rpc, p) for p in PROMPTS]
        http_futures = [pool.submit(_http_stream, server, p) for p in PROMPTS]
        grpc_texts = [f.result(timeout=120) for f in grpc_futures]
        http_texts = [f.result(timeout=120) for f in http_futures]
    assert grpc_texts == http_texts
    assert all(grpc_texts)


def test_tokenizer_calls_interleave_on_both_protocols(server, rpc):
    def grpc_loop():
        return [
            list(rpc.Tokenize(pb.TokenizeRequest(text=f"gRPC call {i}")).tokens) for i in range(50)
        ]

    def http_loop():
        with httpx.Client(base_url=server.url, timeout=30) as http:
            return [
                http.post("/tokenize", json={"prompt": f"gRPC call {i}"}).json()["tokens"]
                for i in range(50)
            ]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        over_grpc, over_http = pool.submit(grpc_loop), pool.submit(http_loop)
        assert over_grpc.result(timeout=60) == over_http.result(timeout=60)


def test_live_grpc_streams_do_not_slow_http_and_the_reverse(server, rpc):
    calls = [rpc.TextGenerate(long_stream(max_new_tokens=1000)) for _ in range(3)]
    for call in calls:
        next(call)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        start = time.monotonic()
        for _ in range(10):
            assert http.get("/health").status_code == 200
        http_took = time.monotonic() - start
        with http.stream(
            "POST",
            "/generate",
            json={
                "text": "A story",
                "stream": True,
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            },
        ) as r:
            lines = r.iter_lines()  # held: dropping it would close the stream (and abort it)
            assert next(line for line in lines if line).startswith("data: {")
            start = time.monotonic()
            for _ in range(10):
                assert rpc.Tokenize(pb.TokenizeRequest(text="quick")).count > 0
            grpc_took = time.monotonic() - start
            assert wait_until(lambda: server.load()["num_running_reqs"] == 4, 10), (
                "all four generate together"
            )
            rpc.Abort(pb.AbortRequest(abort_all=True))
    for call in calls:
        call.cancel()
    # Ten trivial calls each way, while four generations stream: well under a second each
    # way on an idle loop; generous for a shared CI machine.
    assert http_took < 5 and grpc_took < 5, (http_took, grpc_took)
