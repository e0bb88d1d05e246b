"""Load and bare transports for the front benchmarks (bench_grpc_vs_http.py, bench_front.py).

The bare transports (a grpc.aio echo servicer, a uvicorn SSE/JSON echo app) and the load
generators (grpc.aio and aiohttp closed loops, or wrk) each run in a process of their own,
as `python front_load.py --role grpc-echo|http-echo|load ...`; `measure` starts one load
phase and reads its one JSON line, and `Processes`, `wait_for`, `http_ok`, `grpc_ok` start
and watch the servers. Not a test, and not imported by Cadence.
"""

from __future__ import annotations

import os

from cadence import envs  # noqa: E402

envs.set_openmp_defaults()  # as `cadence serve` gives its children; before anything loads OpenMP

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest."
STREAM_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle gear system works.",
    "Tell me a story about a lighthouse keeper.",
    "List some tips for a healthy garden.",
]


def log(msg: str) -> None:
    print(f"[front_load] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- bare transports (each run as `python front_load.py --role ...`) -------------


ECHO_STEP_S = float(
    os.environ.get("CADENCE_ECHO_STEP_S", "0.1")
)  # pause between bare-stream messages: about one engine step at c=32 (bench_front.py sets 0: the transport at full speed)


def echo_meta(completion_tokens: int) -> dict:
    """A meta_info of the size the server sends (gRPC carries it as a string map)."""
    return {
        "id": '"0123456789abcdef0123456789abcdef"',
        "prompt_tokens": "12",
        "completion_tokens": str(completion_tokens),
        "cached_tokens": "0",
        "finish_reason": "null",
        "e2e_latency": "0.123",
    }


def serve_grpc_echo(port: int) -> None:
    """grpc.aio on uvloop answering Tokenize with the text echoed: no tokenizer, no engine."""
    import grpc
    import uvloop

    from cadence.grpc import sglang_pb2 as pb
    from cadence.grpc import sglang_pb2_grpc

    class Echo(sglang_pb2_grpc.SglangServiceServicer):
        async def Tokenize(self, request, context):
            return pb.TokenizeResponse(
                tokens=[1, 2, 3], count=3, max_model_len=8192, input_text=request.text
            )

        async def TextGenerate(self, request, context):
            # One message per "token", paced like engine steps: the transport's own streaming cost.
            n = request.sampling_params.max_new_tokens or 16
            for i in range(n):
                await asyncio.sleep(ECHO_STEP_S)
                yield pb.TextGenerateResponse(
                    text=" x", meta_info=echo_meta(i + 1), finished=i == n - 1
                )

    async def main():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        sglang_pb2_grpc.add_SglangServiceServicer_to_server(Echo(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def serve_http_echo(port: int) -> None:
    """A bare ASGI app on uvicorn (uvloop) echoing a JSON body: no framework."""
    import msgspec
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = msgspec.json.decode(body)
        if scope["path"] == "/generate":  # SSE, one event per "token", paced like engine steps
            n = request.get("sampling_params", {}).get("max_new_tokens", 16)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i in range(n):
                await asyncio.sleep(ECHO_STEP_S)
                # The server's JSON meta_info holds numbers (gRPC's map holds strings).
                meta = {**echo_meta(i + 1), "completion_tokens": i + 1, "prompt_tokens": 12}
                chunk = {"text": " x", "output_ids": [1], "meta_info": meta}
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + msgspec.json.encode(chunk) + b"\n\n",
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        out = msgspec.json.encode(
            {"tokens": [1, 2, 3], "count": 3, "max_model_len": 8192, "input": request}
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})

    # The HTTP stack `cadence serve` runs (uvicorn picks httptools when installed, else h11).
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        lifespan="off",
    )


# ---- load generators (`--role load`: one JSON line) -----------

WARMUP_S = 1.0  # load before each measured window opens (connections up, the server busy)
FIRST_UNIT_TIMEOUT_S = 120.0  # the window waits this long at most for the first unit


async def _closed_loop(concurrency: int, duration: float, one, warmup: float = WARMUP_S) -> dict:
    """`concurrency` workers call `one()` back to back; counts what completes in the window
    [start + `warmup` s, + duration]. `one` returns the number of units (requests or
    tokens) it completed, or takes a `count` callback for units inside a call (streams)."""
    counted = 0
    window = {"open": False, "stop": False, "started": False}

    def count(n: int) -> None:
        nonlocal counted
        window["started"] = window["started"] or n > 0
        if window["open"]:
            counted += n

    async def worker():
        while not window["stop"]:
            await one(count)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    # The window opens once the load is flowing: on a busy machine the first units may take
    # longer than the warm-up, and a window before them measures the start, not the rate.
    deadline = time.perf_counter() + FIRST_UNIT_TIMEOUT_S
    while not window["started"] and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    print("window-open", flush=True)  # the parent samples the front's CPU time on these lines
    window["open"] = True
    start = time.perf_counter()
    await asyncio.sleep(duration)
    window["open"] = False
    elapsed = time.perf_counter() - start
    print("window-closed", flush=True)
    window["stop"] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"units": counted, "elapsed_s": elapsed, "per_s": counted / elapsed}


