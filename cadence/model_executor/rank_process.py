"""A follower rank's process: its share of the model, doing what the leader orders.

Started by the server's supervisor, one per rank other than 0 on this machine (and, on the
other machines of --nnodes, one per rank there). It reports ready once it has met every
other rank and loaded its share; then it follows the leader (`parallel.follow`) until the
leader orders a stop, and exits non-zero when the leader or a peer is lost.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

import msgspec

from cadence.liveness import die_with_parent
from cadence.server_args import ServerArgs

logger = logging.getLogger("cadence.rank")


def make_groups(args: ServerArgs, rank: int):
    """This rank's torch.distributed groups, on the platform's backend."""
    from cadence.distributed.group import RankGroups
    from cadence.distributed.layout import RankLayout
    from cadence.platforms import get_current_platform

    platform = get_current_platform()
    platform.init_backend()
    layout = RankLayout(args.tp_size, args.pp_size, args.nnodes)
    if platform.device.type == "cuda":  # one device per rank of this machine
        platform.set_device(rank % layout.ranks_per_node)
    assert args.dist_init_addr is not None  # the launcher picks one on a single machine
    return RankGroups(
        layout,
        rank,
        args.dist_init_addr,
        platform.get_torch_distributed_backend_str(),
        args.dist_timeout,
    )


def run_rank_process(args: ServerArgs, model_path: str, rank: int, ready_pipe) -> None:
    """Entry of a follower rank's process (`rank` > 0)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when ranks stop
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s",
    )
    try:
        from cadence.model_executor.model_runner import ModelRunner
        from cadence.model_executor.parallel import follow
        from cadence.plugins import load_plugins

        load_plugins()
        runner = ModelRunner(args, model_path, make_groups(args, rank))
        ready_pipe.send_bytes(msgspec.msgpack.encode({"status": "ready", "rank": rank}))
        logger.info("rank %d ready (pid %d)", rank, os.getpid())
    except Exception as e:
        ready_pipe.send_bytes(
            msgspec.msgpack.encode(
                {
                    "status": "error",
                    "error": f"rank {rank}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )
        )
        raise SystemExit(1) from e
    try:
        follow(runner)
    except Exception as e:  # the leader or a peer is gone: this server is over
        logger.error("rank %d lost the other ranks: %s", rank, e)
        raise SystemExit(1) from None
    finally:
        runner.groups.close()
