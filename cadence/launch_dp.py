"""`cadence launch --dp-size N`: N data-parallel replicas of `cadence serve` and the router in
front of them, from one command. The command line and the process plan; `--help` imports
nothing heavy.

The flags are `cadence serve`'s (one parser: `server_args.build_parser`), `--dp-size` and
`--router-dp-worker-base-port`, and every `cadence router` flag spelled `--router-<flag>` (the
router's own parser, its flags copied under the prefix). As in SGLang's launcher, the router
listens on `--host`/`--port`, where a client of `cadence serve` already points; replica i
serves on the i-th free port from `--router-dp-worker-base-port` up, its gRPC on that port
+ 10000 (serve's own rule). Each replica is `cadence serve <your flags> --port P --grpc-port G`
in a child process, on its own share of the CPU cores (and GPUs) when there are enough.

One `Supervisor` owns every child. The replicas start together; the router starts once all
are healthy. A replica that dies is not restarted: the launcher says loudly which one died
and how, the router's probes take it out of rotation, and the survivors go on serving; the
last replica's death, or the router's, ends the launcher with exit code 1. SIGINT/SIGTERM
stop the router, then the replicas, and end it with 0. Children die with the launcher
(PR_SET_PDEATHSIG), even on SIGKILL, and sit in their own process groups, so that a
terminal's Ctrl-C reaches the launcher alone and the stop keeps its order.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, fields

from cadence.config_docs import field_docs
from cadence.server_args import ServerArgs, from_cli_args

logger = logging.getLogger("cadence.launch")

GRPC_PORT_OFFSET = 10000  # a replica's gRPC port is its HTTP port + this, as `cadence serve`'s
_PREFIX = "--router-"


@dataclass(frozen=True)
class LaunchArgs:
    """What `cadence launch` adds to `cadence serve`'s flags."""

    dp_size: int = 1
    """Data-parallel replicas to start: each a whole `cadence serve` (its own scheduler and KV pool) behind one router on --host/--port."""
    router_dp_worker_base_port: int = 31000
    """First port tried for the replicas: replica i serves HTTP on the i-th port from here up that is free (with its gRPC port, this + 10000, free too)."""

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be ≥ 1, got {self.dp_size}")
        if not 1 <= self.router_dp_worker_base_port <= 65535:
            raise ValueError(
                "router_dp_worker_base_port must be in [1, 65535], "
                f"got {self.router_dp_worker_base_port}"
            )


# Router flags the launcher sets itself, and why a user may not give them.
_REFUSED = {
    "host": "the router listens on --host and --port, where clients connect",
    "port": "the router listens on --host and --port, where clients connect",
    "worker_urls": "the launcher gives the router its replicas (more workers: "
    "--router-worker-config FILE)",
}
_PD_REASON = (
    "cadence launch starts complete replicas; for prefill/decode disaggregation start "
    "`cadence serve --disaggregation-mode` workers and `cadence router --pd-disaggregation` "
    "(docs/disaggregation.md)"
)
_REFUSED.update(
    dict.fromkeys(
        ("pd_disaggregation", "prefill_urls", "decode_urls", "prefill_policy", "decode_policy"),
        _PD_REASON,
    )
)


class _Refused(argparse.Action):
    """A router flag the launcher owns: an error that says why, whatever follows it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {_REFUSED[self.dest.removeprefix('router_')]}")


def build_parser() -> argparse.ArgumentParser:
    from cadence.router.cli import build_parser as router_parser
    from cadence.server_args import build_parser as serve_parser

    parser = serve_parser()
    parser.prog = "cadence launch"
    parser.description = (
        "Serve a model from N data-parallel replicas behind the router: the server's flags "
        "(as `cadence serve`), --dp-size, and the router's flags prefixed --router-."
    )
    parser.allow_abbrev = False  # each flag goes to the server or the router by its exact name
    docs = field_docs(LaunchArgs)
    group = parser.add_argument_group("data parallelism (cadence launch)")
    for f in fields(LaunchArgs):
        flag = "--" + f.name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue  # `cadence serve`'s own flag too (--dp-size): read from there
        group.add_argument(flag, type=int, default=f.default,
                           help=f"{docs[f.name]} (default: {f.default})")  # fmt: skip
    group = parser.add_argument_group("router (cadence router's flags, prefixed --router-)")
    for action in router_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        mirror = copy.copy(action)  # the router's own action: its type, count, choices, help
        mirror.option_strings = [_PREFIX + s.removeprefix("--") for s in action.option_strings]
        mirror.dest = "router_" + action.dest
        mirror.metavar = action.metavar or action.dest.upper()
        if action.dest in _REFUSED:
            mirror = _Refused(mirror.option_strings, mirror.dest, nargs="*", help=argparse.SUPPRESS)
        group._add_action(mirror)  # argparse's one way to add a ready-made action
    return parser


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The server's arguments (the launcher's own among them) and the router's (prefix
    dropped): each option takes the values that follow it to its side."""
    own = {"--" + f.name.replace("_", "-") for f in fields(LaunchArgs)}
    server: list[str] = []
    router: list[str] = []
    side = server
    for token in argv:
        if token.startswith("-") and not _is_number(token):
            name = token.split("=", 1)[0]
            side = router if name.startswith(_PREFIX) and name not in own else server
            if side is router:
                token = "--" + token.removeprefix(_PREFIX)
        side.append(token)
    return server, router


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class LaunchPlan:
    """What to start: the parsed arguments, and each side's own command line."""

    server: ServerArgs  # as a replica reads them (its own --port aside)
    launch: LaunchArgs
    host: str  # where the router listens (--host) ...
    port: int  # ... and its port (--port), where clients connect
    server_argv: list[str]  # every replica's `cadence serve` flags, but its ports
    router_argv: list[str]  # the router's flags, before --host/--port/--worker-urls


