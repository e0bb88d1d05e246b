"""The in-process `Engine` as a pipeline stage: an LLM that streams its answer's text to the
stages after it (the `thinker` of the speech pipeline, docs/speech.md).

A request is {"prompt": str} or {"input_ids": [int]} (already templated) with
"sampling_params", or {"text": str}: text that needs no LLM, passed through as one chunk, so
that one pipeline serves both. Each chunk is {"text": delta, "options": the request's
"options"}: what the stages downstream need to know rides along. The LLM's last chunk also
carries "meta": {"finish_reason", "prompt_tokens", "completion_tokens"} (finish_reason as
the native API gives it). The stage's own result is None; its text goes out on its stream
edges only. A request {"engine_load": true} answers one empty chunk whose "meta" is the
engine's load (num_used_tokens: KV tokens held, num_running_reqs, num_waiting_reqs): how a
leak check reads a stage process's KV pages through the pipeline itself.

Lives beside `engine.py`, not in a feature package: it is the one place a pipeline stage
imports the engine, and nothing imports it but a declaration (by name).
"""

from __future__ import annotations

import asyncio
from typing import Any

from cadence.engine import Engine
from cadence.pipeline import Executor, StageContext, StageRequest


class EngineStage(Executor):
    """Streams an LLM's text. `model_path` (None: the default model) and `engine_args`
    (ServerArgs fields, e.g. max_total_tokens) configure its `Engine`; `llm: false` loads
    none, for a pipeline that only ever passes text through."""

    def __init__(
        self, llm: bool = True, model_path: str | None = None, engine_args: dict | None = None
    ):
        self.has_llm = llm
        self.model_path = model_path
        self.engine_args = dict(engine_args or {})
        self.engine: Engine | None = None

    async def setup(self, ctx: StageContext) -> None:
        if self.has_llm:
            self.engine = await asyncio.to_thread(Engine, self.model_path, **self.engine_args)

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            self.engine = None

    async def _load(self) -> dict:
        if self.engine is None:
            return {"num_used_tokens": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}
        load = await asyncio.to_thread(self.engine.get_load)
        return {
            "num_used_tokens": load.num_used_tokens,
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
        }

    async def run(self, req: StageRequest) -> Any:
        data = req.data
        options = data.get("options")
        if "text" in data:
            await req.emit({"text": data["text"], "options": options})
            return None
        if data.get("engine_load"):
            await req.emit({"text": "", "options": options, "meta": await self._load()})
            return None
        if self.engine is None:
            raise RuntimeError("this stage runs no LLM (llm: false): send text, not a prompt")
        params = dict(data.get("sampling_params") or {})
        outputs = self.engine.async_generate(
            data.get("prompt"), params, input_ids=data.get("input_ids"), stream=True
        )
        async for out in outputs:
            meta = out.get("meta_info", {})
            chunk = {"text": out.get("text", ""), "options": options}
            if meta.get("finish_reason") is not None:
                chunk["meta"] = {
                    k: meta.get(k) for k in ("finish_reason", "prompt_tokens", "completion_tokens")
                }
            if chunk["text"] or "meta" in chunk:
                await req.emit(chunk)
        return None
