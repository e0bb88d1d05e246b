"""LoRA adapters on a launched server, through real clients: the openai SDK
(`model="base:adapter"` and the adapter's name), native /generate (`lora_path`), both gRPC
services, /v1/models, refusals, and load/unload under running load with no failed request
and no page left held.

The server (`lora_server`) starts with two adapters (french, sql) and --max-loaded-loras 3;
the adapters are random PEFT-format ones written at launch (lora_adapters.py); their
agreement with PEFT is tests/integration/test_lora.py's.
"""

from __future__ import annotations

import json
import threading
import uuid

import grpc
import httpx
import openai
import pytest
from e2e_server import is_idle
from grpc_support import stub, target
from lora_adapters import LORA_DIR

from cadence.grpc import sglang_pb2 as our_pb
from cadence.grpc import sglang_scheduler_pb2 as pb
from cadence.grpc import sglang_scheduler_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture
def http(lora_server):
    with lora_server.client() as c:
        yield c
    assert is_idle(lora_server.wait_idle()), "a request outlived its test"


def native(http, lora_path=None, text=PROMPT, **params) -> dict:
    body = {"text": text, "sampling_params": {**GREEDY, **params}, "lora_path": lora_path}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def served_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_adapters_change_the_answer_and_every_way_to_name_one_agrees(lora_server, http):
    base, french, sql = (native(http, name)["text"] for name in (None, "french", "sql"))
    assert len({base, french, sql}) == 3
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    model = served_name(http)
    for name, want in (("french", french), ("sql", sql)):
        for chosen in (f"{model}:{name}", name):
            out = client.completions.create(
                model=chosen, prompt=PROMPT, max_tokens=12, temperature=0
            )
            assert out.choices[0].text == want, chosen
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == base
    chat = client.chat.completions.create(
        model=f"{model}:french",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    plain = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.content != plain.choices[0].message.content


def test_a_batch_names_one_adapter_per_item(http):
    body = {
        "text": [PROMPT] * 3,
        "sampling_params": GREEDY,
        "lora_path": ["french", None, "sql"],
    }
    outs = http.post("/generate", json=body).json()
    assert [o["text"] for o in outs] == [native(http, n)["text"] for n in ("french", None, "sql")]


def test_models_lists_the_adapters(http):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    model = served_name(http)
    assert cards["french"]["root"] == f"{LORA_DIR}/french"
    assert cards["french"]["parent"] == model and cards["sql"]["parent"] == model


def test_unknown_adapters_are_refused_at_the_edge(lora_server, http):
    r = http.post("/generate", json={"text": PROMPT, "lora_path": "nope"})
    assert r.status_code == 400 and "nope" in r.text and "lora_path" in r.text
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.completions.create(model=f"{served_name(http)}:nope", prompt=PROMPT, max_tokens=4)
    with grpc.insecure_channel(target(lora_server)) as channel:
        rpc = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(rpc.Generate(_scheduler_request(http, "nope")))
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in err.value.details()
        )


def _scheduler_request(http, lora_id: str) -> pb.GenerateRequest:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    return pb.GenerateRequest(
        request_id=f"lora-{uuid.uuid4().hex[:8]}",
        tokenized=pb.TokenizedInput(original_text=PROMPT, input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=12, top_k=-1, top_p=1.0),
        lora_id=lora_id,
    )


def test_grpc_both_services_pick_the_adapter(lora_server, http):
    want = native(http, "french")
    req = our_pb.TextGenerateRequest(
        text=PROMPT,
        sampling_params=our_pb.SamplingParams(max_new_tokens=12, temperature=0.0),
        lora_path="french",
    )
    replies = list(stub(lora_server).TextGenerate(req))
    assert "".join(r.text for r in replies) == want["text"]
    with grpc.insecure_channel(target(lora_server)) as channel:
        rpc = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        listed = {
            a.lora_name: a
            for a in rpc.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest()).loaded_adapters
        }
        french_id = uuid.uuid5(uuid.NAMESPACE_URL, f"french\0{LORA_DIR}/french").hex
        assert listed["french"].lora_id == french_id
        for lora_id in (french_id, "french"):
            (msg,) = rpc.Generate(_scheduler_request(http, lora_id))
            assert list(msg.complete.output_ids) == want["output_ids"], lora_id
        (load,) = rpc.GetLoads(pb.GetLoadsRequest(include=["lora"])).loads
        assert (load.lora.slots_used, load.lora.slots_total) == (0, 8)  # idle; the default


def test_load_and_unload_under_running_load(lora_server, http):
    """Requests on the base and on french stream while `extra` is loaded, used and unloaded
    and `sql` is unloaded and loaded again: none fails, and nothing stays held."""
    errors: list[str] = []
    stop = threading.Event()

    def load_loop(name):
        with lora_server.client() as c:
            while not stop.is_set():
                body = {
                    "text": PROMPT,
                    "sampling_params": {**GREEDY, "max_new_tokens": 24},
                    "lora_path": name,
                }
                with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    if r.status_code != 200:
                        errors.append(f"{name}: {r.status_code} {r.read()!r}")
                    for line in r.iter_lines():
                        if line.startswith("data:") and "error" in line:
                            errors.append(f"{name}: {line}")

    threads = [
        threading.Thread(target=load_loop, args=(n,)) for n in (None, "french", None, "french")
    ]
    for t in threads:
        t.start()
    try:
        extra = f"{LORA_DIR}/extra"
        r = http.post("/load_lora_adapter", json={"lora_name": "extra", "lora_path": extra})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert set(r.json()["loaded_adapters"]) == {"french", "sql", "extra"}
        assert native(http, "extra")["text"] != native(http, None)["text"]
        r = http.post("/load_lora_adapter", json={"lora_name": "extra", "lora_path": extra})
        assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
        for name in ("extra", "sql"):
            r = http.post("/unload_lora_adapter", json={"lora_name": name})
            assert r.status_code == 200 and r.json()["success"], r.text
        r = http.post("/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 400 and "sql" in r.json()["error_message"]
        r = http.post(
            "/load_lora_adapter", json={"lora_name": "sql", "lora_path": f"{LORA_DIR}/sql"}
        )
        assert r.status_code == 200, r.text
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert is_idle(lora_server.wait_idle())


def test_lora_on_a_server_without_lora_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/generate", json={"text": PROMPT, "lora_path": "french"})
        assert r.status_code == 400 and "LoRA" in r.text
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 400 and "enable-lora" in json.dumps(r.json())


def test_smg_over_http_routes_lora_requests(request, lora_server, http):
    """SGLang's gateway in HTTP mode passes `lora_path` (native and OpenAI bodies) through to
    the server, which serves it as it does directly. SMG routes OpenAI requests by model
    name, so `model="base:adapter"` does not pass it; over gRPC SMG never sets
    GenerateRequest.lora_id (it has no LoRA routing there)."""
    from test_smg_gateway import _gateway, smg_command

    model = served_name(http)
    gateway = _gateway(request, smg_command(), lora_server.url, model)
    want = native(http, "french")
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        body = {"text": PROMPT, "sampling_params": GREEDY, "lora_path": "french"}
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want["text"]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none")
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"lora_path": "french"}
    )
    assert out.choices[0].text == want["text"]
    # SMG routes by the model name and knows only the worker's own: `base:adapter` ends there.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{model}:french", prompt=PROMPT, max_tokens=4)
