"""Served throughput and latency over HTTP, next to the offline engine on the same work.

One run, one dtype, one machine:
  - served: `cadence serve` is launched; at each concurrency C (default 1, 8, 32), C aiohttp
    clients each stream /generate requests back to back (closed loop) from a fixed mix of
    prompts and output lengths (EOS ignored, so every request produces exactly its length).
    Reported: output tokens/s over the level's wall time, TTFT and inter-token latency
    (p50, p99; a chunk carrying k tokens counts as k gaps of 1/k of its delay).
  - limit: the in-process `Engine` (same dtype, same max running requests) runs the same
    requests with the same closed-loop concurrency, after the server has stopped so the two
    never compete (--smoke loads it while the server starts; it idles until then). Target
    (issue 3): served tok/s at C=32 >= 0.9x offline.

Each level is measured served then offline (a fresh server and engine per level), so that a
pair shares the load of the moment on a shared machine; the 1-minute load average at each
measurement is reported next to it.

Both sides get the OpenMP wait settings `cadence serve` gives its children (see
cadence/envs.py) unless the environment sets them, so they differ only by the serving path.

Usage: python benchmarks/bench_serving.py [--concurrency 1 8 32] [--json out.json]
       [--plot bench_results/bench_serving.png] [--dtype float32] [--smoke]
Not a test: timings on shared machines are noisy. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import os

from cadence import envs  # noqa: E402

envs.set_openmp_defaults()  # as `cadence serve` gives its children; before anything loads OpenMP

import argparse
import asyncio
import dataclasses
import itertools
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
import numpy as np

# A fixed mix: prompts of a few to ~200 tokens, cycled against output lengths.
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain, step by step, how a bicycle gear system works and why lower gears make climbing easier.",
    "Summarize the plot of a detective story set in a lighthouse. " * 6,
    "List ten practical tips for keeping a vegetable garden healthy through a dry summer, "
    "with one sentence of explanation for each tip, and end with a short checklist. " * 4,
    "Translate to French: The train leaves at noon and arrives in the evening.",
]
OUTPUT_LENS = [32, 64, 128, 96]
TARGET_RATIO = 0.9


def log(msg: str) -> None:
    print(f"[bench_serving] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Work:
    prompt: str
    max_new_tokens: int


def workload(num_requests: int, output_lens: list[int] | None = None) -> list[Work]:
    mix = itertools.cycle(itertools.product(PROMPTS, output_lens or OUTPUT_LENS))
    return [Work(p, n) for p, n in itertools.islice(mix, num_requests)]


def num_requests_for(concurrency: int, per_client: int, least: int = 8) -> int:
    return max(least, per_client * concurrency)


@dataclasses.dataclass
class ReqStats:
    output_tokens: int
    ttft: float  # seconds from send to the first token
    itls: list[float]  # seconds between tokens
    latency: float


def summarize(stats: list[ReqStats], wall: float) -> dict:
    itls = [x for s in stats for x in s.itls]
    ttfts = [s.ttft for s in stats]
    return {
        "tok_s": sum(s.output_tokens for s in stats) / wall,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) * 1e3,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) * 1e3,
        "itl_p50_ms": float(np.percentile(itls, 50)) * 1e3,
        "itl_p99_ms": float(np.percentile(itls, 99)) * 1e3,
        "e2e_p50_ms": float(np.percentile([s.latency for s in stats], 50)) * 1e3,
        "num_requests": len(stats),
        "output_tokens": sum(s.output_tokens for s in stats),
        "wall_s": wall,
    }


async def closed_loop(work: list[Work], concurrency: int, run_one) -> tuple[list[ReqStats], float]:
    """`concurrency` workers take the next request as soon as their last one finished."""
    queue: asyncio.Queue[Work] = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    stats: list[ReqStats] = []

    async def worker():
        while not queue.empty():
            stats.append(await run_one(queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats, time.perf_counter() - start


def token_times(send: float, arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """TTFT and per-token gaps from (arrival time, tokens in chunk) pairs."""
    arrivals = [(t, k) for t, k in arrivals if k > 0]
    ttft = arrivals[0][0] - send
    itls = []
    for (prev, _), (now, k) in zip(arrivals, arrivals[1:]):
        itls += [(now - prev) / k] * k
    return ttft, itls


def level_work(args, concurrency: int) -> list[Work]:
    """The requests of one level: --requests-per-client each, at least 8 (or --least)."""
    n = num_requests_for(concurrency, args.requests_per_client, args.least_requests)
    return workload(n, args.output_lens)


# ---- served ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(args, port: int, log_path: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "cadence.launch_server",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-running-requests",
        str(args.max_running_requests),
        "--log-level",
        "warning",
    ]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    cmd += ["--grpc-port", str(free_port())]  # not the default port: others may hold it
    cmd += shlex.split(args.server_args)  # later flags win
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def save_figures(flat: dict, args, plot_fn) -> None:
    """A benchmark's figures as JSON at --json and its chart at --plot (`plot_fn(flat, args,
    path)`), where asked for."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(flat, f, indent=2)
    if getattr(args, "plot", None):
        plot_fn(flat, args, args.plot)
        print(f"plot: {args.plot}")


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to a server launched in its own session (it and its children), SIGKILL if it
    has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError("the server did not become healthy in time")


async def streams_cumulative(url: str) -> bool:
    """Whether the server's /generate stream events carry everything so far (SGLang's default,
    and Cadence's) rather than only what is new (`--incremental-streaming-output`)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/server_info") as r:
            r.raise_for_status()
            return not (await r.json()).get("incremental_streaming_output", False)


async def served_level(
    url: str, work: list[Work], concurrency: int, cumulative: bool = True
) -> tuple[list[ReqStats], float]:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def run_one(w: Work) -> ReqStats:
            body = {
                "text": w.prompt,
                "stream": True,
                "sampling_params": {
                    "max_new_tokens": w.max_new_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            }
            arrivals: list[tuple[float, int]] = []
            seen = 0  # output ids so far: a cumulative event's new tokens are those past it
            send = time.perf_counter()
            async with session.post(url + "/generate", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    ids = json.loads(line[6:])["output_ids"]
                    new = len(ids) - seen if cumulative else len(ids)
                    seen += new
                    arrivals.append((time.perf_counter(), new))
            done = time.perf_counter()
            n = sum(k for _, k in arrivals)
            if n != w.max_new_tokens:
                raise RuntimeError(f"expected {w.max_new_tokens} tokens, streamed {n}")
            ttft, itls = token_times(send, arrivals)
            return ReqStats(n, ttft, itls, done - send)

        return await closed_loop(work, concurrency, run_one)


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """`cadence serve` launched (not yet healthy): its process, URL and log path."""
    port = free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="bench-serving-"), "server.log")
    log(f"launching cadence serve on :{port} (log: {log_path})")
    return launch_server(args, port, log_path), f"http://127.0.0.1:{port}", log_path


async def bench_served(args, levels: list[int], server=None) -> dict:
    """The served levels, on `server` (from start_server) or one launched here; it is stopped
    when done."""
    proc, url, log_path = server or start_server(args)
    results = {}
    try:
        await wait_healthy(url, proc)
        cumulative = await streams_cumulative(url)
        log("served: warm-up")
        await served_level(url, workload(4, args.output_lens), 4, cumulative)
        for c in levels:
            work = level_work(args, c)
            log(f"served: concurrency {c}, {len(work)} requests")
            load = os.getloadavg()[0]
            stats, wall = await served_level(url, work, c, cumulative)
            results[c] = {**summarize(stats, wall), "loadavg": load}
            log(f"served: c={c} {results[c]['tok_s']:.1f} tok/s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log(f"server stopped (exit code {proc.returncode})")
    if proc.returncode == 0:
        shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)
    return results


# ---- offline -----------------------------------------------------------------------------


async def offline_level(engine, work: list[Work], concurrency: int) -> tuple[list[ReqStats], float]:
    async def run_one(w: Work) -> ReqStats:
        params = {"max_new_tokens": w.max_new_tokens, "ignore_eos": True, "temperature": 0}
        arrivals: list[tuple[float, int]] = []
        send = time.perf_counter()
        async for chunk in engine.async_generate(w.prompt, params, stream=True):
            arrivals.append((time.perf_counter(), len(chunk["output_ids"])))
        n = sum(k for _, k in arrivals)
        if n != w.max_new_tokens:
            raise RuntimeError(f"expected {w.max_new_tokens} tokens, got {n}")
        ttft, itls = token_times(send, arrivals)
        return ReqStats(n, ttft, itls, time.perf_counter() - send)

    return await closed_loop(work, concurrency, run_one)


def load_engine(args):
    from cadence import Engine

    log("offline: loading the engine")
    return Engine(
        model_path=args.model_path, dtype=args.dtype, max_running_requests=args.max_running_requests
    )


async def bench_offline(args, levels: list[int], engine=None) -> tuple[dict, int]:
    """The offline levels, on `engine` (from load_engine) or one loaded here; it is shut
    down when done."""
    import torch

    engine = engine or load_engine(args)
    results = {}
    try:
        log("offline: warm-up")
        await offline_level(engine, workload(4, args.output_lens), 4)
        for c in levels:
            work = level_work(args, c)
            log(f"offline: concurrency {c}, {len(work)} requests")
            load = os.getloadavg()[0]
            stats, wall = await offline_level(engine, work, c)
            results[c] = {**summarize(stats, wall), "loadavg": load}
            log(f"offline: c={c} {results[c]['tok_s']:.1f} tok/s")
    finally:
        engine.shutdown()
    return results, torch.get_num_threads()


def measure_levels(args, levels: list[int]) -> tuple[dict, dict, int]:
    """Served, then offline, with a server and an engine of their own. --smoke launches the
    server first and loads the engine while it starts (the engine idles while the server is
    measured, and the server is gone when the engine is)."""
    server = start_server(args) if args.smoke else None
    try:
        engine = load_engine(args) if args.smoke else None
    except BaseException:
        os.killpg(server[0].pid, signal.SIGKILL)
        raise
    try:
        served = asyncio.run(bench_served(args, levels, server))
    except BaseException:
        if engine is not None:
            engine.shutdown()
        raise
    offline, threads = asyncio.run(bench_offline(args, levels, engine))
    return served, offline, threads


# ---- report ------------------------------------------------------------------------------


def flatten(served: dict, offline: dict, args, threads: int) -> dict:
    flat = {
        "dtype": args.dtype,
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "concurrency": list(args.concurrency),
        "output_lens": args.output_lens,
        "target_ratio": TARGET_RATIO,
    }
    for c in args.concurrency:
        s, o = served[c], offline[c]
        flat.update(
            {
                f"served_tok_s_c{c}": s["tok_s"],
                f"offline_tok_s_c{c}": o["tok_s"],
                f"served_over_offline_c{c}": s["tok_s"] / o["tok_s"],
                f"num_requests_c{c}": s["num_requests"],
                f"output_tokens_c{c}": s["output_tokens"],
            }
        )
        flat[f"loadavg_served_c{c}"], flat[f"loadavg_offline_c{c}"] = s["loadavg"], o["loadavg"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"):
            flat[f"{key}_c{c}"] = s[key]
            flat[f"offline_{key}_c{c}"] = o[key]
    return flat


def print_table(flat: dict, concurrency: list[int]) -> None:
    print(
        f"\nCadence serving, dtype={flat['dtype']}, threads={flat['threads']}, "
        f"OMP_WAIT_POLICY={flat['omp_wait_policy']}, GOMP_SPINCOUNT={flat['gomp_spincount']}, output lengths {flat['output_lens']}"
    )
    print(
        f"{'C':>4} {'served tok/s':>13} {'offline tok/s':>14} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}   (ms; offline TTFT p50 / ITL p50; load avg served / offline)"
    )
    for c in concurrency:
        g = lambda k: flat[f"{k}_c{c}"]  # noqa: E731
        print(
            f"{c:>4} {g('served_tok_s'):13.1f} {g('offline_tok_s'):14.1f} {g('served_over_offline'):6.2f} "
            f"{g('ttft_p50_ms'):9.1f} {g('ttft_p99_ms'):9.1f} {g('itl_p50_ms'):8.1f} {g('itl_p99_ms'):8.1f}"
            f"   ({g('offline_ttft_p50_ms'):.1f} / {g('offline_itl_p50_ms'):.1f}; "
            f"{g('loadavg_served'):.1f} / {g('loadavg_offline'):.1f})"
        )
    top = max(concurrency)
    ratio = flat[f"served_over_offline_c{top}"]
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(f"target: served >= {TARGET_RATIO}x offline at C={top}: {ratio:.2f}x ({verdict} it)")


def plot(flat: dict, concurrency: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(
        concurrency,
        [flat[f"served_tok_s_c{c}"] for c in concurrency],
        "o-",
        label="served (HTTP, streaming)",
    )
    ax1.plot(
        concurrency,
        [flat[f"offline_tok_s_c{c}"] for c in concurrency],
        "s--",
        label="offline Engine",
    )
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("Throughput")
    ax1.set_ylim(bottom=0)
    for key, style in (
        ("ttft_p50_ms", "o-"),
        ("ttft_p99_ms", "o:"),
        ("itl_p50_ms", "s-"),
        ("itl_p99_ms", "s:"),
    ):
        name, pct = key.removesuffix("_ms").split("_")
        ax2.plot(
            concurrency,
            [flat[f"{key}_c{c}"] for c in concurrency],
            style,
            label=f"{name.upper()} {pct}",
        )
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("ms")
    ax2.set_title("Served latency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"cadence serve vs offline Engine ({flat['dtype']}, {flat['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=2,
        help="requests per level: max(8, this x concurrency)",
    )
    parser.add_argument("--least-requests", type=int, default=8, help="fewest requests in a level")
    parser.add_argument(
        "--output-lens",
        type=int,
        nargs="+",
        default=OUTPUT_LENS,
        help="output lengths, cycled against the prompts",
    )
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument(
        "--server-args", default="", help="extra flags for the server, e.g. '--lazy-kv-pool'"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the whole path at the smallest size, for CI: C=2, 4 requests of 4 and 8 tokens, "
        "a server with --lazy-kv-pool --skip-warmup (no start-up step at full size, no warm-up "
        "request but the benchmark's own), the engine loaded while the server starts",
    )
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure served and offline level by level (a server and an engine per level)",
    )
    parser.add_argument("--json", default=None, help="write the results as one flat JSON object")
    parser.add_argument("--plot", default="bench_results/bench_serving.png")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.requests_per_client, args.least_requests = [2], 2, 4
        args.output_lens = [4, 8]
        args.server_args += " --lazy-kv-pool --skip-warmup"
    args.concurrency = sorted(set(args.concurrency))

    served, offline = {}, {}
    # Level by level, served then offline, so that each pair shares the machine's load of the
    # moment (other tenants come and go); --no-interleave measures all served levels first.
    groups = [[c] for c in args.concurrency] if args.interleave else [args.concurrency]
    for levels in groups:
        more_served, more_offline, threads = measure_levels(args, levels)
        served.update(more_served)
        offline.update(more_offline)
    flat = flatten(served, offline, args, threads)
    print_table(flat, args.concurrency)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(flat, f, indent=2)
        print(f"json: {args.json}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(flat, args.concurrency, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
