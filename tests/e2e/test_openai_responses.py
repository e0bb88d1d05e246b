"""/v1/responses through the official openai client (with the SDK's strict response
validation on) against the shared launched server, and /invocations answering each body as
the route of its shape does.

Generations are kept to a few greedy tokens. Each test ends with the server idle again
(the `client` fixture checks it), so nothing a test started outlives it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from e2e_server import sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = "What is the capital of France?"
SHORT = {"max_output_tokens": 16, "temperature": 0}


@pytest.fixture
def strict(client, server):
    """An openai client that validates every answer against the SDK's models (`client`
    alongside it checks that the server is idle after the test)."""
    with openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    ) as c:
        yield c


def num_tokens(server, text: str) -> int:
    return httpx.post(
        server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["count"]


def test_create_answers_with_usage(strict, model):
    out = strict.responses.create(model=model, input=QUESTION, **SHORT)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == model
    assert out.status in ("completed", "incomplete") and out.error is None
    assert out.output_text.strip()
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"
    usage = out.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_are_the_system_turn(strict, server, model):
    out = strict.responses.create(
        model=model, input=QUESTION, instructions="Answer in one word.", **SHORT
    )
    rendered = (
        "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.usage.input_tokens == num_tokens(server, rendered)
    assert out.instructions == "Answer in one word." and out.output_text.strip()


def test_stream_events_in_order(strict, model):
    events = list(strict.responses.create(model=model, input=QUESTION, stream=True, **SHORT))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] == "response.completed"
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text.strip() and text == events[-4].text == final.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens <= 16


def test_stream_helper_gives_the_final_response(strict, model):
    deltas = []
    with strict.responses.stream(model=model, input=QUESTION, **SHORT) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" or final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "".join(deltas) and final.output_text.strip()


def test_previous_response_id_continues_the_conversation(strict, model):
    first = strict.responses.create(model=model, input="My name is Ada. Say hello.", **SHORT)
    second = strict.responses.create(
        model=model, input="What is my name?", previous_response_id=first.id, **SHORT
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn and its answer.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text.strip()


def test_retrieve_cancel_and_delete(strict, model):
    out = strict.responses.create(model=model, input=QUESTION, metadata={"run": "e2e"}, **SHORT)
    stored = strict.responses.retrieve(out.id)
    assert stored.model_dump() == out.model_dump() and stored.metadata == {"run": "e2e"}
    with pytest.raises(openai.BadRequestError) as e:
        strict.responses.cancel(out.id)
    assert "Cannot cancel a synchronous response." in e.value.message
    strict.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError) as e:
        strict.responses.retrieve(out.id)
    assert f"Response with id '{out.id}' not found." in e.value.message
    with pytest.raises(openai.NotFoundError):
        strict.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        strict.responses.cancel(out.id)


def test_store_false_is_not_retrievable(strict, model):
    out = strict.responses.create(model=model, input=QUESTION, store=False, **SHORT)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        strict.responses.retrieve(out.id)


def test_max_output_tokens_ends_it_incomplete(strict, model):
    out = strict.responses.create(
        model=model, input="Tell me a long story.", max_output_tokens=2, temperature=0
    )
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2 and out.output[0].status == "incomplete"


def test_a_stream_cut_by_max_output_tokens_ends_with_response_completed(strict, model):
    """SGLang's streams end with response.completed; the Response in it says incomplete. The
    SDK's stream helper (which waits for response.completed) gives the final Response."""
    cut = {"model": model, "input": "Tell me a long story.", "max_output_tokens": 3,
           "temperature": 0}  # fmt: skip
    events = list(strict.responses.create(**cut, stream=True))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    with strict.responses.stream(**cut) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper = stream.get_final_response()
    assert helper.status == "incomplete" and helper.output_text == "".join(deltas)
    assert helper.usage.output_tokens == 3


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_constrains_the_answer(strict, model, stream):
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    args = {"model": model, "input": "Where is the Eiffel tower? Answer in JSON.",
            "max_output_tokens": 40, "temperature": 0, "text": {"format": fmt}}  # fmt: skip
    if stream:
        final = list(strict.responses.create(**args, stream=True))[-1].response
    else:
        final = strict.responses.create(**args)
    assert final.text.format.type == "json_schema" and final.text.format.name == "place"
    assert final.status == "completed", final.output_text
    value = json.loads(final.output_text)
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())


