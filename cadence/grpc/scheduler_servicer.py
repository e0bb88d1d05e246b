"""`sglang.grpc.scheduler.SglangScheduler`: the service SGLang's gateway (SMG) drives.

With it, SMG does the HTTP side itself (OpenAI and native parsing, chat templates,
tokenization, detokenization, stop strings) and sends token ids; Cadence runs only the
scheduler path. Like `SglangServicer`, it reaches the engine through the front's one
`EngineClient`: a Generate call becomes the `GenerateReqInput` /generate builds from
token ids, so the front's checks apply, and its failures become status codes through
`errors.rpc` (never inside a message). A call that ends early (client cancel, deadline,
error) closes its result iterator, which aborts the request in the engine.

Served: Generate, Embed (an embedding model's vectors; INVALID_ARGUMENT for a generation
model), HealthCheck, Abort, GetModelInfo, GetServerInfo, GetLoads, FlushCache,
StartProfile/StopProfile, GetTokenizer, and the LoRA RPCs (LoadLoRAAdapter,
UnloadLoRAAdapter, ListLoadedLoRAAdapters) through the engine client's named methods.
A Generate call names its adapter in `lora_id`: the id the server gave it (uuid5 of its
name and path, as SGLang's), the id its loader minted in LoadLoRAAdapter, or its name.
SubscribeKvEvents streams the scheduler's KV-cache events when --kv-events-config publishes
them (UNIMPLEMENTED otherwise, as SGLang answers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import types
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import msgspec
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from cadence.errors import InvalidParameter
from cadence.front.engine_client import EngineClient, ModelInfo
from cadence.front.health import probe_alive
from cadence.grpc import scheduler_convert as convert
from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import sglang_scheduler_pb2_grpc
from cadence.grpc import smg_common_pb2 as common
from cadence.grpc.errors import RpcError, rpc
from cadence.grpc.kv_event_stream import kv_event_batch_proto, kv_event_stream
from cadence.grpc.streams import BacklogWatch
from cadence.grpc.tokenizer_archive import TokenizerArchive, chunks
from cadence.io_struct import GenerateReqInput
from cadence.mem_cache.kv_events import KVEventsConfig
from cadence.serving import embedding_serving, native_api
from cadence.serving.state import ServerState
from cadence.version import __version__

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
SERVICE_NAME = SERVICE.full_name  # sglang.grpc.scheduler.SglangScheduler
# The service's message classes by name, from both of its proto modules (for add_service).
MESSAGE_TYPES = types.SimpleNamespace(
    **{
        name: getattr(module, name)
        for module in (common, pb)
        for name in module.DESCRIPTOR.message_types_by_name
    }
)
# SMG gives a health check 5 s; a probe that has not answered by then is unhealthy.
HEALTH_PROBE_TIMEOUT_S = 4.0
MAX_FLUSH_WAIT_S = 600.0
LOAD_SECTIONS = frozenset(("core", "memory", "spec", "lora", "disagg", "queues", "all"))
# GGUF architecture -> the Hugging Face class SGLang reports (when no config.json says it)
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


class _Calls:
    """Generation calls in flight, against the most allowed (--grpc-max-concurrent-requests)."""

    def __init__(self, max_active: int):
        self.max_active = max_active
        self.num_active = 0


class SglangSchedulerServicer(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """`state` is the front's ServerState (shared with HTTP). `calls` counts the gRPC
    generation calls in flight (`num_active`, `max_active`): pass SglangService's servicer
    so both services share one limit; by default this service counts its own."""

    def __init__(self, state: ServerState, calls=None):
        self.state = state
        self.args = state.args
        self.calls = calls or _Calls(self.args.effective_grpc_max_concurrent_requests)
        self.backlogs = BacklogWatch(self.args.grpc_stream_buffer)
        self.last_output_at = 0.0  # wall clock of the last result a Generate call received
        self._archives: dict[str, TokenizerArchive] = {}
        self._config: dict[str, Any] | None = None  # the model's config.json, once read

    # ---- gates -------------------------------------------------------------------------

    def _client(self) -> EngineClient:
        """The engine client, or UNAVAILABLE while the server starts or stops."""
        self.state.check_ready(hint="; retry once HealthCheck passes")
        return self.state.client

    def _admit(self, client: EngineClient) -> None:
        if client.is_paused:
            raise RpcError(409, "generation is paused; continue it (/continue_generation) first")
        if self.calls.num_active >= self.calls.max_active:
            raise RpcError(
                429,
                f"the server is overloaded: {self.calls.max_active} gRPC generation calls are in "
                "flight (--grpc-max-concurrent-requests); retry later",
            )

    # ---- generation --------------------------------------------------------------------

    @rpc
    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        client = self._client()
        request_id = request.request_id or uuid.uuid4().hex
        obj = convert.generate_input(request, client.info, request_id)
        if request.lora_id:
            obj.lora_path = (await client.lora.resolve(request.lora_id, "lora_id", by_id=True)).name
        self._admit(client)
        self.calls.num_active += 1
        try:
            results = client.generate(obj)
            if obj.stream:
                messages = self._stream(client, obj, results, request_id, context)
            else:
                messages = self._final(results, request_id)
            try:
                async for msg in messages:
                    yield msg
            finally:
                await messages.aclose()
        finally:
            self.calls.num_active -= 1

    async def _final(self, results: AsyncIterator, request_id: str):
        """Without `stream`: one GenerateComplete per sample, once all have ended."""
        async with contextlib.aclosing(results):
            async for result in results:
                self.last_output_at = time.time()
                samples = result if isinstance(result, list) else [result]
                for index, sample in enumerate(samples):
                    yield convert.complete_response(request_id, sample, index)

    async def _stream(
        self, client: EngineClient, obj: GenerateReqInput, results, request_id: str, context
    ):
        """One GenerateStreamChunk per delta, and a GenerateComplete when a sample ends. The
        backlog watch ends the call if the client stops reading."""
        totals: dict[int, convert.Totals] = {}
        num_sent = 0

        def rids() -> list[str]:
            if not obj.is_normalized:  # the rids are known once the front has checked it
                return []
            return [obj.rid] if obj.is_single else list(obj.rid)

        async def overflow(error: RpcError):
            for rid in rids():  # the engine stops at once, whatever becomes of this handler
                client.abort(rid, message="the gRPC client stopped reading its stream")
            await context.abort(error.code, str(error))

        watch = self.backlogs.watch(lambda: client.backlog(rids(), num_sent), overflow)
        try:
            async for chunk in results:
                self.last_output_at = time.time()
                index = chunk.get("index", 0)
                total = totals.setdefault(index, convert.Totals())
                total.add(chunk)
                msg = convert.chunk_response(request_id, chunk, index)
                if msg is not None:
                    yield msg
                num_sent += len(chunk["output_ids"])
                if convert.is_finished(chunk):
                    yield convert.complete_response(request_id, total.result(), index)
        finally:
            self.backlogs.unwatch(watch)
            await results.aclose()  # aborts what still runs

    @rpc
    async def Abort(self, request, context):
        """Ends the request (and its n > 1 samples); success whether or not it was live."""
        if not request.request_id:
            raise InvalidParameter("request_id", "request_id is required: the request to abort")
        reason = request.reason or "aborted by the Abort RPC"
        was_live = self._client().abort(request.request_id, message=reason)
        message = "aborted" if was_live else "no live request has this id; nothing to abort"
        return pb.AbortResponse(success=True, message=message)

    @rpc
    async def Embed(self, request, context):
        """One tokenized input's embedding (a classifier's class logits), through the front's
        embedding path; a generation model answers INVALID_ARGUMENT."""
        client = self._client()
        obj = convert.embed_input(request, request.request_id or uuid.uuid4().hex)
        self._admit(client)
        self.calls.num_active += 1
        try:
            result = await embedding_serving.encode(client, obj)
        finally:
            self.calls.num_active -= 1
        self.last_output_at = time.time()
        vector = result["embedding"]
        return pb.EmbedResponse(
            embedding_dim=len(vector),
            embedding=vector,
            prompt_tokens=result["meta_info"].get("prompt_tokens", 0),
        )

    # ---- health and information --------------------------------------------------------

    @rpc
    async def HealthCheck(self, request, context):
        """Healthy when a one-token probe generation passes through the whole pipeline, or,
        while the probe waits for room (a full KV pool), when the scheduler answers that it
        is running requests: a busy engine is a live one. Within HEALTH_PROBE_TIMEOUT_S."""
        state = self.state
        if state.is_shutting_down:
            return pb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if not state.is_ready or state.client is None:
            return pb.HealthCheckResponse(healthy=False, message="the model is loading")
        client = state.client
        if client.is_paused:  # up by choice
            return pb.HealthCheckResponse(healthy=True, message="generation is paused")
        healthy, message = await probe_alive(client, HEALTH_PROBE_TIMEOUT_S)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    @rpc
    async def GetModelInfo(self, request, context):
        client = self._client()
        info = client.info
        config = self._model_config(info)
        architectures = config.get("architectures") or (
            [_HF_ARCHITECTURES[info.architecture]] if info.architecture in _HF_ARCHITECTURES else []
        )
        return pb.GetModelInfoResponse(
            model_path=info.model_path,
            tokenizer_path=info.tokenizer_dir or "",
            is_generation=info.is_generation,
            preferred_sampling_params=self.state.args.preferred_sampling_params or "",
            weight_version=await client.get_weight_version(),
            default_sampling_params_json="",  # no defaults beyond the native API's
            served_model_name=info.served_model_name,
            max_context_length=info.context_len,
            vocab_size=info.vocab_size,
            model_type=config.get("model_type") or info.architecture,
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=_max_input_len(info),
            architectures=[str(a) for a in architectures],
        )

    def _model_config(self, info: ModelInfo) -> dict[str, Any]:
        """The model's config.json beside its tokenizer files, if it has one ({} if not)."""
        if self._config is None:
            self._config = {}
            path = os.path.join(info.tokenizer_dir or "", "config.json")
            if info.tokenizer_dir and os.path.isfile(path):
                try:
                    with open(path) as f:
                        config = json.load(f)
                    self._config = config if isinstance(config, dict) else {}
                except (OSError, ValueError) as e:
                    logger.warning("cannot read %s: %s", path, e)
        return self._config

    @rpc
    async def GetServerInfo(self, request, context):
        client = self._client()
        info, args = client.info, self.args
        server_args = args.to_dict()
        server_args.pop("api_key", None)  # never echo a secret
        server_args.update(
            model_path=info.model_path,
            served_model_name=info.served_model_name,
            tokenizer_path=info.tokenizer_dir,
            tp_size=1,
            dp_size=1,
            context_length=info.context_len,
            max_total_tokens=info.max_total_tokens,
            max_running_requests=args.max_running_requests,
            is_embedding=not info.is_generation,
            vocab_size=info.vocab_size,
        )
        scheduler_info = {
            **self.state.runtime,
            "max_total_num_tokens": info.max_total_tokens,
            "max_req_input_len": _max_input_len(info),
            "max_running_requests": args.max_running_requests,
            "is_generation": info.is_generation,
        }
        start_time = Timestamp()
        start_time.FromNanoseconds(int(self.state.started * 1e9))
        return pb.GetServerInfoResponse(
            server_args=_struct(server_args),
            scheduler_info=_struct(scheduler_info),
            active_requests=client.stats().get("num_live_requests", 0),
            is_paused=client.is_paused,
            last_receive_timestamp=self.last_output_at,
            uptime_seconds=time.time() - self.state.started,
            sglang_version=__version__,
            server_type="grpc",
            start_time=start_time,
            max_total_num_tokens=info.max_total_tokens,
        )

    @rpc
    async def GetLoads(self, request, context):
        sections = set(request.include) or {"all"}
        unknown = sorted(sections - LOAD_SECTIONS)
        if unknown:
            raise InvalidParameter(
                "include",
                f"include: unknown section {unknown[0]!r}; use {', '.join(sorted(LOAD_SECTIONS))}",
            )
        dp_rank = native_api.check_dp_rank(request.dp_rank if request.HasField("dp_rank") else None)
        max_running = self.args.max_running_requests
        loads = [
            _scheduler_load(load, max_running, sections)
            for load in await self._client().get_load(dp_rank)
        ]
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=__version__,
            dp_rank_count=len(loads),
            loads=loads,
            aggregate=_aggregate(loads),
        )

    # ---- control -----------------------------------------------------------------------

    @rpc
    async def FlushCache(self, request, context):
        """Flushes the prefix cache, once no request runs: at once (timeout_s 0), or as soon
        as the running ones have ended within timeout_s. Not flushed: success false."""
        wait = request.timeout_s
        if not math.isfinite(wait) or not 0 <= wait <= MAX_FLUSH_WAIT_S:
            raise InvalidParameter(
                "timeout_s", f"timeout_s must be in [0, {MAX_FLUSH_WAIT_S:g}] seconds, got {wait}"
            )
        out = await self._client().flush_cache(wait_s=wait)
        if not out.success:
            return common.FlushCacheResponse(
                success=False, message=f"cannot flush the cache: {out.message}"
            )
        return common.FlushCacheResponse(success=True, message="Cache flushed.")

    @rpc
    async def StartProfile(self, request, context):
        """Starts the torch profiler, after start_step forward steps when given; traces go
        under the server's --profile-dir (a client names a subdirectory at most).
        activities, with_stack, record_shapes and profile_by_stage are the profiler's own
        choice here and are ignored."""
        output_dir = request.output_dir if request.HasField("output_dir") else None
        num_steps = request.num_steps if request.HasField("num_steps") else None
        start_step = request.start_step if request.HasField("start_step") else None
        out = await self._client().start_profile(output_dir, num_steps, start_step)
        return common.ProfileResponse(
            success=out.success, message=out.message or "profiling started"
        )

    @rpc
    async def StopProfile(self, request, context):
        out = await self._client().stop_profile()
        return common.ProfileResponse(
            success=out.success, message=out.message or "profiling stopped"
        )

    @rpc
    async def GetTokenizer(self, request, context) -> AsyncIterator[common.GetTokenizerChunk]:
        """The tokenizer directory as a zip archive in 64 KiB chunks; the last carries the
        archive's SHA-256."""
        directory = self._client().info.tokenizer_dir
        if not directory:
            raise RpcError(409, "this server has no local tokenizer directory to send")
        archive = self._archives.get(directory)
        if archive is None:
            archive = self._archives[directory] = TokenizerArchive(directory)
        try:
            data, sha256 = await archive.get()
        except (OSError, ValueError) as e:
            raise RpcError(409, f"cannot send the tokenizer: {e}") from None
        for piece, digest in chunks(data, sha256):
            yield common.GetTokenizerChunk(data=piece, sha256=digest)

    # ---- LoRA adapters -------------------------------------------------------------------

    @rpc
    async def LoadLoRAAdapter(self, request, context):
        """Loads an adapter; Generate calls may name it by the `lora_id` minted here (or by
        its name, or the server's id). Not loaded: success false and why."""
        client = self._client()
        out = await client.load_lora_adapter(request.lora_name, request.lora_path, request.pinned)
        if out.success and request.lora_id:
            client.lora.aliases[request.lora_id] = request.lora_name
        return pb.LoadLoRAAdapterResponse(
            success=out.success, message=out.error_message, loaded_lora_ids=_ids(client, out)
        )

    @rpc
    async def UnloadLoRAAdapter(self, request, context):
        """Unloads the adapter `lora_name` names (or, without a name, `lora_id`)."""
        client = self._client()
        name = request.lora_name
        if not name and request.lora_id:
            name = (await client.lora.resolve(request.lora_id, "lora_id", by_id=True)).name
        if not name:
            raise InvalidParameter("lora_name", "lora_name is required: the adapter to unload")
        out = await client.unload_lora_adapter(name)
        return pb.UnloadLoRAAdapterResponse(
            success=out.success, message=out.error_message, loaded_lora_ids=_ids(client, out)
        )

    @rpc
    async def ListLoadedLoRAAdapters(self, request, context):
        client = self._client()
        return pb.ListLoadedLoRAAdaptersResponse(
            loaded_adapters=[
                pb.LoadedLoRAAdapter(
                    lora_id=client.lora.id_of(a),
                    lora_name=a.name,
                    lora_path=a.path,
                    pinned=a.pinned,
                )
                for a in await client.list_lora_adapters()
            ]
        )

    # ---- not served ----------------------------------------------------------------------

    @rpc
    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[common.KvEventBatch]:
        """The scheduler's KV-cache events (--kv-events-config), as SMG's router reads them:
        from now (start_sequence_number 0), or from a buffered batch on through the
        publisher's replay endpoint."""
        config = KVEventsConfig.parse(self.args.kv_events_config)
        if config is None:
            raise RpcError(
                501,
                "SubscribeKvEvents: this server publishes no KV-cache events; start it with "
                """--kv-events-config '{"publisher": "zmq"}'""",
            )
        async with kv_event_stream(config, request.start_sequence_number) as batches:
            event_id = 0
            async for seq, batch in batches:
                out = kv_event_batch_proto(seq, batch, event_id)
                event_id += len(out.events)
                yield out


