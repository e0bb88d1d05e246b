"""Launched servers for the end-to-end tests, started together and stopped without a trace.

`server` is the one shared server most tests talk to. The other `*_server` fixtures are
short-lived servers that a single test takes apart (signals, killed children, API key,
tiny queues). Whichever server a test asks for first, every server that the collected
tests will need is launched at that moment, in parallel, so their loads overlap; each
fixture then waits only for its own. At the end of the session every server still up is
stopped, and no process started by any of them may be left.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import httpx
import openai
import pytest
from e2e_server import (
    API_KEY,
    PIPELINE_YAML,
    PLUGINS_DIR,
    SESSION_TAG,
    Server,
    fault_plugin_env,
    is_idle,
    pipeline_env,
    tagged_pids,
    wait_until,
    zero_cost_env,
)
from embedding_models import CLASSIFIER_PATH, MINILM_PATH, classifier_env
from lora_adapters import LORA_DIR, lora_env
from pd_servers import PD_ARGS

from cadence.chat_templates import template_path

sys.path.append(PLUGINS_DIR)  # the tests read the fault-injection plugin's markers

_SMALL = ["--max-total-tokens", "2048", "--skip-warmup"]
KV_EVENTS_DIR = os.path.join(tempfile.gettempdir(), f"cadence-e2e-kv-events-{SESSION_TAG[:12]}")
KV_EVENTS_CONFIG = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": f"ipc://{KV_EVENTS_DIR}-pub",
        "replay_endpoint": f"ipc://{KV_EVENTS_DIR}-replay",
        "topic": "kv",
    }
)
SERVER_SPECS: dict[str, list[str]] = {
    # Warm-up on: /health must stay 503 until the warm-up generation has passed.
    "server": ["--max-total-tokens", "16384", "--chunked-prefill-size", "512"],
    "api_key_server": ["--api-key", API_KEY, *_SMALL],
    # At most 1 running + 1 queued request: the third one in flight is refused with 429.
    "overload_server": ["--max-running-requests", "1", "--max-queued-requests", "1", *_SMALL],
    # What `cadence serve` runs without a --dtype: bfloat16 on CPUs with bfloat16 instructions.
    "auto_dtype_server": ["--dtype", "auto", *_SMALL],
    "sigterm_server": _SMALL,
    "sigint_server": _SMALL,
    "kill_scheduler_server": _SMALL,
    "kill_detokenizer_server": _SMALL,
    "kill_front_server": _SMALL,
    # The hardening tests: the fault-injection plugin (a marked request fails inside the
    # server) and two test logit processors, a short server-side deadline so fuzzed requests
    # stay short, small pools; and the flags of SGLang's extras the shared server keeps off.
    "fuzz_server": [
        *("--max-total-tokens", "4096", "--request-timeout-s", "5", "--skip-warmup"),
        *("--enable-custom-logit-processor", "--enable-return-hidden-states"),
        *("--enable-priority-scheduling", "--incremental-streaming-output"),
        *("--strict-model-name", "--served-model-name", "tiny,tiny-alias"),
    ],
    # Speculative decoding (test_speculative_e2e.py): the same text as `server`, faster.
    "spec_server": ["--speculative-algorithm", "NGRAM", *_SMALL],
    # A short watchdog: SIGSTOP of a child must bring the server down within seconds.
    "stall_server": ["--watchdog-timeout", "3", *_SMALL],
    # Two front processes over one scheduler (test_api_workers.py), each logging the requests
    # it serves in full.
    "workers_server": [
        *("--api-workers", "2", "--max-total-tokens", "4096", "--skip-warmup"),
        *("--log-requests", "--log-requests-level", "3"),
    ],
    # The zero-cost model runner (a plugin): tokens as fast as the server moves them, for the
    # stream-coalescing and stream-interval tests. It never writes its KV pool: no need to
    # commit it.
    "zero_cost_server": [
        *("--api-workers", "2", "--max-total-tokens", "16384", "--skip-warmup", "--lazy-kv-pool"),
    ],
    # Embedding models (test_embeddings_e2e.py): all-MiniLM-L6-v2 with its warm-up (an
    # embedding), and a small BERT classifier written when its server starts.
    "embedding_server": [
        *("--model-path", MINILM_PATH, "--served-model-name", "all-MiniLM-L6-v2"),
        *("--max-embedding-batch", "64"),
    ],
    "classifier_server": ["--model-path", CLASSIFIER_PATH, "--skip-warmup"],
    # SGLang's gateway (SMG) in front of Cadence, over gRPC and HTTP (test_smg_*.py).
    # It also publishes KV-cache events (test_kv_events_e2e.py), over ZMQ and gRPC.
    "smg_server": [
        *("--max-total-tokens", "4096", "--skip-warmup"),
        *("--kv-events-config", KV_EVENTS_CONFIG),
    ],
    # Structured output and tools (test_structured_output.py): Cadence's SmolLM2 tool
    # template, Hermes tool calls and <think> reasoning read out of chat answers.
    "structured_server": [
        *("--max-total-tokens", "16384", "--skip-warmup"),
        *("--chat-template", template_path("smollm2_tools")),
        *("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
    ],
    # --pipeline (test_pipeline_serving_e2e.py): two stage processes of test executors, restarted
    # when one dies, or not (then the server exits non-zero).
    "pipeline_server": [*_SMALL, "--pipeline", PIPELINE_YAML, "--pipeline-restart-stages"],
    "pipeline_exit_server": [*_SMALL, "--pipeline", PIPELINE_YAML],
    # The shipped speech pipeline (test_speech_e2e.py): thinker, talker, vocoder, encoder.
    "speech_server": [*_SMALL, "--pipeline", "speech", "--max-speech-chars", "2000"],
    # LoRA adapters (test_lora_e2e.py): two loaded at start, room for a third.
    "lora_server": [
        *_SMALL,
        *("--lora-paths", f"french={LORA_DIR}/french", f"sql={LORA_DIR}/sql"),
        *("--max-loaded-loras", "3", "--max-lora-rank", "16", "--lora-target-modules", "all"),
    ],
    # Prefill/decode disaggregation (test_pd_e2e.py): a pair on one bootstrap port, with the
    # shared server's prefill chunking (its greedy outputs are what the pair must give).
    "prefill_server": [*PD_ARGS, "--disaggregation-mode", "prefill"],
    # It also prefills requests without a room itself: a router's short prompts
    # (test_pd_router_e2e.py, --pd-local-prefill-max-tokens).
    "decode_server": [
        *(*PD_ARGS, "--disaggregation-mode", "decode"),
        "--disaggregation-decode-local-prefill",
    ],
    # The same server without the pipeline: what the speech server's memory is compared with.
    "speech_baseline_server": [*_SMALL, "--max-speech-chars", "2000"],
}
SERVER_ENVS = {
    "fuzz_server": fault_plugin_env,
    "zero_cost_server": zero_cost_env,
    "classifier_server": classifier_env,
    "pipeline_server": pipeline_env,
    "pipeline_exit_server": pipeline_env,
    "lora_server": lora_env,
}


PRELAUNCH = 2  # servers started ahead of their first test, so startups overlap with tests


class Fleet:
    """The e2e servers: each starts shortly before its first test (with the next PRELAUNCH in
    test order, so their startups overlap earlier tests) and stops after its last test, so
    only a few live at once (each holds ~1.5 GB)."""

    def __init__(self, order: list[str], last_users: dict[str, str]):
        self.order = order  # server names by their first test
        self.last_users = last_users  # server name -> node id of the last test that needs it
        self.servers: dict[str, Server] = {}
        self.retired: dict[str, Server] = {}
        self.crashed: list[Server] = []  # shared servers that died under a test, replaced since
        self.problems: list[str] = []

    def get(self, name: str) -> Server:
        if name in self.retired:  # a test outside the collected order (should not happen)
            self.servers[name] = self.retired.pop(name)
        if name not in self.servers:
            self.servers[name] = self._launch(name)
        elif name == "server" and self.servers[name].proc.poll() is not None:
            # A test killed the shared server (a bug): the test that did it fails, the session
            # reports it at the end, and the tests after it get a fresh server.
            self.crashed.append(self.servers[name])
            self.servers[name] = self._launch(name)
        if name in self.order:
            ahead = self.order[self.order.index(name) + 1 :]
            for other in [n for n in ahead if n not in self.servers and n not in self.retired]:
                if sum(1 for n in ahead if n in self.servers) >= PRELAUNCH:
                    break
                self.servers[other] = self._launch(other)
        return self.servers[name].wait_ready()

    def finished(self, nodeid: str) -> None:
        """Stops the servers whose last test was `nodeid`."""
        for name, last in self.last_users.items():
            if last == nodeid and name in self.servers:
                srv = self.servers.pop(name)
                self.problems += self._stop(name, srv)
                self.retired[name] = srv

    @staticmethod
    def _launch(name: str) -> Server:
        env = SERVER_ENVS[name]() if name in SERVER_ENVS else None
        return Server(name.removesuffix("_server") or "shared", SERVER_SPECS[name], env).start()

    @staticmethod
    def _stop(name: str, srv: Server) -> list[str]:
        problems = []
        if srv.proc.poll() is None:
            code = srv.stop(signal.SIGTERM, timeout=20)
            if code != 0:
                problems.append(f"{name}: exit code {code} after SIGTERM\n{srv.log_tail(1500)}")
            if srv.socket_dirs():
                problems.append(f"{name}: socket directory left behind: {srv.socket_dirs()}")
        return problems

    def shutdown(self) -> list[str]:
        """Stops every server; returns what went wrong (left processes, socket dirs, exit codes)."""
        problems = [
            f"the shared server died during the session (exit code {srv.proc.returncode}):\n"
            f"{srv.log_tail(3000)}"
            for srv in self.crashed
        ]
        problems += self.problems
        for name, srv in self.servers.items():
            problems += self._stop(name, srv)
        if not wait_until(lambda: not tagged_pids(SESSION_TAG), timeout=10):
            problems.append(f"processes left by the servers: {tagged_pids(SESSION_TAG)}")
        for srv in [*self.servers.values(), *self.retired.values(), *self.crashed]:
            srv.destroy()
        return problems


_order: list[str] = []  # server names by their first test
_last_users: dict[str, str] = {}
_fleet: Fleet | None = None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: launch only what will run
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if name in SERVER_SPECS:
                if name not in _order:
                    _order.append(name)
                _last_users[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if _fleet is not None:
        _fleet.finished(item.nodeid)
    return result


@pytest.fixture(scope="session")
def fleet():
    global _fleet
    _fleet = Fleet(_order, _last_users)
    yield _fleet
    problems = _fleet.shutdown()
    _fleet = None
    assert not problems, "\n".join(problems)


def _make_server_fixture(name: str):
    # The shared server is looked up per test, so that one which died gets replaced.
    @pytest.fixture(scope="function" if name == "server" else "session", name=name)
    def _fixture(fleet):
        return fleet.get(name)

    return _fixture


for _name in SERVER_SPECS:
    globals()[f"_fixture_{_name}"] = _make_server_fixture(_name)


# ---- OpenAI clients on the shared server (each test must leave it idle) ----------------------


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c
    assert is_idle(server.wait_idle()), "a request outlived its test"


@pytest.fixture
async def aclient(server):
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c
    assert is_idle(server.wait_idle()), "a request outlived its test"


@pytest.fixture
def model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
