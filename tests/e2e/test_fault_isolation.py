"""A request that fails inside the server fails alone: it gets a 500 (gRPC INTERNAL) marked as
its own fault, the requests batched with it finish normally, its KV pages come back, and
the server goes on serving.

The failures are real exceptions raised inside the scheduler's sampler and inside the
detokenizer process, by the fault-injection test plugin (tests/e2e/plugins) installed in
`fuzz_server`, for the one request that carries its marker among its stop strings.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from cadence_fault_injection import DETOKENIZE_MARKER, SAMPLE_MARKER
from e2e_server import is_idle
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAULT_HEADER = "x-cadence-fault"
GOOD = {
    "text": "The capital of France is",
    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
}


def bad(marker: str, **params) -> dict:
    return {
        "text": "Write a long story about a cat.",
        "sampling_params": {"max_new_tokens": 24, "stop": [marker], **params},
    }


@pytest.fixture
def srv(fuzz_server):
    yield fuzz_server
    assert is_idle(fuzz_server.wait_idle()), "a request outlived its test or kept its KV pages"


def test_the_fault_plugin_is_loaded(srv):
    assert "plugins loaded" in srv.log_text() and "fault_injection" in srv.log_text()


@pytest.mark.parametrize(
    "marker,stage", [(SAMPLE_MARKER, "sampling"), (DETOKENIZE_MARKER, "detokenizing")]
)
async def test_a_failing_request_fails_alone_while_its_batch_finishes(srv, marker, stage):
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        with_it = [client.post("/generate", json=GOOD) for _ in range(3)]
        # The bad request is sent while the good ones run, so they share decode batches.
        good_task = asyncio.gather(*with_it)
        await asyncio.sleep(0.3)
        failed = await client.post("/generate", json=bad(marker))
        good = await good_task
    assert failed.status_code == 500, failed.text
    assert failed.headers.get(FAULT_HEADER) == "request"
    error = failed.json()["error"]
    assert error["code"] == 500 and stage in error["message"] and "injected" in error["message"], (
        error
    )
    for r in good:
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 12
    assert "injected" in srv.log_text(), "the failure is logged with its traceback"
    origin = "scheduler" if marker == SAMPLE_MARKER else "detokenizer"
    with srv.client() as client:
        metrics = client.get("/metrics").text
    count = next(
        line
        for line in metrics.splitlines()
        if line.startswith(f'cadence_request_faults_total{{origin="{origin}"}}')
    )
    assert float(count.split()[-1]) >= 1, metrics
    with srv.client() as client:  # the server lives and serves
        assert client.get("/health").status_code == 200
        assert client.post("/generate", json=GOOD).status_code == 200


def test_a_failing_stream_ends_with_an_error_event(srv):
    body = {**bad(SAMPLE_MARKER), "stream": True}
    with srv.client() as client:
        r = client.post("/generate", json=body)
    # The failure comes at the first token: no event has been sent, so it is a plain 500.
    assert r.status_code == 500 and r.headers.get(FAULT_HEADER) == "request", r.text


def test_openai_chat_failure_is_a_json_500_marked_as_the_requests_own(srv):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "stop": [SAMPLE_MARKER],
    }
    with srv.client() as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.headers.get(FAULT_HEADER) == "request", r.text
        assert "injected" in r.json()["error"]["message"]
        ok = client.post("/v1/chat/completions", json={**body, "stop": None})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("marker", [SAMPLE_MARKER, DETOKENIZE_MARKER])
def test_grpc_failure_is_internal_with_the_fault_in_trailing_metadata(srv, marker):
    rpc = stub(srv)
    request = pb.TextGenerateRequest(
        text="Tell me a story.", sampling_params=pb.SamplingParams(max_new_tokens=16, stop=[marker])
    )
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.TextGenerate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected" in e.value.details()
    assert (FAULT_HEADER, "request") in tuple(e.value.trailing_metadata() or ())
    ok = list(
        rpc.TextGenerate(
            pb.TextGenerateRequest(
                text="Hello", sampling_params=pb.SamplingParams(max_new_tokens=4)
            ),
            timeout=60,
        )
    )
    assert ok[-1].finished and json.loads(ok[-1].meta_info["completion_tokens"]) == 4


def test_batch_request_items_fail_alone(srv):
    body = {
        "text": ["The capital of France is", "Write a long story about a cat."],
        "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 4, "stop": [SAMPLE_MARKER]}],
    }
    with srv.client() as client:
        r = client.post("/generate", json=body)
        # The batch answer is all or nothing; the item that failed names itself.
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"], r.text
        assert client.post("/generate", json=GOOD).status_code == 200
