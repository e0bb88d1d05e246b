"""The server's engine as a pipeline stage (`EngineClientStage`): the request it makes of the
engine client, the chunks it streams (EngineStage's format), and the error of a pipeline run
without a server. The real engine runs in tests/e2e/test_speech_e2e.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cadence.pipeline import LocalPipeline, PipelineConfig, StageConfig
from cadence.serving.client_stage import EngineClientStage

OPTIONS = {"voice": "en-us", "speed": 1.0, "format": "pcm", "streaming": True}


class _Client:
    """The two calls the stage makes of an EngineClient: generate (text deltas, the last
    with a finish_reason) and get_load."""

    def __init__(self) -> None:
        self.requests: list = []

    def generate(self, obj):
        self.requests.append(obj)

        async def deltas():
            for i, text in enumerate(["Hello", "", " there."]):
                meta = {"prompt_tokens": 4, "completion_tokens": i + 1, "finish_reason": None}
                if i == 2:
                    meta["finish_reason"] = {"type": "stop", "matched": 2}
                yield {"text": text, "meta_info": meta}
                await asyncio.sleep(0)

        return deltas()

    async def get_load(self):
        one = SimpleNamespace(num_used_tokens=16, num_running_reqs=1, num_waiting_reqs=2)
        return [one, one]  # two data-parallel ranks: summed


def _config() -> PipelineConfig:
    stage = StageConfig(
        name="thinker",
        executor=EngineClientStage,
        placement="front",
        stream_to_client=True,
        terminal=True,
    )
    return PipelineConfig(stages=(stage,))


async def _chunks(pipeline, request, rid=None) -> list:
    return [i.data async for i in pipeline.stream(request, rid=rid) if not i.is_final]


async def test_a_generation_streams_text_deltas_and_ends_with_meta():
    client = _Client()
    ready = asyncio.get_running_loop().create_future()
    ready.set_result(client)  # as a server hands it: an awaitable, once the model is loaded
    pipeline = await LocalPipeline.start(_config(), services={"engine_client": ready})
    try:
        request = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3}}
        chunks = await _chunks(pipeline, {**request, "options": OPTIONS}, rid="chat-1")
        assert chunks == [
            {"text": "Hello", "options": OPTIONS},
            {
                "text": " there.",
                "options": OPTIONS,
                "meta": {
                    "finish_reason": {"type": "stop", "matched": 2},
                    "prompt_tokens": 4,
                    "completion_tokens": 3,
                },
            },
        ]
        (obj,) = client.requests
        assert obj.input_ids == [1, 2, 3, 4] and obj.stream is True
        assert obj.sampling_params == {"max_new_tokens": 3}
        assert obj.rid.startswith("chat-1~")  # the request's pipeline id: one per submission
        text = await _chunks(pipeline, {"text": "Said as it is.", "options": OPTIONS})
        assert text == [{"text": "Said as it is.", "options": OPTIONS}]
        (load,) = await _chunks(pipeline, {"engine_load": True, "options": OPTIONS})
        assert load["meta"] == {"num_used_tokens": 32, "num_running_reqs": 2, "num_waiting_reqs": 4}
        assert len(client.requests) == 1  # text and load asked the engine for no generation
    finally:
        await pipeline.close()


async def test_without_a_server_it_says_which_stage_to_declare_instead():
    with pytest.raises(RuntimeError, match="cadence serve --pipeline.*engine_stage:EngineStage"):
        await LocalPipeline.start(_config())
