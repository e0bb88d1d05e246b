"""A server started with --chat-template, --served-model-name and --api-key: the template
file replaces the model's own (chat_template_kwargs reach it), the model id is the served
name (the path's name becomes unknown), and the openai client needs the key."""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_server import API_KEY, Server, is_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SERVED_NAME = "cadence-e2e-chat"
# ChatML like the model's own template, but with no default system turn and an optional
# `preamble` variable, so its use shows in the prompt's token count.
TEMPLATE = (
    "{% if preamble is defined %}{{ preamble }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
RENDERED = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def template_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_template") / "chatml.jinja"
    path.write_text(TEMPLATE)
    srv = Server(
        "openai_tpl",
        [
            "--chat-template",
            str(path),
            "--served-model-name",
            SERVED_NAME,
            "--api-key",
            API_KEY,
            "--max-total-tokens",
            "2048",
            "--skip-warmup",
        ],
    ).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.destroy()


@pytest.fixture
def client(template_server):
    with openai.OpenAI(
        base_url=template_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as c:
        yield c
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert is_idle(template_server.wait_idle(headers=headers)), "a request outlived its test"


def num_tokens(client, text: str) -> int:
    body = {"prompt": text, "add_special_tokens": False}
    return client.post("/tokenize", cast_to=httpx.Response, body=body).json()["count"]


def test_model_id_is_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    # Another name is served by the one model and echoed back, as SGLang does (a 404 only
    # with --strict-model-name).
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=QUESTION, max_tokens=1
    )
    assert out.model == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_template_file_replaces_the_models_own(client):
    out = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0, max_tokens=1
    )
    assert out.usage.prompt_tokens == num_tokens(client, RENDERED)
    kwargs = {"chat_template_kwargs": {"preamble": "Answer in one word."}}
    out = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0, max_tokens=1, extra_body=kwargs
    )
    assert out.usage.prompt_tokens == num_tokens(client, "Answer in one word.\n" + RENDERED)


def test_missing_or_wrong_api_key_is_401(template_server):
    url = template_server.url + "/v1"
    with openai.OpenAI(base_url=url, api_key="not-the-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=1)
        assert e.value.status_code == 401 and "API key" in e.value.message
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    # The openai client refuses to run without a key, so no Authorization header at all
    # is checked with a plain HTTP client.
    missing = httpx.post(
        url + "/chat/completions", json={"model": SERVED_NAME, "messages": QUESTION}
    )
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