async def _grpc_load(
    target: str,
    kind: str,
    concurrency: int,
    duration: float,
    stream_tokens: int,
    num_channels: int,
    warmup: float = WARMUP_S,
) -> dict:
    import grpc

    from cadence.grpc import sglang_pb2 as pb
    from cadence.grpc import sglang_pb2_grpc

    channels = [grpc.aio.insecure_channel(target) for _ in range(num_channels)]
    stubs = [sglang_pb2_grpc.SglangServiceStub(c) for c in channels]
    turn = 0

    def stub():
        nonlocal turn
        turn += 1
        return stubs[turn % len(stubs)]

    if kind == "tokenize":
        req = pb.TokenizeRequest(text=PROMPT)

        async def one(count):
            await stub().Tokenize(req)
            count(1)
    elif kind == "generate1":
        req = pb.TextGenerateRequest(
            text=PROMPT, sampling_params=pb.SamplingParams(max_new_tokens=1, temperature=0)
        )

        async def one(count):
            async for _ in stub().TextGenerate(req):
                pass
            count(1)
    else:
        reqs = [
            pb.TextGenerateRequest(
                text=p,
                stream=True,
                sampling_params=pb.SamplingParams(
                    max_new_tokens=stream_tokens, ignore_eos=True, temperature=0
                ),
            )
            for p in STREAM_PROMPTS
        ]

        async def one(count):
            seen = 0
            async for msg in stub().TextGenerate(reqs[turn % len(reqs)]):
                done = int(msg.meta_info["completion_tokens"])
                count(done - seen)
                seen = done

    result = await _closed_loop(concurrency, duration, one, warmup)
    for c in channels:
        await c.close()
    return result


