"""Speculative decoding served (`--speculative-algorithm NGRAM`, `spec_server`): the same
text as a server without it (the shared `server`), SGLang's per-request figures in
meta_info, its gauges in /metrics, the average accept length in /server_info, and the
SMG scheduler service's GenerateComplete and GetLoads fields."""

from __future__ import annotations

import grpc
import pytest
from e2e_server import is_idle
from grpc_support import target

from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import sglang_scheduler_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# An answer that copies a span of its prompt: drafts from the prompt get accepted.
PROMPT = (
    "Copy this code exactly.\n"
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n"
)
GREEDY = {"temperature": 0, "max_new_tokens": 48}


@pytest.fixture
def spec(spec_server):
    with spec_server.client() as c:
        yield c
    assert is_idle(spec_server.wait_idle())


def generate(client, **body) -> dict:
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_text_is_the_servers_without_speculation_and_meta_says_what_it_did(spec, server):
    got = generate(spec)
    with server.client() as plain:
        assert got["text"] == generate(plain)["text"]
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0
    assert sum(meta["spec_acceptance_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_num_proposed_drafts"] >= meta["spec_accepted_tokens"]
    assert 0 < meta["spec_accept_rate"] <= 1 and meta["spec_accept_length"] > 1


def test_streamed_tokens_add_up_to_the_whole_answer(spec):
    whole = generate(spec)["text"]
    with spec.stream(
        "POST", "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}
    ) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    assert json.loads(chunks[-1])["text"] == whole  # /generate streams are cumulative


def test_metrics_and_server_info_report_the_accept_length(spec):
    generate(spec)
    body = spec.get("/metrics").text
    lines = {
        line.split("{")[0]: line for line in body.splitlines() if line.startswith("sglang:spec_")
    }
    assert set(lines) == {"sglang:spec_accept_length", "sglang:spec_accept_rate"}, body
    assert float(lines["sglang:spec_accept_length"].split()[-1]) > 1
    [rank] = spec.get("/server_info").json()["internal_states"]
    assert rank["avg_spec_accept_length"] > 1


def test_the_scheduler_service_reports_accepted_and_drafted_tokens(spec, spec_server):
    ids = spec.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    request = pb.GenerateRequest(
        request_id="spec-grpc",
        tokenized=pb.TokenizedInput(original_text=PROMPT, input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=48, n=1),
        logprob_start_len=-1,
    )
    with grpc.insecure_channel(target(spec_server)) as channel:
        rpc = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        [reply] = list(rpc.Generate(request, timeout=60))
        complete = reply.complete
        # How many of its drafts this one request verified depends on what the server's
        # cost model measured on a busy machine (its first verify may be all rejected);
        # that acceptance happens at all is the HTTP test's, and the load's figure below.
        assert complete.spec_draft_tokens > 0
        assert 0 <= complete.spec_accepted_tokens <= complete.spec_draft_tokens
        loads = rpc.GetLoads(pb.GetLoadsRequest(), timeout=10)
        assert loads.loads[0].speculative.accept_length > 1
