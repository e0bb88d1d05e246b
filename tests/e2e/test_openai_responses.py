"""/v1/responses through the official openai client (with the SDK's strict response
validation on) against the shared launched server, and /invocations answering a chat body.

Generations are kept to a few greedy tokens. Each test ends with the server idle again
(the `client` fixture checks it), so nothing a test started outlives it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

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
    assert kinds[-1] in ("response.completed", "response.incomplete")
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
