"""SGLang's LoRA routes over HTTP, without a model: /load_lora_adapter and
/unload_lora_adapter (their bodies, 200 or 400, SGLang's answer), /generate's lora_path
and /v1/models' adapter cards, through Starlette's test client and a real FrontClient
whose scheduler is played by the test (tests/unit/front/lora_scheduler.py)."""

from __future__ import annotations

from starlette.testclient import TestClient

from cadence.entrypoints.http_server import build_app
from cadence.server_args import ServerArgs
from cadence.serving.state import ServerState
from tests.unit.front.lora_scheduler import MODEL, make_client


def http(enabled=True):
    client, scheduler = make_client(enabled=enabled)
    state = ServerState(ServerArgs(), client=client, is_ready=True)
    return TestClient(build_app(state), raise_server_exceptions=False), scheduler


def test_load_and_unload_answer_sglangs_body():
    with http()[0] as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "new", "lora_path": "/adapters/new"})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "success": True,
            "error_message": "",
            "loaded_adapters": {
                "sql": "/adapters/sql",
                "chat": "/adapters/chat",
                "new": "/adapters/new",
            },
        }
        r = c.post("/load_lora_adapter", json={"lora_name": "new", "lora_path": "/adapters/new"})
        assert r.status_code == 400 and not r.json()["success"]
        assert "already loaded" in r.json()["error_message"]
        r = c.post("/unload_lora_adapter", json={"lora_name": "new"})
        assert r.status_code == 200 and "new" not in r.json()["loaded_adapters"]
        r = c.post("/unload_lora_adapter", json={"lora_name": "new"})
        assert r.status_code == 400 and "does not exist" in r.json()["error_message"]


def test_a_bad_body_is_a_400_naming_the_field():
    with http()[0] as c:
        for route, body, field in (
            ("/load_lora_adapter", {"lora_path": "/a"}, "lora_name"),
            ("/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
            ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/a", "pinned": 2}, "pinned"),
            ("/load_lora_adapter", {"lora_name": MODEL, "lora_path": "/a"}, "lora_name"),
            ("/unload_lora_adapter", {}, "lora_name"),
        ):
            r = c.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_without_lora_the_routes_answer_sglangs_refusal():
    c, scheduler = http(enabled=False)
    with c:
        r = c.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"})
        assert r.status_code == 400
        assert r.json() == {
            "success": False,
            "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
            "loaded_adapters": None,
        }
        r = c.post("/generate", json={"text": "hi", "lora_path": "sql"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "LoRA is not enabled" in r.json()["error"]["message"]
    assert scheduler.sent == []


def test_generate_takes_a_loaded_adapter_and_refuses_another():
    c, scheduler = http()
    with c:
        r = c.post("/generate", json={"text": ["a", "b"], "lora_path": ["sql", None]})
        assert r.status_code == 200, r.text
        r = c.post("/generate", json={"text": "a", "lora_path": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "LoRA adapter 'nope' is not loaded" in r.json()["error"]["message"]
    assert [q.lora_path for q in scheduler.requests] == ["sql", None]


def test_models_list_the_adapters():
    with http()[0] as c:
        cards = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in cards] == [
            (MODEL, None, MODEL),
            ("sql", MODEL, "/adapters/sql"),
            ("chat", MODEL, "/adapters/chat"),
        ]
        assert c.get("/v1/models/sql").json()["parent"] == MODEL
        assert c.get("/v1/models/nope").status_code == 404
