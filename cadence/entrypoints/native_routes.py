"""SGLang's native routes over HTTP: health, the model's and the server's facts, /generate,
the tokenizer, and the control routes.

Thin by design: parse the body (`serving.control`, `serving.native_api`), call the engine
client (its named control methods for control), write the answer. The checks live below,
shared with gRPC and the in-process Engine; the app's middleware (`http_server.Gate`)
checks the API key and readiness first.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from cadence.entrypoints.http_io import (
    error_response,
    json_response,
    read_json,
    stream_response,
    until_disconnected,
)
from cadence.front.engine_client import EngineClient
from cadence.front.health import probe
from cadence.serving import control, native_api
from cadence.serving.state import ServerState
from cadence.version import __version__

HEALTH_GENERATE_TIMEOUT_S = 30
PROMETHEUS = "text/plain; version=0.0.4"


def register_native_routes(app: FastAPI, state: ServerState) -> None:
    def client() -> EngineClient:  # read per request: it exists once the model is loaded
        return state.client

    _health_routes(app, state, client)
    _info_routes(app, state, client)
    _generate_routes(app, state, client)
    _session_routes(app, client)
    _control_routes(app, client)


def _health_routes(app: FastAPI, state: ServerState, client) -> None:
    @app.get("/health")
    async def health():
        problem = state.health_problem()
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        await asyncio.wait_for(probe(client()), HEALTH_GENERATE_TIMEOUT_S)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(await native_api.metrics_body(state), media_type=PROMETHEUS)


def _info_routes(app: FastAPI, state: ServerState, client) -> None:
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        engine = client()
        version = await engine.get_weight_version()
        return json_response(native_api.model_info(engine.info, state.args, version))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return json_response(await native_api.server_info(state))

    @app.get("/get_load")
    async def get_load():
        loads = await client().get_load()
        return json_response(
            [
                {
                    "dp_rank": load.dp_rank,
                    "num_reqs": load.num_running_reqs,
                    "num_waiting_reqs": load.num_waiting_reqs,
                    "num_tokens": load.num_used_tokens,
                }
                for load in loads
            ]
        )

    @app.get("/v1/loads")
    async def loads(request: Request):
        rank = native_api.check_dp_rank(request.query_params.get("dp_rank"))
        entries = native_api.load_entries(await client().get_load(rank))
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(_prometheus_loads(entries), media_type=PROMETHEUS)
        return json_response({"timestamp": time.time(), "version": __version__, "loads": entries})


def _prometheus_loads(entries: list[dict]) -> str:
    lines = [
        f'cadence_{name}{{dp_rank="{entry["dp_rank"]}"}} {float(value)}'
        for entry in entries
        for name, value in entry.items()
        if name != "dp_rank"
    ]
    return "\n".join(lines) + "\n"


def _generate_routes(app: FastAPI, state: ServerState, client) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        obj = native_api.generate_input(await read_json(request))
        gen = client().generate(obj)
        if obj.stream:
            if not state.args.incremental_streaming_output:
                gen = native_api.cumulative(gen)
            return await stream_response(gen)
        return json_response(await until_disconnected(request, native_api.last_result(gen)))

    # Also answered by `Gate` before routing (the hot path); these serve the same code to
    # anything that mounts the app without the middleware.
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        return json_response(await native_api.tokenize_body(state, await read_json(request)))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        return json_response(await native_api.detokenize_body(state, await read_json(request)))


def _session_routes(app: FastAPI, client) -> None:
    @app.get("/open_session")  # both methods, as SGLang; one route each, one operation id each
    @app.post("/open_session")
    async def open_session(request: Request):
        body = control.parse(control.OpenSessionBody, await read_json(request))
        session_id = await client().open_session(
            body.capacity_of_str_len, body.session_id, body.streaming, body.timeout
        )
        return json_response(session_id)

    @app.get("/close_session")
    @app.post("/close_session")
    async def close_session(request: Request):
        body = control.parse(control.CloseSessionBody, await read_json(request))
        await client().close_session(body.session_id)
        return Response(status_code=200)  # closing an unknown session is not an error (SGLang)


def _control_routes(app: FastAPI, client) -> None:
    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = control.parse(control.AbortBody, await read_json(request))
        client().abort(body.rid, body.abort_all, "aborted by /abort_request")
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        await read_json(request)  # any JSON body is accepted and ignored
        out = await client().flush_cache()
        if not out.success:
            return error_response(400, f"cannot flush the cache: {out.message}")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = control.parse(control.PauseBody, await read_json(request))
        await client().pause_generation(body.mode)
        return json_response({"success": True, "mode": body.mode})

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await read_json(request)  # any JSON body is accepted and ignored
        await client().continue_generation()
        return json_response({"success": True})

    @app.get("/configure_logging")
    @app.post("/configure_logging")
    async def configure_logging(request: Request):
        body = control.parse(control.ConfigureLoggingBody, await read_json(request))
        client().configure_logging(body.log_requests, body.log_requests_level)
        return Response(status_code=200)

    _profile_routes(app, client)
    _lora_routes(app, client)


def _lora_routes(app: FastAPI, client) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = control.parse(control.LoadLoRABody, await read_json(request))
        out = await client().load_lora_adapter(body.lora_name, body.lora_path, body.pinned)
        return json_response(control.lora_update_body(out), 200 if out.success else 400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = control.parse(control.UnloadLoRABody, await read_json(request))
        out = await client().unload_lora_adapter(body.lora_name)
        return json_response(control.lora_update_body(out), 200 if out.success else 400)


def _profile_routes(app: FastAPI, client) -> None:
    @app.post("/start_profile")
    async def start_profile(request: Request):
        body = control.parse(control.ProfileBody, await read_json(request))
        out = await client().start_profile(body.output_dir, body.num_steps, body.start_step)
        return _outcome(out)

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        await read_json(request)  # any JSON body is accepted and ignored
        return _outcome(await client().stop_profile())

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        body = control.parse(control.UpdateWeightsBody, await read_json(request))
        out = await client().update_weights_from_disk(
            body.model_path, body.load_format, body.weight_version
        )
        return _outcome(out)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = control.parse(control.UpdateWeightVersionBody, await read_json(request))
        out = await client().update_weight_version(body.new_version, body.abort_all_requests)
        return json_response(
            {"success": out.success, "message": out.message, "new_version": out.new_version}
        )

    @app.get("/get_weight_version")
    async def get_weight_version():
        return json_response({"weight_version": await client().get_weight_version()})


def _outcome(out) -> Response:
    """A control answer as SGLang's routes give it: {success, message}, 400 when it failed."""
    return json_response(
        {"success": out.success, "message": out.message}, 200 if out.success else 400
    )
