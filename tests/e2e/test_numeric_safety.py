"""Sampling parameters in range by every check, whose naive math makes the probabilities
non-finite (the request that used to kill the scheduler), are served; and a fuzzer over the
whole sampling-parameter space never gets a 5xx nor takes the server down.
"""

from __future__ import annotations

import json
import math

import grpc
import pytest
from e2e_server import is_idle
from grpc_support import stub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.grpc import sglang_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VOCAB = 49152  # SmolLM2's

# Each of these crashed the scheduler (torch.multinomial on NaN/inf probabilities) and with it
# the whole server; each is now a normal 200.
ATTACKS = [
    {"repetition_penalty": 0.0, "temperature": 1.0},
    {"repetition_penalty": 5e-324, "temperature": 0.7},
    {
        "repetition_penalty": 0.0,
        "frequency_penalty": 2.0,
        "presence_penalty": 2.0,
        "temperature": 0.5,
    },
    {"logit_bias": {"1": 1e300, "2": 1e300}, "temperature": 1.0},
    {"logit_bias": {"1": -1e300, "2": 1e308}, "temperature": 1e-5},
    {"logit_bias": {"1": 1e300}, "temperature": 1e300},
    {"temperature": 1e308},
    {"top_p": 5e-324, "temperature": 1.0},
    {"top_p": 1e-300, "min_p": 1.0, "temperature": 3.0},
    {
        "repetition_penalty": 0.0,
        "temperature": 1.0,
        "logit_bias": {str(t): -1e300 for t in range(0, 2000)},
    },
]


@pytest.fixture
def srv(fuzz_server):
    yield fuzz_server
    assert is_idle(fuzz_server.wait_idle(timeout=30))


@pytest.mark.parametrize("params", ATTACKS, ids=lambda p: ",".join(f"{k}" for k in p))
def test_in_range_parameters_that_overflowed_are_served(srv, params):
    with srv.client() as client:
        r = client.post(
            "/generate",
            json={
                "text": "Once upon a time",
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 6, **params},
            },
        )
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] >= 1
        assert all(math.isfinite(lp) for lp, _, _ in meta["output_token_logprobs"])
        chat = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            **{
                k: v
                for k, v in params.items()
                if k
                in (
                    "temperature",
                    "top_p",
                    "frequency_penalty",
                    "presence_penalty",
                    "repetition_penalty",
                    "min_p",
                )
            },
        }
        if chat.get("temperature", 0) <= 2:  # OpenAI's own range
            assert client.post("/v1/chat/completions", json=chat).status_code == 200


def _float32(value: float) -> float:
    """The nearest value a float32 proto field carries without becoming infinite or 0."""
    if value == 0:
        return value
    return math.copysign(min(max(abs(value), 1.5e-45), 3.0e38), value)


def test_in_range_parameters_that_overflowed_are_served_over_grpc(srv):
    rpc = stub(srv)
    for params in ATTACKS:
        fields = {k: _float32(v) for k, v in params.items() if k != "logit_bias"}
        sp = pb.SamplingParams(max_new_tokens=4, **fields)
        out = list(
            rpc.TextGenerate(
                pb.TextGenerateRequest(text="Once upon a time", sampling_params=sp), timeout=60
            )
        )
        assert out[-1].finished and json.loads(out[-1].meta_info["completion_tokens"]) >= 1, params


# ---- fuzzing ------------------------------------------------------------------------------------

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # subnormals, huge, 0, -0, inf, NaN
    st.sampled_from(
        [0.0, -0.0, 5e-324, 1e-300, 1e-6, 1e-7, 0.5, 1.0, 2.0, 2.0000001, 1e30, 1e300, 1.8e308]
    ),
)
INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB]),
)
TOKEN_KEYS = st.one_of(st.integers(min_value=-5, max_value=VOCAB + 5).map(str), st.text(max_size=4))
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": FLOATS,
        "top_p": FLOATS,
        "top_k": INTS,
        "min_p": FLOATS,
        "frequency_penalty": FLOATS,
        "presence_penalty": FLOATS,
        "repetition_penalty": FLOATS,
        "logit_bias": st.dictionaries(TOKEN_KEYS, FLOATS, max_size=6),
        "min_new_tokens": st.integers(min_value=-2, max_value=4),
        "n": st.integers(min_value=-1, max_value=3),
        "seed": INTS,
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
        "stop_token_ids": st.lists(INTS, max_size=3),
        "ignore_eos": st.one_of(st.booleans(), st.just("true")),
        "top_logprobs_num": st.integers(min_value=-1, max_value=5),
    },
)


def _post(client, body: dict):
    # json.dumps writes NaN and Infinity as bare words, as a careless client would.
    return client.post(
        "/generate", content=json.dumps(body), headers={"content-type": "application/json"}
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(params=SAMPLING, return_logprob=st.booleans())
def test_fuzzed_sampling_parameters_never_get_a_server_error(fuzz_server, params, return_logprob):
    top = params.pop("top_logprobs_num", None)
    body = {
        "text": "The weather today",
        "return_logprob": return_logprob,
        "sampling_params": {**params, "max_new_tokens": 3},
    }
    if top is not None:
        body["top_logprobs_num"] = top
    with fuzz_server.client(timeout=60) as client:
        r = _post(client, body)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    temperature=FLOATS,
    top_p=FLOATS,
    min_p=FLOATS,
    repetition_penalty=FLOATS,
    frequency_penalty=FLOATS,
    top_k=st.integers(min_value=-(2**31), max_value=2**31 - 1),
)
def test_fuzzed_grpc_sampling_parameters_never_get_an_internal_error(fuzz_server, **params):
    sp = pb.SamplingParams(max_new_tokens=2, **params)  # float32 on the wire: NaN and inf pass
    try:
        out = list(
            stub(fuzz_server).TextGenerate(
                pb.TextGenerateRequest(text="Hi", sampling_params=sp), timeout=60
            )
        )
        assert out[-1].finished
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, e.code(), e.details())


def test_the_fuzzed_server_still_serves(fuzz_server):
    assert fuzz_server.proc.poll() is None, fuzz_server.log_tail()
    with fuzz_server.client() as client:
        r = client.post(
            "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200
    assert is_idle(fuzz_server.wait_idle(timeout=30))
