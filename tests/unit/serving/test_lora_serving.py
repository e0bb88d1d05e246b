"""LoRA adapters through the OpenAI serving, over a real FrontClient whose scheduler is
played by the test (tests/unit/front/lora_scheduler.py): which adapter each way of naming
one reaches the scheduler with, the 400s that name the field, /v1/models' adapter cards,
the routes that refuse adapters, and the bodies of /load_lora_adapter and
/unload_lora_adapter."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cadence.errors import InvalidParameter
from cadence.io_struct import LoRAUpdateOutput
from cadence.serving import control
from cadence.serving.embedding_serving import EmbeddingServing, encode_input
from cadence.serving.openai_serving import OpenAIServing
from cadence.serving.responses import ResponsesServing
from tests.unit.front.lora_scheduler import MODEL, adapter, make_client

USER = [{"role": "user", "content": "hi"}]


def make_serving(enabled=True, strict_model_name=False, known=None):
    client, scheduler = make_client(enabled=enabled, known=known)
    args = SimpleNamespace(chat_template=None, strict_model_name=strict_model_name)
    state = SimpleNamespace(args=args, client=client, started=1000.0)
    return OpenAIServing(state), scheduler


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def decoded(result) -> dict:
    return json.loads(result.body)


async def chat(serving, **fields):
    return await serving.chat_completions(body(messages=USER, max_tokens=1, **fields))


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"model": MODEL}, None),
        ({"model": f"{MODEL}:sql"}, "sql"),
        ({"model": "sql"}, "sql"),  # the adapter's own name
        ({"model": "gpt-4"}, None),  # any other name: the base model
        ({"model": MODEL, "lora_path": "chat"}, "chat"),
        ({"model": f"{MODEL}:sql", "lora_path": "chat"}, "sql"),  # the model's adapter wins
        ({"model": "sql", "lora_path": "chat"}, "sql"),
        ({"lora_path": ["chat"]}, "chat"),
    ],
)
async def test_chat_reaches_the_scheduler_with_the_adapter_it_names(fields, expected):
    serving, scheduler = make_serving()
    result = await chat(serving, **fields)
    assert result.status == 200, result.body
    assert [r.lora_path for r in scheduler.requests] == [expected]
    assert decoded(result)["model"] == fields.get("model", MODEL)  # echoed as sent


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"model": f"{MODEL}:nope"}, "model", "LoRA adapter 'nope' is not loaded"),
        ({"model": "other:nope"}, "model", "LoRA adapter 'nope' is not loaded"),
        ({"lora_path": "nope"}, "lora_path", "LoRA adapter 'nope' is not loaded"),
        ({"lora_path": ["sql", "chat"]}, "lora_path", "lora_path has 2 entries"),
    ],
)
async def test_chat_refuses_an_unknown_adapter_naming_the_field(fields, param, message):
    serving, scheduler = make_serving()
    result = await chat(serving, **fields)
    error = decoded(result)["error"]
    assert result.status == 400 and error["param"] == param and message in error["message"]
    assert "loaded adapters: ['chat', 'sql']" in error["message"] or param == "lora_path"
    assert scheduler.requests == []


async def test_without_lora_a_named_adapter_is_refused_and_plain_names_are_served():
    serving, scheduler = make_serving(enabled=False)
    for fields, param in (
        ({"model": f"{MODEL}:sql"}, "model"),
        ({"lora_path": "sql"}, "lora_path"),
    ):
        result = await chat(serving, **fields)
        error = decoded(result)["error"]
        assert result.status == 400 and error["param"] == param
        assert "LoRA adapter 'sql' was requested, but LoRA is not enabled" in error["message"]
    assert (await chat(serving, model="sql")).status == 200  # a name like any other
    assert [r.lora_path for r in scheduler.requests] == [None]


async def test_completions_take_one_adapter_per_prompt():
    serving, scheduler = make_serving()
    result = await serving.completions(
        body(model=MODEL, prompt=["a", "b", "c"], max_tokens=1, lora_path=["sql", None, "chat"])
    )
    assert result.status == 200, result.body
    assert [r.lora_path for r in scheduler.requests] == ["sql", None, "chat"]
    scheduler.sent.clear()
    result = await serving.completions(body(model="chat", prompt=["a", "b"], max_tokens=1, n=2))
    assert [r.lora_path for r in scheduler.requests] == ["chat"] * 4


async def test_an_adapter_loaded_through_another_front_is_looked_up():
    serving, scheduler = make_serving(known=())
    assert (await chat(serving, model=f"{MODEL}:sql")).status == 200
    assert scheduler.lookups == 1 and scheduler.requests[0].lora_path == "sql"


async def test_strict_model_name_checks_the_base_part():
    serving, scheduler = make_serving(strict_model_name=True)
    assert (await chat(serving, model=f"{MODEL}:sql")).status == 200
    assert (await chat(serving, model="sql")).status == 200
    result = await chat(serving, model="other:sql")
    assert result.status == 404 and decoded(result)["error"]["param"] == "model"
    assert (await chat(serving, model="gpt-4")).status == 404
    assert [r.lora_path for r in scheduler.requests] == ["sql", "sql"]


async def test_responses_take_the_adapter_model_names():
    serving, scheduler = make_serving()
    responses = ResponsesServing(serving)
    result = await responses.create(body(model=f"{MODEL}:chat", input="hi", max_output_tokens=1))
    assert result.status == 200, result.body
    assert scheduler.requests[0].lora_path == "chat"


# ---- /v1/models ----------------------------------------------------------------------------


async def test_models_list_each_loaded_adapter_under_the_base():
    serving, scheduler = make_serving(known=("sql",))  # "chat" was loaded elsewhere
    cards = decoded(await serving.list_models())["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    base, sql = cards[0], cards[1]
    assert sql["root"] == "/adapters/sql" and sql["parent"] == MODEL and base["parent"] is None
    assert sql["object"] == "model" and sql["owned_by"] == base["owned_by"]
    assert sql["created"] == base["created"]
    card = await serving.retrieve_model("chat")
    assert card.status == 200 and decoded(card)["root"] == "/adapters/chat"
    missing = await serving.retrieve_model("nope")
    assert missing.status == 404 and decoded(missing)["error"]["param"] == "model"


async def test_without_lora_models_list_the_base_alone_and_ask_nothing():
    serving, scheduler = make_serving(enabled=False)
    assert [c["id"] for c in decoded(await serving.list_models())["data"]] == [MODEL]
    assert (await serving.retrieve_model("sql")).status == 404
    assert scheduler.sent == []


# ---- routes without adapters -----------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"model": f"{MODEL}:sql"}, "model"),
        ({"model": "sql"}, "model"),
        ({"lora_path": "sql"}, "lora_path"),
    ],
)
async def test_embeddings_refuse_an_adapter_naming_the_field(fields, param):
    serving, scheduler = make_serving()
    embeddings = EmbeddingServing(serving.state, serving)
    result = await embeddings.embeddings(body(input="hi", **fields))
    error = decoded(result)["error"]
    assert result.status == 400 and error["param"] == param
    assert "base model only" in error["message"] and scheduler.sent == []


def test_encode_refuses_lora_path_rather_than_ignoring_it():
    with pytest.raises(InvalidParameter) as e:
        encode_input({"text": "hi", "lora_path": "sql"})
    assert e.value.param == "lora_path"
    assert encode_input({"text": "hi", "lora_path": None}).text == "hi"


# ---- the control bodies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, fields, param",
    [
        (control.LoadLoRABody, {"lora_path": "/a"}, "lora_name"),
        (control.LoadLoRABody, {"lora_name": "x"}, "lora_path"),
        (control.LoadLoRABody, {"lora_name": 3, "lora_path": "/a"}, "lora_name"),
        (control.LoadLoRABody, {"lora_name": "x", "lora_path": "/a", "pinned": "yes"}, "pinned"),
        (control.UnloadLoRABody, {}, "lora_name"),
    ],
)
def test_lora_bodies_name_the_field_at_fault(cls, fields, param):
    with pytest.raises(InvalidParameter) as e:
        control.parse(cls, fields)
    assert e.value.param == param


def test_lora_bodies_parse_sglangs_fields():
    body = control.parse(
        control.LoadLoRABody, {"lora_name": "x", "lora_path": "/a", "pinned": True}
    )
    assert (body.lora_name, body.lora_path, body.pinned) == ("x", "/a", True)
    assert control.parse(control.UnloadLoRABody, {"lora_name": "x"}).lora_name == "x"


def test_a_lora_answer_is_sglangs_body():
    ok = LoRAUpdateOutput(success=True, loaded_adapters=[adapter("sql"), adapter("chat")])
    assert control.lora_update_body(ok) == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"sql": "/adapters/sql", "chat": "/adapters/chat"},
    }
    refused = LoRAUpdateOutput(success=False, error_message="LoRA is not enabled.")
    assert control.lora_update_body(refused)["loaded_adapters"] is None
