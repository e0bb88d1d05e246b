"""Speech over HTTP: POST /v1/audio/speech (OpenAI's), GET /v1/audio/voices, and
GET /capabilities. A thin layer over `serving.speech_serving`, which the gRPC RPC calls too.

The audio streams as the encoder makes it: chunked bytes of the format (`stream_format:
audio`) or server-sent events (`sse`). Whatever fails before the first chunk is an ordinary
error response; a client that goes away aborts every stage of its request."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from cadence.entrypoints.http_io import json_response, read_json, sse
from cadence.errors import CadenceError
from cadence.serving.bundle import Serving
from cadence.serving.errors import error_body
from cadence.serving.speech_serving import server_capabilities, speech_params
from cadence.serving.state import ServerState
from cadence.speech import voices


def register_speech_routes(app: FastAPI, state: ServerState, bundle: Serving) -> None:
    serving = bundle.speech

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        params = speech_params(await read_json(request), state.args.max_speech_chars)
        serving.check_speech()
        if params.stream_format == "sse":
            return await _respond(serving.synthesize_events(params), params.media_type, sse)
        return await _respond(serving.synthesize(params), params.media_type, None)

    @app.get("/v1/audio/voices")
    async def list_voices():
        return json_response(
            {
                "object": "list",
                "data": [
                    {"id": name, "espeak_voice": voices.resolve_voice(name)}
                    for name in voices.voice_names()
                ],
            }
        )

    @app.get("/capabilities")
    async def capabilities():
        body = {"capabilities": server_capabilities(state)}
        if "speech" in serving.pipeline_caps:
            body["speech"] = {
                "formats": [
                    f for f in voices.FORMATS if f not in ("opus", "aac") or voices.has_pyav()
                ],
                "stream_formats": list(voices.STREAM_FORMATS),
                "sample_rate": voices.SAMPLE_RATE,
                "max_speech_chars": state.args.max_speech_chars,
                "speed": [voices.MIN_SPEED, voices.MAX_SPEED],
            }
        return json_response(body)

    return serving


async def _respond(gen: AsyncIterator, media_type: str, frame) -> StreamingResponse:
    """Streams `gen` (each item through `frame`, or as is); the first item is awaited before
    the response starts, so that a refusal keeps its status."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = None

    async def body():
        try:
            if first is not None:
                yield frame(first) if frame else first
            async for item in gen:
                yield frame(item) if frame else item
        except CadenceError as e:
            if frame is None:
                raise  # the connection drops: a byte stream has no way to carry an error
            yield sse(error_body(e.status, str(e), e.param))
        finally:
            await gen.aclose()  # aborts the request if the client left mid-stream

    return StreamingResponse(body(), media_type=media_type)
