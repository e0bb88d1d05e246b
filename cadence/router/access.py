"""Who may call which route: the client API key and the admin API key.

Three kinds of route:

- open: `/live`, `/ready`, `/health` (orchestrators probe them without a key);
- client: inference, `/v1/models`, `/metrics`; they need `--api-key` when one is set;
- admin: `GET/POST /workers`, `GET/PUT/DELETE /workers/{id}` (worker management, and the
  topology: internal URLs, errors). With `--admin-api-key` they need that key and only
  that key. Without it they answer 403 unless `--enable-admin-api` is given, which
  serves them open, or behind the client key when one is set.

Keys are compared in constant time on bytes. A client may send a Latin-1 key as Latin-1
or as UTF-8 bytes (HTTP libraries differ); both spellings are compared, always both.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from cadence.router.config import RouterConfig
from cadence.router.proxy import error_response, request_id

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/live", "/ready", "/health"})


class AccessControl:
    """Decides, per request, whether the key it carries opens the route it asks for.

    Built once from the configuration; holds each accepted key as bytes. Stateless
    across requests, so it needs no locking.
    """

    def __init__(self, config: RouterConfig) -> None:
        self._client_keys = _key_bytes(config.api_key)
        self._admin_keys = _key_bytes(config.admin_api_key)
        self.is_admin_enabled = config.is_admin_api_enabled

    @property
    def has_client_key(self) -> bool:
        return bool(self._client_keys)

    def client_refusal(self, request: web.Request) -> web.Response | None:
        """None when the request may use a client route, else the 401 to send."""
        if not self._client_keys or _matches(bearer_token(request), self._client_keys):
            return None
        return _unauthorized(
            request, "missing or wrong API key: send 'Authorization: Bearer <key>'"
        )

    def admin_refusal(self, request: web.Request) -> web.Response | None:
        """None when the request may use an admin route, else the 401 or 403 to send."""
        if self._admin_keys:
            if _matches(bearer_token(request), self._admin_keys):
                return None
            return _unauthorized(
                request,
                "admin route: send 'Authorization: Bearer <admin key>' (the router's --admin-api-key; "
                "the client API key does not open it)",
            )
        if not self.is_admin_enabled:
            return error_response(
                403,
                "the admin API is off: start the router with --admin-api-key KEY to serve it behind "
                "that key, or with --enable-admin-api to serve it without one",
                request_id(request),
                "permission_error",
            )
        return self.client_refusal(request)


def admin_only(access: AccessControl, handler: Handler) -> Handler:
    """Wrap an admin handler so that it runs only for requests `access` lets through."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        refusal = access.admin_refusal(request)
        if refusal is not None:
            return refusal
        return await handler(request)

    guarded.is_admin_route = True  # type: ignore[attr-defined]  # read by client_key_middleware
    return guarded


def client_key_middleware(
    access: AccessControl,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The client key check for every route but the open and the admin ones (they check their own)."""

    @web.middleware
    async def check_client_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not getattr(
            request.match_info.handler, "is_admin_route", False
        ):
            refusal = access.client_refusal(request)
            if refusal is not None:
                return refusal
        return await handler(request)

    return check_client_key


def bearer_token(request: web.Request) -> bytes | None:
    """The token of an 'Authorization: Bearer TOKEN' header as the bytes the client sent."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: this gives them back.
    raw = header.encode("utf-8", "surrogateescape")
    scheme, _, token = raw.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.lstrip(b" ")


def _key_bytes(key: str | None) -> tuple[bytes, ...]:
    """The byte spellings a client may send `key` in: Latin-1 and UTF-8 (equal for ASCII)."""
    if key is None:
        return ()
    latin1, utf8 = key.encode("latin-1"), key.encode("utf-8")
    return (latin1,) if latin1 == utf8 else (latin1, utf8)


def _matches(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Constant-time comparison against every accepted spelling (no early exit)."""
    if token is None:
        token = b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


def _unauthorized(request: web.Request, message: str) -> web.Response:
    response = error_response(401, message, request_id(request), "authentication_error")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response
