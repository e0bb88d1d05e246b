"""The front process: HTTP and gRPC on one event loop over one `EngineClient`.

`run_front_process` is its one entry, in the server's own process (one front) or in each
front worker that the launcher starts (`--api-workers N`, `front_worker_main`). It sits
above both adapters because it wires them; it never starts or watches another process
itself: its children (scheduler, detokenizer) belong to the launcher's `Supervisor`, which
hands over the model's facts and, through `watch`, any child's failure.

Life: the HTTP port is bound at once and answers 503 on /health until the model is loaded
and a warm-up request has passed (gRPC likewise: UNAVAILABLE, grpc.health.v1 NOT_SERVING);
SIGINT/SIGTERM end every request with 503 and stop within a second when idle; a failed
child ends every request with 503 naming it and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.server_args import ServerArgs
from cadence.supervisor import ChildFailed

logger = logging.getLogger("cadence.server")

WARMUP_TIMEOUT_S = 300.0


class StartupFailed(RuntimeError):
    """A start-up step failed for a reason the message explains (no traceback needed)."""


@dataclass
class FrontPlan:
    """What the launcher hands a front process."""

    args: ServerArgs
    paths: Any  # cadence.ipc.IpcPaths: the server's socket directory
    model_path: str
    index: int = 0  # which front (its own output address)
    sock: Any = None  # the launcher's listening HTTP socket (--api-workers); None: bind here
    shared_pause: Any = None  # a shared flag: a pause through one front holds them all
    shared_log: Any = None  # --log-requests as every front reads it (/configure_logging)


# The model's facts, once the scheduler reports them (None: stopping first). Blocking: it
# runs on a worker thread, and must return soon after `stopping` is set.
ModelFacts = Callable[[threading.Event], "dict | None"]
# Starts watching the children; calls its argument with a reason when one is lost.
Watch = Callable[[Callable[[str], None]], None]


def run_front_process(
    plan: FrontPlan,
    model_facts: ModelFacts,
    watch: Watch | None = None,
    stopping: threading.Event | None = None,
) -> int:
    """Serves until stopped; returns the process's exit code."""
    import uvloop

    front = FrontProcess(plan, model_facts, watch, stopping or threading.Event())
    return uvloop.run(front.run())


