"""A gRPC call that ends early ends its request in the engine: within about a second the
scheduler stops generating for it and its KV pages return (read through /v1/loads).
abort_all ends every live stream, gRPC and HTTP alike, gRPC ones with CANCELLED."""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import httpx
import pytest
from e2e_server import is_idle, wait_until
from grpc_support import long_stream, stub, target

from cadence.grpc import sglang_pb2 as pb
from cadence.grpc import sglang_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FREED_WITHIN_S = 1.5


@pytest.fixture
def rpc(server):
    assert is_idle(server.wait_idle())
    yield stub(server)
    assert is_idle(server.wait_idle()), "a request outlived its test"


def assert_freed(server) -> None:
    last = {}

    def freed():
        nonlocal last
        last = server.load()
        return last["num_running_reqs"] == 0 and last["num_used_tokens"] == 0

    assert wait_until(freed, FREED_WITHIN_S, interval=0.02), (
        f"still generating after the call ended: {last}"
    )


def running_with_kv(server) -> dict:
    busy = server.load()
    assert busy["num_running_reqs"] >= 1 and busy["num_used_tokens"] > 0
    return busy


def test_cancelling_a_stream_frees_the_kv_pool(server, rpc):
    call = rpc.TextGenerate(long_stream())
    for _ in range(3):
        next(call)
    running_with_kv(server)
    call.cancel()
    assert_freed(server)


def test_cancelling_a_unary_generate_frees_the_kv_pool(server, rpc):
    call = rpc.TextGenerate(
        pb.TextGenerateRequest(
            text="A long story:",
            sampling_params=pb.SamplingParams(max_new_tokens=4000, ignore_eos=True),
        )
    )
    assert wait_until(lambda: server.load()["num_used_tokens"] > 0, 30)
    call.cancel()
    assert_freed(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_passed_deadline_frees_the_kv_pool(server, rpc, stream):
    req = long_stream()
    req.stream = stream
    with pytest.raises(grpc.RpcError) as e:
        for _ in rpc.TextGenerate(req, timeout=1.5):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_freed(server)


def test_closing_the_channel_mid_stream_frees_the_kv_pool(server):
    channel = grpc.insecure_channel(target(server))
    call = sglang_pb2_grpc.SglangServiceStub(channel).Generate(
        pb.GenerateRequest(
            input_ids=[1, 2, 3, 4],
            stream=True,
            sampling_params=pb.SamplingParams(max_new_tokens=4000, ignore_eos=True),
        )
    )
    next(call)
    running_with_kv(server)
    channel.close()
    assert_freed(server)


def test_abort_all_ends_grpc_streams_with_cancelled_and_http_streams_too(server, rpc):
    calls = [rpc.TextGenerate(long_stream(rid=f"grpc-all-{i}")) for i in range(2)]
    for call in calls:
        next(call)
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        with http.stream(
            "POST",
            "/generate",
            json={
                "text": "Another story",
                "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            },
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            assert server.load()["num_running_reqs"] == 3
            assert rpc.Abort(pb.AbortRequest(abort_all=True)).success is True
            rest = pool.submit(lambda: [line for line in lines if line]).result(timeout=10)
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["meta_info"]["finish_reason"]["type"] == "abort"
    assert_freed(server)


def test_many_cancelled_streams_leave_nothing_behind(server, rpc):
    # 6 x ~1000 KV tokens: all admitted at once by the shared server's 16384-token pool
    calls = [rpc.TextGenerate(long_stream(max_new_tokens=1000)) for _ in range(6)]
    for call in calls:
        next(call)
    start = time.monotonic()
    for call in calls:
        call.cancel()
    assert_freed(server)
    assert time.monotonic() - start < FREED_WITHIN_S + 1


def test_cancelling_an_openai_pass_through_stream_frees_the_kv_pool(server, rpc):
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "stream": True,
            "max_tokens": 2000,
            "ignore_eos": True,
        }
    ).encode()
    call = rpc.ChatComplete(pb.OpenAIRequest(json_body=body))
    for _ in range(3):
        assert not next(call).finished
    running_with_kv(server)
    call.cancel()
    assert_freed(server)
