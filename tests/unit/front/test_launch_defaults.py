"""Two SGLang launch flags that change what the front makes of a request:
--allow-auto-truncate (a prompt too long for the context or the pool is cut to its head, and
max_new_tokens lowered to what is left, instead of a 400) and --preferred-sampling-params
(sampling parameters a request leaves out take the server's)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from test_input_bounds import CountingTokenizer, char_tokenizer

from cadence.errors import InvalidParameter
from cadence.front.embedding import EmbeddingChecker
from cadence.front.engine_client import ModelInfo
from cadence.front.request_checks import RequestChecker, RequestOptions
from cadence.front.sampling_checks import preferred_sampling_params, with_preferred
from cadence.io_struct import EmbeddingReqInput, GenerateReqInput
from cadence.server_args import ServerArgs

CONTEXT = 64
INFO = ModelInfo(
    model_path="/m",
    tokenizer_path=None,
    served_model_name="m",
    context_len=CONTEXT,
    vocab_size=40,
    max_total_tokens=4096,
)


def checker(info: ModelInfo = INFO, **options) -> RequestChecker:
    tokenizer = CountingTokenizer(char_tokenizer())
    return RequestChecker(tokenizer, info, max_items=16, options=RequestOptions(**options))


def check(c: RequestChecker, **fields):
    return asyncio.run(c.check_generate(GenerateReqInput(**fields), None))


def refused(c: RequestChecker, param: str, **fields) -> str:
    with pytest.raises(InvalidParameter) as e:
        check(c, **fields)
    assert e.value.param == param, str(e.value)
    return str(e.value)


# ---- --allow-auto-truncate ----------------------------------------------------------------


def test_without_the_flag_a_prompt_that_fills_the_context_is_refused():
    c = checker()
    assert "context length" in refused(c, "input_ids", input_ids=[1] * CONTEXT)
    assert "context length" in refused(c, "text", text="a" * CONTEXT)
    refused(c, "max_new_tokens", text="a" * 60, sampling_params={"max_new_tokens": 10})


def test_a_long_prompt_keeps_its_head_and_room_for_one_token(caplog):
    c = checker(allow_auto_truncate=True)
    ids = [i % 40 for i in range(3 * CONTEXT)]
    with caplog.at_level("WARNING"):
        [t] = check(c, input_ids=ids, sampling_params={"max_new_tokens": 16})
    assert t.input_ids == ids[: CONTEXT - 1]
    assert t.sampling_params.max_new_tokens == 1
    assert "--allow-auto-truncate" in caplog.text
    [t] = check(c, text="b" * 200, sampling_params={"max_new_tokens": 16})
    assert len(t.input_ids) == CONTEXT - 1
    assert t.sampling_params.max_new_tokens == 1


def test_a_prompt_that_fits_keeps_its_ids_and_max_new_tokens_is_lowered_to_the_room():
    c = checker(allow_auto_truncate=True)
    [t] = check(c, input_ids=[3] * 40, sampling_params={"max_new_tokens": 50, "min_new_tokens": 30})
    assert t.input_ids == [3] * 40
    assert (t.sampling_params.max_new_tokens, t.sampling_params.min_new_tokens) == (24, 24)
    [t] = check(c, input_ids=[3] * 40, sampling_params={"max_new_tokens": 8})
    assert t.sampling_params.max_new_tokens == 8  # fits: untouched


def test_the_kv_pool_bounds_the_cut_when_it_is_smaller_than_the_context():
    small_pool = replace(INFO, max_total_tokens=32)
    c = checker(small_pool, allow_auto_truncate=True)
    [t] = check(c, input_ids=[5] * 50, sampling_params={"max_new_tokens": 4})
    assert len(t.input_ids) == 31 and t.sampling_params.max_new_tokens == 1


def test_every_prompt_of_a_batch_is_cut_on_its_own():
    c = checker(allow_auto_truncate=True)
    short, long = [1] * 10, [2] * 100
    a, b = check(c, input_ids=[short, long], sampling_params={"max_new_tokens": 4})
    assert a.input_ids == short and a.sampling_params.max_new_tokens == 4
    assert b.input_ids == [2] * (CONTEXT - 1) and b.sampling_params.max_new_tokens == 1


def test_bad_ids_past_the_cut_are_not_looked_at_but_inside_it_still_refused():
    c = checker(allow_auto_truncate=True)
    [t] = check(c, input_ids=[1] * CONTEXT + [10**6], sampling_params={"max_new_tokens": 1})
    assert 10**6 not in t.input_ids
    assert "vocabulary" in refused(c, "input_ids", input_ids=[10**6] + [1] * 100)


def test_an_embedding_input_keeps_what_the_model_takes():
    embedding = replace(INFO, is_generation=False, embedding_dim=8)
    plain = EmbeddingChecker(CountingTokenizer(char_tokenizer()), embedding, max_items=8)
    cutting = EmbeddingChecker(
        CountingTokenizer(char_tokenizer()), embedding, max_items=8, allow_auto_truncate=True
    )
    with pytest.raises(InvalidParameter):
        asyncio.run(plain.check(EmbeddingReqInput(input_ids=[1] * 100), None))
    [t] = asyncio.run(cutting.check(EmbeddingReqInput(input_ids=[1] * 100), None))
    assert t.input_ids == [1] * CONTEXT
    [t] = asyncio.run(cutting.check(EmbeddingReqInput(text="c" * 90), None))
    assert len(t.input_ids) == CONTEXT


# ---- --preferred-sampling-params ----------------------------------------------------------


def test_preferred_parameters_fill_what_a_request_leaves_out():
    c = checker(preferred_sampling_params={"temperature": 0.25, "top_k": 5, "max_new_tokens": 7})
    [t] = check(c, text="abc")
    assert (t.sampling_params.temperature, t.sampling_params.top_k) == (0.25, 5)
    assert t.sampling_params.max_new_tokens == 7
    [t] = check(c, text="abc", sampling_params={"temperature": 0.9, "top_k": None})
    assert (t.sampling_params.temperature, t.sampling_params.top_k) == (0.9, 5)


def test_a_bad_request_is_still_refused_with_preferred_parameters_set():
    c = checker(preferred_sampling_params={"temperature": 0.25})
    refused(c, "sampling_params", text="abc", sampling_params=[1, 2])
    refused(c, "top_p", text="abc", sampling_params={"top_p": 7})


def test_the_flag_is_checked_like_a_request_and_names_itself():
    assert preferred_sampling_params(None) is None
    assert preferred_sampling_params('{"top_p": 0.5, "seed": null}') == {"top_p": 0.5}
    for bad, words in (
        ("[1]", "JSON object"),
        ("{", "JSON object"),
        ('{"temprature": 1}', "did you mean 'temperature'"),
        ('{"top_p": 3}', "top_p"),
    ):
        with pytest.raises(ValueError) as e:
            preferred_sampling_params(bad)
        assert "preferred_sampling_params" in str(e.value) and words in str(e.value)
    assert with_preferred("not an object", {"top_p": 0.5}) == "not an object"
    with pytest.raises(ValueError):
        RequestOptions.of(ServerArgs(preferred_sampling_params='{"top_k": -5}'))
    options = RequestOptions.of(
        ServerArgs(preferred_sampling_params='{"top_k": 3}', allow_auto_truncate=True)
    )
    assert options.preferred_sampling_params == {"top_k": 3} and options.allow_auto_truncate
