"""The CUDA platform on a machine with an NVIDIA GPU: correctness of the graph path, and its
speed in process and served.

For the model given (the default SmolLM2-135M GGUF, dequantized to bfloat16), in one run:
  - greedy outputs with CUDA graphs against eager decode (--disable-cuda-graph), and with
    overlap scheduling against without (--disable-overlap-schedule), on 64 prompts whose
    lengths differ, so batches shrink through sizes between the buckets;
  - the chat answer ("the capital of France" should say Paris);
  - in-process decode tokens/s at 1, 8 and 32 streams (256 tokens each, median of 3) in
    each mode: eager (no graphs, no overlap), graphs (no overlap), overlap (graphs and
    overlap scheduling: the default);
  - host launches per decode step at one stream (torch profiler: kernel launches and graph
    launches the host issued, and the kernels the GPU ran);
  - NGRAM speculation against none on bench_speculative's workloads (repeat at 1 and 8
    streams, chat at 1), verify steps replaying the graphs: tok/s, greedy outputs equal,
    tokens per verify step (the `speculative` step);
  - served tokens/s over HTTP at 32 streams (`cadence serve`, streamed /generate), and its
    ratio to the in-process figure;
  - with --cpu-check, float32 greedy continuations against the CPU platform's.

Usage: python benchmarks/check_cuda.py --model-path M [--json out.json] [--skip-served]
       [--modes eager,graphs,overlap] [--no-dequantize] (a model that is not a GGUF file)
Not a test: it needs a GPU, which CI does not have. Progress goes to stderr; the figures
as JSON to stdout (and --json). Targets (issue: H100 or H200): b1 >= 600 tok/s, b32 >=
10,000 tok/s, served c=32 >= 0.8x in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
DECODE_TOKENS = 256
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def log(msg: str) -> None:
    print(f"[check_cuda] {msg}", file=sys.stderr, flush=True)


def engine(args, dtype: str, **extra):
    from cadence import Engine

    return Engine(
        model_path=args.model_path,
        dtype=dtype,
        dequantize=not args.no_dequantize,
        max_total_tokens=65536,
        **{"grammar_backend": "none", **extra},
    )


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, the tokens equal before the first difference."""
    out = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        out.append(n)
    return out


def many_prompts() -> tuple[list[str], list[dict]]:
    """64 prompts, each with its own length (16..48 tokens): requests end at different steps."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (example {i})" for i in range(64)]
    params = [{**GREEDY, "max_new_tokens": 16 + (i * 7) % 33} for i in range(64)]
    return prompts, params


def decode_speed(e, streams: int, repeats: int = 3) -> float:
    params = {"temperature": 0, "max_new_tokens": DECODE_TOKENS, "ignore_eos": True}
    rates = []
    for r in range(repeats):
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({r}.{i})" for i in range(streams)]
        t = time.perf_counter()
        out = e.generate(prompts, [params] * streams)
        dt = time.perf_counter() - t
        rates.append(sum(len(o["output_ids"]) for o in out) / dt)
    return statistics.median(rates)


def launches_per_step(e, tokens: int = 64) -> dict:
    """Host launch calls and GPU kernels per decode step at one stream, from a torch profile
    of one request (its prefill included, so slightly over the decode figure)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    e.generate(PROMPTS[0], params)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e.generate(PROMPTS[1], params)
        torch.cuda.synchronize()
    counts = {"kernel_launches": 0, "graph_launches": 0, "gpu_kernels": 0}
    for ev in prof.events():
        if ev.name in LAUNCH_NAMES:
            counts["kernel_launches"] += 1
        elif ev.name == "cudaGraphLaunch":
            counts["graph_launches"] += 1
        elif ev.device_type == torch.autograd.DeviceType.CUDA:
            counts["gpu_kernels"] += 1
    return {k: round(v / tokens, 1) for k, v in counts.items()}


MODES = {
    "eager": {"disable_cuda_graph": True, "disable_overlap_schedule": True},
    "graphs": {"disable_overlap_schedule": True},
    "overlap": {},
}


