"""A pipeline's declaration: stages, their routing and placement, and the relay between them.

The same declaration is written in YAML (`load_pipeline_config`) or in Python
(`PipelineConfig(stages=[StageConfig(...), ...])`); both end in the same frozen dataclasses,
checked once at load. Checking builds the `PipelineGraph`, the derived view every process
routes by: which stage feeds which, the entry, the terminals, and which stages share a
process. Imports nothing heavy: no torch, no zmq.

    stages:
      - {name: encode, executor: "my.module:Encoder", args: {dim: 8}, next: [left, right]}
      - {name: left,  executor: "my.module:Left",  next: join}
      - {name: right, executor: "my.module:Right", next: join, colocate_with: [left]}
      - {name: join,  executor: "my.module:Join", merge: "my.module:merge", terminal: true}
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass, field
from typing import Any

CLIENT = "client"  # not a stage name: the coordinator's side of every edge
RELAY_BACKENDS_BUILTIN = ("shm", "torch")
MIB = 1 << 20
START_METHODS = ("forkserver", "spawn")
PLACEMENTS = ("process", "front")
# The process name of the stages placed in the front: the coordinator's own process. Never a
# stage process's name (those are stage names, which cannot hold parentheses).
FRONT = "(front)"
PACKAGED_DIR = os.path.join(os.path.dirname(__file__), "pipelines")  # shipped YAML declarations


@dataclass(frozen=True)
class RelayConfig:
    """The data plane between stages in different processes."""

    backend: str = "shm"
    """Relay backend by name: shm (host shared memory), torch (torch.distributed point to
    point: gloo on CPU, nccl on CUDA), or one a plugin registers (entry-point group
    cadence.relays)."""
    slot_mb: float = 16.0
    """Size of one shared-memory slot, in MiB; a payload larger than a slot goes in a segment
    of its own (it still takes a credit)."""
    credits: int = 8
    """Transfers one process may have in flight at once (shm: slots in its pool); a sender
    waits for a credit, and the receiver's acknowledgement returns it."""
    inline_max_bytes: int = 64 * 1024
    """Payloads whose tensors take at most this many bytes travel inside the control message
    instead of the relay (0: every payload with tensors uses the relay)."""
    transfer_timeout_s: float = 60.0
    """Seconds a transfer may wait for a credit or for its receiver before its request fails."""
    zero_copy_min_bytes: int | None = 1 << 20
    """Payloads at least this large are read in place by the receiving stage (shm): its
    tensors are views of the sender's shared memory instead of a copy, and the credit comes
    back once the receiver has dropped every one of them. A sender lends only while at least
    half its credits are free, so a stage that keeps its inputs cannot starve the sender.
    None: always copy."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"relay.backend must be a backend name, got {self.backend!r}")
        if not self.slot_mb > 0:
            raise ValueError(f"relay.slot_mb must be > 0, got {self.slot_mb!r}")
        if not isinstance(self.credits, int) or self.credits < 1:
            raise ValueError(f"relay.credits must be an integer >= 1, got {self.credits!r}")
        if self.inline_max_bytes < 0:
            raise ValueError(f"relay.inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if self.zero_copy_min_bytes is not None and (
            not isinstance(self.zero_copy_min_bytes, int) or self.zero_copy_min_bytes < 0
        ):
            raise ValueError(
                "relay.zero_copy_min_bytes must be an integer >= 0 or null, "
                f"got {self.zero_copy_min_bytes!r}"
            )
        if not self.transfer_timeout_s > 0:
            raise ValueError(
                f"relay.transfer_timeout_s must be > 0, got {self.transfer_timeout_s!r}"
            )

    @property
    def slot_bytes(self) -> int:
        return int(self.slot_mb * MIB)


@dataclass(frozen=True)
class StageConfig:
    """One stage: what it runs, where, and where its output goes."""

    name: str
    """Unique name; other stages route to it by this name."""
    executor: Any
    """Executor factory as "package.module:attr" (or, in Python, an importable class or
    function), called with `args` as keyword arguments; it returns a `cadence.pipeline.Executor`."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the executor factory (plain data: they cross process boundaries)."""
    device: str = "cpu"
    """Device the executor runs on (cpu, cuda, cuda:1, ...); the torch relay picks nccl for
    CUDA stages and gloo otherwise."""
    colocate_with: tuple[str, ...] = ()
    """Stages that share this stage's process (by reference, no relay between them); default:
    a process of its own."""
    next: tuple[str, ...] = ()
    """Stages that receive this stage's result; several is a fan-out (each gets the result)."""
    terminal: bool = False
    """The result goes to the client (several terminal stages: the client gets one result
    per terminal stage, by name)."""
    merge: Any = None
    """Fan-in: "package.module:function" (or an importable function) called with
    {upstream stage: its result} when every upstream stage has delivered; required when
    more than one stage routes here."""
    stream_to: tuple[str, ...] = ()
    """Stream edges: stages that receive this stage's chunks (`emit`) while it runs, as an
    async iterator; a stage fed only by a stream starts at its first chunk."""
    stream_to_client: bool = False
    """Send this stage's chunks to the client through the coordinator (`stream()`)."""
    placement: str = "process"
    """Where the stage runs: `process`, a stage process (its own, or shared through
    colocate_with), or `front`: in the process that started the pipeline, beside the
    coordinator (a server's front process), where its executor can use what that process
    hands its front stages (`Pipeline.start(services=...)`, e.g. the server's engine client).
    Payloads to and from a front stage travel inside control messages, never a relay."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name.replace("_", "a").replace("-", "a").isalnum()
        ):
            raise ValueError(
                f"stage name {self.name!r} must be letters, digits, '_' or '-' (it names files)"
            )
        if self.name == CLIENT:
            raise ValueError(f"stage name {CLIENT!r} is reserved for the coordinator")
        where = f"stage {self.name!r}"
        for name in ("next", "colocate_with", "stream_to"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value or ())
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where}: {name} must be stage names, got {value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "executor", _reference(self.executor, f"{where}: executor"))
        if self.merge is not None:
            object.__setattr__(self, "merge", _reference(self.merge, f"{where}: merge"))
        if not isinstance(self.args, dict):
            raise ValueError(f"{where}: args must be a mapping of keyword arguments")
        object.__setattr__(self, "args", dict(self.args))
        for name in ("terminal", "stream_to_client"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{where}: {name} must be true or false")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"{where}: device must be a device name such as cpu or cuda:0")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"{where}: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.placement == "front" and self.colocate_with:
            raise ValueError(
                f"{where}: placement front runs the stage in the front process, with every other "
                f"front stage; drop colocate_with or the placement"
            )


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline; checked when built (`graph` raises ValueError naming the stage)."""

    stages: tuple[StageConfig, ...]
    """The stages, in any order."""
    name: str = "pipeline"
    """Name used in logs and process titles."""
    entry: str | None = None
    """The stage a request enters at; default: the one stage nothing routes to."""
    relay: RelayConfig = field(default_factory=RelayConfig)
    """The data plane between processes."""
    ready_timeout_s: float = 600.0
    """Seconds every stage process has to load its executors and report ready."""
    start_method: str = "forkserver"
    """How stage processes start: forkserver (forked from a server that has already imported
    torch and the runtime: a start or restart takes well under a second) or spawn (a fresh
    interpreter each, slower but inheriting nothing)."""

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}"
            )
        stages = tuple(self.stages)
        if not stages or not all(isinstance(s, StageConfig) for s in stages):
            raise ValueError("a pipeline needs at least one stage (a list of StageConfig)")
        object.__setattr__(self, "stages", stages)
        if isinstance(self.relay, dict):
            object.__setattr__(self, "relay", _build(RelayConfig, self.relay, "relay"))
        object.__setattr__(self, "graph", PipelineGraph.build(self))

    graph: PipelineGraph = field(init=False, repr=False, compare=False)

    def stage(self, name: str) -> StageConfig:
        return self.graph.stages[name]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the YAML shape): what a stage process receives, msgpack-encoded."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["stages"] = [dataclasses.asdict(s) for s in self.stages]
        out["relay"] = dataclasses.asdict(self.relay)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        """The YAML shape, checked: unknown keys and wrong types are ValueErrors naming them."""
        if not isinstance(data, dict):
            raise ValueError("a pipeline declaration is a mapping with a `stages` list")
        data = dict(data)
        raw_stages = data.pop("stages", None)
        if not isinstance(raw_stages, list) or not raw_stages:
            raise ValueError("a pipeline declaration needs a non-empty `stages` list")
        stages = []
        for i, raw in enumerate(raw_stages):
            if not isinstance(raw, dict):
                raise ValueError(f"stages[{i}] must be a mapping, got {raw!r}")
            where = f"stage {raw.get('name', i)!r}"
            stages.append(_build(StageConfig, raw, where))
        relay = _build(RelayConfig, data.pop("relay", None) or {}, "relay")
        top = _build(_TopLevel, data, "the pipeline")
        return cls(stages=tuple(stages), relay=relay, **dataclasses.asdict(top))


