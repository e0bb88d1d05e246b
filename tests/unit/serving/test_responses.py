"""ResponsesServing over a real FrontClient whose scheduler is a scripted stand-in: how input
becomes chat messages, previous_response_id chains, the store's bound and TTL, errors naming
the field, and the stream's events (their order and sequence numbers). Every Response and
event is also validated against the openai SDK's own models."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jinja2
import openai.types.responses as sdk
import pydantic
import pytest

from cadence.errors import InvalidParameter
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import AbortReq, BatchStrOutput, Logprobs, TokenizedGenerateReqInput
from cadence.serving.openai_results import OpenAIResponse
from cadence.serving.openai_serving import OpenAIServing
from cadence.serving.responses import ResponsesServing, ResponsesStream, ResponseStore
from cadence.serving.responses_protocol import input_messages, parse_request

MODEL = "tiny-chat"
EOS = 3  # the stand-in's end-of-sequence token: decodes to nothing
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
EVENTS = pydantic.TypeAdapter(sdk.ResponseStreamEvent)


class CharTokenizer:
    """One token per character (id = code point); its chat template is TEMPLATE."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages, tokenize=True, chat_template=None, **kwargs):
        assert tokenize is False and kwargs["add_generation_prompt"] is True
        return jinja2.Environment().from_string(TEMPLATE).render(messages=messages)


class ScriptedEngine:
    """Stands in for scheduler + detokenizer: answers every request with `reply`, one
    character per step, then EOS (or stops at max_new_tokens); logprobs are made up."""

    def __init__(self, reply: str):
        self.reply = reply
        self.requests: list[TokenizedGenerateReqInput] = []
        self.aborts: list[str] = []
        self.tm = None
        self.fail_after: int | None = None  # steps before the request fails with a 500

    def send(self, msg) -> None:
        if isinstance(msg, AbortReq):
            self.aborts.append(msg.rid)
        elif isinstance(msg, TokenizedGenerateReqInput):
            self.requests.append(msg)
            asyncio.get_running_loop().create_task(self._run(msg))

    def prompt(self, index: int = -1) -> str:
        return "".join(map(chr, self.requests[index].input_ids))

    async def _run(self, req: TokenizedGenerateReqInput) -> None:
        limit = req.sampling_params.max_new_tokens
        ids = ([ord(c) for c in self.reply] + [EOS])[:limit]
        for k, token in enumerate(ids):
            await asyncio.sleep(0.001)
            if req.rid in self.aborts or req.rid not in self.tm.states:
                return
            if self.fail_after is not None and k == self.fail_after:
                reason = {"type": "abort", "message": "the model step failed", "status_code": 500}
            elif token == EOS:
                reason = {"type": "stop", "matched": EOS}
            elif k == len(ids) - 1:
                reason = {"type": "length", "length": limit}
            else:
                reason = None
            num = req.top_logprobs_num
            logprobs = Logprobs(
                output_token_logprobs_val=[-0.5],
                output_token_logprobs_idx=[token],
                output_top_logprobs_val=[[-0.5, -1.5][:num]],
                output_top_logprobs_idx=[[token, token + 1][:num]],
            )
            self.tm.book.on_output(
                BatchStrOutput(
                    rids=[req.rid],
                    http_worker_ipcs=[None],
                    finished_reasons=[reason],
                    output_strs=["" if token == EOS else chr(token)],
                    output_ids=[[token]],
                    prompt_tokens=[len(req.input_ids)],
                    completion_tokens=[k + 1],
                    cached_tokens=[0],
                    logprobs=[logprobs] if req.return_logprob else None,
                )
            )
            if reason is not None:
                return


def make_serving(reply="Paris.", context_len=256, store=None):
    engine = ScriptedEngine(reply)
    info = ModelInfo(
        model_path="/models/tiny",
        tokenizer_path=None,
        served_model_name=MODEL,
        context_len=context_len,
        vocab_size=0x3000,
        max_total_tokens=4096,
        grammar_backend="xgrammar",
    )
    client = FrontClient(FrontTokenizer(CharTokenizer()), info, engine.send, max_pending=64)
    engine.tm = client.tm
    state = SimpleNamespace(args=SimpleNamespace(chat_template=None), client=client, started=0.0)
    return ResponsesServing(OpenAIServing(state), store), engine


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def decoded(result) -> dict:
    assert isinstance(result, OpenAIResponse), result
    return json.loads(result.body)


