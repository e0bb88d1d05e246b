"""The control plane's sockets on a loop: every message in arrival order, each with its
payload frame exactly when it carries one, junk dropped with its frames, and a send whose
frame does not match its message refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq

from cadence.pipeline import channels
from cadence.pipeline import messages as m
from cadence.pipeline.payload import buffer_from_frame, extract, restore


@pytest.fixture
def pair():
    ctx = zmq.Context()
    pull = channels.bind(ctx, zmq.PULL, "inproc://channels-test")
    push = channels.connect(ctx, zmq.PUSH, "inproc://channels-test")
    yield push, pull
    ctx.destroy(linger=0)


async def test_messages_arrive_in_order_each_with_its_frame(pair):
    push, pull = pair
    with_tensor = extract({"x": torch.arange(6, dtype=torch.int32)})
    relayed = m.DataReady(rid="r", stage="b", src_stage="a", payload=with_tensor.header)
    relayed.relay = {"seq": 1}  # its tensor bytes are in the relay: no frame on the wire
    got: list = []
    done = asyncio.Event()

    def handler(msg, frame) -> None:
        got.append((msg, frame))
        if isinstance(msg, m.Shutdown):
            done.set()

    inbox = channels.Inbox(pull, handler, "test")
    channels.send(
        push, m.Submit(rid="r", stage="a", payload=with_tensor.header), with_tensor.pack().numpy()
    )
    # A frame that would decode as a message of its own: it must go with the junk.
    push.send_multipart([b"\xc1 not a message", m.encode(m.Abort(rids=["stray"]))])
    channels.send(push, m.Complete(rid="r", stage="a", payload=extract({"n": 1}).header))
    channels.send(push, relayed)
    channels.send(push, m.Shutdown())
    inbox.start()
    await asyncio.wait_for(done.wait(), 10)
    inbox.stop()

    assert [type(msg) for msg, _ in got] == [m.Submit, m.Complete, m.DataReady, m.Shutdown]
    submit, frame = got[0]
    restored = restore(submit.payload, buffer_from_frame(frame))
    assert torch.equal(restored["x"], torch.arange(6, dtype=torch.int32))
    assert [frame for _, frame in got[1:]] == [None, None, None]
    assert restore(got[1][0].payload, None) == {"n": 1}


async def test_messages_sent_after_a_quiet_spell_still_arrive(pair):
    push, pull = pair
    got: list = []
    inbox = channels.Inbox(pull, lambda msg, frame: got.append(msg.token), "test")
    inbox.start()
    for token in range(3):  # each drain ends on an empty queue: the next must wake it again
        channels.send(push, m.StatsQuery(token=token))
        for _ in range(200):
            if len(got) > token:
                break
            await asyncio.sleep(0.005)
    inbox.stop()
    assert got == [0, 1, 2]


def test_a_frame_that_does_not_match_its_message_is_refused(pair):
    push, _ = pair
    header = extract({"x": torch.ones(2)}).header
    with pytest.raises(ValueError, match="Submit without its frame"):
        channels.send(push, m.Submit(rid="r", stage="a", payload=header))
    with pytest.raises(ValueError, match="Abort with its frame"):
        channels.send(push, m.Abort(rids=["r"]), b"stray")
