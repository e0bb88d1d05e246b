"""xgrammar (the engine Cadence ships) against llguidance on this CPU, for the default
model's tokenizer: what docs/structured_output.md's choice of engine rests on.

For each of bench_structured's 50 schemas, each engine:
  - compiles it cold (xgrammar's GrammarCompiler without its cache; an llguidance LLMatcher
    built from the schema), JSON in the compact form of json.dumps for both;
  - walks it: up to 64 steps of a seeded random walk, each step filling the token bitmask
    (timed) and taking a random token among those xgrammar allows; llguidance is given the
    same tokens, and the walk ends where either engine refuses one.
Reported: compile ms (p50, max), mask µs per step (mean, p50, p99), and how many steps
both engines allowed exactly the same tokens.

llguidance is not a Cadence dependency: `pip install llguidance` (or put it on PYTHONPATH)
to run this. Not a test: timings on shared machines are noisy.

Usage: python benchmarks/bench_grammar_engines.py [--steps 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * q))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=64, help="longest walk per schema")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        sys.exit("llguidance is not installed: pip install llguidance")
    import torch
    import xgrammar
    from bench_structured import varied_schemas

    from cadence.model_loader import default_model_path
    from cadence.model_loader.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=[eos]
    )
    x_setup = time.perf_counter() - start
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    l_setup = time.perf_counter() - start
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    times: dict[str, list[float]] = {k: [] for k in ("x_compile", "l_compile", "x_mask", "l_mask")}
    steps = same = 0
    rng = random.Random(0)
    x_bits = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    l_bits = llguidance.numpy.allocate_token_bitmask(1, vocab)
    for schema in varied_schemas():
        text = json.dumps(schema)
        start = time.perf_counter()
        x_matcher = xgrammar.GrammarMatcher(
            compiler.compile_json_schema(text, any_whitespace=False)
        )
        times["x_compile"].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=compact)
        l_matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        times["l_compile"].append((time.perf_counter() - start) * 1e3)
        if l_matcher.is_error():
            sys.exit(f"llguidance refused {text}: {l_matcher.get_error()}")
        for _ in range(args.steps):
            start = time.perf_counter()
            x_matcher.fill_next_token_bitmask(x_bits, 0)
            times["x_mask"].append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(l_matcher, l_bits, 0)
            times["l_mask"].append((time.perf_counter() - start) * 1e6)
            x_row = np.unpackbits(x_bits.numpy()[0].view(np.uint8), bitorder="little")[:vocab]
            l_row = np.unpackbits(l_bits[0].view(np.uint8), bitorder="little")[:vocab]
            steps += 1
            same += int((x_row == l_row).all())
            allowed = [t for t in np.flatnonzero(x_row).tolist() if t != eos]
            if not allowed:
                break
            token = rng.choice(allowed)
            if not (x_matcher.accept_token(token) and l_matcher.consume_token(token)):
                break

    results = {"tokenizer_setup_s_xgrammar": x_setup, "tokenizer_setup_s_llguidance": l_setup}
    for engine, key in (("xgrammar", "x"), ("llguidance", "l")):
        compile_ms, mask_us = times[f"{key}_compile"], times[f"{key}_mask"]
        results[f"compile_ms_p50_{engine}"] = statistics.median(compile_ms)
        results[f"compile_ms_max_{engine}"] = max(compile_ms)
        results[f"mask_us_mean_{engine}"] = statistics.mean(mask_us)
        results[f"mask_us_p50_{engine}"] = statistics.median(mask_us)
        results[f"mask_us_p99_{engine}"] = pct(mask_us, 0.99)
    results["steps"], results["steps_same_mask"] = steps, same

    print(f"\n{len(times['x_compile'])} schemas, {steps} mask steps, vocab {vocab}")
    print(f"{'':22} {'xgrammar':>10} {'llguidance':>11}")
    for label, key, unit in (
        ("tokenizer setup", "tokenizer_setup_s", "s"),
        ("compile p50", "compile_ms_p50", "ms"),
        ("compile max", "compile_ms_max", "ms"),
        ("mask per step mean", "mask_us_mean", "us"),
        ("mask per step p50", "mask_us_p50", "us"),
        ("mask per step p99", "mask_us_p99", "us"),
    ):
        x, g = results[f"{key}_xgrammar"], results[f"{key}_llguidance"]
        print(f"{label + ' (' + unit + ')':22} {x:10.2f} {g:11.2f}")
    print(f"steps where both allowed the same tokens: {same} of {steps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