class _PathFilter(logging.Filter):
    """Drops uvicorn's access lines of the paths under these prefixes
    (--uvicorn-access-log-exclude-prefixes); its record's args are (client, method, path,
    http version, status)."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else ""
        return not (isinstance(path, str) and path.startswith(self.prefixes))


class FrontProcess:
    def __init__(
        self, plan: FrontPlan, model_facts: ModelFacts, watch: Watch | None, stopping
    ) -> None:
        from cadence.serving.state import ServerState

        self.plan = plan
        self.args = plan.args
        self.model_facts = model_facts
        self.watch = watch
        self.stopping = stopping  # set once stopping starts (also read by worker threads)
        self.state = ServerState(plan.args)
        self.exit_code = 0
        self.http: Any = None  # uvicorn.Server, made by _start_http
        self.serve_task: Any = None  # asyncio.Task serving HTTP, made by _start_http
        self.grpc: Any = None  # cadence.grpc.server.GrpcServer (None: --disable-grpc)
        self.client: Any = None  # cadence.front.ipc_client.IpcEngineClient, once connected
        self.pipeline_task: asyncio.Task | None = None
        # The engine client for the pipeline's stages placed here (its thinker), once connected.
        self.stage_client: asyncio.Future | None = None
        self.tasks: list[asyncio.Task] = []

    # ---- the steps ------------------------------------------------------------------------

    async def run(self) -> int:
        if self.stopping.is_set():  # a signal arrived while the launcher was starting us
            return 0
        self._install_signal_handlers()
        self._start_http()
        self._start_pipeline()  # its stages load while the model does
        try:
            await self._start_grpc()
            facts = await self._await_model()
            if facts is not None:
                await self._connect_engine(facts)
                self._watch_children()
                await self._warm_up()
                await self._await_pipeline()
                await self._open()
            await self.serve_task
        except (StartupFailed, ChildFailed) as e:
            logger.error("%s", e)
            await self._abandon()
        except Exception:
            logger.exception("start-up failed")
            await self._abandon()
        finally:
            await self._close()
        if not self.http.started and self.exit_code == 0:
            logger.error("could not bind %s:%d", self.args.host, self.args.port)
            self.exit_code = 1
        return self.exit_code

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)

    def _start_http(self) -> None:
        import contextlib

        import uvicorn

        from cadence.entrypoints.http_server import build_app

        class Server(uvicorn.Server):
            def capture_signals(self):  # the front's own handlers serve
                return contextlib.nullcontext()

        level = self.args.log_level_http or "warning"  # --log-level-http
        config = uvicorn.Config(
            build_app(self.state),
            host=self.args.host,
            port=self.args.port,
            log_level=level,
            lifespan="off",
            timeout_graceful_shutdown=1,
            access_log=level in ("debug", "info"),
        )
        if self.args.uvicorn_access_log_exclude_prefixes:
            logging.getLogger("uvicorn.access").addFilter(
                _PathFilter(self.args.uvicorn_access_log_exclude_prefixes)
            )
        self.http = Server(config)
        sockets = [self.plan.sock] if self.plan.sock is not None else None
        self.serve_task = asyncio.create_task(self.http.serve(sockets=sockets))

    def _start_pipeline(self) -> None:
        if self.args.pipeline is None:
            return

        def started(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                logger.error("%s", task.exception())
                self.stop(1)  # at once, not after the model has loaded

        self.stage_client = asyncio.get_running_loop().create_future()
        services = {"engine_client": self.stage_client}
        self.pipeline_task = asyncio.create_task(_start_pipeline(self.args, services))
        self.pipeline_task.add_done_callback(started)

    async def _start_grpc(self) -> None:
        if self.args.disable_grpc:
            return
        from cadence.grpc.server import GrpcServer

        self.grpc = GrpcServer(self.args, self.state)
        try:
            await self.grpc.start()
        except (RuntimeError, ValueError) as e:
            raise StartupFailed(
                f"gRPC: {e} (give another --grpc-port, or --disable-grpc)"
            ) from None

    async def _await_model(self) -> dict | None:
        """The scheduler's report of the loaded model, with the tokenizer loaded meanwhile;
        None when the server stops first."""
        from cadence.model_loader.tokenizer_files import load_tokenizer

        loop = asyncio.get_running_loop()
        tokenizer = loop.run_in_executor(
            None, load_tokenizer, self.plan.model_path, self.args.tokenizer_path
        )
        facts = await loop.run_in_executor(None, self.model_facts, self.stopping)
        if facts is None or self.stopping.is_set():
            return None
        if facts.get("status") != "ready":
            raise StartupFailed(
                f"the scheduler failed to load the model: {facts.get('error')}\n"
                f"{facts.get('traceback', '')}"
            )
        facts["tokenizer"] = await tokenizer
        return facts

    async def _connect_engine(self, facts: dict) -> None:
        from cadence.front.engine_client import ModelInfo
        from cadence.front.ipc_client import IpcEngineClient
        from cadence.front.request_checks import RequestOptions
        from cadence.front.tokenizer import FrontTokenizer
        from cadence.model_loader.tokenizer_files import tokenizer_dir

        args, plan = self.args, self.plan
        tokenizer = facts.pop("tokenizer")
        info = ModelInfo.from_facts(
            plan.model_path,
            args.tokenizer_path or plan.model_path,
            args.served_model_names(plan.model_path),
            tokenizer_dir(plan.model_path, args.tokenizer_path),
            facts,
        )
        self.state.runtime = {k: v for k, v in facts.items() if k != "status"}
        self.client = IpcEngineClient(
            plan.paths,
            info,
            FrontTokenizer(tokenizer),
            args.max_queued_requests + args.max_running_requests,
            index=plan.index,
            request_timeout_s=args.request_timeout_s,
            options=RequestOptions.of(args),
        )
        self.client.shared_pause = plan.shared_pause
        if plan.shared_log is not None:
            self.client.tm.log.shared = plan.shared_log
        self.client.start()
        self.state.client = self.client

    def _watch_children(self) -> None:
        if self.watch is None:
            return
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:  # on the supervisor's thread
            loop.call_soon_threadsafe(self._child_lost, reason)

        self.watch(lost)

    def _child_lost(self, reason: str) -> None:
        if not self.state.is_shutting_down:
            logger.error("%s; shutting down", reason)
            self.stop(1, f"{_as_503(reason)}; the server is shutting down")

    async def _warm_up(self) -> None:
        if self.args.skip_warmup:
            return
        from cadence.front.health import probe

        warmup = asyncio.ensure_future(probe(self.client, "Hello"))
        await asyncio.wait(
            {warmup, self.serve_task}, timeout=WARMUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if not warmup.done():
            warmup.cancel()
            if not self.state.is_shutting_down:
                raise RuntimeError(f"the warm-up request did not finish in {WARMUP_TIMEOUT_S:g} s")
        elif (error := warmup.exception()) is not None:
            raise error

    async def _await_pipeline(self) -> None:
        if self.pipeline_task is None or self.stage_client is None:
            return
        self.stage_client.set_result(self.client)  # the engine has passed its warm-up
        done = {self.pipeline_task, self.serve_task}
        await asyncio.wait(done, return_when=asyncio.FIRST_COMPLETED)
        if self.pipeline_task.done() and self.pipeline_task.exception() is None:
            self.state.pipeline = self.pipeline_task.result()
            self.tasks.append(asyncio.create_task(self._watch_pipeline()))

    async def _watch_pipeline(self) -> None:
        pipeline = self.state.pipeline
        assert pipeline is not None  # watched once started
        health = asyncio.create_task(follow_pipeline_health(self.state, self.grpc))
        try:
            await pipeline.failed.wait()
        finally:
            health.cancel()
        if not self.state.is_shutting_down:
            logger.error("the pipeline failed: %s", pipeline.failure)
            self.stop(1, "a pipeline stage process died; the server is shutting down")

    async def _open(self) -> None:
        if self.state.is_shutting_down:
            return
        self.state.is_ready = True
        if self.grpc is not None:
            await self.grpc.set_serving()
        logger.info("Cadence is ready: http://%s:%d", self.args.host, self.args.port)

    # ---- stopping -------------------------------------------------------------------------

    def stop(self, code: int = 0, reason: str = "the server is shutting down") -> None:
        """Ends every request with a 503 of `reason` now (not cut off by a grace period),
        turns health off on both protocols and lets the servers finish."""
        self.exit_code = self.exit_code or code
        if self.state.client is not None and not self.state.is_shutting_down:
            self.state.client.end_all(reason)
        if self.grpc is not None:
            self.grpc.begin_stop()
        self.state.is_shutting_down = True
        self.http.should_exit = True
        self.stopping.set()

    async def _abandon(self) -> None:
        self.stop(1)
        await self.serve_task

    async def _close(self) -> None:
        self.state.is_shutting_down = True
        self.stopping.set()
        for task in self.tasks:
            task.cancel()
        if self.grpc is not None:
            await self.grpc.stop()
        if self.client is not None:
            self.client.close()
        if self.pipeline_task is not None:
            self.pipeline_task.cancel()  # a start still under way stops what it started
            await asyncio.gather(self.pipeline_task, return_exceptions=True)
        if self.state.pipeline is not None:
            await self.state.pipeline.shutdown()


def _as_503(reason: str) -> str:
    """A child's failure as the 503 its requests end with ("the scheduler process died")."""
    if "made no progress" in reason:
        return reason.split(" made no progress")[0] + " stopped making progress"
    return reason.split(" (")[0]


