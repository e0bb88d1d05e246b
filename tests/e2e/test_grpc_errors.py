"""Each failure of the contract arrives as its gRPC status, never inside a message, and is
decided in the front process: a refused request leaves nothing in the engine.

Statuses that need a specially configured server (RESOURCE_EXHAUSTED from the admission
limit and the stream buffer, UNAVAILABLE while loading, TLS) are in test_grpc_servers.py."""

from __future__ import annotations

import grpc
import pytest
from e2e_server import API_KEY, is_idle
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_support import short_request, stub, target

from cadence.grpc import sglang_pb2 as pb
from cadence.grpc import sglang_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def sp(**kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(**kwargs)


BAD_TEXT_REQUESTS = {
    "empty text": (pb.TextGenerateRequest(text=""), "text"),
    "top_p above 1": (pb.TextGenerateRequest(text="hi", sampling_params=sp(top_p=1.5)), "top_p"),
    "negative temperature": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(temperature=-1)),
        "temperature",
    ),
    "top_k of 0": (pb.TextGenerateRequest(text="hi", sampling_params=sp(top_k=0)), "top_k"),
    "min_p above 1": (pb.TextGenerateRequest(text="hi", sampling_params=sp(min_p=2)), "min_p"),
    "penalty out of range": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(presence_penalty=3)),
        "presence_penalty",
    ),
    "min above max tokens": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(max_new_tokens=2, min_new_tokens=5)),
        "min_new_tokens",
    ),
    "negative max tokens": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(max_new_tokens=-1)),
        "max_new_tokens",
    ),
    "n of 0": (pb.TextGenerateRequest(text="hi", sampling_params=sp(n=0)), "n"),
    "stop id outside the vocabulary": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(stop_token_ids=[10**9])),
        "stop_token_ids",
    ),
    "a regex that does not compile": (
        pb.TextGenerateRequest(text="hi", sampling_params=sp(regex="[0-9")),
        "regex",
    ),
    "prompt longer than the context": (
        pb.TextGenerateRequest(text="hello " * 9000),
        "context length",
    ),
    "prompt plus output beyond the context": (
        pb.TextGenerateRequest(text="hello " * 100, sampling_params=sp(max_new_tokens=8180)),
        "max_new_tokens",
    ),
    "a session (upstream field 13)": (
        pb.TextGenerateRequest(text="hi", session_id="s-1"),
        "session_id",
    ),
    "logprob start beyond the prompt": (
        pb.TextGenerateRequest(text="hi", return_logprob=True, logprob_start_len=50),
        "logprob_start_len",
    ),
}

BAD_IDS_REQUESTS = {
    "a session (upstream field 12)": (
        pb.GenerateRequest(input_ids=[1, 2], session_id="s"),
        "session_id",
    ),
    "empty input_ids": (pb.GenerateRequest(), "input_ids"),
    "negative token id": (pb.GenerateRequest(input_ids=[1, -5, 2]), "input_ids"),
    "token id outside the vocabulary": (pb.GenerateRequest(input_ids=[1, 10**8]), "vocabulary"),
}


@pytest.fixture
def rpc(server):
    s = stub(server)
    yield s
    assert is_idle(server.wait_idle()), "a refused request reached the engine"


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.mark.parametrize("case", sorted(BAD_TEXT_REQUESTS))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_text_generate_is_invalid_argument_naming_the_problem(rpc, case, stream):
    req, needle = BAD_TEXT_REQUESTS[case]
    req.stream = stream
    e = _status(lambda: list(rpc.TextGenerate(req)))
    assert e.code() == INVALID, e.details()
    assert needle in e.details()


@pytest.mark.parametrize("case", sorted(BAD_IDS_REQUESTS))
def test_bad_generate_is_invalid_argument(rpc, case):
    req, needle = BAD_IDS_REQUESTS[case]
    e = _status(lambda: list(rpc.Generate(req)))
    assert e.code() == INVALID and needle in e.details()


def test_classify_with_both_text_and_ids_is_invalid(rpc):
    e = _status(lambda: rpc.Classify(pb.ClassifyRequest(text="a", input_ids=[1])))
    assert e.code() == INVALID and "mutually exclusive" in e.details()
    e = _status(lambda: rpc.Classify(pb.ClassifyRequest()))
    assert e.code() == INVALID


def test_detokenize_outside_the_vocabulary_is_invalid(rpc):
    e = _status(lambda: rpc.Detokenize(pb.DetokenizeRequest(tokens=[1, 10**8])))
    assert e.code() == INVALID and "vocabulary" in e.details()


def test_detokenize_of_a_negative_id_says_ids_must_be_non_negative(rpc):
    e = _status(lambda: rpc.Detokenize(pb.DetokenizeRequest(tokens=[1, -5, 2])))
    assert e.code() == INVALID and "must be non-negative" in e.details() and "-5" in e.details()
    assert e.details().startswith("tokens")  # the field at fault


def test_a_rid_in_use_is_invalid(rpc):
    call = rpc.TextGenerate(
        pb.TextGenerateRequest(
            text="a story",
            rid="grpc-dup",
            stream=True,
            sampling_params=sp(max_new_tokens=2000, ignore_eos=True),
        )
    )
    next(call)
    e = _status(lambda: list(rpc.TextGenerate(short_request(rid="grpc-dup"))))
    assert e.code() == INVALID and "grpc-dup" in e.details()
    assert "Duplicate request ID" in e.details() and e.details().startswith("rid")
    call.cancel()


def test_passed_deadline_is_deadline_exceeded(rpc):
    req = pb.TextGenerateRequest(
        text="a story", sampling_params=sp(max_new_tokens=2000, ignore_eos=True)
    )
    e = _status(lambda: list(rpc.TextGenerate(req, timeout=0.5)))
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unknown_method_is_unimplemented(server):
    channel = grpc.insecure_channel(target(server))
    call = channel.unary_unary(
        "/sglang.runtime.v1.SglangService/NoSuchMethod",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    e = _status(lambda: call(b""))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- API key (the api_key_server of the e2e fleet) ---------------------------------------------


def test_api_key_is_required_on_the_service_but_not_on_health(api_key_server):
    channel = grpc.insecure_channel(target(api_key_server))
    rpc = sglang_pb2_grpc.SglangServiceStub(channel)
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
        e = _status(lambda: rpc.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata))
        assert (
            e.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in e.details()
        )
        assert API_KEY not in e.details()
        e = _status(lambda: list(rpc.TextGenerate(short_request(), metadata=metadata)))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {API_KEY}"),)
    assert rpc.Tokenize(pb.TokenizeRequest(text="hi"), metadata=good).count > 0
    assert list(rpc.TextGenerate(short_request(max_new_tokens=1), metadata=good))[-1].finished
    # health stays open, as /health does over HTTP
    assert rpc.HealthCheck(pb.HealthCheckRequest()).healthy is True
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
