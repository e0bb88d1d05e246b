"""LoRA adapters as the front sees them: which are loaded, and which one a request names.

The scheduler owns the adapters (it loads, evicts and unloads them); the front keeps a
copy of the loaded set (`LoRARegistry`), taken from the model's start-up facts and replaced
by every `LoRAUpdateOutput` the scheduler sends back, so a request naming an adapter is
checked at the edge, once, for every adapter (HTTP, both gRPC services, the in-process
Engine). A name the copy does not know is not refused at once: the registry asks the
scheduler for the loaded set first (one request in flight at a time, shared by every
request that missed meanwhile), so several front processes (--api-workers) stay right
without telling each other about a load.

How an OpenAI `model` string names an adapter is SGLang's rule (`split_model`), plus the
adapter's own name alone, which SGLang would silently serve with the base model.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from cadence.errors import InvalidParameter
from cadence.io_struct import LoRAAdapterInfo, LoRAUpdateOutput

# SGLang's words, for the routes that load and unload (LoRAUpdateOutput.error_message).
LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# Seconds an unknown plain `model` name may wait before it is looked up again (see
# `LoRARegistry.model_adapter`).
BARE_NAME_LOOKUP_S = 1.0
# Names shown in an error that lists the loaded adapters; the rest are counted.
MAX_NAMES_SHOWN = 20


def lora_not_enabled(name: str) -> str:
    """SGLang's refusal of a request that names an adapter on a server without LoRA."""
    return (
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
        "server with --enable-lora flag and preload adapters using --lora-paths or "
        "/load_lora_adapter endpoint."
    )


def split_model(model: str | None, served_names: Sequence[str]) -> tuple[str | None, str | None]:
    """(base model, adapter name) of an OpenAI `model` string, by SGLang's rule: a served
    name (even one with a colon) names the base; `<served name>:<adapter>` and otherwise
    `<base>:<adapter>` (split on the first colon) name an adapter. An empty adapter part
    names none. The adapter's own name alone is resolved by `LoRARegistry.model_adapter`."""
    if not model or ":" not in model or model in served_names:
        return model, None
    for served in served_names:
        if model.startswith(f"{served}:"):
            return served, model[len(served) + 1 :].strip() or None
    base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def check_load_args(lora_name: object, lora_path: object, served_names: Sequence[str]) -> None:
    """The arguments of a load: a name no served model has (requests name it in `model`,
    /v1/models lists it beside them) and a path, both non-empty strings."""
    if not isinstance(lora_name, str) or not lora_name.strip():
        raise InvalidParameter("lora_name", "lora_name (a non-empty string) is required")
    if lora_name in served_names:
        raise InvalidParameter(
            "lora_name",
            f"lora_name {lora_name!r} is the served model's name: give the adapter a "
            "name of its own",
        )
    if not isinstance(lora_path, str) or not lora_path:
        raise InvalidParameter(
            "lora_path",
            "lora_path (the adapter's directory: adapter_config.json and "
            "adapter_model.safetensors) is required",
        )


