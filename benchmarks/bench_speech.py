"""Speech serving: time to first audio and real-time factor, next to eSpeak NG alone.

Not a test. Launches `cadence serve --pipeline speech` (each stage in its own process) and
then `--pipeline speech_colocated` (talker, vocoder and encoder in one; with --smoke, both at
once), and measures:
  - /v1/audio/speech (pcm, the lightest encoder; mp3 too): time to the first audio byte
    (p50) at concurrency 1, and the real-time factor (seconds of audio delivered per second
    of wall time, all clients together) at concurrency 1 and 8, the best of three passes
    (each lasts under a second; the median is in the JSON too);
  - chat with audio (streamed, modalities text + audio): time to the first audio byte and
    time to the first complete sentence of text at the client (p50, concurrency 1), and
    the real-time factor at concurrency 1 and 8 (bound by the LLM);
  - the limit: eSpeak NG synthesizing the same texts sentence by sentence in this process,
    no server, one synthesizer (as the pipeline has one vocoder process): its real-time
    factor is the same at any concurrency; the best of several passes, measured before and
    after each server (on a shared machine a pass can lose its core for a while).
Targets: served real-time factor >= 0.7x the limit at concurrency 8; time to first audio
byte of chat <= time to the first sentence's text + 150 ms.

    .venv/bin/python benchmarks/bench_speech.py [--json out.json] [--plot out.png] [--quick]
        [--modes speech,speech_colocated] [--texts 12] [--passes 3] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from cadence.speech.text import SentenceSplitter, split_sentences

TARGET_RTF_VS_LIMIT = 0.7
TARGET_TTFA_OVER_TEXT_MS = 150.0
SAMPLE_RATE = 24_000
MODES = ("speech", "speech_colocated")
PASSES = 3  # served speech passes per level: the best one counts, as for the limit
TOPICS = (
    "the ocean", "mountains", "a city at night", "coffee", "trains", "the moon",
    "gardening", "old libraries", "rain", "bicycles", "winter", "music",
)  # fmt: skip
TEXTS = [
    f"Let me tell you about {t}. It is a subject people have loved for a long time. "
    f"Some find it calming, others find it exciting. Either way, {t} is worth a few minutes "
    f"of your attention today."
    for t in TOPICS
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- the limit: eSpeak NG in this process ------------------------------------------------------


def limit_rtf(rounds: int) -> float:
    """The best of `rounds` passes over the texts (on a shared machine a pass can lose its
    core for a while; the best one is what eSpeak can do)."""
    from cadence.speech.espeak import ESpeak

    espeak = ESpeak.get()
    espeak.synthesize("warm up", "en-us")
    best = 0.0
    for _ in range(rounds):
        audio_s, started = 0.0, time.perf_counter()
        for text in TEXTS:
            for sentence in split_sentences(text):
                audio_s += len(espeak.synthesize(sentence, "en-us")) / SAMPLE_RATE
        best = max(best, audio_s / (time.perf_counter() - started))
    return best


# -- a served pipeline ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, port: int, log_path: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--pipeline", mode,
        "--port", str(port), "--grpc-port", str(free_port()), "--log-level", "warning",
        "--max-total-tokens", "4096", "--skip-warmup",
    ]  # fmt: skip
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def wait_healthy(client: httpx.AsyncClient, proc, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


async def speak(client: httpx.AsyncClient, text: str, fmt: str) -> tuple[float, float]:
    """(seconds to the first audio byte, seconds of audio) for one /v1/audio/speech."""
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": fmt}
    started = time.perf_counter()
    first, data = None, []
    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            first = first or time.perf_counter() - started
            data.append(chunk)
    return first, _audio_seconds(b"".join(data), fmt)


def _audio_seconds(data: bytes, fmt: str) -> float:
    if fmt == "pcm":
        return len(data) / 2 / SAMPLE_RATE
    import io

    import soundfile

    samples, rate = soundfile.read(io.BytesIO(data))
    return len(samples) / rate


async def chat(client: httpx.AsyncClient, topic: str, max_tokens: int = 64) -> dict:
    """One streamed chat with audio: times to the first text, the first complete sentence of
    text, the first audio byte; seconds of audio."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Tell me about {topic} in three sentences."}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"},
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    splitter = SentenceSplitter()
    started = time.perf_counter()
    out = {"first_text_s": None, "first_sentence_s": None, "first_audio_s": None, "audio_s": 0.0}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - started
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta", {})
            if delta.get("content"):
                out["first_text_s"] = out["first_text_s"] or now
                if splitter.feed(delta["content"]) and out["first_sentence_s"] is None:
                    out["first_sentence_s"] = now
            audio = (delta.get("audio") or {}).get("data")
            if audio:
                out["first_audio_s"] = out["first_audio_s"] or now
                out["audio_s"] += len(base64.b64decode(audio)) / 2 / SAMPLE_RATE
    if out["first_sentence_s"] is None:  # a one-sentence answer ends with the stream
        out["first_sentence_s"] = time.perf_counter() - started
    return out


