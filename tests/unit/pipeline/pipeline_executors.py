"""Small executors for pipeline tests: no model, deterministic, importable by stage processes.

Payloads are {"x": tensor, "trace": [stage names]}; a request may carry "fail" (the stage
that must raise), "refuse" (the stage that passes on a refusal: a RequestError with status
"status" naming field "param", as the server's engine refuses a request), "sleep_ms" (an upper bound for each stage's random pause, drawn from the
rid so that a run is reproducible), "block" (the stage that waits until aborted) and
"stall" (the stage that blocks its whole process's event loop, so that transfers to it stay
unread: the moment to kill it mid-transfer).
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time

import torch

from cadence.errors import RequestError
from cadence.pipeline import Executor, StageRequest


def _pause_s(req: StageRequest, options: dict) -> float:
    bound = options.get("sleep_ms", 0)
    return random.Random(f"{req.rid}/{req.stage}").uniform(0, bound) / 1000 if bound else 0.0


async def _obey(req: StageRequest, options: dict) -> None:
    if options.get("fail") == req.stage:
        raise ValueError(f"asked to fail at {req.stage}")
    if options.get("refuse") == req.stage:
        status = options.get("status", 429)
        raise RequestError(status, f"{req.stage} refused with {status}", options.get("param"))
    if options.get("block") == req.stage:
        await asyncio.Event().wait()  # until cancelled by an abort
    if options.get("stall") == req.stage:
        time.sleep(60)  # the loop stops: nothing more is read in this process
    pause = _pause_s(req, options)
    if pause:
        await asyncio.sleep(pause)


class _Small(Executor):
    async def setup(self, ctx) -> None:
        if ctx.has_own_process:
            # Tiny tensors: one thread. Several stage processes each starting an OpenMP team
            # on a small shared machine stall each other for milliseconds per op.
            torch.set_num_threads(1)


class Step(_Small):
    """x -> x * scale + add, and the stage's name appended to the trace."""

    def __init__(self, add: float = 0.0, scale: float = 1.0):
        self.add, self.scale = add, scale

    async def run(self, req: StageRequest):
        data = req.data
        await _obey(req, data)
        return {
            **data,
            "x": data["x"] * self.scale + self.add,
            "trace": [*data["trace"], req.stage],
        }


class Producer(_Small):
    """Streams `num_chunks` chunks {"i", "x": x * (i + 1)}, then returns the input + trace."""

    def __init__(self, num_chunks: int = 4):
        self.num_chunks = num_chunks

    async def run(self, req: StageRequest):
        data = req.data
        for i in range(self.num_chunks):
            await req.emit({"i": i, "x": data["x"] * (i + 1), "options": _options(data)})
            await asyncio.sleep(0)
            if i == 1:
                await _obey(req, data)  # fail or block mid-stream
        return {**data, "trace": [*data["trace"], req.stage]}


class Collect(_Small):
    """Consumes its stream: x = sum of the chunks' x (plus the data input's x, if any)."""

    async def run(self, req: StageRequest):
        chunks = [chunk async for chunk in req.stream]
        total = sum(c["x"] for c in chunks)
        options = chunks[0]["options"] if chunks else {}
        trace = [req.stage]
        if req.data is not None:
            total = total + req.data["x"]
            options, trace = _options(req.data), [*req.data["trace"], req.stage]
        await _obey(req, options)
        return {**options, "x": total, "n": [c["i"] for c in chunks], "trace": trace}


class Sink(Executor):
    """Ignores its input; returns a fixed small result (for latency measurements)."""

    async def run(self, req: StageRequest):
        return {"ok": True}


class ServiceEcho(Step):
    """Step, and the result carries what the host handed it as service `name` (awaited when
    it is awaitable) and whether it has a process of its own."""

    def __init__(self, name: str = "tag", **kwargs):
        super().__init__(**kwargs)
        self.name = name

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        value = ctx.services.get(self.name)
        self.value = await value if inspect.isawaitable(value) else value
        self.own_process = ctx.has_own_process

    async def run(self, req: StageRequest):
        out = await super().run(req)
        return {**out, "service": self.value, "own_process": self.own_process}


class NotAnExecutor:
    def __init__(self, **kwargs):
        pass


class BrokenSetup(Executor):
    async def setup(self, ctx) -> None:
        raise RuntimeError("the weights are missing")

    async def run(self, req: StageRequest):
        return None


def concat(inputs: dict) -> dict:
    """Fan-in: the inputs' x concatenated in stage-name order, traces merged."""
    names = sorted(inputs)
    first = inputs[names[0]]
    return {
        **_options(first),
        "x": torch.cat([inputs[n]["x"].reshape(-1) for n in names]),
        "trace": [t for n in names for t in inputs[n]["trace"]],
    }


def _options(data: dict) -> dict:
    return {k: data[k] for k in ("fail", "block", "sleep_ms", "stall") if k in data}
