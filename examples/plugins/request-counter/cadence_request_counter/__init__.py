"""Counts finished requests, through Cadence's named hook points only.

Set CADENCE_REQUEST_COUNTER_FILE to a path to also get one JSON line per event, from every
process that runs Cadence code: {"event": ..., "pid": ..., ...}. The events are `loaded`
(each process), `server_args_finalized` (front), `request_finished` (front, with the running
count) and `batch_scheduled` (scheduler).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from cadence.plugins import HookType, plugin_hook

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_num_finished = 0


def _record(event: str, **fields) -> None:
    path = os.environ.get("CADENCE_REQUEST_COUNTER_FILE")  # this plugin's own setting
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields})
    with _lock, open(path, "a") as f:
        f.write(line + "\n")


def register() -> None:
    """The entry point: load_plugins() calls this once in each process."""
    _record("loaded")

    @plugin_hook("cadence.hooks.server_args_finalized", type=HookType.AFTER)
    def on_args(args, *_):
        _record("server_args_finalized", port=args.port, page_size=args.page_size)
        # Returning None keeps the arguments; return args.replace(...) to change them.

    @plugin_hook("cadence.hooks.request_finished", type=HookType.AFTER)
    def on_finished(_result, rid, meta_info):
        global _num_finished
        with _lock:
            _num_finished += 1
            count = _num_finished
        reason = (meta_info.get("finish_reason") or {}).get("type")
        logger.info("request %s finished (%s); %d finished so far", rid, reason, count)
        _record(
            "request_finished",
            rid=rid,
            count=count,
            finish_reason=reason,
            completion_tokens=meta_info.get("completion_tokens"),
        )

    @plugin_hook("cadence.hooks.batch_scheduled", type=HookType.AFTER)
    def on_batch(_result, batch_info):
        _record(
            "batch_scheduled",
            is_prefill=batch_info.is_prefill,
            rids=list(batch_info.rids),
            num_tokens=batch_info.num_tokens,
        )
