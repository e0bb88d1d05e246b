"""Prefill/decode disaggregation: the KV transfer, and a mixed workload colocated vs split.

Not a test. Measures, each next to the limit it is compared with:
  - KV transfer GB/s: a PrefillAgent in one process and a DecodeAgent in another (this one),
    each over its own KVPool shaped like the default model's (SmolLM2-135M: 30 layers,
    3 KV heads, head_dim 64, page 16, float32; read from the GGUF), move a prompt's pages
    over the shm relay, room after room, as the servers do: the prefill side `send`s the
    pages and `finish`es, the decode side `store`s each chunk into its pages and
    `release`s it, as its scheduler does. Timed from the first `send` to the last page
    stored (CLOCK_MONOTONIC is one clock for both processes), after the handshake; median
    of `--transfer-repeats` per size (`--transfer-tokens`, 2,000 and 8,000 by default). Both
    processes run torch on one thread. The limit is a single-threaded copy of a buffer of
    the same size (the faster of ctypes.memmove and torch `copy_`, median). The bytes are
    checked once per size.
  - a mixed workload through real servers: `--streams` (16) streaming clients loop short
    prompts (`--short-tokens` random token ids, `--short-new-tokens` greedy tokens, EOS
    ignored) while a `--long-tokens` (2,000) prompt of its own random ids arrives every
    `--long-every` seconds (`--long-new-tokens` tokens), over native /generate SSE. Colocated:
    one `cadence serve` on the union of both cores (`taskset`). Disaggregated: a prefill
    server on `--prefill-cpus` (0), a decode server on `--decode-cpus` (1), each with
    CADENCE_NUM_THREADS=1, `cadence router --pd-disaggregation` in front, unpinned unless
    `--router-cpus` (the colocated clients talk to their server directly, unless
    `--colocated-router`); the router sends prompts of at most `--local-prefill-max-tokens`
    (256) to the decode server alone, which prefills them itself (conditional
    disaggregation: the short streams never queue behind long prompts on the prefill server;
    0 sends every prompt through the prefill server, as SGLang's router does). After `--warmup` seconds of load, `--duration` seconds are
    measured: ITL p99 of the short streams (the gaps between streamed events, as a client
    sees them; an event may carry several tokens; a stream still stalled when the run ends
    counts its open gap up to the window's end, one that never got a token its whole wait),
    TTFT p50 of the long prompts sent in
    the window (one not answered within `--drain` seconds after it counts with the time it
    waited, a lower bound, and is reported), completion tok/s of every stream.

A 2,000-token prompt takes seconds to compute on these CPUs (about 5 s on both cores of a
quiet 2-core machine, docs/prefix_cache.md): one a second is more than either setup
computes, so its TTFT measures a queue that grows with `--duration`, and the long prompts
not answered in time are reported; a larger `--long-every` measures a steady state. The
decode server takes a request's pages when it arrives, before its prompt is computed, so its
pool (`--decode-max-total-tokens`) is sized by default for every long prompt the run sends.

Targets (issue 29): transfer >= 0.5x memcpy; ITL p99 disaggregated <= 0.5x colocated;
throughput disaggregated >= 0.7x colocated. Peers: SGLang's PD disaggregation with mooncake
or NIXL moves pages by RDMA; on one host our shm relay is compared with memcpy instead.

Usage: python benchmarks/bench_pd.py [--json out.json] [--plot out.png] [--duration 30]
       [--long-every 1.0] [--streams 16] [--router-cpus 1] [--smoke]
Progress goes to stderr, figures to stdout. Every process it starts is stopped on exit.
"""

from __future__ import annotations

import os

from cadence import envs  # noqa: E402

envs.set_openmp_defaults()  # as `cadence serve` gives its children

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import multiprocessing as mp
import random
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import torch

TARGET_TRANSFER_VS_MEMCPY = 0.5
TARGET_ITL_P99_PD_VS_COLOCATED = 0.5
TARGET_TOK_S_PD_VS_COLOCATED = 0.7
TOKEN_IDS = (1000, 40000)  # random prompt ids are drawn from the model's ordinary vocabulary


STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench_pd {time.monotonic() - STARTED:5.1f} s] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the KV transfer, between two processes ------------------------------------------------


def model_shape() -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the default model's pool."""
    try:
        from cadence.model_loader.loader import load_config
        from cadence.model_loader.locate import default_model_path

        config = load_config(default_model_path())
        return config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    except Exception as e:  # the shape is all that is needed: SmolLM2-135M's
        log(f"default model's shape not readable ({e}); using SmolLM2-135M's")
        return 30, 3, 64


def pattern(buf: torch.Tensor, layer: int) -> torch.Tensor:
    """What a prefill pool's layer holds: a value from each element's place (exact in
    float32), so that a page put in the wrong place or a shifted byte shows."""
    values = (torch.arange(buf.numel(), dtype=torch.int64) * 7 + layer) % 100003
    return values.to(buf.dtype).view(buf.shape)


def make_pool(num_pages: int, shape: tuple[int, int, int], page_size: int, fill: bool):
    from cadence.mem_cache.kv_pool import KVPool

    layers, heads, head_dim = shape
    pool = KVPool(num_pages, page_size, layers, heads, head_dim, torch.float32)
    pool.commit()  # as a server does: no page faults inside the timings
    if fill:
        for layer, buf in enumerate(pool.kv_buffer):
            buf.copy_(pattern(buf, layer))
    return pool


def wait_events(agent, until, timeout: float = 60.0) -> None:
    """Hands the agent's events to `until` (as its scheduler takes them, woken by its
    wake_fd), each once, until `until` says stop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not agent.has_events:
            select.select([agent.wake_fd], [], [], 0.2)
        for event in agent.take_events():
            if until(event):
                return
    raise RuntimeError(f"the {agent.side} agent saw no end of its room within {timeout:g} s")


def run_prefill_side(conn, shape, page_size: int, num_pages: int, port: int) -> None:
    """Process: a PrefillAgent over a filled pool. For each (room, pages) it is sent: expects
    the room, waits for the decode side's claim to be accepted, then sends the pages and
    the first token and answers (monotonic ns of the send, None or why it failed)."""
    from cadence.disaggregation import messages as m
    from cadence.disaggregation.agent import Lost, Sent
    from cadence.disaggregation.prefill_agent import PrefillAgent

    torch.set_num_threads(1)
    pool = make_pool(num_pages, shape, page_size, fill=True)
    agent = PrefillAgent(pool, "shm", "127.0.0.1", port, bootstrap_timeout=60, waiting_timeout=60)
    agent.start()
    conn.send("ready")
    try:
        while (job := conn.recv()) is not None:
            room, pages = job
            agent.expect(room, f"bench-{room}")
            conn.send("expecting")
            deadline = time.monotonic() + 30
            while not getattr(agent.rooms.get(room), "accepted", False):  # the handshake
                if time.monotonic() > deadline:
                    raise RuntimeError(f"room {room} was never claimed")
                time.sleep(0.001)
            start = time.monotonic_ns()
            agent.send(room, 0, pages)
            agent.finish(room, m.Done(room=room, token=1))
            failed: list[str] = []

            def ended(event) -> bool:
                if isinstance(event, Lost):
                    failed.append(event.message)
                return isinstance(event, (Sent, Lost))

            wait_events(agent, ended)
            conn.send((start, failed[0] if failed else None))
    finally:
        agent.close()


def receive_room(decode, dst_pages: list[int]) -> int:
    """What the decode scheduler does with a room: stores each chunk into its pages and
    releases it; once all are stored, commits and waits for the prefill side's
    confirmation. The monotonic ns after the last store."""
    from cadence.disaggregation.agent import Arrived, Committed, Lost, Ready

    last = [0]

    def on_event(event) -> bool:
        if isinstance(event, Arrived):
            first = event.first_page
            decode.store(dst_pages[first : first + event.num_pages], event)
            event.release()
            last[0] = time.monotonic_ns()
        elif isinstance(event, Ready):
            decode.commit(event.room)
        elif isinstance(event, Lost):
            raise RuntimeError(f"the transfer failed: {event.message}")
        return isinstance(event, Committed)

    wait_events(decode, on_event)
    return last[0]


def check_pages(dst_pool, src_pages: list[int], dst_pages: list[int]) -> None:
    """The decode pool's pages hold what the prefill pool (same shape, `pattern`) sent."""
    for layer, dst in enumerate(dst_pool.kv_buffer):
        if not torch.equal(pattern(dst, layer)[:, :, src_pages], dst[:, :, dst_pages]):
            raise RuntimeError(f"layer {layer}: the pages arrived with other bytes than sent")


