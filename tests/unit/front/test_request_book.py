"""The front's one request book, for both request kinds it holds today (generation and
embeddings), with the scheduler played by the test: no model, no process.

Each kind is the real one (`TokenizerManager`, `EmbeddingManager`) over one shared
`RequestBook`; what the test checks is the column every kind passes through: a rid unique
across kinds, the admission budget (429), the server's deadline, the abort when the
consumer leaves, `end_all`, the rids of n > 1 samples, and that nothing stays booked.
"""

from __future__ import annotations

import asyncio

import pytest

from cadence.errors import InvalidParameter, RequestError
from cadence.front.client import FrontClient
from cadence.front.embedding import EmbeddingManager
from cadence.front.engine_client import ModelInfo
from cadence.front.request_book import RequestBook
from cadence.front.tokenizer import FrontTokenizer
from cadence.front.tokenizer_manager import TokenizerManager
from cadence.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    EmbeddingReqInput,
    GenerateReqInput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **kwargs):
        return "x" * len(ids)


def _info(is_generation: bool) -> ModelInfo:
    return ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=256,
        vocab_size=100,
        max_total_tokens=1024,
        is_generation=is_generation,
        embedding_dim=0 if is_generation else 3,
    )


class Scheduler:
    """The scheduler's side of the wire: keeps what the front sends, answers on demand."""

    def __init__(self):
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def requests(self) -> list:
        return [m for m in self.sent if not isinstance(m, AbortReq)]

    def aborts(self) -> list[AbortReq]:
        return [m for m in self.sent if isinstance(m, AbortReq)]


class Front:
    """Both kinds over one book, the way `FrontClient` builds them, with separate model infos
    so that one front can hold a generation and an embedding at once."""

    def __init__(self, max_pending=8, max_items=4, request_timeout_s=None):
        self.scheduler = Scheduler()
        self.book = RequestBook(self.scheduler.send, request_timeout_s=request_timeout_s)
        tokenizer = FrontTokenizer(_Tokenizer())
        self.gen = TokenizerManager(tokenizer, _info(True), self.book, max_pending)
        self.emb = EmbeddingManager(tokenizer, _info(False), self.book, max_pending, max_items)

    def start_generation(self, **kwargs) -> tuple[asyncio.Task, object]:
        gen = self.gen.generate_request(GenerateReqInput(input_ids=[1, 2, 3], **kwargs))
        return asyncio.ensure_future(gen.__anext__()), gen

    def start_embedding(self, **kwargs) -> asyncio.Task:
        return asyncio.ensure_future(self.emb.embed(EmbeddingReqInput(input_ids=[1, 2], **kwargs)))


def text_output(rid: str, reason=None, text: str = "a") -> BatchStrOutput:
    return BatchStrOutput(
        rids=[rid],
        http_worker_ipcs=[None],
        finished_reasons=[reason],
        output_strs=[text],
        output_ids=[[7] * len(text)],
        prompt_tokens=[3],
        completion_tokens=[len(text)],
        cached_tokens=[0],
    )


