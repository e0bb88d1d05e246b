"""Whether the engine serves: one request through the whole pipeline.

The warm-up at start, /health_generate and both gRPC health checks send the same probe
through an `EngineClient`: a one-token greedy generation, or on an embedding model one
embedding. `probe_alive` is the gateway's variant (SGLang's SMG gives a health check a few
seconds): a busy engine is a live one, so a probe still waiting for room (a full KV pool)
passes when the scheduler reports requests running.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cadence.errors import CadenceError
from cadence.front.engine_client import EngineClient
from cadence.io_struct import FAKE_BOOTSTRAP_HOST, EmbeddingReqInput, GenerateReqInput

logger = logging.getLogger(__name__)

_GREEDY_TOKEN = {"max_new_tokens": 1, "temperature": 0}


def probe_request(text: str | None = None) -> GenerateReqInput:
    """A one-token greedy generation of `text` (token 0 when None); on a prefill or decode
    server it runs both halves there (the fake bootstrap host), needing no peer."""
    if text is not None:
        obj = GenerateReqInput(text=text, sampling_params=dict(_GREEDY_TOKEN))
    else:
        obj = GenerateReqInput(input_ids=[0], sampling_params=dict(_GREEDY_TOKEN))
    obj.bootstrap_host, obj.bootstrap_room = FAKE_BOOTSTRAP_HOST, 0
    return obj


async def probe(client: EngineClient, text: str | None = None) -> None:
    """One request through the whole pipeline; raises what it failed with."""
    if client.info.is_generation:
        results = client.generate(probe_request(text))
        try:
            async for _ in results:
                pass
        finally:
            await results.aclose()
    elif text is not None:
        await client.embed(EmbeddingReqInput(text=text))
    else:
        await client.embed(EmbeddingReqInput(input_ids=[0]))


async def probe_alive(client: EngineClient, timeout_s: float) -> tuple[bool, str]:
    """(healthy, why) within `timeout_s`: the probe passed, or while it waits the scheduler
    reports requests running; the probe is aborted if it still runs at the end."""
    task = asyncio.ensure_future(probe(client))
    deadline = time.monotonic() + timeout_s
    try:
        await asyncio.wait({task}, timeout=timeout_s / 4)
        if not task.done():
            [load] = await client.get_load(timeout=max(deadline - time.monotonic(), 0.1))
            if load.num_running_reqs > 0:
                return True, f"the engine is busy ({load.num_running_reqs} requests running)"
            await asyncio.wait({task}, timeout=max(deadline - time.monotonic(), 0))
        if not task.done():
            return False, f"the probe generation did not end in {timeout_s:g}s"
        task.result()
    except CadenceError as e:
        logger.warning("HealthCheck: the probe generation failed: %s", e)
        return False, f"the engine failed the probe: {e}"
    finally:
        task.cancel()  # aborts the probe if it still runs
        await asyncio.gather(task, return_exceptions=True)
    return True, "the probe generation passed"
