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
