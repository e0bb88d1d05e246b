"""`Pipeline`: starts a pipeline's stage processes, owns its coordinator, watches for deaths.

    pipeline = await Pipeline.start("speech.yaml", restart_stages=True)
    result = await pipeline.coordinator.submit({"text": "hi"})
    await pipeline.shutdown()

Start-up sweeps what dead pipelines left (socket directories, shared memory), makes a
private socket directory (0700), binds the coordinator, spawns one process per placement
group and waits until each reports ready (a start-up error names the process and carries its
traceback). A thread waits on the processes' sentinels, so a death is seen at once (well
within a second): every request in flight fails with a 503 naming the process, the
coordinator reports unhealthy, the dead process's shared memory is swept, and then either
the process is started again (`restart_stages`; with a relay whose group cannot replace one
member, such as torch, every process is) or `failed` is set, on which the server exits
non-zero. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import threading
import time
import uuid

from cadence.pipeline.config import PipelineConfig, load_pipeline_config
from cadence.pipeline.coordinator import Addresses, Coordinator
from cadence.pipeline.errors import PipelineUnavailable
from cadence.pipeline.lifecycle import make_socket_dir
from cadence.pipeline.messages import StageProcessSpec, encode_spec
from cadence.pipeline.process import run_stage_process
from cadence.pipeline.relay.base import relay_class
from cadence.pipeline.relay.shm import sweep_dead_segments

logger = logging.getLogger("cadence.pipeline")

MAX_RESTARTS = 3  # per process within RESTART_WINDOW_S; past that the pipeline gives up
RESTART_WINDOW_S = 300.0
STOP_GRACE_S = 5.0


class Pipeline:
    """A running multi-process pipeline; see the module docstring."""

    def __init__(self, config: PipelineConfig, restart_stages: bool = False):
        self.config = config
        self.graph = config.graph
        self.restart_stages = restart_stages
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self.failed = asyncio.Event()  # set when a stage died and will not come back
        self.failure: str | None = None
        self.coordinator: Coordinator | None = None
        self.pipeline_id = uuid.uuid4().hex[:8]
        self._closing = False
        self._stopping = threading.Event()
        self._deaths: dict[str, list[float]] = {}
        self._restart_task: asyncio.Task | None = None
        self._watcher: threading.Thread | None = None
        self._store_address: str | None = None
        self._dir: str | None = None

    @classmethod
    async def start(cls, config: PipelineConfig | str, restart_stages: bool = False) -> Pipeline:
        """Starts the pipeline (a config, or the path of a YAML declaration) and returns once
        every stage is ready; PipelineStartError (with everything stopped again) otherwise."""
        if isinstance(config, str):
            config = load_pipeline_config(config)
        relay_class(config.relay.backend)  # an unknown backend fails here, not in each process
        pipeline = cls(config, restart_stages)
        try:
            await pipeline._start()
        except BaseException:
            await pipeline.shutdown()
            raise
        return pipeline

    async def _start(self) -> None:
        sweep_dead_segments()
        self._loop = asyncio.get_running_loop()
        self._dir = make_socket_dir()
        addresses = Addresses(
            coordinator=f"ipc://{self._dir}/coordinator",
            broadcast=f"ipc://{self._dir}/broadcast",
            processes={p: f"ipc://{self._dir}/p{i}" for i, p in enumerate(self.graph.processes)},
        )
        self.coordinator = Coordinator(self.config, addresses)
        self.coordinator.start()
        await self._launch(list(self.graph.processes), dropped=[])
        self.coordinator.mark_healthy()
        self._watcher = threading.Thread(target=self._watch, name="pipeline-watch", daemon=True)
        self._watcher.start()
        logger.info(
            "pipeline %s ready: %d stage(s) in %d process(es), relay %s",
            self.config.name,
            len(self.graph.stages),
            len(self.graph.processes),
            self.config.relay.backend,
        )

    async def _launch(self, names: list[str], dropped: list[str]) -> None:
        if (
            not relay_class(self.config.relay.backend).can_replace_process
            or not self._store_address
        ):
            self._store_address = f"127.0.0.1:{_free_port()}"
        self.coordinator.forget_ready(names)
        context = mp.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            context.set_forkserver_preload(["cadence.pipeline.process"])
        for name in names:
            spec = StageProcessSpec(
                config=self.config.to_dict(),
                process=name,
                pipeline_id=self.pipeline_id,
                coordinator_address=self.coordinator.addresses.coordinator,
                broadcast_address=self.coordinator.addresses.broadcast,
                process_addresses=self.coordinator.addresses.processes,
                store_address=self._store_address,
                parent_pid=os.getpid(),
                dropped=dropped,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            )
            proc = context.Process(
                target=run_stage_process, args=(encode_spec(spec),), name=f"stage {name}"
            )
            proc.start()
            self.processes[name] = proc

        def is_alive(name: str) -> bool:
            return self.processes[name].exitcode is None

        await self.coordinator.wait_ready(set(names), self.config.ready_timeout_s, is_alive)

    # -- faults ---------------------------------------------------------------------------

    def _watch(self) -> None:
        """Thread: wakes on any stage process's exit and hands it to the loop."""
        while not self._stopping.is_set():
            procs = {p.sentinel: (n, p) for n, p in self.processes.items() if p.exitcode is None}
            if not procs:
                time.sleep(0.1)
                continue
            for sentinel in multiprocessing.connection.wait(list(procs), timeout=0.2):
                name, proc = procs[sentinel]
                proc.join(timeout=1)  # reap it: its pid is then dead to the shm sweep
                if not self._stopping.is_set():
                    self._loop.call_soon_threadsafe(self._on_death, name, proc)

    def _on_death(self, name: str, proc) -> None:
        if self._closing or self.processes.get(name) is not proc:
            return  # shutting down, or a process we stopped on purpose
        stages = ", ".join(self.graph.stages_of(name))
        reason = f"stage process {name} (stages: {stages}; pid {proc.pid}) {_exit_text(proc)}"
        logger.error("%s", reason)
        dropped = self.coordinator.mark_unhealthy(reason)
        sweep_dead_segments(pids={proc.pid})
        now = time.monotonic()
        deaths = [t for t in self._deaths.get(name, []) if t > now - RESTART_WINDOW_S] + [now]
        self._deaths[name] = deaths
        if not self.restart_stages:
            self._give_up(f"{reason}; the pipeline stops (restarting stages is off)")
        elif len(deaths) > MAX_RESTARTS:
            self._give_up(f"{reason}; it died {len(deaths)} times in {RESTART_WINDOW_S:g} s")
        elif self._restart_task is None or self._restart_task.done():
            self._restart_task = self._loop.create_task(self._restart(name, reason, dropped))

    async def _restart(self, name: str, reason: str, dropped: list[str]) -> None:
        names = [name]
        if not relay_class(self.config.relay.backend).can_replace_process:
            names = list(self.graph.processes)  # the group cannot take one new member
            others = [p for n, p in self.processes.items() if n != name]
            for n in names:
                self.processes.pop(n, None)
            await asyncio.to_thread(_stop, others, 0.0)
            sweep_dead_segments(pids={p.pid for p in others})
        logger.warning("restarting stage process(es): %s", ", ".join(names))
        try:
            await self._launch(names, dropped)
        except Exception as e:
            self._give_up(f"{reason}; restarting it failed: {e}")
            return
        self.coordinator.mark_healthy()
        logger.info("stage process(es) %s restarted; the pipeline is healthy", ", ".join(names))

    def _give_up(self, failure: str) -> None:
        self.failure = failure
        self.coordinator.unhealthy_reason = failure
        self.failed.set()

    # -- shutdown -------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stops every stage process (Shutdown, then SIGTERM, then SIGKILL), removes their
        shared memory and the socket directory; idempotent."""
        if self._closing:
            return
        self._closing = True
        self._stopping.set()
        if self._restart_task is not None:
            self._restart_task.cancel()
        procs = list(self.processes.values())
        if self.coordinator is not None:
            self.coordinator.tracker.fail_all(PipelineUnavailable("the pipeline is shutting down"))
            self.coordinator.shutdown_stages()
        await asyncio.to_thread(_stop, procs, STOP_GRACE_S)
        if self.coordinator is not None:
            self.coordinator.close()
        sweep_dead_segments(pids={p.pid for p in procs if p.pid})
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 2)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def _stop(procs, grace: float) -> None:
    """Waits up to `grace` for a clean exit, then SIGTERM, then SIGKILL; reaps them all."""
    deadline = time.monotonic() + grace
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.terminate()
            proc.join(timeout=2)
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
            proc.join(timeout=2)


def _exit_text(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