async def concurrent(fn, items: list, concurrency: int) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(item):
        async with gate:
            return await fn(item)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in items))
    return results, time.perf_counter() - started


def start(mode: str) -> tuple[subprocess.Popen, int]:
    """A pipeline server launched (not yet healthy), and its port."""
    port = free_port()
    os.makedirs("bench_results", exist_ok=True)
    return launch(mode, port, f"bench_results/bench_speech_{mode}.log"), port


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


async def measure(mode: str, args, server: tuple[subprocess.Popen, int]) -> dict[str, float]:
    """The figures of one pipeline's server (stopped when done)."""
    proc, port = server
    out: dict[str, float] = {}
    reps = 1 if args.quick else 3
    texts, topics = TEXTS[: args.texts], TOPICS[: args.texts]

    def talk(topic: str):
        return chat(client, topic, args.chat_tokens)

    try:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits
        ) as client:
            await wait_healthy(client, proc)
            log(f"{mode}: ready")
            # Warm up, discarded: a server just started is still settling (its first
            # requests, the model's first batches), which once skewed whichever mode ran first.
            await concurrent(lambda t: speak(client, t, "mp3"), texts, 8)
            await concurrent(talk, list(topics[:2]), 2)
            for fmt in ("pcm", "mp3"):
                for c in (1, 8):
                    # Passes of under a second each: the best of PASSES, as for the limit
                    # (the median is kept too).
                    rtfs, firsts = [], []
                    for _ in range(args.passes):
                        results, wall = await concurrent(
                            lambda t, fmt=fmt: speak(client, t, fmt), texts * reps, c
                        )
                        rtfs.append(sum(a for _, a in results) / wall)
                        firsts += [f for f, _ in results]
                    out[f"served_rtf_c{c}_{fmt}"] = max(rtfs)
                    out[f"served_rtf_c{c}_{fmt}_median"] = statistics.median(rtfs)
                    if c == 1:
                        out[f"ttfa_speech_ms_p50_{fmt}"] = 1000 * p50(firsts)
                    log(f"{mode} speech {fmt} c{c}: rtf {out[f'served_rtf_c{c}_{fmt}']:.1f}")
            results, wall = await concurrent(talk, list(topics[: 4 if args.quick else 8]), 1)
            out["ttfa_chat_ms_p50"] = 1000 * p50([r["first_audio_s"] for r in results])
            out["first_sentence_text_ms_p50"] = 1000 * p50([r["first_sentence_s"] for r in results])
            out["first_text_ms_p50"] = 1000 * p50([r["first_text_s"] for r in results])
            out["chat_rtf_c1"] = sum(r["audio_s"] for r in results) / wall
            results, wall = await concurrent(talk, list(topics), 8)
            out["chat_rtf_c8"] = sum(r["audio_s"] for r in results) / wall
            log(f"{mode} chat: ttfa {out['ttfa_chat_ms_p50']:.0f} ms, first sentence "
                f"{out['first_sentence_text_ms_p50']:.0f} ms")  # fmt: skip
    finally:
        stop(proc)
    return out


