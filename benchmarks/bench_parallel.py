"""Tensor and pipeline parallel ranks against one process, at the same total threads.

Not a test. Three servers of the same GGUF (default: SmolLM2-135M-Instruct's), started
together and measured one at a time while the others idle:
  - tp1: `cadence serve`, one process, CADENCE_NUM_THREADS=2 (`--threads`);
  - tp2: `--tp-size 2`, two ranks of 1 thread each;
  - pp2: `--pp-size 2`, two stages of 1 thread each.
At each concurrency C (`--concurrency`, default 1 32) a pass starts C greedy streams at once
over native /generate (`--new-tokens` each, EOS ignored) and measures decode tok/s in the
steady window (from the last stream's first token to the first stream's end). Each repeat
(`--repeats`) measures every server once, back to back; a ratio is the median of the
repeats' ratios (this VM's speed drifts over minutes, far more than within a repeat).

All-reduce cost: two processes, as a server's ranks on one machine run them, time
`RankGroups.all_reduce_` (what a tensor-parallel layer calls, twice per layer: shared memory
between the ranks, `cadence/distributed/shm_collectives.py`) and a bare gloo
`torch.distributed.all_reduce` of the same [C, hidden] float32 tensor; µs per call, the
median of `--allreduce-calls`.

Targets (issue 31): pp2 c=32 >= 0.85x tp1; tp2 c=32 >= 0.8x tp1; tp2 c=1 >= 0.6x tp1.
Only gloo (CPU) runs here; the NCCL paths need two GPUs.
Peers: none beyond torch.distributed itself (the bare all-reduce).

Usage: python benchmarks/bench_parallel.py [--json out.json] [--plot out.png]
       [--concurrency 1 32] [--new-tokens 64] [--repeats 3] [--smoke]
Progress goes to stderr, figures to stdout. Every server it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_lora as bl  # noqa: E402
import bench_serving as bs  # noqa: E402

SETUPS = {"tp1": [], "tp2": ["--tp-size", "2"], "pp2": ["--pp-size", "2"]}
TARGETS = {"pp2_c32": 0.85, "tp2_c32": 0.8, "tp2_c1": 0.6}


def log(msg: str) -> None:
    print(f"[bench_parallel] {msg}", file=sys.stderr, flush=True)


def launch(name: str, args) -> tuple[subprocess.Popen, str]:
    port = bs.free_port()
    ranks = 1 if name == "tp1" else 2
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--port", str(port),
        "--grpc-port", str(bs.free_port()), "--log-level", "warning", "--dtype", "float32",
        "--max-running-requests", str(max(args.concurrency)), "--incremental-streaming-output",
        "--max-total-tokens", "16384", *SETUPS[name],
    ]  # fmt: skip
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if args.smoke:
        cmd.append("--lazy-kv-pool")
    env = dict(os.environ, CADENCE_NUM_THREADS=str(max(1, args.threads // ranks)))
    log_path = os.path.join(tempfile.mkdtemp(prefix=f"bench-parallel-{name}-"), "server.log")
    log(f"{name}: launching on :{port}, {ranks} rank(s) of {env['CADENCE_NUM_THREADS']} thread(s)")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    return proc, f"http://127.0.0.1:{port}"


async def measure_servers(args) -> dict:
    """{setup: {c: [tok/s per repeat]}}."""
    servers = {name: launch(name, args) for name in SETUPS}
    out: dict = {name: {c: [] for c in args.concurrency} for name in SETUPS}
    timeout = aiohttp.ClientTimeout(total=3600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for name, (proc, url) in servers.items():
                await bs.wait_healthy(url, proc, timeout=900)
                await bl.batch_pass(session, url, max(args.concurrency), args, None, seed=99)
                log(f"{name}: ready and warm")
            for r in range(args.repeats):
                for c in args.concurrency:
                    for name, (_, url) in servers.items():
                        tok_s = await bl.batch_pass(session, url, c, args, None, seed=r)
                        out[name][c].append(tok_s)
                        log(f"repeat {r + 1}: {name} c={c}: {tok_s:.1f} tok/s")
    finally:
        for proc, _ in servers.values():
            bs.stop_group(proc)
    return out


def _allreduce_rank(rank: int, addr: str, sizes: list[int], hidden: int, calls: int, q) -> None:
    import torch
    import torch.distributed as dist

    from cadence.distributed.group import RankGroups
    from cadence.distributed.layout import RankLayout

    torch.set_num_threads(1)
    groups = RankGroups(RankLayout(tp_size=2), rank, addr, "gloo", 60.0)
    groups.use_shm(max(sizes) * hidden)  # as a server's ranks on one machine do
    result = {}
    for rows in sizes:
        x = torch.zeros(rows, hidden)  # in-place sums of zeros stay finite
        for label, call in (
            ("ours", lambda: groups.all_reduce_(x)),
            ("gloo", lambda: dist.all_reduce(x, group=groups.tp_group)),
        ):
            for _ in range(50):
                call()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            result[(label, rows)] = statistics.median(times) * 1e6
    groups.close()
    if rank == 0:
        q.put(result)


def measure_allreduce(args, hidden: int = 576) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    addr = f"127.0.0.1:{bs.free_port()}"
    procs = [
        ctx.Process(
            target=_allreduce_rank,
            args=(r, addr, args.concurrency, hidden, args.allreduce_calls, q),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def flatten(served: dict, reduce: dict, args) -> dict:
    flat: dict = {"concurrency": args.concurrency, "repeats": args.repeats}
    for name, by_c in served.items():
        for c, values in by_c.items():
            flat[f"{name}_tok_s_c{c}"] = statistics.median(values)
            flat[f"{name}_tok_s_c{c}_each"] = values
            if name != "tp1":
                ratios = [x / y for x, y in zip(values, served["tp1"][c])]
                flat[f"{name}_vs_tp1_c{c}"] = statistics.median(ratios)
    c0 = args.concurrency[0]
    flat["allreduce_us"] = reduce[("ours", c0)]
    flat["gloo_allreduce_us"] = reduce[("gloo", c0)]
    for (label, rows), us in reduce.items():
        flat[f"{'allreduce' if label == 'ours' else 'gloo_allreduce'}_us_rows{rows}"] = us
    return flat


def print_report(flat: dict, args) -> None:
    print(
        f"{'setup':<6}"
        + "".join(f"{'c=' + str(c) + ' tok/s':>14}{'vs tp1':>9}" for c in args.concurrency)
    )
    for name in SETUPS:
        row = f"{name:<6}"
        for c in args.concurrency:
            ratio = flat.get(f"{name}_vs_tp1_c{c}")
            row += (
                f"{flat[f'{name}_tok_s_c{c}']:>14.1f}{'' if ratio is None else f'{ratio:.2f}x':>9}"
            )
        print(row)
    for key, target in TARGETS.items():
        name, c = key.split("_")
        ratio = flat.get(f"{name}_vs_tp1_{c}")
        if ratio is not None:
            verdict = "met" if ratio >= target else "missed"
            print(
                f"{name} {c.replace('c', 'c=')}: {ratio:.2f}x tp1 (target >= {target}x: {verdict})"
            )
    for c in args.concurrency:
        ours, bare = flat[f"allreduce_us_rows{c}"], flat[f"gloo_allreduce_us_rows{c}"]
        print(f"all-reduce [{c}, hidden] float32: ours {ours:.1f} us, bare gloo {bare:.1f} us")


def plot(flat: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(SETUPS)
    for i, name in enumerate(SETUPS):
        xs = [j + i * width for j in range(len(args.concurrency))]
        ax.bar(xs, [flat[f"{name}_tok_s_c{c}"] for c in args.concurrency], width, label=name)
    ax.set_xticks([j + width for j in range(len(args.concurrency))])
    ax.set_xticklabels([f"c={c}" for c in args.concurrency])
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("Same GGUF, same total threads: tp1 (2 threads) vs 2 ranks of 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="total threads of every setup")
    parser.add_argument("--allreduce-calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--smoke", action="store_true", help="the whole path at its smallest")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.new_tokens, args.repeats, args.allreduce_calls = [1, 4], 12, 1, 50
    served = asyncio.run(measure_servers(args))
    reduce = measure_allreduce(args)
    flat = flatten(served, reduce, args)
    print_report(flat, args)
    bs.save_figures(flat, args, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
