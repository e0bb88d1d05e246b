"""A server launched with SGLang's --allow-auto-truncate, --preferred-sampling-params,
--max-prefill-tokens and --weight-version, driven by the openai SDK, httpx and the generated
gRPC stubs: a prompt longer than the context is cut to its head (room for one new token)
instead of refused, a request's max_new_tokens is lowered to what the context leaves, the
preferred parameters fill what a request leaves out (and are reported where SGLang reports
them), a prompt longer than the prefill budget is prefilled over several steps with the same
answer, and the weights' version labels every answer until /update_weight_version or a
weight update changes it (the tests run in file order: the version ones last)."""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest
from e2e_server import Server, is_idle, wait_until
from grpc_support import target

from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import sglang_scheduler_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CONTEXT = 256
PREFERRED = {"max_new_tokens": 6, "temperature": 0}
PREFILL_BUDGET = 64
LONG = "The quick brown fox jumps over the lazy dog. " * 80  # far past 256 tokens


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "launch_flags",
        [
            *("--context-length", str(CONTEXT), "--max-total-tokens", "2048"),
            "--allow-auto-truncate",
            *("--preferred-sampling-params", json.dumps(PREFERRED)),
            *("--max-prefill-tokens", str(PREFILL_BUDGET), "--skip-warmup"),
            *("--weight-version", "base-v0", "--log-level-http", "info", "--device", "cpu"),
            *("--uvicorn-access-log-exclude-prefixes", "/health", "/metrics"),
        ],
    ).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.destroy()


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c
    assert is_idle(server.wait_idle()), "a request outlived its test"


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def generate(http, **body) -> dict:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_past_the_context_is_cut_to_its_head_not_refused(http, oai):
    ids = http.post("/tokenize", json={"prompt": LONG}).json()["tokens"]
    assert len(ids) > CONTEXT
    out = generate(http, text=LONG, sampling_params={"max_new_tokens": 50})
    assert out["meta_info"]["prompt_tokens"] == CONTEXT - 1
    assert out["meta_info"]["completion_tokens"] == 1  # what the context leaves
    # The head was kept: the same answer as for the first 255 ids sent as they are.
    head = generate(http, input_ids=ids[: CONTEXT - 1], sampling_params={"max_new_tokens": 1})
    assert head["output_ids"] == out["output_ids"]
    done = oai.completions.create(model="m", prompt=LONG, max_tokens=20, temperature=0)
    assert done.usage.prompt_tokens == CONTEXT - 1 and done.usage.completion_tokens == 1
    chat = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": LONG}], temperature=0
    )
    assert chat.usage.prompt_tokens == CONTEXT - 1 and chat.usage.completion_tokens == 1


def test_the_gateways_grpc_generate_is_cut_the_same_way(server, http):
    """sglang.grpc.scheduler Generate (what SMG sends: ids, every sampling field set)."""
    ids = http.post("/tokenize", json={"prompt": LONG}).json()["tokens"]
    params = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                               n=1, max_new_tokens=20, skip_special_tokens=True)  # fmt: skip
    request = pb.GenerateRequest(
        request_id="cut-1",
        tokenized=pb.TokenizedInput(original_text=LONG, input_ids=ids),
        sampling_params=params,
        logprob_start_len=-1,
    )
    with grpc.insecure_channel(target(server)) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        (reply,) = stub.Generate(request, timeout=60)
    done = reply.complete
    assert (done.prompt_tokens, done.completion_tokens) == (CONTEXT - 1, 1)
    assert done.finish_reason == "length"


def test_max_new_tokens_past_the_context_is_lowered_to_what_it_leaves(http):
    ids = http.post("/tokenize", json={"prompt": LONG}).json()["tokens"][:200]
    out = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 500, "ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] == 200
    assert out["meta_info"]["completion_tokens"] == CONTEXT - 200
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_preferred_parameters_fill_what_a_request_leaves_out(http, oai):
    a = generate(http, text="The capital of France is")
    b = generate(http, text="The capital of France is", sampling_params={"ignore_eos": True})
    assert b["meta_info"]["completion_tokens"] == PREFERRED["max_new_tokens"]
    assert a["meta_info"]["completion_tokens"] <= PREFERRED["max_new_tokens"]
    assert b["text"].startswith(a["text"])  # temperature 0 from the flag: both greedy
    mine = generate(
        http,
        text="The capital of France is",
        sampling_params={"max_new_tokens": 2, "ignore_eos": True},
    )
    assert mine["meta_info"]["completion_tokens"] == 2  # the request's own value wins
    chat = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5
    )
    again = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content == again.choices[0].message.content  # greedy


