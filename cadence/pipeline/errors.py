"""How a pipeline request can fail, in the one error family of `cadence.errors` (each error
carries the HTTP status both protocols answer with)."""

from __future__ import annotations

from dataclasses import dataclass

from cadence.errors import RequestError


@dataclass(frozen=True)
class Failure:
    """How a stage ended a request: the message, and for a refusal it passed on (see
    `stage.failure`) that refusal's status and field; status None is the stage's own 500."""

    message: str
    status: int | None = None
    param: str | None = None

    def error(self) -> StageFailed:
        return StageFailed(self.message, self.status, self.param)


class StageFailed(RequestError):
    """A stage ended this request: its executor raised (500; the message names the stage), or
    passed on a refusal of its own with that refusal's status, message and field (the
    server's engine at its limit: 429; a request it finds invalid: 400). The pipeline
    survived: other requests are unaffected."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        status = status or 500
        super().__init__(status, message, param, is_request_fault=status == 500)


class PipelineUnavailable(RequestError):
    """The pipeline cannot serve now (503): starting, a stage process died or is restarting,
    or it is shutting down."""

    def __init__(self, message: str):
        super().__init__(503, message)


class RequestAborted(RequestError):
    """The request was aborted before it finished (499)."""

    def __init__(self, message: str = "the request was aborted"):
        super().__init__(499, message)


class PipelineStartError(RuntimeError):
    """A stage process failed to start or report ready; the message says which and why."""
