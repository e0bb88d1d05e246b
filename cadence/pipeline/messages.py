"""Every message of a pipeline's control plane, and the one codec that carries them.

Message definitions only: msgspec Structs tagged with their class name, encoded as msgpack
arrays. No pickle: a socket is never a way to run code. A message travels as one ZMQ frame;
a payload carried inline (small tensors, and everything to or from the coordinator) follows
as a second frame holding the packed tensor bytes.

Who sends what (PUSH/PULL unless marked PUB):

    coordinator ──Submit──► entry stage's process
    stage ──DataReady (relay metadata, or inline)──► next stage's process ──DataAck──► sender
    stage ──Complete / Stream──► coordinator
    coordinator ──Abort / Shutdown / ProfilerStart / ProfilerStop / StatsQuery (PUB)──► all
    stage process ──StageReady / StageStats──► coordinator

Wire names are the contract of specs/pipeline.md: Submit, DataReady, Complete, Stream, Abort,
Shutdown, ProfilerStart, ProfilerStop. DataAck, StageReady, StatsQuery and StageStats are the
runtime's own (credit return, readiness, accounting).
"""

from __future__ import annotations

from typing import Any

import msgspec


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    """Where one extracted tensor lies in its payload's packed buffer."""

    path: str  # where it was in the payload, e.g. "audio[0].wave"
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    offset: int  # bytes from the buffer's start; a multiple of payload.ALIGN
    size: int  # bytes


class PayloadHeader(msgspec.Struct, array_like=True):
    """A payload without its tensors: the msgpack of the rest, with placeholders (msgpack
    extension values) where the tensors were, and where each tensor lies in the buffer."""

    skeleton: msgspec.Raw  # msgpack; see payload.py for the extension codes
    tensors: list[TensorMeta]
    nbytes: int  # size of the packed buffer (0: no tensor data, no buffer)


class _Message(msgspec.Struct, array_like=True, tag=True, kw_only=True):
    """Base of every message: tagged with the class name."""


class Submit(_Message):
    """A new request for the entry stage; its tensors follow inline."""

    rid: str
    stage: str  # the entry stage
    payload: PayloadHeader


class DataReady(_Message):
    """A stage's output for a stage in another process: a whole result (chunk_id None) or one
    chunk of a stream edge. Stream end (is_done with no payload) and stream error are
    control-only. `relay` is the backend's metadata for `get_async`; None when the tensors
    follow inline or there are none."""

    rid: str
    stage: str  # the receiving stage
    src_stage: str
    payload: PayloadHeader | None = None
    relay: dict[str, Any] | None = None
    chunk_id: int | None = None
    is_done: bool = True
    error: str | None = None


class DataAck(_Message):
    """The receiver has copied a relayed payload out: the sender may reuse its slot/credit."""

    rid: str
    relay: dict[str, Any]  # the metadata of the acknowledged put


class Complete(_Message):
    """A terminal stage's result (tensors inline) or any stage's failure of a request."""

    rid: str
    stage: str
    payload: PayloadHeader | None = None
    error: str | None = None
    status: int | None = None  # of a refusal the stage passed on (429, 400, ...); None: 500
    param: str | None = None  # the request field that refusal names


class Stream(_Message):
    """One chunk for the client (tensors inline); is_done with no payload ends the stage's
    client stream, error fails it."""

    rid: str
    stage: str
    chunk_id: int
    payload: PayloadHeader | None = None
    is_done: bool = False
    error: str | None = None


class Abort(_Message):
    """Drop these requests everywhere: cancel their executors, release their relay resources."""

    rids: list[str]
    reason: str = "aborted"


class Shutdown(_Message):
    """Stop: finish nothing more, close relays, exit."""


class ProfilerStart(_Message):
    output_dir: str  # each process writes <output_dir>/<process>-<pid>.json on stop


class ProfilerStop(_Message):
    pass


class StageReady(_Message):
    """A stage process's executors are set up and its sockets are live (or it failed to)."""

    process: str
    pid: int
    error: str | None = None


class StatsQuery(_Message):
    token: int


class StageStats(_Message):
    """What a process holds: per stage the rids it still has state for, and its relay's
    accounting (backend-specific counters, e.g. shm's free slots)."""

    token: int
    process: str
    pid: int
    live: dict[str, list[str]]
    relay: dict[str, Any]


Message = (
    Submit
    | DataReady
    | DataAck
    | Complete
    | Stream
    | Abort
    | Shutdown
    | ProfilerStart
    | ProfilerStop
    | StageReady
    | StatsQuery
    | StageStats
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data) -> Message:
    """One message from a frame's bytes; malformed or unknown input is a msgspec.DecodeError."""
    return _decoder.decode(data)


def carries_frame(msg: Message) -> bool:
    """Whether a second frame, the payload's packed tensor bytes, follows `msg` on the wire:
    a payload with tensor data that is not in a relay."""
    payload = getattr(msg, "payload", None)
    return payload is not None and payload.nbytes > 0 and getattr(msg, "relay", None) is None


class StageProcessSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a stage process is started with (the spawn argument, msgpack-encoded; not a
    socket message): its share of the pipeline and where everything else listens."""

    config: dict[str, Any]  # PipelineConfig.to_dict()
    process: str  # which of the graph's processes this is
    pipeline_id: str
    coordinator_address: str  # the coordinator's PULL
    broadcast_address: str  # the coordinator's PUB (aborts, shutdown, profiler, stats)
    process_addresses: dict[str, str]  # every stage process's PULL, by process name
    store_address: str | None = None  # torch relay rendezvous
    parent_pid: int
    dropped: list[str] = []  # rids failed before this process started: drain their messages
    log_level: str = "INFO"


def encode_spec(spec: StageProcessSpec) -> bytes:
    return _encoder.encode(spec)


def decode_spec(data: bytes) -> StageProcessSpec:
    return msgspec.msgpack.decode(data, type=StageProcessSpec)
