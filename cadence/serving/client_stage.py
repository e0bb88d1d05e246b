"""The server's own engine as a pipeline stage: an LLM stage that generates through the
server's `EngineClient`, on the server's scheduler, KV pool and prefix cache.

Declared with `placement: front` (the speech pipeline's thinker, docs/speech.md): it runs in
the server's front process, beside the pipeline's coordinator, and the front process hands
it its engine client (the "engine_client" service of `Pipeline.start`). So `cadence serve
--pipeline speech` loads the model once; a chat answer spoken is one more request of the
server, admitted, budgeted and aborted like every other. Without a server (a pipeline
started on its own, `LocalPipeline`) there is no engine client to wrap: such pipelines
declare `cadence.engine_stage:EngineStage`, which runs an `Engine` of its own.

Requests and chunks are `EngineStage`'s, so either serves the same pipeline: {"prompt": str}
or {"input_ids": [int]} with "sampling_params" (generated, streamed as text deltas), or
{"text": str} (passed through as one chunk), each with "options"; each chunk is {"text",
"options"}, the last one of a generation with "meta" {"finish_reason", "prompt_tokens",
"completion_tokens"}; {"engine_load": true} answers one chunk whose "meta" is the load of
the server's scheduler. An aborted request (its client gone, a stage failed) closes the
generation's stream, which aborts it in the scheduler: its KV pages go back at once.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from cadence.io_struct import GenerateReqInput
from cadence.pipeline import Executor, StageContext, StageRequest

ENGINE_CLIENT = "engine_client"  # the service a server hands its front stages
META_FIELDS = ("finish_reason", "prompt_tokens", "completion_tokens")


class EngineClientStage(Executor):
    """Streams the text the server's LLM writes; see the module docstring."""

    def __init__(self) -> None:
        self.client: Any = None  # cadence.front.EngineClient, from the front process

    async def setup(self, ctx: StageContext) -> None:
        client = ctx.services.get(ENGINE_CLIENT)
        if client is None:
            raise RuntimeError(
                f"stage {ctx.name!r} generates with a Cadence server's engine: declare it with "
                "`placement: front` and serve the pipeline with `cadence serve --pipeline`; a "
                "pipeline run without a server declares cadence.engine_stage:EngineStage instead"
            )
        if inspect.isawaitable(client):  # a server hands it over once the model is loaded
            client = await client
        self.client = client

    async def run(self, req: StageRequest) -> Any:
        data = req.data
        options = data.get("options")
        if "text" in data:
            await req.emit({"text": data["text"], "options": options})
            return None
        if data.get("engine_load"):
            await req.emit({"text": "", "options": options, "meta": await self._load()})
            return None
        obj = GenerateReqInput(
            text=data.get("prompt"),
            input_ids=data.get("input_ids"),
            sampling_params=dict(data.get("sampling_params") or {}),
            stream=True,
            rid=req.rid,
        )
        # Closed when the run ends or is cancelled: closing aborts what still runs.
        async with contextlib.aclosing(self.client.generate(obj)) as outputs:
            async for out in outputs:
                meta = out.get("meta_info", {})
                chunk = {"text": out.get("text", ""), "options": options}
                if meta.get("finish_reason") is not None:
                    chunk["meta"] = {k: meta.get(k) for k in META_FIELDS}
                if chunk["text"] or "meta" in chunk:
                    await req.emit(chunk)
        return None

    async def _load(self) -> dict:
        loads = await self.client.get_load()  # one per data-parallel rank
        fields = ("num_used_tokens", "num_running_reqs", "num_waiting_reqs")
        return {f: sum(getattr(load, f) for load in loads) for f in fields}