async def create(serving, **fields) -> dict:
    result = await serving.create(body(**fields))
    out = decoded(result)
    assert result.status == 200, out
    sdk.Response.model_validate(out, strict=True)  # what the SDK's strict mode checks
    return out


async def sse_events(stream: ResponsesStream) -> list[dict]:
    events = []
    async for frame in stream.sse():
        head, data, end = frame.split(b"\n", 2)
        assert head.startswith(b"event: ") and data.startswith(b"data: ") and end == b"\n"
        event = json.loads(data[6:])
        assert head[7:].decode() == event["type"]
        EVENTS.validate_python(event)
        events.append(event)
    return events


# ---- input → messages ---------------------------------------------------------------------------


def test_input_string_is_one_user_turn():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A"}]},
        {  # an output item of an earlier response, replayed as it was answered
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "B", "annotations": [], "logprobs": []}],
        },
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "C"}, {"type": "input_text", "text": "D"}],
        },
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C\nD"},
    ]


@pytest.mark.parametrize(
    "items, words",
    [
        ([], "non-empty list"),
        (["hi"], "input[0] must be a message"),
        ([{"type": "item_reference", "id": "msg_1"}], "item_reference is not supported"),
        ([{"type": "function_call_output", "call_id": "c", "output": "x"}], "not supported"),
        ([{"role": "tool", "content": "x"}], "input[0].role must be one of"),
        ([{"role": "user"}], "input[0].content must be"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "does not accept input_image",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "must be a text part"),
    ],
)
def test_bad_input_is_a_400_naming_input(items, words):
    with pytest.raises(InvalidParameter) as e:
        input_messages(items)
    assert e.value.param == "input" and words in str(e.value)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({}, "input", "input is required"),
        ({"input": 5}, "input", "wrong type"),
        ({"input": "x", "temperature": 3}, "temperature", "in [0, 2]"),
        ({"input": "x", "temperature": "hot"}, "temperature", "wrong type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs", "in [0, 20]"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "tool calling"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "tool calling"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "one of text, json"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
            "text.format",
            "schema must be a JSON schema object",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format",
            "name must be a non-empty string",
        ),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", "wrong type"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ],
)
def test_bad_fields_are_a_400_naming_them(fields, param, words):
    with pytest.raises(InvalidParameter) as e:
        parse_request(body(**fields))
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_fields_this_server_does_not_implement_are_ignored():
    req = parse_request(
        body(
            input="x",
            reasoning={"effort": "low"},
            truncation="auto",
            user="u",
            prompt_cache_key="k",
            service_tier="auto",
            tools=[],
            tool_choice="auto",
            text={"format": {"type": "text"}, "verbosity": "low"},
        )
    )
    assert req.input == "x"


# ---- unary --------------------------------------------------------------------------------------


async def test_create_renders_instructions_then_input_and_counts_exactly():
    serving, engine = make_serving()
    out = await create(serving, model=MODEL, input="Capital?", instructions="Be brief.")
    prompt = "<system>Be brief.<user>Capital?<assistant>"
    assert engine.prompt() == prompt
    assert out["id"].startswith("resp_") and out["object"] == "response"
    assert out["status"] == "completed" and out["model"] == MODEL and out["error"] is None
    (message,) = out["output"]
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}
    ]
    assert out["usage"] == {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": len("Paris.") + 1,  # EOS counts
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt) + 7,
    }
    assert out["instructions"] == "Be brief." and out["store"] is True
    # The default length is whatever the context leaves, as for chat.
    assert engine.requests[0].sampling_params.max_new_tokens == 256 - len(prompt)