@dataclass(frozen=True)
class _TopLevel:
    name: str = "pipeline"
    entry: str | None = None
    ready_timeout_s: float = 600.0
    start_method: str = "forkserver"


def packaged_pipelines() -> list[str]:
    """Names of the pipelines shipped in `cadence/pipeline/pipelines/` (`<name>.yaml`)."""
    return sorted(n[: -len(".yaml")] for n in os.listdir(PACKAGED_DIR) if n.endswith(".yaml"))


def resolve_pipeline_path(name_or_path: str) -> str:
    """`--pipeline`'s value as a YAML file: a path to one, or the name of a shipped pipeline;
    a ValueError listing the shipped ones otherwise."""
    if os.path.isfile(name_or_path):
        return os.path.abspath(name_or_path)
    packaged = os.path.join(PACKAGED_DIR, f"{name_or_path}.yaml")
    if os.sep not in name_or_path and os.path.isfile(packaged):
        return packaged
    names = ", ".join(packaged_pipelines()) or "none"
    raise ValueError(
        f"pipeline: no such file {name_or_path!r}, and no shipped pipeline of that name "
        f"(shipped: {names}); give a YAML declaration's path or a shipped name"
    )


def load_pipeline_config(path: str) -> PipelineConfig:
    """Reads and checks a YAML declaration; every mistake is a ValueError saying what to fix."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read the pipeline declaration {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    try:
        return PipelineConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class PipelineGraph:
    """What routing needs, derived from the stages once.

    Processes are named after their stages (sorted, joined by "+"), and numbered in the order
    of the stage list: that number is a process's rank in a relay's group. Stages placed in
    the front have the process FRONT, which is not among `processes`: it is the
    coordinator's, started by no one and in no relay group."""

    stages: dict[str, StageConfig]
    entry: str
    terminals: tuple[str, ...]
    data_inputs: dict[str, tuple[str, ...]]  # stage -> stages whose result it receives
    stream_input: dict[str, str]  # stage -> the stage streaming into it (at most one)
    process_of: dict[str, str]  # stage -> its process name
    processes: tuple[str, ...]  # stage process names, by rank (FRONT is not one)
    client_streams: tuple[str, ...]  # stages that stream to the client
    front_stages: tuple[str, ...] = ()  # stages placed in the front (process FRONT)

    def stages_of(self, process: str) -> tuple[str, ...]:
        return tuple(s for s, p in self.process_of.items() if p == process)

    def rank_of(self, process: str) -> int:
        return self.processes.index(process)

    def colocated(self, a: str, b: str) -> bool:
        return self.process_of[a] == self.process_of[b]

    @classmethod
    def build(cls, config: PipelineConfig) -> PipelineGraph:
        stages: dict[str, StageConfig] = {}
        for s in config.stages:
            if s.name in stages:
                raise ValueError(f"stage {s.name!r} is declared twice")
            stages[s.name] = s
        _check_references(stages, config.entry)
        data_inputs: dict[str, list[str]] = {name: [] for name in stages}
        stream_input: dict[str, str] = {}
        for s in stages.values():
            for dst in s.next:
                data_inputs[dst].append(s.name)
            for dst in s.stream_to:
                if dst in stream_input:
                    raise ValueError(
                        f"stage {dst!r} has two stream inputs ({stream_input[dst]!r} and "
                        f"{s.name!r}); a stage takes at most one stream"
                    )
                stream_input[dst] = s.name
        _check_cycles(stages)
        entry = config.entry or _find_entry(stages, data_inputs, stream_input)
        if data_inputs[entry] or entry in stream_input:
            raise ValueError(f"entry stage {entry!r} must not receive from other stages")
        for name, s in stages.items():
            if len(data_inputs[name]) > 1 and s.merge is None:
                raise ValueError(
                    f"stage {name!r} receives from {len(data_inputs[name])} stages "
                    f"({', '.join(data_inputs[name])}) but has no merge function: add "
                    f"`merge: package.module:function`"
                )
            if not (s.next or s.terminal or s.stream_to or s.stream_to_client):
                raise ValueError(
                    f"stage {name!r} sends its result nowhere: give it `next`, `terminal: true` "
                    f"or a stream edge"
                )
        reachable = _reachable(stages, entry)
        for name in sorted(stages, key=lambda n: not stages[n].terminal):  # terminals first
            if name not in reachable:
                kind = "terminal" if stages[name].terminal else "stage"
                raise ValueError(
                    f"{kind} {name!r} is not reached by any path from the entry stage {entry!r}"
                )
        terminals = tuple(n for n, s in stages.items() if s.terminal)
        if not terminals:
            raise ValueError("no stage is terminal: mark the stage(s) whose result the client gets")
        process_of = _placements(stages)
        processes = tuple(
            dict.fromkeys(process_of[s.name] for s in config.stages if s.placement != "front")
        )
        return cls(
            stages=stages,
            entry=entry,
            terminals=terminals,
            data_inputs={k: tuple(v) for k, v in data_inputs.items()},
            stream_input=stream_input,
            process_of=process_of,
            processes=processes,
            client_streams=tuple(n for n, s in stages.items() if s.stream_to_client),
            front_stages=tuple(n for n, s in stages.items() if s.placement == "front"),
        )


