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
to compare with it; without it, xgrammar's figures are reported alone. Not a test: timings
on shared machines are noisy.

Usage: python benchmarks/bench_grammar_engines.py [--steps 64] [--schemas 50] [--json out.json]
       [--smoke]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np


def log(msg: str) -> None:
    print(f"[bench_grammar_engines] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * q))]


def import_llguidance():
    """llguidance's modules, or None (with a message) where it is not installed."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        log("llguidance is not installed (pip install llguidance): xgrammar alone")
        return None
    return llguidance


class Engines:
    """xgrammar, and llguidance when given, set up for one tokenizer."""

    def __init__(self, tokenizer, llguidance):
        import torch
        import xgrammar

        self.xgrammar, self.llguidance = xgrammar, llguidance
        self.vocab, self.eos = len(tokenizer), tokenizer.eos_token_id
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab, stop_token_ids=[self.eos]
        )
        self.setup_s = {"xgrammar": time.perf_counter() - start}
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.x_bits = torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)
        if llguidance is not None:
            start = time.perf_counter()
            self.lltok = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab, eos_token=self.eos
            )
            self.setup_s["llguidance"] = time.perf_counter() - start
            self.l_bits = llguidance.numpy.allocate_token_bitmask(1, self.vocab)

    def compile(self, text: str, times: dict[str, list[float]]):
        """Both matchers for one schema, each compile timed."""
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        start = time.perf_counter()
        compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
        x_matcher = self.xgrammar.GrammarMatcher(compiled)
        times["x_compile"].append((time.perf_counter() - start) * 1e3)
        if self.llguidance is None:
            return x_matcher, None
        start = time.perf_counter()
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(text, overrides=compact)
        l_matcher = self.llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        times["l_compile"].append((time.perf_counter() - start) * 1e3)
        if l_matcher.is_error():
            sys.exit(f"llguidance refused {text}: {l_matcher.get_error()}")
        return x_matcher, l_matcher

    def walk(self, x_matcher, l_matcher, steps: int, rng, times) -> tuple[int, int]:
        """(steps taken, steps where both allowed the same tokens) of one seeded walk."""
        taken = same = 0
        for _ in range(steps):
            start = time.perf_counter()
            x_matcher.fill_next_token_bitmask(self.x_bits, 0)
            times["x_mask"].append((time.perf_counter() - start) * 1e6)
            x_row = np.unpackbits(self.x_bits.numpy()[0].view(np.uint8), bitorder="little")
            x_row = x_row[: self.vocab]
            taken += 1
            if l_matcher is not None:
                start = time.perf_counter()
                self.llguidance.numpy.fill_next_token_bitmask(l_matcher, self.l_bits, 0)
                times["l_mask"].append((time.perf_counter() - start) * 1e6)
                l_row = np.unpackbits(self.l_bits[0].view(np.uint8), bitorder="little")
                same += int((x_row == l_row[: self.vocab]).all())
            allowed = [t for t in np.flatnonzero(x_row).tolist() if t != self.eos]
            if not allowed:
                break
            token = rng.choice(allowed)
            if not x_matcher.accept_token(token):
                break
            if l_matcher is not None and not l_matcher.consume_token(token):
                break
        return taken, same


def summarize(engines: Engines, times: dict[str, list[float]], steps: int, same: int) -> dict:
    results = {f"tokenizer_setup_s_{name}": s for name, s in engines.setup_s.items()}
    for engine, key in (("xgrammar", "x"), ("llguidance", "l")):
        compile_ms, mask_us = times[f"{key}_compile"], times[f"{key}_mask"]
        if not compile_ms:
            continue
        results[f"compile_ms_p50_{engine}"] = statistics.median(compile_ms)
        results[f"compile_ms_max_{engine}"] = max(compile_ms)
        results[f"mask_us_mean_{engine}"] = statistics.mean(mask_us)
        results[f"mask_us_p50_{engine}"] = statistics.median(mask_us)
        results[f"mask_us_p99_{engine}"] = pct(mask_us, 0.99)
    results["steps"] = steps
    if engines.llguidance is not None:
        results["steps_same_mask"] = same
    return results


def print_report(results: dict, num_schemas: int, vocab: int) -> None:
    print(f"\n{num_schemas} schemas, {results['steps']} mask steps, vocab {vocab}")
    print(f"{'':22} {'xgrammar':>10} {'llguidance':>11}")
    for label, key, unit in (
        ("tokenizer setup", "tokenizer_setup_s", "s"),
        ("compile p50", "compile_ms_p50", "ms"),
        ("compile max", "compile_ms_max", "ms"),
        ("mask per step mean", "mask_us_mean", "us"),
        ("mask per step p50", "mask_us_p50", "us"),
        ("mask per step p99", "mask_us_p99", "us"),
    ):
        x, g = results[f"{key}_xgrammar"], results.get(f"{key}_llguidance")
        shown = f"{g:11.2f}" if g is not None else f"{'-':>11}"
        print(f"{label + ' (' + unit + ')':22} {x:10.2f} {shown}")
    if "steps_same_mask" in results:
        print(f"steps where both allowed the same tokens: {results['steps_same_mask']} of "
              f"{results['steps']}")  # fmt: skip
    else:
        print("llguidance: not installed (pip install llguidance), not compared")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=64, help="longest walk per schema")
    parser.add_argument("--schemas", type=int, default=None, help="only the first N schemas")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="5 schemas, walks of 4 steps: for CI")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.schemas = 4, 5
    llguidance = import_llguidance()
    from bench_structured import varied_schemas

    from cadence.model_loader import default_model_path
    from cadence.model_loader.tokenizer_files import load_tokenizer

    engines = Engines(load_tokenizer(default_model_path()), llguidance)
    times: dict[str, list[float]] = {k: [] for k in ("x_compile", "l_compile", "x_mask", "l_mask")}
    steps = same = 0
    rng = random.Random(0)
    schemas = varied_schemas()[: args.schemas]
    for schema in schemas:
        x_matcher, l_matcher = engines.compile(json.dumps(schema), times)
        taken, agreed = engines.walk(x_matcher, l_matcher, args.steps, rng, times)
        steps, same = steps + taken, same + agreed
    results = summarize(engines, times, steps, same)
    print_report(results, len(schemas), engines.vocab)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
