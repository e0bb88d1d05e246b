"""`Pipeline`: starts a pipeline's stage processes, owns its coordinator, watches for deaths.

    pipeline = await Pipeline.start("speech.yaml", restart_stages=True)
    result = await pipeline.coordinator.submit({"text": "hi"})
    await pipeline.shutdown()

Start-up sweeps what dead pipelines left (socket directories, shared memory), makes a
private socket directory (0700), binds the coordinator, starts one process per placement
group through a `Supervisor` and waits until each reports ready (a start-up error names the
process and carries its traceback), then sets up the stages placed in the front (in this
process, beside the coordinator: front.py) with the caller's `services`, watching the stage
processes meanwhile. The supervisor sees a death at once (well within a second): every
request in flight fails with a 503 naming the process, the coordinator reports unhealthy,
the dead process's shared memory is swept, and then either the process is started again
(`restart_stages`, within the supervisor's restart budget; with a relay whose group cannot
replace one member, such as torch, every process is) or `failed` is set, on which the
server exits non-zero. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from cadence.pipeline.config import FRONT, PipelineConfig, load_pipeline_config
from cadence.pipeline.coordinator import Addresses, Coordinator
from cadence.pipeline.errors import PipelineStartError, PipelineUnavailable
from cadence.pipeline.lifecycle import make_socket_dir
from cadence.pipeline.messages import StageProcessSpec, encode_spec
from cadence.pipeline.process import run_stage_process
from cadence.pipeline.relay.base import relay_class
from cadence.pipeline.relay.shm import sweep_dead_segments
from cadence.supervisor import Failure, ProcessSpec, Supervisor, exit_text

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
        self.supervisor = Supervisor(
            max_restarts=MAX_RESTARTS,
            restart_window_s=RESTART_WINDOW_S,
            start_method=config.start_method,
        )
        if config.start_method == "forkserver":
            self.supervisor.ctx.set_forkserver_preload(["cadence.pipeline.process"])
        self.failed = asyncio.Event()  # set when a stage died and will not come back
        self.failure: str | None = None
        self.coordinator: Coordinator | None = None
        self.pipeline_id = uuid.uuid4().hex[:8]
        self._closing = False
        self._restart_task: asyncio.Task | None = None
        self._store_address: str | None = None
        self._dir: str | None = None

    @property
    def processes(self) -> dict:
        """The current process of each placement group, by name."""
        return self.supervisor.processes()

    @classmethod
    async def start(
        cls,
        config: PipelineConfig | str,
        restart_stages: bool = False,
        services: Mapping[str, Any] | None = None,
    ) -> Pipeline:
        """Starts the pipeline (a config, or the path of a YAML declaration) and returns once
        every stage is ready; PipelineStartError (with everything stopped again) otherwise.
        `services` go to the setup of the stages placed in the front (`StageContext`)."""
        if isinstance(config, str):
            config = load_pipeline_config(config)
        relay_class(config.relay.backend)  # an unknown backend fails here, not in each process
        pipeline = cls(config, restart_stages)
        try:
            await pipeline._start(services or {})
        except BaseException:
            await pipeline.shutdown()
            raise
        return pipeline

    async def _start(self, services: Mapping[str, Any]) -> None:
        sweep_dead_segments()
        self._loop = asyncio.get_running_loop()
        self._dir = make_socket_dir()
        coordinator = f"ipc://{self._dir}/coordinator"
        processes = {p: f"ipc://{self._dir}/p{i}" for i, p in enumerate(self.graph.processes)}
        if self.graph.front_stages:
            processes[FRONT] = coordinator  # what stage processes send the front reaches it
        addresses = Addresses(
            coordinator=coordinator, broadcast=f"ipc://{self._dir}/broadcast", processes=processes
        )
        self.coordinator = Coordinator(self.config, addresses)
        self.coordinator.start()
        await self._launch(list(self.graph.processes), dropped=[])
        self.supervisor.watch(self._lost(restart=False), self._lost(restart=True))
        if self.graph.front_stages:
            await self._setup_front(services)
        if self.coordinator.unhealthy_reason == "starting":  # not since lost and restarted
            self.coordinator.mark_healthy()
        logger.info(
            "pipeline %s ready: %d stage(s) in %d process(es) and %d in the front, relay %s",
            self.config.name,
            len(self.graph.stages) - len(self.graph.front_stages),
            len(self.graph.processes),
            len(self.graph.front_stages),
            self.config.relay.backend,
        )

    async def _setup_front(self, services: Mapping[str, Any]) -> None:
        """Sets up the front stages once the processes are ready: a front stage may wait in
        its setup for a service (a server's engine client, once the model is loaded), and a
        stage process lost meanwhile (for good) fails the start at once."""
        setup = asyncio.ensure_future(self.coordinator.host_front_stages().setup(services))
        failed = asyncio.ensure_future(self.failed.wait())
        try:
            await asyncio.wait({setup, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not setup.done():
                setup.cancel()
                await asyncio.gather(setup, return_exceptions=True)
        if self.failed.is_set():
            raise PipelineStartError(f"the pipeline failed while starting: {self.failure}")
        setup.result()

    async def _launch(self, names: list[str], dropped: list[str]) -> None:
        if (
            not relay_class(self.config.relay.backend).can_replace_process
            or not self._store_address
        ):
            self._store_address = f"127.0.0.1:{_free_port()}"
        self.coordinator.forget_ready(names)
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
            self.supervisor.start(
                ProcessSpec(
                    name,
                    run_stage_process,
                    (encode_spec(spec),),
                    restart=self.restart_stages,
                    stop_grace_s=2.0,
                )
            )

        def is_alive(name: str) -> bool:
            return self.processes[name].exitcode is None

        await self.coordinator.wait_ready(set(names), self.config.ready_timeout_s, is_alive)

    # -- faults ---------------------------------------------------------------------------

    def _lost(self, restart: bool):
        """The supervisor's callback (on its thread) for a stage process that died: handed
        to the loop, to restart it (within the budget) or to give up."""

        def lost(failure: Failure) -> None:
            self._loop.call_soon_threadsafe(self._on_death, failure, restart)

        return lost

    def _on_death(self, failure: Failure, restart: bool) -> None:
        if self._closing:
            return
        name = failure.name
        stages = ", ".join(self.graph.stages_of(name))
        reason = f"stage process {name} (stages: {stages}; pid {failure.pid}) {exit_text(failure.exitcode)}"
        logger.error("%s", reason)
        dropped = self.coordinator.mark_unhealthy(reason)
        sweep_dead_segments(pids={failure.pid})
        if not self.restart_stages:
            self._give_up(f"{reason}; the pipeline stops (restarting stages is off)")
        elif not restart:
            self._give_up(
                f"{reason}; it died more than {MAX_RESTARTS} times in {RESTART_WINDOW_S:g} s"
            )
        elif self._restart_task is None or self._restart_task.done():
            self._restart_task = self._loop.create_task(self._restart(name, reason, dropped))

    async def _restart(self, name: str, reason: str, dropped: list[str]) -> None:
        names = [name]
        if not relay_class(self.config.relay.backend).can_replace_process:
            names = list(self.graph.processes)  # the group cannot take one new member
            others = [n for n in names if n != name]
            pids = {self.processes[n].pid for n in others}
            await asyncio.to_thread(self.supervisor.stop, others)
            sweep_dead_segments(pids=pids)
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
        if self._restart_task is not None:
            self._restart_task.cancel()
        pids = {p.pid for p in self.processes.values() if p.pid}
        if self.coordinator is not None:
            self.coordinator.tracker.fail_all(PipelineUnavailable("the pipeline is shutting down"))
            self.coordinator.shutdown_stages()
        # Asked to shut down above; a process still there after the grace gets SIGTERM.
        await asyncio.to_thread(self.supervisor.stop, None, STOP_GRACE_S)
        if self.coordinator is not None:
            if self.coordinator.front is not None:
                await self.coordinator.front.aclose()
            self.coordinator.close()
        sweep_dead_segments(pids=pids)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
