"""OpenAIServing over a real FrontClient (and its TokenizerManager) whose scheduler is a scripted stand-in: the
request each body turns into, the response and chunk shapes (role chunk, deltas,
finish_reason last, usage, [DONE]), n > 1 indexes, echo and logprobs, the chat template
override, errors with OpenAI field names, and aborts when a stream is left early."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jinja2
import msgspec
import pytest

from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.tokenizer import FrontTokenizer
from cadence.front.tokenizer_manager import TokenizerManager
from cadence.io_struct import AbortReq, BatchStrOutput, Logprobs, TokenizedGenerateReqInput
from cadence.serving.openai_results import OpenAIResponse, OpenAIStream, StreamFailed
from cadence.serving.openai_serving import OpenAIServing

MODEL = "tiny-chat"
EOS = 3  # the stand-in's end-of-sequence token: decodes to nothing
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class CharTokenizer:
    """One token per character (id = code point); its chat template is DEFAULT_TEMPLATE."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)

    def apply_chat_template(
        self,
        messages,
        tokenize=True,
        chat_template=None,
        add_generation_prompt=False,
        continue_final_message=False,
        **kwargs,
    ):
        assert tokenize is False
        template = jinja2.Environment().from_string(chat_template or DEFAULT_TEMPLATE)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
        )


class ScriptedEngine:
    """Stands in for scheduler + detokenizer: answers every request with `reply`, one
    character per step, then EOS (or stops at max_new_tokens). Logprobs are made up:
    -0.5 for the chosen token, alternatives below it."""

    def __init__(self, reply: str = "Paris."):
        self.reply = reply
        self.requests: list[TokenizedGenerateReqInput] = []
        self.aborts: list[str] = []
        self.tm: TokenizerManager | None = None
        self.fail_after: int | None = None  # steps before the request fails with a 500

    def send(self, msg) -> None:
        if isinstance(msg, AbortReq):
            self.aborts.append(msg.rid)
        elif isinstance(msg, TokenizedGenerateReqInput):
            self.requests.append(msg)
            asyncio.get_running_loop().create_task(self._run(msg))

    async def _run(self, req: TokenizedGenerateReqInput) -> None:
        ids = [ord(c) for c in self.reply] + [EOS]
        limit = req.sampling_params.max_new_tokens
        ids = ids[:limit]
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
                    logprobs=[self._logprobs(req, token, first=k == 0)]
                    if req.return_logprob
                    else None,
                )
            )
            if reason is not None:
                return

    @staticmethod
    def _logprobs(req, token: int, first: bool) -> Logprobs:
        num = req.top_logprobs_num
        lp = Logprobs(
            output_token_logprobs_val=[-0.5],
            output_token_logprobs_idx=[token],
            output_top_logprobs_val=[[-0.5, -1.5, -2.5][:num]],
            output_top_logprobs_idx=[[token, token + 1, token + 2][:num]],
        )
        if first and req.logprob_start_len >= 0:
            prompt = req.input_ids[req.logprob_start_len :]
            lp.input_token_logprobs_val = [None] + [-1.0] * (len(prompt) - 1)
            lp.input_token_logprobs_idx = prompt
            lp.input_top_logprobs_val = [None] + [[-1.0] * min(num, 1) for _ in prompt[1:]]
            lp.input_top_logprobs_idx = [None] + [[t] * min(num, 1) for t in prompt[1:]]
        return lp


def make_serving(reply="Paris.", context_len=256, chat_template=None, strict_model_name=False):
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
    client = FrontClient(FrontTokenizer(CharTokenizer()), info, engine.send, max_pending=1088)
    engine.tm = client.tm
    args = SimpleNamespace(chat_template=chat_template, strict_model_name=strict_model_name)
    state = SimpleNamespace(args=args, client=client, started=1000.0)
    return OpenAIServing(state), engine


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def decoded(result: OpenAIResponse) -> dict:
    assert isinstance(result, OpenAIResponse)
    return json.loads(result.body)


async def sse_events(stream: OpenAIStream) -> list:
    frames = [frame async for frame in stream.sse()]
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
    assert frames[-1] == b"data: [DONE]\n\n"
    return [json.loads(f[6:]) for f in frames[:-1]]


