"""Relay bandwidth and control-plane latency of the stage pipeline (cadence.pipeline).

Not a test. Measures, each next to the limit it is compared with:
  - per relay backend (shm, torch), GB/s moving one payload of 1 MiB, 16 MiB and 256 MiB
    from one process to another, as the runtime does it (extract + put into the relay,
    DataReady over ZMQ, a lent payload read in place (shm) or a get into a
    fresh buffer (torch) + restore, DataAck back): `one-shot` is one
    payload at a time, timed from the start of the put to the restored tensor on the
    receiver (CLOCK_MONOTONIC is one clock for both processes); `streamed` is payloads back
    to back with the relay's credits in flight, bytes delivered per second. The limit is a
    single-process memcpy of the same size into a warm buffer (one thread: what one copy
    costs; torch's multi-threaded copy is printed too, for reference);
  - control-plane round trip: a request through a one-stage pipeline (coordinator -> Submit
    -> stage process -> its executor -> Complete -> coordinator, on uvloop as in the server),
    next to a bare ZMQ PUSH/PULL ping-pong of the same size between two processes (blocking
    sockets), and, to tell the event loop's share from the runtime's, the same ping-pong
    with both ends on an event loop reading through `channels.Inbox`.
The three round trips run in rounds (`--rounds`, `--count` each), alternating, so that on a
shared machine all three see the same load; the medians of the rounds are reported, and the
spread of the round-by-round ratio next to them.
Targets: shm >= 0.5x memcpy at 16 MiB (one-shot); control round trip <= 1.5x bare ZMQ.

    .venv/bin/python benchmarks/bench_relay.py [--json out.json] [--png out.png] [--quick]
        [--control-only] [--rounds 5] [--count 1000] [--sizes 1 16 256] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid

import msgspec
import torch
import uvloop
import zmq

from cadence.pipeline import Executor, Pipeline, PipelineConfig, RelayConfig, StageConfig, channels
from cadence.pipeline.messages import DataAck, DataReady, StatsQuery
from cadence.pipeline.payload import extract, restore
from cadence.pipeline.relay import RelayContext, create_relay

MIB = 1 << 20
SIZES_MIB = (1, 16, 256)
BACKENDS = ("shm", "torch")
TARGET_SHM_VS_MEMCPY = 0.5
TARGET_CONTROL_VS_ZMQ = 1.5
SLOT_MB = 16  # 1 and 16 MiB fit a slot; 256 MiB takes a segment of its own
CREDITS = 4


def _reps(size_mib: int, quick: bool) -> int:
    reps = {1: 200, 16: 30, 256: 4}.get(size_mib, max(4, 200 // size_mib))
    return max(2, reps // 4) if quick else reps


# -- the relay, between two processes --------------------------------------------------


def _relay_context(backend: str, pipeline_id: str, rank: int, store: str) -> RelayContext:
    config = RelayConfig(backend=backend, slot_mb=SLOT_MB, credits=CREDITS, inline_max_bytes=0)
    return RelayContext(pipeline_id, rank, 2, "cpu", config, store_address=store)


def _release(loop, push, ack) -> None:
    """A lent payload's last view is gone (on any thread): acknowledge it from the loop."""
    try:
        loop.call_soon_threadsafe(channels.send, push, ack)
    except RuntimeError:
        pass  # the loop has closed: the run is over


def run_receiver(backend: str, pipeline_id: str, store: str, pull_at: str, push_to: str) -> None:
    """Process: receives every announced payload as a stage process does (read in place when
    lent, else into a fresh buffer), restores it, acknowledges, and reports (seq, monotonic
    ns when the restored tensor was ready)."""
    torch.set_num_threads(1)

    async def main() -> None:
        relay = await asyncio.to_thread(
            create_relay, _relay_context(backend, pipeline_id, 1, store)
        )
        ctx = zmq.Context()
        pull = channels.bind(ctx, zmq.PULL, pull_at)
        push = channels.connect(ctx, zmq.PUSH, push_to)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()

        def on_message(msg, frame) -> None:
            if msg.rid == "stop":
                done.set_result(None)
            else:
                queue.put_nowait(msg)

        inbox = channels.Inbox(pull, on_message, "receiver")
        inbox.start()
        channels.send(push, DataAck(rid="hello", relay={}))
        while not done.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            msg = getter.result()
            meta = msg.relay
            release = functools.partial(_release, loop, push, DataAck(rid=msg.rid, relay=meta))
            lent = relay.lend(meta, release)
            if lent is not None:  # read in place (zero-copy receive): taken now, freed later
                channels.send(push, DataAck(rid=msg.rid, relay={**meta, "borrower": os.getpid()}))
                restored = restore(msg.payload, lent)
            else:
                dest = torch.empty(meta["size"], dtype=torch.uint8)
                op = await relay.get_async(meta, dest, msg.rid)
                await op.wait_for_completion(60)
                if relay.needs_ack:
                    channels.send(push, DataAck(rid=msg.rid, relay=meta))
                restored = restore(msg.payload, dest)
            ready_ns = time.monotonic_ns()
            del lent, restored  # the consumer is done with it: a lent slot goes back
            channels.send(push, DataAck(rid="timing", relay={"seq": msg.chunk_id, "ns": ready_ns}))
        inbox.stop()
        relay.close()
        ctx.destroy(linger=0)

    asyncio.run(main())


