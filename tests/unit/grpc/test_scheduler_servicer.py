"""SglangSchedulerServicer over a scripted EngineClient: no model, no process, no socket.

The engine side is a fake that yields the result dicts the front yields (delta chunks with
an `index` for n > 1, or one final list), so what is checked is the servicer's own work:
one chunk per delta, one complete per sample with every output id, the request closed
(aborted) when the call ends early, and the answers of the unary RPCs.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import zipfile
from types import SimpleNamespace

import grpc
import pytest

from cadence.front.engine_client import EngineClient, ModelInfo
from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import smg_common_pb2 as common
from cadence.grpc.scheduler_servicer import SglangSchedulerServicer
from cadence.io_struct import (
    FlushCacheReqOutput,
    GetLoadReqOutput,
    GetWeightVersionReqOutput,
    ProfileReqOutput,
)
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState


def chunk(ids, reason=None, index=None, done=0):
    meta = dict(prompt_tokens=3, completion_tokens=done + len(ids), cached_tokens=0)
    out = {"text": "", "output_ids": ids, "meta_info": {**meta, "finish_reason": reason}}
    if index is not None:
        out["index"] = index
    return out


class ScriptedClient(EngineClient):
    """Yields `script` for every generate call; records what was asked and closed."""

    def __init__(self, script, tokenizer_dir=None):
        self.info = ModelInfo(
            model_path="/m.gguf",
            tokenizer_path=None,
            served_model_name="m",
            context_len=2048,
            vocab_size=1000,
            max_total_tokens=1024,
            eos_token_ids=(2,),
            bos_token_id=1,
            architecture="llama",
            tokenizer_dir=tokenizer_dir,
        )
        self.script = script
        self.requests, self.closed, self.aborted, self.controls = [], [], [], []
        self.load = GetLoadReqOutput(
            dp_rank=0,
            num_running_reqs=2,
            num_waiting_reqs=1,
            num_used_tokens=256,
            num_cached_tokens=0,
            max_total_num_tokens=1024,
            token_usage=0.25,
            gen_throughput=12.5,
            cache_hit_rate=0.5,
        )
        self.flush_ok_after = 0  # FlushCache answers success from this call on

    @property
    def tokenizer(self):
        return None

    async def generate(self, obj):
        self.requests.append(obj)
        finished = False
        try:
            for item in self.script:
                await asyncio.sleep(0)
                yield item
            finished = True
        finally:
            self.closed.append((obj.rid, finished))

    async def embed(self, obj):
        self.requests.append(obj)
        return {"embedding": [0.5, -0.25, 1.0], "meta_info": {"id": obj.rid, "prompt_tokens": 4}}

    def abort(self, rid=None, abort_all=False, message="aborted"):
        self.aborted.append((rid, message))
        return rid == "live"

    async def tokenize(self, text, add_special_tokens=True, prompt_field=None):
        return []

    async def detokenize(self, ids, skip_special_tokens=True):
        return ""

    async def tokenize_batch(self, texts, add_special_tokens=True, param="prompt"):
        return [[] for _ in texts]

    async def detokenize_batch(self, id_lists, skip_special_tokens=True, param="tokens"):
        return ["" for _ in id_lists]

    async def control(self, msg, timeout=60.0):
        self.controls.append(msg)
        name = type(msg).__name__
        if name == "GetLoadReqInput":
            return self.load
        if name == "FlushCacheReqInput":
            ok = sum(type(m).__name__ == name for m in self.controls) > self.flush_ok_after
            return FlushCacheReqOutput(success=ok, message="" if ok else "requests are running")
        if name == "ProfileReq":
            return ProfileReqOutput(success=True, message=f"profile {msg.action}")
        if name == "GetWeightVersionReqInput":
            return GetWeightVersionReqOutput(weight_version="step-7")
        raise AssertionError(name)

    @property
    def is_paused(self):
        return False

    def backlog(self, rids, consumed):
        return 0

    def stats(self):
        return {"num_live_requests": 3}

    def configure_logging(self, log_requests=None, log_requests_level=None):
        raise AssertionError("no gRPC call configures logging")

    def end_all(self, message, status=503):
        pass


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        raise Aborted(code, details)


def servicer(client) -> SglangSchedulerServicer:
    state = ServerState(args=ServerArgs(), client=client, is_ready=True)
    return SglangSchedulerServicer(state)


def gen_request(stream, n=1, request_id="g1", **kwargs):
    params = pb.SamplingParams(temperature=0.7, max_new_tokens=4, n=n)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=params,
        stream=stream,
        **kwargs,
    )


async def collect(agen):
    return [m async for m in agen]


async def test_a_stream_of_two_samples_has_chunks_and_one_complete_per_index():
    script = [
        chunk([10], index=0),
        chunk([20], index=1),
        chunk([11], {"type": "length", "length": 2}, index=0, done=1),
        chunk([21, 2], {"type": "stop", "matched": 2}, index=1, done=1),
    ]
    client = ScriptedClient(script)
    msgs = await collect(servicer(client).Generate(gen_request(True, n=2), Context()))
    kinds = [(m.WhichOneof("response"), getattr(m, m.WhichOneof("response")).index) for m in msgs]
    assert kinds == [
        ("chunk", 0),
        ("chunk", 1),
        ("chunk", 0),
        ("complete", 0),
        ("chunk", 1),
        ("complete", 1),
    ]
    completes = {m.complete.index: m.complete for m in msgs if m.HasField("complete")}
    assert list(completes[0].output_ids) == [10, 11] and completes[0].finish_reason == "length"
    assert list(completes[1].output_ids) == [20, 21, 2] and completes[1].matched_token_id == 2
    assert {m.request_id for m in msgs} == {"g1"}
    assert client.requests[0].rid == "g1" and client.requests[0].stream


async def test_without_stream_only_the_complete_messages_are_sent_with_every_output_id():
    final = [chunk([10, 11], {"type": "length"}), chunk([20, 2], {"type": "stop", "matched": 2})]
    client = ScriptedClient([final])
    msgs = await collect(servicer(client).Generate(gen_request(False, n=2), Context()))
    assert [m.WhichOneof("response") for m in msgs] == ["complete", "complete"]
    assert [(m.complete.index, list(m.complete.output_ids)) for m in msgs] == [
        (0, [10, 11]),
        (1, [20, 2]),
    ]
    assert client.closed == [("g1", True)]


async def test_a_call_that_ends_early_closes_the_request_which_aborts_it():
    client = ScriptedClient([chunk([i]) for i in range(100)])
    messages = servicer(client).Generate(gen_request(True), Context())
    first = await messages.__anext__()
    assert list(first.chunk.token_ids) == [0]
    await messages.aclose()  # what grpc does when the client cancels
    assert client.closed == [("g1", False)]


async def test_an_empty_request_id_gets_a_fresh_one():
    client = ScriptedClient([chunk([1], {"type": "length"})])
    (msg,) = await collect(servicer(client).Generate(gen_request(False, request_id=""), Context()))
    assert len(msg.request_id) == 32 and client.requests[0].rid == msg.request_id


async def test_bad_values_end_the_call_with_invalid_argument_before_the_engine_sees_them():
    client = ScriptedClient([])
    context = Context()
    with pytest.raises(Aborted):
        await collect(
            servicer(client).Generate(gen_request(True, return_hidden_states=True), context)
        )
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and client.requests == []


async def test_abort_succeeds_for_live_and_unknown_ids():
    client = ScriptedClient([])
    svc = servicer(client)
    live = await svc.Abort(pb.AbortRequest(request_id="live", reason="client left"), Context())
    gone = await svc.Abort(pb.AbortRequest(request_id="gone"), Context())
    assert live.success and gone.success and live.message != gone.message
    assert client.aborted == [("live", "client left"), ("gone", "aborted by the Abort RPC")]


async def test_model_info_tells_the_gateway_it_generates():
    info = await servicer(ScriptedClient([], "/tok")).GetModelInfo(pb.GetModelInfoRequest(), None)
    assert info.is_generation and info.tokenizer_path == "/tok"
    assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (2048, 1000, [2])
    assert (info.bos_token_id, info.max_req_input_len) == (1, 1023)
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.model_type == "llama"
    assert info.weight_version == "step-7"  # the scheduler's, asked for each time


async def test_server_info_carries_what_the_gateway_reads():
    info = await servicer(ScriptedClient([])).GetServerInfo(pb.GetServerInfoRequest(), None)
    args = dict(info.server_args)
    assert (args["tp_size"], args["dp_size"], args["is_embedding"]) == (1, 1, False)
    assert (args["context_length"], args["max_total_tokens"]) == (2048, 1024)
    assert "api_key" not in args and info.server_type == "grpc"
    assert info.active_requests == 3 and info.max_total_num_tokens == 1024
    assert dict(info.scheduler_info)["max_total_num_tokens"] == 1024


async def test_loads_map_the_scheduler_report():
    svc = servicer(ScriptedClient([]))
    resp = await svc.GetLoads(pb.GetLoadsRequest(), None)
    (load,) = resp.loads
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (2, 1, 3)
    assert (load.num_used_tokens, load.max_total_num_tokens, load.token_usage) == (256, 1024, 0.25)
    assert load.max_running_requests == 64 and load.memory.token_capacity == 1024
    assert resp.dp_rank_count == 1 and resp.aggregate.total_reqs == 3
    other_rank = await svc.GetLoads(pb.GetLoadsRequest(dp_rank=1), None)
    assert len(other_rank.loads) == 0


async def test_flush_cache_waits_up_to_timeout_for_running_requests_to_end():
    client = ScriptedClient([])
    client.flush_ok_after = 2
    svc = servicer(client)
    now = await svc.FlushCache(common.FlushCacheRequest(timeout_s=0), Context())
    assert not now.success and "requests are running" in now.message
    waited = await svc.FlushCache(common.FlushCacheRequest(timeout_s=5), Context())
    assert waited.success


async def test_profile_output_dir_must_be_a_plain_name():
    svc = servicer(ScriptedClient([]))
    ok = await svc.StartProfile(common.StartProfileRequest(output_dir="run1"), Context())
    assert ok.success and ok.message == "profile start"
    context = Context()
    with pytest.raises(Aborted):
        await svc.StartProfile(common.StartProfileRequest(output_dir="../etc"), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_get_loads_refuses_a_negative_dp_rank_before_asking_the_scheduler():
    client = ScriptedClient([])
    context = Context()
    with pytest.raises(Aborted):
        await servicer(client).GetLoads(pb.GetLoadsRequest(dp_rank=-1), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in context.details
    assert client.controls == []


async def test_profile_start_step_is_passed_on_and_a_negative_one_refused():
    client = ScriptedClient([])
    svc = servicer(client)
    request = common.StartProfileRequest(start_step=3, num_steps=2)
    assert (await svc.StartProfile(request, Context())).success
    assert (client.controls[-1].start_step, client.controls[-1].num_steps) == (3, 2)
    for field, value in [("start_step", -1), ("num_steps", 0)]:
        context = Context()
        with pytest.raises(Aborted):
            await svc.StartProfile(common.StartProfileRequest(**{field: value}), context)
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and field in context.details
    assert len(client.controls) == 1  # the refused ones never reached the scheduler


async def test_get_tokenizer_streams_a_zip_whose_last_chunk_carries_its_sha256(tmp_path):
    vocab = os.urandom(200_000)  # incompressible: several 64 KiB chunks
    (tmp_path / "tokenizer.json").write_bytes(vocab)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    (tmp_path / "weights.bin").write_bytes(b"not a tokenizer file")
    svc = servicer(ScriptedClient([], str(tmp_path)))
    chunks = await collect(svc.GetTokenizer(common.GetTokenizerRequest(), Context()))
    data = b"".join(c.data for c in chunks)
    assert len(chunks) >= 2 and all(len(c.data) <= 64 * 1024 for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None
    assert sorted(archive.namelist()) == ["tokenizer.json", "tokenizer_config.json"]
    assert archive.read("tokenizer.json") == vocab


async def test_embed_answers_the_front_s_embedding_of_the_tokenized_input():
    client = ScriptedClient([])
    request = pb.EmbedRequest(
        request_id="e1",
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        token_type_ids=[0, 1, 1],
        is_cross_encoder=True,
    )
    out = await servicer(client).Embed(request, Context())
    assert (out.embedding_dim, list(out.embedding), out.prompt_tokens) == (3, [0.5, -0.25, 1.0], 4)
    (obj,) = client.requests
    assert (obj.input_ids, obj.token_type_ids, obj.rid) == ([5, 6, 7], [0, 1, 1], "e1")


@pytest.mark.parametrize(
    "request_fields, field",
    [
        ({}, "tokenized.input_ids"),
        ({"tokenized": {"input_ids": [1]}, "data_parallel_rank": 1}, "data_parallel_rank"),
    ],
)
async def test_embed_refuses_what_it_cannot_serve_naming_the_field(request_fields, field):
    svc, context = servicer(ScriptedClient([])), Context()
    with pytest.raises(Aborted):
        await svc.Embed(pb.EmbedRequest(**request_fields), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and field in context.details


async def test_kv_events_are_unimplemented_with_a_reason():
    svc, context = servicer(ScriptedClient([])), Context()
    with pytest.raises(Aborted):
        await collect(svc.SubscribeKvEvents(SimpleNamespace(), context))
    assert context.code == grpc.StatusCode.UNIMPLEMENTED and "SubscribeKvEvents" in context.details
