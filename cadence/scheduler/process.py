"""The scheduler process: owns the model and KV memory; one loop of receive -> handle -> step.

It never blocks on a client: requests and control messages arrive on a ZMQ PULL socket and
are drained between steps; token outputs go to the detokenizer, control answers straight
back to the asking front process. All request logic is the scheduler core's
(`Scheduler.handle` / `Scheduler.step`), shared with the in-process `Engine`.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from cadence import io_struct
from cadence.io_struct import UpdateWeightFromDiskReqInput
from cadence.ipc import FrontRouter, Heartbeat, IpcPaths, bind, connect
from cadence.liveness import die_with_parent
from cadence.scheduler.embedding import EmbedOutput, failed_output
from cadence.scheduler.req import ReqOutput, to_messages
from cadence.scheduler.scheduler import Scheduler
from cadence.server_args import ServerArgs

logger = logging.getLogger("cadence.scheduler")

# An idle loop wakes this often (ms): a signal that reached another thread (torch's) is
# handled within it, so a stop is prompt.
IDLE_POLL_MS = 100
# How long loading new weights may stop the loop before the watchdog calls it stuck.
WEIGHT_LOAD_GRACE_S = 900.0
# Time a forward step may take per token it computes before the watchdog (--watchdog-timeout,
# counted after this) calls the scheduler stuck: 2,048 prefill tokens get ~100 s more.
STEP_GRACE_S_PER_TOKEN = 0.05


class SchedulerProcess:
    def __init__(self, scheduler: Scheduler, paths: IpcPaths, heartbeat: Heartbeat | None = None):
        self.scheduler = scheduler
        self.heartbeat = heartbeat
        self.ctx = zmq.Context(1)
        self.inbox = bind(self.ctx, zmq.PULL, paths.scheduler_input)
        self.to_detokenizer = connect(self.ctx, zmq.PUSH, paths.detokenizer_input)
        self.fronts = FrontRouter(self.ctx)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        if scheduler.pd is not None:  # the transfer agent's news wakes the loop too
            self.poller.register(scheduler.pd.agent.wake_fd, zmq.POLLIN)

    def run(self) -> None:
        parent = os.getppid()
        while True:
            if self.heartbeat is not None:
                self.heartbeat.beat()
            timeout = 0 if self.scheduler.has_work else IDLE_POLL_MS
            ready = dict(self.poller.poll(timeout))
            if ready:
                while self.inbox in ready:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(data.bytes)
            elif os.getppid() != parent:
                return  # the server is gone
            elif not self.scheduler.has_work:
                self.scheduler.runner.keep_alive()
            if self.heartbeat is not None and self.scheduler.has_work:
                # A step is one forward pass the loop cannot beat inside: a long prefill on a
                # busy machine is progress, so the watchdog allows time in proportion to the
                # tokens the step may compute (a hang still shows, later).
                self.heartbeat.busy(STEP_GRACE_S_PER_TOKEN * self.scheduler.step_tokens_bound())
            self._send(self.scheduler.step())

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = io_struct.decode(data)
        except Exception:
            logger.exception("dropped a message the scheduler cannot decode (%d bytes)", len(data))
            return
        if isinstance(msg, UpdateWeightFromDiskReqInput) and self.heartbeat is not None:
            self.heartbeat.busy(WEIGHT_LOAD_GRACE_S)  # loading stops the loop, by design
        reply = self.scheduler.handle(msg)
        if reply is not None:
            self.fronts.send(reply.http_worker_ipc, reply)
        # What the message ended (aborts, pause) is reported now, not after the next step.
        outputs, self.scheduler.outputs = self.scheduler.outputs, []
        self._send(outputs)

    def _send(self, outputs: list[ReqOutput | EmbedOutput]) -> None:
        if not outputs:
            return
        try:
            data = [
                io_struct.encode(msg) for msg in to_messages(outputs, self.scheduler.weight_version)
            ]
        except Exception as e:
            # One request's output cannot be encoded: find it, fail it, send the others.
            logger.exception("encoding a step's outputs failed; checking them one by one")
            good = []
            for out in outputs:
                try:
                    for msg in to_messages([out], self.scheduler.weight_version):
                        io_struct.encode(msg)
                    good.append(out)
                except Exception:
                    if isinstance(out, EmbedOutput):  # it has ended already: say it failed
                        good.append(failed_output(out, e, "encoding its output"))
                    else:
                        self.scheduler.fail_rid(out.rid, e, "encoding its output")
            good += self.scheduler.outputs
            self.scheduler.outputs = []
            data = [
                io_struct.encode(msg) for msg in to_messages(good, self.scheduler.weight_version)
            ]
        for part in data:  # embeddings pass through the detokenizer untouched
            self.to_detokenizer.send(part, copy=False)


def build_scheduler(args: ServerArgs, model_path: str, tokenizer) -> Scheduler:
    """The scheduler core with its collaborators: the model runner (which loads the weights),
    the KV manager over the runner's pool, the stop checker. `tokenizer` may be a Future of
    it, still loading while the weights load."""
    from cadence.constrained import create_grammar_queue
    from cadence.mem_cache.kv_manager import KVManager
    from cadence.model_loader.tokenizer_files import LightTokenizer
    from cadence.scheduler.stop_checker import StopChecker

    runner = make_runner(args, model_path)
    if isinstance(tokenizer, Future):
        tokenizer = tokenizer.result()
    eos_ids = set(runner.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    grammars = None
    if runner.is_generation:  # an embedding model generates nothing to constrain
        # The grammar engine needs transformers' own tokenizer: loaded then if not now.
        grammars = create_grammar_queue(
            args.grammar_backend,
            tokenizer.transformers_tokenizer
            if isinstance(tokenizer, LightTokenizer)
            else lambda: tokenizer,
            runner.config.vocab_size,
            sorted(eos_ids),
            any_whitespace=args.constrained_json_any_whitespace,
        )
    kv = KVManager.build(
        runner.kv_allocator,
        enable_prefix_cache=not args.disable_radix_cache,
        kv_events=args.kv_events_config is not None,
        disk=make_disk_tier(args, model_path, runner),
        write_through=args.hicache_write_policy != "write_back",
    )
    from cadence.scheduler.disaggregation import build_disaggregation

    return Scheduler(
        args,
        runner,
        kv,
        StopChecker(tokenizer, eos_ids, runner.context_len),
        grammars=grammars,
        pd=build_disaggregation(args, kv, getattr(runner, "kv_pool", None), runner.context_len),
    )


def make_runner(args: ServerArgs, model_path: str):
    """The runner of the model at `model_path`: an encoder's (a BERT directory, detected from
    its config.json) or a decoder's (GGUF files and Llama-family directories)."""
    from cadence.model_loader.encoder_loader import is_encoder

    if is_encoder(model_path):
        if args.is_parallel:
            raise ValueError(
                "tp_size / pp_size: encoder models are served on one rank; give "
                "--tp-size 1 --pp-size 1"
            )
        from cadence.model_executor.encoder_runner import EncoderRunner

        return EncoderRunner(args, model_path)
    from cadence.model_executor.model_runner import ModelRunner

    if not args.is_parallel:
        return ModelRunner(args, model_path)
    from cadence.model_executor.parallel import LeaderRunner
    from cadence.model_executor.rank_process import make_groups

    return LeaderRunner(ModelRunner(args, model_path, make_groups(args, 0)))


