"""Errors of the OpenAI routes as the official openai client sees them: OpenAI's error shape
with the right status and `param`, for bad parameters, unknown models and fields, and prompts
the model cannot take; and clients that leave abort their request. (The missing API key is
test_openai_template's, on its server with --api-key.)"""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_server import is_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def check_error(error: openai.APIStatusError, status: int, param: str | None, *words: str) -> None:
    assert error.status_code == status
    body = error.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert error.param == param and body["error"]["code"] == status
    for word in words:
        assert word in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_temperature_is_400_naming_it(client, model, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=QUESTION, temperature=-1, stream=stream
        )
    check_error(e.value, 400, "temperature", "temperature must be in [0, 2]")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", temperature=3, stream=stream)
    check_error(e.value, 400, "temperature")


async def test_any_model_name_is_served_by_the_one_model(aclient):
    """As SGLang: the one model serves whatever `model` names (the answer echoes it); only
    --strict-model-name refuses other names (tests/e2e/test_sglang_compat.py)."""
    chat = await aclient.chat.completions.create(
        model="gpt-4o", messages=QUESTION, max_tokens=2, temperature=0
    )
    assert chat.model == "gpt-4o" and chat.choices[0].finish_reason in ("stop", "length")
    stream = await aclient.completions.create(
        model="default", prompt="Hi", max_tokens=2, stream=True
    )
    models = [c.model async for c in stream]
    assert models and set(models) == {"default"}


@pytest.mark.parametrize(
    "route, kwargs, param, words",
    [
        ("chat", {"top_p": 1.5}, "top_p", ["top_p must be in (0, 1]"]),
        ("chat", {"n": 0}, "n", ["n must be >= 1"]),
        ("chat", {"max_tokens": 10_000}, "max_tokens", ["exceeds the context length (8192)"]),
        (
            "chat",
            {"max_completion_tokens": -1},
            "max_completion_tokens",
            ["max_completion_tokens must be >= 0"],
        ),
        ("chat", {"top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
        ("chat", {"logit_bias": {"49152": 5}}, "logit_bias", ["[0, 49152)"]),
        (
            "chat",
            {"extra_body": {"min_tokens": 9}, "max_tokens": 3},
            "min_tokens",
            ["min_tokens must be <= max_tokens"],
        ),
        ("chat", {"extra_body": {"regex": "[a-z"}}, "regex", ["not a valid constraint"]),
        (
            "chat",
            {"messages": [{"role": "user", "content": "Hi " * 9000}]},
            "messages",
            ["at least the context length (8192)"],
        ),
        ("chat", {"messages": []}, "messages", ["must not be empty"]),
        ("completions", {"prompt": [49152]}, "prompt", ["outside the vocabulary"]),
        (
            "completions",
            {"prompt": "Hi", "logprobs": 50},
            "logprobs",
            ["logprobs must be in [0, 20]"],
        ),
        ("completions", {"prompt": "Hi", "suffix": "!"}, "suffix", ["not supported"]),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, model, route, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(**{"model": model, "messages": QUESTION, **kwargs})
        else:
            client.completions.create(model=model, **kwargs)
    check_error(e.value, 400, param, *words)


def test_tokenize_and_detokenize_aliases(client):
    tokens = client.post("/tokenize", cast_to=httpx.Response, body={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
    text = client.post(
        "/detokenize", cast_to=httpx.Response, body={"tokens": tokens["tokens"]}
    ).json()["text"]
    assert text == "Hello world"


def test_leaving_a_stream_early_aborts_it(client, server, model):
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, chunk in zip(range(3), stream):
        assert chunk.choices
    stream.close()
    assert is_idle(server.wait_idle(timeout=10))


def test_a_client_timing_out_aborts_its_request(client, server, model):
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.5).completions.create(
            model=model, prompt="Hi", max_tokens=2000, extra_body={"ignore_eos": True}
        )
    assert is_idle(server.wait_idle(timeout=10))
