"""SglangScheduler messages <-> the front's request structs and result dicts, without a model.

A GenerateRequest must become the GenerateReqInput /generate builds from token ids (proto3
zeros that mean "unset" read as the neutral value, unsupported fields refused by name), and
results must become the chunk/complete messages SGLang's gateway reads.
"""

from __future__ import annotations

import pytest

from cadence.errors import InvalidParameter
from cadence.front.engine_client import ModelInfo
from cadence.front.normalize import normalize_batch_and_arguments
from cadence.front.sampling_checks import check_sampling_params, parse_sampling_params
from cadence.grpc import scheduler_convert as convert
from cadence.grpc import sglang_scheduler_pb2 as pb

INFO = ModelInfo(
    model_path="/m.gguf",
    tokenizer_path=None,
    served_model_name="m",
    context_len=2048,
    vocab_size=1000,
    max_total_tokens=1024,
)


def smg_params(**overrides) -> pb.SamplingParams:
    """What SGLang's gateway sends for a plain chat request (explicit values everywhere)."""
    fields = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
    )
    return pb.SamplingParams(**{**fields, **overrides})


def request(**overrides) -> pb.GenerateRequest:
    fields = dict(
        request_id="r1",
        tokenized=pb.TokenizedInput(original_text="hi", input_ids=[5, 6, 7]),
        sampling_params=smg_params(max_new_tokens=8),
    )
    return pb.GenerateRequest(**{**fields, **overrides})


# ---- requests ---------------------------------------------------------------------------------


def test_a_gateway_request_becomes_the_generate_input_of_token_ids():
    obj = convert.generate_input(request(stream=True), INFO, "r1")
    assert (obj.input_ids, obj.rid, obj.stream, obj.text) == ([5, 6, 7], "r1", True, None)
    assert obj.sampling_params == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_new_tokens": 8,
        "min_new_tokens": 0,
        "n": 1,
        "ignore_eos": False,
        "no_stop_trim": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
    }
    assert obj.return_logprob is None and obj.top_logprobs_num is None
    # and the front accepts every value as it is
    check_sampling_params(parse_sampling_params(obj.sampling_params), INFO.vocab_size)


def test_float32_values_come_back_as_the_decimals_sent_and_greedy_stays_zero():
    params = convert.sampling_params(
        smg_params(temperature=0.0, top_p=0.95, min_p=0.05, frequency_penalty=0.3)
    )
    assert (params["temperature"], params["top_p"], params["min_p"]) == (0.0, 0.95, 0.05)
    assert params["frequency_penalty"] == 0.3


def test_proto3_zeros_that_mean_unset_read_as_the_neutral_value():
    params = convert.sampling_params(pb.SamplingParams())  # a client that set nothing
    assert (params["top_p"], params["top_k"], params["repetition_penalty"], params["n"]) == (
        1.0,
        -1,
        1.0,
        1,
    )
    assert params["temperature"] == 0.0  # proto zero: greedy, as SGLang reads it
    assert "max_new_tokens" not in params


def test_stops_logit_bias_and_counts_map_by_name():
    params = convert.sampling_params(
        smg_params(
            max_new_tokens=0,
            min_new_tokens=2,
            stop=["\n\n"],
            stop_token_ids=[2, 7],
            ignore_eos=True,
            no_stop_trim=True,
            n=3,
            logit_bias={"11": 0.5, "12": -100.0},
            stream_interval=4,  # accepted, changes nothing here
        )
    )
    assert params["max_new_tokens"] == 0  # explicitly 0 (optional on the wire): kept
    assert params["stop"] == ["\n\n"] and params["stop_token_ids"] == [2, 7]
    assert params["logit_bias"] == {"11": 0.5, "12": -100.0}
    assert (params["min_new_tokens"], params["n"], params["ignore_eos"]) == (2, 3, True)
    assert params["no_stop_trim"] is True and "stream_interval" not in params


def test_without_max_new_tokens_the_request_gets_what_the_context_and_pool_leave():
    req = request(sampling_params=smg_params())
    obj = convert.generate_input(req, INFO, "r1")
    assert obj.sampling_params["max_new_tokens"] == 1024 - 3  # the pool is smaller than the context