def _check_references(stages: dict[str, StageConfig], entry: str | None) -> None:
    known = ", ".join(stages)
    for s in stages.values():
        for key in ("next", "stream_to", "colocate_with"):
            for other in getattr(s, key):
                if other not in stages:
                    raise ValueError(
                        f"stage {s.name!r}: {key} names unknown stage {other!r} (stages: {known})"
                    )
                if other == s.name and key != "colocate_with":
                    raise ValueError(f"stage {s.name!r}: {key} names the stage itself (a cycle)")
    if entry is not None and entry not in stages:
        raise ValueError(f"entry names unknown stage {entry!r} (stages: {known})")


def _edges(s: StageConfig) -> tuple[str, ...]:
    return s.next + s.stream_to


def _check_cycles(stages: dict[str, StageConfig]) -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dst in _edges(stages[name]):
            if state.get(dst) == 1:
                loop = path[path.index(dst) :] + [dst]
                raise ValueError(f"stages form a cycle: {' -> '.join(loop)}")
            if dst not in state:
                visit(dst, path + [dst])
        state[name] = 2

    for name in stages:
        if name not in state:
            visit(name, [name])


def _find_entry(stages, data_inputs, stream_input) -> str:
    roots = [n for n in stages if not data_inputs[n] and n not in stream_input]
    if len(roots) != 1:
        raise ValueError(
            f"cannot tell the entry stage: {len(roots)} stages receive from no other stage "
            f"({', '.join(roots) or 'none'}); name one with `entry:`"
        )
    return roots[0]


