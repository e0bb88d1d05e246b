"""`sglang.runtime.v1.SglangService`: every RPC of the contract over the front's one engine.

Thin by design, like the HTTP adapter: turn the request message into what the HTTP route
would build (`GenerateReqInput`, raw OpenAI JSON), call the same code below it, and turn
the result into messages. Failures become status codes through `errors.rpc`; nothing is
reported inside a message. A call that ends early (client cancel, deadline, error) closes
its result iterator, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from cadence.errors import CadenceError, InvalidParameter
from cadence.front.engine_client import EngineClient
from cadence.front.health import probe
from cadence.grpc import convert, sglang_pb2_grpc
from cadence.grpc import sglang_pb2 as pb
from cadence.grpc.errors import RpcError, rpc
from cadence.grpc.streams import BacklogWatch, buffered
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput
from cadence.serving import embedding_serving, native_api
from cadence.serving.bundle import serving_of
from cadence.serving.errors import FAULT_HEADER
from cadence.serving.openai_results import OpenAIResponse, StreamFailed
from cadence.serving.speech_serving import speech_params
from cadence.serving.state import ServerState

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
# The unary OpenAI pass-through RPCs and the EmbeddingServing method (the HTTP route) of each.
_OPENAI_UNARY = {
    "OpenAIEmbed": "embeddings",
    "OpenAIClassify": "classify",
    "Score": "score",
    "Rerank": "rerank",
}


class SglangServicer(sglang_pb2_grpc.SglangServiceServicer):
    """`state` is the front's ServerState (shared with HTTP): `client` is None until loaded."""

    def __init__(self, state: ServerState):
        self.state = state
        self.args = state.args
        serving = serving_of(state)  # the same objects the HTTP routes answer through
        self.openai = serving.openai
        self.embedding = serving.embeddings
        self.speech = serving.speech
        self.max_active = self.args.effective_grpc_max_concurrent_requests
        self.num_active = 0  # generation calls in flight
        self.backlogs = BacklogWatch(self.args.grpc_stream_buffer)

    # ---- gates -------------------------------------------------------------------------

    def _client(self) -> EngineClient:
        """The engine client, or UNAVAILABLE while the server starts or stops."""
        self.state.check_ready(hint="; retry once grpc.health.v1 reports SERVING")
        return self.state.client

    def _admit(self) -> None:
        if self.num_active >= self.max_active:
            raise RpcError(
                429,
                f"the server is overloaded: {self.max_active} gRPC generation calls are in flight "
                "(--grpc-max-concurrent-requests); retry later",
            )

    def _check_not_paused(self) -> None:
        if self.state.client is not None and self.state.client.is_paused:
            raise RpcError(
                409, "generation is paused (PauseGeneration); call ContinueGeneration first"
            )

    # ---- generation --------------------------------------------------------------------

    @rpc
    async def _generate(self, request, context, make: Callable[[dict, bool], Any]) -> AsyncIterator:
        """TextGenerate and Generate: one request, its results as messages built by `make`."""
        obj = convert.generate_input(request)
        client = self._client()
        self._check_not_paused()
        self._admit()
        self.num_active += 1
        try:
            if obj.stream:
                messages = self._stream(client, obj, context, make)
                try:
                    async for msg in messages:
                        yield msg
                finally:
                    await messages.aclose()
                return
            result = await native_api.last_result(client.generate(obj))
            samples = result if isinstance(result, list) else [result]
            outcomes = []
            for index, chunk in enumerate(samples):
                if len(samples) > 1:
                    chunk["index"] = index
                outcomes.append(_messages(chunk, make, final=True))
            for _, cancelled in outcomes:
                if cancelled:
                    raise RpcError(499, cancelled)
            for msgs, _ in outcomes:
                for msg in msgs:
                    yield msg
        finally:
            self.num_active -= 1

    TextGenerate = functools.partialmethod(_generate, make=convert.text_response)
    Generate = functools.partialmethod(_generate, make=convert.ids_response)

    async def _stream(
        self, client: EngineClient, obj: GenerateReqInput, context, make
    ) -> AsyncIterator:
        """One message per result chunk, sent as it comes; the backlog watch ends the call
        if the client stops reading (what the request produced minus what was sent)."""
        results = client.generate(obj)
        sent = _Sent(client, obj)

        async def overflow(error: RpcError):
            for rid in sent.rids():  # the engine stops at once, whatever becomes of this handler
                client.abort(rid, message="the gRPC client stopped reading its stream")
            await context.abort(error.code, str(error))

        watch = self.backlogs.watch(sent.backlog, overflow)
        try:
            async for chunk in results:
                msgs, cancelled = _messages(chunk, make, final=convert.is_finished(chunk))
                for msg in msgs:
                    yield msg
                sent.num_tokens += len(chunk["output_ids"])
                if cancelled:
                    raise RpcError(499, cancelled)
        finally:
            self.backlogs.unwatch(watch)
            await results.aclose()  # aborts the request unless it finished

    # ---- embeddings and classification (the HTTP routes' own code) -------------------------

    @rpc
    async def TextEmbed(self, request, context):
        _require_text(request.text)
        result = await self._embed(embedding_serving.encode, request, text=request.text)
        return pb.TextEmbedResponse(**result)

    @rpc
    async def Embed(self, request, context):
        _require_ids(request.input_ids)
        result = await self._embed(
            embedding_serving.encode, request, input_ids=list(request.input_ids)
        )
        return pb.EmbedResponse(**result)

    @rpc
    async def Classify(self, request, context):
        if request.text and request.input_ids:
            raise InvalidParameter(
                "text", "text and input_ids are mutually exclusive: give exactly one of them"
            )
        if not request.text and not request.input_ids:
            raise InvalidParameter(
                "text", "text or input_ids is required: give exactly one of them"
            )
        if request.input_ids:
            _require_ids(request.input_ids)
            prompt = {"input_ids": list(request.input_ids)}
        else:
            prompt = {"text": request.text}
        result = await self._embed(embedding_serving.classify, request, **prompt)
        return pb.ClassifyResponse(**result)

    async def _embed(self, operation, request, **prompt) -> dict:
        """One input through `operation` (embedding_serving.encode or .classify), as the
        fields of the response message: `embedding`, and `meta_info` (a classifier's label
        and class probabilities among them)."""
        client = self._client()
        self._check_not_paused()
        self._admit()
        rid = request.rid if request.HasField("rid") else None
        self.num_active += 1
        try:
            result = await operation(client, EmbeddingReqInput(**prompt, rid=rid))
        finally:
            self.num_active -= 1
        meta = dict(result["meta_info"])
        for name in ("label", "probs"):
            if name in result:
                meta[name] = result[name]
        return {"embedding": result["embedding"], "meta_info": convert.meta_info(meta)}

    # ---- tokenizer (front process only) ---------------------------------------------------

    @rpc
    async def Tokenize(self, request, context):
        client = self._client()
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        [tokens] = await client.tokenize_batch([request.text], add_special, param="text")
        return pb.TokenizeResponse(
            tokens=tokens,
            count=len(tokens),
            max_model_len=client.info.context_len,
            input_text=request.text,
        )

    @rpc
    async def Detokenize(self, request, context):
        # The repeated field goes as it is: its size is checked before it becomes a list.
        [text] = await self._client().detokenize_batch([request.tokens])
        return pb.DetokenizeResponse(text=text)

    # ---- health and information --------------------------------------------------------

    @rpc
    async def HealthCheck(self, request, context):
        """Healthy when a one-token generation passes through the whole pipeline (as
        /health_generate); while paused, the engine is up by choice and reported healthy."""
        state = self.state
        if state.health_problem() is not None or state.client is None:
            return pb.HealthCheckResponse(healthy=False)
        if state.client.is_paused:
            return pb.HealthCheckResponse(healthy=True)
        try:
            await asyncio.wait_for(probe(state.client), HEALTH_CHECK_TIMEOUT_S)
        except (TimeoutError, CadenceError) as e:
            logger.warning(
                "gRPC HealthCheck: the probe generation failed: %s", e or type(e).__name__
            )
            return pb.HealthCheckResponse(healthy=False)
        return pb.HealthCheckResponse(healthy=True)

    @rpc
    async def GetModelInfo(self, request, context):
        client = self._client()
        version = await client.get_weight_version()
        return pb.GetModelInfoResponse(
            model_path=client.info.model_path,
            json_info=_json(native_api.model_info(client.info, self.state.args, version)),
        )

    @rpc
    async def GetServerInfo(self, request, context):
        info = await native_api.server_info(self.state)
        return pb.GetServerInfoResponse(json_info=_json(info))

    @rpc
    async def ListModels(self, request, context):
        self._client()
        body = msgspec.json.decode((await self.openai.list_models()).body)
        cards = [
            pb.ModelCard(
                id=m["id"],
                root=m.get("root") or "",
                parent=m.get("parent"),
                max_model_len=m.get("max_model_len"),
                capabilities=m.get("capabilities", []),
            )
            for m in body["data"]
        ]
        return pb.ListModelsResponse(models=cards)

    @rpc
    async def GetLoad(self, request, context):
        dp_rank = native_api.check_dp_rank(request.dp_rank if request.HasField("dp_rank") else None)
        loads = await self._client().get_load(dp_rank)
        return pb.GetLoadResponse(json_info=_json(native_api.load_entries(loads)))

    # ---- control -----------------------------------------------------------------------

    @rpc
    async def Abort(self, request, context):
        # As upstream: success once the abort is sent, whether or not the rid was still live.
        self._client().abort(request.rid or None, request.abort_all, "aborted by the Abort RPC")
        return pb.AbortResponse(success=True)

    @rpc
    async def FlushCache(self, request, context):
        out = await self._client().flush_cache()
        if not out.success:
            raise RpcError(409, f"cannot flush the cache: {out.message}")
        return pb.FlushCacheResponse(success=True, message="Cache flushed.")

    @rpc
    async def PauseGeneration(self, request, context):
        mode = request.mode or "abort"
        await self._client().pause_generation(mode)
        return pb.PauseGenerationResponse(message=f"generation paused (mode {mode})")

    @rpc
    async def ContinueGeneration(self, request, context):
        await self._client().continue_generation()
        return pb.ContinueGenerationResponse(message="generation continued")

    # ---- OpenAI JSON pass-through (the HTTP OpenAI routes' own code) ------------------------

    @rpc
    async def _openai_stream(
        self, request, context, route: str
    ) -> AsyncIterator[pb.OpenAIStreamChunk]:
        """ChatComplete and Complete: one message per SSE event of the HTTP route `route`
        (a method of OpenAIServing); the last has finished = true, so each event is sent once
        the next one exists (or the stream has ended)."""
        self._client()
        self._check_not_paused()
        self._admit()
        self.num_active += 1
        try:
            result = await getattr(self.openai, route)(request.json_body)
            if isinstance(result, OpenAIResponse):
                _raise_if_error(result.status, result.body, result.is_request_fault)
                yield pb.OpenAIStreamChunk(json_chunk=result.body, finished=True)
                return
            batches = buffered(result.__aiter__(), self.args.grpc_stream_buffer, _aborter(context))
            held = None
            try:
                async for items in batches:
                    if held is not None:
                        yield pb.OpenAIStreamChunk(json_chunk=held, finished=False)
                    for item in items[:-1]:
                        yield pb.OpenAIStreamChunk(json_chunk=item, finished=False)
                    held = items[-1]
            except StreamFailed as e:
                _raise_if_error(e.status, e.body, e.is_request_fault)
            finally:
                await batches.aclose()  # aborts the request if the call ended early
                await result.aclose()
            if held is not None:
                yield pb.OpenAIStreamChunk(json_chunk=held, finished=True)
        finally:
            self.num_active -= 1

    ChatComplete = functools.partialmethod(_openai_stream, route="chat_completions")
    Complete = functools.partialmethod(_openai_stream, route="completions")

    @rpc
    async def SynthesizeSpeech(self, request, context) -> AsyncIterator[pb.SpeechChunk]:
        """POST /v1/audio/speech: the same checks and pipeline; one message per encoded
        chunk, then an empty one with finished = true."""
        self._client()
        body = {"input": request.input, "model": request.model or None}
        for name in ("voice", "response_format", "speed"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        params = speech_params(body, self.args.max_speech_chars)
        self.speech.check_speech()
        self._admit()
        self.num_active += 1
        try:
            chunks = self.speech.synthesize(params)
            try:
                async for audio in chunks:
                    yield pb.SpeechChunk(audio=audio, content_type=params.media_type)
            finally:
                await chunks.aclose()  # a cancelled call aborts every stage
            yield pb.SpeechChunk(finished=True, content_type=params.media_type)
        finally:
            self.num_active -= 1

    @rpc
    async def _openai_unary(self, request, context, method: str) -> pb.OpenAIResponse:
        """OpenAIEmbed, OpenAIClassify, Score, Rerank: the HTTP route's answer as one message."""
        self._client()
        call = getattr(self.embedding, _OPENAI_UNARY[method])
        self._check_not_paused()
        self._admit()
        self.num_active += 1
        try:
            result = await call(request.json_body)
        finally:
            self.num_active -= 1
        _raise_if_error(result.status, result.body, result.is_request_fault)
        return pb.OpenAIResponse(json_body=result.body, status_code=result.status)

    OpenAIEmbed = functools.partialmethod(_openai_unary, method="OpenAIEmbed")
    OpenAIClassify = functools.partialmethod(_openai_unary, method="OpenAIClassify")
    Score = functools.partialmethod(_openai_unary, method="Score")
    Rerank = functools.partialmethod(_openai_unary, method="Rerank")

    # ---- profiling and weights -------------------------------------------------------------

    @rpc
    async def StartProfile(self, request, context):
        output_dir = request.output_dir if request.HasField("output_dir") else None
        out = await self._client().start_profile(output_dir)
        if not out.success:
            raise RpcError(409, f"cannot start the profiler: {out.message}")
        return pb.StartProfileResponse(message=out.message or "profiling started")

    @rpc
    async def StopProfile(self, request, context):
        out = await self._client().stop_profile()
        if not out.success:
            raise RpcError(409, f"cannot stop the profiler: {out.message}")
        return pb.StopProfileResponse(message=out.message or "profiling stopped")

    @rpc
    async def UpdateWeightsFromDisk(self, request, context):
        load_format = request.load_format if request.HasField("load_format") else None
        out = await self._client().update_weights_from_disk(request.model_path, load_format)
        if not out.success:
            raise RpcError(400, f"cannot update the weights: {out.message}")
        return pb.UpdateWeightsResponse(success=True, message=out.message or "weights updated")


# ---- helpers ----------------------------------------------------------------------------------


def _json(obj) -> str:
    return msgspec.json.encode(obj).decode()


def _aborter(context):
    """Ends the call with an RpcError's status, from any task (a stalled send included)."""

    async def abort(error: RpcError):
        await context.abort(error.code, str(error))

    return abort


class _Sent:
    """What a native stream has sent, against what its requests produced (its backlog)."""

    __slots__ = ("client", "obj", "num_tokens")

    def __init__(self, client: EngineClient, obj: GenerateReqInput):
        self.client = client
        self.obj = obj  # normalized by the client once its first result is due: its rids are known
        self.num_tokens = 0

    def rids(self) -> list[str]:
        obj = self.obj
        if not obj.is_normalized:
            return []
        return [obj.rid] if obj.is_single else list(obj.rid)

    def backlog(self) -> int:
        return self.client.backlog(self.rids(), self.num_tokens)


def _messages(
    chunk: dict, make: Callable[[dict, bool], Any], final: bool
) -> tuple[list, str | None]:
    """The message(s) of one result, and why its request was aborted (Abort, abort_all,
    pause), if it was: the call then ends with CANCELLED once what it produced is sent."""
    if "index" in chunk:
        chunk["meta_info"]["index"] = chunk.pop("index")
    reason = convert.abort_message(chunk)
    if reason is None:
        return [make(chunk, final)], None
    if chunk["text"] or chunk["output_ids"]:
        return [make(chunk, False)], reason
    return [], reason


def _raise_if_error(status: int, body: bytes, is_request_fault: bool = False) -> None:
    """An OpenAI error answer as a status: the code of its HTTP status, the error message as
    details, and the HTTP status and JSON body in trailing metadata for clients that want them."""
    if status < 400:
        return
    try:
        message = msgspec.json.decode(body)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = body.decode(errors="replace")
    metadata = (("x-http-status", str(status)), ("error-json-bin", body))
    if is_request_fault:
        metadata += ((FAULT_HEADER, "request"),)
    raise RpcError(status, message, metadata)


def _require_text(text: str) -> None:
    if not text:
        raise InvalidParameter("text", "text must not be empty")


def _require_ids(ids) -> None:
    if not ids:
        raise InvalidParameter("input_ids", "input_ids must not be empty")
    bad = [t for t in ids if t < 0]
    if bad:
        raise InvalidParameter(
            "input_ids", f"input_ids: token ids must be non-negative, got {bad[0]}"
        )
