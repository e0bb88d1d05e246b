"""Memory that is what it seems: a server takes its KV pool's memory (and a full step's
working memory) at start, so its resident memory when fresh is what it holds after a soak
that fills the pool; /server_info and gRPC GetServerInfo report the pool's size.

The server is this module's own (a fresh one is the point), with a small pool so that the
soak is short, yet large enough that a lazily committed pool grows the server by far more
than the 10% allowed: 4096 float32 tokens of SmolLM2 are 180 MiB; with --lazy-kv-pool the
server grew from 1145 to 1459 MiB (+27.5%) in this test.
"""

from __future__ import annotations

import asyncio
import json
import random

import openai
import pytest
from e2e_server import Server, tagged_pids
from grpc_support import stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

POOL_TOKENS = 4096
PROMPT_TOKENS = 480  # eight of these hold nearly every page of the pool at once
CONCURRENCY = 8
WAVES = 2  # the second wave evicts the first one's cached pages and takes them over


def resident_bytes(srv: Server) -> int:
    """VmRSS summed over every process of the server, from /proc."""
    total = 0
    for pid in tagged_pids(srv.tag):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass  # gone meanwhile
    return total


@pytest.fixture(scope="module")
def memory_server():
    srv = Server("kv_memory", ["--max-total-tokens", str(POOL_TOKENS)]).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.destroy()


async def soak(srv: Server, model: str) -> None:
    """Waves of concurrent requests whose distinct prompts together fill the pool."""
    rng = random.Random(27)
    async with openai.AsyncOpenAI(
        base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        for _ in range(WAVES):
            prompts = [
                [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
                for _ in range(CONCURRENCY)
            ]
            done = await asyncio.gather(
                *(
                    client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
                    for p in prompts
                )
            )
            assert all(c.usage.prompt_tokens == PROMPT_TOKENS for c in done)


def test_resident_memory_of_a_fresh_server_is_what_it_holds_after_filling_its_pool(
    memory_server,
):
    srv = memory_server
    fresh = resident_bytes(srv)
    with srv.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    asyncio.run(soak(srv, model))
    load = srv.wait_idle()
    # The finished prompts' pages stay in the prefix cache: most of the pool was written.
    assert load["num_cached_tokens"] >= 0.75 * POOL_TOKENS, load
    after = resident_bytes(srv)
    print(
        f"\nresident memory: fresh {fresh / 2**20:.0f} MiB, after filling the KV pool "
        f"{after / 2**20:.0f} MiB ({after / fresh - 1:+.1%}), limit +10%"
    )
    assert abs(after - fresh) <= 0.10 * fresh


def test_server_info_reports_the_kv_pool_on_both_protocols(memory_server):
    with memory_server.client() as c:
        info = c.get("/server_info").json()
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V, float32.
    expected = POOL_TOKENS * 30 * 3 * 64 * 2 * 4
    assert info["kv_pool_bytes"] == expected
    assert info["kv_pool_committed"] is True and info["lazy_kv_pool"] is False
    assert info["max_total_num_tokens"] == POOL_TOKENS
    memory = info["internal_states"][0]["memory_usage"]  # SGLang's shape: GB
    assert memory["token_capacity"] == POOL_TOKENS
    assert memory["kvcache"] == round(expected / 2**30, 2)
    grpc_info = json.loads(stub(memory_server).GetServerInfo(pb.GetServerInfoRequest()).json_info)
    assert grpc_info["kv_pool_bytes"] == expected and grpc_info["kv_pool_committed"] is True
