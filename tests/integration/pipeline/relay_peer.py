"""The two sides of a relay, each in its own process, for test_relay_processes.py.

They talk over a multiprocessing Pipe carrying msgpack bytes only (no pickled objects), in
the order the pipeline runtime uses: put, announce, (receiver) get, acknowledge, then the
sender's wait. The receiver reports each payload it restored (header, then packed bytes) and
both report their relay's accounting before closing it.
"""

from __future__ import annotations

import asyncio

import msgspec
import torch

from cadence.pipeline.config import RelayConfig
from cadence.pipeline.messages import PayloadHeader
from cadence.pipeline.payload import extract, restore
from cadence.pipeline.relay import RelayContext, create_relay


def make_payloads() -> list:
    g = torch.Generator().manual_seed(7)
    return [
        {"x": torch.randn(256, generator=g)},
        {
            "ids": torch.randint(0, 1000, (3, 100), generator=g),
            "note": "two tensors",
            "m": [torch.ones(5, dtype=torch.bool)],
        },
        {
            "big": torch.randn(1 << 18, generator=g).to(torch.bfloat16)
        },  # 512 KiB: past a 64 KiB slot
        (torch.arange(10, dtype=torch.int16), {"deep": [torch.zeros(2, 2, dtype=torch.complex64)]}),
        {"large": torch.randn(2 << 20, generator=g)},  # 8 MiB: copied on a thread
        {"t": torch.randn(64, 64, generator=g).t()},
    ]


def context(backend: str, pipeline_id: str, rank: int, store: str) -> RelayContext:
    config = RelayConfig(backend=backend, slot_mb=1 / 16, credits=2, transfer_timeout_s=30)
    return RelayContext(pipeline_id, rank, 2, "cpu", config, store_address=store)


async def _recv(conn):
    return msgspec.msgpack.decode(await asyncio.to_thread(conn.recv_bytes))


async def _sender(ctx: RelayContext, conn, report) -> None:
    relay = await asyncio.to_thread(create_relay, ctx)
    try:
        for i, payload in enumerate(make_payloads()):
            extracted = extract(payload)
            op = await relay.put_payload_async(extracted, f"r{i}", 1)
            header = msgspec.msgpack.encode(extracted.header)
            conn.send_bytes(
                msgspec.msgpack.encode({"rid": f"r{i}", "header": header, "meta": op.metadata})
            )
            if relay.needs_ack:
                relay.acknowledge(await _recv(conn))
            await op.wait_for_completion(30)
        # A request dropped here after its put was announced: cleaned up at once, still drained.
        op = await relay.put_async(torch.ones(100, dtype=torch.uint8), "dropped", 1)
        conn.send_bytes(
            msgspec.msgpack.encode({"rid": "dropped", "meta": op.metadata, "drop": True})
        )
        relay.cleanup("dropped")
        if relay.needs_ack:
            relay.acknowledge(await _recv(conn))
        conn.send_bytes(msgspec.msgpack.encode({"end": True}))
        await _recv(conn)  # the receiver is done with everything
        await _settled(relay)
        report.send_bytes(msgspec.msgpack.encode(relay.stats()))
    finally:
        relay.close()


async def _receiver(ctx: RelayContext, conn, report) -> None:
    relay = await asyncio.to_thread(create_relay, ctx)
    try:
        while True:
            msg = await _recv(conn)
            if msg.get("end"):
                break
            meta, rid = msg["meta"], msg["rid"]
            if msg.get("drop"):
                await relay.discard_async(meta, rid, 0)
            else:
                dest = torch.empty(meta["size"], dtype=torch.uint8, device=relay.buffer_device(0))
                op = await relay.get_async(meta, dest, rid)
                await op.wait_for_completion(30)
            if relay.needs_ack:
                conn.send_bytes(msgspec.msgpack.encode(meta))
            if msg.get("drop"):
                continue
            payload = restore(msgspec.msgpack.decode(msg["header"], type=PayloadHeader), dest)
            again = extract(payload)
            report.send_bytes(msgspec.msgpack.encode(again.header))
            report.send_bytes(bytes(again.pack().numpy()) if again.nbytes else b"")
        conn.send_bytes(msgspec.msgpack.encode({"done": True}))
        await _settled(relay)
        report.send_bytes(msgspec.msgpack.encode(relay.stats()))
    finally:
        relay.close()


async def _settled(relay) -> None:
    """Transfers the other side has finished complete here a moment later (a waiting thread
    sees it); give them that moment before reporting."""
    for _ in range(200):
        if not relay.stats()["pending"]:
            return
        await asyncio.sleep(0.01)


def run_sender(ctx_bytes: bytes, conn, report) -> None:
    asyncio.run(_sender(_ctx(ctx_bytes), conn, report))


def run_receiver(ctx_bytes: bytes, conn, report) -> None:
    asyncio.run(_receiver(_ctx(ctx_bytes), conn, report))