def embedding_output(rid: str, reason=None) -> BatchEmbeddingOutput:
    return BatchEmbeddingOutput(
        rids=[rid],
        http_worker_ipcs=[None],
        finished_reasons=[reason or {"type": "stop"}],
        embeddings=[[0.5, 0.25, 0.0]],
        prompt_tokens=[2],
        cached_tokens=[0],
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def leave(task: asyncio.Task, gen=None) -> None:
    """The consumer goes away: its waiting call is cancelled, its iterator closed."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if gen is not None:
        await gen.aclose()


async def test_a_rid_is_unique_across_every_kind():
    front = Front()
    task, gen = front.start_generation(rid="shared")
    await settle()
    with pytest.raises(InvalidParameter, match="Duplicate request ID 'shared'") as e:
        await front.emb.embed(EmbeddingReqInput(input_ids=[1], rid="shared"))
    assert e.value.param == "rid"
    with pytest.raises(InvalidParameter, match="Duplicate request ID 'shared'"):
        await front.gen.generate_request(GenerateReqInput(input_ids=[1], rid="shared")).__anext__()
    embedding = front.start_embedding(rid="vec")
    await settle()
    with pytest.raises(InvalidParameter, match="Duplicate request ID 'vec'"):
        await front.gen.generate_request(GenerateReqInput(input_ids=[1], rid="vec")).__anext__()
    # Only the first two were sent; the refused ones never reached the scheduler.
    assert [m.rid for m in front.scheduler.requests()] == ["shared", "vec"]
    front.book.on_output(text_output("shared", {"type": "stop"}))
    front.book.on_output(embedding_output("vec"))
    assert (await task)["meta_info"]["id"] == "shared"
    assert (await embedding)["embedding"] == [0.5, 0.25, 0.0]
    await gen.aclose()
    assert front.book.live == {}


async def test_past_the_budget_a_request_of_either_kind_is_refused_with_429():
    front = Front(max_pending=2, max_items=2)
    first, g1 = front.start_generation()
    second = front.start_embedding()
    await settle()
    assert len(front.book) == 2
    with pytest.raises(RequestError, match="too many requests in flight") as e:
        await front.gen.generate_request(GenerateReqInput(input_ids=[1])).__anext__()
    assert e.value.status == 429
    with pytest.raises(RequestError) as e:
        await front.emb.embed(EmbeddingReqInput(input_ids=[1]))
    assert e.value.status == 429
    assert len(front.scheduler.requests()) == 2  # the refused ones were never sent
    await leave(first, g1)
    await leave(second)
    assert front.book.live == {}


async def test_an_embedding_batch_as_large_as_allowed_fits_an_empty_front():
    front = Front(max_pending=1, max_items=3)
    task = asyncio.ensure_future(front.emb.embed(EmbeddingReqInput(input_ids=[[1], [2], [3]])))
    await settle()
    [batch] = front.scheduler.requests()
    rids = [t.rid for t in batch.batch]
    for rid in rids:
        front.book.on_output(embedding_output(rid))
    assert len(await task) == 3
    assert front.book.live == {}


async def test_the_deadline_aborts_a_generation_which_answers_what_it_made():
    front = Front(request_timeout_s=0.05)
    task, gen = front.start_generation(rid="slow")
    await settle()
    front.book.on_output(text_output("slow", None, "ab"))
    await asyncio.sleep(0.1)
    [abort] = front.scheduler.aborts()
    assert abort.rid == "slow"
    assert abort.message == "the request ran past the server's deadline (--request-timeout-s 0.05)"
    # The scheduler ends it with the abort: the client gets what was generated, not an error.
    front.book.on_output(text_output("slow", {"type": "abort", "message": abort.message}, ""))
    result = await task
    assert result["text"] == "ab" and result["meta_info"]["finish_reason"]["type"] == "abort"
    await gen.aclose()
    assert front.book.live == {}


async def test_the_deadline_ends_an_embedding_with_504():
    front = Front(request_timeout_s=0.05)
    task = front.start_embedding(rid="slow")
    await asyncio.sleep(0.1)
    [abort] = front.scheduler.aborts()
    assert abort.rid == "slow"
    front.book.on_output(embedding_output("slow", {"type": "abort", "message": "aborted"}))
    with pytest.raises(RequestError, match="deadline") as e:
        await task
    assert e.value.status == 504
    assert front.book.live == {}


async def test_a_finished_request_is_not_aborted_by_the_deadline():
    front = Front(request_timeout_s=0.05)
    task = front.start_embedding(rid="quick")
    await settle()
    front.book.on_output(embedding_output("quick"))
    await task
    await asyncio.sleep(0.1)
    assert front.scheduler.aborts() == []


async def test_a_generation_consumer_that_leaves_aborts_its_request():
    front = Front()
    task, gen = front.start_generation(rid="left", stream=True)
    await settle()
    front.book.on_output(text_output("left", None, "a"))
    assert (await task)["text"] == "a"
    await gen.aclose()  # the client went away mid-stream
    [abort] = front.scheduler.aborts()
    assert (abort.rid, abort.message) == ("left", "the client went away")
    assert front.book.live == {}
    front.book.on_output(text_output("left", None, "b"))  # a late output finds nothing


async def test_an_embedding_consumer_that_leaves_aborts_its_request():
    front = Front()
    task = front.start_embedding(rid="left")
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [abort] = front.scheduler.aborts()
    assert (abort.rid, abort.message) == ("left", "the client went away")
    assert front.book.live == {}


async def test_end_all_ends_every_kind_at_once_with_its_status():
    front = Front()
    task, gen = front.start_generation(rid="g")
    embedding = front.start_embedding(rid="e")
    await settle()
    front.book.end_all("the server is shutting down")
    with pytest.raises(RequestError, match="shutting down") as e:
        await task
    assert e.value.status == 503
    with pytest.raises(RequestError, match="shutting down") as e:
        await embedding
    assert e.value.status == 503
    # One abort_all for the scheduler; no per-request abort on the way out.
    aborts = front.scheduler.aborts()
    assert [(a.rid, a.abort_all) for a in aborts] == [(None, True)]
    # The scheduler's late outputs change nothing.
    front.book.on_output(text_output("g", {"type": "stop"}))
    await gen.aclose()
    assert front.book.live == {}
    front.book.end_all("again")  # nothing live: nothing sent
    assert len(front.scheduler.aborts()) == 1


async def test_a_rid_names_the_samples_of_its_n_gt_1_request():
    sent: list = []
    client = FrontClient(FrontTokenizer(_Tokenizer()), _info(True), sent.append, max_pending=8)
    gen = client.generate(GenerateReqInput(input_ids=[1, 2], rid="r", sampling_params={"n": 2}))
    task = asyncio.ensure_future(gen.__anext__())
    await settle()
    assert sorted(client.book.matching("r")) == ["r-0", "r-1"]
    assert client.book.matching("r-0") == ["r-0"] and client.book.matching("q") == []
    assert client.stats()["num_live_requests"] == 2
    assert client.abort("r", message="stop it") is True
    assert sorted(m.rid for m in sent if isinstance(m, AbortReq)) == ["r-0", "r-1"]
    assert client.abort("gone") is False  # still sent: it may be queued in the scheduler
    await leave(task, gen)
    assert client.book.live == {} and client.stats()["num_live_requests"] == 0


async def test_an_output_that_cannot_be_taken_fails_its_request_alone():
    front = Front()
    bad, g1 = front.start_generation(rid="bad")
    good, g2 = front.start_generation(rid="good")
    await settle()
    broken = text_output("bad")
    broken.output_ids = [None]  # the kind raises taking it
    front.book.on_output(broken)
    front.book.on_output(text_output("good", {"type": "stop"}))
    with pytest.raises(RequestError, match="internal error while taking its output") as e:
        await bad
    assert e.value.status == 500 and e.value.is_request_fault
    assert (await good)["text"] == "a"
    assert front.book.num_request_faults["front"] == 1
    assert [a.rid for a in front.scheduler.aborts()] == ["bad"]
    await g1.aclose()
    await g2.aclose()
    assert front.book.live == {}


async def test_kinds_see_only_their_own_requests():
    front = Front()
    task, gen = front.start_generation(rid="g")
    embedding = front.start_embedding(rid="e")
    await settle()
    assert list(front.gen.states) == ["g"] and list(front.emb.states) == ["e"]
    sent = front.scheduler.requests()
    assert isinstance(sent[0], TokenizedGenerateReqInput)
    assert isinstance(sent[1], TokenizedEmbeddingReqInput)
    front.book.end_all("stop")
    for t in (task, embedding):
        with pytest.raises(RequestError):
            await t
    await gen.aclose()
