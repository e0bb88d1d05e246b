"""sglang.grpc.scheduler.SglangScheduler (what SGLang's gateway drives) against a launched
server, through our generated stubs, checked against the HTTP routes for the same request.

The server is `smg_server`, dedicated to the SMG tests (test_smg_gateway.py uses it too);
every test leaves it idle (checked through /v1/loads).
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

import grpc
import pytest
from e2e_server import API_KEY, is_idle, tried, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_support import target

from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import sglang_scheduler_pb2_grpc
from cadence.grpc import smg_common_pb2 as common

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
PROMPT = "The capital of France is"


@pytest.fixture
def rpc(smg_server):
    with grpc.insecure_channel(target(smg_server)) as channel:
        yield sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    assert is_idle(smg_server.wait_idle()), "a request outlived its test"


@pytest.fixture
def http(smg_server):
    with smg_server.client() as c:
        yield c


@pytest.fixture
def prompt_ids(http) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def greedy(max_new_tokens: int, **kwargs) -> pb.SamplingParams:
    """Sampling parameters as the gateway sends them for a greedy request."""
    fields = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
        max_new_tokens=max_new_tokens,
    )
    return pb.SamplingParams(**{**fields, **kwargs})


def generate(ids, request_id="smg-1", stream=False, params=None, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(original_text=PROMPT, input_ids=ids),
        sampling_params=params or greedy(6),
        stream=stream,
        logprob_start_len=-1,
        **kwargs,
    )


# ---- registration: what the gateway reads first ---------------------------------------------


def test_health_check_passes_and_grpc_health_names_the_service(smg_server, rpc):
    reply = rpc.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert reply.healthy, reply.message
    with grpc.insecure_channel(target(smg_server)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_model_info_says_generation_and_points_at_the_tokenizer(rpc, http):
    info = rpc.GetModelInfo(pb.GetModelInfoRequest())
    want = http.get("/model_info").json()
    assert info.is_generation  # proto default false would make the gateway embeddings-only
    assert (info.served_model_name, info.model_path) == (
        want["served_model_name"],
        want["model_path"],
    )
    assert (info.max_context_length, info.vocab_size) == (
        want["max_context_length"],
        want["vocab_size"],
    )
    assert len(info.eos_token_ids) > 0 and info.max_req_input_len > 0
    assert os.path.isfile(os.path.join(info.tokenizer_path, "tokenizer.json"))


def test_server_info_and_loads(rpc, http):
    info = rpc.GetServerInfo(pb.GetServerInfoRequest())
    args = dict(info.server_args)
    assert (args["tp_size"], args["dp_size"], args["max_total_tokens"]) == (1, 1, 4096)
    assert info.server_type == "grpc" and info.max_total_num_tokens == 4096
    assert info.uptime_seconds > 0 and not info.is_paused
    loads = rpc.GetLoads(pb.GetLoadsRequest())
    (load,) = loads.loads
    want = http.get("/v1/loads").json()["loads"][0]
    assert (load.max_total_num_tokens, load.num_used_tokens) == (want["max_total_num_tokens"], 0)
    assert loads.dp_rank_count == 1 and load.max_running_requests > 0
    with pytest.raises(grpc.RpcError) as e:
        rpc.GetLoads(pb.GetLoadsRequest(dp_rank=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in e.value.details()


def test_start_profile_with_start_step_profiles_later_steps(smg_server, rpc, prompt_ids):
    """SGLang's start_step: the profiler starts after that many forward steps, then stops
    by itself after num_steps; a negative start_step is INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as e:
        rpc.StartProfile(common.StartProfileRequest(start_step=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start_step" in e.value.details()
    out_dir = Path(smg_server.profile_dir) / "late"
    started = rpc.StartProfile(
        common.StartProfileRequest(output_dir="late", start_step=2, num_steps=2)
    )
    assert started.success and "after 2 forward steps" in started.message
    assert not list(out_dir.iterdir())  # armed, not started
    list(rpc.Generate(generate(prompt_ids, params=greedy(8))))
    assert wait_until(lambda: list(out_dir.iterdir()), 30), "no trace after the profiled steps"
    assert not rpc.StopProfile(common.StopProfileRequest()).success  # it stopped by itself


def test_get_tokenizer_streams_the_tokenizer_directory_as_a_zip(rpc):
    directory = rpc.GetModelInfo(pb.GetModelInfoRequest()).tokenizer_path
    chunks = list(rpc.GetTokenizer(common.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert not any(c.sha256 for c in chunks[:-1]) and all(len(c.data) <= 65536 for c in chunks)
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None and "tokenizer.json" in archive.namelist()
    assert all("/" not in name for name in archive.namelist())  # flat
    with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
        assert archive.read("tokenizer.json") == f.read()


# ---- generation -----------------------------------------------------------------------------


def test_unary_generate_matches_http_generate_with_the_same_ids(rpc, http, prompt_ids):
    (msg,) = rpc.Generate(generate(prompt_ids))
    complete = msg.complete
    assert msg.request_id == "smg-1" and complete.finish_reason == "length"
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    want = http.post("/generate", json=body).json()
    assert list(complete.output_ids) == want["output_ids"]
    text = http.post("/detokenize", json={"tokens": list(complete.output_ids)}).json()["text"]
    assert text == want["text"]
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt_ids), 6)


def test_streamed_generate_sends_new_tokens_then_one_complete(rpc, prompt_ids):
    (whole,) = rpc.Generate(generate(prompt_ids))
    msgs = tried(
        lambda: list(rpc.Generate(generate(prompt_ids, stream=True))), lambda m: len(m) >= 3
    )
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds == ["chunk"] * (len(msgs) - 1) + ["complete"] and len(msgs) >= 3
    streamed = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    assert streamed == list(whole.complete.output_ids) == list(msgs[-1].complete.output_ids)
    assert [m.chunk.completion_tokens for m in msgs[:-1]][-1] == 6


def test_two_samples_come_with_their_index(rpc, prompt_ids):
    params = greedy(4, temperature=0.8, ignore_eos=True)  # sampled: EOS could end one early
    params.n = 2
    msgs = list(rpc.Generate(generate(prompt_ids, "smg-n2", stream=True, params=params)))
    completes = [m.complete for m in msgs if m.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1]
    for c in completes:
        chunks = [m.chunk for m in msgs if m.HasField("chunk") and m.chunk.index == c.index]
        assert [t for ch in chunks for t in ch.token_ids] == list(c.output_ids)
        assert len(c.output_ids) == 4
    unary = list(rpc.Generate(generate(prompt_ids, "smg-n2u", params=params)))
    assert sorted(m.complete.index for m in unary) == [0, 1]


def test_logprobs_match_http(rpc, http, prompt_ids):
    req = generate(prompt_ids, return_logprob=True, top_logprobs_num=2, params=greedy(3))
    (msg,) = rpc.Generate(req)
    out = msg.complete.output_logprobs
    assert list(out.token_ids) == list(msg.complete.output_ids)
    assert [len(row.values) for row in out.top_logprobs] == [2, 2, 2]
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    want = http.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"]
    assert list(out.token_logprobs) == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
    streamed = list(rpc.Generate(generate(prompt_ids, stream=True, **_logprobs(2))))
    per_chunk = [m.chunk.output_logprobs.token_ids for m in streamed if m.HasField("chunk")]
    assert [t for ids in per_chunk for t in ids] == list(streamed[-1].complete.output_ids)


def _logprobs(top: int) -> dict:
    return dict(return_logprob=True, top_logprobs_num=top)


# ---- ending requests --------------------------------------------------------------------------


def long_request(ids, request_id: str) -> pb.GenerateRequest:
    return generate(ids, request_id, stream=True, params=greedy(3000, ignore_eos=True))


def test_abort_ends_a_live_stream_and_an_unknown_id_succeeds(smg_server, rpc, prompt_ids):
    call = rpc.Generate(long_request(prompt_ids, "smg-doomed"))
    assert next(call).HasField("chunk")
    reply = rpc.Abort(pb.AbortRequest(request_id="smg-doomed", reason="test"))
    assert reply.success
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"
    assert rpc.Abort(pb.AbortRequest(request_id="no-such-request")).success


def test_cancelling_a_stream_aborts_the_request_and_frees_the_kv_pool(smg_server, rpc, prompt_ids):
    call = rpc.Generate(long_request(prompt_ids, "smg-cancel"))
    next(call), next(call)
    assert smg_server.load()["num_used_tokens"] > 0
    call.cancel()
    load = smg_server.wait_idle(timeout=10)
    assert load["num_used_tokens"] == 0 and load["num_running_reqs"] == 0


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda r: setattr(r.sampling_params, "temperature", -1.0), "temperature"),
        (lambda r: r.tokenized.input_ids.append(10**6), "vocabulary"),
        (lambda r: setattr(r.sampling_params, "regex", "[a-z]+"), "regex"),
        (lambda r: setattr(r, "return_hidden_states", True), "return_hidden_states"),
        (lambda r: r.tokenized.ClearField("input_ids"), "input_ids"),
    ],
)
def test_bad_values_are_invalid_argument(rpc, prompt_ids, change, needle):
    req = generate(prompt_ids)
    change(req)
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_undecodable_bytes_are_invalid_argument(smg_server):
    with grpc.insecure_channel(target(smg_server)) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Generate")(b"\x0a\xff\xff\xff\x0f")
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sglang.grpc.scheduler.GenerateRequest" in e.value.details()


def test_embed_on_a_generation_model_is_invalid_argument_naming_the_model(rpc, prompt_ids):
    # An embedding model's Embed: test_embeddings_e2e.py.
    with pytest.raises(grpc.RpcError) as e:
        rpc.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=prompt_ids)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation model" in e.value.details() and "embedding model" in e.value.details()


def test_the_api_key_guards_the_service_but_not_its_health_check(api_key_server):
    with grpc.insecure_channel(target(api_key_server)) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert API_KEY not in e.value.details()
        key = (("authorization", f"Bearer {API_KEY}"),)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=key).is_generation
