"""Protobuf requests become the same GenerateReqInput as /generate; results become messages."""

from __future__ import annotations

import json

import grpc
import pytest

from cadence.errors import InvalidParameter
from cadence.front.normalize import normalize_batch_and_arguments
from cadence.grpc import convert
from cadence.grpc import sglang_pb2 as pb
from cadence.grpc.errors import code_for_http_status


def test_only_the_fields_the_client_set_reach_the_request():
    obj = convert.generate_input(pb.TextGenerateRequest(text="hi"))
    assert (obj.text, obj.input_ids, obj.sampling_params, obj.rid, obj.stream) == (
        "hi",
        None,
        None,
        None,
        False,
    )
    assert (
        obj.return_logprob is None
        and obj.logprob_start_len is None
        and obj.top_logprobs_num is None
    )


def test_sampling_params_keep_the_decimals_sent_and_explicit_zeros():
    params = pb.SamplingParams(
        temperature=0.0,
        top_p=0.95,
        top_k=5,
        max_new_tokens=0,
        stop=["\n", "END"],
        stop_token_ids=[2],
        ignore_eos=False,
        n=2,
    )
    assert convert.sampling_params(params) == {
        "temperature": 0.0,
        "top_p": 0.95,
        "top_k": 5,
        "max_new_tokens": 0,
        "stop": ["\n", "END"],
        "stop_token_ids": [2],
        "ignore_eos": False,
        "n": 2,
    }


def test_generate_request_fields_map_by_name():
    req = pb.GenerateRequest(
        input_ids=[1, 2, 3],
        stream=True,
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
        rid="r1",
        routing_key="k",
        sampling_params=pb.SamplingParams(max_new_tokens=4),
    )
    obj = convert.generate_input(req)
    assert (
        obj.input_ids,
        obj.stream,
        obj.return_logprob,
        obj.top_logprobs_num,
        obj.logprob_start_len,
        obj.rid,
        obj.routing_key,
        obj.sampling_params,
    ) == ([1, 2, 3], True, True, 2, 0, "r1", "k", {"max_new_tokens": 4})
    normalize_batch_and_arguments(obj)  # the native checks accept what the adapter built


def test_disaggregated_params_become_the_native_bootstrap_fields():
    params = pb.DisaggregatedParams(
        bootstrap_host="10.0.0.2", bootstrap_port=8998, bootstrap_room=7
    )
    for request in (
        pb.TextGenerateRequest(text="x", disaggregated_params=params),
        pb.GenerateRequest(input_ids=[1], disaggregated_params=params),
    ):
        obj = convert.generate_input(request)
        assert (obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room) == ("10.0.0.2", 8998, 7)
    assert convert.generate_input(pb.TextGenerateRequest(text="x")).bootstrap_room is None


def test_unservable_fields_are_invalid_arguments():
    for request in (
        pb.TextGenerateRequest(text="x", session_id="s"),
        pb.GenerateRequest(input_ids=[1], session_id="s"),
    ):
        assert convert.generate_input(request).session_params == {"id": "s"}
    with pytest.raises(InvalidParameter, match="one data-parallel rank"):
        convert.generate_input(pb.GenerateRequest(input_ids=[1], routed_dp_rank=3))
    assert convert.generate_input(
        pb.GenerateRequest(input_ids=[1], routed_dp_rank=0)
    ).input_ids == [1]


def test_meta_info_values_are_json():
    meta = {
        "id": "abc",
        "prompt_tokens": 12,
        "finish_reason": {"type": "stop", "matched": 2},
        "e2e_latency": 0.5,
        "cached": None,
        "flag": True,
        "neg": -3,
        "big": 2**40,
        "quoted": 'say "hi"\n',
    }
    encoded = convert.meta_info(meta)
    assert encoded["id"] == '"abc"' and encoded["prompt_tokens"] == "12"
    assert (encoded["cached"], encoded["flag"], encoded["neg"]) == ("null", "true", "-3")
    assert {k: json.loads(v) for k, v in encoded.items()} == meta


def test_responses_carry_text_ids_and_finished():
    result = {
        "text": "Paris",
        "output_ids": [7, 8],
        "meta_info": {"id": "r", "finish_reason": None},
    }
    text = convert.text_response(result, finished=False)
    ids = convert.ids_response(result, finished=True)
    assert (text.text, text.finished, text.meta_info["finish_reason"]) == ("Paris", False, "null")
    assert (list(ids.output_ids), ids.finished) == ([7, 8], True)


def test_finished_and_aborted_results_are_recognised():
    done = {"meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    running = {"meta_info": {"finish_reason": None}}
    assert convert.is_finished(done) and not convert.is_finished(running)
    assert convert.abort_message(done) is None


def test_abort_reasons_are_recognised():
    aborted = {
        "meta_info": {"finish_reason": {"type": "abort", "message": "aborted by the Abort RPC"}}
    }
    assert convert.abort_message(aborted) == "aborted by the Abort RPC"


@pytest.mark.parametrize(
    "status, code",
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (401, grpc.StatusCode.UNAUTHENTICATED),
        (404, grpc.StatusCode.NOT_FOUND),
        (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (418, grpc.StatusCode.INVALID_ARGUMENT),
        (500, grpc.StatusCode.INTERNAL),
        (503, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_http_statuses_map_to_grpc_codes(status, code):
    assert code_for_http_status(status) == code


def test_upstream_field_numbers_of_session_id_and_disaggregated_params():
    """A client generated from today's upstream proto puts session_id at 13 (12) and
    disaggregated_params at 14 (13): both decode to the fields they mean."""
    text_fields = pb.TextGenerateRequest.DESCRIPTOR.fields_by_name
    ids_fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert (text_fields["session_id"].number, text_fields["disaggregated_params"].number) == (
        13,
        14,
    )
    assert (ids_fields["session_id"].number, ids_fields["disaggregated_params"].number) == (12, 13)
    wire = b"\x0a\x02hi" + b"\x6a\x03s-1"  # text = 1, then field 13 (string) = "s-1"
    assert pb.TextGenerateRequest.FromString(wire).session_id == "s-1"
