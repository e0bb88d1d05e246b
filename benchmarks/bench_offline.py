"""Offline engine throughput against the matmul limit and a plain transformers decode loop.

All figures come from one run, one process, one dtype:
  - ours: decode tok/s at batch 1, 8, 32 (128 new tokens each, greedy, EOS ignored) and
    prefill tok/s for one 512-token prompt, through the in-process Engine;
  - limit: the model's weight matrix multiplies alone (every layer's projections plus the
    LM head) at the same batch sizes — no attention, no norms, no Python around them — through
    the same kernels the engine uses (on CPU, weights packed once into oneDNN's layout); the
    same multiplies through plain F.linear are reported as *_limit_plain_tok_s;
  - peer: transformers' own decode loop (generate with a KV cache) on the same GGUF weights.

Usage: python benchmarks/bench_offline.py [--dtype auto] [--json out.json] [--plot out.png]
       [--repeats 3] [--new-tokens 128] [--prefill-len 512] [--skip-hf] [--smoke]
Not a test: timings on shared machines are noisy; each figure is the median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

BATCHES = (1, 8, 32)
NEW_TOKENS = 128
PREFILL_LEN = 512


def log(msg: str) -> None:
    print(f"[bench_offline] {msg}", file=sys.stderr, flush=True)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts(tokenizer, batch: int) -> list[list[int]]:
    base = tokenizer.encode("Write a long story about a lighthouse keeper and the sea. Chapter")
    return [base + tokenizer.encode(f" {i + 1}:") for i in range(batch)]


def bench_ours(
    engine, repeats: int, new_tokens: int = NEW_TOKENS, prefill_len: int = PREFILL_LEN
) -> dict:
    out = {}
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    for bs in BATCHES:
        ids = prompts(engine.tokenizer, bs)
        engine.generate(input_ids=ids, sampling_params=dict(params, max_new_tokens=4))
        log(f"ours: decode batch {bs}")

        def run():
            res = engine.generate(input_ids=ids, sampling_params=params)
            assert sum(r["meta_info"]["completion_tokens"] for r in res) == bs * new_tokens

        # Subtract the prefill so the figure is decode alone.
        prefill = median_time(
            lambda: engine.generate(input_ids=ids, sampling_params=dict(params, max_new_tokens=1)),
            repeats,
        )
        total = median_time(run, repeats)
        out[f"decode_b{bs}_tok_s"] = bs * (new_tokens - 1) / max(total - prefill, 1e-9)
    sentence = engine.tokenizer.encode("The sea was calm that night. ")
    long_ids = [(sentence * (prefill_len // len(sentence) + 1))[:prefill_len]]
    log(f"ours: prefill {prefill_len}")
    t = median_time(
        lambda: engine.generate(input_ids=long_ids, sampling_params={"max_new_tokens": 1}), repeats
    )
    out[f"prefill_{prefill_len}_tok_s"] = prefill_len / t
    return out


def bench_limit(
    model, dtype, repeats: int, prefill_len: int = PREFILL_LEN, timed: int | None = None
) -> dict:
    """The model's projections alone, through the very objects the engine calls (packed
    oneDNN weights on CPU), and the same shapes through plain F.linear for reference; each
    figure the median of `timed` passes (default 3 x `repeats`) after an untimed one."""
    linears = [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    linears.append(model.lm_head_linear)
    plain = [
        torch.randn(lin.out_features, lin.in_features, dtype=dtype) for lin in linears
    ]  # values don't matter
    out = {}
    for rows in BATCHES + (prefill_len,):
        xs = {lin.in_features: torch.randn(rows, lin.in_features, dtype=dtype) for lin in linears}

        def run():
            for lin in linears:
                lin(xs[lin.in_features])

        def run_plain():
            for w in plain:
                F.linear(xs[w.shape[1]], w)

        key = f"prefill_{rows}_limit" if rows == prefill_len else f"decode_b{rows}_limit"
        for suffix, fn in (("_tok_s", run), ("_plain_tok_s", run_plain)):
            fn()
            out[key + suffix] = rows / median_time(fn, timed or repeats * 3)
    return out


def bench_hf(model_path: str, dtype, repeats: int, tokenizer, new_tokens: int = NEW_TOKENS) -> dict:
    from transformers import AutoModelForCausalLM

    from cadence.model_loader.hf_export import exported_checkpoint_dir

    log("peer: loading transformers' model (the GGUF's weights, de-quantized by transformers)")
    model = AutoModelForCausalLM.from_pretrained(
        exported_checkpoint_dir(model_path), dtype=dtype
    ).eval()
    out = {}
    for bs in (1, 32):
        ids = prompts(tokenizer, bs)
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        log(f"peer: decode batch {bs}")

        def gen(n):
            with torch.inference_mode():
                model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        prefill = median_time(lambda: gen(1), max(1, repeats // 2))
        total = median_time(lambda: gen(new_tokens), max(1, repeats // 2))
        out[f"decode_b{bs}_hf_tok_s"] = bs * (new_tokens - 1) / max(total - prefill, 1e-9)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(BATCHES)
    ax.plot(xs, [results[f"decode_b{b}_tok_s"] for b in xs], "o-", label="Cadence")
    ax.plot(xs, [results[f"decode_b{b}_limit_tok_s"] for b in xs], "s--", label="matmul limit")
    ax.plot(
        xs,
        [results[f"decode_b{b}_limit_plain_tok_s"] for b in xs],
        "x:",
        color="gray",
        label="matmul limit, plain F.linear",
    )
    hf = [
        (b, results.get(f"decode_b{b}_hf_tok_s"))
        for b in xs
        if results.get(f"decode_b{b}_hf_tok_s")
    ]
    if hf:
        ax.plot([b for b, _ in hf], [v for _, v in hf], "^:", label="transformers loop")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Offline decode, {results['dtype']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: what `cadence serve` runs (bfloat16 where the CPU has bfloat16 "
        "instructions, else float32)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--json", default=None, help="write the results as one flat JSON object")
    parser.add_argument("--plot", default="bench_results/bench_offline.png")
    parser.add_argument(
        "--new-tokens", type=int, default=NEW_TOKENS, help="decoded per request (at least 2)"
    )
    parser.add_argument(
        "--prefill-len", type=int, default=PREFILL_LEN, help="tokens of the prefill figure"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure once (the limit's too) with 2 new tokens per request and a 16-token "
        "prefill (the peer included): for CI",
    )
    args = parser.parse_args()
    limit_timed = None  # 3 x --repeats
    if args.smoke:
        args.repeats, args.new_tokens, args.prefill_len, limit_timed = 1, 2, 16, 1
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: decode is timed beyond the first token")

    from cadence import Engine
    from cadence.platforms import get_current_platform

    dtype = get_current_platform().resolve_dtype(args.dtype)
    args.dtype = str(dtype).removeprefix("torch.")
    log(f"loading the engine ({args.dtype})")
    engine = Engine(
        model_path=args.model_path,
        dtype=args.dtype,
        max_running_requests=64,
        disable_radix_cache=True,  # the prefill figure repeats one prompt: measure compute
    )
    try:
        results = {"dtype": args.dtype, "threads": torch.get_num_threads()}
        results.update(new_tokens=args.new_tokens, prefill_len=args.prefill_len)
        results.update(bench_ours(engine, args.repeats, args.new_tokens, args.prefill_len))
        log("limit: weight matmuls alone")
        # On the engine's own thread: OpenMP keeps a worker team per calling thread, and a
        # second team on this thread would slow both down (see cadence/engine.py).
        results.update(
            engine.run_in_scheduler(
                lambda s: bench_limit(
                    s.runner.model, dtype, args.repeats, args.prefill_len, limit_timed
                ),
                timeout=600,
            )
        )
        model_path = engine.info.model_path
    finally:
        engine.shutdown()  # its thread, and with it its OpenMP team, ends here
    if not args.skip_hf:
        results.update(bench_hf(model_path, dtype, args.repeats, engine.tokenizer, args.new_tokens))

    n = args.prefill_len
    rows = [
        ("decode b1", "decode_b1_tok_s", "decode_b1_limit_tok_s", "decode_b1_hf_tok_s"),
        ("decode b8", "decode_b8_tok_s", "decode_b8_limit_tok_s", None),
        ("decode b32", "decode_b32_tok_s", "decode_b32_limit_tok_s", "decode_b32_hf_tok_s"),
        (f"prefill {n}", f"prefill_{n}_tok_s", f"prefill_{n}_limit_tok_s", None),
    ]
    print(
        f"\nCadence offline, dtype={args.dtype}, threads={results['threads']}; limit = the engine's matmul "
        f"kernels alone (plain F.linear: b1 {results['decode_b1_limit_plain_tok_s']:.1f}, "
        f"b32 {results['decode_b32_limit_plain_tok_s']:.1f} tok/s)"
    )
    print(
        f"{'':12} {'ours tok/s':>11} {'limit':>9} {'ours/limit':>11} {'transformers':>13} {'ours/hf':>8}"
    )
    for name, ours, limit, hf in rows:
        h = results.get(hf) if hf else None
        print(
            f"{name:12} {results[ours]:11.1f} {results[limit]:9.1f} {results[ours] / results[limit]:11.2f} "
            f"{(f'{h:.1f}' if h else '-'):>13} {(f'{results[ours] / h:.2f}' if h else '-'):>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
