"""The gRPC server of the front process (grpc.aio, on the same event loop as HTTP).

Serves `sglang.runtime.v1.SglangService`, SGLang's scheduler service
`sglang.grpc.scheduler.SglangScheduler` (what SGLang's gateway SMG drives), the standard
`grpc.health.v1.Health` (the empty name and each service's name: NOT_SERVING until the
engine is warmed up, SERVING then, NOT_SERVING again while stopping) and server reflection
(v1alpha). With --api-key, every call of either service but its HealthCheck must carry
`authorization: Bearer <key>`; health and reflection stay open, as /health does over HTTP.

Transport settings, and why:
- keepalive: clients may ping every --grpc-min-ping-interval-s even with no call and no
  data in flight, so a client keeping its connection alive through a long prefill is not
  cut off with GOAWAY too_many_pings; the server pings idle clients itself.
- SO_REUSEPORT off: a port already in use is an error at start-up, not a silent second
  listener sharing it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cadence.grpc import SERVICE_NAME, scheduler_servicer, sglang_pb2
from cadence.grpc.scheduler_servicer import SERVICE_NAME as SCHEDULER_SERVICE_NAME
from cadence.grpc.scheduler_servicer import SglangSchedulerServicer
from cadence.grpc.servicer import SglangServicer
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)

_OPEN_METHODS = (f"/{SERVICE_NAME}/HealthCheck", f"/{SCHEDULER_SERVICE_NAME}/HealthCheck")
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


# What the server sends is bounded by what a request may ask for (a batch of embeddings, the
# logprobs of a long generation, the ids and echoed text of a tokenized document), not by
# the size of the request: an answer may be many times larger than its request.
MAX_SEND_MESSAGE_MB = 256


def server_options(args: ServerArgs) -> list[tuple[str, int]]:
    max_receive = args.grpc_max_message_mb * 1024 * 1024
    max_send = max(args.grpc_max_message_mb, MAX_SEND_MESSAGE_MB) * 1024 * 1024
    return [
        # grpcio refuses a larger message from its length prefix, before it is decoded.
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", max_send),
        ("grpc.keepalive_time_ms", int(args.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(args.grpc_keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(args.grpc_min_ping_interval_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),  # our own keepalive pings never stop
        # One front: a port in use is an error. Several (--api-workers): each front process
        # binds the port with SO_REUSEPORT, after the launcher checked that no one else holds it.
        ("grpc.so_reuseport", 1 if args.api_workers > 1 else 0),
    ]


def server_credentials(args: ServerArgs) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files of the flags (None: plaintext)."""
    if args.grpc_tls_cert is None:
        return None

    def read(flag: str, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"--{flag}: cannot read {path}: {e.strerror}") from None

    cert = read("grpc-tls-cert", args.grpc_tls_cert)
    key = read("grpc-tls-key", args.grpc_tls_key)
    client_ca = (
        read("grpc-tls-client-ca", args.grpc_tls_client_ca) if args.grpc_tls_client_ca else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses SglangService calls without `authorization: Bearer <key>` (UNAUTHENTICATED)."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method in _OPEN_METHODS or method.startswith(_OPEN_SERVICES):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong API key: send metadata `authorization: Bearer <key>`",
        )

    kwargs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


def add_service(server: grpc.aio.Server, servicer, service, messages) -> None:
    """Serves every method of `service` (a protobuf ServiceDescriptor) from `servicer`'s
    method of the same name, with `messages` the generated module holding its types.

    Requests arrive as bytes and are parsed here, so a message that cannot be decoded
    (corrupt wire format, a string of bad UTF-8) ends with INVALID_ARGUMENT naming the
    problem, instead of grpcio's UNKNOWN for a failing deserializer."""
    handlers = {}
    for method in service.methods:
        request_type = getattr(messages, method.input_type.name)
        response_type = getattr(messages, method.output_type.name)
        impl = getattr(servicer, method.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _parsing(impl, request_type, method.server_streaming),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def _parsing(impl, request_type, is_streaming: bool):
    async def parse(raw: bytes, context):
        try:
            return request_type.FromString(raw)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {request_type.DESCRIPTOR.full_name} message: {e}",
            )

    if is_streaming:

        async def stream(raw: bytes, context):
            messages = impl(await parse(raw, context), context)
            try:
                async for message in messages:
                    yield message
            finally:
                await messages.aclose()  # now, not at garbage collection: it may hold a request

        return stream

    async def unary(raw: bytes, context):
        return await impl(await parse(raw, context), context)

    return unary


class GrpcServer:
    """Owns the grpc.aio server; `start()` binds at once, `set_serving()` flips health."""

    def __init__(self, args: ServerArgs, state):
        self.args = args
        self.port = args.effective_grpc_port
        interceptors = [ApiKeyInterceptor(args.api_key)] if args.api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(args))
        self.servicer = SglangServicer(state)
        add_service(
            self.server,
            self.servicer,
            sglang_pb2.DESCRIPTOR.services_by_name["SglangService"],
            sglang_pb2,
        )
        # One limit on generation calls in flight for both services.
        self.scheduler_servicer = SglangSchedulerServicer(state, calls=self.servicer)
        add_service(
            self.server,
            self.scheduler_servicer,
            scheduler_servicer.SERVICE,
            scheduler_servicer.MESSAGE_TYPES,
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                SCHEDULER_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        host = args.host if ":" not in args.host else f"[{args.host}]"
        self.address = f"{host}:{self.port}"
        self.is_tls = args.grpc_tls_cert is not None
        self._stopping: asyncio.Task | None = None

    async def start(self) -> None:
        """Binds and starts serving (health NOT_SERVING). Raises RuntimeError/ValueError
        when the port cannot be bound or the TLS files cannot be read."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        credentials = server_credentials(self.args)
        if credentials is None:
            bound = self.server.add_insecure_port(self.address)
        else:
            bound = self.server.add_secure_port(self.address, credentials)
        if bound != self.port:  # older grpcio returns 0 instead of raising
            raise RuntimeError(f"could not bind gRPC on {self.address}")
        await self.server.start()

    async def set_serving(self) -> None:
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)
        logger.info("gRPC is serving: %s (%s)", self.address, "TLS" if self.is_tls else "plaintext")

    async def set_health(self, serving: bool) -> None:
        """SERVING or NOT_SERVING (the pipeline's stages down or back); nothing once stopping."""
        if self._stopping is None:
            status = health_pb2.HealthCheckResponse
            await self._set_status(status.SERVING if serving else status.NOT_SERVING)

    async def _set_status(self, status) -> None:
        for name in ("", SERVICE_NAME, SCHEDULER_SERVICE_NAME):
            await self.health.set(name, status)

    def begin_stop(self, grace: float = 2.0) -> asyncio.Task:
        """Health goes NOT_SERVING and new calls are refused; calls in flight get `grace`
        seconds, then are cancelled. Idempotent: returns the one stopping task."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        return self._stopping

    async def _stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def stop(self, grace: float = 2.0) -> None:
        await self.begin_stop(grace)
