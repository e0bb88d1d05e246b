"""The relay seam: how a payload's packed bytes move between two stage processes.

A backend is a `Relay` subclass, registered by name: the built-ins (`shm`, `torch`) here,
others through the `cadence.relays` entry-point group, whose entries name the class (e.g.
`nixl = "my_pkg.relay:NixlRelay"`). Each stage process builds one relay at start-up
(`create_relay`), shared by all of its stages.

The protocol, for one payload:

    sender:   op = await relay.put_async(buf, rid, dst)    # buf is the packed payload
              send DataReady(relay=op.metadata)             # ALWAYS before waiting
              await op.wait_for_completion(timeout)
    receiver: op = await relay.get_async(metadata, dest, rid)
              await op.wait_for_completion(timeout)          # dest now holds the bytes
              if relay.needs_ack: send DataAck(relay=metadata) to the sender
    sender, on DataAck: relay.acknowledge(metadata)        # its put completes

A backend whose bytes the receiver can read where they lie (shm) may instead lend them:
`lend(metadata, on_release)` returns them as a tensor, and the receiver sends DataAck from
`on_release`, once every tensor restored from them is gone (zero-copy receive).

Sending the control message before waiting is what keeps credit-based backends from
deadlocking: a put completes only once its receiver has read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

import torch

from cadence.pipeline.config import RelayConfig
from cadence.pipeline.payload import Extracted

RELAY_GROUP = "cadence.relays"

_BUILTIN = {
    "shm": "cadence.pipeline.relay.shm:ShmRelay",
    "torch": "cadence.pipeline.relay.torch_dist:TorchRelay",
}
_registry: dict[str, type[Relay]] = {}


class RelayError(RuntimeError):
    """A transfer failed; its request fails with this message."""


class RelayTimeout(RelayError, TimeoutError):
    """No credit, or no receiver, within the transfer timeout."""


class RelayAborted(RelayError):
    """`cleanup(request_id)` ended the transfer before it completed."""


@dataclass(frozen=True)
class RelayContext:
    """A relay's place in its pipeline, the same in every process but for `rank`/`device`."""

    pipeline_id: str  # unique per launch; tags what a backend leaves in the system (shm names)
    rank: int  # this process's number among the pipeline's stage processes
    world_size: int  # number of stage processes
    device: str  # where this process's stages run: cpu, cuda, cuda:1, ...
    config: RelayConfig
    store_address: str | None = None  # "host:port" rendezvous for group backends (torch)
    peer_devices: tuple[str, ...] = ()  # the device of each rank's stages


class RelayOperation(ABC):
    """One put or get in flight.

    Invariant: `metadata` is plain msgpack data (it travels in DataReady/DataAck) and is
    ready when the operation is returned, before the transfer completes."""

    @property
    @abstractmethod
    def metadata(self) -> dict[str, Any]: ...

    @abstractmethod
    async def wait_for_completion(self, timeout: float | None = None) -> None:
        """Returns once the transfer is done: for a put, once the receiver no longer needs
        the sender's memory; for a get, once `dest` holds the bytes. Raises RelayTimeout
        after `timeout` seconds, RelayAborted after `cleanup`, RelayError on failure."""


