"""The CUDA platform against the CPU on one model, for a machine with an NVIDIA GPU.

  - greedy continuations in float32 on both (the CPU run in a child process with
    CADENCE_PLATFORM=cpu): how many tokens agree before the first difference;
  - the chat answer in bfloat16 on the GPU ("the capital of France" should say Paris);
  - in-process decode tokens/s in bfloat16 at 1, 8 and 32 streams (128 tokens each).

Usage: python benchmarks/check_cuda.py --model-path M [--dequantize] [--json out.json]
Not a test: it needs a GPU, which CI does not have. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


def log(msg: str) -> None:
    print(f"[check_cuda] {msg}", file=sys.stderr, flush=True)


def engine(args, dtype: str):
    from cadence import Engine

    extra = {"dequantize": True} if args.dequantize else {}
    return Engine(
        model_path=args.model_path,
        dtype=dtype,
        max_total_tokens=32768,
        grammar_backend=args.grammar_backend,
        **extra,
    )


def greedy_ids(args) -> list[list[int]]:
    e = engine(args, "float32")
    try:
        return [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
    finally:
        e.shutdown()


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, the tokens equal before the first difference."""
    out = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        out.append(n)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--grammar-backend", default="xgrammar")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_child:
        print(json.dumps(greedy_ids(args)))
        return 0

    import torch

    from cadence.platforms import current_platform

    res: dict = {"device": torch.cuda.get_device_name(0), "platform": current_platform.name}
    log(f"platform {res['platform']} on {res['device']}")
    cmd = [sys.executable, __file__, "--cpu-child", "--model-path", args.model_path]
    cmd += ["--grammar-backend", args.grammar_backend] + ["--dequantize"] * args.dequantize
    cpu = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, CADENCE_PLATFORM="cpu"),
    )
    gpu_ids = greedy_ids(args)
    cpu_ids = json.loads(cpu.communicate(timeout=600)[0].splitlines()[-1])
    res["greedy_tokens_equal"] = agreement(gpu_ids, cpu_ids)
    res["greedy_tokens_each"] = GREEDY["max_new_tokens"]
    log(f"float32 greedy, tokens equal to the CPU's: {res['greedy_tokens_equal']}")

    e = engine(args, "bfloat16")
    try:
        chat = e.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        res["chat_answer"] = e.generate(chat, {"temperature": 0, "max_new_tokens": 24})["text"]
        log(f"chat: {res['chat_answer']!r}")
        params = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}
        e.generate(PROMPTS[0], {**params, "max_new_tokens": 8})  # warm-up
        for n in (1, 8, 32):
            prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(n)]
            t = time.perf_counter()
            out = e.generate(prompts if n > 1 else prompts[0], params)
            dt = time.perf_counter() - t
            tokens = sum(len(r["output_ids"]) for r in (out if n > 1 else [out]))
            res[f"decode_tok_s_c{n}"] = tokens / dt
            log(f"{n} streams: {tokens / dt:.0f} tok/s")
    finally:
        e.shutdown()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
