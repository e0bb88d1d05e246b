"""A streamed request that fails midway (the scheduler aborts it with an error status)
ends its stream with that RequestError instead of leaving the consumer waiting forever."""

from __future__ import annotations

import asyncio

import pytest

from cadence.errors import RequestError
from cadence.front.engine_client import ModelInfo
from cadence.front.request_book import RequestBook
from cadence.front.tokenizer import FrontTokenizer
from cadence.front.tokenizer_manager import TokenizerManager
from cadence.io_struct import AbortReq, BatchStrOutput, GenerateReqInput


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **kwargs):
        return "x" * len(ids)


def _output(rid: str, reason, text: str) -> BatchStrOutput:
    return BatchStrOutput(
        rids=[rid],
        http_worker_ipcs=[None],
        finished_reasons=[reason],
        output_strs=[text],
        output_ids=[[1] * len(text)],
        prompt_tokens=[2],
        completion_tokens=[len(text)],
        cached_tokens=[0],
    )


@pytest.mark.parametrize("n", [1, 2])
async def test_failure_mid_stream_raises_in_the_consumer(n):
    sent = []
    info = ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=256,
        vocab_size=100,
        max_total_tokens=1024,
    )
    book = RequestBook(sent.append)
    tm = TokenizerManager(FrontTokenizer(_Tokenizer()), info, book)
    gen = tm.generate_request(GenerateReqInput(text="hi", stream=True, sampling_params={"n": n}))
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    book.on_output(_output(sent[0].rid, None, "a"))
    assert (await asyncio.wait_for(first, 2))["text"] == "a"
    failed = {"type": "abort", "message": "the model step failed", "status_code": 500}
    book.on_output(_output(sent[0].rid, failed, ""))
    with pytest.raises(RequestError, match="the model step failed") as info:
        await asyncio.wait_for(gen.__anext__(), 2)
    assert info.value.status == 500
    assert tm.states == {}
    # The other samples of the request stop too.
    assert sorted(m.rid for m in sent if isinstance(m, AbortReq)) == [t.rid for t in sent[1:n]]


async def test_outputs_after_the_finish_do_not_change_the_outcome():
    """The front ends a stream (a 503 on shutdown) while the scheduler's outputs for it are
    still in flight: the consumer, even a slow one, still gets the 503."""
    sent = []
    info = ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=256,
        vocab_size=100,
        max_total_tokens=1024,
    )
    book = RequestBook(sent.append)
    tm = TokenizerManager(FrontTokenizer(_Tokenizer()), info, book)
    gen = tm.generate_request(GenerateReqInput(text="hi", stream=True))
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    rid = sent[0].rid
    book.on_output(_output(rid, None, "a"))
    assert (await asyncio.wait_for(first, 2))["text"] == "a"
    # The consumer is busy: the front's 503, then late scheduler outputs, arrive before it reads on.
    book.on_output(
        _output(
            rid, {"type": "abort", "message": "the server is shutting down", "status_code": 503}, ""
        )
    )
    book.on_output(_output(rid, None, "b"))
    book.on_output(_output(rid, {"type": "abort", "message": "aborted"}, ""))
    with pytest.raises(RequestError, match="shutting down") as info:
        await asyncio.wait_for(gen.__anext__(), 2)
    assert info.value.status == 503
    assert tm.states == {}