def test_logprob_options_reach_the_request_only_when_logprobs_are_asked_for():
    plain = convert.generate_input(request(top_logprobs_num=3, logprob_start_len=-1), INFO, "r")
    assert plain.return_logprob is None and plain.top_logprobs_num is None
    asked = convert.generate_input(
        request(
            return_logprob=True, top_logprobs_num=3, logprob_start_len=0, token_ids_logprob=[9]
        ),
        INFO,
        "r",
    )
    assert (asked.return_logprob, asked.top_logprobs_num, asked.logprob_start_len) == (True, 3, 0)
    assert asked.token_ids_logprob == [9]


def test_n_samples_get_the_rids_the_gateway_expects():
    obj = convert.generate_input(request(sampling_params=smg_params(n=2)), INFO, "req-9")
    normalize_batch_and_arguments(obj, 100)
    assert obj.rid == ["req-9-0", "req-9-1"] and not obj.is_single


@pytest.mark.parametrize("constraint", ["regex", "json_schema", "ebnf_grammar", "structural_tag"])
def test_constrained_decoding_is_refused_naming_the_field(constraint):
    req = request(sampling_params=smg_params(**{constraint: "x"}))
    with pytest.raises(InvalidParameter, match=f"sampling_params.{constraint}: constrained"):
        convert.generate_input(req, INFO, "r")


@pytest.mark.parametrize(
    "field,value",
    [
        ("return_hidden_states", True),
        ("custom_logit_processor", "x"),
        ("input_embeds", [0.1]),
        ("mm_inputs", pb.MultimodalInputs(image_urls=["http://x/a.png"])),
        ("data_parallel_rank", 1),
    ],
)
def test_fields_this_server_cannot_honour_are_refused_by_name(field, value):
    with pytest.raises(InvalidParameter, match=f"^{field}: .*leave the field unset"):
        convert.generate_input(request(**{field: value}), INFO, "r")


def test_disaggregated_params_become_the_native_bootstrap_fields():
    """SMG's PD mode over gRPC: the same params go to the prefill and the decode worker."""
    params = pb.DisaggregatedParams(bootstrap_host="p", bootstrap_port=9000, bootstrap_room=12)
    obj = convert.generate_input(request(disaggregated_params=params), INFO, "r")
    assert (obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room) == ("p", 9000, 12)


def test_lora_id_is_left_to_the_servicer():
    """The adapter is resolved against the loaded ones (test_lora_rpcs.py), not refused."""
    assert convert.generate_input(request(lora_id="sql"), INFO, "r").lora_path is None


def test_harmless_empty_or_zero_fields_are_accepted():
    req = request(mm_inputs=pb.MultimodalInputs(), data_parallel_rank=0, log_metrics=True)
    assert convert.generate_input(req, INFO, "r").input_ids == [5, 6, 7]


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"tokenized": pb.TokenizedInput(original_text="hi")}, "tokenized.input_ids"),
        ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ],
)
def test_missing_or_negative_values_are_refused(overrides, field):
    with pytest.raises(InvalidParameter) as e:
        convert.generate_input(request(**overrides), INFO, "r")
    assert e.value.param == field


# ---- results ----------------------------------------------------------------------------------


def result(ids, reason=None, **meta) -> dict:
    meta_info = dict(prompt_tokens=3, completion_tokens=len(ids), cached_tokens=1)
    meta_info.update(finish_reason=reason, **meta)
    return {"text": "", "output_ids": ids, "meta_info": meta_info}


@pytest.mark.parametrize(
    "reason,expected,matched",
    [
        ({"type": "stop", "matched": 2}, "stop", ("matched_token_id", 2)),
        ({"type": "stop", "matched": "END"}, "stop", ("matched_stop_str", "END")),
        ({"type": "length", "length": 4}, "length", None),
        ({"type": "abort", "message": "aborted by the Abort RPC"}, "abort", None),
    ],
)
def test_finish_reasons_and_matched_stops(reason, expected, matched):
    msg = convert.complete_response("r1", result([4, 2], reason), 0)
    complete = msg.complete
    assert msg.request_id == "r1" and complete.finish_reason == expected
    assert complete.WhichOneof("matched_stop") == (matched[0] if matched else None)
    if matched:
        assert getattr(complete, matched[0]) == matched[1]
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (3, 2, 1)
    assert list(complete.output_ids) == [4, 2]


