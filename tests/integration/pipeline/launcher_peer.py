"""A launcher in a process of its own, for the test that SIGKILLs one: it starts a linear
pipeline over shm, reports its stage processes' pids, and waits to be killed."""

from __future__ import annotations

import asyncio

from pipeline_graphs import linear

from cadence.pipeline import Pipeline, RelayConfig


def run_launcher(report) -> None:
    async def main() -> None:
        pipeline = await Pipeline.start(linear(RelayConfig(backend="shm", slot_mb=1 / 16)))
        report.send([proc.pid for proc in pipeline.processes.values()])
        await asyncio.Event().wait()

    asyncio.run(main())
