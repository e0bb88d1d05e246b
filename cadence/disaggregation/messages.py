"""The bootstrap channel's messages: what a prefill server and a decode server say about one
request's room (`bootstrap_room`) while its KV pages move between them.

The channel is ZMQ over TCP: the prefill server's ROUTER on its bootstrap port, one DEALER per
prefill server on each decode server. Pages themselves travel over a pipeline relay (shm,
torch); a `Chunk` only announces them. In order, for one room:

    decode  -> prefill   Claim        the room is mine: send from page `skip_pages` on
    prefill -> decode    Accepted     the room's request is here too: the transfer will come
    prefill -> decode    Chunk ...    pages [first_page, first_page + num_pages), on the relay
    decode  -> prefill   ChunkAck     (relays that need it) the chunk's memory may be reused
    prefill -> decode    Done         the prompt's first sampled token and its logprobs
    decode  -> prefill   DoneAck      every page is copied here
    prefill -> decode    Confirmed    and they were still the room's while copied: go on

With the shm backend the prefill server's KV pool itself is in shared memory (named in
`Accepted`): a `Chunk` names the pool's pages and the decode server copies them straight into
its own, one copy in all. A prefill server lets a room's pages go as soon as the room ends
there (answered, aborted, timed out); `Confirmed` is what tells the decode server that its
copies were made while the pages were still the room's (a room the prefill side no longer
holds answers `DoneAck` with `Failed`), so a request never decodes over pages another
request has overwritten. Without a shared pool (the torch backend, or no room for it in
/dev/shm), a chunk travels through the relay instead.

Either side may end a room at any point: `Failed` (prefill -> decode) or `Cancel` (decode ->
prefill), with the reason the other side's client is told. `Ping` lets a prefill server find
out that a decode server is gone (ROUTER_MANDATORY: sending to a dead peer fails).
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Msg(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    room: int


class Claim(_Msg):
    rid: str  # the decode side's request id (logs)
    skip_pages: int  # leading pages the decode side already has (its prefix cache)
    layout: str  # KVPool.layout of the decode side: both pools must agree
    backend: str  # the relay backend the decode side reads with


class Accepted(_Msg):
    # shm: the prefill server's KV pool lives in shared memory: {"segment": its name,
    # "num_pages": pages per layer}; the decode side copies pages from it directly.
    pool: dict[str, Any] | None = None


class Chunk(_Msg):
    first_page: int  # the request's page index of the chunk's first page
    num_pages: int
    relay: dict[str, Any]  # the relay's put metadata (empty when read from the pool)
    pages: list[int] | None = None  # the prefill pool's pages, to read where they lie


class ChunkAck(_Msg):
    relay: dict[str, Any]


class Done(_Msg):
    token: int | None  # the first output token; None when the request asked for none
    logprob: float | None = None
    top: list[tuple[float | None, int]] | None = None  # (logprob, token id) alternatives
    given: list[tuple[float | None, int]] | None = None  # of the token_ids_logprob asked for
    cached_tokens: int = 0  # prompt tokens the prefill side took from its prefix cache
    num_pages: int = 0  # pages sent before it (the decode side checks it got them all)


class DoneAck(_Msg):
    pass


class Confirmed(_Msg):
    pass


class Failed(_Msg):
    message: str


class Cancel(_Msg):
    message: str


class Ping(_Msg):
    pass


Message = Claim | Accepted | Chunk | ChunkAck | Done | DoneAck | Confirmed | Failed | Cancel | Ping

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