async def test_max_output_tokens_ends_it_incomplete():
    serving, engine = make_serving()
    out = await create(serving, input="Q", max_output_tokens=3, temperature=0, top_p=0.5)
    params = engine.requests[0].sampling_params
    assert (params.max_new_tokens, params.temperature, params.top_p) == (3, 0, 0.5)
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"
    assert out["output"][0]["content"][0]["text"] == "Par"
    assert (out["max_output_tokens"], out["temperature"], out["top_p"]) == (3, 0, 0.5)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    "fmt, constraint",
    [
        ({"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}, SCHEMA),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "text"}, None),
    ],
)
async def test_text_format_constrains_the_answer_as_chat_response_format_does(fmt, constraint):
    serving, engine = make_serving(reply='{"city": "Paris"}')
    out = await create(serving, input="Q", text={"format": fmt})
    schema = engine.requests[0].sampling_params.json_schema
    assert (json.loads(schema) if schema else None) == constraint
    assert out["text"] == {"format": fmt}  # echoed as the SDK's ResponseTextConfig
    assert out["output"][0]["content"][0]["text"] == '{"city": "Paris"}'


async def test_a_schema_the_grammar_refuses_is_a_400_naming_text_format():
    serving, engine = make_serving()
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}
    result = await serving.create(body(input="Q", text={"format": fmt}))
    error = decoded(result)["error"]
    assert result.status == 400 and error["param"] == "text.format", error
    assert error["message"].startswith("text.format is not a valid constraint"), error
    assert engine.requests == []  # refused at the edge


async def test_top_logprobs_returns_a_logprob_per_output_token():
    serving, engine = make_serving(reply="ab")
    out = await create(serving, input="Q", top_logprobs=2)
    assert engine.requests[0].return_logprob and engine.requests[0].top_logprobs_num == 2
    logprobs = out["output"][0]["content"][0]["logprobs"]
    assert [lp["token"] for lp in logprobs] == ["a", "b", ""]
    assert logprobs[0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "b", "logprob": -1.5, "bytes": [98]},
    ]


async def test_errors_from_below_name_the_responses_fields():
    serving, engine = make_serving(context_len=64)
    too_long = decoded(await serving.create(body(input="x", max_output_tokens=100)))
    assert too_long["error"]["param"] == "max_output_tokens"
    assert "max_output_tokens (100)" in too_long["error"]["message"]
    prompt_too_long = decoded(await serving.create(body(input="x" * 100, stream=True)))
    assert prompt_too_long["error"]["param"] == "input"
    assert engine.requests == []


# ---- stored responses ---------------------------------------------------------------------------


async def test_retrieve_delete_and_cancel():
    serving, _ = make_serving()
    out = await create(serving, input="Q", metadata={"k": "v"})
    assert out["metadata"] == {"k": "v"}
    assert decoded(serving.retrieve(out["id"])) == out
    cancel = serving.cancel(out["id"])
    assert cancel.status == 400
    assert decoded(cancel)["error"]["message"] == "Cannot cancel a synchronous response."
    assert decoded(serving.delete(out["id"])) == {
        "id": out["id"],
        "object": "response",
        "deleted": True,
    }
    for call in (serving.retrieve, serving.cancel, serving.delete):
        missing = call(out["id"])
        assert missing.status == 404
        assert decoded(missing)["error"]["message"] == f"Response with id '{out['id']}' not found."


async def test_store_false_is_not_kept():
    serving, _ = make_serving()
    out = await create(serving, input="Q", store=False)
    assert out["store"] is False and serving.retrieve(out["id"]).status == 404
    result = await serving.create(body(input="Q2", previous_response_id=out["id"]))
    assert result.status == 400