def run_scheduler_process(
    args: ServerArgs,
    paths: IpcPaths,
    model_path: str,
    heartbeat: Heartbeat | None,
    ready_pipe,
) -> None:
    """Entry of the scheduler process (started by the launcher's supervisor). Reports the
    loaded model's facts (or the load error) through `ready_pipe` as msgpack bytes, then
    serves until the server goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front process decides when we stop
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        from cadence.model_loader.tokenizer_files import load_scheduler_tokenizer
        from cadence.plugins import load_plugins

        load_plugins()
        # The tokenizer loads on a thread while the weights load and the KV pool is written,
        # which hold no GIL for most of theirs.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as loader:
            tokenizer = loader.submit(load_scheduler_tokenizer, model_path, args.tokenizer_path)
            scheduler = build_scheduler(args, model_path, tokenizer)
        proc = SchedulerProcess(scheduler, paths, heartbeat)
        ready_pipe.send_bytes(
            msgspec.msgpack.encode({"status": "ready", **runtime_facts(scheduler)})
        )
        if heartbeat is not None:
            heartbeat.beat()
    except Exception as e:
        ready_pipe.send_bytes(
            msgspec.msgpack.encode(
                {"status": "error", "error": f"{e}", "traceback": traceback.format_exc()}
            )
        )
        raise SystemExit(1) from e
    try:
        proc.run()
    finally:
        # A stop (SIGTERM unwinds to here) or the server gone: the disk tier writes what it
        # holds back, the KV-event publisher and the PD transfer agent let their sockets
        # and shared memory go.
        scheduler.close()


def make_disk_tier(args: ServerArgs, model_path: str, runner):
    """The prefix cache's disk tier (--enable-hierarchical-cache), bound to everything that
    makes this server's K/V: the model and tokenizer files, how the weights are served
    (dtype, quantization), the KV dtype, the page shape."""
    if not args.enable_hierarchical_cache or args.disable_radix_cache:
        return None
    from cadence.mem_cache.disk_tier import DiskTier, file_identity, identity_of

    pool = runner.kv_pool
    identity = identity_of(
        file_identity(model_path),
        file_identity(args.tokenizer_path),
        # How the weights are served changes the K/V they compute.
        str(runner.dtype),
        args.quantization,
        args.dequantize,
        str(pool.dtype),
        pool.page_shape,
        runner.config.architecture,
    )
    return DiskTier(args.hicache_dir, identity, pool, int(args.hicache_size * 1e9))


def runtime_facts(scheduler: Scheduler) -> dict:
    """What the front learns about the loaded model once the scheduler is up."""
    from cadence.model_loader.loader import served_weight_types

    runner: Any = scheduler.runner  # a model runner's facts, beyond the Runner ABC
    return {
        "eos_token_ids": sorted(scheduler.stops.eos_ids),
        "bos_token_id": runner.config.bos_token_id,
        "architecture": runner.config.architecture,
        "context_len": runner.context_len,
        "vocab_size": runner.config.vocab_size,
        "max_total_tokens": runner.max_total_tokens,
        # The KV pool: its size in memory, and whether that memory was all taken at start.
        "kv_pool_bytes": runner.kv_pool_bytes,
        "kv_pool_committed": runner.is_kv_pool_committed,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
        "platform": runner.platform.name,
        # An embedding model (an encoder, or a decoder with --is-embedding) and its vectors.
        "is_generation": runner.is_generation,
        **runner.embedding_facts(),
        # the engine constraints are enforced with; the front refuses them under "none"
        "grammar_backend": "none" if scheduler.grammars is None else scheduler.grammars.name,
        # Per type in the model file: how many tensors, and what they are served as.
        "weight_types": served_weight_types(runner.model),
        # LoRA: whether adapters are served, and those loaded at start.
        "lora_enabled": runner.lora is not None,
        "lora_adapters": (
            [msgspec.structs.asdict(a) for a in runner.lora.describe()] if runner.lora else []
        ),
    }