def _ctx(data: bytes) -> RelayContext:
    raw = msgspec.msgpack.decode(data)
    return context(raw["backend"], raw["pipeline_id"], raw["rank"], raw["store"])


# -- zero-copy receive (shm lends large payloads) ------------------------------------------

LEND_CREDITS = 4


def lend_context(pipeline_id: str, rank: int) -> RelayContext:
    config = RelayConfig(
        slot_mb=1, credits=LEND_CREDITS, transfer_timeout_s=30, zero_copy_min_bytes=1 << 16
    )
    return RelayContext(pipeline_id, rank, 2, "cpu", config)


def lend_payloads() -> list:
    g = torch.Generator().manual_seed(11)
    return [
        {"pcm": torch.randn(1 << 17, generator=g), "ids": torch.arange(7), "text": "lent"},
        {"x": torch.randn(1 << 16, generator=g)},  # dropped by the sender once announced
        {"y": torch.randn(1 << 16, generator=g).to(torch.float16)},  # its receiver dies
    ]


async def _lend_sender(pipeline_id: str, conn, report) -> None:
    relay = await asyncio.to_thread(create_relay, lend_context(pipeline_id, 0))
    seen = []  # the sender's accounting at each step, for the test to check
    try:
        first, dropped, orphan = [extract(p) for p in lend_payloads()]
        # 1. Lent, taken (delivered: the put completes), released later.
        op = await relay.put_payload_async(first, "r0", 1)
        _announce(conn, "r0", first, op.metadata)
        relay.acknowledge(await _recv(conn))  # taken
        await op.wait_for_completion(30)
        seen.append(relay.stats())
        relay.acknowledge(await _recv(conn))  # released
        seen.append(relay.stats())
        # 2. Cleaned up before any acknowledgement: the slot waits for the receiver's word.
        op = await relay.put_payload_async(dropped, "r1", 1)
        _announce(conn, "r1", dropped, op.metadata, drop=True)
        relay.cleanup("r1")
        seen.append(relay.stats())
        relay.acknowledge(await _recv(conn))  # drained, never lent
        seen.append(relay.stats())
        # 3. Taken by a receiver that then dies holding it: the slot comes back.
        op = await relay.put_payload_async(orphan, "r2", 1)
        _announce(conn, "r2", orphan, op.metadata)
        relay.acknowledge(await _recv(conn))  # taken
        await op.wait_for_completion(30)
        seen.append(relay.stats())
        conn.send_bytes(msgspec.msgpack.encode({"die": True}))
        for _ in range(500):
            if not relay.stats()["borrowed"]:
                break
            await asyncio.sleep(0.01)
        seen.append(relay.stats())
        report.send_bytes(msgspec.msgpack.encode(seen))
    finally:
        relay.close()


def _announce(conn, rid: str, extracted, meta: dict, drop: bool = False) -> None:
    header = msgspec.msgpack.encode(extracted.header)
    conn.send_bytes(
        msgspec.msgpack.encode({"rid": rid, "header": header, "meta": meta, "drop": drop})
    )


async def _lend_receiver(pipeline_id: str, conn, report) -> None:
    import os

    relay = await asyncio.to_thread(create_relay, lend_context(pipeline_id, 1))
    # 1. Read in place; the payload's bytes are reported, then it is dropped.
    msg = await _recv(conn)
    meta = msg["meta"]
    released = []
    buf = relay.lend(meta, lambda: released.append(conn.send_bytes(msgspec.msgpack.encode(meta))))
    conn.send_bytes(msgspec.msgpack.encode({**meta, "borrower": os.getpid()}))
    payload = restore(msgspec.msgpack.decode(msg["header"], type=PayloadHeader), buf)
    lent_while_held = relay.stats()["lent"]
    again = extract(payload)
    report.send_bytes(msgspec.msgpack.encode(again.header))
    report.send_bytes(bytes(again.pack().numpy()))
    payload["pcm"].mul_(2)  # in-place writes land in the sender's slot, still ours
    buf = payload = again = None
    report.send_bytes(
        msgspec.msgpack.encode([lent_while_held, relay.stats()["lent"], len(released)])
    )
    # 2. A request this side has dropped: drained, not lent.
    msg = await _recv(conn)
    await relay.discard_async(msg["meta"], msg["rid"], 0)
    conn.send_bytes(msgspec.msgpack.encode(msg["meta"]))
    # 3. Taken, then this process dies holding it.
    msg = await _recv(conn)
    held = relay.lend(msg["meta"], lambda: None)
    conn.send_bytes(msgspec.msgpack.encode({**msg["meta"], "borrower": os.getpid()}))
    assert held is not None
    await _recv(conn)  # the sender has seen it taken: die holding it
    conn.close()
    report.close()
    os._exit(0)


def run_lend_sender(pipeline_id: str, conn, report) -> None:
    asyncio.run(_lend_sender(pipeline_id, conn, report))


def run_lend_receiver(pipeline_id: str, conn, report) -> None:
    asyncio.run(_lend_receiver(pipeline_id, conn, report))