def in_process(args, res: dict) -> None:
    """One engine per mode, one after the other: equality, chat, speed, launches."""
    prompts, params = many_prompts()
    ids = {}
    for mode in args.modes.split(","):
        extra = MODES[mode]
        log(f"{mode}: starting an engine")
        t = time.perf_counter()
        e = engine(args, "bfloat16", **extra)
        res[f"{mode}_engine_start_s"] = round(time.perf_counter() - t, 1)
        try:
            ids[mode] = [o["output_ids"] for o in e.generate(prompts, params)]
            if "chat_answer" not in res:
                chat = e.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "What is the capital of France?"}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                res["chat_answer"] = e.generate(chat, {"temperature": 0, "max_new_tokens": 24})[
                    "text"
                ]
                log(f"chat: {res['chat_answer']!r}")
            for n in (1, 8, 32):
                res[f"{mode}_decode_tok_s_c{n}"] = round(decode_speed(e, n))
                log(f"{mode}: {n} streams: {res[f'{mode}_decode_tok_s_c{n}']} tok/s")
            res[f"{mode}_per_step_b1"] = launches_per_step(e)
            log(f"{mode}: per decode step at b=1: {res[f'{mode}_per_step_b1']}")
        finally:
            e.shutdown()
    for a, b in (("graphs", "eager"), ("overlap", "graphs")):
        if a in ids and b in ids:
            same = agreement(ids[a], ids[b])
            res[f"{a}_vs_{b}_prompts_equal"] = sum(
                s == len(x) == len(y) for s, x, y in zip(same, ids[a], ids[b])
            )
            res[f"{a}_vs_{b}_first_difference"] = [
                (i, s) for i, (s, x) in enumerate(zip(same, ids[a])) if s < len(x)
            ][:8]
            log(f"greedy, {a} vs {b}: {res[f'{a}_vs_{b}_prompts_equal']} of 64 prompts equal")


def other_paths(args, res: dict) -> None:
    """The default configuration's other paths: temperature sampling (on the device,
    overlapped), top-p (the portable sampler, not overlapped), and speculative decoding,
    whose verify steps run several rows per request through the attention kernel: how
    many greedy outputs equal those without it."""
    prompts = [f"{', '.join(str(k % 7) for k in range(i, i + 24))}," for i in range(8)]
    greedy = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    e = engine(args, "bfloat16")
    try:
        for name, extra in (("t08", {}), ("t08_top_p", {"top_p": 0.9})):
            params = {"temperature": 0.8, "max_new_tokens": 32, "ignore_eos": True, **extra}
            outs = e.generate(prompts, [params] * len(prompts))
            res[f"sampled_{name}_complete"] = all(len(o["output_ids"]) == 32 for o in outs)
        want = [o["output_ids"] for o in e.generate(prompts, [greedy] * len(prompts))]
    finally:
        e.shutdown()
    e = engine(args, "bfloat16", speculative_algorithm="NGRAM")
    try:
        got = e.generate(prompts, [greedy] * len(prompts))
    finally:
        e.shutdown()
    res["spec_vs_plain_prompts_equal"] = sum(o["output_ids"] == w for o, w in zip(got, want))
    res["spec_accepted_tokens"] = sum(
        (o["meta_info"].get("spec_accepted_tokens") or 0) for o in got
    )
    log(f"sampling and speculative decoding: {res}")


SPEC_CASES = (("repeat", 1), ("repeat", 8), ("chat", 1))
SPEC_ROUNDS = 3  # per case: each round new prompts, the engines in turns


