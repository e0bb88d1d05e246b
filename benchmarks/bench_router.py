"""Router overhead: requests/s and added latency of `cadence router` and of smg.

Not a test. One run starts, each in its own process:
  - a fast upstream (bare aiohttp on uvloop) that answers chat completions at once,
    as one JSON body or as an SSE stream of small events;
  - our router in front of it (`python -m cadence.router`);
  - smg (SGLang's Rust model gateway, `pip install smg`) in front of the same upstream;
and drives each of direct / ours / smg with load from a separate process (wrk when it
is installed, `apt-get install wrk`; else an aiohttp client) at concurrency 1 and 64,
non-streaming and streaming. Prints a table with the ratios and the targets:
  added p50 latency of ours <= 0.5 ms at c=1; ours >= 0.7x smg's requests/s at c=64.
With --stacks it also measures the floor and the ceiling of the stack choice: a bare
30-line aiohttp server + ClientSession proxy, and a FastAPI + httpx proxy on uvicorn.

    .venv/bin/python benchmarks/bench_router.py [--duration 5] [--json out.json] [--png out.png]
        [--stacks] [--no-smg] [--no-install] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TARGET_ADDED_P50_MS = 0.5
TARGET_RPS_VS_SMG = 0.7
SMG_VERSION = "1.13.0"
MODEL = "bench-model"
NUM_STREAM_EVENTS = 8
STACKS = ("bare_aiohttp", "fastapi_httpx")  # extra targets with --stacks
PROXIES = ("ours", "smg", *STACKS)  # everything measured against direct
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 16,
}

# -- the upstream ----------------------------------------------------------------------


def run_upstream(port: int) -> None:
    """A fast fake worker: health, models, chat completions (JSON or SSE)."""
    import uvloop
    from aiohttp import web

    completion = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello there!"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }
    ).encode()
    events = [
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
        for i in range(NUM_STREAM_EVENTS)
    ] + [b"data: [DONE]\n\n"]

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body and b'"stream":true' not in body:
            return web.Response(body=completion, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/{tail:.*}", ok)
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop()
    )


# -- bare proxies of other stacks (--stacks) --------------------------------------------


def run_bare_aiohttp_proxy(port: int, upstream: str) -> None:
    """The smallest aiohttp server + ClientSession proxy: the floor of the aiohttp stack."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def proxy(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        async with session.post(upstream + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as up:  # fmt: skip
            if up.content_type != "text/event-stream":
                return web.Response(
                    status=up.status, body=await up.read(), content_type=up.content_type
                )
            response = web.StreamResponse(
                status=up.status, headers={"Content-Type": "text/event-stream"}
            )
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session_ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/health", health)
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop()
    )


