"""The radix prefix cache, on vs off, on one server build.

Two servers are launched in turn (with --smoke, at once) from the same code: the default
(prefix cache on, lpm) and `--disable-radix-cache`. On each:
  - shared system prompt: a ~2,000-token system prompt and a short question. Cold is the
    first request after a flush; warm is the same system prompt with a new question. Time to
    first token over streamed /v1/chat/completions, median of `--repeats`.
  - multi-turn: 16 conversations x 6 turns, all at once; each conversation has its own
    ~400-token document, and every turn appends the model's previous answer and a new user
    message (greedy, 32 tokens per answer). Reported: completion tokens/s over the wall time,
    TTFT p50 overall and per turn.
The hit rate is the server's own `cache_hit_rate` (/v1/loads) after the multi-turn run with
the cache on.

Targets (issue 15, this machine): warm TTFT >= 10x faster than cold; multi-turn TTFT p50
>= 3x better and throughput >= 1.5x with the cache on.

Usage: python benchmarks/bench_prefix_cache.py [--json out.json] [--plot out.png]
       [--dtype float32] [--repeats 3] [--conversations 16] [--turns 6] [--smoke]
Not a test: timings on shared machines are noisy. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import os

from cadence import envs  # noqa: E402

envs.set_openmp_defaults()  # as `cadence serve` gives its children

import argparse
import asyncio
import json
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

CONVERSATIONS = 16
TURNS = 6
ANSWER_TOKENS = 32
TOPICS = [
    "lighthouses", "bees", "glaciers", "violins", "trains", "coral reefs", "bread", "comets",
    "maps", "tea", "bridges", "owls", "volcanoes", "paper", "clocks", "rivers",
]  # fmt: skip
QUESTIONS = [
    "Summarize the document in one sentence.",
    "What is the most surprising fact in it?",
    "Give one question a student might ask about it.",
    "Explain that to a child.",
    "What would you research next?",
    "Name one word from the document you like.",
]


def log(msg: str) -> None:
    print(f"[bench_prefix_cache] {msg}", file=sys.stderr, flush=True)


def document(topic: str, sentences: int) -> str:
    """Plain varied prose about `topic` (~10 tokens a sentence)."""
    parts = []
    for i in range(sentences):
        parts.append(
            f"Note {i} about {topic}: observation {i * 7 % 13} was recorded on day {i * 3 % 29} "
            f"and compared with sample {i * 11 % 17}."
        )
    return " ".join(parts)


SYSTEM_SENTENCES = 80  # ~2,000 tokens
DOCUMENT_SENTENCES = 16  # ~400 tokens: each conversation's own document


def system_prompt(sentences: int) -> str:
    return "You are a careful assistant. Use only the reference material below.\n" + document(
        "the reference archive", sentences
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, port: int, cache_on: bool, log_path: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--port", str(port),
        "--grpc-port", str(free_port()), "--dtype", args.dtype, "--log-level", "warning",
        "--max-running-requests", "32", "--chunked-prefill-size", "1024",
        # A 2,000-token prefill on a loaded 2-core machine can take longer than the default.
        "--watchdog-timeout", "600",
    ]  # fmt: skip
    if not cache_on:
        cmd.append("--disable-radix-cache")
    cmd += shlex.split(args.server_args)  # later flags win
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def wait_healthy(session, url, proc, timeout=600):
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


async def chat(session, url, messages, max_tokens) -> tuple[float, str, dict]:
    """(TTFT seconds, answer text, usage) of one streamed greedy chat completion."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(delta)
    return ttft if ttft is not None else time.perf_counter() - start, "".join(text), usage


async def shared_prompt(session, url, args) -> tuple[float, float, int]:
    """Median cold and warm TTFT (s) of the long shared system prompt, and its token count."""
    colds, warms, num = [], [], 0
    system = {"role": "system", "content": system_prompt(args.system_sentences)}
    for k in range(args.repeats):
        async with session.post(url + "/flush_cache") as r:
            await r.read()
        cold, _, usage = await chat(
            session, url, [system, {"role": "user", "content": f"Question {k}: hello?"}], 4
        )
        warm, _, _ = await chat(
            session, url, [system, {"role": "user", "content": f"Another one {k}: why?"}], 4
        )
        colds.append(cold)
        warms.append(warm)
        num = usage.get("prompt_tokens", num)
        log(f"  shared prompt {k}: cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms")
    return statistics.median(colds), statistics.median(warms), num


async def multiturn(session, url, args) -> tuple[float, list[list[float]]]:
    """Completion tok/s over the run, and TTFTs per turn (seconds)."""
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    tokens = 0

    async def conversation(c: int):
        nonlocal tokens
        messages = [
            {
                "role": "system",
                "content": "Answer briefly.\n" + document(TOPICS[c], args.document_sentences),
            },
        ]
        for t in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            ttft, answer, usage = await chat(session, url, messages, args.answer_tokens)
            per_turn[t].append(ttft)
            tokens += usage.get("completion_tokens", 0)
            messages.append({"role": "assistant", "content": answer})

    async with session.post(url + "/flush_cache") as r:
        await r.read()
    start = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return tokens / (time.perf_counter() - start), per_turn


