"""io_struct: request normalization, JSON body checks, and the msgpack codec."""

import re
import subprocess
import sys

import msgspec
import pytest

from cadence import io_struct
from cadence.errors import InvalidParameter
from cadence.front.normalize import item, normalize_batch_and_arguments
from cadence.front.sampling_checks import parse_sampling_params
from cadence.io_struct import (
    MESSAGE_TYPES,
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    CloseSessionReqInput,
    CloseSessionReqOutput,
    ContinueGenerationReqInput,
    EmbeddingReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetLoadReqInput,
    GetLoadReqOutput,
    GetLoRAAdaptersReqInput,
    GetWeightVersionReqInput,
    GetWeightVersionReqOutput,
    LoadLoRAAdapterReqInput,
    Logprobs,
    LoRAAdapterInfo,
    LoRAUpdateOutput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    SamplingParams,
    SessionParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
    decode,
    encode,
)
from cadence.serving.body import parse_struct as from_json_dict  # the one body parser

UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


def normalized(**kwargs) -> GenerateReqInput:
    req = GenerateReqInput(**kwargs)
    normalize_batch_and_arguments(req)
    return req


def raises_param(param, match=None):
    """pytest.raises for an InvalidParameter (a ValueError) naming `param`."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(ValueError, match=match)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            assert isinstance(self.info.value, InvalidParameter)
            assert self.info.value.param == param, (self.info.value.param, str(self.info.value))
            return suppressed

    return _Check()


# -- single and batch ----------------------------------------------------------------------


def test_single_text_keeps_scalars_and_fills_defaults():
    req = normalized(text="Hello")
    assert req.is_single and req.batch_size == 1 and req.parallel_sample_num == 1
    assert req.text == "Hello" and req.input_ids is None
    assert UUID_HEX.match(req.rid)
    assert req.sampling_params == {}
    assert req.return_logprob is False
    assert req.logprob_start_len == -1
    assert req.top_logprobs_num == 0
    assert req.token_ids_logprob is None
    assert req.lora_path is None


def test_single_input_ids():
    req = normalized(input_ids=[1, 2, 3], rid="mine", return_logprob=True)
    assert req.is_single and req.input_ids == [1, 2, 3]
    assert req.rid == "mine" and req.return_logprob is True


def test_batch_text_gives_per_item_lists_and_unique_rids():
    req = normalized(text=["a", "b", "c"], top_logprobs_num=2)
    assert not req.is_single and req.batch_size == 3
    assert req.text == ["a", "b", "c"]
    assert len(set(req.rid)) == 3 and all(UUID_HEX.match(r) for r in req.rid)
    assert req.top_logprobs_num == [2, 2, 2]
    assert req.return_logprob == [False] * 3
    assert req.sampling_params == [{}, {}, {}]


def test_batch_input_ids():
    req = normalized(input_ids=[[1, 2], [3]], rid=["x", "y"])
    assert not req.is_single and req.batch_size == 2
    assert req.input_ids == [[1, 2], [3]] and req.rid == ["x", "y"]


def test_batch_of_one_is_still_a_batch():
    req = normalized(text=["only"])
    assert not req.is_single and req.batch_size == 1 and req.text == ["only"]


def test_normalize_is_idempotent():
    req = normalized(text="a", sampling_params={"n": 2}, rid="r")
    before = msgspec.structs.asdict(req)
    normalize_batch_and_arguments(req)
    assert msgspec.structs.asdict(req) == before


# -- parallel sampling (n > 1) -------------------------------------------------------------


def test_n_expands_single_request_into_batch():
    req = normalized(text="p", sampling_params={"n": 3, "temperature": 0.7}, rid="r")
    assert not req.is_single and req.batch_size == 3 and req.parallel_sample_num == 3
    assert req.text == ["p", "p", "p"]
    assert req.rid == ["r-0", "r-1", "r-2"]
    assert req.sampling_params == [{"n": 1, "temperature": 0.7}] * 3


def test_n_without_user_rid_derives_sample_rids_from_one_generated_rid():
    req = normalized(text="p", sampling_params={"n": 2})
    base0, j0 = req.rid[0].rsplit("-", 1)
    base1, j1 = req.rid[1].rsplit("-", 1)
    assert base0 == base1 and UUID_HEX.match(base0) and (j0, j1) == ("0", "1")


def test_n_expands_batch_item_major():
    req = normalized(
        input_ids=[[1], [2, 2]],
        sampling_params={"n": 2},
        rid=["a", "b"],
        return_logprob=[True, False],
        token_ids_logprob=[[7], None],
        lora_path=["la", "lb"],
    )
    assert req.batch_size == 4 and req.parallel_sample_num == 2
    assert req.input_ids == [[1], [1], [2, 2], [2, 2]]
    assert req.rid == ["a-0", "a-1", "b-0", "b-1"]
    assert req.return_logprob == [True, True, False, False]
    assert req.token_ids_logprob == [[7], [7], None, None]
    assert req.lora_path == ["la", "la", "lb", "lb"]
    assert all(sp == {"n": 1} for sp in req.sampling_params)
    # Samples of one prompt must not share a mutable id list.
    assert req.input_ids[0] is not req.input_ids[1]


def test_n_expansion_copies_user_dicts():
    user_params = {"n": 2, "temperature": 0.5}
    req = normalized(text="p", sampling_params=user_params)
    assert user_params == {"n": 2, "temperature": 0.5}
    req.sampling_params[0]["temperature"] = 0.0
    assert req.sampling_params[1]["temperature"] == 0.5


def test_broadcast_sampling_params_are_independent_copies():
    req = normalized(text=["a", "b"], sampling_params={"temperature": 0.1})
    req.sampling_params[0]["temperature"] = 9
    assert req.sampling_params[1] == {"temperature": 0.1}


def test_n_must_match_across_batch():
    with raises_param("n", match="same for every item"):
        normalized(text=["a", "b"], sampling_params=[{"n": 2}, {"n": 3}])


@pytest.mark.parametrize("n", [0, -1, "2", True, 1.5])
def test_invalid_n(n):
    with raises_param("n", match="^n must be"):
        normalized(text="a", sampling_params={"n": n})


def test_n_none_means_one():
    req = normalized(text="a", sampling_params={"n": None})
    assert req.is_single and req.parallel_sample_num == 1


def test_item_major_item_access():
    req = normalized(text=["p0", "p1"], sampling_params={"n": 2}, rid=["a", "b"])
    items = [item(req, i) for i in range(req.batch_size)]
    assert [(it.text, it.rid) for it in items] == [
        ("p0", "a-0"),
        ("p0", "a-1"),
        ("p1", "b-0"),
        ("p1", "b-1"),
    ]
    assert all(it.is_single and it.is_normalized and it.batch_size == 1 for it in items)


# -- per-item fields -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("sampling_params", [{}, {}, {}]),
        ("return_logprob", [True]),
        ("logprob_start_len", [0, 1, 2]),
        ("top_logprobs_num", [1]),
        ("lora_path", ["a", "b", "c"]),
        ("token_ids_logprob", [[1], [2], [3]]),
        ("rid", ["a"]),
    ],
)
def test_per_item_list_of_wrong_length_names_field(field, value):
    with raises_param(field, match=f"^{field} has {len(value)} entries"):
        normalized(text=["a", "b"], **{field: value})


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("return_logprob", "yes", "^return_logprob must be true or false"),
        ("return_logprob", [True, 1], r"^return_logprob\[1\] must be true or false"),
        ("logprob_start_len", -2, "^logprob_start_len must be an integer >= -1"),
        ("logprob_start_len", 1.0, "^logprob_start_len must be an integer"),
        ("top_logprobs_num", -1, "^top_logprobs_num must be an integer >= 0"),
        ("top_logprobs_num", True, "^top_logprobs_num must be an integer"),
        ("lora_path", 5, "^lora_path must be a string"),
        ("sampling_params", "greedy", "^sampling_params must be an object"),
        ("sampling_params", [{}, 3], r"^sampling_params\[1\] must be an object"),
        ("token_ids_logprob", 5, "^token_ids_logprob must be a list"),
        ("token_ids_logprob", [1, -1], r"^token_ids_logprob\[1\] must be a token id"),
        ("token_ids_logprob", [[1], [-3]], r"^token_ids_logprob\[1\]\[0\] must be a token id"),
    ],
)
def test_per_item_wrong_values_name_field(field, value, message):
    with raises_param(field, match=message):
        normalized(text=["a", "b"], **{field: value})


def test_per_item_list_with_none_entries_take_default():
    req = normalized(text=["a", "b"], return_logprob=[None, True], sampling_params=[None, {}])
    assert req.return_logprob == [False, True]
    assert req.sampling_params == [{}, {}]


def test_single_request_accepts_one_entry_lists():
    req = normalized(text="a", sampling_params=[{"temperature": 0}], rid=["r"])
    assert req.is_single and req.sampling_params == {"temperature": 0} and req.rid == "r"


def test_token_ids_logprob_flat_list_applies_to_all():
    req = normalized(text=["a", "b"], token_ids_logprob=[4, 5])
    assert req.token_ids_logprob == [[4, 5], [4, 5]]
    assert normalized(text="a", token_ids_logprob=[4]).token_ids_logprob == [4]
    assert normalized(text="a", token_ids_logprob=[]).token_ids_logprob is None


def test_multimodal_data_single_and_batch():
    single = normalized(text="a", image_data=["img1", "img2"])
    assert single.image_data == ["img1", "img2"]  # several images of one prompt, untouched
    batch = normalized(text=["a", "b"], audio_data=["x", "y"], sampling_params={"n": 2})
    assert batch.audio_data == ["x", "x", "y", "y"]
    assert batch.image_data is None
    assert item(batch, 2).audio_data == "y"
    with raises_param("video_data", match="one entry per prompt"):
        normalized(text=["a", "b"], video_data=["only one"])


# -- prompts -------------------------------------------------------------------------------


def test_text_and_input_ids_exclusive():
    with raises_param("text", match="text and input_ids are mutually exclusive"):
        normalized(text="a", input_ids=[1])
    with raises_param("text", match="text or input_ids is required"):
        normalized()
    with raises_param("text", match="text or input_ids"):
        normalized(sampling_params={})


@pytest.mark.parametrize(
    "kwargs,param,message",
    [
        ({"text": ""}, "text", "^text must not be empty"),
        ({"text": []}, "text", "^text must not be empty"),
        ({"text": ["a", ""]}, "text", r"^text\[1\] must not be empty"),
        ({"text": ["a", 3]}, "text", r"^text\[1\] must be a string"),
        ({"text": 3}, "text", "^text must be a string or a list"),
        ({"input_ids": []}, "input_ids", "^input_ids must not be empty"),
        ({"input_ids": [[1], []]}, "input_ids", r"^input_ids\[1\] must not be empty"),
        ({"input_ids": [1, [2]]}, "input_ids", "not a mix"),
        ({"input_ids": [1, -1]}, "input_ids", r"^input_ids\[1\] must be a token id"),
        ({"input_ids": [1, True]}, "input_ids", r"^input_ids\[1\] must be a token id"),
        ({"input_ids": [1, 2.0]}, "input_ids", r"^input_ids\[1\] must be a token id"),
        ({"input_ids": [[0], ["a"]]}, "input_ids", r"^input_ids\[1\]\[0\] must be a token id"),
        ({"input_ids": "1 2 3"}, "input_ids", "^input_ids must be a list"),
    ],
)
def test_bad_prompts(kwargs, param, message):
    with raises_param(param, match=message):
        normalized(**kwargs)


# -- rids ----------------------------------------------------------------------------------


def test_user_rids_kept():
    assert normalized(text=["a", "b"], rid=["r1", "r2"]).rid == ["r1", "r2"]


def test_duplicate_rids_rejected():
    with raises_param("rid", match="Duplicate request ID 'x' within the request"):
        normalized(text=["a", "b", "c"], rid=["x", "y", "x"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"text": ["a", "b"], "rid": "one"}, "^rid must be a list of 2 strings"),
        ({"text": "a", "rid": ""}, r"^rid\[0\] must be a non-empty string"),
        ({"text": ["a", "b"], "rid": ["x", 5]}, r"^rid\[1\] must be a non-empty string"),
        ({"text": "a", "rid": 5}, "^rid must be a string or a list"),
    ],
)
def test_bad_rids(kwargs, message):
    with raises_param("rid", match=message):
        normalized(**kwargs)


def test_generated_rids_differ_between_requests():
    assert normalized(text="a").rid != normalized(text="a").rid


# -- item() --------------------------------------------------------------------------------


def test_item_of_batch_is_a_normalized_single():
    req = normalized(
        text=["a", "b"],
        rid=["r0", "r1"],
        sampling_params=[{"temperature": 0}, {"top_k": 3}],
        return_logprob=[False, True],
        stream=True,
        routing_key="k",
    )
    one = item(req, 1)
    assert one.is_single and one.is_normalized and one.batch_size == 1
    assert (one.text, one.rid, one.sampling_params) == ("b", "r1", {"top_k": 3})
    assert one.return_logprob is True and one.stream is True and one.routing_key == "k"
    # Normalizing an item changes nothing.
    before = msgspec.structs.asdict(one)
    normalize_batch_and_arguments(one)
    assert msgspec.structs.asdict(one) == before


def test_item_of_single_is_a_copy():
    req = normalized(text="a", rid="r")
    copy = item(req, 0)
    assert copy == req and copy is not req
    with pytest.raises(IndexError):
        item(req, 1)


def test_item_requires_normalization():
    with pytest.raises(RuntimeError, match="normalize_batch_and_arguments"):
        item(GenerateReqInput(text=["a"]), 0)


# -- from_json_dict ------------------------------------------------------------------------


def test_from_json_dict_accepts_the_contract():
    body = {
        "text": ["a", "b"],
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "rid": ["x", "y"],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": [1, 2],
        "token_ids_logprob": [3, 4],
        "return_text_in_logprobs": True,
        "stream": True,
        "image_data": None,
        "lora_path": None,
        "routing_key": "user-7",
    }
    req = from_json_dict(GenerateReqInput, body)
    assert req.text == ["a", "b"] and req.routing_key == "user-7" and req.stream is True
    assert not req.is_normalized
    normalize_batch_and_arguments(req)
    assert req.top_logprobs_num == [1, 2] and req.token_ids_logprob == [[3, 4], [3, 4]]


@pytest.mark.parametrize(
    "field,value",
    [
        ("prompt", 1),
        ("model", "default"),
        ("log_metrics", True),
        ("background", False),
        ("no_logs", True),
        ("return_bytes", False),
        ("return_entropy", False),
        ("type", "x"),
        ("is_single", False),
        ("batch_size", 7),
        ("is_normalized", True),
    ],
)
def test_from_json_dict_ignores_unknown_and_derived_fields(field, value):
    """Lenient like SGLang: fields the server does not implement (SMG adds several) are
    dropped; derived fields a client sends can never override what normalization derives."""
    req = from_json_dict(GenerateReqInput, {"text": "a", field: value})
    normalize_batch_and_arguments(req)
    assert req.is_single and req.batch_size == 1 and req.text == "a"


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"text": 5}, "text", "^text has the wrong type"),
        ({"input_ids": [1, "2"]}, "input_ids", r"^input_ids\[1\] has the wrong type"),
        ({"sampling_params": "x"}, "sampling_params", "^sampling_params has the wrong type"),
        ({"rid": 3}, "rid", "^rid has the wrong type"),
        ({"return_logprob": 1}, "return_logprob", "^return_logprob has the wrong type"),
        ({"logprob_start_len": "0"}, "logprob_start_len", "^logprob_start_len has the wrong"),
        ({"top_logprobs_num": [1, "a"]}, "top_logprobs_num", r"^top_logprobs_num\[1\] has"),
        ({"stream": "true"}, "stream", "^stream has the wrong type"),
        ({"routing_key": 5}, "routing_key", "^routing_key has the wrong type"),
    ],
)
def test_from_json_dict_type_errors_name_field(body, param, message):
    with raises_param(param, match=message):
        from_json_dict(GenerateReqInput, body)


def test_from_json_dict_rejects_non_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        from_json_dict(GenerateReqInput, [{"text": "a"}])


# -- embeddings ----------------------------------------------------------------------------


def test_embedding_single_and_batch():
    single = EmbeddingReqInput(text="hello")
    normalize_batch_and_arguments(single)
    assert single.is_single and single.batch_size == 1 and UUID_HEX.match(single.rid)
    batch = EmbeddingReqInput(input_ids=[[1], [2]], rid=["a", "b"])
    normalize_batch_and_arguments(batch)
    assert not batch.is_single and batch.batch_size == 2
    one = item(batch, 1)
    assert (one.input_ids, one.rid, one.is_single) == ([2], "b", True)


def test_embedding_image_data():
    single = EmbeddingReqInput(text="a", image_data="img")
    normalize_batch_and_arguments(single)
    assert single.image_data == "img"
    batch = EmbeddingReqInput(text=["a", "b"], image_data=["i0", "i1"])
    normalize_batch_and_arguments(batch)
    assert item(batch, 1).image_data == "i1"
    with raises_param("image_data", match="one entry per prompt"):
        normalize_batch_and_arguments(EmbeddingReqInput(text=["a", "b"], image_data="img"))


def test_embedding_errors():
    with raises_param("text", match="exactly one"):
        normalize_batch_and_arguments(EmbeddingReqInput())
    with raises_param("rid", match="Duplicate request ID"):
        normalize_batch_and_arguments(EmbeddingReqInput(text=["a", "b"], rid=["x", "x"]))
    with raises_param("text", match="wrong type"):
        from_json_dict(EmbeddingReqInput, {"text": 5, "sampling_params": {}})


# -- tokenized requests --------------------------------------------------------------------


def test_tokenized_request_carries_sampling_params_struct():
    params = parse_sampling_params({"temperature": 0.2, "stop": "x", "logit_bias": {"3": 1}})
    req = TokenizedGenerateReqInput(
        rid="r",
        input_text="hi",
        input_ids=[1, 2],
        sampling_params=params,
        http_worker_ipc="ipc://a",
    )
    back = decode(encode(req))
    assert isinstance(back.sampling_params, SamplingParams)
    assert back.sampling_params.logit_bias == {3: 1.0} and back.sampling_params.stop == ["x"]


# -- control messages ----------------------------------------------------------------------


def test_abort_needs_exactly_one_target():
    AbortReq(rid="r")
    AbortReq(abort_all=True)
    with raises_param("rid"):
        AbortReq()
    with raises_param("rid"):
        AbortReq(rid="r", abort_all=True)
    with pytest.raises(msgspec.ValidationError, match="rid"):
        decode(msgspec.msgpack.encode({"type": "AbortReq"}))


def test_pause_mode_and_profile_action_checked():
    for mode in ("abort", "retract", "in_place"):
        assert decode(encode(PauseGenerationReqInput(mode=mode))).mode == mode
    with raises_param("mode", match="^mode must be one of abort, retract, in_place"):
        PauseGenerationReqInput(mode="later")
    with raises_param("action", match="^action must be start or stop"):
        ProfileReq(action="pause")
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "PauseGenerationReqInput", "mode": "later"}))


# -- codec ---------------------------------------------------------------------------------


def _examples():
    logprobs = Logprobs(
        input_token_logprobs_val=[None, -0.5],
        input_token_logprobs_idx=[1, 2],
        input_top_logprobs_val=[None, [-0.1, -2.0]],
        input_top_logprobs_idx=[None, [2, 9]],
        output_token_logprobs_val=[-0.25],
        output_token_logprobs_idx=[7],
        output_top_logprobs_val=[[-0.25, -3.0]],
        output_top_logprobs_idx=[[7, 8]],
        output_token_ids_logprobs_val=[[-4.0]],
        output_token_ids_logprobs_idx=[[11]],
    )
    common = dict(
        rids=["a", "b"],
        http_worker_ipcs=["ipc://f0", None],
        finished_reasons=[None, {"type": "stop", "matched": 2}],
        prompt_tokens=[3, 4],
        completion_tokens=[1, 5],
        cached_tokens=[0, 2],
    )
    return [
        normalized(
            text=["x", "y"], sampling_params={"n": 2, "top_p": 0.5}, image_data=[b"\x00", None]
        ),
        normalized(input_ids=[5, 6], rid="single"),
        GenerateReqInput(text="raw, not normalized"),
        EmbeddingReqInput(text=["e1", "e2"], rid=["a", "b"]),
        TokenizedGenerateReqInput(
            rid="r",
            input_text=None,
            input_ids=[1, 2, 3],
            sampling_params=SamplingParams(stop=["\n"], stop_token_ids=[2], seed=-1),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            token_ids_logprob=[11],
            stream=True,
            lora_path="adapter",
            http_worker_ipc="ipc://f0",
        ),
        TokenizedEmbeddingReqInput(rid="e", input_text="t", input_ids=[1]),
        BatchTokenizedEmbeddingReqInput(
            batch=[
                TokenizedEmbeddingReqInput(rid="e0", input_text=None, input_ids=[1, 2]),
                TokenizedEmbeddingReqInput(
                    rid="e1", input_text="t", input_ids=[3], token_type_ids=[1]
                ),
            ]
        ),
        BatchTokenIDOutput(
            output_ids=[[7], [8, 2]],
            skip_special_tokens=[True, False],
            spaces_between_special_tokens=[True, True],
            no_stop_trim=[False, True],
            stop_strs=[["\n\n"], None],
            logprobs=[logprobs, None],
            **common,
        ),
        BatchTokenIDOutput(
            output_ids=[[], [1]],
            skip_special_tokens=[True, True],
            spaces_between_special_tokens=[True, True],
            no_stop_trim=[False, False],
            stop_strs=[None, None],
            **common,
        ),
        BatchStrOutput(
            output_strs=["é", " world"],
            output_ids=[[7], [8, 2]],
            logprobs=[logprobs, None],
            **common,
        ),
        BatchEmbeddingOutput(
            rids=["a", "b"],
            http_worker_ipcs=[None, None],
            finished_reasons=[
                {"type": "length", "length": 0},
                {"type": "abort", "message": "gone"},
            ],
            embeddings=[[0.5, -0.25], None],
            prompt_tokens=[2, 3],
            cached_tokens=[0, 0],
        ),
        AbortReq(rid="r", message="client disconnected"),
        AbortReq(abort_all=True, http_worker_ipc="ipc://f1"),
        FlushCacheReqInput(),
        FlushCacheReqOutput(success=False, message="2 requests running"),
        PauseGenerationReqInput(mode="retract"),
        ContinueGenerationReqInput(),
        GetLoadReqInput(),
        GetLoadReqOutput(
            dp_rank=0,
            num_running_reqs=3,
            num_waiting_reqs=1,
            num_used_tokens=100,
            num_cached_tokens=40,
            max_total_num_tokens=4096,
            token_usage=100 / 4096,
            gen_throughput=812.5,
            cache_hit_rate=0.25,
        ),
        ProfileReq(action="start", output_dir="/tmp/trace", num_steps=5),
        ProfileReqOutput(success=True, message="/tmp/trace"),
        UpdateWeightFromDiskReqInput(
            model_path="/models/m.gguf", load_format="gguf", weight_version="v2"
        ),
        UpdateWeightFromDiskReqOutput(success=True),
        UpdateWeightVersionReqInput(new_version="v3", abort_all_requests=False),
        UpdateWeightVersionReqOutput(success=True, new_version="v3"),
        GetWeightVersionReqInput(),
        GetWeightVersionReqOutput(weight_version="v3"),
        OpenSessionReqInput(capacity_of_str_len=1000, streaming=True, timeout=30.0),
        OpenSessionReqOutput(session_id="s1", success=True),
        CloseSessionReqInput(session_id="s1"),
        CloseSessionReqOutput(success=False, message="no open session 's1'"),
        LoadLoRAAdapterReqInput(lora_name="fr", lora_path="/adapters/fr", pinned=True),
        UnloadLoRAAdapterReqInput(lora_name="fr"),
        GetLoRAAdaptersReqInput(),
        LoRAUpdateOutput(
            success=True,
            loaded_adapters=[LoRAAdapterInfo(name="fr", path="/a/fr", lora_id="ab12", rank=8)],
        ),
        TokenizedGenerateReqInput(
            rid="t",
            input_text=None,
            input_ids=[1, 2],
            sampling_params=SamplingParams(),
            session_params=SessionParams(id="s1", rid="r0", offset=3, replace=True),
        ),
    ]


def test_examples_cover_every_message_type():
    assert {type(m) for m in _examples()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", _examples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_messages_are_tagged_with_their_class_name():
    for cls in MESSAGE_TYPES:
        assert cls.__struct_config__.tag == cls.__name__
    data = encode(FlushCacheReqInput())
    assert msgspec.msgpack.decode(data)["type"] == "FlushCacheReqInput"


def test_decode_rejects_unknown_fields_and_types():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode(msgspec.msgpack.encode({"type": "FlushCacheReqInput", "extra": 1}))
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "NoSuchMessage"}))
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "FlushCacheReqOutput", "success": "yes"}))
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1")


def test_encode_rejects_non_messages():
    with pytest.raises(TypeError, match="not a message type"):
        encode({"type": "AbortReq", "abort_all": True})
    with pytest.raises(TypeError):
        encode(SamplingParams())


def test_no_pickle_and_no_heavy_imports():
    source = open(io_struct.__file__).read()
    assert "import pickle" not in source
    code = (
        "import sys, cadence.io_struct; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