async def _start_pipeline(args: ServerArgs, services: dict):
    """--pipeline: starts its stage processes; this front process owns their coordinator and
    runs the stages placed in the front (the speech thinker, on this server's engine client)."""
    from cadence.pipeline import Pipeline, PipelineStartError, load_pipeline_config

    try:
        config = load_pipeline_config(args.pipeline_path or "")
        return await Pipeline.start(
            config, restart_stages=args.pipeline_restart_stages, services=services
        )
    except (ValueError, PipelineStartError) as e:
        raise StartupFailed(f"--pipeline {args.pipeline}: {e}") from None


async def follow_pipeline_health(state, grpc_server) -> None:
    """grpc.health.v1 follows the pipeline as /health does: NOT_SERVING while a stage process
    is down or restarting, SERVING again once it is back (in the order the changes came)."""
    changes: asyncio.Queue = asyncio.Queue()
    coordinator = state.pipeline.coordinator
    coordinator.on_health_change.append(changes.put_nowait)
    try:
        while True:
            reason = await changes.get()
            if state.is_shutting_down:
                continue
            if reason is not None:
                logger.warning("the pipeline cannot serve: %s", reason)
            if grpc_server is not None:
                await grpc_server.set_health(reason is None)
    finally:
        coordinator.on_health_change.remove(changes.put_nowait)


# ---- a front worker of --api-workers ---------------------------------------------------------


def bind_shared_sockets(args: ServerArgs):
    """--api-workers: the HTTP listening socket every front worker accepts on, once nobody
    else holds the gRPC port they will share; StartupFailed naming the port otherwise."""
    sock = _bind_http(args)
    try:
        _check_grpc_port_free(args)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_http(args: ServerArgs):
    """The HTTP listening socket every front worker accepts on (SO_REUSEADDR only: a port
    another program holds is an error here, never a second listener)."""
    import socket

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise StartupFailed(f"cannot bind HTTP on {args.host}:{args.port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _check_grpc_port_free(args: ServerArgs) -> None:
    """The front workers share the gRPC port with SO_REUSEPORT, which would let them join a
    listener of another program; so first check, without it, that no one holds the port."""
    import socket

    if args.disable_grpc:
        return
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.effective_grpc_port))
        except OSError as e:
            raise StartupFailed(
                f"cannot bind gRPC on {args.host}:{args.effective_grpc_port}: {e.strerror} "
                "(give another --grpc-port, or --disable-grpc)"
            ) from None