def run_fastapi_httpx_proxy(port: int, upstream: str) -> None:
    """FastAPI on uvicorn relaying through httpx: the stack the router did not choose."""
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    app = FastAPI()
    client = httpx.AsyncClient(
        base_url=upstream, timeout=60, limits=httpx.Limits(max_connections=None)
    )

    async def proxy(request: Request) -> Response:
        req = client.build_request("POST", "/v1/chat/completions", content=await request.body(),
                                   headers={"Content-Type": "application/json"})  # fmt: skip
        up = await client.send(req, stream=True)
        if up.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(up.aiter_raw(), status_code=up.status_code,
                                     media_type="text/event-stream", background=BackgroundTask(up.aclose))  # fmt: skip
        content = await up.aread()
        await up.aclose()
        return Response(
            content, status_code=up.status_code, media_type=up.headers.get("content-type")
        )

    async def health(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    # Plain routes: the bench script's string annotations would defeat FastAPI's injection.
    app.router.add_route("/v1/chat/completions", proxy, methods=["POST"])
    app.router.add_route("/health", health, methods=["GET"])
    uvicorn.run(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop"
    )


# -- load generation -------------------------------------------------------------------


def run_aiohttp_load(url: str, concurrency: int, duration: float, body: str) -> None:
    """Closed-loop load: `concurrency` clients back to back; prints one JSON line."""
    import aiohttp
    import uvloop

    async def main() -> dict:
        latencies: list[float] = []
        errors = 0
        deadline = time.perf_counter() + duration
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client() -> None:
                nonlocal errors
                while time.perf_counter() < deadline:
                    start = time.perf_counter()
                    async with session.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        if r.status != 200:
                            errors += 1
                    latencies.append(time.perf_counter() - start)

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            elapsed = time.perf_counter() - started
        latencies.sort()
        return {
            "rps": len(latencies) / elapsed,
            "p50_ms": latencies[len(latencies) // 2] * 1000,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
            "errors": errors,
            "requests": len(latencies),
        }

    print(json.dumps(uvloop.run(main())))


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def parse_wrk(output: str) -> dict:
    def latency(pct: str) -> float:
        match = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M)
        if match is None:
            raise RuntimeError(f"no {pct}% line in wrk output:\n{output}")
        return float(match.group(1)) * _WRK_UNITS[match.group(2)]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    requests = int(re.search(r"(\d+) requests in", output).group(1))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", output))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors += int(non_2xx.group(1)) if non_2xx else 0
    return {
        "rps": rps,
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
        "errors": errors,
        "requests": requests,
    }


class Load:
    """Runs one measurement from a separate process with wrk or the aiohttp loader."""

    def __init__(self, client: str, workdir: Path) -> None:
        self.client = client
        self.workdir = workdir

    def measure(self, url: str, concurrency: int, duration: float, stream: bool) -> dict:
        body = json.dumps({**REQUEST, "stream": stream})
        if self.client == "wrk":
            script = self.workdir / f"post_{int(stream)}.lua"
            escaped = body.replace("\\", "\\\\").replace('"', '\\"')
            script.write_text(
                f'wrk.method = "POST"\nwrk.body = "{escaped}"\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
            )
            cmd = [
                "wrk",
                "-t1",
                f"-c{concurrency}",
                f"-d{max(1, round(duration))}s",
                "--latency",
                "-s",
                str(script),
                url,
            ]
            out = subprocess.run(
                cmd, capture_output=True, text=True, check=True, timeout=duration + 30
            )
            return parse_wrk(out.stdout)
        cmd = [sys.executable, __file__, "_load", url, str(concurrency), str(duration), body]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=duration + 30)
        return json.loads(out.stdout.strip().splitlines()[-1])


# -- processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout}s")


def http_ok(url: str, data: bytes | None = None) -> bool:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=2) as resp:
        return resp.status == 200


def find_smg(install: bool) -> str | None:
    candidate = Path(sys.executable).parent / "smg"
    found = str(candidate) if candidate.exists() else shutil.which("smg")
    if found or not install:
        return found
    print(f"smg not found; installing smg=={SMG_VERSION} into this environment ...", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"smg=={SMG_VERSION}"])
    if result.returncode != 0:
        return None
    return str(candidate) if candidate.exists() else shutil.which("smg")


class Fleet:
    """The upstream and the two routers, each a child process, all stopped on exit."""

    def __init__(self, with_smg: bool, install_smg: bool, with_stacks: bool = False) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="bench_router_"))
        self.urls: dict[str, str] = {}
        self.with_smg = with_smg
        self.install_smg = install_smg
        self.with_stacks = with_stacks

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.logdir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def start(self) -> None:
        up_port, ours_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        self._spawn("upstream", [sys.executable, __file__, "_upstream", str(up_port)])
        wait_until(lambda: http_ok(upstream + "/health"), "upstream", 20)
        self.urls["direct"] = upstream
        self._spawn(
            "ours",
            [sys.executable, "-m", "cadence.router", "--port", str(ours_port), "--worker-urls", upstream,
             "--log-level", "warning", "--health-check-startup-interval-secs", "0.1"],
        )  # fmt: skip
        ours = f"http://127.0.0.1:{ours_port}"
        wait_until(lambda: http_ok(ours + "/ready"), "cadence router", 30)
        self.urls["ours"] = ours
        if self.with_stacks:
            for name in STACKS:
                port = free_port()
                self._spawn(name, [sys.executable, __file__, "_" + name, str(port), upstream])
                stack_url = f"http://127.0.0.1:{port}"
                wait_until(lambda: http_ok(stack_url + "/health"), name, 30)
                self.urls[name] = stack_url
        smg = find_smg(self.install_smg) if self.with_smg else None
        if smg is None:
            if self.with_smg:
                print("smg is not available: its columns stay empty (pip install smg to fill them)")
            return
        smg_port = free_port()
        # No grace period at shutdown: nothing is in flight when the run stops it (SMG would
        # otherwise wait ~5 s before exiting).
        self._spawn(
            "smg",
            [smg, "launch", "--worker-urls", upstream, "--host", "127.0.0.1", "--port", str(smg_port),
             "--policy", "round_robin", "--log-level", "warn", "--shutdown-grace-period-secs", "0"],
        )  # fmt: skip
        smg_url = f"http://127.0.0.1:{smg_port}"
        probe = json.dumps(REQUEST).encode()
        wait_until(lambda: http_ok(smg_url + "/v1/chat/completions", probe), "smg", 60)
        self.urls["smg"] = smg_url

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- report ----------------------------------------------------------------------------


