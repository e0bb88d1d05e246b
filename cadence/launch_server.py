"""`cadence serve`: the front process (HTTP and gRPC on one event loop) plus the scheduler
and detokenizer processes. `--help` imports nothing heavy.

Life cycle: the HTTP port is bound at once and answers 503 on /health until the model is
loaded and a warm-up generation has passed (the gRPC port likewise: UNAVAILABLE, and
grpc.health.v1 NOT_SERVING until then, NOT_SERVING again once stopping). SIGINT/SIGTERM stop everything within seconds
and remove the socket directory; if a child process dies, the server exits non-zero naming
it. Children also die with the front process (PR_SET_PDEATHSIG), so nothing is orphaned.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cadence.server_args import ServerArgs, add_cli_args, from_cli_args

logger = logging.getLogger("cadence.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence serve", description="Serve a model over HTTP and gRPC."
    )
    add_cli_args(parser)
    return parser


def _child_start(parent_pid: int) -> None:
    """First thing in a child: die with the parent, even if it is already gone."""
    import os

    from cadence.liveness import die_with_parent

    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)


def _scheduler_entry(args, paths, model_path, ready_pipe, parent_pid, heartbeat):
    _child_start(parent_pid)
    from cadence.scheduler.process import run_scheduler_process

    run_scheduler_process(args, paths, model_path, ready_pipe, heartbeat)


def _detokenizer_entry(args, paths, tokenizer_source, parent_pid, heartbeat):
    _child_start(parent_pid)
    from cadence.detokenizer.process import run_detokenizer_process

    run_detokenizer_process(args, paths, tokenizer_source, heartbeat)


class ChildDied(RuntimeError):
    pass


class StartupFailed(RuntimeError):
    """A start-up step failed for a reason the message explains (no traceback needed)."""


async def follow_pipeline_health(state, grpc_server) -> None:
    """grpc.health.v1 follows the pipeline as /health does: NOT_SERVING while a stage process
    is down or restarting, SERVING again once it is back (in the order the changes came)."""
    import asyncio

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


async def _start_pipeline(args: ServerArgs):
    """--pipeline: starts its stage processes; this front process owns their coordinator."""
    from cadence.pipeline import Pipeline, PipelineStartError, load_pipeline_config

    try:
        config = load_pipeline_config(args.pipeline_path)
        return await Pipeline.start(config, restart_stages=args.pipeline_restart_stages)
    except (ValueError, PipelineStartError) as e:
        raise StartupFailed(f"--pipeline {args.pipeline}: {e}") from None


def _wait_ready(reader, children, stopping, timeout: float = 1800.0) -> dict:
    import time

    import msgspec

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping.is_set():
        if reader.poll(0.5):
            return msgspec.msgpack.decode(reader.recv_bytes())
        for proc in children:
            if proc.exitcode is not None:
                raise ChildDied(
                    f"the {proc.name} process died during start-up (exit code {proc.exitcode})"
                )
    if stopping.is_set():
        return {"status": "stopped"}
    raise ChildDied("the scheduler did not report ready in time")


async def _serve(
    args: ServerArgs,
    paths,
    children,
    reader,
    model_path: str,
    stopping,
    heartbeats,
    sock=None,
    index: int = 0,
    shared_pause=None,
) -> int:
    """One front process: HTTP (on `sock` when given, the launcher's shared listening socket)
    and gRPC on one event loop, front `index` of the server (its own output address).
    `reader` brings the scheduler's ready report; `children` are the processes whose death
    ends this one (none in a front worker: its launcher watches them)."""
    import asyncio
    import multiprocessing.connection
    import signal

    import uvicorn

    from cadence.entrypoints.http_server import build_app
    from cadence.front.engine_client import ModelInfo
    from cadence.front.ipc_client import IpcEngineClient
    from cadence.front.request_checks import RequestOptions
    from cadence.front.tokenizer import FrontTokenizer
    from cadence.model_loader.loader import load_tokenizer, tokenizer_dir
    from cadence.serving.state import ServerState

    class Server(uvicorn.Server):
        def capture_signals(self):  # we install our own handlers below
            import contextlib

            return contextlib.nullcontext()

    loop = asyncio.get_running_loop()
    state = ServerState(args)
    server = Server(
        uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            access_log=False,
        )
    )
    exit_code = 0
    grpc_server = None

    def stop(code: int = 0, reason: str = "the server is shutting down"):
        nonlocal exit_code
        exit_code = exit_code or code
        if state.client is not None and not state.is_shutting_down:
            state.client.end_all(
                reason
            )  # answered now, not cut off by the HTTP server's grace period
        if grpc_server is not None:
            grpc_server.begin_stop()  # health NOT_SERVING at once; calls in flight get a grace period
        state.is_shutting_down = True
        server.should_exit = True
        stopping.set()

    if stopping.is_set():  # a signal arrived while we were starting
        return 0

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    serve_task = asyncio.create_task(server.serve(sockets=[sock] if sock is not None else None))
    client = None
    pipeline_task = None
    if args.pipeline is not None:  # its stages load while the model does

        def pipeline_started(task):
            if not task.cancelled() and task.exception() is not None:
                logger.error("%s", task.exception())
                stop(1)  # at once, not after the model has loaded

        pipeline_task = asyncio.create_task(_start_pipeline(args))
        pipeline_task.add_done_callback(pipeline_started)
    try:
        if not args.disable_grpc:
            from cadence.grpc.server import GrpcServer

            grpc_server = GrpcServer(args, state)
            try:
                await grpc_server.start()
            except (RuntimeError, ValueError) as e:
                raise StartupFailed(
                    f"gRPC: {e} (give another --grpc-port, or --disable-grpc)"
                ) from None
        tokenizer_future = loop.run_in_executor(
            None, load_tokenizer, model_path, args.tokenizer_path
        )
        ready = await loop.run_in_executor(None, _wait_ready, reader, children, stopping)
        if ready.get("status") == "stopped":
            await serve_task
            return exit_code
        if ready.get("status") != "ready":
            logger.error(
                "the scheduler failed to load the model: %s\n%s",
                ready.get("error"),
                ready.get("traceback", ""),
            )
            stop(1)
            await serve_task
            return exit_code
        tokenizer = await tokenizer_future
        info = ModelInfo.from_facts(
            model_path,
            args.tokenizer_path or model_path,
            args.served_model_names(model_path),
            tokenizer_dir(model_path, args.tokenizer_path),
            ready,
        )
        state.runtime = {k: v for k, v in ready.items() if k != "status"}
        client = IpcEngineClient(
            paths,
            info,
            FrontTokenizer(tokenizer),
            args.max_queued_requests + args.max_running_requests,
            index=index,
            request_timeout_s=args.request_timeout_s,
            options=RequestOptions.of(args),
        )
        client.shared_pause = shared_pause
        client.start()
        state.client = client

        def watch():
            # Wakes up regularly so that shutting down never waits on this thread.
            while not stopping.is_set():
                fired = multiprocessing.connection.wait([p.sentinel for p in children], timeout=0.5)
                if fired:
                    dead = [p for p in children if p.sentinel in fired]
                    for p in dead:  # the sentinel can fire just before the exit status is readable
                        p.join(timeout=1)
                    return dead
            return []

        async def watchdog():
            dead = await loop.run_in_executor(None, watch)
            if not state.is_shutting_down:
                for p in dead:
                    logger.error(
                        "the %s process died (exit code %s); shutting down", p.name, p.exitcode
                    )
                stop(
                    1,
                    f"the {' and '.join(p.name for p in dead)} process died; the server is shutting down",
                )

        watch_task = asyncio.create_task(watchdog()) if children else None

        async def progress_watchdog():
            """A child that stops making progress (hung, stopped, deadlocked) is as bad as a
            dead one: report unhealthy, fail what waits with 503, exit non-zero."""
            period = min(1.0, args.watchdog_timeout / 4)
            while not state.is_shutting_down:
                await asyncio.sleep(period)
                for proc, heartbeat in zip(children, heartbeats):
                    if heartbeat.age() > args.watchdog_timeout and not state.is_shutting_down:
                        logger.error(
                            "the %s process made no progress for %.1f s (--watchdog-timeout %g); "
                            "shutting down",
                            proc.name,
                            heartbeat.age(),
                            args.watchdog_timeout,
                        )
                        stop(
                            1,
                            f"the {proc.name} process stopped making progress; the server is shutting down",
                        )
                        return

        progress_task = asyncio.create_task(progress_watchdog())
        if not args.skip_warmup:
            from cadence.serving.embedding_serving import probe

            warmup = asyncio.ensure_future(probe(client, "Hello"))
            await asyncio.wait(
                {warmup, serve_task}, timeout=300, return_when=asyncio.FIRST_COMPLETED
            )
            if not warmup.done():
                warmup.cancel()
                if not state.is_shutting_down:
                    raise RuntimeError("the warm-up generation did not finish in 300 s")
            elif warmup.exception() is not None:
                raise warmup.exception()
        if pipeline_task is not None:
            await asyncio.wait({pipeline_task, serve_task}, return_when=asyncio.FIRST_COMPLETED)
            if pipeline_task.done() and pipeline_task.exception() is None:
                state.pipeline = pipeline_task.result()

                async def pipeline_watchdog():
                    health = asyncio.create_task(follow_pipeline_health(state, grpc_server))
                    try:
                        await state.pipeline.failed.wait()
                    finally:
                        health.cancel()
                    if not state.is_shutting_down:
                        logger.error("the pipeline failed: %s", state.pipeline.failure)
                        stop(1, "a pipeline stage process died; the server is shutting down")

                watch_pipeline_task = asyncio.create_task(pipeline_watchdog())
        if not state.is_shutting_down:
            state.is_ready = True
            if grpc_server is not None:
                await grpc_server.set_serving()
            logger.info("Cadence is ready: http://%s:%d", args.host, args.port)
        await serve_task
        if watch_task is not None:
            watch_task.cancel()
        progress_task.cancel()
        if state.pipeline is not None:
            watch_pipeline_task.cancel()
    except (ChildDied, StartupFailed) as e:
        logger.error("%s", e)
        stop(1)
        await serve_task
    except Exception:
        logger.exception("start-up failed")
        stop(1)
        await serve_task
    finally:
        state.is_shutting_down = True
        if grpc_server is not None:
            await grpc_server.stop()
        if client is not None:
            client.close()
        if pipeline_task is not None:
            pipeline_task.cancel()  # a start still under way stops what it started
            await asyncio.gather(pipeline_task, return_exceptions=True)
        if state.pipeline is not None:
            await state.pipeline.shutdown()
    if not server.started and exit_code == 0:
        logger.error("could not bind %s:%d", args.host, args.port)
        exit_code = 1
    return exit_code


# ---- several front processes (--api-workers) -----------------------------------------------


def _front_worker_entry(args, paths, model_path, index, sock, reader, shared, parent_pid):
    """A front worker process: serves HTTP on the launcher's socket and gRPC on the shared
    port until SIGTERM (or its launcher's death), then exits."""
    _child_start(parent_pid)
    import threading

    import uvloop

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(name)s[front {index}] %(levelname)s %(message)s",
    )
    from cadence.plugins import load_plugins

    load_plugins()
    stopping = threading.Event()
    heartbeats, pause = shared
    code = uvloop.run(
        _serve(
            args,
            paths,
            [],
            reader,
            model_path,
            stopping,
            heartbeats,
            sock=sock,
            index=index,
            shared_pause=pause,
        )
    )
    sys.exit(code)


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


def _supervise(args, ctx, sock, paths, children, reader, model_path, stopping, heartbeats) -> int:
    """--api-workers N: this process binds the HTTP socket, starts N front workers on it,
    hands them the scheduler's ready report, and watches everything. Any process dying
    (a front worker included) stops the server with exit code 1; SIGTERM/SIGINT stop the
    fronts first (they end their requests), then the scheduler and detokenizer."""
    import multiprocessing.connection
    import os
    import signal

    import msgspec

    from cadence.front import metrics

    pause = ctx.RawValue("b", 0)
    workers, pipes = [], []
    for i in range(args.api_workers):
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_front_worker_entry,
            args=(args, paths, model_path, i, sock, r, (heartbeats, pause), os.getpid()),
            name=f"front {i}",
        )
        proc.start()
        workers.append(proc)
        pipes.append(w)
    sock.close()  # the workers hold it now
    logger.info("%d front processes serve http://%s:%d", len(workers), args.host, args.port)
    exit_code, reported = 0, False
    try:
        while not stopping.is_set():
            if not reported and reader.poll(0):
                report = reader.recv_bytes()
                for w in pipes:
                    w.send_bytes(report)  # each front learns the model's facts, or the error
                reported = True
                facts = msgspec.msgpack.decode(report)
                if facts.get("status") != "ready":
                    logger.error(
                        "the scheduler failed to load the model: %s\n%s",
                        facts.get("error"),
                        facts.get("traceback", ""),
                    )
            fired = multiprocessing.connection.wait(
                [p.sentinel for p in children + workers], timeout=0.2
            )
            dead = [p for p in children + workers if p.sentinel in fired]
            if dead:
                # A signal to the whole process group (a terminal's Ctrl-C, `timeout`) reaches
                # everyone at once: a child ending then is the shutdown, not a failure.
                stopping.wait(0.3)
                for p in dead:
                    p.join(timeout=1)
                    level = logging.INFO if stopping.is_set() else logging.ERROR
                    logger.log(level, "the %s process ended (exit code %s)", p.name, p.exitcode)
                    metrics.mark_process_dead(p.pid)
                exit_code = 0 if stopping.is_set() else 1
                break
    finally:
        for p in workers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in workers:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
            if p.exitcode not in (0, None) and not exit_code and not stopping.is_set():
                exit_code = 1
    return exit_code