async def _relay_figures(backend: str, size_mib: int, quick: bool) -> dict:
    pipeline_id = uuid.uuid4().hex[:8]
    folder = tempfile.mkdtemp(prefix="cadence-bench-relay-")
    to_sender, to_receiver = f"ipc://{folder}/sender", f"ipc://{folder}/receiver"
    store = f"127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pull = channels.bind(ctx, zmq.PULL, to_sender)
    push = channels.connect(ctx, zmq.PUSH, to_receiver)
    proc = mp.get_context("spawn").Process(
        target=run_receiver, args=(backend, pipeline_id, store, to_receiver, to_sender)
    )
    proc.start()
    relay = await asyncio.to_thread(create_relay, _relay_context(backend, pipeline_id, 0, store))
    timings: dict[int, int] = {}
    arrived = asyncio.Event()

    def on_message(msg, frame) -> None:
        if msg.rid == "timing":
            timings[msg.relay["seq"]] = msg.relay["ns"]
            arrived.set()
        elif msg.rid != "hello":
            relay.acknowledge(msg.relay)

    inbox = channels.Inbox(pull, on_message, "sender")
    inbox.start()
    payload = torch.full((size_mib * MIB,), 7, dtype=torch.uint8)
    seq = 0

    async def send_one() -> tuple[int, int, object]:
        nonlocal seq
        seq += 1
        start = time.monotonic_ns()
        extracted = extract(payload)
        op = await relay.put_payload_async(extracted, f"r{seq}", 1)
        msg = DataReady(rid=f"r{seq}", stage="b", src_stage="a", payload=extracted.header)
        msg.relay, msg.chunk_id = op.metadata, seq
        channels.send(push, msg)
        return seq, start, op

    async def arrival(n: int) -> int:
        while n not in timings:
            arrived.clear()
            await arrived.wait()
        return timings[n]

    reps = _reps(size_mib, quick)
    one_shot = []
    for i in range(reps + 2):  # two warm-up transfers
        n, start, op = await send_one()
        await op.wait_for_completion(120)
        ready = await arrival(n)
        if i >= 2:
            one_shot.append(size_mib * MIB / (ready - start))  # bytes per ns = GB/s
    first = None
    ops = []
    for _ in range(reps):
        n, start, op = await send_one()
        first = first or start
        ops.append(op)
    await asyncio.gather(*(op.wait_for_completion(120) for op in ops))
    last = await arrival(n)
    streamed = reps * size_mib * MIB / (last - first)
    channels.send(push, DataReady(rid="stop", stage="b", src_stage="a"))
    await asyncio.to_thread(proc.join, 30)
    inbox.stop()
    relay.close()
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
    return {"one_shot": statistics.median(one_shot), "best": max(one_shot), "streamed": streamed}


# -- the limit: one memcpy ---------------------------------------------------------------


def memcpy_figures(size_mib: int, quick: bool) -> dict:
    src = torch.full((size_mib * MIB,), 3, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = _reps(size_mib, quick) * 2
    single = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        single.append(src.numel() / (time.perf_counter_ns() - start))
    multi = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        dst.copy_(src)
        multi.append(src.numel() / (time.perf_counter_ns() - start))
    return {
        "memcpy": statistics.median(single),
        "memcpy_best": max(single),
        "torch_copy": statistics.median(multi),
    }


# -- control plane -----------------------------------------------------------------------


class Echo(Executor):
    """Answers at once: what is left of a request's round trip is the control plane."""

    async def run(self, req):
        return req.data


def run_zmq_echo(pull_at: str, push_to: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_at)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_to)
    while True:
        msg = pull.recv()
        if msg == b"stop":
            break
        push.send(msg)
    ctx.destroy(linger=0)


