"""A stage process: `run_stage_process(spec)` hosts one or more colocated stages.

Start-up: build the relay (joining its group, for group backends), build and set up each
stage's executor, bind this process's PULL socket, subscribe to the coordinator's broadcasts,
and report StageReady once the first broadcast arrives (so no Abort published after that
can be missed). Then one event loop: every message from either socket is dispatched by type
through one table. Shutdown (or SIGTERM) cancels what runs, closes the executors and the
relay (its shared memory included) and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import traceback
from typing import Any

import zmq

from cadence.liveness import die_with_parent, is_alive
from cadence.pipeline import channels
from cadence.pipeline.config import PipelineConfig, resolve
from cadence.pipeline.executor import Executor, StageContext
from cadence.pipeline.messages import (
    Abort,
    DataAck,
    DataReady,
    ProfilerStart,
    ProfilerStop,
    Shutdown,
    StageProcessSpec,
    StageReady,
    StageStats,
    StatsQuery,
    Submit,
    decode_spec,
)
from cadence.pipeline.relay.base import Relay, RelayContext, create_relay
from cadence.pipeline.stage import StageRuntime
from cadence.pipeline.transport import Transport

logger = logging.getLogger("cadence.pipeline.stage")

PRUNE_PERIOD_S = 10.0


def process_device(config: PipelineConfig, process: str) -> str:
    """A process's device: its first stage's (colocated stages normally share one)."""
    return config.stage(config.graph.stages_of(process)[0]).device


def build_executor(config: PipelineConfig, stage: str) -> Executor:
    cfg = config.stage(stage)
    executor = resolve(cfg.executor)(**cfg.args)
    if not isinstance(executor, Executor):
        raise TypeError(
            f"stage {stage!r}: {cfg.executor} returned a {type(executor).__name__}, "
            "not a cadence.pipeline.Executor"
        )
    return executor


class StageProcess:
    def __init__(self, spec: StageProcessSpec):
        self.spec = spec
        self.config = PipelineConfig.from_dict(spec.config)
        self.graph = self.config.graph
        self.stages = self.graph.stages_of(spec.process)
        self.relay: Relay | None = None
        self.transport: Transport | None = None
        self.executors: dict[str, Executor] = {}
        self.profiler = None
        self.profile_dir: str | None = None

    async def run(self) -> int:
        self.stopped = asyncio.Event()
        self.subscribed = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stopped.set)
        unwatch = self._watch_launcher(loop)
        ctx = zmq.Context()
        coordinator = channels.connect(ctx, zmq.PUSH, self.spec.coordinator_address)
        pull = channels.bind(ctx, zmq.PULL, self.spec.process_addresses[self.spec.process])
        sub = channels.connect(ctx, zmq.SUB, self.spec.broadcast_address)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        inboxes = [
            channels.Inbox(pull, self.dispatch, self.spec.process),
            channels.Inbox(sub, self.dispatch_broadcast, self.spec.process),
        ]
        try:
            await self._setup(ctx)
            for inbox in inboxes:
                inbox.start()
            await asyncio.wait(
                [loop.create_task(self.subscribed.wait()), loop.create_task(self.stopped.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            channels.send(coordinator, StageReady(process=self.spec.process, pid=os.getpid()))
            pruner = loop.create_task(self._prune())
            await self.stopped.wait()
            pruner.cancel()
            return 0
        except Exception as e:
            logger.error("stage process %s failed to start: %s", self.spec.process, e)
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            ready = StageReady(process=self.spec.process, pid=os.getpid(), error=error)
            channels.send(coordinator, ready)
            return 1
        finally:
            unwatch()
            for inbox in inboxes:
                inbox.stop()
            await self._teardown()
            for sock in (coordinator, pull, sub):
                sock.close(linger=0)
            ctx.term()

    def _watch_launcher(self, loop: asyncio.AbstractEventLoop):
        """Stops this process when the launcher dies; returns what ends the watch.

        PR_SET_PDEATHSIG is not enough: under forkserver our parent is the fork server, and
        it lives until every child it forked has closed the liveness pipe each one inherits,
        so a SIGKILLed launcher would leave us and it running. A pidfd of the launcher wakes
        the loop at its death (polled twice a second where pidfds are missing)."""
        pid = self.spec.parent_pid
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.stopped.set()
            return lambda: None
        except (AttributeError, OSError):
            task = loop.create_task(self._poll_launcher(pid))
            return task.cancel
        loop.add_reader(fd, self.stopped.set)

        def unwatch() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        return unwatch

    async def _poll_launcher(self, pid: int) -> None:
        while is_alive(pid):
            await asyncio.sleep(0.5)
        self.stopped.set()

    async def _setup(self, ctx: zmq.Context) -> None:
        graph, spec = self.graph, self.spec
        if len(graph.processes) > 1:
            rctx = RelayContext(
                pipeline_id=spec.pipeline_id,
                rank=graph.rank_of(spec.process),
                world_size=len(graph.processes),
                device=process_device(self.config, spec.process),
                config=self.config.relay,
                store_address=spec.store_address,
                peer_devices=tuple(process_device(self.config, p) for p in graph.processes),
            )
            self.relay = await asyncio.to_thread(create_relay, rctx)  # a group join blocks
        self.transport = Transport(
            self.config,
            spec.process,
            self.relay,
            ctx,
            spec.coordinator_address,
            spec.process_addresses,
        )
        for rid in spec.dropped:
            self.transport.drop(rid)
        for name in self.stages:
            cfg = self.config.stage(name)
            executor = self.executors[name] = build_executor(self.config, name)
            await executor.setup(StageContext(name, cfg.device, spec.process))
            merge = resolve(cfg.merge) if cfg.merge else None
            self.transport.runtimes[name] = StageRuntime(
                cfg, graph, executor, self.transport, merge, self.transport.on_finished
            )
        self.handlers = {
            Submit: self.transport.on_submit,
            DataReady: self.transport.on_data_ready,
            DataAck: self.transport.on_data_ack,
        }
        self.broadcast_handlers = {
            Abort: self.on_abort,
            Shutdown: lambda msg: self.stopped.set(),
            StatsQuery: self.on_stats,
            ProfilerStart: self.on_profiler_start,
            ProfilerStop: self.on_profiler_stop,
        }

    async def _teardown(self) -> None:
        if self.transport is not None:
            for runtime in self.transport.runtimes.values():
                for rid in list(runtime.requests):
                    runtime.abort(rid)
        for name, executor in self.executors.items():
            try:
                await executor.close()
            except Exception:
                logger.exception("stage %s: closing its executor failed", name)
        if self.relay is not None:
            self.relay.close()
        if self.transport is not None:
            self.transport.close()

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(self, msg: Any, frame) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.warning("%s: unexpected %s", self.spec.process, type(msg).__name__)
            return
        handler(msg, frame)

    def dispatch_broadcast(self, msg: Any, frame) -> None:
        self.subscribed.set()
        handler = self.broadcast_handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def on_abort(self, msg: Abort) -> None:
        for rid in msg.rids:
            self.transport.drop(rid)

    def on_stats(self, msg: StatsQuery) -> None:
        stats = StageStats(
            token=msg.token,
            process=self.spec.process,
            pid=os.getpid(),
            live={name: list(rt.requests) for name, rt in self.transport.runtimes.items()},
            relay=self.relay.stats() if self.relay is not None else {},
        )
        channels.send(self.transport.coordinator, stats)

    def on_profiler_start(self, msg: ProfilerStart) -> None:
        import torch.profiler

        if self.profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if any(self.config.stage(s).device.startswith("cuda") for s in self.stages):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.profile_dir = msg.output_dir

    def on_profiler_stop(self, msg: ProfilerStop) -> None:
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        os.makedirs(self.profile_dir, exist_ok=True)
        path = os.path.join(self.profile_dir, f"{self.spec.process}-{os.getpid()}.json")
        profiler.export_chrome_trace(path)

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_PERIOD_S)
            self.transport.prune_dropped()


def run_stage_process(spec_bytes: bytes) -> None:
    """Entry of a stage process (spawned by the launcher); exits with the loop's status."""
    spec = decode_spec(spec_bytes)
    die_with_parent()  # the forkserver's death, which follows the launcher's, ends us too
    if not is_alive(spec.parent_pid):
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s {spec.process} %(name)s %(levelname)s %(message)s",
    )
    import uvloop

    sys.exit(uvloop.run(StageProcess(spec).run()))
