"""Served embeddings/s of all-MiniLM-L6-v2 over HTTP, next to the model's own forward pass
(the limit) and sentence-transformers (the peer), on the same 32-sentence batches.

- limit: the encoder's forward pass and pooling alone, in process (Cadence's EncoderRunner,
  inputs tokenized beforehand), one 32-sentence batch after another.
- limit_budget: the same forward pass on the same inputs regrouped as the scheduler groups
  queued requests (up to its 2,048-token budget per step): the ceiling of served at high
  concurrency, where requests queue and one step runs several of them.
- peer: sentence-transformers' `SentenceTransformer.encode` on the same batches (its own
  tokenization, padding and pooling; batch_size 32), in process.
- served: `cadence serve --model-path <MiniLM>`; clients post the batches to /v1/embeddings
  (base64, what the openai client asks for by default) at concurrency 1, 8 and 32, each
  client one request at a time. Embeddings/s over the wall time of each run.

Each is also given per second of CPU time (`*_emb_cpu_s`: the bench process's for the limit
and the peer, the server's processes' together for served; the clients' excluded): on a
shared, loaded machine wall time measures the neighbours as much as the code, CPU time much
less so.

The sentences mix short queries and longer passages, as retrieval traffic does. Targets
(issue 16): served at concurrency 32 >= 0.8x the limit and >= 1.5x sentence-transformers.

Each figure is measured `--rounds` times, interleaved with the others, and the median kept.

Usage: python benchmarks/bench_embeddings.py [--json out.json] [--plot out.png]
       [--seconds 10] [--rounds 3] [--batches 16] [--smoke]
Not a test: timings on a shared machine are noisy (the load average is reported with them).
Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

from cadence import envs  # noqa: E402

envs.set_openmp_defaults()  # as `cadence serve` gives its children

import argparse
import asyncio
import base64
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

BATCH = 32
CONCURRENCY = (1, 8, 32)

QUERIES = [
    "how do solar panels work",
    "best way to learn a new language",
    "symptoms of vitamin d deficiency",
    "what is the capital of australia",
    "how long to boil an egg",
    "python list comprehension example",
    "why is the sky blue",
    "train times from paris to lyon",
    "how to reset a router",
    "difference between weather and climate",
    "who wrote pride and prejudice",
    "cheap flights to lisbon in may",
    "how many bones are in the human body",
    "what causes inflation",
    "recipe for banana bread",
    "how to change a flat tire",
]
PASSAGES = [
    "Solar panels are made of photovoltaic cells that turn sunlight into direct current, which "
    "an inverter then converts into the alternating current used by homes.",
    "Canberra is the capital city of Australia; it was chosen as a compromise between Sydney "
    "and Melbourne and was built as a planned city in the early twentieth century.",
    "The sky looks blue because molecules in the air scatter short blue wavelengths of "
    "sunlight much more than the longer red ones.",
    "Inflation happens when the general level of prices rises, often because demand grows "
    "faster than supply or because the costs of production increase.",
    "An adult human skeleton usually has 206 bones, while a newborn has close to 300, many of "
    "which fuse together during childhood.",
    "Pride and Prejudice is a novel by Jane Austen, first published in 1813, that follows "
    "Elizabeth Bennet as she deals with manners, upbringing and marriage.",
    "To change a flat tire, loosen the lug nuts, raise the car with a jack, swap the wheel "
    "for the spare and tighten the nuts in a star pattern.",
    "Weather describes the short-term state of the atmosphere, while climate is the average "
    "of weather patterns over decades.",
    "Mash three ripe bananas, mix them with melted butter, sugar, an egg and flour, then bake "
    "the batter for about an hour at 175 degrees.",
    "List comprehensions build a new list by applying an expression to every item of an "
    "iterable, optionally filtered by a condition.",
    "A hard-boiled egg needs about ten minutes in boiling water; a soft-boiled one about six.",
    "Vitamin D deficiency can cause tiredness, bone pain, muscle weakness and low mood.",
    "Unplug the router, wait thirty seconds and plug it back in; for a factory reset, hold "
    "the reset button for ten seconds.",
    "High-speed trains connect Paris and Lyon in about two hours, with departures every hour "
    "from the Gare de Lyon.",
    "Learning a language works best with daily practice, conversations with native speakers "
    "and plenty of listening.",
    "Lisbon is served by many low-cost airlines, and fares in spring are usually lower "
    "midweek than at weekends.",
]


def log(msg: str) -> None:
    print(f"[bench_embeddings] {msg}", file=sys.stderr, flush=True)


def batches(count: int, size: int = BATCH) -> list[list[str]]:
    """`count` batches of `size` sentences drawn from the queries and passages (a fixed seed),
    so that batches differ in their mix of lengths."""
    rng = random.Random(0)
    pool = QUERIES + PASSAGES
    return [rng.choices(pool, k=size) for _ in range(count)]


# -- the limit and the peer (in process) -----------------------------------------------------


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) of every live process in process group `pgid` (Linux)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[0] is the state; pgrp is the third after ")"
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def timed(fn, work: list, seconds: float) -> tuple[float, float]:
    """Embeddings/s of fn over `work` (batches), cycled for about `seconds`: per second of
    wall time and per second of this process's CPU time."""
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for batch in work:
            fn(batch)
            done += len(batch)
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def limit_fn(path: str, work: list[list[str]]):
    """The encoder's forward pass and pooling on pre-tokenized batches, and those batches."""
    from cadence.model_executor.encoder_runner import EncoderRunner
    from cadence.model_executor.runner import EmbedItem
    from cadence.model_loader.tokenizer_files import load_tokenizer
    from cadence.server_args import ServerArgs

    runner = EncoderRunner(ServerArgs(model_path=path, dtype="float32"), path)
    tokenizer = load_tokenizer(path)
    items = [[EmbedItem(str(i), tokenizer(s)["input_ids"]) for i, s in enumerate(b)] for b in work]
    runner.embed(items[0])  # warm-up
    return runner.embed, items