def key(target: str, metric: str, concurrency: int, stream: bool) -> str:
    return f"{target}{'_stream' if stream else ''}_{metric}_c{concurrency}"


def derive(results: dict) -> None:
    """Add added-latency and ratio keys next to the raw figures (in place)."""
    for stream in (False, True):
        for c in (1, 64):
            direct = {
                m: results.get(key("direct", m, c, stream)) for m in ("p50_ms", "p99_ms", "rps")
            }
            for target in PROXIES:
                for m in ("p50_ms", "p99_ms"):
                    value = results.get(key(target, m, c, stream))
                    added = (
                        None if value is None or direct[m] is None else round(value - direct[m], 4)
                    )
                    results[key(target, "added_" + m, c, stream)] = added
                rps = results.get(key(target, "rps", c, stream))
                results[key(target, "rps_vs_direct", c, stream)] = (
                    None if rps is None or not direct["rps"] else round(rps / direct["rps"], 3)
                )
            ours, smg = (
                results.get(key("ours", "rps", c, stream)),
                results.get(key("smg", "rps", c, stream)),
            )
            results[key("ours", "rps_vs_smg", c, stream)] = (
                None if not smg or ours is None else round(ours / smg, 3)
            )


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: dict) -> None:
    print()
    header = f"{'mode':<8}{'c':>4}  {'target':<15}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'vs direct':>10}"
    print(header)
    print("-" * len(header))
    for stream in (False, True):
        for c in (1, 64):
            for target in ("direct", *PROXIES):
                rps = results.get(key(target, "rps", c, stream))
                if rps is None:
                    continue
                print(
                    f"{'stream' if stream else 'json':<8}{c:>4}  {target:<15}{rps:>9.0f}"
                    f"{fmt(results.get(key(target, 'p50_ms', c, stream))):>9}"
                    f"{fmt(results.get(key(target, 'p99_ms', c, stream))):>9}"
                    f"{fmt(results.get(key(target, 'added_p50_ms', c, stream))):>9}"
                    f"{fmt(results.get(key(target, 'added_p99_ms', c, stream))):>9}"
                    f"{fmt(results.get(key(target, 'rps_vs_direct', c, stream)), '.2f'):>10}"
                )
    print()
    added = results.get("ours_added_p50_ms_c1")
    ratio = results.get("ours_rps_vs_smg_c64")
    print(f"ours added p50 at c=1 (json):  {fmt(added, '.3f')} ms   target <= {TARGET_ADDED_P50_MS} ms   "
          f"{'MET' if added is not None and added <= TARGET_ADDED_P50_MS else 'NOT MET'}")  # fmt: skip
    print(f"smg  added p50 at c=1 (json):  {fmt(results.get('smg_added_p50_ms_c1'), '.3f')} ms")
    print(f"ours / smg req/s at c=64 (json): {fmt(ratio, '.2f')}   target >= {TARGET_RPS_VS_SMG}   "
          f"{'MET' if ratio is not None and ratio >= TARGET_RPS_VS_SMG else 'NOT MET' if ratio else 'no smg'}")  # fmt: skip
    print(
        f"ours / smg req/s at c=64 (stream): {fmt(results.get('ours_stream_rps_vs_smg_c64'), '.2f')}"
    )