def test_the_preferred_parameters_are_reported_as_given(server, http):
    info = http.get("/model_info").json()
    assert json.loads(info["preferred_sampling_params"]) == PREFERRED
    assert http.get("/server_info").json()["max_prefill_tokens"] == PREFILL_BUDGET
    with grpc.insecure_channel(target(server)) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        reply = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert json.loads(reply.preferred_sampling_params) == PREFERRED


def test_device_cpu_serves_on_the_cpu_platform(http):
    info = http.get("/server_info").json()
    assert info["device"] == "cpu" and info["platform"] == "cpu"


def test_log_level_http_info_writes_an_access_line_per_request_but_excluded_paths(server, http):
    """--log-level-http info: an access line per request; none for the paths under
    --uvicorn-access-log-exclude-prefixes (/health, probed every 0.1 s while it started)."""
    http.get("/metrics")
    http.get("/model_info?probe=access-log")
    line = '"GET /model_info?probe=access-log HTTP/1.1" 200'
    assert wait_until(lambda: line in server.log_text(), timeout=10), server.log_tail()
    log = server.log_text()
    assert '"GET /health' not in log and '"GET /metrics' not in log
    assert server.health_history  # it was probed


def test_a_prompt_longer_than_the_prefill_budget_answers_as_in_one_step(http):
    """200 prompt tokens at most 64 per step: four prefill steps. The greedy answer equals
    the one for the same prompt whose first 192 tokens are already cached (one step)."""
    ids = http.post("/tokenize", json={"prompt": LONG}).json()["tokens"][:200]
    params = {"max_new_tokens": 8, "ignore_eos": True}
    cold = generate(http, input_ids=ids, sampling_params=params)
    warm = generate(http, input_ids=ids, sampling_params=params)
    assert warm["meta_info"]["cached_tokens"] > 0
    assert cold["output_ids"] == warm["output_ids"]


# ---- --weight-version (these change the server's version: they run last) -----------------


def versions(server, http) -> tuple[str, str, str, str]:
    """The version as each place reports it: /generate's meta_info, /get_weight_version,
    /model_info and gRPC GetModelInfo."""
    meta = generate(http, text="Hi", sampling_params={"max_new_tokens": 1})["meta_info"]
    with grpc.insecure_channel(target(server)) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        rpc = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).weight_version
    return (
        meta["weight_version"],
        http.get("/get_weight_version").json()["weight_version"],
        http.get("/model_info").json()["weight_version"],
        rpc,
    )


def stream_until_first_chunk(server, ended: list) -> threading.Thread:
    """A long streamed /generate on a thread; `ended` gets its last event's finish reason."""
    started = threading.Event()

    def run():
        body = {"text": "Count:", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
        last = None
        with server.client() as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    last = json.loads(line[5:])
                    started.set()
        ended.append(last["meta_info"]["finish_reason"])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the stream sent nothing"
    return thread


def test_every_answer_carries_the_version_it_was_launched_with(server, http):
    assert versions(server, http) == ("base-v0",) * 4


def test_a_new_version_aborts_what_runs_unless_asked_not_to(server, http):
    ended: list = []
    thread = stream_until_first_chunk(server, ended)
    r = http.post("/update_weight_version", json={"new_version": "step-1"})
    assert r.json() == {
        "success": True,
        "message": "weight version updated to step-1",
        "new_version": "step-1",
    }
    thread.join(60)
    assert ended[0]["type"] == "abort" and "step-1" in ended[0]["message"]
    assert versions(server, http) == ("step-1",) * 4
    ended.clear()
    thread = stream_until_first_chunk(server, ended)
    body = {"new_version": "step-2", "abort_all_requests": False}
    assert http.post("/update_weight_version", json=body).json()["success"]
    thread.join(120)
    assert ended[0]["type"] == "length"  # it ran to its end
    assert versions(server, http) == ("step-2",) * 4


def test_a_weight_update_that_names_a_version_serves_under_it(http):
    path = http.get("/model_info").json()["model_path"]
    before = generate(http, text="The sky is", sampling_params={"max_new_tokens": 6})
    bad = http.post("/update_weights_from_disk", json={"model_path": "/no/such.gguf",
                                                       "weight_version": "step-3"})  # fmt: skip
    assert bad.status_code == 400 and not bad.json()["success"]
    wrong = {"model_path": path, "load_format": "safetensors", "weight_version": "step-3"}
    r = http.post("/update_weights_from_disk", json=wrong)
    assert r.status_code == 400 and "holds gguf weights" in r.json()["message"], r.text
    assert http.get("/get_weight_version").json()["weight_version"] == "step-2"
    r = http.post(
        "/update_weights_from_disk", json={"model_path": path, "weight_version": "step-3"}
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    after = generate(http, text="The sky is", sampling_params={"max_new_tokens": 6})
    assert after["meta_info"]["weight_version"] == "step-3"
    assert after["output_ids"] == before["output_ids"]  # the same file: the same greedy answer
