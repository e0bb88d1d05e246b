"""`cadence serve`: the command line and the process plan. `--help` imports nothing heavy.

The plan: a scheduler process (the model and its KV memory) and a detokenizer process, owned
by a `Supervisor`, and the front (HTTP and gRPC, `cadence.front_process`) in this process;
with `--api-workers N`, N front worker processes on one listening socket instead, this
process only supervising. A child that dies or stops making progress stops the server with
a non-zero exit naming it; SIGINT/SIGTERM stop everything and remove the socket directory.
Children die with this process (PR_SET_PDEATHSIG), so nothing is orphaned.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

from cadence.server_args import ServerArgs, build_parser, from_cli_args

logger = logging.getLogger("cadence.server")

SCHEDULER, DETOKENIZER = "scheduler", "detokenizer"


def engine_processes(args: ServerArgs, paths, model_path: str) -> list:
    """The processes behind the fronts: they stop after the fronts (rank 1)."""
    import multiprocessing as mp

    from cadence.ipc import Heartbeat
    from cadence.supervisor import ProcessSpec

    shared = mp.get_context("spawn").RawArray("d", 2)
    beats = Heartbeat(shared, 0), Heartbeat(shared, 1)
    tokenizer_source = args.tokenizer_path or model_path
    ranks = []
    if args.is_parallel:  # ranks 1 .. of this machine; rank 0 is the scheduler's
        from cadence.distributed.ranks import follower_specs

        ranks = follower_specs(args, model_path)
    return ranks + [
        ProcessSpec(
            SCHEDULER,
            "cadence.scheduler.process:run_scheduler_process",
            (args, paths, model_path, beats[0]),
            reports_ready=True,
            heartbeat=beats[0],
            stop_rank=1,
        ),
        ProcessSpec(
            DETOKENIZER,
            "cadence.detokenizer.process:run_detokenizer_process",
            (args, paths, tokenizer_source, beats[1]),
            heartbeat=beats[1],
            stop_rank=1,
        ),
    ]


def launch(args: ServerArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stopping = _stop_on_signals()
    from cadence import envs
    from cadence.front_process import FrontPlan, StartupFailed, serve_front_workers
    from cadence.ipc import IpcPaths
    from cadence.supervisor import ChildFailed, Supervisor

    model_path = _model_path(args)
    if model_path is None:
        return 2
    from cadence.distributed.ranks import prepare_parallel_args, serve_ranks_only

    args = prepare_parallel_args(args)
    envs.set_openmp_defaults()  # the children read it when they start (see envs.py)
    supervisor = Supervisor(watchdog_timeout_s=args.watchdog_timeout)
    if args.node_rank > 0:  # another machine's ranks: no front, no scheduler
        try:
            return serve_ranks_only(args, model_path, supervisor, stopping)
        except ChildFailed as e:
            logger.error("%s", e)
            return 1
        finally:
            supervisor.stop()
    paths = IpcPaths.create()
    plan = FrontPlan(args, paths, model_path)
    try:
        engine = engine_processes(args, paths, model_path)
        if args.api_workers > 1:
            return serve_front_workers(plan, supervisor, engine, _failure_text, stopping)
        for spec in engine:
            supervisor.start(spec)
        return serve_here(plan, supervisor, stopping)
    except (StartupFailed, ChildFailed) as e:
        logger.error("%s", e)
        return 1
    finally:
        supervisor.stop()
        paths.remove()
        logger.info("Cadence stopped")


def _stop_on_signals() -> threading.Event:
    """Until the front's event loop takes over, a signal only marks the server as stopping,
    so the children and the socket directory are still cleaned up."""
    import signal

    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


def _model_path(args: ServerArgs) -> str | None:
    """The model file or directory to serve; None (logged) when it or --pipeline's
    declaration is wrong: nothing has started yet."""
    from cadence.model_loader.locate import check_load_format, resolve_model_path

    try:
        model_path = resolve_model_path(args.model_path)
        check_load_format(model_path, args.load_format)
        if args.pipeline is not None:
            from cadence.pipeline import load_pipeline_config

            load_pipeline_config(args.pipeline_path or "")
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return None
    return model_path


def serve_here(plan, supervisor, stopping: threading.Event) -> int:
    """One front, in this process."""
    from cadence.front_process import run_front_process

    def model_facts(stop: threading.Event) -> dict | None:
        return supervisor.wait_ready(SCHEDULER, stopping=stop)

    def watch(lost) -> None:
        supervisor.watch(lambda failure: lost(_failure_text(failure, plan.args)))

    return run_front_process(plan, model_facts, watch, stopping)


def _failure_text(failure, args: ServerArgs) -> str:
    if failure.stalled_s is not None:
        return f"{failure.reason} (--watchdog-timeout {args.watchdog_timeout:g})"
    return failure.reason


def main(argv: list[str] | None = None) -> int:
    from cadence.plugins import PluginError, load_plugins

    try:
        load_plugins()  # before the arguments exist, so that plugins can shape them
    except PluginError as e:
        print(f"cadence serve: error: {e}", file=sys.stderr)
        return 1
    parser, argv = build_parser(), sys.argv[1:] if argv is None else argv
    if parser.parse_known_args(argv)[0].dp_size > 1:  # SGLang's data parallelism: the
        os.execv(sys.executable, [sys.executable, "-m", "cadence.launch_dp", *argv])  # launcher
    try:
        args = from_cli_args(parser.parse_args(argv))
        from cadence.front.sampling_checks import preferred_sampling_params

        preferred_sampling_params(args.preferred_sampling_params)  # checked before any start
    except ValueError as e:
        parser.error(str(e))
    from cadence.hooks import finalize_server_args
    from cadence.platforms import PlatformError

    try:  # platform defaults, then the server_args_finalized hook point
        args = finalize_server_args(args)
    except (PlatformError, ValueError, TypeError) as e:
        print(f"cadence serve: error: {e}", file=sys.stderr)
        return 1
    exit_now(launch(args))


def exit_now(code: int) -> NoReturn:
    """Ends the process once `launch` has stopped and removed everything: the interpreter's
    own teardown (collecting torch's and every module's objects) would add seconds."""
    from cadence.supervisor import exit_fast

    exit_fast(code)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