def write_chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(s, c) for s in (False, True) for c in (1, 64)]
    labels = [f"{'stream' if s else 'json'} c={c}" for s, c in groups]
    targets = [t for t in ("direct", *PROXIES) if results.get(key(t, "rps", 64, False)) is not None]
    colors = dict(
        zip(("direct", *PROXIES), ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red"))
    )
    fig, (ax_rps, ax_lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        xs = [g - 0.4 + (i + 0.5) * width for g in range(len(groups))]
        rps = [results.get(key(target, "rps", c, s)) or 0 for s, c in groups]
        ax_rps.bar(xs, rps, width, label=target, color=colors[target])
        if target != "direct":
            lat = [results.get(key(target, "added_p50_ms", c, s)) or 0 for s, c in groups]
            ax_lat.bar(xs, lat, width, label=target, color=colors[target])
    ax_rps.set_title("requests/s (higher is better)")
    ax_lat.set_title("added p50 latency vs direct, ms (lower is better)")
    ax_lat.set_yscale("symlog", linthresh=1.0)
    ax_lat.axhline(
        TARGET_ADDED_P50_MS, color="gray", linestyle="--", linewidth=1, label="target at c=1"
    )
    for ax in (ax_rps, ax_lat):
        ax.set_xticks(range(len(groups)), labels)
        ax.legend()
    fig.suptitle(
        f"router overhead in front of a fast upstream ({os.cpu_count()} CPUs, load: {results['load_client']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of unmeasured load before each"
    )
    parser.add_argument("--json", help="write the figures as one flat JSON object here")
    parser.add_argument("--png", default="bench_results/bench_router.png", help="chart path")
    parser.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto")
    parser.add_argument("--no-smg", action="store_true", help="skip smg")
    parser.add_argument(
        "--no-install", action="store_true", help="do not pip install smg when missing"
    )
    parser.add_argument("--stacks", action="store_true",
                        help="also measure a bare aiohttp proxy and a FastAPI+httpx proxy (the stack choice)")  # fmt: skip
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every target and phase for 0.2 s, no warm-up, smg only if it is already "
        "installed: for CI",
    )
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.warmup, args.no_install = 0.2, 0.0, True
    client = args.client if args.client != "auto" else ("wrk" if shutil.which("wrk") else "aiohttp")
    fleet = Fleet(
        with_smg=not args.no_smg, install_smg=not args.no_install, with_stacks=args.stacks
    )
    results: dict = {
        "load_client": client,
        "duration_s": args.duration,
        "cpu_count": os.cpu_count(),
    }
    try:
        print(f"starting upstream and proxies (logs in {fleet.logdir}) ...", flush=True)
        fleet.start()
        load = Load(client, fleet.logdir)
        runs = [(s, c, t) for s in (False, True) for c in (1, 64) for t in fleet.urls]
        for n, (stream, c, target) in enumerate(runs, 1):
            url = fleet.urls[target] + "/v1/chat/completions"
            if args.warmup > 0:
                load.measure(url, c, args.warmup, stream)
            figures = load.measure(url, c, args.duration, stream)
            for metric in ("rps", "p50_ms", "p99_ms", "errors"):
                results[key(target, metric, c, stream)] = round(figures[metric], 4)
            print(
                f"[{n:>2}/{len(runs)}] {'stream' if stream else 'json':<6} c={c:<3} {target:<14}"
                f" {figures['rps']:>8.0f} req/s  p50 {figures['p50_ms']:.3f} ms  p99 {figures['p99_ms']:.3f} ms"
                f"  errors {figures['errors']}",
                flush=True,
            )
    finally:
        fleet.stop()
    derive(results)
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
        print(f"wrote {args.json}")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        write_chart(results, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        run_upstream(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_bare_aiohttp":
        run_bare_aiohttp_proxy(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_fastapi_httpx":
        run_fastapi_httpx_proxy(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_load":
        run_aiohttp_load(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
