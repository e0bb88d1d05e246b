"""Named hook points: stable moments whose signatures are part of Cadence's public API.

Each is a plain function that Cadence calls at that moment and that does nothing itself;
a plugin hooks it like any target, by its dotted path:

    HookRegistry.register("cadence.hooks.request_finished", on_finished, HookType.AFTER)

- `server_args_finalized(args) -> args` — front process (and the in-process Engine), once,
  after parsing and the platform's defaults.
- `request_received(req)` — front process, for each request accepted, before it is sent.
- `request_finished(rid, meta_info)` — front process, once per received request, however it ended.
- `batch_scheduled(batch_info)` — scheduler process, before each forward step.

`server_args_finalized` and `request_received` let exceptions through: a hook can stop
start-up, or refuse a request by raising `cadence.errors.RequestError`. The
observers `request_finished` and `batch_scheduled` are called through `notify`, which logs
a failing hook instead of letting it break serving.

Imports nothing heavy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cadence.io_struct import GenerateReqInput
    from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchInfo:
    """One forward step as `batch_scheduled` sees it."""

    is_prefill: bool
    """True for a prefill (extend) step, which may hold prompt chunks of several requests; False for decode."""
    rids: tuple[str, ...]
    """The requests in the step, in batch order."""
    num_tokens: int
    """Tokens the forward pass processes: the prompt tokens of a prefill, one per request in decode."""


def server_args_finalized(args: ServerArgs) -> ServerArgs:
    """Front process (and the in-process Engine), once, with the parsed arguments after the
    platform's defaults. Returns the arguments to serve with: an AFTER hook may return
    `args.replace(...)` (validated like the CLI's), a BEFORE hook `((new_args,), {})`.
    The scheduler and detokenizer processes receive the result."""
    return args


def request_received(req: GenerateReqInput) -> None:
    """Front process: a request was validated and tokenized and is about to go to the
    scheduler. `req` is one item (a batch or `n > 1` calls this once per rid) and has
    `req.rid` set; changing it has no effect. Raising refuses the request."""


def request_finished(rid: str, meta_info: dict[str, Any]) -> None:
    """Front process: request `rid` ended, exactly once per `request_received`. `meta_info`
    is a copy of the result's meta info: `finish_reason` (a dict with `type`: stop, length
    or abort), `prompt_tokens`, `completion_tokens`, `cached_tokens` as far as known."""


def batch_scheduled(batch_info: BatchInfo) -> None:
    """Scheduler process: a forward step was scheduled and is about to run."""


def notify(point: Callable[..., Any], *args: Any) -> None:
    """Calls an observer hook point; a plugin hook that raises is logged, not propagated."""
    try:
        point(*args)
    except Exception:
        logger.exception(
            "a plugin hook on cadence.hooks.%s failed", getattr(point, "__name__", point)
        )


def finalize_server_args(args: ServerArgs) -> ServerArgs:
    """The platform's defaults, then `server_args_finalized`: the arguments to serve with."""
    from cadence.platforms import current_platform, select_platform
    from cadence.server_args import ServerArgs

    if args.device is not None:  # before anything resolves the platform
        select_platform(args.device)
    args = current_platform.apply_server_args_defaults(args)
    args = server_args_finalized(args)
    if not isinstance(args, ServerArgs):
        raise TypeError(
            f"a hook on cadence.hooks.server_args_finalized returned {type(args).__name__}, "
            f"not ServerArgs"
        )
    return args
