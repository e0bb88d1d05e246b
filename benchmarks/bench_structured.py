"""Constrained decoding against unconstrained decoding, and grammar compile time.

All figures come from one run, one process, one in-process Engine:
  - decode tok/s at batch 1 and 32 with a JSON-schema constraint on every request (an object
    holding an array of exactly --readings bounded integers and an enum: ~200 tokens the
    grammar forces at 48, the compiled grammar cached by a warm-up), against the same prompts unconstrained
    with the same number of new tokens per request (EOS ignored), greedy; the prefill (one
    token) is subtracted, and the two runs alternate so drift hits both alike;
  - the constraint's share of the constrained decode time: the sampler's time (grammar
    masks included) and the grammars' accept time, timed in place, beyond the sampler's
    time in the unconstrained run. On a machine shared with other work the tok/s swing
    with its load; this share is the constraint's own cost;
  - grammar compile time (ms) of 50 varied schemas, each compiled cold (no cache) by the
    engine the server runs, as the scheduler's worker thread does.

The limit compared with: constrained >= 0.9x unconstrained at batch 32.

Usage: python benchmarks/bench_structured.py [--repeats 3] [--readings 48] [--json out.json]
       [--plot out.png] [--schemas 50] [--smoke]  (the plot goes beside --json unless --plot says where)
Not a test: timings on shared machines are noisy; each figure is the median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BATCHES = (1, 32)
TARGET_RATIO_B32 = 0.9


def long_schema(readings: int = 48) -> dict:
    """An object holding exactly `readings` integers in [0, 999] and an enum: about four
    tokens a reading, every one of them forced by the grammar."""
    return {
        "type": "object",
        "properties": {
            "readings": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": readings,
                "maxItems": readings,
            },
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["readings", "unit"],
    }


def log(msg: str) -> None:
    print(f"[bench_structured] {msg}", file=sys.stderr, flush=True)


def varied_schemas() -> list[dict]:
    """50 schemas: nested objects, arrays, enums, bounded numbers, required fields."""
    out = []
    for name in ("person", "city", "book", "order", "device", "planet", "recipe", "car", "movie"):
        out += [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "id": {"type": "integer", "minimum": 0, "maximum": 1000},
                },
                "required": ["name", "id"],
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": [name, "other"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 10},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["kind", "score"],
            },
            {
                "type": "object",
                "properties": {
                    name: {
                        "type": "object",
                        "properties": {
                            "title": {"type": "string"},
                            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                        },
                        "required": ["title", "year"],
                    },
                    "valid": {"type": "boolean"},
                },
                "required": [name],
            },
            {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "label": {"type": "string"},
                                "count": {"type": "integer", "minimum": 1},
                            },
                            "required": ["label", "count"],
                        },
                        "minItems": 1,
                    }
                },
                "required": ["items"],
            },
            {"anyOf": [{"type": "string", "enum": [name, "none"]}, {"type": "integer"}]},
        ]
    return (out + [long_schema()] * 5)[:50]


def prompts(tokenizer, batch: int) -> list[list[int]]:
    base = tokenizer.encode("Temperature readings of a weather station, as JSON. Station")
    return [base + tokenizer.encode(f" {i + 1}:") for i in range(batch)]


class Clock:
    """Seconds the scheduler spends in the sampler (grammar masks included) and in the
    grammars' `accept`, wrapped in place: the constraint's own cost, which the load of other
    work on the machine inflates like everything else but cannot fake as a difference
    between the two kinds of run."""

    def __init__(self):
        from cadence.constrained.xgrammar_backend import XGrammarGrammar
        from cadence.model_executor import step_results

        self.seconds = {"sample": 0.0, "accept": 0.0}
        self._wrap(step_results, "sample", "sample")
        self._wrap(XGrammarGrammar, "accept", "accept")

    def _wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def decode_rates(engine, clock: Clock, batch: int, repeats: int, readings: int) -> dict:
    """Decode tok/s at `batch`, constrained ("c") and not ("u"), medians of alternating runs;
    and the constraint's share of the constrained runs' decode time ("share"): sampler and
    accept seconds of a constrained run less the sampler seconds of an unconstrained one."""
    ids = prompts(engine.tokenizer, batch)
    schema = json.dumps(long_schema(readings))
    constrained = {"temperature": 0, "max_new_tokens": 400, "json_schema": schema}
    warm = engine.generate(input_ids=ids, sampling_params=constrained)  # compiles, caches
    lengths = [r["meta_info"]["completion_tokens"] for r in warm]
    # Both kinds ask for exactly the tokens they write: the scheduler reserves KV pages for
    # max_new_tokens at admission, and a larger ask would admit fewer rows at once.
    forced = [dict(constrained, max_new_tokens=n) for n in lengths]
    free = [
        {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, "min_new_tokens": n}
        for n in lengths
    ]
    one = {"max_new_tokens": 1, "min_new_tokens": 0}
    # per run: (new tokens, seconds of the run, seconds of its prefill alone, sampler+accept)
    runs: dict[str, list[tuple[int, float, float, float]]] = {"c": [], "u": []}
    for _ in range(repeats):
        for kind, params in (("c", forced), ("u", free)):
            start = time.perf_counter()
            prefill_params = [dict(p, **one) for p in params]
            engine.generate(input_ids=ids, sampling_params=prefill_params)
            prefill = time.perf_counter() - start
            clock.reset()
            start = time.perf_counter()
            res = engine.generate(input_ids=ids, sampling_params=params)
            total = time.perf_counter() - start
            tokens = sum(r["meta_info"]["completion_tokens"] for r in res) - batch
            runs[kind].append((tokens, total, prefill, sum(clock.seconds.values())))
            name = "constrained" if kind == "c" else "unconstrained"
            log(
                f"  {name}: {tokens} new tokens in {total:.2f} s (prefill alone {prefill:.2f} s), "
                f"sampler+accept {clock.seconds['sample']:.2f}+{clock.seconds['accept']:.2f} s"
            )
    out = {}
    for kind in ("c", "u"):
        # The median prefill of the kind, subtracted from each run: one prefill timed alone
        # can swing by more than a short run lasts.
        prefill = statistics.median(r[2] for r in runs[kind])
        decode = [max(r[1] - prefill, 1e-3) for r in runs[kind]]
        out[kind] = statistics.median(r[0] / d for r, d in zip(runs[kind], decode))
        out[f"{kind}_decode_s"] = statistics.median(decode)
        out[f"{kind}_cost_s"] = statistics.median(r[3] for r in runs[kind])
    out["share"] = (out["c_cost_s"] - out["u_cost_s"]) / out["c_decode_s"]
    return out


def compile_times(engine, num_schemas: int | None = None) -> list[float]:
    """ms to compile each schema (the first `num_schemas`) cold, on the scheduler's thread
    (nothing else runs)."""
    from cadence.constrained import GrammarKey, create_backend

    def run(scheduler):
        runner = scheduler.runner
        backend = create_backend(
            engine.args.grammar_backend,
            engine.tokenizer,
            runner.config.vocab_size,
            sorted(scheduler.stops.eos_ids),
        )
        times = []
        for schema in varied_schemas()[:num_schemas]:
            start = time.perf_counter()
            backend.compile(GrammarKey("json_schema", json.dumps(schema)))
            times.append((time.perf_counter() - start) * 1e3)
        return times

    return engine.run_in_scheduler(run, timeout=600)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    batches = results["batches"]
    xs = range(len(batches))
    c = [results[f"constrained_tok_s_b{b}"] for b in batches]
    u = [results[f"unconstrained_tok_s_b{b}"] for b in batches]
    ax.bar([x - 0.2 for x in xs], u, 0.4, label="unconstrained")
    ax.bar([x + 0.2 for x in xs], c, 0.4, label="JSON schema")
    ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode throughput")
    ax.legend()
    ax2.hist(results["compile_ms"], bins=20)
    ax2.set_xlabel("compile time (ms)")
    ax2.set_ylabel("schemas")
    ax2.set_title(f"Grammar compile, p50 {results['compile_ms_p50']:.1f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--readings", type=int, default=48, help="integers of the decode schema (~4 tokens each)"
    )
    parser.add_argument("--schemas", type=int, default=None, help="compile only the first N")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--json", default=None, help="write the results as one flat JSON object")
    parser.add_argument(
        "--plot", default=None, help="PNG path (default: beside --json, or bench_results/)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure once at batch 1 and 4, with 4 readings and 5 schemas to compile: for CI",
    )
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.readings, args.schemas, args.batches = 1, 4, 5, [1, 4]

    from cadence import Engine

    log("loading the engine")
    engine = Engine(model_path=args.model_path, dtype=args.dtype, max_running_requests=64)
    clock = Clock()
    try:
        results: dict = {
            "dtype": args.dtype,
            "grammar_backend": engine.args.grammar_backend,
            "readings": args.readings,
            "repeats": args.repeats,
            "batches": args.batches,
        }
        for batch in args.batches:
            log(f"decode batch {batch}")
            rates = decode_rates(engine, clock, batch, args.repeats, args.readings)
            results[f"constrained_tok_s_b{batch}"] = rates["c"]
            results[f"unconstrained_tok_s_b{batch}"] = rates["u"]
            results[f"constraint_share_b{batch}"] = rates["share"]
        log("compile times")
        times = compile_times(engine, args.schemas)
    finally:
        engine.shutdown()
    results["compile_ms"] = times
    results["compile_ms_p50"] = statistics.median(times)
    results["compile_ms_p90"] = sorted(times)[int(len(times) * 0.9)]
    results["compile_ms_max"] = max(times)

    print(f"\nCadence structured output, {results['grammar_backend']}, dtype={args.dtype}")
    print(
        f"{'':10} {'constrained':>12} {'unconstrained':>14} {'ratio':>7} {'limit':>7}"
        f" {'constraint share':>17}"
    )
    for b in args.batches:
        c, u = results[f"constrained_tok_s_b{b}"], results[f"unconstrained_tok_s_b{b}"]
        limit = f">={TARGET_RATIO_B32}" if b == 32 else "-"
        share = results[f"constraint_share_b{b}"]
        print(f"{f'batch {b}':10} {c:12.1f} {u:14.1f} {c / u:7.2f} {limit:>7} {share:17.1%}")
    print(
        "constraint share: sampler and accept time a constrained run spends beyond an "
        "unconstrained one, of its decode time (1 - share: the ratio its own cost allows)"
    )
    print(
        f"compile ms over {len(times)} schemas: p50 {results['compile_ms_p50']:.1f}, "
        f"p90 {results['compile_ms_p90']:.1f}, max {results['compile_ms_max']:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in results.items() if k != "compile_ms"}, f, indent=2)
    path = args.plot or (
        os.path.splitext(args.json)[0] + ".png"
        if args.json
        else "bench_results/bench_structured.png"
    )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    plot(results, path)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