def run_loop_echo(pull_at: str, push_to: str) -> None:
    """Process: echoes every message from an event loop, as a stage process reads them."""

    async def main() -> None:
        ctx = zmq.Context()
        pull = channels.bind(ctx, zmq.PULL, pull_at)
        push = channels.connect(ctx, zmq.PUSH, push_to)
        done = asyncio.Event()

        def on_message(msg, frame) -> None:
            if msg.token < 0:
                done.set()
            else:
                channels.send(push, msg)

        inbox = channels.Inbox(pull, on_message, "echo")
        inbox.start()
        await done.wait()
        inbox.stop()
        ctx.destroy(linger=0)

    uvloop.run(main())


class ControlPeers:
    """The three round trips, each against a process of its own that lives for the whole
    run, so that rounds can alternate between them and every figure of a round sees the
    same machine load:
      - control: a request through a one-stage pipeline (Submit -> echo -> Complete);
      - bare: a blocking ZMQ PUSH/PULL ping-pong of the same size (the limit);
      - loop: the ping-pong with both ends on an event loop reading through `Inbox`, the
        floor of any round trip an asyncio process takes part in."""

    WARMUP = 200

    async def start(self) -> None:
        # Stage processes import this file by its name: its directory is on sys.path (main()).
        config = PipelineConfig(
            name="bench-control",
            stages=[StageConfig(name="echo", executor="bench_relay:Echo", terminal=True)],
        )
        self.pipeline = await Pipeline.start(config)
        self.request = {"text": "hi", "n": 1}
        self.message_bytes = len(msgspec.msgpack.encode(self.request)) + 40  # ~ a Submit
        self.folder = tempfile.mkdtemp(prefix="cadence-bench-control-")
        self.ctx = zmq.Context()
        spawn = mp.get_context("spawn")
        self.bare_pull, self.bare_push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.bare_pull.bind(f"ipc://{self.folder}/bare-back")
        self.bare_push.connect(f"ipc://{self.folder}/bare-there")
        self.bare_proc = spawn.Process(
            target=run_zmq_echo,
            args=(f"ipc://{self.folder}/bare-there", f"ipc://{self.folder}/bare-back"),
        )
        self.loop_pull = channels.bind(self.ctx, zmq.PULL, f"ipc://{self.folder}/loop-back")
        self.loop_push = channels.connect(self.ctx, zmq.PUSH, f"ipc://{self.folder}/loop-there")
        self.loop_proc = spawn.Process(
            target=run_loop_echo,
            args=(f"ipc://{self.folder}/loop-there", f"ipc://{self.folder}/loop-back"),
        )
        self.bare_proc.start()
        self.loop_proc.start()
        self._waiter: asyncio.Future | None = None
        self.inbox = channels.Inbox(self.loop_pull, self._on_echo, "ping")
        self.inbox.start()
        await self.control(self.WARMUP)
        self.bare(self.WARMUP)
        await self.loop(self.WARMUP)

    async def control(self, count: int) -> list[int]:
        submit, request, times = self.pipeline.coordinator.submit, self.request, []
        for _ in range(count):
            start = time.perf_counter_ns()
            await submit(request)
            times.append(time.perf_counter_ns() - start)
        return times

    async def control_message(self, count: int) -> list[int]:
        """A control message alone: StatsQuery (PUB) -> dispatch -> StageStats."""
        times = []
        for _ in range(count):
            start = time.perf_counter_ns()
            await self.pipeline.coordinator.stage_stats()
            times.append(time.perf_counter_ns() - start)
        return times

    def bare(self, count: int) -> list[int]:
        push, pull, message, times = self.bare_push, self.bare_pull, b"x" * self.message_bytes, []
        for _ in range(count):
            start = time.perf_counter_ns()
            push.send(message)
            pull.recv()
            times.append(time.perf_counter_ns() - start)
        return times

    def _on_echo(self, msg, frame) -> None:
        self._waiter.set_result(None)

    async def loop(self, count: int) -> list[int]:
        loop, times = asyncio.get_running_loop(), []
        for i in range(count):
            self._waiter = loop.create_future()
            start = time.perf_counter_ns()
            channels.send(self.loop_push, StatsQuery(token=i))
            await self._waiter
            times.append(time.perf_counter_ns() - start)
        return times

    async def stop(self) -> None:
        await self.pipeline.shutdown()
        self.bare_push.send(b"stop")
        channels.send(self.loop_push, StatsQuery(token=-1))
        await asyncio.to_thread(self.bare_proc.join, 10)
        await asyncio.to_thread(self.loop_proc.join, 10)
        self.inbox.stop()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)


