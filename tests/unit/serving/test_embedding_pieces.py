"""The embedding path's pure pieces, without a model: pooling over packed rows, the pooling a
model directory declares, normalization of EmbeddingReqInput (pairs, token types,
dimensions), and the OpenAI-side shapes (inputs, base64, score prompts and label scores)."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch

from cadence.errors import InvalidParameter
from cadence.front.normalize import items, normalize_batch_and_arguments
from cadence.io_struct import EmbeddingReqInput
from cadence.layers.pooler import PoolingConfig, pool
from cadence.model_loader.encoder_loader import is_encoder, read_pooling
from cadence.serving import embedding_protocol as proto

# -- pooling ------------------------------------------------------------------------------


@pytest.fixture
def packed():
    torch.manual_seed(0)
    lens = [3, 1, 4]
    return torch.randn(sum(lens), 5), lens


@pytest.mark.parametrize(
    "mode, reduce",
    [
        ("cls", lambda rows: rows[0]),
        ("last", lambda rows: rows[-1]),
        ("mean", lambda rows: rows.mean(0)),
        ("max", lambda rows: rows.amax(0)),
        ("mean_sqrt_len", lambda rows: rows.sum(0) / math.sqrt(len(rows))),
    ],
)
def test_each_pooling_mode_reduces_each_request_s_own_rows(packed, mode, reduce):
    hidden, lens = packed
    expected = torch.stack([reduce(rows) for rows in hidden.split(lens)])
    assert torch.allclose(pool(hidden, lens, PoolingConfig(mode)), expected, atol=1e-6)
    normalized = pool(hidden, lens, PoolingConfig(mode, normalize=True))
    assert torch.allclose(normalized.norm(dim=1), torch.ones(3))
    assert torch.allclose(normalized, torch.nn.functional.normalize(expected, dim=1), atol=1e-6)


def test_an_unknown_pooling_mode_is_refused():
    with pytest.raises(ValueError, match="pooling mode"):
        PoolingConfig("weightedmean")


def _write(path, name, obj):
    path.joinpath(name).parent.mkdir(parents=True, exist_ok=True)
    path.joinpath(name).write_text(json.dumps(obj))


def test_the_pooling_comes_from_modules_json_and_its_pooling_config(tmp_path):
    default = PoolingConfig("cls", normalize=True)
    assert read_pooling(str(tmp_path), default) == default  # no sentence-transformers files
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    _write(tmp_path, "modules.json", modules)
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_mean_tokens": True})
    assert read_pooling(str(tmp_path), default) == PoolingConfig("mean", normalize=False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "x.Normalize"})
    _write(tmp_path, "modules.json", modules)
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_lasttoken": True})
    assert read_pooling(str(tmp_path), default) == PoolingConfig("last", normalize=True)
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode": "mean_sqrt_len_tokens"})
    assert read_pooling(str(tmp_path), default).mode == "mean_sqrt_len"
    _write(
        tmp_path,
        "1_Pooling/config.json",
        {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True},
    )
    with pytest.raises(ValueError, match="exactly one pooling mode"):
        read_pooling(str(tmp_path), default)


def test_an_encoder_directory_is_told_from_a_decoder_s(tmp_path):
    enc, dec = tmp_path / "enc", tmp_path / "dec"
    _write(enc, "config.json", {"model_type": "bert", "architectures": ["BertModel"]})
    _write(dec, "config.json", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert is_encoder(str(enc)) and not is_encoder(str(dec))
    assert not is_encoder(str(tmp_path / "missing")) and not is_encoder(str(tmp_path / "x.gguf"))


# -- EmbeddingReqInput normalization ----------------------------------------------------------


def test_cross_encoder_pairs_normalize_to_one_item_per_pair():
    batch = EmbeddingReqInput(text=[["q", "d1"], ["q", "d2"]], is_cross_encoder_request=True)
    normalize_batch_and_arguments(batch)
    assert not batch.is_single and batch.batch_size == 2
    assert [i.text for i in items(batch)] == [["q", "d1"], ["q", "d2"]]
    single = EmbeddingReqInput(text=["q", "d"], is_cross_encoder_request=True)
    normalize_batch_and_arguments(single)
    assert single.is_single and single.text == ["q", "d"]
    # Without the flag a list of two strings is a batch of two texts.
    plain = EmbeddingReqInput(text=["q", "d"])
    normalize_batch_and_arguments(plain)
    assert plain.batch_size == 2


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"text": [["q"]], "is_cross_encoder_request": True}, "text"),
        ({"text": [["q", ""]], "is_cross_encoder_request": True}, "text"),
        ({"text": [["q", "d"]]}, "text"),  # pairs need the flag
        ({"text": "a", "token_type_ids": [0]}, "token_type_ids"),
        ({"input_ids": [1, 2], "token_type_ids": [0]}, "token_type_ids"),
        ({"input_ids": [[1, 2], [3]], "token_type_ids": [[0, 1], [-1]]}, "token_type_ids"),
        ({"text": "a", "dimensions": 0}, "dimensions"),
        ({"text": ""}, "text"),
        ({"input_ids": []}, "input_ids"),
    ],
)
def test_bad_embedding_requests_name_the_field(fields, param):
    with pytest.raises(InvalidParameter) as e:
        normalize_batch_and_arguments(EmbeddingReqInput(**fields))
    assert e.value.param == param


def test_token_types_and_dimensions_follow_each_item():
    obj = EmbeddingReqInput(
        input_ids=[[1, 2], [3]], token_type_ids=[[0, 1], [0]], dimensions=8, rid=["a", "b"]
    )
    normalize_batch_and_arguments(obj)
    first, second = items(obj)
    assert (first.token_type_ids, second.token_type_ids) == ([0, 1], [0])
    assert first.dimensions == second.dimensions == 8 and second.rid == "b"


# -- the OpenAI-side shapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("hi", {"text": "hi"}),
        (["a", "b"], {"text": ["a", "b"]}),
        ([1, 2, 3], {"input_ids": [1, 2, 3]}),
        ([[1], [2, 3]], {"input_ids": [[1], [2, 3]]}),
    ],
)
def test_every_openai_input_form_maps_to_native_fields(value, expected):
    assert proto.embedding_input(value) == expected


@pytest.mark.parametrize("value", ["", "   ", [], ["a", " "], ["a", 1], [[1], []], [True], None])
def test_empty_or_mixed_inputs_are_refused_naming_input(value):
    with pytest.raises(InvalidParameter) as e:
        proto.embedding_input(value)
    assert e.value.param == "input"


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it():
    vector = [0.5, -1.25, 3.0e-3, 123.0]
    text = proto.encode_vector(vector, "base64")
    decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
    assert decoded.tolist() == pytest.approx(vector, rel=1e-7)
    assert proto.encode_vector(vector, "float") is vector
    with pytest.raises(InvalidParameter) as e:
        proto.check_encoding_format("int8")
    assert e.value.param == "encoding_format"


def test_score_prompts_concatenate_query_and_item_in_the_asked_order():
    assert proto.score_prompts("Q", ["a", "b"], False) == ({"text": ["Qa", "Qb"]}, 2)
    assert proto.score_prompts("Q", "a", True) == ({"text": ["aQ"]}, 1)
    assert proto.score_prompts([1, 2], [[3], [4, 5]], False) == (
        {"input_ids": [[1, 2, 3], [1, 2, 4, 5]]},
        2,
    )
    for query, items_, param in (
        ("Q", [[1]], "items"),
        ([1], ["a"], "items"),
        ("Q", [], "items"),
        (None, ["a"], "query"),
    ):
        with pytest.raises(InvalidParameter) as e:
            proto.score_prompts(query, items_, False)
        assert e.value.param == param


def test_label_scores_are_probabilities_or_a_softmax_over_the_labels():
    logprobs = [[math.log(0.5), 11, "a"], [math.log(0.25), 12, "b"]]
    assert proto.label_scores(logprobs, [11, 12], False) == pytest.approx([0.5, 0.25])
    assert proto.label_scores(logprobs, [11, 12], True) == pytest.approx([2 / 3, 1 / 3])
    with pytest.raises(InvalidParameter) as e:
        proto.check_labels([3, 50000], vocab_size=1000)
    assert e.value.param == "label_token_ids" and "50000" in str(e.value)
    with pytest.raises(InvalidParameter):
        proto.check_labels([], vocab_size=1000)


def test_request_bodies_parse_strictly_where_it_matters():
    req = proto.parse(proto.EmbeddingRequest, b'{"input": "x", "unknown": 1, "dimensions": 8}')
    assert (req.input, req.dimensions, req.encoding_format) == ("x", 8, "float")
    for cls, body, param in (
        (proto.EmbeddingRequest, b"{}", "input"),
        (proto.RerankRequest, b'{"query": "q"}', "documents"),
        (proto.RerankRequest, b'{"query": "q", "documents": "d"}', "documents"),
        (proto.ScoringRequest, b'{"apply_softmax": "yes"}', "apply_softmax"),
    ):
        with pytest.raises(InvalidParameter) as e:
            proto.parse(cls, body)
        assert e.value.param == param