# ---- helpers ----------------------------------------------------------------------------------


async def _drain(results: AsyncIterator) -> None:
    async with contextlib.aclosing(results):
        async for _ in results:
            pass


def _ids(client: EngineClient, out) -> list[str]:
    """The ids of the adapters loaded after a load or unload (the ones their loaders minted
    where they did)."""
    return [client.lora.id_of(a) for a in out.loaded_adapters]


def _max_input_len(info: ModelInfo) -> int:
    """The longest prompt that leaves room for one output token in the context and the pool."""
    return max(min(info.context_len, info.max_total_tokens) - 1, 0)


def _struct(values: dict[str, Any]) -> Struct:
    """A protobuf Struct of `values`, made JSON-safe first (tuples, paths, ...)."""
    struct = Struct()
    struct.update(msgspec.json.decode(msgspec.json.encode(values, enc_hook=str)))
    return struct


def _scheduler_load(load, max_running: int, sections: set[str]) -> pb.SchedulerLoad:
    """SGLang's per-rank load record from the scheduler's GetLoadReqOutput. `utilization`
    is the larger of the KV pool's use and the running batch's share of its maximum."""
    entry = pb.SchedulerLoad(
        dp_rank=load.dp_rank,
        num_running_reqs=load.num_running_reqs,
        num_waiting_reqs=load.num_waiting_reqs,
        num_total_reqs=load.num_running_reqs + load.num_waiting_reqs,
        num_used_tokens=load.num_used_tokens,
        max_total_num_tokens=load.max_total_num_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        cache_hit_rate=load.cache_hit_rate,
        utilization=max(load.token_usage, load.num_running_reqs / max(max_running, 1)),
        max_running_requests=max_running,
    )
    if sections & {"memory", "all"}:
        entry.memory.token_capacity = load.max_total_num_tokens
    if sections & {"queues", "all"}:
        entry.queues.waiting = load.num_waiting_reqs
    if load.spec_accept_length is not None:
        entry.speculative.accept_length = load.spec_accept_length
        entry.speculative.accept_rate = load.spec_accept_rate or 0.0
    if load.lora_slots_total and sections & {"lora", "all"}:
        entry.lora.slots_used = load.lora_slots_used or 0
        entry.lora.slots_total = load.lora_slots_total
        entry.lora.utilization = entry.lora.slots_used / load.lora_slots_total
    return entry


def _aggregate(loads: list[pb.SchedulerLoad]) -> pb.AggregateMetrics:
    if not loads:
        return pb.AggregateMetrics()
    n = len(loads)
    return pb.AggregateMetrics(
        total_running_reqs=sum(x.num_running_reqs for x in loads),
        total_waiting_reqs=sum(x.num_waiting_reqs for x in loads),
        total_reqs=sum(x.num_total_reqs for x in loads),
        avg_token_usage=sum(x.token_usage for x in loads) / n,
        avg_throughput=sum(x.gen_throughput for x in loads) / n,
        avg_utilization=sum(x.utilization for x in loads) / n,
    )