def _median_us(times: list[int]) -> float:
    return statistics.median(times) / 1000


async def control_rtt(rounds: int, count: int) -> dict:
    """Medians over `rounds` rounds; in each round every round trip runs `count` times, in
    an order that rotates from round to round."""
    peers = ControlPeers()
    await peers.start()
    per_round: dict[str, list[float]] = {"control": [], "bare": [], "loop": []}
    pooled: list[int] = []
    try:
        for r in range(rounds):
            names = list(per_round)
            for name in names[r % 3 :] + names[: r % 3]:
                times = getattr(peers, name)(count)
                if asyncio.iscoroutine(times):
                    times = await times
                per_round[name].append(_median_us(times))
                if name == "control":
                    pooled += times
        message = _median_us(await peers.control_message(max(1, count // 2)))
    finally:
        await peers.stop()
    ratios = [c / b for c, b in zip(per_round["control"], per_round["bare"])]
    pooled.sort()
    return {
        "control_rtt_us": statistics.median(per_round["control"]),
        "control_rtt_p99_us": pooled[int(len(pooled) * 0.99)] / 1000,
        "control_msg_rtt_us": message,
        "zmq_rtt_us": statistics.median(per_round["bare"]),
        "zmq_loop_rtt_us": statistics.median(per_round["loop"]),
        "control_vs_zmq": statistics.median(ratios),
        "control_vs_zmq_rounds": ratios,
        "control_rounds_us": per_round["control"],
        "zmq_rounds_us": per_round["bare"],
        "message_bytes": peers.message_bytes,
    }


# -- report --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def measure(args) -> dict:
    """The relay's figures, then the control round trips. --smoke runs them all at once (both
    backends' transfers and the round trips): their processes then start, importing torch,
    together."""
    out: dict = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}}
    out["sizes_mib"] = [] if args.control_only else list(args.sizes)
    if args.smoke:
        _, control = await asyncio.gather(
            relay_figures(out, args), control_rtt(args.rounds, args.count)
        )
    else:
        await relay_figures(out, args)
        control = await control_rtt(args.rounds, args.count)
    out.update(control)
    out["machine"]["load_after"] = os.getloadavg()[0]
    return out


async def relay_figures(out: dict, args) -> None:
    """Each size's memcpy limit and both backends' transfers, into `out`."""
    for size in out["sizes_mib"]:
        limits = memcpy_figures(size, args.quick)
        out[f"memcpy_gb_s_{size}mib"] = limits["memcpy"]
        out[f"memcpy_best_gb_s_{size}mib"] = limits["memcpy_best"]
        out[f"torch_copy_gb_s_{size}mib"] = limits["torch_copy"]
        if args.smoke:
            runs = await asyncio.gather(*(_relay_figures(b, size, args.quick) for b in BACKENDS))
        else:
            runs = [await _relay_figures(backend, size, args.quick) for backend in BACKENDS]
        for backend, figures in zip(BACKENDS, runs):
            out[f"{backend}_gb_s_{size}mib"] = figures["one_shot"]
            out[f"{backend}_best_gb_s_{size}mib"] = figures["best"]
            out[f"{backend}_streamed_gb_s_{size}mib"] = figures["streamed"]
    if 16 in out["sizes_mib"]:
        out["shm_vs_memcpy_16mib"] = out["shm_gb_s_16mib"] / out["memcpy_gb_s_16mib"]
        best = out["shm_best_gb_s_16mib"] / out["memcpy_best_gb_s_16mib"]
        out["shm_vs_memcpy_best_16mib"] = best


def print_relay(res: dict) -> None:
    print(f"{'payload':>8} {'memcpy':>8} {'torch cp':>9}", end="")
    for backend in BACKENDS:
        print(f" {backend + ' 1-shot':>12} {backend + ' stream':>12}", end="")
    print("   (GB/s)")
    for size in res["sizes_mib"]:
        print(
            f"{size:>5} MiB {res[f'memcpy_gb_s_{size}mib']:>8.2f} "
            f"{res[f'torch_copy_gb_s_{size}mib']:>9.2f}",
            end="",
        )
        for backend in BACKENDS:
            print(
                f" {res[f'{backend}_gb_s_{size}mib']:>12.2f} "
                f"{res[f'{backend}_streamed_gb_s_{size}mib']:>12.2f}",
                end="",
            )
        print()
    if "shm_vs_memcpy_16mib" not in res:
        return
    ok = res["shm_vs_memcpy_16mib"] >= TARGET_SHM_VS_MEMCPY
    print(
        f"shm at 16 MiB: {res['shm_vs_memcpy_16mib']:.2f}x memcpy "
        f"(target >= {TARGET_SHM_VS_MEMCPY}x): {'met' if ok else 'MISSED'}"
    )
    print(
        f"  best of the repetitions (the least disturbed by other load): shm "
        f"{res['shm_best_gb_s_16mib']:.2f} GB/s, memcpy {res['memcpy_best_gb_s_16mib']:.2f} GB/s: "
        f"{res['shm_vs_memcpy_best_16mib']:.2f}x; torch {res['torch_best_gb_s_16mib']:.2f} GB/s"
    )


def print_report(res: dict) -> None:
    machine = res["machine"]
    print(
        f"machine: {machine['cpus']} CPUs, load average {machine['load']:.1f} at the start, "
        f"{machine['load_after']:.1f} at the end"
    )
    if res["sizes_mib"]:
        print_relay(res)
    ratios = res["control_vs_zmq_rounds"]
    ok = res["control_vs_zmq"] <= TARGET_CONTROL_VS_ZMQ
    print(
        f"control round trip (Submit -> echo stage -> Complete) {res['control_rtt_us']:.0f} us "
        f"(p99 {res['control_rtt_p99_us']:.0f}) vs bare ZMQ PUSH/PULL {res['zmq_rtt_us']:.0f} us: "
        f"{res['control_vs_zmq']:.2f}x, median of {len(ratios)} rounds "
        f"(spread {min(ratios):.2f}x to {max(ratios):.2f}x; target <= {TARGET_CONTROL_VS_ZMQ}x): "
        f"{'met' if ok else 'MISSED'}"
    )
    print(
        f"the same ping-pong with both ends on an event loop (channels.Inbox): "
        f"{res['zmq_loop_rtt_us']:.0f} us ({res['zmq_loop_rtt_us'] / res['zmq_rtt_us']:.2f}x bare); "
        f"a control message alone (StatsQuery over PUB -> dispatch -> StageStats): "
        f"{res['control_msg_rtt_us']:.0f} us"
    )


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    sizes = res["sizes_mib"]
    series = [("memcpy", "memcpy_gb_s_{}mib")]
    for backend in BACKENDS:
        series += [(f"{backend} one-shot", backend + "_gb_s_{}mib")]
        series += [(f"{backend} streamed", backend + "_streamed_gb_s_{}mib")]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series if sizes else []):
        values = [res[key.format(size)] for size in sizes]
        ax.bar([x + i * width for x in range(len(sizes))], values, width, label=label)
    if sizes:
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))])
        ax.set_xticklabels([f"{s} MiB" for s in sizes])
        ax.set_yscale("log")  # memcpy and the relays differ by orders of magnitude
        ax.legend(fontsize=8)
    ax.set_ylabel("GB/s (log scale)")
    ax.set_title("relay bandwidth between two processes")
    bx.bar(
        ["bare\nZMQ", "ZMQ on\na loop", "control\nplane"],
        [res["zmq_rtt_us"], res["zmq_loop_rtt_us"], res["control_rtt_us"]],
    )
    bx.set_ylabel("round trip, us (median)")
    bx.set_title("control round trip")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--png", default="bench_results/bench_relay.png")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES_MIB), help="payload sizes, MiB"
    )
    parser.add_argument("--control-only", action="store_true", help="only the control round trips")
    parser.add_argument(
        "--rounds", type=int, default=5, help="control rounds (medians of the rounds kept)"
    )
    parser.add_argument(
        "--count", type=int, default=1000, help="round trips of each kind in a round"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every code path at the smallest size (1 MiB, one short round), the transfers "
        "and the round trips run at once: for CI",
    )
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.sizes, args.rounds, args.count = True, [1], 1, 100
    res = uvloop.run(measure(args))  # the loop the server's front process runs
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.png:
        plot(res, args.png)
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    sys.exit(main())
