"""Speech end to end: `cadence serve --pipeline speech` through the official openai client.

The server holds one copy of the model: its thinker generates on the server's own scheduler
(measured: resident memory, and the scheduler's load while a chat is spoken). Every format
decodes back (soundfile, miniaudio, PyAV) to a non-silent waveform whose length fits the text
at the asked speed; streamed speech gives its first bytes long before the last; bad input is
a 400 naming the field; the server says what it can do, and a server without the pipeline
refuses speech with a 400 saying how to start one."""

from __future__ import annotations

import base64
import glob
import json
import os
import signal
import sys
import time

import httpx
import openai
import pytest
from e2e_server import child_pids, is_idle, tagged_pids, tried

from cadence.model_loader.locate import default_model_path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit", "speech"))
from speech_checks import assert_speech, decode, duration_s  # noqa: E402

pytestmark = pytest.mark.slow

TEXT = "The weather is lovely today. Shall we take a walk along the river before lunch?"
FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
SPEECH_PATH, CHAT_PATH = "/v1/audio/speech", "/v1/chat/completions"


@pytest.fixture
def speech(speech_server):
    with openai.OpenAI(
        base_url=speech_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c
    assert is_idle(speech_server.wait_idle()), "a request outlived its test"


# ---- one copy of the model ----------------------------------------------------------------
# First in this file: the speech server is compared fresh with a fresh server without the
# pipeline, after the same small amount of work on each.

QUESTION = [{"role": "user", "content": "Describe the sea in three short sentences."}]
MIB = 1 << 20


def _rss(pid: int) -> int:
    """VmRSS of one process, from /proc (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _stage_processes(srv) -> dict[str, int]:
    """The pid of each stage process of the server's pipeline, by process name: the one that
    bound its PULL socket (p<rank> in the pipeline's socket directory)."""
    from cadence.pipeline import load_pipeline_config, resolve_pipeline_path

    graph = load_pipeline_config(resolve_pipeline_path("speech")).graph
    (directory,) = glob.glob(os.path.join(srv.tmpdir, "cadence-pipe-*"))
    paths = {os.path.join(directory, f"p{graph.rank_of(p)}"): p for p in graph.processes}
    inodes = {}
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[7] in paths:
                inodes[parts[6]] = paths[parts[7]]
    owners = {}
    for pid in tagged_pids(srv.tag):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in inodes:
                owners[inodes[link[8:-1]]] = pid
    return owners


def _same_small_work(srv, spoken: bool) -> None:
    with srv.client() as c:
        chat = {"model": "m", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
        assert c.post(CHAT_PATH, json=chat).status_code == 200
        if spoken:
            r = c.post(SPEECH_PATH, json={"model": "m", "input": TEXT, "response_format": "wav"})
            assert r.status_code == 200
            audio = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
            assert c.post(CHAT_PATH, json={**chat, **audio}).status_code == 200
    assert is_idle(srv.wait_idle())


def test_the_speech_server_holds_one_copy_of_the_model(speech_server, speech_baseline_server):
    """Resident memory of the server with --pipeline speech <= the same server without it +
    the vocoder's share: the model-free processes the pipeline adds (its fork server, and the
    stage processes that run only talker, vocoder or encoder) and, for the thinker now placed
    in the front, what one model-free stage process costs, all measured here. A thinker with
    an engine of its own (the old declaration: its process took 416 MiB against 161 to 169
    MiB for each model-free stage, measured with the same flags) does not fit."""
    from cadence.pipeline import load_pipeline_config, resolve_pipeline_path

    _same_small_work(speech_baseline_server, spoken=False)
    _same_small_work(speech_server, spoken=True)
    graph = load_pipeline_config(resolve_pipeline_path("speech")).graph
    stages = _stage_processes(speech_server)
    model_free = {
        name: pid
        for name, pid in stages.items()
        if all(
            graph.stages[s].executor.startswith("cadence.speech.executors:")
            for s in graph.stages_of(name)
        )
    }
    (fork_server,) = {
        p for p in child_pids(speech_server.proc.pid) if set(stages.values()) & set(child_pids(p))
    }
    without = {pid: _rss(pid) for pid in tagged_pids(speech_baseline_server.tag)}
    with_pipeline = {pid: _rss(pid) for pid in tagged_pids(speech_server.tag)}
    one_stage = max(_rss(pid) for pid in model_free.values())
    share = _rss(fork_server) + sum(_rss(pid) for pid in model_free.values()) + one_stage
    figures = (
        f"without the pipeline {sum(without.values()) / MIB:.0f} MiB "
        f"({len(without)} processes); with it {sum(with_pipeline.values()) / MIB:.0f} MiB "
        f"({len(with_pipeline)} processes); the vocoder's share {share / MIB:.0f} MiB = fork "
        f"server {_rss(fork_server) / MIB:.0f} + "
        + " + ".join(f"{name} {_rss(pid) / MIB:.0f}" for name, pid in sorted(model_free.items()))
        + f" + the thinker in the front, at most one model-free stage {one_stage / MIB:.0f}; "
        f"front process {_rss(speech_server.proc.pid) / MIB:.0f} MiB with the pipeline, "
        f"{_rss(speech_baseline_server.proc.pid) / MIB:.0f} MiB without"
    )
    print(figures)
    # RSS moves by a few MiB from run to run in each of the 8 processes (the front's by tens,
    # with the audio it has just encoded). A second copy of the model costs at least its
    # weights, the size of the GGUF file (94 MiB): half of that tells the two apart.
    slack = os.path.getsize(default_model_path()) / 2
    assert sum(with_pipeline.values()) <= sum(without.values()) + share + slack, figures
    # And in structure: no stage process of the thinker; every other process the pipeline
    # added is the fork server or one of its stage processes.
    assert set(stages) == set(model_free) == {"talker", "vocoder", "encoder"}, stages
    assert set(child_pids(fork_server)) == set(stages.values())
    assert len(with_pipeline) == len(without) + 1 + len(stages)


def test_a_chat_spoken_runs_on_the_servers_scheduler_and_leaving_aborts_it(speech_server):
    """While a chat is spoken its generation is a request of the server's own scheduler
    (/v1/loads counts it); a client that leaves the stream aborts it there at once, long
    before its 1500 tokens could have been written."""
    body = {
        "model": "m",
        "messages": QUESTION,
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"},
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", speech_server.url + CHAT_PATH, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        load = speech_server.load()
        assert load["num_running_reqs"] + load["num_waiting_reqs"] == 1, load
    left = time.monotonic()
    assert is_idle(speech_server.wait_idle(timeout=5)), speech_server.load()
    assert time.monotonic() - left < 5


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_is_speech_of_the_text(speech, fmt):
    audio = speech.audio.speech.create(
        model="tts-1", input=TEXT, voice="alloy", response_format=fmt
    )
    assert_speech(audio.content, fmt, TEXT)
    mime = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}
    assert audio.response.headers["content-type"].startswith(mime.get(fmt, f"audio/{fmt}"))


def test_nothing_speakable_is_a_valid_silent_file_in_every_format(speech, speech_server):
    """Nothing to say (".", "?", an emoji): every format answers a file that decodes to
    (near) silence; mp3 used to be a 500. The gRPC stream ends the same way."""
    from grpc_support import stub

    from cadence.grpc import sglang_pb2 as pb

    for text in (".", "?", "\U0001f600"):
        for fmt in FORMATS:
            audio = speech.audio.speech.create(
                model="tts-1", input=text, voice="alloy", response_format=fmt
            )
            samples, rate = decode(audio.content, fmt)
            assert len(samples) <= 0.1 * rate and abs(samples).max(initial=0.0) < 0.01, fmt
    chunks = list(
        stub(speech_server).SynthesizeSpeech(
            pb.SpeechRequest(input=".", response_format="mp3"), timeout=60
        )
    )
    assert chunks[-1].finished and len(decode(b"".join(c.audio for c in chunks), "mp3")[0]) > 0


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_scales_the_duration(speech, speed):
    normal = speech.audio.speech.create(
        model="tts-1", input=TEXT, voice="echo", response_format="wav"
    )
    scaled = speech.audio.speech.create(
        model="tts-1", input=TEXT, voice="echo", response_format="wav", speed=speed
    )
    assert_speech(scaled.content, "wav", TEXT, speed=speed)
    ratio = duration_s(normal.content, "wav") / duration_s(scaled.content, "wav")
    assert ratio == pytest.approx(speed, rel=0.2)


def test_espeak_voices_and_openai_names(speech):
    for voice in ("nova", "onyx", "fr", "de+f3", "en-gb"):
        audio = speech.audio.speech.create(
            model="tts-1", input="Bonjour. Hallo. Hello.", voice=voice, response_format="pcm"
        )
        assert duration_s(audio.content, "pcm") > 0.5, voice


def test_streamed_speech_starts_long_before_it_ends(speech):
    # mp3: its encoder's work per sentence makes the whole take long enough to time (35
    # sentences, near --max-speech-chars: about 0.3 s here). A server that sends nothing
    # until the end fails every try; a stall of a busy machine before the first bytes gets
    # two more.
    text = " ".join(f"This is sentence number {i} of a long text read aloud." for i in range(35))
    assert len(text) <= 2000  # the default --max-speech-chars

    def timed() -> tuple[float, float, list[bytes]]:
        started = time.monotonic()
        chunks, first_at = [], None
        with speech.audio.speech.with_streaming_response.create(
            model="tts-1", input=text, voice="alloy", response_format="mp3"
        ) as response:
            for chunk in response.iter_bytes():
                first_at = first_at or time.monotonic() - started
                chunks.append(chunk)
        return first_at, time.monotonic() - started, chunks

    first_at, total, chunks = tried(timed, lambda got: got[0] < got[1] / 2)
    assert len(chunks) > 5
    assert first_at < total / 2, f"first bytes at {first_at:.3f} s of {total:.3f} s"
    assert_speech(b"".join(chunks), "mp3", text)


def test_sse_gives_delta_events_then_done(speech_server):
    body = {
        "model": "tts-1",
        "input": TEXT,
        "voice": "coral",
        "response_format": "mp3",
        "stream_format": "sse",
    }
    events = []
    with httpx.stream("POST", speech_server.url + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and len(events) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert_speech(audio, "mp3", TEXT)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": ""}, "input", "non-empty"),
        ({"input": "x" * 2001}, "input", "--max-speech-chars"),
        ({"voice": "nobody"}, "voice", "unknown voice"),
        ({"response_format": "ogg"}, "response_format", "must be one of"),
        ({"speed": 0.2}, "speed", "between 0.25 and 4.0"),
        ({"speed": 4.5}, "speed", "between 0.25 and 4.0"),
        ({"stream_format": "chunks"}, "stream_format", "audio or sse"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(speech, fields, param, words):
    body = {"model": "tts-1", "input": "Hello.", "voice": "alloy", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        speech.audio.speech.create(**body)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_the_speech_server_says_what_it_can_do(speech_server):
    caps = httpx.get(speech_server.url + "/capabilities").json()
    assert {"speech", "audio_output", "chat", "streaming"} <= set(caps["capabilities"])
    assert caps["speech"]["max_speech_chars"] == 2000 and "opus" in caps["speech"]["formats"]
    cards = httpx.get(speech_server.url + "/v1/models").json()["data"]
    assert all(set(card["capabilities"]) == set(caps["capabilities"]) for card in cards)
    voices = httpx.get(speech_server.url + "/v1/audio/voices").json()["data"]
    assert {"alloy", "en-us", "fr"} <= {v["id"] for v in voices}


def test_a_server_without_the_pipeline_refuses_speech(server):
    caps = httpx.get(server.url + "/capabilities").json()["capabilities"]
    assert "speech" not in caps and "audio_output" not in caps and "chat" in caps
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["capabilities"] == caps
    r = httpx.post(
        server.url + "/v1/audio/speech", json={"model": "m", "input": "Hi.", "voice": "alloy"}
    )
    assert r.status_code == 400 and "--pipeline speech" in r.json()["error"]["message"]


# ---- chat with audio output: thinker -> talker -> vocoder -> encoder ------------------------


def test_chat_with_audio_speaks_its_answer(speech):
    before = time.time()
    completion = speech.chat.completions.create(
        model="m",
        messages=QUESTION,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        max_tokens=48,
        temperature=0,
    )
    message = completion.choices[0].message
    assert message.content and message.audio.transcript == message.content
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > before
    assert_speech(base64.b64decode(message.audio.data), "wav", message.content)
    assert completion.usage.completion_tokens > 0
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_interleaves_text_and_audio(speech):
    text, audio, kinds, last = [], [], [], None
    stream = speech.chat.completions.create(
        model="m",
        messages=QUESTION,
        modalities=["text", "audio"],
        audio={"voice": "nova", "format": "pcm16"},
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
            kinds.append("text")
        if delta.audio and getattr(delta.audio, "data", None):
            audio.append(base64.b64decode(delta.audio.data))
            kinds.append("audio")
        if chunk.choices[0].finish_reason:
            last = delta.audio
    transcript = "".join(text)
    assert last.transcript == transcript and last.expires_at > 0
    assert kinds[0] == "text" and "audio" in kinds
    assert_speech(b"".join(audio), "pcm", transcript)


def test_text_chat_on_the_speech_server_has_no_audio(speech):
    completion = speech.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=8, temperature=0
    )
    assert completion.choices[0].message.content and completion.choices[0].message.audio is None


@pytest.mark.parametrize(
    ("audio", "words"),
    [
        ({"voice": "nobody", "format": "wav"}, "unknown voice"),
        ({"voice": "alloy", "format": "ogg"}, "audio.format must be one of"),
        (None, "needs audio"),
    ],
)
def test_bad_audio_options_are_a_400_naming_audio(speech, audio, words):
    extra = {"audio": audio} if audio is not None else {}
    with pytest.raises(openai.BadRequestError) as e:
        speech.chat.completions.create(
            model="m", messages=QUESTION, modalities=["text", "audio"], max_tokens=4, **extra
        )
    assert e.value.body["param"] == "audio" and words in e.value.body["message"]


def test_audio_output_from_a_server_without_the_pipeline_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m",
            messages=QUESTION,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            max_tokens=4,
        )
    assert e.value.body["param"] == "modalities" and "--pipeline speech" in e.value.body["message"]


# ---- gRPC: SynthesizeSpeech, chat with audio through ChatComplete, capabilities --------------


def test_grpc_synthesize_speech_streams_the_file(speech_server):
    from grpc_support import stub

    from cadence.grpc import sglang_pb2 as pb

    rpc = stub(speech_server)
    for fmt in ("mp3", "pcm"):
        request = pb.SpeechRequest(input=TEXT, model="tts-1", voice="shimmer", response_format=fmt)
        chunks = list(rpc.SynthesizeSpeech(request, timeout=60))
        assert chunks[-1].finished and not chunks[-1].audio
        assert not any(c.finished for c in chunks[:-1]) and len(chunks) > 2
        assert {c.content_type for c in chunks} == {"audio/mpeg" if fmt == "mp3" else "audio/pcm"}
        assert_speech(b"".join(c.audio for c in chunks), fmt, TEXT)
    fast = list(
        rpc.SynthesizeSpeech(pb.SpeechRequest(input=TEXT, response_format="pcm", speed=2.0))
    )
    assert_speech(b"".join(c.audio for c in fast), "pcm", TEXT, speed=2.0)
    cards = rpc.ListModels(pb.ListModelsRequest()).models
    assert {"speech", "audio_output"} <= set(cards[0].capabilities)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"input": ""}, "input"), ({"voice": "nobody"}, "voice"), ({"speed": 5.0}, "speed")],
)
def test_grpc_bad_speech_is_invalid_argument_naming_the_field(speech_server, fields, param):
    import grpc
    from grpc_support import stub

    from cadence.grpc import sglang_pb2 as pb

    request = pb.SpeechRequest(**{"input": "Hello.", **fields})
    with pytest.raises(grpc.RpcError) as e:
        list(stub(speech_server).SynthesizeSpeech(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in e.value.details()


def test_grpc_chat_with_audio_through_chat_complete(speech_server):
    from grpc_support import stub

    from cadence.grpc import sglang_pb2 as pb

    body = {
        "model": "m",
        "messages": QUESTION,
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "mp3"},
        "max_tokens": 32,
        "temperature": 0,
    }
    (reply,) = stub(speech_server).ChatComplete(
        pb.OpenAIRequest(json_body=json.dumps(body).encode()), timeout=120
    )
    message = json.loads(reply.json_chunk)["choices"][0]["message"]
    assert message["audio"]["transcript"] == message["content"]
    assert_speech(base64.b64decode(message["audio"]["data"]), "mp3", message["content"])


def test_grpc_speech_without_the_pipeline_is_invalid_argument(server):
    import grpc
    from grpc_support import stub

    from cadence.grpc import sglang_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        list(stub(server).SynthesizeSpeech(pb.SpeechRequest(input="Hello."), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--pipeline speech" in e.value.details()
    (card,) = stub(server).ListModels(pb.ListModelsRequest()).models
    assert "speech" not in card.capabilities and "chat" in card.capabilities


# ---- the router in front of a text replica and a speech replica -------------------------------


async def test_router_reads_capabilities_and_routes_speech_to_the_speech_replica(
    server, speech_server
):
    from router_checks import start_router, wait_for

    router = await start_router([server.url, speech_server.url])
    try:
        workers = {w.url: w for w in router.registry}
        text_worker, speech_worker = workers[server.url], workers[speech_server.url]
        assert {"speech", "audio_output"} <= speech_worker.capabilities
        assert "speech" not in text_worker.capabilities and "chat" in text_worker.capabilities
        assert {w.to_dict()["capabilities_source"] for w in workers.values()} == {"worker"}
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
            for _ in range(3):
                r = await http.post(
                    SPEECH_PATH, json={"model": "m", "input": TEXT, "response_format": "wav"}
                )
                assert r.status_code == 200
                assert_speech(r.content, "wav", TEXT)
            chat = {"model": "m", "messages": QUESTION, "max_tokens": 4, "temperature": 0}
            r = await http.post(CHAT_PATH, json={**chat, "modalities": ["text", "audio"],
                                                 "audio": {"voice": "alloy", "format": "wav"}})  # fmt: skip
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["audio"]["data"]
            before = text_worker.num_requests
            for _ in range(4):
                assert (await http.post(CHAT_PATH, json=chat)).status_code == 200
            assert text_worker.num_requests > before  # text chat reaches the text replica too
            # The speech replica stops answering: speech fails with the router's 503, text goes on.
            os.kill(speech_server.proc.pid, signal.SIGSTOP)
            try:
                await wait_for(lambda: not speech_worker.is_routable, "the speech replica out")
                r = await http.post(SPEECH_PATH, json={"model": "m", "input": TEXT})
                assert r.status_code == 503 and "speech" in r.json()["error"]["message"]
                assert (await http.post(CHAT_PATH, json=chat)).status_code == 200
            finally:
                os.kill(speech_server.proc.pid, signal.SIGCONT)
            await wait_for(lambda: speech_worker.is_routable, "the speech replica back", 60)
            r = await http.post(
                SPEECH_PATH, json={"model": "m", "input": TEXT, "response_format": "pcm"}
            )
            assert r.status_code == 200
    finally:
        await router.stop()
