"""The embedding routes over HTTP: SGLang's native /encode and /classify, and /v1/embeddings,
/v1/classify, /v1/score and /v1/rerank. A thin layer over `serving.embedding_serving`, which
the gRPC RPCs and the in-process Engine call too. The app's middleware checks the API key
and readiness; a client that goes away aborts its requests."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from cadence.entrypoints.http_io import error_headers, json_response, read_json, until_disconnected
from cadence.serving import embedding_serving
from cadence.serving.bundle import Serving
from cadence.serving.openai_results import OpenAIResponse
from cadence.serving.state import ServerState


def register_embedding_routes(app: FastAPI, state: ServerState, bundle: Serving) -> None:
    serving = bundle.embeddings

    @app.post("/encode")
    async def encode(request: Request):
        obj = embedding_serving.encode_input(await read_json(request))
        return json_response(
            await until_disconnected(request, embedding_serving.encode(state.client, obj))
        )

    @app.post("/classify")
    async def classify(request: Request):
        obj = embedding_serving.encode_input(await read_json(request))
        return json_response(
            await until_disconnected(request, embedding_serving.classify(state.client, obj))
        )

    for path, method in (
        ("/v1/embeddings", serving.embeddings),
        ("/v1/classify", serving.classify),
        ("/v1/score", serving.score),
        ("/v1/rerank", serving.rerank),
    ):
        app.add_api_route(path, _route(method), methods=["POST"], name=path)


def _route(method):
    async def route(request: Request):
        result = await until_disconnected(request, method(await request.body()))
        return _to_http(result)

    return route


def _to_http(result: OpenAIResponse) -> Response:
    return Response(
        result.body,
        status_code=result.status,
        media_type="application/json",
        headers=error_headers(result.status, result.is_request_fault),
    )