USER = [{"role": "user", "content": "Capital of France?"}]


async def test_models():
    serving, _ = make_serving()
    listing = decoded(await serving.list_models())
    assert [m["id"] for m in listing["data"]] == [MODEL] and listing["object"] == "list"
    assert decoded(await serving.retrieve_model(MODEL))["max_model_len"] == 256
    missing = await serving.retrieve_model("gpt-4")
    assert missing.status == 404 and decoded(missing)["error"]["param"] == "model"


async def test_chat_completion_renders_the_template_and_counts_exactly():
    serving, engine = make_serving()
    out = decoded(
        await serving.chat_completions(body(model=MODEL, messages=USER, max_tokens=20, seed=5))
    )
    prompt = "<user>Capital of France?<assistant>"
    assert engine.requests[0].input_ids == [ord(c) for c in prompt]
    assert engine.requests[0].sampling_params.max_new_tokens == 20
    assert engine.requests[0].sampling_params.seed == 5
    assert (
        out["object"] == "chat.completion"
        and out["model"] == MODEL
        and out["id"].startswith("chatcmpl-")
    )
    assert out["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Paris.",
                "reasoning_content": None,
                "tool_calls": None,
                "refusal": None,
            },
            "logprobs": None,
            "finish_reason": "stop",
            "matched_stop": EOS,
        }
    ]
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == len("Paris.") + 1  # EOS counts
    assert out["usage"]["total_tokens"] == len(prompt) + 7


async def test_chat_default_max_tokens_is_what_the_context_leaves():
    serving, engine = make_serving(context_len=100)
    await serving.chat_completions(body(messages=USER))
    assert engine.requests[0].sampling_params.max_new_tokens == 100 - len(
        "<user>Capital of France?<assistant>"
    )


