"""Schemathesis against the server's own OpenAPI document: every route declares its request
body, and bodies generated from those schemas (valid ones and deliberately invalid ones)
never get a server error.

Bounded for CI: a fixed number of examples per operation, derandomized. The fuzzed server
has a short server-side deadline (--request-timeout-s), so generated requests that ask for
thousands of tokens end in seconds.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from e2e_server import is_idle
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES_PER_OPERATION = 25
STATUSES: Counter = Counter()  # (route, status) over the whole run, for the report


@pytest.fixture(scope="module")
def operations(fuzz_server):
    document = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


LABELS = [
    "GET /health",
    "GET /health_generate",
    "GET /model_info",
    "GET /server_info",
    "GET /get_load",
    "GET /v1/loads",
    "GET /v1/models",
    "POST /generate",
    "POST /tokenize",
    "POST /v1/tokenize",
    "POST /detokenize",
    "POST /v1/detokenize",
    "POST /abort_request",
    "POST /flush_cache",
    "POST /pause_generation",
    "POST /continue_generation",
    "POST /start_profile",
    "POST /stop_profile",
    "POST /update_weights_from_disk",
    "POST /update_weight_version",
    "GET /get_weight_version",
    "GET /configure_logging",
    "POST /configure_logging",
    "POST /load_lora_adapter",
    "POST /unload_lora_adapter",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/responses/{response_id}/cancel",
    "POST /invocations",
    "GET /metrics",
    "GET /get_model_info",
    "GET /get_server_info",
    "GET /v1/models/{model_id}",
    "GET /open_session",
    "POST /open_session",
    "GET /close_session",
    "POST /close_session",
    "POST /encode",
    "POST /classify",
    "POST /v1/embeddings",
    "POST /v1/classify",
    "POST /v1/score",
    "POST /v1/rerank",
    "POST /v1/audio/speech",
    "GET /v1/audio/voices",
    "GET /capabilities",
]


def test_every_operation_of_the_document_is_fuzzed(operations):
    assert set(operations) == set(LABELS), set(operations) ^ set(LABELS)


def test_every_post_route_declares_its_request_body(fuzz_server):
    document = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert {"/generate", "/v1/chat/completions", "/v1/completions", "/abort_request"} <= set(posts)
    missing = [path for path, op in posts.items() if "requestBody" not in op]
    assert not missing, missing
    sampling = document["components"]["schemas"]["SamplingParams"]["properties"]
    assert (
        sampling["repetition_penalty"]["minimum"] == 0
        and sampling["repetition_penalty"]["maximum"] == 2
    )


# Routes whose body may be anything (it is read for nothing): no invalid body exists.
ANY_BODY = {"POST /v1/responses/{response_id}/cancel"}
# Invalid data only exists where there is something to get wrong: a request body.
CASES = [
    (label, mode)
    for label in LABELS
    for mode in (
        [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        if label.startswith("POST") and label not in ANY_BODY
        else [GenerationMode.POSITIVE]
    )
]


@pytest.mark.parametrize("label,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_no_generated_request_gets_a_server_error(fuzz_server, operations, label, mode):
    operation = operations[label]

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=fuzz_server.url, timeout=60)
        STATUSES[label, response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    run()
    assert fuzz_server.proc.poll() is None, fuzz_server.log_tail()


def test_the_fuzzed_server_is_alive_and_idle(fuzz_server):
    print("\nstatus counts:", dict(sorted(STATUSES.items())))
    with fuzz_server.client() as client:
        client.post("/continue_generation")  # the fuzzer may have paused it
        client.post("/stop_profile")  # ... or left a profile running
        r = client.post(
            "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200, r.text
    assert is_idle(fuzz_server.wait_idle(timeout=30))
