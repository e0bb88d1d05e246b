"""A stage process collects garbage for the lent payloads of requests that ended, again
while they live on (a cycle may form only as the request's last task unwinds), and gives
up after LENT_GC_TRIES: what survives that is held on purpose."""

from __future__ import annotations

import asyncio
import gc

from cadence.pipeline import transport
from cadence.pipeline.transport import Transport


def _transport(acks: list) -> Transport:
    t = Transport.__new__(Transport)  # only the lent-payload books, no sockets
    t.runtimes, t._lent, t._gc_tries = {}, {}, {}
    t._gc_at, t._gc_handle, t._closed = 0.0, None, False
    t._ack = lambda src, rid, meta: acks.append(rid)
    return t


async def test_lent_payloads_of_an_ended_request_are_collected_for_a_few_times(monkeypatch):
    monkeypatch.setattr(transport, "LENT_GC_PERIOD_S", 0.01)
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1))
    acks: list = []
    t = _transport(acks)
    t._lent["kept"] = 1  # its request ended here (no runtime holds it); the payload lives on
    t._collect_soon()
    for _ in range(500):  # ten tries 10 ms apart, then no more
        await asyncio.sleep(0.01)
        if t._gc_handle is None:
            break
    assert len(collections) == transport.LENT_GC_TRIES
    await asyncio.sleep(0.05)
    assert len(collections) == transport.LENT_GC_TRIES  # given up: held on purpose
    t._lent["freed"] = 1
    t._collect_soon()
    await asyncio.sleep(0.005)  # a collection runs, then the payload goes (as a cycle's would)
    assert len(collections) > transport.LENT_GC_TRIES
    t._returned("src", "freed", {})
    done = len(collections)
    await asyncio.sleep(0.1)
    assert len(collections) == done and acks == ["freed"]  # nothing left to collect for
    assert "freed" not in t._gc_tries and t._lent == {"kept": 1}
