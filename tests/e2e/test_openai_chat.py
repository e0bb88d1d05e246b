"""/v1/chat/completions and /v1/models through the official openai client (sync and async)
against the shared launched server of the default model (SmolLM2-135M-Instruct).

Generations are kept to a few tokens: the suite runs on small shared CPUs. Each test ends
with the server idle again, so nothing a test started outlives it.
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's own template adds its default system turn when the messages have none.
RENDERED_QUESTION = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def num_tokens(server, text: str) -> int:
    return httpx.post(
        server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["count"]


def greedy(client, model, **kwargs):
    return client.chat.completions.create(model=model, messages=QUESTION, temperature=0, **kwargs)


def test_models_list_and_retrieve(client, server):
    (card,) = client.models.list().data
    info = httpx.get(server.url + "/model_info").json()
    # Without --served-model-name the id is the model path's name.
    assert card.id == info["served_model_name"] and card.id.startswith("SmolLM2-135M-Instruct")
    assert card.object == "model" and card.owned_by == "cadence"
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.param == "model"


def test_greedy_answer_names_paris_with_exact_usage(client, server, model):
    out = greedy(client, model, max_tokens=24, logprobs=True)
    choice = out.choices[0]
    assert "Paris" in choice.message.content
    assert (
        choice.message.role == "assistant" and choice.index == 0 and choice.finish_reason == "stop"
    )
    assert out.object == "chat.completion" and out.model == model and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == num_tokens(
        server, RENDERED_QUESTION
    )  # the model's own template
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # One logprob per generated token; the EOS that ended the answer counts, as in the engine.
    tokens = [t.token for t in choice.logprobs.content]
    assert out.usage.completion_tokens == len(tokens) and tokens[-1] == "<|im_end|>"
    assert "".join(tokens[:-1]) == choice.message.content


def test_the_default_dtype_answers_paris_too(auto_dtype_server):
    """The dtype `cadence serve` picks by itself (bfloat16 here when the CPU has it), whose
    logits are refined near the top in float32, gives the same answer."""
    from cadence.platforms.cpu import CpuPlatform

    info = httpx.get(auto_dtype_server.url + "/server_info").json()
    expected = "bfloat16" if CpuPlatform().supports_bf16() else "float32"
    assert info["dtype"] == expected  # the scheduler reports the dtype it resolved
    with openai.OpenAI(
        base_url=auto_dtype_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        model = c.models.list().data[0].id
        answer = greedy(c, model, max_tokens=16).choices[0].message.content
    assert "Paris" in answer, answer


def test_logprobs_with_top_logprobs(client, model):
    out = greedy(client, model, max_completion_tokens=5, logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    content = choice.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)  # greedy picks the best
        assert bytes(entry.bytes).decode() == entry.token


async def test_stream_matches_the_whole_answer(aclient, client, model):
    whole = greedy(client, model, max_tokens=24)
    stream = await aclient.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in choice_chunks) == whole.choices[0].message.content
    assert [c.finish_reason for c in choice_chunks] == [None] * (len(choice_chunks) - 1) + ["stop"]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )


def test_the_finish_chunk_carries_the_last_text_as_vllm_sends_it(client, model):
    """vLLM's streaming test reads delta.content of every chunk and of the finish chunk."""
    whole = greedy(client, model, max_tokens=5)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=5, stream=True
        )
    )
    choices = [c.choices[0] for c in chunks]
    assert all(isinstance(c.delta.content, str) for c in choices)
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert choices[-1].delta.content  # the last token's text comes with finish_reason
    assert "".join(c.delta.content for c in choices) == whole.choices[0].message.content


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=5, stream=True,
            stream_options=options,
        )
    )  # fmt: skip
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages), usages
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert len({u.prompt_tokens for u in usages}) == 1 and usages[0].prompt_tokens > 0
    counts = [u.completion_tokens for u in usages]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5  # role chunk first
    assert (
        chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage.completion_tokens == 5
    )
    assert chunks[-1].choices == []
    # continuous_usage_stats without include_usage adds nothing (vLLM).
    plain = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=3, stream=True,
        stream_options={"continuous_usage_stats": True},
    )  # fmt: skip
    assert all(c.usage is None for c in plain)


async def test_n_2_streams_each_choice_with_its_index(aclient, model):
    stream = await aclient.chat.completions.create(
        model=model, messages=QUESTION, n=2, temperature=1.0, seed=7, max_tokens=6, stream=True
    )
    by_index: dict[int, list] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            by_index[choice.index].append(choice)
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason in ("stop", "length")
        assert all(c.finish_reason is None for c in choices[:-1])
        assert "".join(c.delta.content or "" for c in choices)


def test_n_2_counts_every_sample(client, model):
    out = client.chat.completions.create(
        model=model, messages=QUESTION, n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_stop_sequence_ends_before_it(client, model):
    answer = greedy(client, model, max_tokens=24).choices[0].message.content
    assert " Paris" in answer
    out = greedy(client, model, max_tokens=24, stop=[" Paris", "never-generated"])
    assert out.choices[0].message.content == answer[: answer.index(" Paris")]
    assert out.choices[0].finish_reason == "stop"


def test_same_seed_same_text(client, model):
    def sample():
        return (
            client.chat.completions.create(
                model=model, messages=QUESTION, temperature=1.0, seed=1234, max_tokens=8
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_sglang_sampling_extras(client, server, model):
    answer = greedy(client, model, max_tokens=12).choices[0].message.content
    # top_k = 1 is greedy whatever the temperature.
    top1 = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=1.0,
        max_tokens=12,
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    assert top1.choices[0].message.content == answer
    # Past EOS with ignore_eos, at least min_tokens.
    long = greedy(client, model, max_tokens=20, extra_body={"ignore_eos": True, "min_tokens": 20})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 20
    # A stop token id ends the answer early; a ruled-out token never appears.
    paris = httpx.post(
        server.url + "/tokenize", json={"prompt": " Paris", "add_special_tokens": False}
    ).json()
    (paris_id,) = paris["tokens"]
    stopped = greedy(client, model, max_tokens=24, extra_body={"stop_token_ids": [paris_id]})
    assert (
        stopped.choices[0].finish_reason == "stop"
        and "Paris" not in stopped.choices[0].message.content
    )
    banned = greedy(
        client,
        model,
        max_tokens=12,
        logit_bias={str(paris_id): -100},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        user="e2e",
        logprobs=True,
    )
    assert " Paris" not in [t.token for t in banned.choices[0].logprobs.content]


def test_system_and_earlier_turns_shape_the_prompt(client, server, model):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
    ]
    out = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=1
    )
    rendered = (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user\nCapital of Italy?<|im_end|>\n"
        "<|im_start|>assistant\nRome.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.usage.prompt_tokens == num_tokens(server, rendered)
    no_prompt = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=1,
        extra_body={"add_generation_prompt": False},
    )
    assert no_prompt.usage.prompt_tokens == num_tokens(
        server, rendered.removesuffix("<|im_start|>assistant\n")
    )
