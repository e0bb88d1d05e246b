"""The disaggregation fields at the edge: required where a server runs one half, checked
for type and range, passed to the scheduler as they came; ignored elsewhere."""

from __future__ import annotations

import asyncio

import pytest
from test_input_bounds import CountingTokenizer, char_tokenizer

from cadence.errors import InvalidParameter
from cadence.front.engine_client import ModelInfo
from cadence.front.request_checks import RequestChecker, RequestOptions
from cadence.io_struct import FAKE_BOOTSTRAP_HOST, GenerateReqInput

INFO = ModelInfo(
    model_path="/m",
    tokenizer_path=None,
    served_model_name="m",
    context_len=64,
    vocab_size=40,
    max_total_tokens=4096,
)


def check(mode: str, n: int = 1, local: bool = False, **fields):
    options = RequestOptions(
        disaggregation_mode=mode, disaggregation_bootstrap_port=8998, decode_local_prefill=local
    )
    checker = RequestChecker(
        CountingTokenizer(char_tokenizer()), INFO, max_items=16, options=options
    )
    obj = GenerateReqInput(text="abc", sampling_params={"max_new_tokens": 2, "n": n}, **fields)
    return asyncio.run(checker.check_generate(obj, None))


def refused(param: str, words: str, mode: str, **fields) -> None:
    with pytest.raises(InvalidParameter) as e:
        check(mode, **fields)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_a_server_that_runs_both_halves_ignores_the_fields():
    [t] = check("null", bootstrap_host="h", bootstrap_port=1, bootstrap_room=5)
    assert t.bootstrap_room is None and t.bootstrap_host is None


def test_each_half_requires_what_it_needs_and_the_port_defaults():
    refused("bootstrap_room", "router", "prefill")
    refused("bootstrap_room", "required", "decode", bootstrap_host="h")
    refused("bootstrap_host", "required", "decode", bootstrap_room=3)
    [t] = check("prefill", bootstrap_room=3)
    assert (t.bootstrap_host, t.bootstrap_port, t.bootstrap_room) == (None, 8998, 3)
    [t] = check("decode", bootstrap_host="10.0.0.1", bootstrap_room=2**63 - 1)
    assert (t.bootstrap_host, t.bootstrap_port, t.bootstrap_room) == ("10.0.0.1", 8998, 2**63 - 1)
    [t] = check("decode", bootstrap_host="p", bootstrap_port=9100, bootstrap_room=0)
    assert t.bootstrap_port == 9100


def test_bad_values_are_refused_naming_the_field():
    refused("bootstrap_room", "[0, 2**63)", "prefill", bootstrap_room=-1)
    refused("bootstrap_room", "[0, 2**63)", "prefill", bootstrap_room=2**63)
    refused("bootstrap_room", "[0, 2**63)", "prefill", bootstrap_room="7")
    refused("bootstrap_port", "port number", "decode", bootstrap_host="h", bootstrap_room=1,
            bootstrap_port=70000)  # fmt: skip
    refused("bootstrap_host", "string", "decode", bootstrap_host=5, bootstrap_room=1)


def test_parallel_sampling_is_refused_on_either_half():
    refused("n", "n > 1", "prefill", n=2, bootstrap_room=1)


def test_a_decode_server_that_prefills_locally_runs_roomless_requests_itself():
    """--disaggregation-decode-local-prefill (a router's short prompts): a request with no
    room and no host runs here; one that names its prefill server is still disaggregated,
    and half a pair of fields is still refused."""
    [t] = check("decode", local=True)
    assert (t.bootstrap_host, t.bootstrap_room) == (None, None)
    [t] = check("decode", local=True, bootstrap_host="p", bootstrap_room=4)
    assert (t.bootstrap_host, t.bootstrap_room) == ("p", 4)
    refused("bootstrap_room", "required", "decode", local=True, bootstrap_host="h")
    refused("bootstrap_room", "router", "prefill", local=False)


def test_the_health_probes_fake_host_runs_both_halves_here():
    """SGLang's health checks and warm-up address 2.2.2.2: no peer is needed."""
    [t] = check("decode", bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0)
    assert t.bootstrap_room is None


def test_a_batch_carries_one_room_per_prompt():
    checker = RequestChecker(
        CountingTokenizer(char_tokenizer()),
        INFO,
        max_items=16,
        options=RequestOptions(disaggregation_mode="decode"),
    )
    obj = GenerateReqInput(
        text=["ab", "cd"],
        sampling_params={"max_new_tokens": 2},
        bootstrap_host=["p", "p"],
        bootstrap_room=[1, 2],
    )
    items = asyncio.run(checker.check_generate(obj, None))
    assert [t.bootstrap_room for t in items] == [1, 2]
