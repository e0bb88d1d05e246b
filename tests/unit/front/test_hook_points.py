"""The named hook points as the TokenizerManager calls them: request_received can refuse a
request before anything is sent; request_finished fires exactly once per received request,
whether it finished or its client went away; a raising observer does not break serving."""

from __future__ import annotations

import asyncio

import pytest

from cadence import hooks
from cadence.errors import RequestError
from cadence.front.engine_client import ModelInfo
from cadence.front.request_book import RequestBook
from cadence.front.tokenizer import FrontTokenizer
from cadence.front.tokenizer_manager import TokenizerManager
from cadence.io_struct import BatchStrOutput, GenerateReqInput, TokenizedGenerateReqInput
from cadence.plugins import HookRegistry, HookType


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture
def registry():
    reg = HookRegistry()
    yield reg
    reg.clear()


@pytest.fixture
def manager():
    sent = []
    info = ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=64,
        vocab_size=100,
        max_total_tokens=1024,
    )
    return TokenizerManager(FrontTokenizer(_Tokenizer()), info, RequestBook(sent.append)), sent


def _finish(tm: TokenizerManager, rid: str) -> None:
    tm.book.on_output(
        BatchStrOutput(
            rids=[rid],
            http_worker_ipcs=[None],
            finished_reasons=[{"type": "length"}],
            output_strs=["AB"],
            output_ids=[[1, 2]],
            prompt_tokens=[3],
            completion_tokens=[2],
            cached_tokens=[0],
        )
    )


def _record(registry: HookRegistry) -> list:
    events = []
    registry.register(
        "cadence.hooks.request_received",
        lambda r, req: events.append(("received", req.rid)),
        HookType.AFTER,
    )
    registry.register(
        "cadence.hooks.request_finished",
        lambda r, rid, meta: events.append(("finished", rid, meta["finish_reason"]["type"])),
        HookType.AFTER,
    )
    return events


async def test_received_then_finished_once_each(manager, registry):
    tm, sent = manager
    events = _record(registry)
    gen = tm.generate_request(GenerateReqInput(text="abc", sampling_params={"max_new_tokens": 2}))
    task = asyncio.ensure_future(gen.__anext__())
    while not sent:
        await asyncio.sleep(0)
    rid = sent[0].rid
    _finish(tm, rid)
    result = await task
    await gen.aclose()
    assert result["text"] == "AB"
    assert events == [("received", rid), ("finished", rid, "length")]


async def test_a_client_that_goes_away_still_gets_request_finished(manager, registry):
    tm, sent = manager
    events = _record(registry)
    gen = tm.generate_request(
        GenerateReqInput(input_ids=[[1, 2], [3, 4]], sampling_params={"max_new_tokens": 2})
    )
    task = asyncio.ensure_future(gen.__anext__())
    while len(sent) < 2:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rids = [m.rid for m in sent if isinstance(m, TokenizedGenerateReqInput)]
    assert events == [
        ("received", rids[0]),
        ("received", rids[1]),
        ("finished", rids[0], "abort"),
        ("finished", rids[1], "abort"),
    ]
    assert tm.states == {}


async def test_request_received_can_refuse_before_anything_is_sent(manager, registry):
    tm, sent = manager

    def refuse(req):
        raise RequestError(403, "this tenant is over its quota")

    registry.register("cadence.hooks.request_received", refuse, HookType.BEFORE, plugin="quota")
    with pytest.raises(RequestError) as info:
        async for _ in tm.generate_request(
            GenerateReqInput(text="abc", sampling_params={"max_new_tokens": 2})
        ):
            pass
    assert info.value.status == 403 and sent == [] and tm.states == {}


async def test_a_raising_observer_is_logged_and_serving_goes_on(manager, registry, caplog):
    tm, sent = manager

    def broken(result, rid, meta):
        raise KeyError("oops")

    registry.register("cadence.hooks.request_finished", broken, HookType.AFTER, plugin="flaky")
    gen = tm.generate_request(GenerateReqInput(text="abc", sampling_params={"max_new_tokens": 2}))
    task = asyncio.ensure_future(gen.__anext__())
    while not sent:
        await asyncio.sleep(0)
    _finish(tm, sent[0].rid)
    assert (await task)["text"] == "AB"
    await gen.aclose()
    assert "request_finished failed" in caplog.text and "'flaky'" in caplog.text


def test_server_args_finalized_may_return_new_arguments(registry):
    from cadence.server_args import ServerArgs

    target = "cadence.hooks.server_args_finalized"
    registry.register(
        target, lambda result, args: result.replace(max_running_requests=3), HookType.AFTER
    )
    assert hooks.finalize_server_args(ServerArgs()).max_running_requests == 3
    registry.clear()
    registry.register(target, lambda result, args: {"port": 1}, HookType.AFTER)
    with pytest.raises(TypeError, match="returned dict, not ServerArgs"):
        hooks.finalize_server_args(ServerArgs())
