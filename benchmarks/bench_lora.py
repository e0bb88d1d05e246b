"""LoRA adapters served in one batch, against the base model alone on the same build and GGUF.

Not a test. One run, one machine, one server at a time (each started, measured, stopped):
  - plain: `cadence serve` on the GGUF (default: SmolLM2-135M-Instruct's), no LoRA;
  - lora: the same server with `--lora-paths` naming `--adapters` (8) distinct adapters of
    rank `--rank` (16) on all seven projections (q, k, v, o, gate, up, down), made here with
    PEFT on the GGUF's Hugging Face export (random, non-zero A and B, each seeded apart) and
    saved in `--adapter-dtype` (bfloat16, as adapters trained in mixed precision are; the
    server keeps each at its file's precision).

At each batch size B (`--batch`, default 1 8 32), a pass starts B greedy streams at once over
native /generate (distinct prompts, `--new-tokens` tokens each, EOS ignored) and measures
decode tok/s in the steady window: from the moment every stream has its first token to the
moment the first stream ends, the tokens all streams received in it over its length (no
prefill, no ramp). On the lora server each repeat (`--repeats`) is a pair of passes, one with
no adapter (the base model: a step with no adapter runs the plain forward) and one where
stream i names adapter i mod `--adapters` (a batch of 8 or more holds every adapter);
lora/base is the median of the pairs' ratios. The two passes of a pair run seconds apart:
this VM's speed drifts by up to 2x over minutes, far more than between two such passes. The
plain server's base figure is printed beside them as a check (a different minute, so
compare it loosely). `load_ms`: /load_lora_adapter of one more such adapter (unloaded again
between tries), the median.

Targets (issue 28): lora >= 0.7x base at b1, >= 0.8x at b8 and b32.
Peers: PEFT (`peft`, in the test extras) makes the adapters; SGLang serves the same requests
on CUDA only, so the base model on our own build is the yardstick.

Usage: python benchmarks/bench_lora.py [--json out.json] [--plot out.png] [--batch 1 8 32]
       [--new-tokens 96] [--repeats 3] [--smoke]
Progress goes to stderr, figures to stdout. Every server it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs  # noqa: E402

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {1: 0.7, 8: 0.8, 32: 0.8}
SUBJECTS = ["a lighthouse", "the harbour", "a mountain village", "the old mill", "a river"]
ASKS = ["Describe", "Write a short story about", "List facts about", "Explain the history of"]


def log(msg: str) -> None:
    print(f"[bench_lora] {msg}", file=sys.stderr, flush=True)


# ---- adapters ------------------------------------------------------------------------------


def make_adapters(model_path: str, root: str, count: int, rank: int, dtype: str) -> list[str]:
    """`count` PEFT adapters (rank `rank`, all seven projections, saved in `dtype`) for the
    GGUF's model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from cadence.model_loader.hf_export import exported_checkpoint_dir

    base = AutoModelForCausalLM.from_pretrained(
        exported_checkpoint_dir(model_path), dtype=torch.float32
    )
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES, init_lora_weights=False
    )
    model = get_peft_model(base, config)
    paths = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        path = os.path.join(root, f"adapter{i}")
        model.to(getattr(torch, dtype)).save_pretrained(path)
        model.float()
        paths.append(path)
    log(f"made {count} rank-{rank} {dtype} adapters on all seven projections under {root}")
    return paths


# ---- one server at a time ------------------------------------------------------------------


