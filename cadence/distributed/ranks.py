"""The rank processes of a parallel server, as its launcher starts them.

Node 0 runs rank 0 inside its scheduler process and ranks 1 .. per_node - 1 as processes of
their own (`model_executor.rank_process`); node n > 0 runs its ranks only, and serves
nothing: it lives as long as its ranks do. Every rank is a child of the node's supervisor,
so a rank that dies stops its node's server with a non-zero exit. Standard library only:
the CLI plans this before anything heavy loads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from cadence.distributed.layout import RankLayout

# The server's arguments (cadence.server_args.ServerArgs), read by name: this room sits
# below the arguments' module and imports nothing above it.
ServerArgs = Any

logger = logging.getLogger("cadence.server")


def prepare_parallel_args(args: ServerArgs) -> ServerArgs:
    """On one machine without --dist-init-addr, a free local port for the ranks to meet at;
    and, unless CADENCE_NUM_THREADS says otherwise, the machine's cores shared out among its
    ranks (the children read it when they start)."""
    if not args.is_parallel:
        return args
    if args.dist_init_addr is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args = args.replace(dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")
    per_node = RankLayout(args.tp_size, args.pp_size, args.nnodes).ranks_per_node
    if "CADENCE_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))  # this process's share (cadence launch pins one)
        os.environ["CADENCE_NUM_THREADS"] = str(max(1, cores // per_node))
    return args


def rank_name(rank: int) -> str:
    return f"rank {rank}"


def follower_specs(args: ServerArgs, model_path: str) -> list:
    """This machine's follower ranks (all but rank 0, which the scheduler process runs)."""
    from cadence.supervisor import ProcessSpec

    layout = RankLayout(args.tp_size, args.pp_size, args.nnodes)
    return [
        ProcessSpec(
            rank_name(rank),
            "cadence.model_executor.rank_process:run_rank_process",
            (args, model_path, rank),
            reports_ready=True,
            stop_rank=2,  # after the scheduler, which orders them to stop
        )
        for rank in layout.node_ranks(args.node_rank)
        if rank != 0
    ]


def start_followers(args: ServerArgs, model_path: str):
    """For an in-process Engine: a supervisor with this machine's follower ranks started
    (they report ready once the engine's own rank 0 has met them)."""
    from cadence.supervisor import Supervisor

    if args.node_rank != 0:
        raise ValueError(
            "node_rank: an Engine runs node 0; start the other nodes with cadence serve"
        )
    supervisor = Supervisor()
    for spec in follower_specs(args, model_path):
        supervisor.start(spec)
    return supervisor


def serve_ranks_only(
    args: ServerArgs, model_path: str, supervisor, stopping: threading.Event
) -> int:
    """Node n > 0: start this machine's ranks and live as long as they do. Exits 0 when the
    leader ordered them to stop (its server stopped), 1 when one of them failed."""
    specs = follower_specs(args, model_path)
    for spec in specs:
        supervisor.start(spec)
    for spec in specs:
        if supervisor.wait_ready(spec.name, stopping=stopping) is None:
            return 0  # stopped by a signal while starting
    logger.info(
        "node %d: ranks %s ready; the leader's server is on node 0",
        args.node_rank,
        ", ".join(spec.name.split()[1] for spec in specs),
    )
    failed: list = []
    done = threading.Event()

    def lost(failure) -> None:
        if failure.exitcode != 0:
            failed.append(failure)
        done.set()

    supervisor.watch(lost)
    while not (done.is_set() or stopping.is_set()):
        done.wait(0.2)
    if failed:
        logger.error("%s; stopping this node", failed[0].reason)
        return 1
    return 0