async def test_previous_response_id_continues_the_conversation():
    serving, engine = make_serving(reply="R")
    first = await create(serving, input="A", instructions="Old rules.")
    second = await create(
        serving,
        input=[{"role": "user", "content": "B"}],
        previous_response_id=first["id"],
        instructions="New rules.",
    )
    third = await create(serving, input="C", previous_response_id=second["id"])
    # Instructions apply to their own response only; inputs and outputs chain recursively.
    assert [engine.prompt(i) for i in range(3)] == [
        "<system>Old rules.<user>A<assistant>",
        "<system>New rules.<user>A<assistant>R<user>B<assistant>",
        "<user>A<assistant>R<user>B<assistant>R<user>C<assistant>",
    ]
    assert third["previous_response_id"] == second["id"]
    assert third["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    # Deleting a link does not break the responses that continued it.
    serving.delete(second["id"])
    await create(serving, input="D", previous_response_id=third["id"])
    assert engine.prompt().startswith("<user>A<assistant>R<user>B")


async def test_unknown_previous_response_is_a_400_with_its_code():
    serving, engine = make_serving()
    result = await serving.create(body(input="Q", previous_response_id="resp_nope"))
    assert result.status == 400
    assert decoded(result)["error"] == {
        "message": "Previous response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert engine.requests == []


def _put(store: ResponseStore, response_id: str) -> None:
    store.put({"id": response_id}, [])


def test_store_keeps_the_newest_within_its_bound():
    store = ResponseStore(max_entries=3, ttl_s=100, clock=lambda: 0.0)
    for i in range(5):
        _put(store, f"r{i}")
    assert len(store) == 3 and store.get("r1") is None and store.get("r2") is not None
    _put(store, "r2")  # storing an id again makes it the newest
    _put(store, "r5")
    assert store.get("r3") is None and store.get("r2") is not None


def test_store_forgets_entries_past_their_ttl():
    now = [0.0]
    store = ResponseStore(max_entries=10, ttl_s=60, clock=lambda: now[0])
    _put(store, "old")
    now[0] = 30.0
    _put(store, "new")
    now[0] = 59.0
    assert store.get("old") is not None
    now[0] = 60.0
    assert store.get("old") is None and store.get("new") is not None
    assert store.pop("old") is None and len(store) == 1
    now[0] = 90.0
    assert len(store) == 0


# ---- streaming ----------------------------------------------------------------------------------


async def test_stream_events_in_order_with_sequence_numbers():
    serving, _ = make_serving(reply="Hi!")
    stream = await serving.create(body(input="Q", stream=True))
    events = await sse_events(stream)
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all("error" not in e for e in events)  # the SDK raises on a top-level "error"
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert final["id"] == created["id"] and final["status"] == "completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hi!" == events[-4]["text"] == final["output"][0]["content"][0]["text"]
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]}
    assert events[-2]["item"] == final["output"][0]
    assert final["usage"]["output_tokens"] == 4
    assert decoded(serving.retrieve(final["id"])) == final


async def test_stream_cut_by_max_output_tokens_ends_with_response_completed_saying_incomplete():
    serving, _ = make_serving(reply="Hello")
    events = await sse_events(
        await serving.create(body(input="Q", max_output_tokens=2, stream=True))
    )
    assert events[-1]["type"] == "response.completed"  # SGLang's end; the SDK helper's too
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "He"


async def test_failure_mid_stream_is_an_error_event_then_response_failed():
    serving, engine = make_serving(reply="abcdef")
    engine.fail_after = 2
    events = await sse_events(await serving.create(body(input="Q", stream=True)))
    error, failed = events[-2:]
    assert error == {
        "type": "error",
        "sequence_number": error["sequence_number"],
        "code": "server_error",
        "message": "the model step failed",
        "param": None,
    }
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {
        "code": "server_error",
        "message": "the model step failed",
    }
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_leaving_a_stream_early_aborts_the_request():
    serving, engine = make_serving(reply="long answer " * 10)
    stream = await serving.create(body(input="Q", stream=True))
    frames = stream.sse()
    assert (await anext(frames)).startswith(b"event: response.created\n")
    await frames.aclose()
    assert engine.aborts == [engine.requests[0].rid] and engine.tm.states == {}


async def test_cancelled_call_aborts_the_request():
    serving, engine = make_serving(reply="long answer " * 10)
    task = asyncio.ensure_future(serving.create(body(input="Q")))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborts == [engine.requests[0].rid] and engine.tm.states == {}
