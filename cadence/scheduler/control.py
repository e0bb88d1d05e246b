"""The scheduler's control desk: the answer to every control message a front sends (flush,
pause and continue, load, profile, weight update, sessions, LoRA adapters).

Requests and aborts are the scheduler's own (`Scheduler.handle`); these messages read its
state and act on it through its public methods, and each returns the reply its caller waits
for (or None). `Scheduler.handle` first takes back the step in flight for any of them but the
load query, so that none sees a step half applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from cadence.constrained.grammar_queue import GrammarQueue
from cadence.io_struct import (
    CloseSessionReqInput,
    CloseSessionReqOutput,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetLoRAAdaptersReqInput,
    GetWeightVersionReqInput,
    GetWeightVersionReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
)
from cadence.mem_cache.kv_manager import KVManager
from cadence.model_executor.lora_manager import NOT_ENABLED as LORA_NOT_ENABLED
from cadence.model_executor.runner import Runner
from cadence.scheduler.disaggregation import DecodeIntake, PrefillHandoff
from cadence.scheduler.embedding import EmbeddingQueue
from cadence.scheduler.profiler import Profiler
from cadence.scheduler.req import Req
from cadence.scheduler.sessions import SessionController
from cadence.scheduler.speculative import Speculation
from cadence.server_args import ServerArgs


class Controlled(Protocol):
    """What the desk reads and acts on: the scheduler's (`scheduler.py`)."""

    args: ServerArgs
    runner: Runner
    kv: KVManager
    running: list[Req]
    chunked: Req | None
    grammars: GrammarQueue | None
    embeds: EmbeddingQueue
    pd: PrefillHandoff | DecodeIntake | None
    spec: Speculation | None
    sessions: SessionController
    profiler: Profiler
    is_paused: bool
    weight_version: str

    @property
    def waiting(self) -> deque[Req]: ...

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "") -> None: ...

    def retract_all(self) -> None: ...

    def throughput(self) -> float: ...

    def cache_hit_rate(self) -> float: ...


