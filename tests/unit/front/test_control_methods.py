"""The engine client's named control methods over a scheduler played by the test: each
checks its arguments before anything is sent (the same words for HTTP, both gRPC services
and the Engine), sends the one message its call means, and returns the typed answer."""

from __future__ import annotations

import asyncio

import pytest

from cadence import io_struct
from cadence.errors import InvalidParameter
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    CloseSessionReqInput,
    CloseSessionReqOutput,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    PauseGenerationReqInput,
    ProfileReq,
    ProfileReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1]

    def decode(self, ids, **kwargs):
        return ""


class Scheduler:
    """Answers every control message through the real codec, as the scheduler would;
    `replies` decides each answer by the request's type."""

    def __init__(self):
        self.sent: list = []
        self.client: FrontClient | None = None
        self.num_flushes_refused = 0  # FlushCache says "requests are running" this many times
        self.open_ok = True

    def send(self, msg) -> None:
        msg = io_struct.decode(io_struct.encode(msg))
        self.sent.append(msg)
        reply = self.reply(msg)
        if reply is not None:
            reply.cid = msg.cid
            reply = io_struct.decode(io_struct.encode(reply))
            asyncio.get_running_loop().call_soon(self.client.on_message, reply)

    def reply(self, msg):
        if isinstance(msg, FlushCacheReqInput):
            flushes = sum(isinstance(m, FlushCacheReqInput) for m in self.sent)
            ok = flushes > self.num_flushes_refused
            return FlushCacheReqOutput(success=ok, message="" if ok else "requests are running")
        if isinstance(msg, GetLoadReqInput):
            return GetLoadReqOutput(
                dp_rank=0,
                num_running_reqs=2,
                num_waiting_reqs=1,
                num_used_tokens=64,
                num_cached_tokens=0,
                max_total_num_tokens=1024,
                token_usage=0.0625,
                gen_throughput=0.0,
                cache_hit_rate=0.0,
            )
        if isinstance(msg, ProfileReq):
            return ProfileReqOutput(success=True, message=f"profile {msg.action}")
        if isinstance(msg, UpdateWeightFromDiskReqInput):
            return UpdateWeightFromDiskReqOutput(success=False, message="no such file")
        if isinstance(msg, OpenSessionReqInput):
            if not self.open_ok:
                return OpenSessionReqOutput(session_id=None, success=False, message="id taken")
            return OpenSessionReqOutput(session_id=msg.session_id or "new", success=True)
        if isinstance(msg, CloseSessionReqInput):
            return CloseSessionReqOutput(success=msg.session_id == "open")
        return None  # pause and continue have no answer


@pytest.fixture
def engine() -> tuple[FrontClient, Scheduler]:
    info = ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=256,
        vocab_size=100,
        max_total_tokens=1024,
    )
    scheduler = Scheduler()
    scheduler.client = FrontClient(FrontTokenizer(_Tokenizer()), info, scheduler.send, 8)
    return scheduler.client, scheduler


async def test_flush_answers_at_once_or_waits_for_running_requests(engine):
    client, scheduler = engine
    scheduler.num_flushes_refused = 1
    out = await client.flush_cache()
    assert (out.success, out.message) == (False, "requests are running")
    scheduler.sent.clear()
    scheduler.num_flushes_refused = 2
    out = await asyncio.wait_for(client.flush_cache(wait_s=5), 5)
    assert out.success and len(scheduler.sent) == 3  # two refusals, then the flush


async def test_pause_and_continue_set_the_pause_every_adapter_reads(engine):
    client, scheduler = engine
    await client.pause_generation("retract")
    assert client.is_paused
    assert isinstance(scheduler.sent[-1], PauseGenerationReqInput)
    assert scheduler.sent[-1].mode == "retract"
    await client.continue_generation()
    assert not client.is_paused and isinstance(scheduler.sent[-1], ContinueGenerationReqInput)


async def test_a_pause_of_an_unknown_mode_is_refused_before_anything_is_sent(engine):
    client, scheduler = engine
    with pytest.raises(InvalidParameter, match="mode must be one of abort, retract, in_place"):
        await client.pause_generation("later")
    assert scheduler.sent == [] and not client.is_paused


async def test_get_load_keeps_only_the_asked_rank(engine):
    client, _ = engine
    [load] = await client.get_load()
    assert (load.dp_rank, load.num_running_reqs) == (0, 2)
    assert [x.dp_rank for x in await client.get_load(0)] == [0]
    assert await client.get_load(3) == []


async def test_start_profile_sends_its_arguments_and_returns_the_answer(engine):
    client, scheduler = engine
    out = await client.start_profile("run-1", num_steps=3, start_step=0)
    assert (out.success, out.message) == (True, "profile start")
    sent = scheduler.sent[-1]
    assert (sent.action, sent.output_dir, sent.num_steps, sent.start_step) == (
        "start",
        "run-1",
        3,
        0,
    )
    assert (await client.stop_profile()).message == "profile stop"


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"output_dir": "/abs"}, "output_dir"),
        ({"output_dir": ".."}, "output_dir"),
        ({"output_dir": "a/b"}, "output_dir"),
        ({"output_dir": "a\\b"}, "output_dir"),
        ({"output_dir": "x\x00"}, "output_dir"),
        ({"output_dir": ""}, "output_dir"),
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": 2**63}, "num_steps"),
        ({"start_step": -1}, "start_step"),
        # Both wrong: the integers are named first, as the HTTP body's parser does.
        ({"output_dir": "/abs", "num_steps": 0}, "num_steps"),
    ],
)
async def test_a_bad_profile_is_refused_naming_the_field(engine, kwargs, param):
    client, scheduler = engine
    with pytest.raises(InvalidParameter) as e:
        await client.start_profile(**kwargs)
    assert e.value.param == param and scheduler.sent == []


async def test_update_weights_needs_a_model_path_and_returns_the_outcome(engine):
    client, scheduler = engine
    for bad in ("", None):
        with pytest.raises(InvalidParameter, match="model_path .* is required") as e:
            await client.update_weights_from_disk(bad)
        assert e.value.param == "model_path"
    assert scheduler.sent == []
    out = await client.update_weights_from_disk("/m.gguf", "gguf")
    assert (out.success, out.message) == (False, "no such file")
    assert (scheduler.sent[-1].model_path, scheduler.sent[-1].load_format) == ("/m.gguf", "gguf")


async def test_open_session_returns_its_id_or_says_why_not(engine):
    client, scheduler = engine
    assert await client.open_session(session_id="s1", streaming=True, timeout=30) == "s1"
    sent = scheduler.sent[-1]
    assert (sent.session_id, sent.streaming, sent.timeout) == ("s1", True, 30)
    assert await client.open_session() == "new"
    scheduler.open_ok = False
    with pytest.raises(InvalidParameter, match="cannot open the session: id taken") as e:
        await client.open_session(session_id="s1")
    assert e.value.param is None and e.value.status == 400


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"session_id": ""}, "session_id"),
        ({"session_id": "x" * 257}, "session_id"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": 10**30}, "timeout"),
        ({"capacity_of_str_len": -1}, "capacity_of_str_len"),
    ],
)
async def test_a_bad_session_is_refused_naming_the_field(engine, kwargs, param):
    client, scheduler = engine
    with pytest.raises(InvalidParameter) as e:
        await client.open_session(**kwargs)
    assert e.value.param == param and scheduler.sent == []


async def test_close_session_says_whether_one_was_open(engine):
    client, _ = engine
    assert await client.close_session("open") is True
    assert await client.close_session("unknown") is False
