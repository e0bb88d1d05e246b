"""The OpenAI routes over HTTP: a thin layer over `OpenAIServing` and `ResponsesServing`.

Each route hands the raw body to the serving module and writes back what it returns;
the gRPC pass-through RPCs call the same module, so both protocols answer alike.
/v1/tokenize and /v1/detokenize are the native routes' aliases (one implementation, in
native_api). /invocations (SageMaker's route, as vLLM serves it) answers a body with the
route of its shape (`serving.invocations`); like every route here it reads the body whatever
its content type. The API key and readiness checks are the app's middleware.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from cadence.entrypoints.http_io import error_headers, until_disconnected
from cadence.serving.bundle import Serving
from cadence.serving.openai_results import OpenAIResponse


def register_openai_routes(app: FastAPI, bundle: Serving) -> None:
    serving = bundle.openai

    @app.get("/v1/models")
    async def list_models():
        return _to_http(await serving.list_models())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        return _to_http(await serving.retrieve_model(model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await request.body()
        return _to_http(await until_disconnected(request, serving.chat_completions(body)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.body()
        return _to_http(await until_disconnected(request, serving.completions(body)))

    _responses_routes(app, bundle)


def _responses_routes(app: FastAPI, bundle: Serving) -> None:
    responses = bundle.responses

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await request.body()
        return _to_http(await until_disconnected(request, responses.create(body)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return _to_http(responses.retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):  # the body, if any, is not read
        return _to_http(responses.cancel(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return _to_http(responses.delete(response_id))


def register_invocations(app: FastAPI, bundle: Serving) -> None:
    invocations = bundle.invocations

    @app.post("/invocations")
    async def invoke(request: Request):
        body = await request.body()
        return _to_http(await until_disconnected(request, invocations.invoke(body)))


def _to_http(result) -> Response:
    if isinstance(result, OpenAIResponse):
        return Response(
            result.body,
            status_code=result.status,
            media_type="application/json",
            headers=error_headers(result.status, result.is_request_fault),
        )
    return StreamingResponse(
        result.sse(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