def test_text_format_json_object_answers_a_json_object(strict, model):
    out = strict.responses.create(
        model=model, input="Describe Paris in JSON.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert out.text.format.type == "json_object"
    if out.status == "completed":
        assert isinstance(json.loads(out.output_text), dict)
    else:  # cut by the length: still the start of an object
        assert out.output_text.lstrip().startswith("{")


def test_a_schema_the_grammar_refuses_is_a_400_naming_text_format(strict, model):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}
    with pytest.raises(openai.BadRequestError) as e:
        strict.responses.create(model=model, input=QUESTION, text={"format": fmt}, **SHORT)
    assert e.value.param == "text.format" and "objekt" in e.value.message


def test_unknown_previous_response_id_is_a_400_naming_it(strict, model):
    with pytest.raises(openai.BadRequestError) as e:
        strict.responses.create(
            model=model, input=QUESTION, previous_response_id="resp_unknown", **SHORT
        )
    assert e.value.param == "previous_response_id"
    assert e.value.code == "previous_response_not_found"
    assert "Previous response with id 'resp_unknown' not found." in e.value.message


def test_tools_are_refused_naming_the_field(strict, model):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        strict.responses.create(model=model, input=QUESTION, tools=[tool], **SHORT)
    assert e.value.param == "tools" and "not supported" in e.value.message


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json"])
def test_invocations_answers_a_chat_body(client, server, model, content_type):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
    }
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(
        server.url + "/invocations", content=json.dumps(body), headers=headers, timeout=120
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] <= 8


def flushed(server) -> None:
    """An empty prefix cache, so that two requests prefill exactly alike."""
    assert httpx.post(server.url + "/flush_cache").status_code == 200


CHAT = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
SCORE = {"query": "The sky is", "items": [" blue", " green"], "label_token_ids": [28, 30]}


@pytest.mark.parametrize(
    "route, body",
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/v1/score", SCORE)],
)
def test_invocations_answers_a_body_as_the_route_of_its_shape(client, server, route, body):
    """vLLM's /invocations: the same keys and the same answer as the route itself."""
    flushed(server)
    routed = httpx.post(server.url + route, json=body, timeout=120).json()
    flushed(server)
    invoked = httpx.post(server.url + "/invocations", json=body, timeout=120).json()
    assert invoked.keys() == routed.keys(), (invoked, routed)
    if "choices" in routed:
        assert invoked["object"] == routed["object"] and invoked["usage"] == routed["usage"]
        assert invoked["choices"] == routed["choices"]
    else:
        for got, expected in zip(invoked["scores"], routed["scores"], strict=True):
            assert got == pytest.approx(expected, rel=1e-3, abs=1e-9)


def test_invocations_streams_as_the_route_does(client, server):
    """The same text, chunk kind and usage. How many chunks carry the text is not
    compared: tokens that arrive while the client reads travel in one chunk."""

    def content(path: str) -> tuple[str, set, dict]:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert not chunks[-1]["choices"], chunks[-1]  # the usage chunk comes last
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
        return text, {c["object"] for c in chunks}, chunks[-1]["usage"]

    flushed(server)
    routed = content("/v1/chat/completions")
    flushed(server)
    assert content("/invocations") == routed and routed[0]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "m", "temperature": 0}, "found no route for this body"),
        ({"query": "q"}, "found no route for this body"),
        ([CHAT], "must be a JSON object"),  # what the chat route says of it
        ({"messages": "hi"}, "messages"),
    ],
)
def test_invocations_refuses_a_body_of_no_route_with_a_400(client, server, body, words):
    r = httpx.post(server.url + "/invocations", json=body, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