def memcpy_gb_s(nbytes: int, repeats: int) -> float:
    """The faster of a single-threaded ctypes.memmove and torch copy_, median GB/s."""
    src = torch.full((nbytes,), 3, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm: both buffers touched
    best = 0.0
    for copy in (
        lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        lambda: dst.copy_(src),
    ):
        speeds = []
        for _ in range(max(3, repeats * 2)):
            start = time.perf_counter_ns()
            copy()
            speeds.append(nbytes / (time.perf_counter_ns() - start))
        best = max(best, statistics.median(speeds))
    return best


def time_room(conn, decode, port: int, room: int, src_pages, dst_pages) -> int:
    """Nanoseconds from the prefill side's `send` of one room's pages to the last one stored
    here."""
    conn.send((room, src_pages))
    if conn.recv() != "expecting":
        raise RuntimeError("the prefill side answered out of turn")
    decode.claim(room, f"bench-{room}", "127.0.0.1", port, 0)
    end = receive_room(decode, dst_pages)
    start, failed = conn.recv()
    if failed:
        raise RuntimeError(f"the prefill side: {failed}")
    return end - start


def transfer_figures(args) -> dict:
    from cadence.disaggregation.decode_agent import DecodeAgent

    torch.set_num_threads(1)
    shape, page = model_shape(), args.page_size
    sizes = {tokens: -(-tokens // page) for tokens in args.transfer_tokens}
    num_pages = max(sizes.values()) + 1
    port = free_port()
    conn, child_conn = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=run_prefill_side, args=(child_conn, shape, page, num_pages, port), daemon=True
    )
    proc.start()
    dst = make_pool(num_pages, shape, page, fill=False)
    decode = DecodeAgent(dst, "shm", bootstrap_timeout=60, waiting_timeout=60)
    decode.start()
    out: dict = {"kv_layers": shape[0], "kv_heads": shape[1], "kv_head_dim": shape[2]}
    out["page_nbytes"] = dst.page_nbytes
    rng = random.Random(0)
    room = 0
    try:
        if not conn.poll(120) or conn.recv() != "ready":
            raise RuntimeError("the prefill side did not start")
        for tokens, n in sizes.items():
            nbytes, speeds = n * dst.page_nbytes, []
            for rep in range(args.transfer_repeats + 1):  # the first warms the relay's slots
                room += 1
                src_pages = rng.sample(range(num_pages), n)  # a pool's pages are scattered
                dst_pages = rng.sample(range(num_pages), n)
                ns = time_room(conn, decode, port, room, src_pages, dst_pages)
                speeds += [nbytes / ns] if rep else []
            check_pages(dst, src_pages, dst_pages)
            out[f"kv_transfer_gb_s_{tokens}tok"] = statistics.median(speeds)
            out[f"kv_transfer_best_gb_s_{tokens}tok"] = max(speeds)  # the least disturbed
            out[f"memcpy_gb_s_{tokens}tok"] = memcpy_gb_s(nbytes, args.transfer_repeats)
            out[f"transfer_mb_{tokens}tok"] = nbytes / 1e6
            log(
                f"transfer {tokens} tokens ({nbytes / 1e6:.1f} MB): "
                f"{out[f'kv_transfer_gb_s_{tokens}tok']:.2f} GB/s (best "
                f"{out[f'kv_transfer_best_gb_s_{tokens}tok']:.2f}), "
                f"memcpy {out[f'memcpy_gb_s_{tokens}tok']:.2f} GB/s"
            )
    finally:
        decode.close()
        with contextlib.suppress(OSError):  # gone already
            conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    first = args.transfer_tokens[0]
    out["kv_transfer_gb_s"] = out[f"kv_transfer_gb_s_{first}tok"]
    out["memcpy_gb_s"] = out[f"memcpy_gb_s_{first}tok"]
    return out


# -- the servers ---------------------------------------------------------------------------


def cpu_list(spec: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3] (taskset's list form)."""
    cpus: list[int] = []
    for part in filter(None, spec.split(",")):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


class Fleet:
    """Servers and routers, each a child process in its own session (killed with all it
    started), logs in one folder."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logdir = tempfile.mkdtemp(prefix="cadence-bench-pd-")

    def spawn(self, name: str, cmd: list[str], cpus: str = "", threads: int = 0) -> None:
        """Starts `cmd` pinned to `cpus` (taskset), with `threads` torch threads (default:
        one per pinned core)."""
        env = dict(os.environ)
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
            env["CADENCE_NUM_THREADS"] = str(threads or len(set(cpu_list(cpus))))
        with open(os.path.join(self.logdir, f"{name}.log"), "wb") as out:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip

    def tail(self, name: str, n: int = 2000) -> str:
        with open(os.path.join(self.logdir, f"{name}.log"), errors="replace") as f:
            return f.read()[-n:]

    async def wait_ready(self, name: str, url: str, timeout: float = 600) -> None:
        proc, path = self.procs[name], "/ready" if name.endswith("router") else "/health"
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")
                try:
                    async with session.get(url + path) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"{name} was not ready within {timeout:g} s:\n{self.tail(name)}")

    def stop(self, *names: str) -> None:
        """SIGTERM to each one's process group, SIGKILL after 30 s; reaps them."""
        for name in names or list(self.procs):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue


def server_cmd(args, port: int, mode: str = "null", bootstrap_port: int = 0) -> list[str]:
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--host", "127.0.0.1",
        "--port", str(port), "--disable-grpc", "--dtype", args.dtype, "--log-level", "warning",
        "--skip-warmup",
        # A long prefill on a loaded 2-core machine can take longer than the default.
        "--watchdog-timeout", "600",
    ]  # fmt: skip
    pool = args.decode_max_total_tokens if mode == "decode" else args.max_total_tokens
    cmd += ["--max-total-tokens", str(pool)]
    if mode != "null":
        cmd += ["--disaggregation-mode", mode]
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if mode == "decode" and args.local_prefill_max_tokens:
        cmd.append("--disaggregation-decode-local-prefill")
    if args.smoke:
        cmd.append("--lazy-kv-pool")
    return cmd + shlex.split(args.server_args)


def router_cmd(port: int, workers: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "cadence.router", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--health-check-startup-interval-secs", "0.1", *workers,
    ]  # fmt: skip


def launch(fleet: Fleet, args, setup: str) -> list[tuple[str, str]]:
    """Starts one setup's processes; (name, url) of each, the one the clients use last."""
    url = lambda port: f"http://127.0.0.1:{port}"  # noqa: E731
    if setup == "colocated":
        port = free_port()
        fleet.spawn(
            "colocated", server_cmd(args, port), args.colocated_cpus, args.colocated_threads
        )
        started = [("colocated", url(port))]
        if args.colocated_router:
            rport = free_port()
            fleet.spawn("colocated_router", router_cmd(rport, ["--worker-urls", url(port)]))
            started.append(("colocated_router", url(rport)))
        return started
    ports, bootstrap = (free_port(), free_port(), free_port()), free_port()
    fleet.spawn("prefill", server_cmd(args, ports[0], "prefill", bootstrap), args.prefill_cpus)
    fleet.spawn("decode", server_cmd(args, ports[1], "decode", bootstrap), args.decode_cpus)
    pd = ["--pd-disaggregation", "--prefill", url(ports[0]), str(bootstrap)]
    if args.local_prefill_max_tokens:
        pd += ["--pd-local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    fleet.spawn(
        "pd_router", router_cmd(ports[2], [*pd, "--decode", url(ports[1])]), args.router_cpus
    )
    return [("prefill", url(ports[0])), ("decode", url(ports[1])), ("pd_router", url(ports[2]))]


# -- the mixed workload --------------------------------------------------------------------


class Window:
    """What the clients saw inside the measured window [t0, t1) (perf_counter seconds)."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.gaps: list[float] = []  # between a short stream's consecutive events
        self.tokens = 0  # completion tokens streamed, every stream
        self.ttfts: list[float] = []  # long prompts sent in the window
        self.long_sent = self.long_unanswered = self.short_done = 0
        self.events = 0
        self.errors: list[str] = []
        self.open: dict[int, float] = {}  # stream -> when its current wait began

    def has(self, t: float) -> bool:
        return self.t0 <= t < self.t1


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


async def stream(session, url: str, ids: list[int], max_new_tokens: int):
    """(arrival perf_counter, completion tokens so far) of each event of a streamed greedy
    native /generate."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": True,
    }
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the stream ended in an error: {event['error']}")
                yield now, event["meta_info"]["completion_tokens"]


async def short_client(session, url: str, args, i: int, w: Window) -> None:
    rng = random.Random(1000 + i)
    while True:
        prev_t, prev_n = None, 0
        w.open[i] = time.perf_counter()  # waiting since: its first token, then each next
        try:
            async for t, n in stream(session, url, random_ids(rng, args.short_tokens),
                                     args.short_new_tokens):  # fmt: skip
                if w.has(t):
                    w.events += 1
                    w.tokens += n - prev_n
                if prev_t is not None and (w.has(t) or w.has(prev_t)):
                    w.gaps.append(t - prev_t)  # a gap that ends after the window counts too
                prev_t, prev_n = t, n
                w.open[i] = t
            w.open.pop(i, None)
            w.short_done += w.has(time.perf_counter())
        except Exception as e:  # counted, never a silent end of the stream
            w.errors.append(f"short: {type(e).__name__}: {e}")
            await asyncio.sleep(0.2)


async def long_request(session, url: str, args, k: int, w: Window) -> None:
    sent, first, prev_n = time.perf_counter(), None, 0
    counted = w.has(sent)
    w.long_sent += counted
    try:
        ids = random_ids(random.Random(k), args.long_tokens)  # its own: no prefix cache hit
        async for t, n in stream(session, url, ids, args.long_new_tokens):
            if first is None:
                first = t
                if counted:
                    w.ttfts.append(t - sent)
            w.tokens += (n - prev_n) * w.has(t)
            prev_n = n
    except asyncio.CancelledError:
        if counted and first is None:  # not answered in time: a lower bound
            w.ttfts.append(time.perf_counter() - sent)
            w.long_unanswered += 1
        raise
    except (RuntimeError, aiohttp.ClientError) as e:
        w.errors.append(f"long: {e}")


async def mixed_workload(url: str, args) -> Window:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm = Window(0, 0)  # one of each, unmeasured: first-request costs are paid here
        await long_request(session, url, args, -1, warm)
        async for _ in stream(session, url, random_ids(random.Random(-1), args.short_tokens), 4):
            pass
        if warm.errors:
            raise RuntimeError(f"the warm-up request failed: {warm.errors[0]}")
        start = time.perf_counter()
        w = Window(start + args.warmup, start + args.warmup + args.duration)
        shorts = [asyncio.create_task(short_client(session, url, args, i, w))
                  for i in range(args.streams)]  # fmt: skip
        longs, k = [], 0
        while time.perf_counter() < w.t1:  # open loop: one every --long-every seconds
            longs.append(asyncio.create_task(long_request(session, url, args, k, w)))
            k += 1
            await asyncio.sleep(max(0.0, start + k * args.long_every - time.perf_counter()))
        pending = [t for t in longs if not t.done()]
        if pending:  # the short streams go on: the last long prompts meet the same load
            await asyncio.wait(pending, timeout=args.drain)
        for task in shorts + longs:
            task.cancel()
        await asyncio.gather(*shorts, *longs, return_exceptions=True)
        # A stream stalled when the run ends: its open wait counts, up to the window's end
        # (a server whose decode starves behind prefills shows as such, not as no figure).
        w.gaps += [w.t1 - since for since in w.open.values() if since < w.t1]
    return w


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def figures(w: Window, duration: float) -> dict:
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return {
        "itl_p99_ms": ms(percentile(w.gaps, 99)),
        "itl_p50_ms": ms(percentile(w.gaps, 50)),
        "ttft_p50_ms": ms(percentile(w.ttfts, 50)),
        "tok_s": w.tokens / duration,
        "tokens_per_event": w.tokens / max(1, w.events),
        "long_sent": w.long_sent,
        "long_unanswered": w.long_unanswered,
        "short_done": w.short_done,
        "errors": len(w.errors),
    }


async def run_setup(fleet: Fleet, args, setup: str, started: list[tuple[str, str]]) -> dict:
    """Waits for a setup's processes, runs the workload through its front, stops them."""
    try:
        for name, url in started:
            await fleet.wait_ready(name, url)
        log(f"{setup}: up (logs in {fleet.logdir}); {args.warmup:g} s warm-up, "
            f"{args.duration:g} s measured")  # fmt: skip
        w = await mixed_workload(started[-1][1], args)
    finally:
        fleet.stop(*(name for name, _ in reversed(started)))
    for error in w.errors[:3]:
        log(f"{setup}: {error}")
    if w.long_unanswered:
        log(f"{setup}: {w.long_unanswered} of {w.long_sent} long prompts got no token within "
            f"--drain {args.drain:g} s: the prompts arrive faster than they are computed")  # fmt: skip
    result = figures(w, args.duration)
    log(f"{setup}: ITL p99 {result['itl_p99_ms'] or 0:.1f} ms, TTFT p50 "
        f"{result['ttft_p50_ms'] or 0:.0f} ms, {result['tok_s']:.0f} tok/s, "
        f"{result['errors']} errors")  # fmt: skip
    return result


# -- report --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def derive(res: dict) -> None:
    res["transfer_vs_memcpy"] = ratio(res["kv_transfer_gb_s"], res["memcpy_gb_s"])
    res["itl_p99_pd_vs_colocated"] = ratio(res["itl_p99_ms_pd"], res["itl_p99_ms_colocated"])
    res["ttft_p50_pd_vs_colocated"] = ratio(res["ttft_p50_ms_pd"], res["ttft_p50_ms_colocated"])
    res["tok_s_pd_vs_colocated"] = ratio(res["tok_s_pd"], res["tok_s_colocated"])


def verdict(value: float | None, target: float, at_least: bool) -> str:
    if value is None:
        return "n/a"
    return "MET" if (value >= target if at_least else value <= target) else "NOT MET"


def report(res: dict) -> None:
    print("| figure | value |\n|---|---:|")
    for key, value in res.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        ("transfer_vs_memcpy", TARGET_TRANSFER_VS_MEMCPY, True, ">="),
        ("itl_p99_pd_vs_colocated", TARGET_ITL_P99_PD_VS_COLOCATED, False, "<="),
        ("tok_s_pd_vs_colocated", TARGET_TOK_S_PD_VS_COLOCATED, True, ">="),
    ]
    print()
    for key, target, at_least, op in lines:
        value = res[key]
        print(f"{key}: {fmt(value)}x (target {op} {target}x) {verdict(value, target, at_least)}")
    for setup in ("colocated", "pd"):
        if res[f"long_unanswered_{setup}"]:
            print(f"  note: {setup}: {res[f'long_unanswered_{setup}']} of "
                  f"{res[f'long_sent_{setup}']} long prompts got no token within --drain: TTFT p50 "
                  "is a lower bound (queueing); a larger --long-every measures a steady state")  # fmt: skip
    print(f"  KV transfer {fmt(res['kv_transfer_gb_s'])} GB/s, memcpy {fmt(res['memcpy_gb_s'])} "
          f"GB/s ({res['transfer_tokens'][0]} tokens); ITL p99 {fmt(res['itl_p99_ms_pd'])} ms "
          f"disaggregated, {fmt(res['itl_p99_ms_colocated'])} ms colocated; TTFT p50 "
          f"{fmt(res['ttft_p50_ms_pd'])} / {fmt(res['ttft_p50_ms_colocated'])} ms; "
          f"{fmt(res['tok_s_pd'])} / {fmt(res['tok_s_colocated'])} tok/s")  # fmt: skip


