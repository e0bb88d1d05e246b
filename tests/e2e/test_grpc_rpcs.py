"""Every RPC of sglang.runtime.v1.SglangService against the shared launched server, through
our generated stubs, checked against what the HTTP routes answer for the same request.

Every test leaves the server idle and unpaused (checked through /v1/loads)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest
from e2e_server import is_idle, tried
from grpc_support import long_stream, short_request, stub

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
META_KEYS = {
    "id",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reason",
    "e2e_latency",
}


@pytest.fixture
def rpc(server):
    s = stub(server)
    yield s
    s.ContinueGeneration(pb.ContinueGenerationRequest())  # never leave the shared server paused
    assert is_idle(server.wait_idle()), "a request outlived its test"


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c


def meta(msg) -> dict:
    return {k: json.loads(v) for k, v in msg.meta_info.items()}


# ---- generation ---------------------------------------------------------------------------


def test_text_generate_unary_is_one_final_message_equal_to_http(rpc, http):
    msgs = list(rpc.TextGenerate(short_request(PROMPT, 6)))
    assert len(msgs) == 1 and msgs[0].finished
    info = meta(msgs[0])
    assert META_KEYS <= set(info)
    assert re.fullmatch(r"[0-9a-f]{32}", info["id"])  # a fresh uuid4().hex
    assert info["completion_tokens"] == 6 and info["finish_reason"] == {
        "type": "length",
        "length": 6,
    }
    assert msgs[0].meta_info["prompt_tokens"] == str(info["prompt_tokens"])  # JSON-encoded values
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    assert msgs[0].text == http.post("/generate", json=body).json()["text"]


def test_text_generate_stream_deltas_add_up_and_only_the_last_is_finished(rpc):
    whole = list(rpc.TextGenerate(short_request(PROMPT, 8)))[0]
    req = short_request(PROMPT, 8, stream=True, rid="grpc-stream-1")
    msgs = tried(lambda: list(rpc.TextGenerate(req)), lambda msgs: len(msgs) >= 2)
    assert len(msgs) >= 2
    assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert "".join(m.text for m in msgs) == whole.text
    assert {meta(m)["id"] for m in msgs} == {"grpc-stream-1"}
    assert meta(msgs[-1])["completion_tokens"] == 8


def test_generate_with_token_ids_unary_and_stream(rpc, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    params = pb.SamplingParams(max_new_tokens=5, temperature=0)
    (final,) = rpc.Generate(pb.GenerateRequest(input_ids=ids, sampling_params=params))
    assert final.finished and len(final.output_ids) == 5
    streamed = list(
        rpc.Generate(pb.GenerateRequest(input_ids=ids, sampling_params=params, stream=True))
    )
    assert [t for m in streamed for t in m.output_ids] == list(final.output_ids)
    assert streamed[-1].finished
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    assert list(final.output_ids) == http.post("/generate", json=body).json()["output_ids"]


def test_logprobs_arrive_in_meta_info(rpc):
    req = short_request(
        PROMPT, 3, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
    )
    (msg,) = rpc.TextGenerate(req)
    info = meta(msg)
    assert len(info["output_token_logprobs"]) == 3
    logprob, token_id, text = info["output_token_logprobs"][0]
    assert logprob <= 0 and isinstance(token_id, int) and isinstance(text, str)
    assert all(len(row) == 2 for row in info["output_top_logprobs"])


def test_n_samples_come_as_one_message_each_with_their_index(rpc):
    req = pb.TextGenerateRequest(
        text=PROMPT,
        rid="grpc-n",
        sampling_params=pb.SamplingParams(max_new_tokens=3, n=2, temperature=0.8),
    )
    msgs = list(rpc.TextGenerate(req))
    assert sorted(meta(m)["index"] for m in msgs) == [0, 1] and all(m.finished for m in msgs)
    assert {meta(m)["id"] for m in msgs} == {"grpc-n-0", "grpc-n-1"}


# ---- tokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("add_special", [None, True, False])
def test_tokenize_matches_http(rpc, http, add_special):
    req = pb.TokenizeRequest(text="Hello gRPC world")
    body = {"prompt": "Hello gRPC world"}
    if add_special is not None:
        req.add_special_tokens = add_special
        body["add_special_tokens"] = add_special
    got = rpc.Tokenize(req)
    want = http.post("/tokenize", json=body).json()
    assert (list(got.tokens), got.count, got.max_model_len) == (
        want["tokens"],
        want["count"],
        want["max_model_len"],
    )
    assert got.input_text == "Hello gRPC world"


def test_detokenize_round_trips_and_matches_http(rpc, http):
    tokens = list(rpc.Tokenize(pb.TokenizeRequest(text="Round trip, café ☕")).tokens)
    text = rpc.Detokenize(pb.DetokenizeRequest(tokens=tokens)).text
    assert text == "Round trip, café ☕"
    assert text == http.post("/detokenize", json={"tokens": tokens}).json()["text"]


# ---- health and information -----------------------------------------------------------------


def test_health_check_runs_a_generation(rpc):
    assert rpc.HealthCheck(pb.HealthCheckRequest()).healthy is True


def test_model_info_matches_http(rpc, http):
    got = rpc.GetModelInfo(pb.GetModelInfoRequest())
    want = http.get("/model_info").json()
    assert got.model_path == want["model_path"]
    assert json.loads(got.json_info) == want


def test_server_info_matches_http(rpc, http):
    got = json.loads(rpc.GetServerInfo(pb.GetServerInfoRequest()).json_info)
    want = http.get("/server_info").json()
    got.pop("uptime_s"), want.pop("uptime_s")
    assert got == want and got["grpc_port"] is not None and "api_key" not in got


def test_list_models_matches_v1_models(rpc, http):
    (card,) = rpc.ListModels(pb.ListModelsRequest()).models
    (want,) = http.get("/v1/models").json()["data"]
    assert (card.id, card.root, card.max_model_len) == (
        want["id"],
        want["root"],
        want["max_model_len"],
    )
    assert not card.HasField("parent")


def test_get_load_is_the_v1_loads_list_filtered_by_rank(rpc, http):
    loads = json.loads(rpc.GetLoad(pb.GetLoadRequest()).json_info)
    want = http.get("/v1/loads").json()["loads"]
    assert [load["dp_rank"] for load in loads] == [0] and set(loads[0]) == set(want[0])
    assert loads[0]["num_used_tokens"] == 0
    assert json.loads(rpc.GetLoad(pb.GetLoadRequest(dp_rank=0)).json_info)[0]["dp_rank"] == 0
    assert rpc.GetLoad(pb.GetLoadRequest(dp_rank=5)).json_info == "[]"
    with pytest.raises(grpc.RpcError) as e:
        rpc.GetLoad(pb.GetLoadRequest(dp_rank=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in e.value.details()


# ---- control ------------------------------------------------------------------------------


def test_abort_one_rid_ends_its_stream_with_cancelled(server, rpc):
    call = rpc.TextGenerate(long_stream(rid="grpc-doomed"))
    first = next(call)
    assert meta(first)["id"] == "grpc-doomed" and not first.finished
    assert rpc.Abort(pb.AbortRequest(rid="grpc-doomed")).success is True
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED and "Abort" in e.value.details()
    # As upstream SGLang: an unknown rid is not an error.
    assert rpc.Abort(pb.AbortRequest(rid="no-such-request")).success is True


def test_abort_needs_a_rid_or_abort_all(rpc):
    with pytest.raises(grpc.RpcError) as e:
        rpc.Abort(pb.AbortRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_flush_cache_when_idle_and_refused_while_running(server, rpc):
    assert rpc.FlushCache(pb.FlushCacheRequest()).success is True
    call = rpc.TextGenerate(long_stream())
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        rpc.FlushCache(pb.FlushCacheRequest())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "running" in e.value.details()
    call.cancel()


def test_pause_refuses_new_generations_until_continue(rpc):
    assert "in_place" in rpc.PauseGeneration(pb.PauseGenerationRequest(mode="in_place")).message
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.TextGenerate(short_request()))
    assert (
        e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "ContinueGeneration" in e.value.details()
    )
    assert (
        rpc.Tokenize(pb.TokenizeRequest(text="still answered")).count > 0
    )  # the front is not paused
    assert rpc.ContinueGeneration(pb.ContinueGenerationRequest()).message
    assert list(rpc.TextGenerate(short_request()))[-1].finished


def test_pause_in_abort_mode_ends_live_streams_with_cancelled(rpc):
    call = rpc.TextGenerate(long_stream())
    next(call)
    rpc.PauseGeneration(pb.PauseGenerationRequest())  # mode "" means abort
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED and "paused" in e.value.details()


def test_pause_rejects_an_unknown_mode(rpc):
    with pytest.raises(grpc.RpcError) as e:
        rpc.PauseGeneration(pb.PauseGenerationRequest(mode="sideways"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sideways" in e.value.details()


def test_update_weights_from_disk_same_model_then_bad_path(rpc):
    model_path = rpc.GetModelInfo(pb.GetModelInfoRequest()).model_path
    before = list(rpc.TextGenerate(short_request()))[0].text
    out = rpc.UpdateWeightsFromDisk(pb.UpdateWeightsRequest(model_path=model_path), timeout=300)
    assert out.success is True
    assert list(rpc.TextGenerate(short_request()))[0].text == before
    with pytest.raises(grpc.RpcError) as e:
        rpc.UpdateWeightsFromDisk(pb.UpdateWeightsRequest(model_path="/nonexistent/model.gguf"))
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "/nonexistent/model.gguf" in e.value.details()
    )
    with pytest.raises(grpc.RpcError) as e:
        rpc.UpdateWeightsFromDisk(pb.UpdateWeightsRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_path" in e.value.details()


def test_profile_start_stop_writes_a_trace(rpc, server):
    out_dir = Path(server.profile_dir) / "grpc-traces"  # a name under the server's --profile-dir
    with pytest.raises(grpc.RpcError) as e:
        rpc.StopProfile(pb.StopProfileRequest())  # nothing to stop yet
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        rpc.StartProfile(
            pb.StartProfileRequest(output_dir=str(out_dir))
        )  # a client never names a path
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_dir" in e.value.details()
    rpc.StartProfile(pb.StartProfileRequest(output_dir="grpc-traces"))
    list(rpc.TextGenerate(short_request(max_new_tokens=2)))
    msg = rpc.StopProfile(pb.StopProfileRequest(), timeout=300).message
    traces = [p for p in out_dir.iterdir() if p.is_file()]
    assert len(traces) == 1 and str(traces[0]) in msg


# ---- OpenAI JSON pass-through ---------------------------------------------------------------


def _chat(stream: bool) -> bytes:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()


def test_chat_complete_unary_equals_http(rpc, http):
    (chunk,) = rpc.ChatComplete(pb.OpenAIRequest(json_body=_chat(False)))
    assert chunk.finished
    got = json.loads(chunk.json_chunk)
    want = http.post(
        "/v1/chat/completions", content=_chat(False), headers={"content-type": "application/json"}
    ).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    # The second call reuses the first's KV: the prefix cache shows in the cached tokens only.
    got_details = got["usage"].pop("prompt_tokens_details", None) or {}
    want_details = want["usage"].pop("prompt_tokens_details", None) or {}
    assert got["usage"] == want["usage"]
    assert want_details.get("cached_tokens", 0) >= got_details.get("cached_tokens", 0)


def test_chat_complete_stream_is_one_message_per_sse_event(rpc, http):
    chunks = list(rpc.ChatComplete(pb.OpenAIRequest(json_body=_chat(True))))
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    events = [json.loads(c.json_chunk) for c in chunks]
    with http.stream("POST", "/v1/chat/completions", content=_chat(True)) as r:
        sse = [line[len("data: ") :] for line in r.iter_lines() if line]
    assert sse[-1] == "[DONE]"
    http_events = [json.loads(e) for e in sse[:-1]]
    # Each message is one chunk as an SSE event carries it. Their number may differ from the
    # HTTP stream's: deltas that arrive together while the front is busy go out merged.
    assert all(e["object"] == "chat.completion.chunk" for e in events + http_events)
    reasons = [
        [e["choices"][0]["finish_reason"] for e in ev if e["choices"]]
        for ev in (events, http_events)
    ]
    assert reasons[0][-1] == reasons[1][-1] is not None
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    http_text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in http_events if e["choices"]
    )
    assert text == http_text and text


def test_complete_unary_and_stream(rpc):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    (whole,) = rpc.Complete(pb.OpenAIRequest(json_body=json.dumps(body).encode()))
    text = json.loads(whole.json_chunk)["choices"][0]["text"]
    chunks = list(
        rpc.Complete(pb.OpenAIRequest(json_body=json.dumps({**body, "stream": True}).encode()))
    )
    assert chunks[-1].finished
    assert (
        "".join(
            json.loads(c.json_chunk)["choices"][0]["text"]
            for c in chunks
            if json.loads(c.json_chunk)["choices"]
        )
        == text
    )


def test_openai_errors_are_statuses_with_the_http_body_in_trailers(rpc, http):
    body = json.dumps({"prompt": PROMPT, "max_tokens": -1}).encode()
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.Complete(pb.OpenAIRequest(json_body=body)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    trailers = dict(e.value.trailing_metadata())
    want = http.post("/v1/completions", content=body)
    assert trailers["x-http-status"] == str(want.status_code) == "400"
    assert json.loads(trailers["error-json-bin"]) == want.json()
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.ChatComplete(pb.OpenAIRequest(json_body=b'{"model": "nope", "messages": []}')))
    assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("method", ["OpenAIEmbed", "OpenAIClassify", "Score", "Rerank"])
def test_openai_unary_pass_through_says_what_is_not_served(rpc, method):
    with pytest.raises(grpc.RpcError) as e:
        getattr(rpc, method)(pb.OpenAIRequest(json_body=b'{"input": "hi"}'))
    assert e.value.code() in (
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    )
    assert e.value.details()


# ---- embeddings (an embedding model's; test_embeddings_e2e.py serves them) ---------------------


@pytest.mark.parametrize(
    "method, request_",
    [
        ("TextEmbed", pb.TextEmbedRequest(text="hi")),
        ("Embed", pb.EmbedRequest(input_ids=[1, 2])),
        ("Classify", pb.ClassifyRequest(text="hi")),
    ],
)
def test_a_generation_model_refuses_embed_and_classify_naming_the_model(rpc, method, request_):
    with pytest.raises(grpc.RpcError) as e:
        getattr(rpc, method)(request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation model" in e.value.details() and "embedding model" in e.value.details()