def _stop_children(children) -> None:
    for proc in children:
        if proc.is_alive():
            proc.terminate()
    for proc in children:
        proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)


def launch(args: ServerArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    import multiprocessing as mp
    import os
    import signal
    import threading

    import uvloop

    # Until the event loop takes over, a signal only marks the server as stopping, so the
    # children and the socket directory are still cleaned up.
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())

    from cadence import envs
    from cadence.ipc import Heartbeat, IpcPaths
    from cadence.model_loader.locate import resolve_model_path

    try:
        model_path = resolve_model_path(args.model_path)
        if args.pipeline is not None:  # a mistake in the declaration stops us before any start
            from cadence.pipeline import load_pipeline_config

            load_pipeline_config(args.pipeline_path)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    paths = IpcPaths.create()
    envs.set_openmp_defaults()  # the children read it when they start (see envs.py)
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    shared = ctx.RawArray("d", 2)
    heartbeats = [Heartbeat(shared, 0), Heartbeat(shared, 1)]  # scheduler, detokenizer
    children = [
        ctx.Process(
            target=_scheduler_entry,
            args=(args, paths, model_path, writer, os.getpid(), heartbeats[0]),
            name="scheduler",
        ),
        ctx.Process(
            target=_detokenizer_entry,
            args=(args, paths, args.tokenizer_path or model_path, os.getpid(), heartbeats[1]),
            name="detokenizer",
        ),
    ]
    sock = None
    if args.api_workers > 1:
        try:  # before anything starts: a port in use is an error at once
            sock = _bind_http(args)
            _check_grpc_port_free(args)
        except StartupFailed as e:
            if sock is not None:
                sock.close()
            logger.error("%s", e)
            paths.remove()
            return 1
        # Values of every front process in files (aggregated by /metrics), in the private
        # socket directory: removed with it. Set before any front process imports the client.
        metrics_dir = os.path.join(paths.directory, "metrics")
        os.makedirs(metrics_dir, mode=0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        for proc in children:
            proc.start()
        if args.api_workers > 1:
            return _supervise(
                args, ctx, sock, paths, children, reader, model_path, stopping, heartbeats
            )
        return uvloop.run(_serve(args, paths, children, reader, model_path, stopping, heartbeats))
    except StartupFailed as e:
        logger.error("%s", e)
        return 1
    finally:
        _stop_children(children)
        paths.remove()
        logger.info("Cadence stopped")


def main(argv: list[str] | None = None) -> int:
    from cadence.plugins import PluginError, load_plugins

    try:
        load_plugins()  # before the arguments exist, so that plugins can shape them
    except PluginError as e:
        print(f"cadence serve: error: {e}", file=sys.stderr)
        return 1
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    from cadence.hooks import finalize_server_args
    from cadence.platforms import PlatformError

    try:
        args = finalize_server_args(
            args
        )  # platform defaults, then the server_args_finalized hook point
    except (PlatformError, ValueError, TypeError) as e:
        print(f"cadence serve: error: {e}", file=sys.stderr)
        return 1
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