def launch(name: str, args, lora_paths: list[str]) -> tuple[subprocess.Popen, str]:
    port = bs.free_port()
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--model-path", args.model_path,
        "--port", str(port), "--grpc-port", str(bs.free_port()), "--log-level", "warning",
        "--max-running-requests", str(max(args.batch)), "--incremental-streaming-output",
    ]  # fmt: skip
    if args.smoke:
        cmd.append("--lazy-kv-pool")  # no pool written and no throwaway steps at start
    if lora_paths:
        cmd += ["--lora-paths", *(f"a{i}={p}" for i, p in enumerate(lora_paths))]
        cmd += ["--max-loras-per-batch", str(len(lora_paths) + 1)]
        cmd += ["--max-lora-rank", str(args.rank), "--lora-target-modules", "all"]
    log_path = os.path.join(tempfile.mkdtemp(prefix=f"bench-lora-{name}-"), "server.log")
    log(f"{name}: launching on :{port} (log: {log_path})")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def stream(session, url: str, prompt: str, new_tokens: int, adapter: str | None) -> list:
    """One greedy stream: (arrival time, tokens so far) per event."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0},
    }
    if adapter is not None:
        body["lora_path"] = adapter
    marks, seen = [], 0
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            seen += len(json.loads(line[6:])["output_ids"])
            marks.append((time.perf_counter(), seen))
    if seen != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens, streamed {seen}")
    return marks


def steady_decode_tok_s(streams: list[list]) -> float:
    """Tokens all streams received between the last first token and the first end, over that
    window's length: decode at the full batch, with no prefill in it."""
    start = max(marks[0][0] for marks in streams)
    end = min(marks[-1][0] for marks in streams)
    if end <= start:
        raise RuntimeError("no steady window: raise --new-tokens")

    def count_at(marks, t):
        return max((n for when, n in marks if when <= t), default=0)

    tokens = sum(count_at(m, end) - count_at(m, start) for m in streams)
    return tokens / (end - start)


async def batch_pass(session, url, batch: int, args, adapters: list[str] | None, seed: int):
    """Steady decode tok/s of `batch` streams; stream i names adapters[i mod len] (None: the
    base model for every stream)."""
    prompts = [
        f"{ASKS[(seed + i) % len(ASKS)]} {SUBJECTS[(seed * 7 + i) % len(SUBJECTS)]} (note {seed}-{i})."
        for i in range(batch)
    ]
    names = [adapters[i % len(adapters)] if adapters else None for i in range(batch)]
    streams = await asyncio.gather(
        *(stream(session, url, p, args.new_tokens, a) for p, a in zip(prompts, names))
    )
    return steady_decode_tok_s(streams)


async def load_ms(session, url: str, path: str, tries: int) -> float:
    times = []
    for i in range(tries):
        name = f"extra{i}"
        t0 = time.perf_counter()
        async with session.post(
            url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        ) as r:
            body = await r.json()
        times.append((time.perf_counter() - t0) * 1e3)
        if not body.get("success"):
            raise RuntimeError(f"/load_lora_adapter failed: {body}")
        async with session.post(url + "/unload_lora_adapter", json={"lora_name": name}) as r:
            r.raise_for_status()
    return statistics.median(times)


async def measure(name: str, args, lora_paths: list[str], extra: str | None) -> dict:
    """{batch: {"base": tok/s, "lora": tok/s, "ratio": lora/base}} of one server, "load_ms".
    With adapters, each repeat runs a base pass and then a LoRA pass, and the ratio is the
    median of the pairs' ratios: both sides of a pair see the machine in the same state."""
    proc, url = launch(name, args, lora_paths)
    names = [f"a{i}" for i in range(len(lora_paths))]
    out: dict = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await bs.wait_healthy(url, proc, timeout=900)
            for warm in [None, names] if names else [None]:  # warm-up
                await batch_pass(session, url, max(args.batch), args, warm, seed=999)
            for b in args.batch:
                base, lora = [], []
                for r in range(args.repeats):
                    base.append(await batch_pass(session, url, b, args, None, seed=r))
                    if names:
                        lora.append(await batch_pass(session, url, b, args, names, seed=r))
                out[b] = {"base": statistics.median(base)}
                line = f"{name}: b{b} base {out[b]['base']:.1f} tok/s ({_each(base)})"
                if names:
                    ratios = [x / y for x, y in zip(lora, base)]
                    out[b].update(lora=statistics.median(lora), ratio=statistics.median(ratios))
                    line += (
                        f", lora {out[b]['lora']:.1f} tok/s ({_each(lora)}), "
                        f"lora/base {out[b]['ratio']:.2f}x ({_each(ratios, '.2f')})"
                    )
                log(line)
            if extra:
                out["load_ms"] = await load_ms(session, url, extra, args.repeats)
                log(f"{name}: adapter load {out['load_ms']:.0f} ms")
    finally:
        bs.stop_group(proc)
    return out