def _reachable(stages: dict[str, StageConfig], entry: str) -> set[str]:
    seen, todo = {entry}, [entry]
    while todo:
        for dst in _edges(stages[todo.pop()]):
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


def _placements(stages: dict[str, StageConfig]) -> dict[str, str]:
    """Union of the colocate_with relations: each group is one process; the front stages'
    process is FRONT."""
    for s in stages.values():
        for other in s.colocate_with:
            if stages[other].placement == "front":
                raise ValueError(
                    f"stage {s.name!r}: colocate_with names {other!r}, which is placed in the "
                    f"front; a stage process cannot share the front process"
                )
    parent = {name: name for name in stages}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s in stages.values():
        for other in s.colocate_with:
            parent[root(other)] = root(s.name)
    groups: dict[str, list[str]] = {}
    for name in stages:
        groups.setdefault(root(name), []).append(name)
    return {
        name: FRONT if stages[name].placement == "front" else "+".join(sorted(groups[root(name)]))
        for name in stages
    }


def _reference(value: Any, where: str) -> str:
    """The "module:attr" reference of a factory or merge function (a string or an object)."""
    if isinstance(value, str):
        module, _, attr = value.partition(":")
        if not module or not attr:
            raise ValueError(f"{where} must be 'package.module:attr', got {value!r}")
        return value
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not callable(value) or not module or "<locals>" in qualname or module == "__main__":
        raise ValueError(
            f"{where} must be 'package.module:attr' or a class/function defined at the top of "
            f"an importable module (stage processes import it by name), got {value!r}"
        )
    return f"{module}:{qualname}"


def resolve(reference: str) -> Any:
    """The object a "package.module:attr" reference names."""
    module, _, attr = reference.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _build(cls: type, data: Any, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})"
        )
    try:
        return cls(**data)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{where}: {e}") from None
