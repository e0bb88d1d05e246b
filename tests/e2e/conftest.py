"""Launched servers for the end-to-end tests, started together and stopped without a trace.

`server` is the one shared server most tests talk to. The other `*_server` fixtures are
short-lived servers that a single test takes apart (signals, killed children, API key,
tiny queues). Whichever server a test asks for first, every server that the collected
tests will need is launched at that moment, in parallel, so their loads overlap; each
fixture then waits only for its own. At the end of the session every server still up is
stopped, and no process started by any of them may be left.
"""

from __future__ import annotations

import signal
import sys

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

from cadence.chat_templates import template_path

sys.path.append(PLUGINS_DIR)  # the tests read the fault-injection plugin's markers

_SMALL = ["--max-total-tokens", "2048", "--skip-warmup"]
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
    # A short watchdog: SIGSTOP of a child must bring the server down within seconds.
    "stall_server": ["--watchdog-timeout", "3", *_SMALL],
    # Two front processes over one scheduler (test_api_workers.py).
    "workers_server": ["--api-workers", "2", "--max-total-tokens", "4096", "--skip-warmup"],
    # The zero-cost model runner (a plugin): tokens as fast as the server moves them, for the
    # stream-coalescing and stream-interval tests.
    "zero_cost_server": ["--api-workers", "2", "--max-total-tokens", "16384", "--skip-warmup"],
    # Embedding models (test_embeddings_e2e.py): all-MiniLM-L6-v2 with its warm-up (an
    # embedding), and a small BERT classifier written when its server starts.
    "embedding_server": [
        *("--model-path", MINILM_PATH, "--served-model-name", "all-MiniLM-L6-v2"),
        *("--max-embedding-batch", "64"),
    ],
    "classifier_server": ["--model-path", CLASSIFIER_PATH, "--skip-warmup"],
    # SGLang's gateway (SMG) in front of Cadence, over gRPC and HTTP (test_smg_*.py).
    "smg_server": ["--max-total-tokens", "4096", "--skip-warmup"],
    # Structured output and tools (test_structured_output.py): Cadence's SmolLM2 tool
    # template, Hermes tool calls and <think> reasoning read out of chat answers.
    "structured_server": [
        *("--max-total-tokens", "16384", "--skip-warmup"),
        *("--chat-template", template_path("smollm2_tools")),
        *("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
    ],
    # --pipeline (test_pipeline_serving.py): two stage processes of test executors, restarted
    # when one dies, or not (then the server exits non-zero).
    "pipeline_server": [*_SMALL, "--pipeline", PIPELINE_YAML, "--pipeline-restart-stages"],
    "pipeline_exit_server": [*_SMALL, "--pipeline", PIPELINE_YAML],
    # The shipped speech pipeline (test_speech_e2e.py): thinker, talker, vocoder, encoder.
    "speech_server": [*_SMALL, "--pipeline", "speech", "--max-speech-chars", "2000"],
}
SERVER_ENVS = {
    "fuzz_server": fault_plugin_env,
    "zero_cost_server": zero_cost_env,
    "classifier_server": classifier_env,
    "pipeline_server": pipeline_env,
    "pipeline_exit_server": pipeline_env,
}


class Fleet:
    def __init__(self, needed: set[str]):
        self.needed = needed
        self.servers: dict[str, Server] = {}
        self.crashed: list[Server] = []  # shared servers that died under a test, replaced since

    def get(self, name: str) -> Server:
        if name not in self.servers:
            for other in [name, *sorted(self.needed - set(self.servers) - {name})]:
                self.servers[other] = self._launch(other)
        elif name == "server" and self.servers[name].proc.poll() is not None:
            # A test killed the shared server (a bug): the test that did it fails, the session
            # reports it at the end, and the tests after it get a fresh server.
            self.crashed.append(self.servers[name])
            self.servers[name] = self._launch(name)
        return self.servers[name].wait_ready()

    @staticmethod
    def _launch(name: str) -> Server:
        env = SERVER_ENVS[name]() if name in SERVER_ENVS else None
        return Server(name.removesuffix("_server") or "shared", SERVER_SPECS[name], env).start()

    def shutdown(self) -> list[str]:
        """Stops every server; returns what went wrong (left processes, socket dirs, exit codes)."""
        problems = [
            f"the shared server died during the session (exit code {srv.proc.returncode}):\n"
            f"{srv.log_tail(3000)}"
            for srv in self.crashed
        ]
        for name, srv in self.servers.items():
            if srv.proc.poll() is None:
                code = srv.stop(signal.SIGTERM, timeout=20)
                if code != 0:
                    problems.append(f"{name}: exit code {code} after SIGTERM\n{srv.log_tail(1500)}")
                if srv.socket_dirs():
                    problems.append(f"{name}: socket directory left behind: {srv.socket_dirs()}")
        if not wait_until(lambda: not tagged_pids(SESSION_TAG), timeout=10):
            problems.append(f"processes left by the servers: {tagged_pids(SESSION_TAG)}")
        for srv in [*self.servers.values(), *self.crashed]:
            srv.destroy()
        return problems


_needed: set[str] = set()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: launch only what will run
def pytest_collection_modifyitems(config, items):
    for item in items:
        _needed.update(n for n in getattr(item, "fixturenames", ()) if n in SERVER_SPECS)


@pytest.fixture(scope="session")
def fleet():
    f = Fleet(_needed)
    yield f
    problems = f.shutdown()
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