def speculative(args, res: dict) -> None:
    """NGRAM speculation on the default configuration against none, as bench_speculative's
    workloads ask it (its prompts, chat-templated, 128 tokens each, greedy): decode tok/s
    of each case, the engines taking turns round by round, and the greedy outputs of every
    prompt equal or not. Verify steps replay the decode graphs, a row per token; the eager
    verify (graphs off) is timed on repeat c=1 for comparison."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_speculative import Prompts

    params = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}
    engines = {
        "off": engine(args, "bfloat16", max_running_requests=8),
        "on": engine(args, "bfloat16", max_running_requests=8, speculative_algorithm="NGRAM"),
        "on_eager": engine(
            args,
            "bfloat16",
            max_running_requests=8,
            speculative_algorithm="NGRAM",
            disable_cuda_graph=True,
        ),
    }
    prompts, equal, total, verify_ct, accepted = Prompts(), 0, 0, 0, 0
    try:
        tmpl = engines["off"].tokenizer
        for workload, c in SPEC_CASES:
            rates: dict[str, list[float]] = {}
            for r in range(SPEC_ROUNDS):
                batch = [
                    tmpl.apply_chat_template(
                        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                    )
                    for p in prompts.take(workload, f"c{c}-{r}", 2 * c)
                ]
                names = [n for n in engines if n != "on_eager" or (workload, c) == ("repeat", 1)]
                outs = {}
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    e, t, got = engines[name], time.perf_counter(), []
                    for k in range(0, len(batch), c):  # c at once
                        got += e.generate(batch[k : k + c], [params] * c)
                    dt = time.perf_counter() - t
                    rates.setdefault(name, []).append(sum(len(o["output_ids"]) for o in got) / dt)
                    outs[name] = got
                for a, b in zip(outs["off"], outs["on"]):
                    equal += a["output_ids"] == b["output_ids"]
                    total += 1
                    verify_ct += b["meta_info"].get("spec_verify_ct") or 0
                    accepted += b["meta_info"].get("spec_accepted_tokens") or 0
            key = f"{workload}_c{c}"
            for name, got in rates.items():
                res[f"spec_{name}_tok_s_{key}"] = round(statistics.median(got))
            res[f"spec_vs_base_{key}"] = round(
                statistics.median(a / b for a, b in zip(rates["on"], rates["off"])), 2
            )
            log(
                f"speculative {key}: { {n: round(statistics.median(g)) for n, g in rates.items()} }"
            )
    finally:
        for e in engines.values():
            e.shutdown()
    res["spec_greedy_equal"] = f"{equal}/{total}"
    res["spec_accept_len"] = round((accepted + verify_ct) / verify_ct, 2) if verify_ct else 0.0
    log(f"speculative: greedy equal {res['spec_greedy_equal']}, accept {res['spec_accept_len']}")


FEATURES = {
    "logprobs": {"return_logprob": True, "top_logprobs_num": 3},
    "penalties": {"sampling_params": {"frequency_penalty": 0.8, "repetition_penalty": 1.3}},
    "logit_bias": {"sampling_params": {"logit_bias": {"13": 5.0, "28": -100.0}}},
    "stop_string": {"sampling_params": {"stop": ["\n\n"], "ignore_eos": False}},
    "regex": {"sampling_params": {"regex": r"(yes|no), because [a-z ]{5,40}\."}},
    "json_schema": {
        "sampling_params": {
            "json_schema": json.dumps(
                {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            )
        }
    },
    "seeded_top_p": {"sampling_params": {"temperature": 0.9, "top_p": 0.8, "seed": 11}},
    "min_new_tokens": {"sampling_params": {"min_new_tokens": 20, "ignore_eos": False}},
}


def features(args, res: dict) -> None:
    """Each request feature on the default configuration (graphs and overlap) against eager
    decode: the same text, and logprobs within 0.05. Anything that reads the host on the
    way (penalties, bias, grammars, seeds, filters, logprobs) runs through these paths."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Case {i}." for i in range(6)]
    outs = {}
    for mode in ("eager", "overlap"):
        e = engine(args, "bfloat16", grammar_backend="xgrammar", **MODES[mode])
        try:
            outs[mode] = {}
            for name, extra in FEATURES.items():
                params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
                params.update(extra.get("sampling_params", {}))
                other = {k: v for k, v in extra.items() if k != "sampling_params"}
                outs[mode][name] = e.generate(prompts, [params] * len(prompts), **other)
            emb = engine(args, "bfloat16", is_embedding=True, **MODES[mode])
            try:
                outs[mode]["embedding"] = emb.encode(prompts)
            finally:
                emb.shutdown()
        finally:
            e.shutdown()
    for name in FEATURES:
        a, b = outs["overlap"][name], outs["eager"][name]
        same = sum(x["text"] == y["text"] for x, y in zip(a, b))
        res[f"feature_{name}_equal"] = f"{same}/{len(a)}"
    lp = [
        abs(p[0] - q[0])
        for x, y in zip(outs["overlap"]["logprobs"], outs["eager"]["logprobs"])
        for p, q in zip(
            x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
        )
    ]
    res["feature_logprobs_max_diff"] = round(max(lp), 4) if lp else None
    ea, eb = outs["overlap"]["embedding"], outs["eager"]["embedding"]
    res["feature_embedding_max_diff"] = round(
        max(abs(u - v) for x, y in zip(ea, eb) for u, v in zip(x["embedding"], y["embedding"])), 4
    )
    log(
        f"features, graphs+overlap vs eager: { {k: v for k, v in res.items() if k.startswith('feature_')} }"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream_all(port: int, streams: int, tokens: int) -> tuple[int, float]:
    import aiohttp

    async def one(session, i):
        body = {
            "text": f"{PROMPTS[i % len(PROMPTS)]} (served {i})",
            "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            "stream": True,
        }
        got = 0
        async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    got = json.loads(line[6:])["meta_info"]["completion_tokens"]
        return got

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(streams)))  # warm
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(streams)))
        return sum(counts), time.perf_counter() - t