def test_a_chunk_carries_new_tokens_and_running_totals_and_a_bare_finish_carries_none():
    msg = convert.chunk_response("r1", result([8], None, completion_tokens=5), 1)
    assert list(msg.chunk.token_ids) == [8] and msg.chunk.completion_tokens == 5
    assert msg.chunk.index == 1 and not msg.chunk.HasField("output_logprobs")
    assert convert.chunk_response("r1", result([], {"type": "length"}), 0) is None


LOGPROBS = dict(
    output_token_logprobs=[[-0.5, 4, None], [-1.5, 2, None]],
    output_top_logprobs=[[[-0.5, 4, None], [-2.0, 9, None]], [[-1.5, 2, None], [-1.6, 3, None]]],
    output_token_ids_logprobs=[None, None],  # token_ids_logprob not asked for
    input_token_logprobs=[[None, 5, None], [-3.0, 6, None], [-0.25, 7, None]],
    input_top_logprobs=[None, None, None],
)


def test_logprobs_become_output_and_input_messages():
    msg = convert.complete_response("r1", result([4, 2], {"type": "length"}, **LOGPROBS), 0)
    out = msg.complete.output_logprobs
    assert list(out.token_logprobs) == [-0.5, -1.5] and list(out.token_ids) == [4, 2]
    assert [list(row.token_ids) for row in out.top_logprobs] == [[4, 9], [2, 3]]
    assert [list(row.values) for row in out.top_logprobs][0] == [-0.5, -2.0]
    assert len(out.token_ids_logprobs) == 0  # no rows of Nones
    inp = msg.complete.input_logprobs
    assert [v.HasField("value") for v in inp.token_logprobs] == [False, True, True]
    assert inp.token_logprobs[2].value == -0.25 and list(inp.token_ids) == [5, 6, 7]
    assert len(inp.top_logprobs) == 0


def test_token_ids_logprobs_come_one_row_per_position():
    rows = [[[-4.0, 11, None], [-5.0, 12, None]], [[-4.5, 11, None], [-6.0, 12, None]]]
    out = convert.output_logprobs(
        {
            "output_token_logprobs": [[-0.5, 4, None], [-1.0, 5, None]],
            "output_token_ids_logprobs": rows,
        }
    )
    assert [list(r.token_ids) for r in out.token_ids_logprobs] == [[11, 12], [11, 12]]
    assert list(out.token_ids_logprobs[1].values) == [-4.5, -6.0]


def test_no_logprob_messages_when_none_were_asked_for():
    msg = convert.complete_response("r1", result([4], {"type": "length"}), 0)
    assert not msg.complete.HasField("output_logprobs")
    assert not msg.complete.HasField("input_logprobs")


def test_stream_totals_add_up_the_deltas_for_the_complete_message():
    total = convert.Totals()
    first = result([4], None, **{k: v[:1] for k, v in LOGPROBS.items() if k.startswith("output")})
    first["meta_info"].update(
        input_token_logprobs=LOGPROBS["input_token_logprobs"],
        input_top_logprobs=LOGPROBS["input_top_logprobs"],
    )
    last = result([2], {"type": "stop", "matched": 2}, completion_tokens=2)
    last["meta_info"].update(
        {k: v[1:] for k, v in LOGPROBS.items() if k.startswith("output")},
        input_token_logprobs=[],
        input_top_logprobs=[],
    )
    for chunk in (first, last):
        total.add(chunk)
    complete = convert.complete_response("r1", total.result(), 0).complete
    assert list(complete.output_ids) == [4, 2] and complete.completion_tokens == 2
    assert list(complete.output_logprobs.token_ids) == [4, 2]
    assert len(complete.output_logprobs.top_logprobs) == 2
    assert list(complete.input_logprobs.token_ids) == [5, 6, 7]
    assert complete.matched_token_id == 2
    # the chunk of the first delta carries the prompt logprobs, the second none
    assert convert.chunk_response("r1", first, 0).chunk.HasField("input_logprobs")
    assert not convert.chunk_response("r1", last, 0).chunk.HasField("input_logprobs")
