"""`cadence serve --tp-size 2` end to end, and a two-"node" server: two process trees, each
`cadence serve` with its own --node-rank, meeting over TCP at --dist-init-addr.

Clients see nothing of the ranks: the openai SDK, the native route and the gRPC service
answer as from one process, and greedily the same text. A rank that dies, here or on the
other node, ends the server with a non-zero exit within 30 s; no process is left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from e2e_server import Server, free_port, wait_until
from grpc_support import short_request, stub

pytestmark = pytest.mark.timeout(300)

SMALL = ["--max-total-tokens", "2048", "--skip-warmup"]
PROMPT = "The capital of France is"
# What one process answers greedily to PROMPT (the default GGUF, float32): the reference.
EXPECTED_START = " Paris"
DEATH_LIMIT_S = 30.0


def rank_pid(server: Server, rank: int) -> int:
    found = re.search(rf"rank {rank} ready \(pid (\d+)\)", server.log_text())
    assert found, f"rank {rank} never said it was ready:\n{server.log_tail()}"
    return int(found.group(1))


def greedy(server: Server, max_new_tokens: int = 8) -> dict:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    with server.client() as c:
        r = c.post("/generate", json=body)
    r.raise_for_status()
    return r.json()


def dies_non_zero(server: Server) -> float:
    """Seconds until `server` exits; fails unless it exits non-zero within DEATH_LIMIT_S."""
    start = time.monotonic()
    code = server.wait_exit(DEATH_LIMIT_S)
    took = time.monotonic() - start
    assert code is not None, f"the server still runs {DEATH_LIMIT_S:.0f} s after a rank died"
    assert code != 0, f"the server exited 0 after a rank died:\n{server.log_tail()}"
    return took


@pytest.fixture(scope="module")
def tp2_server():
    srv = Server("tp2", ["--tp-size", "2", *SMALL]).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.destroy()


def test_clients_see_one_server_behind_two_ranks(tp2_server):
    srv = tp2_server
    native = greedy(srv)
    assert native["text"].startswith(EXPECTED_START)
    api = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    completion = api.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == native["text"]
    chat = api.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    (msg,) = list(stub(srv).TextGenerate(short_request(PROMPT, max_new_tokens=8)))
    assert msg.finished and msg.text == native["text"]
    assert srv.wait_idle()["num_used_tokens"] == 0


def test_killing_rank_0_stops_the_server_and_its_followers(tp2_server):
    srv = tp2_server
    os.kill(srv.child_pid("scheduler"), signal.SIGKILL)  # rank 0 runs in the scheduler
    dies_non_zero(srv)
    assert wait_until(lambda: not srv.leftover_pids(), 10), srv.leftover_pids()


def test_pipeline_lanes_under_concurrent_streams_then_a_stage_killed_mid_stream():
    """pp=2 keeps two decode lanes in flight: eight concurrent streams each get what the
    same request alone gets, the pool is back after them; then a stage killed while streams
    decode ends the server non-zero and every stream ends (none hangs)."""
    srv = Server("pp2", ["--pp-size", "2", *SMALL]).start()
    try:
        srv.wait_ready()

        async def stream(api, max_tokens: int) -> str:
            chunks = await api.completions.create(
                model="default",
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def together(n: int, max_tokens: int, kill_after: float | None = None) -> list:
            async with openai.AsyncOpenAI(
                base_url=srv.url + "/v1", api_key="none", max_retries=0
            ) as api:
                streams = asyncio.gather(
                    *(stream(api, max_tokens) for _ in range(n)), return_exceptions=True
                )
                if kill_after is not None:
                    await asyncio.sleep(kill_after)
                    os.kill(rank_pid(srv, 1), signal.SIGKILL)
                return await asyncio.wait_for(streams, DEATH_LIMIT_S + 10)

        (alone,) = asyncio.run(together(1, 12))
        assert alone.startswith(EXPECTED_START)
        assert asyncio.run(together(8, 12)) == [alone] * 8
        assert srv.wait_idle()["num_used_tokens"] == 0

        ended = asyncio.run(together(8, 2000, kill_after=3))
        # 2,000 tokens each take minutes here: every stream was cut, none hung.
        print("streams ended by:", sorted({repr(e)[:200] for e in ended}))
        assert all(isinstance(e, Exception) for e in ended), ended
        dies_non_zero(srv)
        assert "rank 1 process died" in srv.log_text()
        assert wait_until(lambda: not srv.leftover_pids(), 10), srv.leftover_pids()
    finally:
        srv.destroy()


def test_four_ranks_serve_and_a_killed_last_stage_rank_stops_them():
    srv = Server("tp2pp2", ["--tp-size", "2", "--pp-size", "2", *SMALL]).start()
    try:
        srv.wait_ready()
        assert greedy(srv)["text"].startswith(EXPECTED_START)
        os.kill(rank_pid(srv, 3), signal.SIGKILL)
        dies_non_zero(srv)
        assert "rank 3 process died" in srv.log_text()
        assert wait_until(lambda: not srv.leftover_pids(), 10), srv.leftover_pids()
    finally:
        srv.destroy()


def test_two_nodes_serve_together_and_a_lost_node_stops_node_0():
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *SMALL]
    node0 = Server("node0", [*nodes, "--node-rank", "0"]).start()
    node1 = Server("node1", [*nodes, "--node-rank", "1"]).start()
    try:
        node0.wait_ready()
        assert greedy(node0)["text"].startswith(EXPECTED_START)
        assert "node 1: ranks 1 ready" in node1.log_text()
        assert node1.proc.poll() is None
        with pytest.raises(httpx.ConnectError):  # node 1 serves nothing: its ranks only
            httpx.get(node1.url + "/health", timeout=5)
        node1.proc.send_signal(signal.SIGKILL)  # the machine goes away: its rank dies with it
        dies_non_zero(node0)
        assert wait_until(lambda: not node1.leftover_pids(), 10), node1.leftover_pids()
    finally:
        node0.destroy()
        node1.destroy()