def plot(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = [
        ("ITL p99 of the streams (ms)", "itl_p99_ms"),
        ("TTFT p50 of the long prompts (ms)", "ttft_p50_ms"),
        ("completion tok/s", "tok_s"),
    ]
    for ax, (title, key) in zip(axes, panels):
        values = [res[f"{key}_colocated"] or 0, res[f"{key}_pd"] or 0]
        ax.bar(["colocated", "disaggregated"], values, color=["#999999", "#2a7ab0"])
        ax.set_title(title, fontsize=10)
    ax = axes[3]
    sizes = res["transfer_tokens"]
    xs = range(len(sizes))
    ax.bar([x - 0.2 for x in xs], [res[f"memcpy_gb_s_{t}tok"] for t in sizes], 0.4,
           label="memcpy", color="#999999")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [res[f"kv_transfer_gb_s_{t}tok"] for t in sizes], 0.4,
           label="KV transfer (shm)", color="#2a7ab0")  # fmt: skip
    ax.set_xticks(list(xs), [f"{t} tokens" for t in sizes])
    ax.set_title("GB/s", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"PD disaggregation: {res['streams']} streams + a {res['long_tokens']}-token prompt every "
        f"{res['long_every_s']:g} s ({os.cpu_count()} CPUs)",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


async def gather(coros) -> None:
    await asyncio.gather(*coros)


def measure(args) -> dict:
    """The transfer, then each setup. A full run starts each setup once the last has
    stopped, after the transfer, so that nothing competes; --smoke starts everything at
    once and measures in turn, so that the servers load while the transfer runs."""
    fleet = Fleet()
    res: dict = {"local_prefill_max_tokens": args.local_prefill_max_tokens}
    try:
        started = {s: launch(fleet, args, s) for s in ("colocated", "pd")} if args.smoke else {}
        log(f"KV transfer: {args.transfer_tokens} tokens, {args.transfer_repeats} repeats")
        res.update(transfer_figures(args))
        if started:  # nothing is measured while another process still loads
            ready = [fleet.wait_ready(*proc) for procs in started.values() for proc in procs]
            asyncio.run(gather(ready))
        for setup in ("colocated", "pd"):
            procs = started.pop(setup, None) or launch(fleet, args, setup)
            for key, value in asyncio.run(run_setup(fleet, args, setup, procs)).items():
                res[f"{key}_{setup}"] = value
    finally:
        fleet.stop()
    return res


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--json", help="write the figures as one flat JSON object here")
    add("--plot", default="bench_results/bench_pd.png")
    add("--dtype", default="float32")
    add("--page-size", type=int, default=16, help="of the transfer's pools (the servers' default)")
    add("--transfer-tokens", type=int, nargs="+", default=[2000, 8000])
    add("--transfer-repeats", type=int, default=5)
    add("--duration", type=float, default=30.0, help="measured seconds of each setup")
    add("--warmup", type=float, default=3.0, help="seconds of load before the window")
    add("--drain", type=float, default=15.0,
        help="seconds the long prompts sent in the window may still take to answer")  # fmt: skip
    add("--streams", type=int, default=16)
    add("--short-tokens", type=int, default=20)
    add("--short-new-tokens", type=int, default=64)
    add("--long-tokens", type=int, default=2000)
    add("--long-new-tokens", type=int, default=8)
    add("--long-every", type=float, default=1.0, help="seconds between long prompts")
    add("--max-total-tokens", type=int, default=16384,
        help="the pool of the colocated and the prefill server (queued requests hold none)")  # fmt: skip
    add("--decode-max-total-tokens", type=int, default=None,
        help="the decode server's pool; it takes pages for a request when the request "
             "arrives, before its prompt is computed: by default enough for every long "
             "prompt the run sends and every stream")  # fmt: skip
    add("--local-prefill-max-tokens", type=int, default=256,
        help="the PD router's --pd-local-prefill-max-tokens: prompts this short are "
        "prefilled by the decode server (conditional disaggregation); 0: every prompt goes "
        "to the prefill server")  # fmt: skip
    add("--prefill-cpus", default="0", help="taskset list of the prefill server")
    add("--decode-cpus", default="1", help="taskset list of the decode server")
    add("--router-cpus", default="", help="taskset list of the PD router (default: unpinned)")
    add("--colocated-threads", type=int, default=0,
        help="CADENCE_NUM_THREADS of the colocated server (default: one per core); its "
             "threads wait for each other, so a core shared with the clients or anyone "
             "else slows all of them")  # fmt: skip
    add("--colocated-router", action="store_true",
        help="put a router (normal mode) in front of the colocated server too")  # fmt: skip
    add("--server-args", default="", help="extra flags for every server")
    add("--smoke", action="store_true",
        help="seconds per phase for CI: 4 streams, a 100-token prompt, small transfers, "
             "every process started at once with --lazy-kv-pool")  # fmt: skip
    args = parser.parse_args()
    if args.smoke:
        args.transfer_tokens, args.transfer_repeats = [200, 400], 2
        args.duration, args.warmup, args.drain = 2.0, 0.5, 2.0
        args.streams, args.short_new_tokens, args.long_tokens, args.long_new_tokens = 4, 16, 100, 4
        args.max_total_tokens = 4096
    args.colocated_cpus = f"{args.prefill_cpus},{args.decode_cpus}"  # both setups' cores
    args.colocated_threads = args.colocated_threads or len(set(cpu_list(args.colocated_cpus)))
    if args.decode_max_total_tokens is None:
        sent = math.ceil((args.warmup + args.duration) / args.long_every) + 2
        need = sent * (args.long_tokens + args.long_new_tokens)
        need += args.streams * (args.short_tokens + args.short_new_tokens)
        args.decode_max_total_tokens = max(args.max_total_tokens, -(-need // 4096) * 4096)
    return args


def main() -> int:
    args = parse_args()
    load_start = os.getloadavg()[0]
    res = measure(args)
    res.update(
        kv_transfer_gb_s=res.pop("kv_transfer_gb_s"), memcpy_gb_s=res.pop("memcpy_gb_s"),
        transfer_tokens=args.transfer_tokens, streams=args.streams,
        short_tokens=args.short_tokens, short_new_tokens=args.short_new_tokens,
        long_tokens=args.long_tokens, long_new_tokens=args.long_new_tokens,
        long_every_s=args.long_every, duration_s=args.duration, warmup_s=args.warmup,
        drain_s=args.drain, max_total_tokens=args.max_total_tokens,
        decode_max_total_tokens=args.decode_max_total_tokens,
        prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
        router_cpus=args.router_cpus or "unpinned", colocated_router=args.colocated_router,
        colocated_cpus=args.colocated_cpus, colocated_threads=args.colocated_threads,
        cpu_count=os.cpu_count(), load_avg_start=load_start, load_avg_end=os.getloadavg()[0],
    )  # fmt: skip
    derive(res)
    report(res)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.plot:
        plot(args.plot, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