def _each(values: list[float], fmt: str = ".1f") -> str:
    return ", ".join(format(v, fmt) for v in values)


# ---- report --------------------------------------------------------------------------------


def flatten(plain: dict, lora: dict, args) -> dict:
    flat: dict = {
        "model_path": args.model_path,
        "adapters": args.adapters,
        "rank": args.rank,
        "adapter_dtype": args.adapter_dtype,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "load_ms": lora["load_ms"],
    }
    for b in args.batch:
        flat[f"base_tok_s_b{b}"] = lora[b]["base"]
        flat[f"lora_tok_s_b{b}"] = lora[b]["lora"]
        flat[f"lora_vs_base_b{b}"] = lora[b]["ratio"]
        if b in plain:
            flat[f"plain_tok_s_b{b}"] = plain[b]["base"]
    return flat


def print_report(flat: dict, args) -> None:
    print(
        f"{'batch':>6} {'base tok/s':>11} {'lora tok/s':>11} {'lora/base':>10}  "
        f"{'target':>7} {'no-LoRA server':>15}"
    )
    for b in args.batch:
        target = f">= {TARGETS[b]}x" if b in TARGETS else "-"
        print(
            f"{b:>6} {flat[f'base_tok_s_b{b}']:>11.1f} {flat[f'lora_tok_s_b{b}']:>11.1f} "
            f"{flat[f'lora_vs_base_b{b}']:>9.2f}x  {target:>7} "
            f"{flat.get(f'plain_tok_s_b{b}', float('nan')):>15.1f}"
        )
    print(
        f"adapter load: {flat['load_ms']:.0f} ms (rank {args.rank}, seven projections, "
        f"{args.adapter_dtype})"
    )


def plot(flat: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(args.batch))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    base = [flat[f"base_tok_s_b{b}"] for b in args.batch]
    lora = [flat[f"lora_tok_s_b{b}"] for b in args.batch]
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="base model alone")
    ax.bar([x + 0.2 for x in xs], lora, 0.4, label=f"{args.adapters} adapters, rank {args.rank}")
    for x, b in zip(xs, args.batch):
        ax.annotate(
            f"{flat[f'lora_vs_base_b{b}']:.2f}x",
            (x + 0.2, flat[f"lora_tok_s_b{b}"]),
            ha="center",
            va="bottom",
        )
    ax.set_xticks(list(xs), [f"batch {b}" for b in args.batch])
    ax.set_ylabel("decode tok/s")
    ax.set_title("LoRA: mixed-adapter batches vs the base model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="a GGUF file (default: SmolLM2's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--adapter-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="the precision the adapters are saved in (served as saved)",
    )
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="batch 1 and 4, 24 tokens, two adapters, once, no plain server (for CI)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.new_tokens, args.repeats, args.adapters = [1, 4], 24, 1, 2
    if args.model_path is None:
        from cadence.model_loader.locate import default_model_path

        args.model_path = default_model_path()
    with tempfile.TemporaryDirectory(prefix="bench-lora-adapters-") as root:
        paths = make_adapters(
            args.model_path, root, args.adapters + 1, args.rank, args.adapter_dtype
        )
        plain = {} if args.smoke else asyncio.run(measure("plain", args, [], None))
        lora = asyncio.run(measure("lora", args, paths[:-1], paths[-1]))
    flat = flatten(plain, lora, args)
    print_report(flat, args)
    bs.save_figures(flat, args, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