def serve_front_workers(
    plan: FrontPlan, supervisor, engine: list, failure_text, stopping: threading.Event
) -> int:
    """--api-workers N: binds the HTTP socket, starts the engine and N front workers on the
    socket, relays the scheduler's report to each, and watches everything: any process lost
    stops the server with exit code 1 (fronts first, then the engine)."""
    import os

    args = plan.args
    sock = bind_shared_sockets(args)
    # Values of every front process in files (aggregated by /metrics), in the private socket
    # directory: removed with it. Set before any front process imports the client.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(plan.paths.directory, "metrics")
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], mode=0o700)
    for spec in engine:
        supervisor.start(spec)
    pipes = _start_front_workers(plan, supervisor, sock)
    sock.close()  # the workers hold it now
    logger.info("%d front processes serve http://%s:%d", args.api_workers, args.host, args.port)
    failed = threading.Event()
    supervisor.watch(_on_worker_failure(args, failure_text, stopping, failed))
    report = _relay_report(supervisor, engine[0].name, pipes, stopping)
    if report is not None and report.get("status") != "ready":
        logger.error("the scheduler failed to load the model: %s\n%s",
                     report.get("error"), report.get("traceback", ""))  # fmt: skip
    stopping.wait()
    return 1 if failed.is_set() else 0


def _start_front_workers(plan: FrontPlan, supervisor, sock) -> list:
    """Starts the front workers on `sock` (stopped first: rank 0); returns the pipes their
    model facts go through."""
    import dataclasses

    from cadence.front.request_log import RequestLog
    from cadence.supervisor import ProcessSpec

    pause, pipes = supervisor.ctx.RawValue("b", 0), []
    args = plan.args
    log = supervisor.ctx.RawValue(
        "b", RequestLog.encode(args.log_requests, args.log_requests_level)
    )
    for i in range(plan.args.api_workers):
        reader, writer = supervisor.ctx.Pipe(duplex=False)
        worker = dataclasses.replace(plan, index=i, sock=sock, shared_pause=pause, shared_log=log)
        target = "cadence.front_process:front_worker_main"
        spec = ProcessSpec(f"front {i}", target, (worker, reader), stop_rank=0, stop_grace_s=20)
        supervisor.start(spec)
        pipes.append(writer)
    return pipes


def _on_worker_failure(args: ServerArgs, failure_text, stopping, failed) -> Callable:
    """The supervisor's callback of --api-workers: a lost process stops the server (exit 1),
    unless the server is already stopping."""
    from cadence.front import metrics

    def on_failure(failure) -> None:
        # A signal to the whole process group (Ctrl-C, `timeout`) reaches everyone at once:
        # a child ending then is the shutdown, not a failure.
        is_shutdown = stopping.wait(0.3)
        level = logging.INFO if is_shutdown else logging.ERROR
        logger.log(level, "%s", failure_text(failure, args))
        metrics.mark_process_dead(failure.pid)
        if not is_shutdown:
            failed.set()
            stopping.set()

    return on_failure


def _relay_report(supervisor, name: str, pipes, stopping: threading.Event) -> dict | None:
    """Waits for the report of child `name` (the scheduler) and hands each front worker the
    same bytes."""
    import msgspec

    report = supervisor.wait_ready(name, stopping=stopping)
    if report is not None:
        data = msgspec.msgpack.encode(report)
        for pipe in pipes:
            pipe.send_bytes(data)
    return report


def front_worker_main(plan: FrontPlan, facts_pipe) -> None:
    """A front worker process: serves on the launcher's socket until SIGTERM (or the
    launcher's death). The launcher relays the scheduler's report through `facts_pipe` and
    watches every process itself."""
    logging.basicConfig(
        level=plan.args.log_level.upper(),
        format=f"%(asctime)s %(name)s[front {plan.index}] %(levelname)s %(message)s",
    )
    from cadence.plugins import load_plugins

    load_plugins()
    sys.exit(run_front_process(plan, lambda stopping: _read_facts(facts_pipe, stopping)))


def _read_facts(pipe, stopping: threading.Event) -> dict | None:
    import msgspec

    while not stopping.is_set():
        if pipe.poll(0.2):
            return msgspec.msgpack.decode(pipe.recv_bytes())
    return None
