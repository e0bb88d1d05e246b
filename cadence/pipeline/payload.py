"""A payload's tensors out and back in: extract, pack into one aligned buffer, restore.

A payload is plain data (None, bool, int, float, str, bytes, lists, tuples, dicts) with
torch tensors anywhere inside. `extract` walks it once: each tensor becomes a placeholder (a
msgpack extension value holding its index) and a `TensorMeta` (path, shape, dtype, offset,
size); the rest is msgpack. `Extracted.pack` lays the tensors' bytes out in one buffer, each
at an ALIGN-byte boundary; `restore` rebuilds the payload from the header and that buffer,
each tensor a view of the buffer (no copy). Any dtype whose elements torch can copy works,
on any device; empty and non-contiguous tensors too. Nothing is pickled.

Extension codes in the skeleton: 1 = tensor (4-byte little-endian index into the header's
tensors), 2 = tuple (msgpack of its items), so that a tuple comes back a tuple.
"""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import torch

from cadence.pipeline.messages import PayloadHeader, TensorMeta

ALIGN = 64  # every tensor starts at a multiple of this many bytes: any dtype can view it
EXT_TENSOR = 1
EXT_TUPLE = 2

_encoder = msgspec.msgpack.Encoder()
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN)


class Extracted:
    """A payload taken apart: its header and its tensors, in the header's order."""

    def __init__(self, header: PayloadHeader, tensors: list[torch.Tensor]):
        self.header = header
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    def pack_into(self, dst: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Writes the tensors into `dst` (1-D uint8, at least `nbytes` long, any device); only
        bytes [start, end) of the packed layout when given, so that several threads can
        share one large copy."""
        end = self.nbytes if end is None else end
        for tensor, meta in zip(self.tensors, self.header.tensors):
            lo, hi = max(start, meta.offset), min(end, meta.offset + meta.size)
            if lo < hi:
                src = _as_bytes(tensor)[lo - meta.offset : hi - meta.offset]
                copy_bytes(dst[lo:hi], src)

    def pack(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """The packed buffer on `device`. A payload of one contiguous tensor already on that
        device is its own buffer (a view, no copy): the sender must not change it afterwards,
        which the read-only contract on outputs already says."""
        if len(self.tensors) == 1:
            tensor = self.tensors[0]
            if tensor.is_contiguous() and tensor.device == torch.device(device):
                return _as_bytes(tensor)
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.pack_into(buf)
        return buf


def extract(obj: Any) -> Extracted:
    """Takes the tensors out of `obj`; a value that msgpack cannot carry is a TypeError naming
    where it is."""
    if _is_plain(obj):  # most control-plane payloads: msgpack as they are, no walk
        return Extracted(PayloadHeader(msgspec.Raw(_encoder.encode(obj)), [], 0), [])
    tensors: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    end = 0

    def walk(x: Any, path: str) -> Any:
        nonlocal end
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, torch.Tensor):
            tensor = _checked(x, path)
            size = tensor.numel() * tensor.element_size()
            offset = _align(end)
            end = offset + size
            dtype = str(tensor.dtype).removeprefix("torch.")
            metas.append(TensorMeta(path or "$", tuple(tensor.shape), dtype, offset, size))
            tensors.append(tensor)
            return msgspec.msgpack.Ext(EXT_TENSOR, (len(tensors) - 1).to_bytes(4, "little"))
        if isinstance(x, dict):
            out = {}
            for key, value in x.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"payload key {key!r} at {path or '$'}: keys are str or int")
                out[key] = walk(value, f"{path}.{key}" if path else str(key))
            return out
        if isinstance(x, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
            return msgspec.msgpack.Ext(EXT_TUPLE, _encoder.encode(items))
        raise TypeError(
            f"payload value at {path or '$'} is a {type(x).__name__}: a payload holds None, "
            f"bool, int, float, str, bytes, lists, tuples, dicts and torch tensors"
        )

    try:
        skeleton = _encoder.encode(walk(obj, ""))
    finally:
        walk = None  # noqa: F841  (it refers to itself: that cycle would hold the tensors)
    header = PayloadHeader(msgspec.Raw(skeleton), metas, end)
    return Extracted(header, tensors)


def restore(header: PayloadHeader, buf: torch.Tensor | None) -> Any:
    """The payload rebuilt; its tensors are views of `buf` (1-D uint8, any device), which
    must hold `header.nbytes` bytes (None when there are none)."""
    metas = header.tensors
    if header.nbytes and (buf is None or buf.numel() < header.nbytes):
        raise ValueError(f"payload needs {header.nbytes} bytes of tensor data, got fewer")
    if not metas:  # nothing to view: no per-call hook, no reference to `buf` to let go of
        return msgspec.msgpack.decode(header.skeleton, ext_hook=_no_tensor_ext_hook)
    device = buf.device if buf is not None else torch.device("cpu")

    def ext_hook(code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            index = int.from_bytes(data, "little")
            if index >= len(metas):
                raise ValueError(f"payload placeholder {index} has no tensor")
            return _view(metas[index], buf, device)
        if code == EXT_TUPLE:
            return tuple(msgspec.msgpack.decode(data, ext_hook=ext_hook))
        raise ValueError(f"unknown payload extension code {code}")

    try:
        return msgspec.msgpack.decode(header.skeleton, ext_hook=ext_hook)
    finally:
        # ext_hook refers to itself (tuples): left alone, that cycle would keep `buf` alive
        # until the garbage collector runs, and a lent buffer goes back only once it dies.
        ext_hook = None  # noqa: F841


def _no_tensor_ext_hook(code: int, data: memoryview) -> Any:
    """`restore`'s extension hook for a payload without tensors."""
    if code == EXT_TUPLE:
        return tuple(msgspec.msgpack.decode(data, ext_hook=_no_tensor_ext_hook))
    if code == EXT_TENSOR:
        raise ValueError(f"payload placeholder {int.from_bytes(data, 'little')} has no tensor")
    raise ValueError(f"unknown payload extension code {code}")


def _is_plain(x: Any) -> bool:
    """Only plain values (exactly their types), str/int-keyed dicts and lists: what msgpack
    carries as it is, with no tensor or tuple to take out."""
    kind = type(x)
    if kind in _PLAIN_TYPES:
        return True
    if kind is dict:
        for key, value in x.items():
            if (type(key) is not str and type(key) is not int) or not _is_plain(value):
                return False
        return True
    if kind is list:
        for value in x:
            if not _is_plain(value):
                return False
        return True
    return False


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for 1-D uint8 tensors of one size. Between contiguous CPU tensors it is
    one plain memcpy on this thread (ctypes releases the GIL): torch's copy would start its
    OpenMP team, whose spinning barrier stalls for milliseconds when stage processes
    outnumber the cores. A caller that wants several threads on one large copy splits it
    (the shm relay does, through `Extracted.pack_into`'s byte range)."""
    if not (dst.is_cpu and src.is_cpu and dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src)
        return
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def buffer_from_frame(frame) -> torch.Tensor:
    """A writable CPU copy of an inline frame's bytes, as the buffer `restore` takes."""
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a payload")
    return dtype


def _view(meta: TensorMeta, buf: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    dtype = dtype_of(meta.dtype)
    if meta.size == 0:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    numel = 1
    for dim in meta.shape:
        numel *= dim
    if numel * dtype.itemsize != meta.size or meta.offset % ALIGN:
        raise ValueError(f"payload tensor {meta.path} has an inconsistent size or offset")
    raw = buf[meta.offset : meta.offset + meta.size]
    return raw.view(dtype).view(meta.shape)


def _checked(x: torch.Tensor, path: str) -> torch.Tensor:
    if x.is_quantized or x.layout != torch.strided:
        raise TypeError(
            f"payload tensor at {path or '$'} is {'quantized' if x.is_quantized else x.layout}: "
            "send a dense tensor (e.g. int_repr() and the scale)"
        )
    return x.detach().resolve_conj().resolve_neg()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as 1-D uint8, contiguous (a view when it already is)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