def parse(argv: list[str]) -> LaunchPlan:
    """The plan from the command line; a bad flag or value exits 2 with the parser's error
    naming it, before anything starts."""
    from cadence.router.cli import parse_config

    parser = build_parser()
    ns = parser.parse_args(argv)
    host, port = ns.host, ns.port
    server_argv, router_argv = split_argv(argv)
    try:
        launch = LaunchArgs(**{f.name: getattr(ns, f.name) for f in fields(LaunchArgs)})
        limit = 65535 - (0 if ns.disable_grpc else GRPC_PORT_OFFSET)
        if launch.router_dp_worker_base_port > limit:
            raise ValueError(
                f"router_dp_worker_base_port must be ≤ {limit} (the gRPC ports lie 10000 "
                f"above), got {launch.router_dp_worker_base_port}"
            )
        # --port is the router's: the replicas' arguments are checked with the first port
        # they may get (a gRPC port 10000 above --port is nobody's business here).
        ns.port = launch.router_dp_worker_base_port
        args = from_cli_args(ns)
        _check_server_args(args, launch)
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be in [1, 65535] (the router's port), got {port}")
    except ValueError as e:
        parser.error(str(e))
    try:  # the router's reading of its flags, with what the launcher adds
        parse_config([*router_argv, "--host", host, "--port", str(port),
                      "--worker-urls", "http://127.0.0.1:1"])  # fmt: skip
    except ValueError as e:
        parser.error(f"router: {e} (given as {_PREFIX}{str(e).split(':')[0].replace('_', '-')})")
    # Each replica's argv gets its own --port; the launcher's flags are none of its business.
    drop = {"--port", "--data-parallel-size"}
    drop |= {"--" + f.name.replace("_", "-") for f in fields(LaunchArgs)}
    return LaunchPlan(args, launch, host, port, _drop_options(server_argv, drop), router_argv)


def _check_server_args(args: ServerArgs, launch: LaunchArgs) -> None:
    """Server flags a replica cannot take as given: a ValueError naming the field."""
    if args.grpc_port is not None:
        raise ValueError(
            "grpc_port: each replica serves gRPC on its own HTTP port + 10000; drop --grpc-port "
            "(or give --disable-grpc)"
        )
    if args.disaggregation_mode != "null":
        raise ValueError(f"disaggregation_mode: {_PD_REASON}")
    if args.kv_events_config is not None and launch.dp_size > 1:
        raise ValueError(
            "kv_events_config: every replica would publish on the same endpoint; start "
            "publishing replicas with `cadence serve` and `cadence router`"
        )
    if getattr(args, "nnodes", 1) > 1 or getattr(args, "dist_init_addr", None) is not None:
        raise ValueError(
            "nnodes: cadence launch starts its replicas on this machine, each with its own "
            "ranks; drop --nnodes and --dist-init-addr (several machines: run `cadence serve` "
            "on each and `cadence router` in front)"
        )


def _drop_options(argv: list[str], names: set[str]) -> list[str]:
    """`argv` without the options `names` and their values."""
    kept: list[str] = []
    dropping = False
    for token in argv:
        if token.startswith("-") and not _is_number(token):
            dropping = token.split("=", 1)[0] in names
        if not dropping:
            kept.append(token)
    return kept


# ---- the process plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """One replica: where it serves and what of the machine it gets."""

    index: int
    port: int
    grpc_port: int | None  # None with --disable-grpc
    url: str  # how the launcher and the router reach it
    cpus: tuple[int, ...] | None  # its share of the CPU cores; None: all of them
    cuda_devices: str | None  # its CUDA_VISIBLE_DEVICES; None: as inherited

    @property
    def name(self) -> str:
        return f"replica {self.index}"


def plan_replicas(plan: LaunchPlan) -> list[Replica]:
    """Ports and shares of the machine for `--dp-size` replicas; ValueError when the router's
    port is taken or the ports run out (nothing has started yet)."""
    args, launch, host = plan.server, plan.launch, plan.host
    if not _is_free(host, plan.port):
        raise ValueError(f"port: {host}:{plan.port} is in use; the router listens there")
    taken = {plan.port}
    ports: list[tuple[int, int | None]] = []
    port = launch.router_dp_worker_base_port
    while len(ports) < launch.dp_size:
        grpc = None if args.disable_grpc else port + GRPC_PORT_OFFSET
        if port > 65535 or (grpc is not None and grpc > 65535):
            raise ValueError(
                f"router_dp_worker_base_port: fewer than {launch.dp_size} free ports from "
                f"{launch.router_dp_worker_base_port} up on {host}"
            )
        wanted = [port] if grpc is None else [port, grpc]
        if not taken & set(wanted) and all(_is_free(host, p) for p in wanted):
            ports.append((port, grpc))
            taken.update(wanted)
        port += 1
    cpus, gpus = _shares(launch.dp_size, getattr(args, "world_size", 1))
    return [
        Replica(i, p, g, f"http://{_reach(host)}:{p}", cpus[i], gpus[i])
        for i, (p, g) in enumerate(ports)
    ]


def _shares(n: int, per_replica_gpus: int) -> tuple[list, list]:
    """Each replica's CPU cores and CUDA devices. Cores: equal contiguous slices when there
    are at least n (replicas that each spread over every core only slow one another down).
    Devices: replica i gets the i-th `per_replica_gpus` of them (its tensor x pipeline ranks),
    as SGLang's base_gpu_id; too few, and they share (a warning). None: as inherited."""
    cores = sorted(os.sched_getaffinity(0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [d.strip() for d in visible.split(",") if d.strip()]
    else:  # one entry per NVIDIA GPU the driver knows; none without the driver
        try:
            gpus = [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
        except OSError:
            gpus = []
    cpu_shares: list = [None] * n
    gpu_shares: list = [None] * n
    if len(cores) >= n > 1:
        step = len(cores) // n
        cpu_shares = [tuple(cores[i * step : (i + 1) * step]) for i in range(n)]
    if len(gpus) >= n * per_replica_gpus and n > 1:
        step = per_replica_gpus
        gpu_shares = [",".join(gpus[i * step : (i + 1) * step]) for i in range(n)]
    elif gpus and n > 1:
        logger.warning(
            "%d replicas of %d GPU(s) each share the %d GPU(s) there are",
            n, per_replica_gpus, len(gpus),
        )  # fmt: skip
    return cpu_shares, gpu_shares


def _is_free(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def _reach(host: str) -> str:
    """The address to reach a server listening on `host` from this machine."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def replica_spec(replica: Replica, server_argv: list[str]):
    from cadence.supervisor import ProcessSpec

    argv = [*server_argv, "--port", str(replica.port)]
    if replica.grpc_port is not None:
        argv += ["--grpc-port", str(replica.grpc_port)]
    return ProcessSpec(
        replica.name,
        "cadence.replica_set:run_replica_process",
        (argv, replica.cpus, replica.cuda_devices),
        stop_rank=1,  # after the router: no request is routed to a replica that is stopping
        stop_grace_s=15.0,  # its own stop: the fronts, then its scheduler and detokenizer
    )


def router_spec(plan: LaunchPlan, replicas: list[Replica]):
    from cadence.replica_set import ROUTER
    from cadence.supervisor import ProcessSpec

    args = plan.server
    argv = [*plan.router_argv, "--host", plan.host, "--port", str(plan.port)]
    argv += ["--worker-urls", *(r.url for r in replicas)]
    given = {token.split("=", 1)[0] for token in plan.router_argv}
    if args.api_key is not None and "--api-key" not in given:
        argv += ["--api-key", args.api_key]  # one key for the whole deployment
    return ProcessSpec(ROUTER, "cadence.replica_set:run_router_process", (argv,), stop_rank=0)


# ---- the command --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from cadence.plugins import PluginError, load_plugins

    try:
        load_plugins()  # before the arguments exist, so that plugins can shape them
    except PluginError as e:
        print(f"cadence launch: error: {e}", file=sys.stderr)
        return 1
    plan = parse(list(sys.argv[1:] if argv is None else argv))  # exits 2 on a bad flag
    args = plan.server
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stopping = _stop_on_signals()
    try:
        replicas = plan_replicas(plan)
    except ValueError as e:
        print(f"cadence launch: error: {e}", file=sys.stderr)
        return 2
    from cadence.replica_set import ReplicaSet

    specs = [replica_spec(r, plan.server_argv) for r in replicas]
    router_url = f"http://{_reach(plan.host)}:{plan.port}"
    return ReplicaSet(replicas, specs, router_spec(plan, replicas), router_url).run(stopping)


def _stop_on_signals() -> threading.Event:
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


if __name__ == "__main__":
    sys.exit(main())