class LoRARegistry:
    """The loaded adapters by name, as the scheduler last reported them.

    `refresh` asks the scheduler for the loaded set (a `GetLoRAAdaptersReqInput`); its
    answer reaches `update` on arrival, in the order the scheduler sent it, which is what
    keeps the copy current: nothing else writes it. `max_loaded` is --max-loaded-loras (a
    request naming more distinct adapters than may be loaded at once is refused)."""

    def __init__(
        self,
        enabled: bool,
        adapters: Iterable[LoRAAdapterInfo] = (),
        refresh: Callable[[], Awaitable[object]] | None = None,
        max_loaded: int | None = None,
    ):
        self.enabled = enabled
        self.adapters: dict[str, LoRAAdapterInfo] = {a.name: a for a in adapters}
        self.max_loaded = max_loaded
        self._refresh = refresh
        # Ids callers minted for adapters they loaded (the scheduler service's
        # LoadLoRAAdapter), by id: requests may name an adapter by them.
        self.aliases: dict[str, str] = {}
        self._num_sent = 0  # lookups sent to the scheduler so far
        self._num_done = 0  # the number of the last lookup answered (or failed)
        self._in_flight: asyncio.Future | None = None
        self._answered_sent_at = -math.inf  # when the last answered refresh was sent

    # ---- the copy --------------------------------------------------------------------------

    def update(self, out: LoRAUpdateOutput) -> None:
        """An answer of the scheduler: `loaded_adapters` is every adapter loaded after it.
        A failed call may come without the list (SGLang's null); an empty list then says
        nothing, and the copy stays."""
        if out.success or out.loaded_adapters:
            self.adapters = {a.name: a for a in out.loaded_adapters}
            names = self.adapters.keys()
            self.aliases = {k: v for k, v in self.aliases.items() if v in names}

    def get(self, key: str, by_id: bool = False) -> LoRAAdapterInfo | None:
        """The adapter `key` names; `by_id` also its lora_id or an id its loader minted
        (the scheduler service's `lora_id`). A request's `lora_path` names it by name only,
        as SGLang's does: that is what the scheduler is given."""
        found = self.adapters.get(key)
        if found is not None or not by_id:
            return found
        for info in self.adapters.values():
            if info.lora_id == key:
                return info
        alias = self.aliases.get(key)
        return None if alias is None else self.adapters.get(alias)

    def id_of(self, info: LoRAAdapterInfo) -> str:
        """The id a client knows the adapter by: the one it minted, else the server's."""
        for alias, name in self.aliases.items():
            if name == info.name:
                return alias
        return info.lora_id

    # ---- the checks of a request -----------------------------------------------------------

    async def check(self, names: Iterable[str | None], param: str) -> None:
        """Every adapter a request's items name (None: the base model) is loaded, else an
        InvalidParameter naming `param`. A name the copy lacks is looked up once."""
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        if not wanted:
            return
        if not self.enabled:
            raise InvalidParameter(param, f"{param}: {lora_not_enabled(wanted[0])}")
        if self.max_loaded is not None and len(wanted) > self.max_loaded:
            raise InvalidParameter(
                param,
                f"{param}: the request names {len(wanted)} different LoRA adapters, but at "
                f"most {self.max_loaded} are loaded at once (--max-loaded-loras); send "
                "fewer per request",
            )
        missing = [n for n in wanted if n not in self.adapters]
        if missing:  # one lookup for all of them
            await self.refresh()
            missing = [n for n in missing if n not in self.adapters]
        if missing:
            raise self._not_loaded(missing[0], param)

    async def resolve(self, key: str, param: str, by_id: bool = False) -> LoRAAdapterInfo:
        """The loaded adapter `key` names (see `get`), looked up once at the scheduler when
        the copy lacks it; else an InvalidParameter naming `param`."""
        if not self.enabled:
            raise InvalidParameter(param, f"{param}: {lora_not_enabled(key)}")
        found = self.get(key, by_id)
        if found is None:
            await self.refresh()
            found = self.get(key, by_id)
        if found is None:
            raise self._not_loaded(key, param)
        return found

    def _not_loaded(self, key: str, param: str) -> InvalidParameter:
        return InvalidParameter(
            param,
            f"{param}: LoRA adapter {key!r} is not loaded; loaded adapters: "
            f"{self._shown_names()}. Load it with /load_lora_adapter first",
        )

    async def model_adapter(self, model: str | None, served_names: Sequence[str]) -> str | None:
        """The adapter an OpenAI `model` string names (None: the base model): SGLang's
        `base:adapter`, or the adapter's own name alone. A `base:adapter` naming no
        loaded adapter is a 400 naming `model`; any other unknown name is served by the base
        model (any `model` is, unless --strict-model-name). An unknown plain name is looked
        up at most every BARE_NAME_LOOKUP_S: most are a client's idea of the model's name,
        and each lookup holds the request back until the scheduler's step ends."""
        _, adapter = split_model(model, served_names)
        if adapter is not None:
            return (await self.resolve(adapter, "model")).name
        if not self.enabled or not model or model in served_names:
            return None
        if model not in self.adapters:  # loaded through another front process?
            await self.refresh(max_age_s=BARE_NAME_LOOKUP_S)
        return model if model in self.adapters else None

    def names_adapter(self, model: str | None, served_names: Sequence[str]) -> str | None:
        """`model_adapter` from the copy alone, for the routes that refuse adapters."""
        _, adapter = split_model(model, served_names)
        if adapter is not None:
            return adapter
        return model if model is not None and model in self.adapters else None

    def _shown_names(self) -> str:
        names = sorted(self.adapters)
        shown = ", ".join(repr(n) for n in names[:MAX_NAMES_SHOWN])
        more = len(names) - MAX_NAMES_SHOWN
        return f"[{shown}{f', and {more} more' if more > 0 else ''}]"

    # ---- asking the scheduler ----------------------------------------------------------------

    async def refresh(self, max_age_s: float | None = None) -> None:
        """Asks the scheduler for the loaded set, through a request sent after this call
        began (an older one may predate a load a client already saw succeed), or with
        `max_age_s` one sent at most that long ago. Callers that miss together share one
        request; at most one is in flight."""
        if self._refresh is None:
            return
        if max_age_s is not None and time.monotonic() - self._answered_sent_at <= max_age_s:
            return
        need = self._num_sent + 1
        while self._num_done < need:
            if self._in_flight is None:
                self._in_flight = asyncio.ensure_future(self._ask(self._refresh))
                # Its failure reaches every caller that waits; none may be left to read it.
                self._in_flight.add_done_callback(lambda f: f.cancelled() or f.exception())
            # Shielded: a caller that goes away does not cancel the others' lookup.
            await asyncio.shield(self._in_flight)

    async def _ask(self, refresh: Callable[[], Awaitable[object]]) -> None:
        # Counted as sent here, where the request leaves: callers that missed before
        # this point may share it.
        self._num_sent += 1
        number, sent_at = self._num_sent, time.monotonic()
        try:
            await refresh()
            self._answered_sent_at = sent_at
        finally:
            self._num_done = number
            self._in_flight = None