async def _http_load(
    url: str,
    kind: str,
    concurrency: int,
    duration: float,
    stream_tokens: int,
    model: str | None,
    warmup: float = WARMUP_S,
) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=600),
        headers={"Content-Type": "application/json"},  # a gateway refuses other types (415)
    ) as session:
        if kind == "tokenize":
            body = json.dumps({"prompt": PROMPT}).encode()

            async def one(count):
                async with session.post(url + "/tokenize", data=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                count(1)
        elif kind == "generate1":
            body = json.dumps(
                {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            ).encode()

            async def one(count):
                async with session.post(url + "/generate", data=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                count(1)
        else:
            extra = {"model": model} if model else {}  # a gateway routes by model
            bodies = [
                json.dumps(
                    {
                        "text": p,
                        "stream": True,
                        "sampling_params": {
                            "max_new_tokens": stream_tokens,
                            "ignore_eos": True,
                            "temperature": 0,
                        },
                        **extra,
                    }
                ).encode()
                for p in STREAM_PROMPTS
            ]
            turn = 0

            async def one(count):
                # Counted by completion_tokens: events may carry the output so far (SGLang's
                # default shape) or only what is new, and SMG repeats the last ids at the end.
                nonlocal turn
                turn += 1
                seen = 0
                async with session.post(url + "/generate", data=bodies[turn % len(bodies)]) as r:
                    assert r.status == 200, r.status
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            done = json.loads(line[6:])["meta_info"]["completion_tokens"]
                            count(done - seen)
                            seen = done

        return await _closed_loop(concurrency, duration, one, warmup)


def _wrk_load(url: str, kind: str, concurrency: int, duration: float) -> dict:
    route, body = (
        ("/tokenize", {"prompt": PROMPT})
        if kind == "tokenize"
        else (
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        )
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(body))}\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        script = f.name
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{concurrency}",
                f"-d{max(1, round(duration))}s",
                "-s",
                script,
                url + route,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(script)
    rps = float(
        next(line.split()[1] for line in out.splitlines() if line.startswith("Requests/sec"))
    )
    return {"units": None, "elapsed_s": duration, "per_s": rps}


def run_load(args) -> None:
    import uvloop

    if args.client == "wrk":
        result = _wrk_load(args.target, args.kind, args.concurrency, args.duration)
    elif args.target.startswith("http"):
        result = uvloop.run(
            _http_load(
                args.target,
                args.kind,
                args.concurrency,
                args.duration,
                args.stream_tokens,
                args.model,
                args.warmup,
            )
        )
    else:
        result = uvloop.run(
            _grpc_load(
                args.target,
                args.kind,
                args.concurrency,
                args.duration,
                args.stream_tokens,
                args.grpc_channels,
                args.warmup,
            )
        )
    print(json.dumps(result))


# ---- the orchestrating process ------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def measure(
    target: str,
    kind: str,
    concurrency: int,
    args,
    cpu_pid: int | None = None,
    client: str = "python",
    stream_tokens: int | None = None,
    model: str | None = None,
    gateway_pid: int | None = None,
) -> dict:
    """One phase's load; with `cpu_pid` (and `gateway_pid`) the CPU seconds that process
    spent inside the measured window."""
    duration = args.stream_duration if kind == "stream" else args.duration
    stream_tokens = stream_tokens or args.stream_tokens
    cmd = [
        sys.executable,
        __file__,
        "--role",
        "load",
        "--target",
        target,
        "--kind",
        kind,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--stream-tokens",
        str(stream_tokens),
        "--client",
        client,
        "--grpc-channels",
        str(args.grpc_channels),
        "--warmup",
        str(getattr(args, "load_warmup", WARMUP_S)),  # a benchmark's --smoke shortens it
    ]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    cpu = before = gateway_cpu = gateway_before = None
    lines = []
    for line in proc.stdout:  # the window markers arrive as they happen
        line = line.strip()
        if line == "window-open" and cpu_pid is not None:
            before = cpu_seconds(cpu_pid)
            if gateway_pid is not None:
                gateway_before = cpu_seconds(gateway_pid)
        elif line == "window-closed" and before is not None:
            cpu = cpu_seconds(cpu_pid) - before
            if gateway_before is not None:
                gateway_cpu = cpu_seconds(gateway_pid) - gateway_before
        else:
            lines.append(line)
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(f"the {kind} load on {target} failed (exit {proc.returncode})")
    result = json.loads(lines[-1])
    result["front_cpu_s"] = cpu
    result["gateway_cpu_s"] = gateway_cpu
    return result


class Processes:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="bench-grpc-http-")

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_path = os.path.join(self.tmp, f"{name}.log")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc.log_path = log_path  # wait_for quotes it when the process exits early
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def wait_for(check, what: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(proc)}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not come up in {timeout:.0f}s")


def log_tail(proc: subprocess.Popen, chars: int = 2000) -> str:
    """The end of a spawned process's log: the benchmark removes its log folder when it
    stops, and a start that failed should say why."""
    try:
        with open(proc.log_path, "rb") as f:
            return f.read()[-chars:].decode(errors="replace")
    except (AttributeError, OSError):
        return "(no log)"


def http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def grpc_ok(target: str) -> bool:
    import grpc

    from cadence.grpc import sglang_pb2 as pb
    from cadence.grpc import sglang_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        sglang_pb2_grpc.SglangServiceStub(channel).Tokenize(
            pb.TokenizeRequest(text="up?"), timeout=2
        )
    return True


def urllib_post_ok(url: str) -> bool:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps({"prompt": "up?"}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=2) as r:
        return r.status == 200


def main(argv: list[str] | None = None) -> int:
    """The child roles: a bare transport, or one load phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("grpc-echo", "http-echo", "load"), required=True)
    parser.add_argument("--port", type=int)
    parser.add_argument("--target")
    parser.add_argument("--kind")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument(
        "--warmup", type=float, default=WARMUP_S, help="seconds of load before the window"
    )
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--client", default="python")
    parser.add_argument("--grpc-channels", type=int, default=4)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    if args.role == "grpc-echo":
        serve_grpc_echo(args.port)
    elif args.role == "http-echo":
        serve_http_echo(args.port)
    else:
        run_load(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