class ControlDesk:
    """Control messages of one scheduler, by type (`handlers`)."""

    def __init__(self, scheduler: Controlled):
        self.scheduler = scheduler

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            FlushCacheReqInput: self.flush,
            PauseGenerationReqInput: self.pause,
            ContinueGenerationReqInput: self.resume,
            GetLoadReqInput: self.load,
            ProfileReq: self.profile,
            UpdateWeightFromDiskReqInput: self.update_weights,
            UpdateWeightVersionReqInput: self.update_weight_version,
            GetWeightVersionReqInput: self.weight_version,
            OpenSessionReqInput: self.open_session,
            CloseSessionReqInput: self.close_session,
            LoadLoRAAdapterReqInput: self.load_lora,
            UnloadLoRAAdapterReqInput: self.unload_lora,
            GetLoRAAdaptersReqInput: self.list_lora,
        }

    def flush(self, msg: FlushCacheReqInput) -> FlushCacheReqOutput:
        """Empties the prefix cache, when nothing runs or waits (SGLang refuses it then too)."""
        s = self.scheduler
        busy = bool(
            s.running
            or s.waiting
            or s.chunked
            or s.grammars
            or s.embeds.num_waiting
            or (s.pd is not None and s.pd.waiting)
        )
        if not busy:
            s.kv.flush()  # what open sessions pin stays (their next turns need it)
            if s.spec is not None:
                s.spec.flush()
        return FlushCacheReqOutput(
            success=not busy, message="requests are running; retry when idle" if busy else ""
        )

    def pause(self, msg: PauseGenerationReqInput) -> None:
        s = self.scheduler
        if msg.mode == "abort":
            s.abort(abort_all=True, message="generation paused")
        elif msg.mode == "retract":
            s.retract_all()
        s.is_paused = True

    def resume(self, msg: ContinueGenerationReqInput) -> None:
        self.scheduler.is_paused = False

    def load(self, msg: GetLoadReqInput) -> GetLoadReqOutput:
        """What runs, waits and is held (SGLang's GetLoadReqOutput)."""
        s = self.scheduler
        usage = s.kv.usage()
        used, total = usage.num_used_tokens, usage.num_tokens
        load = GetLoadReqOutput(
            dp_rank=0,
            num_running_reqs=len(s.running) + (1 if s.chunked else 0),
            num_waiting_reqs=len(s.waiting)
            + len(s.grammars or ())
            + s.embeds.num_waiting
            + (len(s.pd.waiting) if s.pd is not None else 0),
            num_used_tokens=used,
            num_cached_tokens=usage.num_cached * usage.page_size,
            max_total_num_tokens=total,
            token_usage=used / total if total else 0.0,
            gen_throughput=s.throughput(),
            cache_hit_rate=s.cache_hit_rate(),
        )
        if s.spec is not None:
            (load.spec_accept_length, load.spec_accept_rate, load.avg_spec_accept_length) = (
                s.spec.load_figures()
            )
        if s.runner.lora is not None:
            load.lora_slots_used = len({r.lora_uid for r in s.running} - {None})
            load.lora_slots_total = s.args.max_loras_per_batch
        return load

    def profile(self, msg: ProfileReq) -> ProfileReqOutput:
        profiler = self.scheduler.profiler
        if msg.action == "start":
            ok, message = profiler.start(msg.output_dir, msg.num_steps, msg.start_step)
        else:
            ok, message = profiler.stop()
        return ProfileReqOutput(success=ok, message=message)

    def update_weights(self, msg: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        s = self.scheduler
        try:
            path = s.runner.load_weights(msg.model_path, msg.load_format)
        except Exception as e:  # the server keeps its old weights and says why
            return UpdateWeightFromDiskReqOutput(success=False, message=str(e))
        # Cached KV was computed by the old weights: none of it may be matched again.
        s.sessions.unpin_all()
        s.kv.flush()
        if msg.weight_version is not None:
            s.weight_version = msg.weight_version
        return UpdateWeightFromDiskReqOutput(success=True, message=f"loaded weights from {path}")

    def update_weight_version(
        self, msg: UpdateWeightVersionReqInput
    ) -> UpdateWeightVersionReqOutput:
        """Relabels the served weights; every live request is aborted first unless asked not."""
        s = self.scheduler
        if msg.abort_all_requests:
            s.abort(abort_all=True, message=f"weight version changed to {msg.new_version!r}")
        s.weight_version = msg.new_version
        return UpdateWeightVersionReqOutput(
            success=True,
            message=f"weight version updated to {msg.new_version}",
            new_version=msg.new_version,
        )

    def weight_version(self, msg: GetWeightVersionReqInput) -> GetWeightVersionReqOutput:
        return GetWeightVersionReqOutput(weight_version=self.scheduler.weight_version)

    def open_session(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        return self.scheduler.sessions.open(msg)

    def close_session(self, msg: CloseSessionReqInput) -> CloseSessionReqOutput:
        if self.scheduler.sessions.close(msg.session_id):
            return CloseSessionReqOutput(success=True)
        return CloseSessionReqOutput(success=False, message=f"no open session {msg.session_id!r}")

    def load_lora(self, msg: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        return self._lora_update(lambda lora: lora.load(msg.lora_name, msg.lora_path, msg.pinned))

    def unload_lora(self, msg: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        return self._lora_update(lambda lora: lora.unload(msg.lora_name))

    def list_lora(self, msg: GetLoRAAdaptersReqInput) -> LoRAUpdateOutput:
        return self._lora_update(lambda lora: None)

    def _lora_update(self, change) -> LoRAUpdateOutput:
        """A change to the loaded adapters (SGLang's LoRAUpdateOutput): every adapter loaded
        after it, or why it failed (an unloaded adapter's requests run on to their end)."""
        lora = self.scheduler.runner.lora
        if lora is None:
            return LoRAUpdateOutput(success=False, error_message=LORA_NOT_ENABLED)
        try:
            change(lora)
        except ValueError as e:
            return LoRAUpdateOutput(
                success=False, error_message=str(e), loaded_adapters=lora.describe()
            )
        return LoRAUpdateOutput(success=True, loaded_adapters=lora.describe())