def start(args, cache_on: bool) -> tuple[subprocess.Popen, str, str]:
    """A server launched (not yet healthy): its process, URL and log path."""
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"bench_prefix_cache_{int(cache_on)}.log")
    return launch(args, port, cache_on, log_path), f"http://127.0.0.1:{port}", log_path


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


async def measure(args, cache_on: bool, server: tuple[subprocess.Popen, str, str]) -> dict:
    """The figures of one server (stopped when done)."""
    proc, url, log_path = server
    name = "on" if cache_on else "off"
    try:
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await wait_healthy(session, url, proc)
            log(f"cache {name}: server up (log {log_path})")
            cold, warm, num = await shared_prompt(session, url, args)
            log(
                f"cache {name}: multi-turn, {args.conversations} conversations x {args.turns} turns"
            )
            tok_s, per_turn = await multiturn(session, url, args)
            async with session.get(url + "/v1/loads") as r:
                loads = (await r.json())["loads"][0]
        return {
            "cold": cold,
            "warm": warm,
            "system_tokens": num,
            "tok_s": tok_s,
            "per_turn": per_turn,
            "hit_rate": loads["cache_hit_rate"],
        }
    finally:
        stop(proc)


def measure_both(args) -> tuple[dict, dict]:
    """Cache on, then off. A full run starts each server once the other has stopped, so the
    two never compete; --smoke starts both at once, so that their loading overlaps, and
    measures them in turn all the same."""
    started = {on: start(args, on) for on in (True, False)} if args.smoke else {}
    try:
        on = asyncio.run(measure(args, True, started.pop(True, None) or start(args, True)))
        off = asyncio.run(measure(args, False, started.pop(False, None) or start(args, False)))
    finally:
        for proc, _, _ in started.values():  # one a failed run did not reach
            stop(proc)
    return on, off


def p50(values) -> float:
    return statistics.median(values)


def plot(path: str, on: dict, off: dict, conversations: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, len(on["per_turn"]) + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, data, marker in (("cache on", on, "o"), ("cache off", off, "s")):
        ax.plot(turns, [p50(t) * 1e3 for t in data["per_turn"]], marker=marker, label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(f"{conversations} concurrent conversations: time to first token per turn")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures as one flat JSON object here")
    parser.add_argument("--plot", default="bench_results/bench_prefix_cache.png")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS)
    parser.add_argument(
        "--system-sentences",
        type=int,
        default=SYSTEM_SENTENCES,
        help="length of the shared system prompt (~25 tokens a sentence)",
    )
    parser.add_argument(
        "--server-args", default="", help="extra flags for both servers, e.g. '--lazy-kv-pool'"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the whole path at the smallest size, for CI: one repeat, 2 conversations x 2 "
        "turns of 4 tokens, a short system prompt and documents, both servers started at once "
        "with --lazy-kv-pool --skip-warmup",
    )
    args = parser.parse_args()
    args.document_sentences = DOCUMENT_SENTENCES
    if args.smoke:
        args.repeats, args.conversations, args.turns, args.answer_tokens = 1, 2, 2, 4
        args.system_sentences, args.document_sentences = 8, 4
        args.server_args += " --lazy-kv-pool --skip-warmup"

    on, off = measure_both(args)
    flat_on = [x for t in on["per_turn"] for x in t]
    flat_off = [x for t in off["per_turn"] for x in t]
    result = {
        "system_prompt_tokens": on["system_tokens"],
        "ttft_cold_ms": on["cold"] * 1e3,
        "ttft_warm_ms": on["warm"] * 1e3,
        "ttft_warm_cache_off_ms": off["warm"] * 1e3,
        "warm_speedup": on["cold"] / on["warm"],
        "multiturn_tok_s_on": on["tok_s"],
        "multiturn_tok_s_off": off["tok_s"],
        "multiturn_ttft_p50_ms_on": p50(flat_on) * 1e3,
        "multiturn_ttft_p50_ms_off": p50(flat_off) * 1e3,
        "multiturn_ttft_ratio": p50(flat_off) / p50(flat_on),
        "multiturn_throughput_ratio": on["tok_s"] / off["tok_s"],
        "hit_rate": on["hit_rate"],
        "load_avg_1m": os.getloadavg()[0],
    }
    print("| metric | value |\n|---|---:|")
    for key, value in result.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    print("\n| turn | TTFT p50 on (ms) | TTFT p50 off (ms) |\n|---:|---:|---:|")
    for t in range(args.turns):
        print(
            f"| {t + 1} | {p50(on['per_turn'][t]) * 1e3:.0f} | {p50(off['per_turn'][t]) * 1e3:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(args.plot, on, off, args.conversations)


if __name__ == "__main__":
    main()