async def test_chat_template_file_and_kwargs(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(
        "{{ greeting }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
        "{% if add_generation_prompt %}[assistant:{% endif %}"
    )
    serving, engine = make_serving(chat_template=str(path))
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    await serving.chat_completions(
        body(messages=messages, max_tokens=1, chat_template_kwargs={"greeting": "hi"})
    )
    await serving.chat_completions(
        body(messages=messages, max_tokens=1, add_generation_prompt=False)
    )
    rendered = ["".join(map(chr, r.input_ids)) for r in engine.requests]
    assert rendered == [
        "hi[system:S][user:U][assistant:A][user:V][assistant:",
        "[system:S][user:U][assistant:A][user:V]",
    ]


def test_unreadable_or_invalid_chat_template_stops_start_up(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        make_serving(chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        make_serving(chat_template=str(bad))


async def test_chat_logprobs():
    serving, _ = make_serving(reply="ab")
    out = decoded(
        await serving.chat_completions(body(messages=USER, logprobs=True, top_logprobs=2))
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b", ""]
    assert content[0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "b", "logprob": -1.5, "bytes": [98]},
    ]
    assert len(content) == out["usage"]["completion_tokens"]


async def test_chat_stream_role_first_finish_last_then_usage():
    serving, _ = make_serving(reply="Hi!")
    stream = await serving.chat_completions(
        body(messages=USER, stream=True, stream_options={"include_usage": True})
    )
    events = await sse_events(stream)
    assert events[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "", "reasoning_content": None},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert all(
        e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events
    )
    deltas = [e["choices"][0] for e in events[1:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hi!"
    assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]
    # EOS adds no text: the closing delta's content is "" (a string on every chunk), with
    # SGLang's null fields, so typed clients see the attributes.
    assert deltas[-1]["delta"] == {"content": "", "reasoning_content": None, "tool_calls": None}
    assert all("reasoning_content" in d["delta"] for d in deltas)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in events[:-1])


async def test_chat_stream_finish_reason_comes_with_the_last_text():
    serving, _ = make_serving(reply="Hi!")
    stream = await serving.chat_completions(body(messages=USER, stream=True, max_tokens=2))
    events = await sse_events(stream)
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"]["content"] == "i"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


async def test_stream_with_n_2_streams_each_choice_with_its_index():
    serving, engine = make_serving(reply="ok")
    stream = await serving.chat_completions(body(messages=USER, n=2, stream=True, seed=1))
    events = await sse_events(stream)
    assert len(engine.requests) == 2
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None}
        assert "".join(c["delta"].get("content") or "" for c in mine[1:]) == "ok"
        assert mine[-1]["finish_reason"] == "stop"
    assert "usage" not in events[-1]


async def test_n_2_non_stream_counts_the_prompt_once():
    serving, _ = make_serving(reply="ok")
    out = decoded(await serving.chat_completions(body(messages=USER, n=2)))
    assert [c["index"] for c in out["choices"]] == [0, 1]
    prompt_len = len("<user>Capital of France?<assistant>")
    assert out["usage"]["prompt_tokens"] == prompt_len and out["usage"]["completion_tokens"] == 6


async def test_completion_with_echo_and_logprobs_matches_its_stream():
    serving, engine = make_serving(reply="cd")
    request = dict(model=MODEL, prompt="ab", max_tokens=2, echo=True, logprobs=1)
    out = decoded(await serving.completions(body(**request)))
    assert engine.requests[0].logprob_start_len == 0
    choice = out["choices"][0]
    assert choice["text"] == "abcd" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c", "d"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {"c": -0.5}, {"d": -0.5}],
        "text_offset": [0, 1, 2, 3],
    }
    events = await sse_events(await serving.completions(body(**request, stream=True)))
    assert "".join(e["choices"][0]["text"] for e in events) == "abcd"
    streamed = [e["choices"][0]["logprobs"] for e in events]
    assert sum((lp["tokens"] for lp in streamed), []) == choice["logprobs"]["tokens"]
    assert sum((lp["text_offset"] for lp in streamed), []) == choice["logprobs"]["text_offset"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_completion_prompt_list_gives_a_choice_per_prompt_and_sample():
    serving, engine = make_serving(reply="x")
    out = decoded(await serving.completions(body(prompt=["ab", "cde"], n=2, max_tokens=1)))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [len(r.input_ids) for r in engine.requests] == [2, 2, 3, 3]
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    out = decoded(await serving.completions(body(prompt=[[104, 105]], max_tokens=1, echo=True)))
    assert out["choices"][0]["text"] == "hix"
    # A token-id prompt is echoed with its special tokens (EOS here), as vLLM does.
    out = decoded(await serving.completions(body(prompt=[104, EOS], max_tokens=1, echo=True)))
    assert out["choices"][0]["text"] == f"h{chr(EOS)}x"


async def test_completion_default_max_tokens_is_16():
    serving, engine = make_serving(reply="y" * 40)
    out = decoded(await serving.completions(body(prompt="a")))
    assert engine.requests[0].sampling_params.max_new_tokens == 16
    assert (
        out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    )


@pytest.mark.parametrize(
    "route, fields, status, param, words",
    [
        (
            "chat",
            {"messages": USER, "temperature": -1},
            400,
            "temperature",
            "temperature must be in [0, 2]",
        ),
        (
            "chat",
            {"messages": USER, "max_tokens": 1000},
            400,
            "max_tokens",
            "plus max_tokens (1000) exceeds",
        ),
        (
            "chat",
            {"messages": USER, "max_completion_tokens": 1000},
            400,
            "max_completion_tokens",
            "plus max_completion_tokens (1000)",
        ),
        (
            "chat",
            {"messages": USER, "min_tokens": 5, "max_tokens": 2},
            400,
            "min_tokens",
            "min_tokens must be <=",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x" * 300}]},
            400,
            "messages",
            "at least the context length (256)",
        ),
        ("chat", {"messages": USER, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
        (
            "chat",
            {
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                },
            },
            400,
            "response_format",
            'response_format is not a valid constraint: Unsupported type "objekt"',
        ),
        (
            "chat",
            {"messages": USER, "regex": "(a|b"},
            400,
            "regex",
            "regex is not a valid constraint: Regex parsing error",
        ),
        ("completions", {"prompt": ""}, 400, "prompt", "prompt"),
        ("completions", {"prompt": [0x3000]}, 400, "prompt", "outside the vocabulary"),
        (
            "completions",
            {"prompt": "a", "stop_token_ids": [-1]},
            400,
            "stop_token_ids",
            "stop_token_ids[0]",
        ),
        ("completions", {"prompt": "a", "n": 0}, 400, "n", "n must be >= 1"),
    ],
)
async def test_errors_have_openai_shape_and_field_names(route, fields, status, param, words):
    serving, engine = make_serving()
    call = serving.chat_completions if route == "chat" else serving.completions
    for stream in (False, True):
        result = await call(body(**fields, stream=stream))
        error = decoded(result)["error"]
        assert result.status == status and error["param"] == param and words in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    assert engine.requests == []


async def test_leaving_a_stream_early_aborts_the_request():
    serving, engine = make_serving(reply="long answer " * 10)
    stream = await serving.completions(body(prompt="a", max_tokens=100, stream=True))
    chunks = aiter(stream)
    first = msgspec.json.decode(await anext(chunks))
    assert first["object"] == "text_completion"
    await chunks.aclose()
    assert engine.aborts == [engine.requests[0].rid]
    assert engine.tm.states == {}


async def test_cancelled_call_aborts_the_request():
    serving, engine = make_serving(reply="long answer " * 10)
    task = asyncio.ensure_future(serving.completions(body(prompt="a", max_tokens=100)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborts == [engine.requests[0].rid] and engine.tm.states == {}


async def test_failure_mid_stream_is_an_error_event_then_done():
    serving, engine = make_serving(reply="abcdef")
    engine.fail_after = 2
    events = await sse_events(await serving.chat_completions(body(messages=USER, stream=True)))
    assert events[-1] == {
        "error": {
            "message": "the model step failed",
            "type": "internal_error",
            "param": None,
            "code": 500,
        }
    }
    engine2_serving, engine2 = make_serving(reply="abcdef")
    engine2.fail_after = 2
    with pytest.raises(StreamFailed) as info:
        async for _ in await engine2_serving.chat_completions(body(messages=USER, stream=True)):
            pass
    assert info.value.status == 500


def test_server_args_refuse_a_missing_chat_template_file(tmp_path):
    from cadence.server_args import ServerArgs

    with pytest.raises(ValueError, match="chat_template: no such file"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert ServerArgs(chat_template=str(tmp_path / "t.jinja")).chat_template.endswith("t.jinja")


async def test_any_model_name_is_served_and_echoed_unless_strict():
    serving, _ = make_serving()
    out = decoded(await serving.chat_completions(body(messages=USER, model="gpt-4")))
    assert out["model"] == "gpt-4" and out["choices"][0]["message"]["content"]
    strict, _ = make_serving(strict_model_name=True)
    refused = await strict.chat_completions(body(messages=USER, model="gpt-4"))
    assert refused.status == 404 and decoded(refused)["error"]["param"] == "model"
    assert "does not exist" in decoded(refused)["error"]["message"]
    assert (
        decoded(await strict.chat_completions(body(messages=USER, model=MODEL)))["model"] == MODEL
    )


@pytest.mark.parametrize("route", ["chat_completions", "completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(route):
    serving, _ = make_serving(reply="Hi!")
    prompt = {"messages": USER} if route == "chat_completions" else {"prompt": "Q"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = await sse_events(
        await getattr(serving, route)(body(**prompt, stream=True, stream_options=options))
    )
    counts = [e["usage"]["completion_tokens"] for e in events]  # the role chunk's is 0
    assert counts == sorted(counts) and counts[-1] == 4 and len(events) >= 4
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events)
    assert all(
        e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
        for e in events
    )
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"] == []


async def test_continuous_usage_stats_without_include_usage_sends_no_usage():
    serving, _ = make_serving(reply="Hi!")
    options = {"continuous_usage_stats": True}
    events = await sse_events(
        await serving.chat_completions(body(messages=USER, stream=True, stream_options=options))
    )
    assert events and all("usage" not in e for e in events)
