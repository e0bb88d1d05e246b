"""The argument groups of the request kinds beyond plain generation: speculative decoding,
the prefix cache's disk tier, prefill/decode disaggregation and LoRA adapters. Each is a frozen
dataclass that checks its own fields, as in `server_args.py`, which holds them in
`ServerArgs` with the core groups."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


def _at_least_one(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name} must be ≥ 1, got {getattr(obj, name)}")


SPECULATIVE_ALGORITHMS = ("NGRAM",)  # what Cadence runs
_SPECULATIVE_ELSEWHERE = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "LOOKAHEAD")  # SGLang's others


@dataclass(frozen=True)
class SpeculativeArgs:
    """Speculative decoding: tokens drafted ahead and verified together in one forward step."""

    speculative_algorithm: str | None = None
    """NGRAM: drafts from n-gram matches in the request's own prompt and output and in a store of recent outputs, verified in one forward step per request; the output is exactly what it is without speculation (greedy and sampled alike), only faster where answers repeat spans. SGLang's draft-model algorithms (EAGLE, EAGLE3, NEXTN, STANDALONE) are not available."""
    speculative_num_draft_tokens: int | None = None
    """Tokens per verify step and request, counting the last verified one (as SGLang counts): up to this minus one are drafted. Default with NGRAM: 12."""
    speculative_ngram_min_match_window_size: int = 1
    """Shortest suffix of a request's tokens matched to draft from."""
    speculative_ngram_max_match_window_size: int = 12
    """Longest suffix of a request's tokens matched (the longest match wins)."""
    speculative_ngram_min_bfs_breadth: int = 1
    """Fewest continuations the shared n-gram store keeps per n-gram (at least 1)."""
    speculative_ngram_max_bfs_breadth: int = 10
    """Most continuations the shared n-gram store keeps per n-gram; one of them is drafted (a chain, not a tree)."""
    speculative_ngram_match_type: str = "BFS"
    """Which stored continuation is drafted: BFS (the most recent) or PROB (the most frequent)."""
    speculative_ngram_branch_length: int = 18
    """Longest continuation the shared store keeps per n-gram."""
    speculative_ngram_capacity: int = 1_000_000
    """Most n-grams the shared store holds (least recently used forgotten first; about 150 bytes each)."""

    def __post_init__(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        name = algorithm.upper()
        if name in _SPECULATIVE_ELSEWHERE:
            raise ValueError(
                f"speculative_algorithm {algorithm} needs a draft model, which Cadence does not "
                f"run; use NGRAM (drafts from n-gram matches, no draft model)"
            )
        if name not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be NGRAM, got {algorithm!r} (SGLang's EAGLE, "
                "EAGLE3, NEXTN and STANDALONE need a draft model, which Cadence does not run)"
            )
        object.__setattr__(self, "speculative_algorithm", name)
        if self.speculative_num_draft_tokens is None:
            object.__setattr__(self, "speculative_num_draft_tokens", 12)
        if self.speculative_num_draft_tokens < 2:
            raise ValueError(
                "speculative_num_draft_tokens counts the last verified token: give ≥ 2, got "
                f"{self.speculative_num_draft_tokens}"
            )
        _at_least_one(
            self,
            "speculative_ngram_min_match_window_size",
            "speculative_ngram_min_bfs_breadth",
            "speculative_ngram_branch_length",
        )
        if (
            self.speculative_ngram_max_match_window_size
            < self.speculative_ngram_min_match_window_size
        ):
            raise ValueError(
                "speculative_ngram_max_match_window_size must be ≥ "
                "speculative_ngram_min_match_window_size"
            )
        if self.speculative_ngram_max_bfs_breadth < self.speculative_ngram_min_bfs_breadth:
            raise ValueError(
                "speculative_ngram_max_bfs_breadth must be ≥ speculative_ngram_min_bfs_breadth"
            )
        match_type = self.speculative_ngram_match_type.upper()
        if match_type not in ("BFS", "PROB"):
            raise ValueError(
                f"speculative_ngram_match_type must be BFS or PROB, got "
                f"{self.speculative_ngram_match_type!r}"
            )
        object.__setattr__(self, "speculative_ngram_match_type", match_type)
        if self.speculative_ngram_capacity < 0:
            raise ValueError("speculative_ngram_capacity must be ≥ 0")


@dataclass(frozen=True)
class HiCacheArgs:
    """The prefix cache's disk tier: pages kept in files beyond memory and across restarts."""

    enable_hierarchical_cache: bool = False
    """Keep prefix-cache pages on disk below memory (needs --hicache-storage-backend file): a prefix evicted from memory, or computed before a restart, is read back instead of prefilled again."""
    hicache_storage_backend: str | None = None
    """Where the tier below memory lives: file (a directory: file_storage_path in --hicache-storage-backend-extra-config, else SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else hicache/ under the state directory)."""
    hicache_storage_backend_extra_config: str | None = None
    """The backend's settings as a JSON object: {"file_storage_path": "/path"}."""
    hicache_size: float = 0.0
    """Most gigabytes the disk tier keeps (least recently used files go first); 0: no cap."""
    hicache_write_policy: str = "write_through"
    """When pages go to disk: write_through (as soon as the cache stores them) or write_back (when memory evicts them); write_through_selective is taken as write_through."""

    def __post_init__(self) -> None:
        if self.hicache_write_policy not in (
            "write_through",
            "write_back",
            "write_through_selective",
        ):
            raise ValueError(
                "hicache_write_policy must be write_through, write_back or "
                f"write_through_selective, got {self.hicache_write_policy!r}"
            )
        if self.hicache_size < 0:
            raise ValueError("hicache_size must be ≥ 0 (GB; 0: no cap)")
        backend = self.hicache_storage_backend
        if backend is not None and backend != "file":
            raise ValueError(f"hicache_storage_backend: only file is available, got {backend!r}")
        if self.enable_hierarchical_cache and backend is None:
            raise ValueError(
                "enable_hierarchical_cache: give --hicache-storage-backend file (the KV pool is "
                "the memory tier; the disk is the tier below it)"
            )
        if self.hicache_storage_backend_extra_config is not None:
            try:
                extra = json.loads(self.hicache_storage_backend_extra_config)
            except ValueError as e:
                raise ValueError(f"hicache_storage_backend_extra_config: not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("hicache_storage_backend_extra_config: give a JSON object")

    @property
    def hicache_dir(self) -> str:
        """The file backend's directory."""
        from cadence import envs

        extra = json.loads(self.hicache_storage_backend_extra_config or "{}")
        path = extra.get("file_storage_path") or envs.hicache_storage_dir()
        return path or os.path.join(envs.state_dir(), "hicache")


DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_BACKENDS = ("shm", "torch")


@dataclass(frozen=True)
class DisaggregationArgs:
    """Prefill/decode disaggregation: a prefill server runs prompts, a decode server streams tokens (docs/disaggregation.md)."""

    disaggregation_mode: str = "null"
    """null (prefill and decode here), prefill (run prompts, send their KV pages to the decode server a request names) or decode (receive KV pages, stream the tokens)."""
    disaggregation_transfer_backend: str = "shm"
    """How KV pages move: shm (shared memory, both servers on one host) or torch (torch.distributed point to point across hosts: gloo on CPU, NCCL where both sides are on CUDA)."""
    disaggregation_bootstrap_port: int = 8998
    """The prefill server's bootstrap port, where decode servers claim a request's room (a router passes it to both sides as bootstrap_port)."""
    disaggregation_bootstrap_timeout: float | None = None
    """Seconds a request's room may wait for its other side (the decode server's claim on a prefill server; the prefill server's answer on a decode server) before it fails; default SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, else 300."""
    disaggregation_waiting_timeout: float | None = None
    """Seconds a decode server waits for a claimed request's KV pages and first token before it fails the request; default SGLANG_DISAGGREGATION_WAITING_TIMEOUT, else 300."""
    disaggregation_decode_local_prefill: bool = False
    """Decode mode: also prefill here a request that comes without a room (the short prompts a router sends with --pd-local-prefill-max-tokens). Without it such a request is refused (400), which catches a client that bypasses the router."""

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                "disaggregation_mode must be null, prefill or decode, got "
                f"{self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in DISAGGREGATION_BACKENDS:
            raise ValueError(
                "disaggregation_transfer_backend must be shm or torch, got "
                f"{self.disaggregation_transfer_backend!r} (SGLang's mooncake and nixl need "
                "RDMA libraries this server does not ship)"
            )
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(
                f"disaggregation_bootstrap_port must be a port, got "
                f"{self.disaggregation_bootstrap_port}"
            )
        if self.disaggregation_decode_local_prefill and self.disaggregation_mode != "decode":
            raise ValueError(
                "disaggregation_decode_local_prefill: only a decode server (--disaggregation-mode "
                f"decode) prefills requests without a room, this one runs {self.disaggregation_mode!r}"
            )
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")

    @property
    def effective_bootstrap_timeout(self) -> float:
        from cadence import envs

        given = self.disaggregation_bootstrap_timeout
        return given if given is not None else envs.disaggregation_bootstrap_timeout()

    @property
    def effective_waiting_timeout(self) -> float:
        from cadence import envs

        given = self.disaggregation_waiting_timeout
        return given if given is not None else envs.disaggregation_waiting_timeout()


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_FUSED_NAMES = {  # SGLang also accepts the fused names
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def parse_lora_path(entry: Any) -> tuple[str, str, bool]:
    """One --lora-paths entry as (name, path, pinned): `PATH` (named by itself),
    `NAME=PATH`, or the JSON object {"lora_name", "lora_path", "pinned"} (SGLang's forms)."""
    if isinstance(entry, dict):
        obj = entry
    elif isinstance(entry, str) and entry.strip().startswith("{") and entry.strip().endswith("}"):
        try:
            obj = json.loads(entry)
        except ValueError as e:
            raise ValueError(f"lora_paths: {entry!r} is not valid JSON: {e}") from None
    elif isinstance(entry, str) and entry:
        name, sep, path = entry.partition("=")
        return (name, path, False) if sep else (entry, entry, False)
    else:
        raise ValueError(
            f"lora_paths: each entry is NAME=PATH, PATH or a JSON object, got {entry!r}"
        )
    if not isinstance(obj, dict) or not {"lora_name", "lora_path"} <= set(obj):
        raise ValueError(f"lora_paths: a JSON entry needs lora_name and lora_path, got {entry!r}")
    return str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))


@dataclass(frozen=True)
class LoraArgs:
    """LoRA adapters: many PEFT adapters over one base model, mixed in one batch."""

    enable_lora: bool = False
    """Serve LoRA adapters (set by itself when --lora-paths is given)."""
    lora_paths: tuple[str, ...] | None = None
    """Adapters loaded at start: NAME=PATH, PATH (named by itself) or a JSON object {"lora_name": ..., "lora_path": ..., "pinned": true}; a PEFT directory each."""
    max_loras_per_batch: int = 8
    """Most distinct adapters in one forward step, the base model counted as one (SGLang's meaning)."""
    max_loaded_loras: int | None = None
    """Most adapters held in memory at once; loading one more evicts an unpinned adapter no request uses (--lora-eviction-policy). Default: no limit."""
    max_lora_rank: int | None = None
    """Largest adapter rank accepted (loads above it are refused). Default: the largest rank among --lora-paths; required without them."""
    lora_target_modules: tuple[str, ...] | None = None
    """Modules an adapter may target (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, qkv_proj, gate_up_proj, or all). Default: those of --lora-paths' adapters; required without them."""
    lora_eviction_policy: str = "lru"
    """Which adapter gives way when --max-loaded-loras is reached: lru (least recently used) or fifo (first loaded)."""

    def __post_init__(self) -> None:
        paths = self.lora_paths
        if isinstance(paths, (str, dict)):
            paths = [paths]
        if paths is not None:
            entries = [parse_lora_path(p) for p in paths]
            names = [name for name, _, _ in entries]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"lora_paths: the name(s) {dup} are given twice")
            canonical = tuple(
                f"{n}={p}"
                if not pin and "=" not in n
                else json.dumps({"lora_name": n, "lora_path": p, "pinned": pin})
                for n, p, pin in entries
            )
            object.__setattr__(self, "lora_paths", canonical)
            if entries:
                object.__setattr__(self, "enable_lora", True)
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", _lora_modules(self.lora_target_modules))
        _at_least_one(self, "max_loras_per_batch")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be ≥ 1")
        if self.lora_eviction_policy not in ("lru", "fifo"):
            raise ValueError(
                f"lora_eviction_policy must be lru or fifo, got {self.lora_eviction_policy!r}"
            )
        num_paths = len(self.lora_paths or ())
        if self.max_loaded_loras is not None and self.max_loaded_loras < max(1, num_paths):
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be ≥ 1 and ≥ the number of "
                f"lora_paths ({num_paths})"
            )
        if (
            self.enable_lora
            and not num_paths
            and (self.max_lora_rank is None or self.lora_target_modules is None)
        ):
            raise ValueError(
                "enable_lora without lora_paths: give --max-lora-rank and --lora-target-modules "
                "(the limits adapters loaded later must fit)"
            )

    @property
    def lora_entries(self) -> list[tuple[str, str, bool]]:
        """--lora-paths as (name, path, pinned)."""
        return [parse_lora_path(p) for p in self.lora_paths or ()]


