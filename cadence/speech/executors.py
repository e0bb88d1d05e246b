"""The speech pipeline's stages after the thinker: talker → vocoder → encoder, stream edges
all the way, so that audio starts with the first sentence. The thinker is the LLM as a stage
(`cadence.engine_stage.EngineStage`): it streams a chat answer's text, or passes a speech
request's text through.

A request (what the front submits; see `speech_request` and `chat_request`):
    {"text": str} (speech) or {"prompt": str | "input_ids": [int], "sampling_params": dict}
    (chat), and
    "options": {"voice": eSpeak voice, "speed": float, "format": response format,
                "streaming": bool}

Chunks, each stage to the next (every chunk carries the request's `options`):
    thinker -> talker, client   {"text": delta}                    the answer's text as it comes
    talker  -> vocoder          {"sentence": str}                  one complete sentence
                                {"final": True, "transcript": str}  last: the whole raw text
    vocoder -> encoder          {"pcm": float32 tensor [n], "sentence": str} | the final one
    encoder -> client           {"audio": bytes}                   the format's bytes, in order
The encoder's result: {"transcript", "format", "sample_rate", "num_samples", "duration_s"}.

The talker always ends with its final chunk, so every stage downstream runs even for a text
with nothing to say (the client then gets a valid file: empty, or 10 ms of silence where
the format needs a sample; see `cadence.speech.audio`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cadence.pipeline import Executor, StageContext, StageRequest
from cadence.speech.text import MAX_SENTENCE_CHARS, SentenceSplitter
from cadence.speech.voices import SAMPLE_RATE

logger = logging.getLogger("cadence.speech")


def speech_request(text: str, voice: str, speed: float, fmt: str, streaming: bool) -> dict:
    """A text-to-speech request: the thinker passes `text` through, no LLM."""
    return {
        "text": text,
        "options": {"voice": voice, "speed": speed, "format": fmt, "streaming": streaming},
    }


def chat_request(
    prompt: str | list[int],
    sampling_params: dict,
    voice: str,
    fmt: str,
    streaming: bool,
    speed: float = 1.0,
) -> dict:
    """A chat answer spoken: the thinker's LLM answers `prompt` (already templated: text, or
    its token ids)."""
    return {
        "prompt" if isinstance(prompt, str) else "input_ids": prompt,
        "sampling_params": sampling_params,
        "options": {"voice": voice, "speed": speed, "format": fmt, "streaming": streaming},
    }


class _SpeechStage(Executor):
    async def setup(self, ctx: StageContext) -> None:
        if ctx.has_own_process:
            import torch

            # Small tensors and one synthesizer per process: several stage processes each
            # running an OpenMP team on a small machine would stall each other.
            torch.set_num_threads(1)


class Talker(_SpeechStage):
    """Normalizes streamed text and cuts it into sentences as soon as each is complete."""

    def __init__(self, max_sentence_chars: int = MAX_SENTENCE_CHARS):
        self.max_sentence_chars = max_sentence_chars

    async def run(self, req: StageRequest) -> Any:
        splitter = SentenceSplitter(self.max_sentence_chars)
        options: dict = {}
        raw: list[str] = []
        async for chunk in req.stream:
            options = chunk["options"]
            raw.append(chunk["text"])
            for sentence in splitter.feed(chunk["text"]):
                await req.emit({"sentence": sentence, "options": options})
        for sentence in splitter.flush():
            await req.emit({"sentence": sentence, "options": options})
        await req.emit({"final": True, "transcript": "".join(raw), "options": options})
        return None


class Vocoder(_SpeechStage):
    """eSpeak NG: each sentence's waveform, as a float32 tensor at SAMPLE_RATE."""

    async def setup(self, ctx: StageContext) -> None:
        await super().setup(ctx)
        from cadence.speech.espeak import ESpeak

        self.espeak = await asyncio.to_thread(ESpeak.get)
        await asyncio.to_thread(self.espeak.synthesize, "ready", "en-us")  # load the voice data

    async def run(self, req: StageRequest) -> Any:
        import torch

        async for chunk in req.stream:
            if chunk.get("final"):
                await req.emit(chunk)
                continue
            options = chunk["options"]
            pcm = await asyncio.to_thread(
                self.espeak.synthesize, chunk["sentence"], options["voice"], options["speed"]
            )
            await req.emit(
                {"pcm": torch.from_numpy(pcm), "sentence": chunk["sentence"], "options": options}
            )
        return None


class Encoder(_SpeechStage):
    """The response format's bytes, sent as soon as the codec gives them."""

    async def run(self, req: StageRequest) -> Any:
        from cadence.speech.audio import make_encoder

        encoder = None
        num_samples = 0
        transcript = ""
        options: dict = {}
        async for chunk in req.stream:
            options = chunk["options"]
            if encoder is None:
                encoder = make_encoder(options["format"], options["streaming"])
            if chunk.get("final"):
                transcript = chunk["transcript"]
                continue
            pcm = chunk["pcm"].numpy()
            num_samples += len(pcm)
            data = encoder.encode(pcm)
            if data:
                await req.emit({"audio": data})
        if encoder is None:
            raise RuntimeError("the vocoder sent nothing, not even the end of the text")
        tail = encoder.finish()
        if tail:
            await req.emit({"audio": tail})
        return {
            "transcript": transcript,
            "format": options["format"],
            "sample_rate": SAMPLE_RATE,
            "num_samples": num_samples,
            "duration_s": num_samples / SAMPLE_RATE,
        }