def served(args, res: dict) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--model-path", args.model_path]
    cmd += ["--port", str(port), "--grpc-port", str(_free_port())]
    cmd += [] if args.no_dequantize else ["--dequantize"]
    cmd += ["--dtype", "bfloat16", "--grammar-backend", "none", "--max-total-tokens", "65536"]
    log("served: starting cadence serve")
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    try:
        import urllib.request

        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not come up") from None
                time.sleep(1)
        rates = []
        for _ in range(3):
            tokens, dt = asyncio.run(_stream_all(port, 32, DECODE_TOKENS))
            rates.append(tokens / dt)
        res["served_http_tok_s_c32"] = round(statistics.median(rates))
        inproc = res.get("overlap_decode_tok_s_c32")  # the server's defaults
        if inproc:
            res["served_vs_in_process_c32"] = round(res["served_http_tok_s_c32"] / inproc, 2)
        log(f"served over HTTP, 32 streams: {res['served_http_tok_s_c32']} tok/s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def cpu_agreement(args, res: dict) -> None:
    """float32 greedy on the GPU against the CPU platform (in a child process)."""
    cmd = [sys.executable, __file__, "--cpu-child", "--model-path", args.model_path]
    cpu = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, CADENCE_PLATFORM="cpu")
    )
    e = engine(args, "float32")
    try:
        gpu_ids = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
    finally:
        e.shutdown()
    cpu_ids = json.loads(cpu.communicate(timeout=900)[0].splitlines()[-1])
    res["float32_tokens_equal_to_cpu"] = agreement(gpu_ids, cpu_ids)
    log(f"float32 greedy, tokens equal to the CPU's: {res['float32_tokens_equal_to_cpu']}")


def plot(res: dict, path: str) -> None:
    """Decode tok/s per mode at 1, 8 and 32 streams (and served at 32), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = (1, 8, 32)
    modes = [m for m in MODES if f"{m}_decode_tok_s_c1" in res]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / (len(modes) + 1)
    for k, mode in enumerate(modes):
        xs = [i + k * width for i in range(len(streams))]
        ax.bar(xs, [res[f"{mode}_decode_tok_s_c{n}"] for n in streams], width, label=mode)
    if "served_http_tok_s_c32" in res:
        x = len(streams) - 1 + len(modes) * width
        ax.bar([x], [res["served_http_tok_s_c32"]], width, label="served over HTTP")
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(streams))])
    ax.set_xticklabels([f"{n} stream{'s' * (n > 1)}" for n in streams])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Cadence on {res.get('device', 'CUDA')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--modes", default="eager,graphs,overlap")
    parser.add_argument(
        "--steps",
        default="in_process,other_paths,speculative,features,served,cpu_agreement",
        help="which parts run (served unless --skip-served, cpu_agreement with --cpu-check)",
    )
    parser.add_argument("--no-dequantize", action="store_true")
    parser.add_argument("--plot", default=None, help="write a PNG of the tok/s figures")
    parser.add_argument(
        "--from-json", default=None, help="only plot the figures of an earlier run's --json"
    )
    parser.add_argument("--cpu-check", action="store_true")
    parser.add_argument("--cpu-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            plot(json.load(f), args.plot or "check_cuda.png")
        return 0
    if args.model_path is None:
        parser.error("--model-path is required (unless --from-json)")
    if args.cpu_child:
        e = engine(args, "float32")
        try:
            print(json.dumps([r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]))
        finally:
            e.shutdown()
        return 0

    import torch

    from cadence.platforms import current_platform

    res: dict = {"device": torch.cuda.get_device_name(0), "platform": current_platform.name}
    log(f"platform {res['platform']} on {res['device']}")

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)

    steps = [in_process, other_paths, speculative, features]
    steps += [] if args.skip_served else [served]
    steps += [cpu_agreement] if args.cpu_check else []
    steps = [step for step in steps if step.__name__ in args.steps.split(",")]
    for step in steps:
        try:
            step(args, res)
        except Exception as e:  # report what ran; the next phase may still work
            res[f"{step.__name__}_error"] = repr(e)
            log(f"{step.__name__} failed: {traceback.format_exc()}")
        save()
    print(json.dumps(res, indent=2))
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
