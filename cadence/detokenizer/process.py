"""The detokenizer process: token ids from the scheduler in, text deltas out to each front."""

from __future__ import annotations

import logging
import os
import signal

import msgspec
import zmq

from cadence import io_struct
from cadence.detokenizer.detokenizer import Detokenizer
from cadence.io_struct import BatchEmbeddingOutput, BatchStrOutput, BatchTokenIDOutput
from cadence.ipc import FrontRouter, Heartbeat, IpcPaths, bind
from cadence.liveness import die_with_parent
from cadence.server_args import ServerArgs

logger = logging.getLogger("cadence.detokenizer")


def _split_by_front(out: BatchStrOutput) -> dict[str | None, BatchStrOutput]:
    """One BatchStrOutput per front process, so each front gets only its own rids."""
    fronts = set(out.http_worker_ipcs)
    if len(fronts) == 1:
        return {fronts.pop(): out}
    parts = {}
    for front in fronts:
        idx = [i for i, f in enumerate(out.http_worker_ipcs) if f == front]
        parts[front] = BatchStrOutput(
            rids=[out.rids[i] for i in idx],
            http_worker_ipcs=[front] * len(idx),
            finished_reasons=[out.finished_reasons[i] for i in idx],
            output_strs=[out.output_strs[i] for i in idx],
            output_ids=[out.output_ids[i] for i in idx],
            prompt_tokens=[out.prompt_tokens[i] for i in idx],
            completion_tokens=[out.completion_tokens[i] for i in idx],
            cached_tokens=[out.cached_tokens[i] for i in idx],
            logprobs=None if out.logprobs is None else [out.logprobs[i] for i in idx],
            hidden_states=_pick(out.hidden_states, idx),
            spec_verify_ct=_pick(out.spec_verify_ct, idx),
            spec_accepted_tokens=_pick(out.spec_accepted_tokens, idx),
            spec_proposed_tokens=_pick(out.spec_proposed_tokens, idx),
            spec_acceptance_histogram=_pick(out.spec_acceptance_histogram, idx),
            weight_version=out.weight_version,
        )
    return parts


def _pick(values: list | None, idx: list[int]) -> list | None:
    return None if values is None else [values[i] for i in idx]


def _failed_outputs(data: bytes, error: Exception) -> BatchStrOutput:
    """For an output batch that does not decode (a bug on the scheduler side): each of its
    requests, found by reading the message without its schema, ends with an internal error
    of its own; the fronts then abort them in the scheduler. Empty when even that fails."""
    try:
        raw = msgspec.msgpack.decode(data)
        rids, fronts = list(raw["rids"]), list(raw["http_worker_ipcs"])
        if len(rids) != len(fronts) or not all(isinstance(r, str) for r in rids):
            raise ValueError("no request ids in it")
    except Exception:
        rids, fronts = [], []
    reason = {
        "type": "abort",
        "status_code": 500,
        "request_fault": True,
        "origin": "detokenizer",
        "message": f"internal error: the engine's output could not be read: {error}",
    }
    n = len(rids)
    return BatchStrOutput(
        rids=rids,
        http_worker_ipcs=fronts,
        finished_reasons=[dict(reason) for _ in rids],
        output_strs=[""] * n,
        output_ids=[[] for _ in rids],
        prompt_tokens=[0] * n,
        completion_tokens=[0] * n,
        cached_tokens=[0] * n,
    )


def run_detokenizer_process(
    args: ServerArgs, paths: IpcPaths, tokenizer_source: str, heartbeat: Heartbeat | None = None
) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front process decides when we stop
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from cadence.model_loader.tokenizer_files import load_decoder
    from cadence.plugins import load_plugins

    load_plugins()
    detokenizer = Detokenizer(load_decoder(tokenizer_source))
    ctx = zmq.Context(1)
    inbox = bind(ctx, zmq.PULL, paths.detokenizer_input)
    fronts = FrontRouter(ctx)
    parent = os.getppid()
    while True:
        if heartbeat is not None:
            heartbeat.beat()
        if not inbox.poll(100):  # short: a signal another thread took is handled soon
            if os.getppid() != parent:
                return
            continue
        data = inbox.recv(copy=False).bytes
        try:
            msg = io_struct.decode(data)
        except Exception as e:
            logger.exception("a message the detokenizer cannot decode (%d bytes)", len(data))
            for front, part in _split_by_front(_failed_outputs(data, e)).items():
                fronts.send(front, part)  # its requests end with an error instead of hanging
            continue
        if isinstance(msg, BatchTokenIDOutput):
            for front, part in _split_by_front(detokenizer.process(msg)).items():
                fronts.send(front, part)
        elif isinstance(msg, BatchEmbeddingOutput):
            fronts.send(msg.http_worker_ipcs[0], msg)
        else:
            logger.error("detokenizer got an unexpected %s", type(msg).__name__)