def plot(path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels, values = [], []
    for mode in MODES:
        for c in (1, 8):
            labels.append(f"{'per-proc' if mode == 'speech' else 'coloc'}\nc{c}")
            values.append(result[f"{mode}.served_rtf_c{c}_pcm"])
    labels.append("limit\n(eSpeak)")
    values.append(result["limit_rtf_c8"])
    axes[0].bar(labels, values, color=["tab:blue"] * 4 + ["tab:gray"])
    axes[0].axhline(TARGET_RTF_VS_LIMIT * result["limit_rtf_c8"], color="tab:gray",
                    linestyle="--", label=f"{TARGET_RTF_VS_LIMIT}x limit")  # fmt: skip
    axes[0].set_ylabel("audio seconds per wall second")
    axes[0].set_title("/v1/audio/speech (pcm): real-time factor")
    axes[0].legend()
    keys = ("first_text_ms_p50", "first_sentence_text_ms_p50", "ttfa_chat_ms_p50")
    width = 0.25
    for i, key in enumerate(keys):
        xs = [m + (i - 1) * width for m in range(len(MODES))]
        axes[1].bar(xs, [result[f"{mode}.{key}"] for mode in MODES], width, label=key)
    axes[1].set_xticks(range(len(MODES)), ["each stage its process", "colocated"])
    axes[1].set_ylabel("ms (p50)")
    axes[1].set_title("chat with audio: first text, first sentence, first audio")
    axes[1].legend()
    fig.suptitle(
        f"eSpeak NG speech pipeline ({result['cpu_count']} cores, load avg "
        f"{result['load_avg_1m']:.1f})"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures as JSON here")
    parser.add_argument("--plot", default="bench_results/bench_speech.png")
    parser.add_argument("--quick", action="store_true", help="fewer requests per measurement")
    parser.add_argument("--modes", default=",".join(MODES), help="pipelines to serve, in order")
    parser.add_argument("--texts", type=int, default=len(TEXTS), help="texts (and chat topics)")
    parser.add_argument("--passes", type=int, default=PASSES, help="speech passes per level")
    parser.add_argument("--chat-tokens", type=int, default=64, help="max_tokens of each chat")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure once on 2 texts, chats of 16 tokens, one limit pass, every "
        "pipeline's server started at once (measured in turn): for CI",
    )
    args = parser.parse_args()
    limit_rounds = 5
    if args.smoke:
        args.quick, args.texts, args.passes, args.chat_tokens, limit_rounds = True, 2, 1, 16, 1

    load_before = os.getloadavg()[0]
    modes = args.modes.split(",")
    result: dict[str, float] = {}
    # A full run starts each server once the one before has stopped; --smoke starts them all
    # at once, before the first limit pass, so that their loading overlaps it and each other.
    started = {mode: start(mode) for mode in modes} if args.smoke else {}
    try:
        limits = [limit_rtf(limit_rounds)]
        for mode in modes:
            server = started.pop(mode, None) or start(mode)
            for key, value in asyncio.run(measure(mode, args, server)).items():
                result[f"{mode}.{key}"] = value
            limits.append(
                limit_rtf(limit_rounds)
            )  # again after each server: the best of all is the limit
    finally:
        for proc, _ in started.values():  # one a failed run did not reach
            stop(proc)
    result["limit_rtf_c8"] = result["limit_rtf_c1"] = max(limits)
    main_mode = modes[0]
    for key in ("ttfa_chat_ms_p50", "first_sentence_text_ms_p50"):
        result[key] = result[f"{main_mode}.{key}"]
    result["served_rtf_c8"] = result[f"{main_mode}.served_rtf_c8_pcm"]
    result["served_vs_limit_c8"] = result["served_rtf_c8"] / result["limit_rtf_c8"]
    result["ttfa_chat_over_first_sentence_ms"] = (
        result["ttfa_chat_ms_p50"] - result["first_sentence_text_ms_p50"]
    )
    result.update(
        load_avg_1m_before=load_before, load_avg_1m=os.getloadavg()[0], cpu_count=os.cpu_count()
    )
    print("| metric | value | target |\n|---|---:|---|")
    targets = {
        "served_vs_limit_c8": f">= {TARGET_RTF_VS_LIMIT}",
        "ttfa_chat_over_first_sentence_ms": f"<= {TARGET_TTFA_OVER_TEXT_MS:.0f}",
    }
    for key, value in result.items():
        print(f"| {key} | {value:.2f} | {targets.get(key, '')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot and all(f"{m}.served_rtf_c1_pcm" in result for m in MODES):
        plot(args.plot, result)


if __name__ == "__main__":
    main()
