"""The LoRA adapters a server holds: loading, names, who uses them, eviction.

An adapter is loaded once (`load_adapter` checks it against the base model and the limits
set at start) and named; a request takes it (`acquire`) when it reaches the scheduler and
gives it back when it ends (`release`). Unloading takes the name away at once, so no new
request can ask for it, and frees the weights when the last request using it ends. Each
load gets a uid of its own, never reused: the prefix cache keeps KV per uid, so KV computed
under one adapter is never matched for another, for the base model, or for a later adapter
loaded under the same name.

With --max-loaded-loras, loading one more adapter than that evicts one that is neither
pinned nor in use, least recently used (lru) or first loaded (fifo); when none may go, the
load is refused. On this runtime an adapter's weights live on the model's device from the
moment it is loaded, so the loaded set is the pool the policy keeps.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from cadence.io_struct import LoRAAdapterInfo
from cadence.layers.lora import LoraWeights
from cadence.model_loader.lora_loader import (
    AdapterInfo,
    LoraLoadError,
    load_adapter,
    read_adapter_config,
)
from cadence.models.config import ModelConfig
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def lora_id(name: str, path: str) -> str:
    """SGLang's deterministic adapter id (what its scheduler service's `lora_id` carries)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    uid: int  # never reused: the adapter's KV namespace
    info: AdapterInfo
    weights: LoraWeights
    pinned: bool = False
    num_requests: int = 0  # live requests holding it
    loaded_at: int = 0  # load order (fifo)
    last_used: float = field(default_factory=time.monotonic)  # lru
    is_unloaded: bool = False  # its name is gone; freed once num_requests is 0

    def describe(self) -> LoRAAdapterInfo:
        return LoRAAdapterInfo(
            name=self.name,
            path=self.path,
            lora_id=lora_id(self.name, self.path),
            rank=self.info.rank,
            pinned=self.pinned,
        )


class LoraManager:
    """The adapters of one model runner (see the module docstring)."""

    def __init__(self, args: ServerArgs, config: ModelConfig, dtype: torch.dtype, device):
        self.config = config
        # On the CPU an adapter stays at its file's precision (lora_products_ sums in float32
        # whatever the weights' dtype); elsewhere it takes the model's.
        self.dtype: torch.dtype | None = None if torch.device(device).type == "cpu" else dtype
        self.device = device
        self.max_loaded = args.max_loaded_loras
        self.policy = args.lora_eviction_policy
        self.adapters: dict[str, LoraAdapter] = {}  # by name: the loaded ones
        self._draining: set[LoraAdapter] = set()  # unloaded, still used by requests
        # LoraBatch's products' arguments by group composition (keys hold adapters' ids):
        # emptied whenever an adapter's weights are freed.
        self.batch_args: dict[tuple[int, ...], dict] = {}
        self._uids = itertools.count(1)
        self._order = itertools.count()
        entries = args.lora_entries
        self.allowed = args.lora_target_modules
        self.max_rank = args.max_lora_rank
        if entries:
            infos = [read_adapter_config(path) for _, path, _ in entries]
            if self.max_rank is None:
                self.max_rank = max(info.rank for info in infos)
            if self.allowed is None:
                self.allowed = tuple(sorted({m for i in infos for m in i.target_modules}))
        for name, path, pinned in entries:
            self.load(name, path, pinned)

    # ---- load and unload -------------------------------------------------------------------

    def load(self, name: str, path: str, pinned: bool = False) -> LoraAdapter:
        """Loads the adapter at `path` as `name`; LoraLoadError (ValueError) says why not."""
        if not name:
            raise LoraLoadError("lora_name: give the adapter a name")
        if name in self.adapters:
            raise LoraLoadError(f"Failed to load LoRA adapter {name} because it is already loaded")
        info, weights = load_adapter(
            path, self.config, self.dtype, self.device, self.max_rank, self.allowed
        )
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            self._evict_one(name)
        adapter = LoraAdapter(
            name, path, next(self._uids), info, weights, pinned, loaded_at=next(self._order)
        )
        self.adapters[name] = adapter
        logger.info(
            "loaded LoRA adapter %s from %s (r=%d, %s, %.1f MB)",
            name, path, info.rank, ",".join(info.target_modules), weights.nbytes / 1e6,
        )  # fmt: skip
        return adapter

    def _evict_one(self, incoming: str) -> None:
        idle = [a for a in self.adapters.values() if not a.pinned and a.num_requests == 0]
        if not idle:
            raise LoraLoadError(
                f"cannot load {incoming}: all {len(self.adapters)} loaded adapters "
                f"(--max-loaded-loras {self.max_loaded}) are pinned or in use"
            )
        key = (lambda a: a.last_used) if self.policy == "lru" else (lambda a: a.loaded_at)
        victim = min(idle, key=key)
        logger.info("evicting LoRA adapter %s (%s) to load %s", victim.name, self.policy, incoming)
        self.unload(victim.name)

    def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraLoadError(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}"
            )
        adapter.is_unloaded = True
        if adapter.num_requests == 0:
            self._free(adapter)
        else:
            self._draining.add(adapter)

    def _free(self, adapter: LoraAdapter) -> None:
        self._draining.discard(adapter)
        self.batch_args.clear()
        adapter.weights = LoraWeights([])
        logger.info("unloaded LoRA adapter %s", adapter.name)

    def describe(self) -> list[LoRAAdapterInfo]:
        return [a.describe() for a in self.adapters.values()]

    # ---- requests --------------------------------------------------------------------------

    def acquire(self, name: str) -> LoraAdapter:
        """The adapter a request runs with, held until `release`; KeyError when no adapter of
        that name is loaded (now)."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(name)
        adapter.num_requests += 1
        adapter.last_used = time.monotonic()
        return adapter

    def release(self, adapter: LoraAdapter) -> None:
        adapter.num_requests -= 1
        if adapter.num_requests < 0:
            raise RuntimeError(f"LoRA adapter {adapter.name} released more often than acquired")
        if adapter.num_requests == 0 and adapter.is_unloaded:
            self._free(adapter)

    @property
    def num_in_use(self) -> int:
        """Requests holding an adapter now (0 once every request has ended: a leak check)."""
        held = [*self.adapters.values(), *self._draining]
        return sum(a.num_requests for a in held)