def _lora_modules(value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else list(value)
    if "all" in names:
        if len(names) > 1:
            raise ValueError("lora_target_modules: 'all' must be given alone")
        return LORA_TARGET_MODULES
    out: list[str] = []
    for name in names:
        parts = _LORA_FUSED_NAMES.get(name, (name,))
        for part in parts:
            if part not in LORA_TARGET_MODULES:
                raise ValueError(
                    f"lora_target_modules: {name!r} cannot be served (choose from "
                    f"{', '.join(LORA_TARGET_MODULES)}, qkv_proj, gate_up_proj or all)"
                )
            if part not in out:
                out.append(part)
    return tuple(out)


@dataclass(frozen=True)
class ParallelArgs:
    """Tensor and pipeline parallelism over torch.distributed, on one machine or several (docs/parallel.md)."""

    tp_size: int = 1
    """Tensor parallel ranks: attention heads, key-value heads, the MLP and the vocabulary split across this many processes (gloo on CPU, NCCL on CUDA)."""
    pp_size: int = 1
    """Pipeline parallel stages: contiguous layer ranges, activations sent from stage to stage; a decode keeps one lane of the running requests per stage in flight."""
    nnodes: int = 1
    """Machines the tp_size × pp_size ranks are spread over (each runs `cadence serve` with the same flags and its own --node-rank)."""
    node_rank: int = 0
    """This machine's index among --nnodes. Node 0 runs the scheduler and serves HTTP and gRPC; the others run ranks only."""
    dist_init_addr: str | None = None
    """host:port of node 0, where every rank meets (torch.distributed's TCP store). Required with --nnodes > 1; on one machine a free local port is taken."""
    dist_timeout: float = 60.0
    """Seconds any collective may wait for the other ranks before the server stops with an error (a rank that died ends the server sooner: its sockets close)."""
    dp_size: int = 1
    """Data-parallel replicas (SGLang's flag): more than 1 serves the command line as `cadence launch` does, that many replicas of this server (each its own scheduler and KV pool) behind the router on --host/--port (docs/launch.md)."""

    def __post_init__(self) -> None:
        _at_least_one(self, "tp_size", "pp_size", "nnodes", "dp_size")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes ({self.nnodes}) must divide tp_size × pp_size ({self.world_size}): "
                "each machine runs the same number of ranks"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr: --nnodes > 1 needs node 0's host:port")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


def split_host_port(addr: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets) -> (host, port); ValueError naming dist_init_addr."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host, int(port)
