"""Control answers find their own caller by id: a control message that cannot be sent fails
only its caller, at once, and leaves no waiter behind; answers that come back out of order
still reach the callers that asked; an answer nobody waits for any more is dropped."""

from __future__ import annotations

import asyncio

import pytest

from cadence import io_struct
from cadence.errors import RequestError
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    CloseSessionReqInput,
    CloseSessionReqOutput,
    GetLoadReqInput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
)


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **kwargs):
        return "x" * len(ids)


class Wire:
    """The scheduler's socket: every message is encoded as the real one is (so a value the
    codec cannot carry fails here as it does there), and kept for the test to answer."""

    def __init__(self):
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(io_struct.decode(io_struct.encode(msg)))


def make_client() -> tuple[FrontClient, Wire]:
    info = ModelInfo(
        model_path="m",
        tokenizer_path=None,
        served_model_name="m",
        context_len=256,
        vocab_size=100,
        max_total_tokens=1024,
    )
    wire = Wire()
    return FrontClient(FrontTokenizer(_Tokenizer()), info, wire.send, max_pending=8), wire


def answer(request: OpenSessionReqInput) -> OpenSessionReqOutput:
    """The scheduler's answer to `request`, through the codec, echoing its id."""
    out = OpenSessionReqOutput(session_id=request.session_id, success=True, cid=request.cid)
    return io_struct.decode(io_struct.encode(out))


async def test_a_control_that_cannot_be_sent_fails_at_once_and_leaves_no_waiter():
    client, wire = make_client()
    huge = OpenSessionReqInput(capacity_of_str_len=10**23)  # msgpack carries at most 2^64
    with pytest.raises(RequestError) as e:
        await asyncio.wait_for(client.control(huge), 2)
    assert e.value.status == 500 and e.value.is_request_fault
    assert "OpenSessionReqInput could not be sent" in str(e.value)
    assert client._control_waiters == {} and wire.sent == []
    # The next one of the same kind gets its own answer, not a stale slot's.
    task = asyncio.ensure_future(client.control(OpenSessionReqInput(session_id="s1")))
    await asyncio.sleep(0)
    client.on_message(answer(wire.sent[0]))
    assert (await asyncio.wait_for(task, 2)).session_id == "s1"
    assert client._control_waiters == {}


async def test_two_controls_of_one_kind_get_their_own_answers_out_of_order():
    client, wire = make_client()
    first = asyncio.ensure_future(client.control(OpenSessionReqInput(session_id="a")))
    second = asyncio.ensure_future(client.control(OpenSessionReqInput(session_id="b")))
    await asyncio.sleep(0)
    assert [m.session_id for m in wire.sent] == ["a", "b"]  # both sent, neither waits its turn
    assert len({m.cid for m in wire.sent}) == 2 and all(m.cid for m in wire.sent)
    client.on_message(answer(wire.sent[1]))  # b's answer first
    assert (await asyncio.wait_for(second, 2)).session_id == "b"
    assert not first.done()
    client.on_message(answer(wire.sent[0]))
    assert (await asyncio.wait_for(first, 2)).session_id == "a"
    assert client._control_waiters == {}


async def test_an_answer_after_its_caller_gave_up_is_dropped_and_takes_no_ones_place():
    client, wire = make_client()
    with pytest.raises(RequestError) as e:
        await client.control(OpenSessionReqInput(session_id="late"), timeout=0.01)
    assert e.value.status == 503 and client._control_waiters == {}
    task = asyncio.ensure_future(client.control(OpenSessionReqInput(session_id="now")))
    await asyncio.sleep(0)
    client.on_message(answer(wire.sent[0]))  # the late answer: nobody waits for it
    client.on_message(CloseSessionReqOutput(success=True))  # no id at all
    assert not task.done()
    client.on_message(answer(wire.sent[1]))
    assert (await asyncio.wait_for(task, 2)).session_id == "now"


async def test_a_cancelled_caller_leaves_no_waiter():
    client, wire = make_client()
    task = asyncio.ensure_future(client.control(CloseSessionReqInput(session_id="s")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client._control_waiters == {}


async def test_end_all_fails_the_waiting_controls_at_once():
    client, wire = make_client()
    task = asyncio.ensure_future(client.control(GetLoadReqInput()))
    await asyncio.sleep(0)
    client.end_all("the scheduler died", 503)
    with pytest.raises(RequestError, match="the scheduler died"):
        await asyncio.wait_for(task, 2)
    assert client._control_waiters == {}