def budget_batches(items: list[list], budget: int) -> list[list]:
    """The same inputs regrouped as the scheduler groups them when requests queue up: in
    order, as many as `budget` tokens take (at least one)."""
    out: list[list] = [[]]
    num_tokens = 0
    for item in (item for batch in items for item in batch):
        n = len(item.token_ids)
        if out[-1] and num_tokens + n > budget:
            out.append([])
            num_tokens = 0
        out[-1].append(item)
        num_tokens += n
    return out


def peer_fn(path: str, work: list[list[str]]):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    encode = lambda batch: model.encode(batch, batch_size=BATCH)  # noqa: E731
    encode(work[0])  # warm-up
    return encode, work


# -- served ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(path: str, port: int, log_path: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--model-path", path,
        "--port", str(port), "--grpc-port", str(free_port()), "--log-level", "warning",
        "--max-embedding-batch", str(BATCH), "--watchdog-timeout", "600",
    ]  # fmt: skip
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def wait_healthy(session, url: str, proc, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
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


async def serve_run(
    url: str, work, concurrency: int, seconds: float, pgid: int
) -> tuple[float, float]:
    """Embeddings/s with `concurrency` clients posting batches one at a time: per second of
    wall time and per second of the server's CPU time (all its processes; not the clients').

    Connections of their own: kept-alive ones from an earlier run sit idle through the
    in-process figures, past the server's keep-alive timeout, and one closing as a request
    goes out fails it."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await _serve_run(session, url, work, concurrency, seconds, pgid)


async def _serve_run(
    session, url: str, work, concurrency: int, seconds: float, pgid: int
) -> tuple[float, float]:
    done = 0
    stop_at = time.monotonic() + seconds

    async def client(offset: int):
        nonlocal done
        k = offset
        while time.monotonic() < stop_at:
            body = {"input": work[k % len(work)], "encoding_format": "base64", "model": "m"}
            async with session.post(url + "/v1/embeddings", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"/v1/embeddings answered {r.status}: {answer}")
            # What a client does with the answer: decode the vectors.
            vectors = [base64.b64decode(d["embedding"]) for d in answer["data"]]
            assert len(vectors) == len(work[k % len(work)])
            done += len(vectors)
            k += concurrency

    start, cpu = time.monotonic(), group_cpu_seconds(pgid)
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done / (time.monotonic() - start), done / (group_cpu_seconds(pgid) - cpu)


async def measure(
    path: str, work, seconds: float, rounds: int, warmup_s: float = 2.0
) -> dict[str, list[float]]:
    """Every figure measured `rounds` times, interleaved (limit, peer, served at each
    concurrency, then again), so that a shared machine's changing load falls on all of them
    alike rather than on whichever ran last."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.gettempdir(), f"bench_embeddings_{port}.log")
    proc = launch(path, port, log_path)
    runs: dict[str, list[float]] = {}
    try:
        connector = aiohttp.TCPConnector(limit=max(CONCURRENCY))
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            log("loading the limit's runner and the peer's model in process")
            from cadence.server_args import ServerArgs

            embed, items = limit_fn(path, work)
            in_process = {
                "limit_emb_s": (embed, items),
                "limit_budget_emb_s": (
                    embed,
                    budget_batches(items, ServerArgs().chunked_prefill_size),  # the default
                ),
                "st_emb_s": peer_fn(path, work),
            }
            await wait_healthy(session, url, proc)
            await serve_run(url, work, 8, warmup_s, proc.pid)  # warm-up

            def record(key: str, r: int, figures: tuple[float, float]) -> None:
                runs.setdefault(key, []).append(figures[0])
                runs.setdefault(key.replace("_emb_s", "_emb_cpu_s"), []).append(figures[1])
                log(f"round {r + 1}: {key} {figures[0]:.0f} emb/s, {figures[1]:.0f} emb/cpu-s")

            for r in range(rounds):
                for key, (fn, batches_) in in_process.items():
                    record(key, r, timed(fn, batches_, seconds))
                for c in CONCURRENCY:
                    figures = await serve_run(url, work, c, seconds, proc.pid)
                    record(f"served_emb_s_c{c}", r, figures)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    return runs


def plot(path: str, result: dict) -> None:
    """Two panels: embeddings per second of wall time, and per second of CPU time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"served\nc{c}" for c in CONCURRENCY]
    labels += ["limit\n(forward)", "limit\n(budget)", "sentence-\ntransformers"]
    colors = ["tab:blue"] * len(CONCURRENCY) + ["tab:gray", "silver", "tab:orange"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, unit, title in ((axes[0], "s", "wall time"), (axes[1], "cpu_s", "CPU time")):
        values = [result[f"served_emb_{unit}_c{c}"] for c in CONCURRENCY]
        values += [result[f"limit_emb_{unit}"], result[f"limit_budget_emb_{unit}"]]
        values.append(result[f"st_emb_{unit}"])
        ax.bar(labels, values, color=colors)
        limit, peer = result[f"limit_emb_{unit}"], result[f"st_emb_{unit}"]
        ax.axhline(0.8 * limit, color="tab:gray", linestyle="--", label="0.8x limit")
        ax.axhline(1.5 * peer, color="tab:orange", linestyle=":", label="1.5x peer")
        ax.set_ylabel(f"embeddings per second of {title}")
        ax.set_title(f"per second of {title}")
        ax.legend(loc="lower right")
    fig.suptitle(
        f"all-MiniLM-L6-v2, {result['batch_size']}-sentence batches, median of {result['rounds']} rounds "
        f"({result['cpu_count']} cores, load avg {result['load_avg_1m']:.1f})"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians kept")
    parser.add_argument("--json", help="write the figures (and every round's) as JSON here")
    parser.add_argument("--plot", default="bench_results/bench_embeddings.png")
    parser.add_argument("--batches", type=int, default=16, help="distinct 32-sentence batches")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure once, briefly (0.2 s each, 2 batches of 4 sentences, so that 32 "
        "clients' requests in flight are few embeddings): for CI",
    )
    args = parser.parse_args()
    batch_size = BATCH
    if args.smoke:
        args.seconds, args.rounds, args.batches, batch_size = 0.2, 1, 2, 4

    from cadence.model_loader.locate import embedding_model_path

    path = embedding_model_path()
    work = batches(args.batches, batch_size)
    load_before = os.getloadavg()[0]
    warmup_s = min(2.0, 2 * args.seconds)
    runs = asyncio.run(measure(path, work, args.seconds, args.rounds, warmup_s))
    result = {key: statistics.median(values) for key, values in runs.items()}
    served, limit, peer = result["served_emb_s_c32"], result["limit_emb_s"], result["st_emb_s"]
    result.update(
        served_vs_limit_c32=served / limit,
        served_vs_st_c32=served / peer,
        served_vs_limit_budget_c32=served / result["limit_budget_emb_s"],
        served_vs_limit_c32_cpu=result["served_emb_cpu_s_c32"] / result["limit_emb_cpu_s"],
        served_vs_limit_budget_c32_cpu=(
            result["served_emb_cpu_s_c32"] / result["limit_budget_emb_cpu_s"]
        ),
        served_vs_st_c32_cpu=result["served_emb_cpu_s_c32"] / result["st_emb_cpu_s"],
        batch_size=batch_size,
        rounds=args.rounds,
        seconds_per_run=args.seconds,
        load_avg_1m_before=load_before,
        load_avg_1m=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
    )
    print(f"all-MiniLM-L6-v2, {batch_size}-sentence batches, median of {args.rounds} rounds")
    print("| metric | value | runs |\n|---|---:|---|")
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"| {key} | {shown} | {' '.join(f'{v:.0f}' for v in runs.get(key, []))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "runs": runs}, f, indent=2)
    if args.plot:
        plot(args.plot, result)


if __name__ == "__main__":
    main()