class Relay(ABC):
    """A data-plane backend for one process.

    Invariants every backend keeps:
    - A put holds its resources (slot, credit, send buffer) until it is acknowledged
      (`acknowledge`), completes, or its request is cleaned up, whichever comes first;
      releasing twice is harmless.
    - `cleanup(request_id)` releases everything held for that request on this side, at once,
      and ends its pending operations with RelayAborted; it may run before, during or after
      the request's transfers.
    - A receiver consumes every DataReady it gets, even for an aborted request (get, ack,
      discard): a backend may rely on that to finish its put.
    - `close()` releases everything, including what outlives a process in the system (shared
      memory segments); after it, the relay is not used again.
    - Only the process's event-loop thread calls these methods.
    """

    name: ClassVar[str] = ""
    needs_ack: ClassVar[bool] = False
    """True when a put completes only on the receiver's DataAck (credit-based backends)."""
    can_replace_process: ClassVar[bool] = True
    """False when a restarted process cannot rejoin the others (a fixed process group): the
    launcher then restarts every stage process together."""

    def __init__(self, ctx: RelayContext):
        self.ctx = ctx

    def buffer_device(self, peer: int) -> torch.device:
        """Where the packed bytes of a transfer with rank `peer` live: what `put_async` sends
        from and where `get_async` destinations are allocated."""
        return torch.device("cpu")

    @abstractmethod
    async def put_async(self, tensor: torch.Tensor, request_id: str, dst: int) -> RelayOperation:
        """Starts sending `tensor` (1-D uint8, contiguous) to the process of rank `dst`; may
        wait for a credit. The tensor must not change until the put completes."""

    async def put_payload_async(
        self, payload: Extracted, request_id: str, dst: int
    ) -> RelayOperation:
        """`put_async` of the packed payload; a backend overrides it to pack straight into
        its own memory and save a copy."""
        return await self.put_async(payload.pack(self.buffer_device(dst)), request_id, dst)

    @abstractmethod
    async def get_async(
        self, metadata: dict[str, Any], dest: torch.Tensor, request_id: str
    ) -> RelayOperation:
        """Starts receiving the put that `metadata` describes into `dest` (1-D uint8 on
        `buffer_device(sender)`, at least metadata["size"] bytes)."""

    def lend(self, metadata: dict[str, Any], on_release: Callable[[], None]) -> torch.Tensor | None:
        """The put that `metadata` describes, as a 1-D uint8 CPU tensor over the sender's own
        memory (no copy), or None when this put is not lent (the receiver then uses
        `get_async`). `on_release` runs, on whichever thread drops the last view of that
        tensor, once nothing refers to it any more: the receiver acknowledges from there."""
        return None

    async def discard_async(self, metadata: dict[str, Any], request_id: str, src: int) -> None:
        """Consumes a put whose request this side has dropped, so that the sender's put can
        complete; the default receives it into a scratch buffer. The caller still acks."""
        dest = torch.empty(metadata["size"], dtype=torch.uint8, device=self.buffer_device(src))
        op = await self.get_async(metadata, dest, request_id)
        await op.wait_for_completion(self.ctx.config.transfer_timeout_s)

    def acknowledge(self, metadata: dict[str, Any]) -> None:
        """The receiver acknowledged the put that `metadata` describes (needs_ack backends)."""

    @abstractmethod
    def cleanup(self, request_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Accounting for leak checks; every backend reports `pending` (puts not yet done)."""
        return {"backend": self.name, "pending": 0}


def register_relay(name: str):
    """Class decorator: makes a Relay subclass available under `name`."""

    def decorate(cls: type[Relay]) -> type[Relay]:
        cls.name = name
        _registry[name] = cls
        return cls

    return decorate


def relay_class(name: str) -> type[Relay]:
    """The backend called `name`: registered, built in, or from a `cadence.relays` entry point."""
    if name in _registry:
        return _registry[name]
    if name in _BUILTIN:
        from cadence.pipeline.config import resolve

        return _registered(name, resolve(_BUILTIN[name]))
    for ep in entry_points(group=RELAY_GROUP):
        if ep.name == name:
            return _registered(name, ep.load())
    raise ValueError(
        f"unknown relay backend {name!r}; available: {', '.join(available_relays())} "
        f"(plugins add backends through the {RELAY_GROUP!r} entry-point group)"
    )


def available_relays() -> list[str]:
    names = set(_registry) | set(_BUILTIN) | {ep.name for ep in entry_points(group=RELAY_GROUP)}
    return sorted(names)


def create_relay(ctx: RelayContext) -> Relay:
    return relay_class(ctx.config.backend)(ctx)


def _registered(name: str, cls: Any) -> type[Relay]:
    if not (isinstance(cls, type) and issubclass(cls, Relay)):
        raise ValueError(f"relay backend {name!r} is {cls!r}, not a Relay subclass")
    _registry.setdefault(name, cls)
    if not cls.name:
        cls.name = name
    return _registry[name]
