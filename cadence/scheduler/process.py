"""The scheduler process: owns the model and KV memory; one loop of receive → dispatch → step.

It never blocks on a client: requests and control messages arrive on a ZMQ PULL socket and
are drained between steps; token outputs go to the detokenizer, control answers straight
back to the asking front process.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import msgspec
import torch
import zmq

from cadence import io_struct
from cadence.io_struct import (AbortReq, ContinueGenerationReqInput, FlushCacheReqInput, FlushCacheReqOutput,
                               GetLoadReqInput, GetLoadReqOutput, PauseGenerationReqInput, ProfileReq,
                               ProfileReqOutput, TokenizedGenerateReqInput, UpdateWeightFromDiskReqInput,
                               UpdateWeightFromDiskReqOutput)
from cadence.ipc import FrontRouter, Heartbeat, IpcPaths, bind, connect, die_with_parent
from cadence.scheduler.req import req_from_tokenized, to_batch_output
from cadence.scheduler.scheduler import Scheduler
from cadence.server_args import ServerArgs

logger = logging.getLogger("cadence.scheduler")

# How long loading new weights may stop the loop before the watchdog calls it stuck.
WEIGHT_LOAD_GRACE_S = 900.0

# Control requests the asking front waits on, and the type of their answer.
_REPLIES = {
    FlushCacheReqInput: FlushCacheReqOutput,
    ProfileReq: ProfileReqOutput,
    UpdateWeightFromDiskReqInput: UpdateWeightFromDiskReqOutput,
}


class SchedulerProcess:
    def __init__(self, args: ServerArgs, paths: IpcPaths, model_path: str, tokenizer, heartbeat: Heartbeat | None = None):
        self.args = args
        self.heartbeat = heartbeat
        self.scheduler = Scheduler(args, model_path, tokenizer)
        self.ctx = zmq.Context(1)
        self.inbox = bind(self.ctx, zmq.PULL, paths.scheduler_input)
        self.to_detokenizer = connect(self.ctx, zmq.PUSH, paths.detokenizer_input)
        self.fronts = FrontRouter(self.ctx)
        self.profiler: torch.profiler.profile | None = None
        self.profile_dir: str | None = None
        self.handlers = {
            TokenizedGenerateReqInput: self._on_generate,
            AbortReq: self._on_abort,
            FlushCacheReqInput: self._on_flush,
            PauseGenerationReqInput: self._on_pause,
            ContinueGenerationReqInput: self._on_continue,
            GetLoadReqInput: self._on_get_load,
            ProfileReq: self._on_profile,
            UpdateWeightFromDiskReqInput: self._on_update_weights,
        }

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        parent = os.getppid()
        while True:
            if self.heartbeat is not None:
                self.heartbeat.beat()
            timeout = 0 if self.scheduler.has_work else 1000
            if self.inbox.poll(timeout):
                while True:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(data.bytes)
            elif os.getppid() != parent:
                return  # the server is gone
            self._send_outputs(self.scheduler.step())

    def _dispatch(self, data: bytes) -> None:
        """Handles one message; a message that cannot be decoded or handled is logged and
        answered where it can be, never allowed to stop the loop."""
        try:
            msg = io_struct.decode(data)
        except Exception:
            logger.exception("dropped a message the scheduler cannot decode (%d bytes)", len(data))
            return
        try:
            self.handlers[type(msg)](msg)
        except Exception as e:
            logger.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, TokenizedGenerateReqInput):
                self.scheduler.fail(req_from_tokenized(msg), e, "being admitted")
            elif type(msg) in _REPLIES:
                reply = _REPLIES[type(msg)](success=False, message=f"internal error: {type(e).__name__}: {e}")
                reply.http_worker_ipc = msg.http_worker_ipc
                self.fronts.send(msg.http_worker_ipc, reply)
        self._flush_outputs()

    def _send_outputs(self, outputs) -> None:
        if not outputs:
            return
        try:
            data = io_struct.encode(to_batch_output(outputs))
        except Exception as e:
            # One request's output cannot be encoded: find it, fail it, send the others.
            logger.exception("encoding a step's outputs failed; checking them one by one")
            good = []
            for out in outputs:
                try:
                    io_struct.encode(to_batch_output([out]))
                    good.append(out)
                except Exception:
                    self.scheduler.fail_rid(out.rid, e, "encoding its output")
            good += self.scheduler.outputs
            self.scheduler.outputs = []
            data = io_struct.encode(to_batch_output(good)) if good else None
        if data is not None:
            self.to_detokenizer.send(data, copy=False)

    def _flush_outputs(self) -> None:
        outputs, self.scheduler.outputs = self.scheduler.outputs, []
        self._send_outputs(outputs)

    # ---- handlers ------------------------------------------------------------------------

    def _on_generate(self, msg: TokenizedGenerateReqInput) -> None:
        self.scheduler.add_request(req_from_tokenized(msg))

    def _on_abort(self, msg: AbortReq) -> None:
        self.scheduler.abort(msg.rid, msg.abort_all, msg.message or "aborted")
        self._flush_outputs()

    def _on_flush(self, msg: FlushCacheReqInput) -> None:
        s = self.scheduler
        busy = bool(s.running or s.waiting or s.chunked)
        reply = FlushCacheReqOutput(success=not busy, http_worker_ipc=msg.http_worker_ipc,
                                    message="requests are running; retry when idle" if busy else "")
        self.fronts.send(msg.http_worker_ipc, reply)

    def _on_pause(self, msg: PauseGenerationReqInput) -> None:
        s = self.scheduler
        if msg.mode == "abort":
            s.abort(abort_all=True, message="generation paused")
        elif msg.mode == "retract":
            s.retract_all()
        s.is_paused = True
        self._flush_outputs()

    def _on_continue(self, msg: ContinueGenerationReqInput) -> None:
        self.scheduler.is_paused = False

    def _on_get_load(self, msg: GetLoadReqInput) -> None:
        s = self.scheduler
        used = s.num_used_tokens()
        total = s.runner.max_total_tokens
        self.fronts.send(msg.http_worker_ipc, GetLoadReqOutput(
            dp_rank=0, num_running_reqs=len(s.running) + (1 if s.chunked else 0),
            num_waiting_reqs=len(s.waiting), num_used_tokens=used, num_cached_tokens=0,
            max_total_num_tokens=total, token_usage=used / total if total else 0.0,
            gen_throughput=s.throughput(), cache_hit_rate=0.0, http_worker_ipc=msg.http_worker_ipc))

    def _on_profile(self, msg: ProfileReq) -> None:
        if msg.action == "start":
            if self.profiler is not None:
                reply = ProfileReqOutput(success=False, message="a profile is already running")
            else:
                self.profile_dir = _profile_dir(self.args.effective_profile_dir, msg.output_dir)
                os.makedirs(self.profile_dir, mode=0o700, exist_ok=True)
                self.profiler = torch.profiler.profile(activities=self.scheduler.runner.platform.profiler_activities())
                self.profiler.__enter__()
                reply = ProfileReqOutput(success=True, message=f"profiling into {self.profile_dir}")
        elif self.profiler is None:
            reply = ProfileReqOutput(success=False, message="no profile is running; start one first")
        else:
            self.profiler.__exit__(None, None, None)
            path = os.path.join(self.profile_dir, f"trace-{int(time.time())}-{os.getpid()}.json")
            self.profiler.export_chrome_trace(path)
            self.profiler = None
            reply = ProfileReqOutput(success=True, message=path)
        reply.http_worker_ipc = msg.http_worker_ipc
        self.fronts.send(msg.http_worker_ipc, reply)

    def _on_update_weights(self, msg: UpdateWeightFromDiskReqInput) -> None:
        from cadence.model_loader.loader import load_model
        from cadence.model_loader.locate import resolve_model_path

        runner = self.scheduler.runner
        if self.heartbeat is not None:
            self.heartbeat.busy(WEIGHT_LOAD_GRACE_S)  # loading stops the loop, by design
        try:
            path = resolve_model_path(msg.model_path)
            config, model = load_model(path, runner.dtype, runner.device, progress=False)
            runner.adopt_weights(config, model)
            del model  # its tensors now belong to the runner; anything left over goes back
            runner.platform.empty_cache()
            reply = UpdateWeightFromDiskReqOutput(success=True, message=f"loaded weights from {path}")
        except Exception as e:  # the server keeps its old weights and says why
            reply = UpdateWeightFromDiskReqOutput(success=False, message=str(e))
        reply.http_worker_ipc = msg.http_worker_ipc
        self.fronts.send(msg.http_worker_ipc, reply)


def _profile_dir(root: str, name: str | None) -> str:
    """Where a trace goes: `root` (the operator's --profile-dir) or one plain subdirectory of
    it. The front checked `name` already; a path that leaves `root` is refused here too."""
    path = os.path.realpath(os.path.join(root, name)) if name else os.path.realpath(root)
    if os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root):
        raise ValueError(f"output_dir {name!r} is not a subdirectory of --profile-dir")
    return path


def run_scheduler_process(args: ServerArgs, paths: IpcPaths, model_path: str, ready_pipe,
                          heartbeat: Heartbeat | None = None) -> None:
    """Entry of the scheduler process. Reports the loaded model's facts (or the load error)
    through `ready_pipe` as msgpack bytes, then serves until the server goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front process decides when we stop
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        from cadence.model_loader.loader import load_tokenizer
        from cadence.plugins import load_plugins

        load_plugins()
        tokenizer = load_tokenizer(model_path, args.tokenizer_path)
        proc = SchedulerProcess(args, paths, model_path, tokenizer, heartbeat)
        runner = proc.scheduler.runner
        ready_pipe.send_bytes(msgspec.msgpack.encode({
            "status": "ready", "context_len": runner.context_len, "vocab_size": runner.config.vocab_size,
            "max_total_tokens": runner.max_total_tokens, "dtype": str(runner.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""), "platform": runner.platform.name,
        }))
        if heartbeat is not None:
            heartbeat.beat()
    except Exception as e:
        ready_pipe.send_bytes(msgspec.msgpack.encode({"status": "error", "error": f"{e}",
                                                      "traceback": traceback.format_exc()}))
        raise SystemExit(1)
    proc.run()
