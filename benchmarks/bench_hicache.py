"""The prefix cache's disk tier (--enable-hierarchical-cache), on vs off, on one build.

Multi-turn: `--conversations` conversations of `--turns` turns, taken turn by turn in
rotation, each with its own ~`--doc-tokens` document; every turn appends the model's
previous answer and a new question (greedy, `--answer-tokens` per answer). The KV pool is
kept small (`--pool-tokens`) so that all conversations together need about four times what
it holds: by the time a conversation comes back, memory has evicted its history. With the
disk tier on, that history is read back from disk; off, it is prefilled again. Reported:
completion tokens/s over the whole run and the TTFT p50 of the turns after the first (every
time on the default model, in process, streamed).

Restart: a server with the disk tier prefills a ~`--restart-tokens`-token prompt and stops;
a new server on the same directory answers a new question on that prompt (warm: its pages
come from the files) and on another prompt of the same length (cold). TTFT of each, median
of `--repeats`.

Targets (issue 30, this machine): throughput >= 1.5x, TTFT p50 >= 3x better with the tier
on; restart warm >= 5x faster than cold.

Usage: python benchmarks/bench_hicache.py [--json out.json] [--plot out.png] [--smoke]
Not a test: timings on shared machines are noisy. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

COLD_TOPICS = ["rivers", "deserts", "forests", "volcanoes", "harbours", "orchards", "caves"]
TOPICS = ["lighthouses", "bees", "glaciers", "violins", "trains", "coral reefs", "bread", "comets"]
QUESTIONS = [
    "Summarize the document in one sentence.",
    "What is the most surprising fact in it?",
    "Give one question a student might ask about it.",
    "Explain that to a child.",
    "What would you research next?",
    "Name one word from the document you like.",
]
SENTENCE = (
    "This is a long report on {t}, written for careful readers, and every paragraph "
    "adds one more detail about {t} and the people who study them. "
)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def document(topic: str, tokens: int) -> str:
    return SENTENCE.format(t=topic) * max(1, tokens // 30)


def engine(args, directory: str | None, pool_tokens: int):
    from cadence import Engine

    kwargs = dict(model_path=None, dtype=args.dtype, max_total_tokens=pool_tokens)
    if directory is not None:
        kwargs.update(
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_backend_extra_config=json.dumps({"file_storage_path": directory}),
            hicache_write_policy=args.write_policy,
        )
    return Engine(**kwargs)


def timed(e, prompt: str, max_new_tokens: int) -> tuple[float, str, int]:
    """(TTFT s, text, completion tokens) of one streamed greedy request."""

    async def run():
        start = time.perf_counter()
        first, text, count = None, "", 0
        params = {"temperature": 0, "max_new_tokens": max_new_tokens}
        async for chunk in e.async_generate(prompt, params, stream=True):
            if first is None:
                first = time.perf_counter() - start
            text += chunk.get("text", "")
            count = chunk.get("meta_info", {}).get("completion_tokens", count)
        return first, text, count

    return asyncio.run(run())


def multi_turn(args, directory: str | None) -> dict:
    e = engine(args, directory, args.pool_tokens)
    try:
        chats = [
            document(TOPICS[i % len(TOPICS)], args.doc_tokens) for i in range(args.conversations)
        ]
        ttfts, tokens = [], 0
        start = time.perf_counter()
        for turn in range(args.turns):
            for c in range(args.conversations):
                prompt = chats[c] + f"\nUser: {QUESTIONS[turn % len(QUESTIONS)]}\nAssistant:"
                ttft, text, count = timed(e, prompt, args.answer_tokens)
                chats[c] = prompt + text
                tokens += count
                if turn:
                    ttfts.append(ttft)
            log(f"  {'on' if directory else 'off'}: turn {turn + 1}/{args.turns} done")
        wall = time.perf_counter() - start
        history = max(len(e.tokenizer.encode(c)) for c in chats)
        return {
            "tok_s": tokens / wall,
            "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else 0.0,
            "history_tokens": history,
            "total_tokens": sum(len(e.tokenizer.encode(c)) for c in chats),
        }
    finally:
        e.shutdown()


def restart(args, directory: str) -> dict:
    warm_prompt = document("owls", args.restart_tokens)
    # Each cold prompt is new to the tier: the cold requests of earlier repeats wrote theirs.
    cold_prompts = [
        document(f"{COLD_TOPICS[r % len(COLD_TOPICS)]} {r}", args.restart_tokens)
        for r in range(args.repeats)
    ]
    e = engine(args, directory, args.restart_pool)
    try:
        timed(e, warm_prompt + "\nUser: Hi.\nAssistant:", 1)
    finally:
        e.shutdown()  # a clean stop: every page is written
    warm, cold = [], []
    for r in range(args.repeats):
        e = engine(args, directory, args.restart_pool)
        try:
            q = f"\nUser: {QUESTIONS[r % len(QUESTIONS)]}\nAssistant:"
            warm.append(timed(e, warm_prompt + q, 1)[0])
            cold.append(timed(e, cold_prompts[r] + q, 1)[0])
            tokens = len(e.tokenizer.encode(warm_prompt))
        finally:
            e.shutdown()
        log(
            f"  restart {r + 1}/{args.repeats}: warm {warm[-1] * 1000:.0f} ms, cold {cold[-1] * 1000:.0f} ms"
        )
    return {
        "ttft_restart_warm_ms": statistics.median(warm) * 1000,
        "ttft_restart_cold_ms": statistics.median(cold) * 1000,
        "restart_prompt_tokens": tokens,
    }


def plot(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = [
        ("multi-turn tok/s", ["off", "on"], [res["tok_s_off"], res["tok_s_on"]]),
        ("multi-turn TTFT p50 (ms)", ["off", "on"], [res["ttft_p50_ms_off"], res["ttft_p50_ms_on"]]),
        ("TTFT after restart (ms)", ["cold", "warm"], [res["ttft_restart_cold_ms"], res["ttft_restart_warm_ms"]]),
    ]  # fmt: skip
    for ax, (title, labels, values) in zip(axes, panels):
        ax.bar(labels, values, color=["#999999", "#2a7ab0"])
        ax.set_title(title, fontsize=10)
    fig.suptitle("disk tier of the prefix cache (default model, this machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default="bench_results/bench_hicache.png")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--write-policy", default="write_back")
    parser.add_argument("--conversations", type=int, default=11)  # ~4x the pool in all
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=700)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=2048)
    parser.add_argument("--restart-tokens", type=int, default=2000)
    parser.add_argument("--restart-pool", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: the whole path once, for CI"
    )
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.doc_tokens, args.answer_tokens = 3, 2, 200, 4
        args.pool_tokens, args.restart_tokens, args.restart_pool, args.repeats = 512, 300, 1024, 1
    directory = tempfile.mkdtemp(prefix="cadence-bench-hicache-")
    load_start = os.getloadavg()[0]
    try:
        res: dict = {}
        for name, d in (("off", None), ("on", os.path.join(directory, "multi"))):
            log(f"multi-turn, disk tier {name}")
            for key, value in multi_turn(args, d).items():
                res[f"{key}_{name}" if key in ("tok_s", "ttft_p50_ms") else key] = value
        log("restart")
        res.update(restart(args, os.path.join(directory, "restart")))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    res["pool_tokens"] = args.pool_tokens
    res["kv_over_pool"] = res["total_tokens"] / args.pool_tokens
    res["throughput_ratio"] = res["tok_s_on"] / res["tok_s_off"]
    res["ttft_ratio"] = res["ttft_p50_ms_off"] / max(res["ttft_p50_ms_on"], 1e-9)
    res["restart_ratio"] = res["ttft_restart_cold_ms"] / max(res["ttft_restart_warm_ms"], 1e-9)
    res["load_avg_start"], res["load_avg_end"] = load_start, os.getloadavg()[0]
    print("| figure | value |\n|---|---:|")
    for key, value in res.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    print(f"throughput on/off {res['throughput_ratio']:.2f}x (target >= 1.5x); "
          f"TTFT p50 off/on {res['ttft_ratio']:.2f}x (target >= 3x); "
          f"restart cold/warm {res['restart_ratio']:.2f}x (target >= 5x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot(args.plot, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
