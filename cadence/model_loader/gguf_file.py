"""A GGUF file's metadata and tensors, read in milliseconds.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value: for a
49,152-token vocabulary and its merges that is ~250,000 views and ~5 s of every model load.
The loader needs a dozen scalars, the vocabulary's length and the tensors, so this reader
walks the header with `struct` over a memory map, keeps scalars and numeric arrays, counts
string arrays without decoding them, and gives each tensor its data as a view of the map,
with the same types, shapes and byte layout as `gguf.GGUFReader` (whose tables of
quantized types it uses). A file it cannot read (big-endian, an unknown version or value
type) is handed to `gguf.GGUFReader` itself.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> struct format of one scalar (GGUF's GGUFValueType numbering)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {"B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32,
          "i": np.int32, "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64,
          "d": np.float64}  # fmt: skip
# plain (not block-quantized) tensor types: GGMLQuantizationType value -> numpy item type
_PLAIN_TENSORS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                  27: np.int64, 28: np.float64}  # fmt: skip


class UnreadableHere(ValueError):
    """This reader does not handle the file; `gguf.GGUFReader` may."""


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, counted but not decoded."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class Tensor:
    """One tensor as `gguf.GGUFReader` presents it: `shape` innermost dimension first, as the
    file lists it; `data` a read-only view of the file (bytes per row for quantized types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """`fields` (key -> value: a scalar, a str, a numpy array, or a `StringArray`) and
    `tensors`, in file order."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        try:
            self._read()
        except (struct.error, ValueError) as e:  # past the end: a cut-short download
            if isinstance(e, UnreadableHere):
                raise
            raise ValueError(
                f"{path}: the GGUF file is truncated or corrupt ({e}); download it again"
            ) from None

    def _read(self) -> None:
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in VERSIONS:
            raise UnreadableHere(f"GGUF version {version}")
        self._pos = 4 + 4 + 8 + 8
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---- the header --------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise UnreadableHere(f"metadata value type {kind}")
        item, count = self._unpack("<IQ")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            values = np.frombuffer(self._buf, _NUMPY[fmt], count, self._pos)
            self._pos += size * count
            return values
        if item == _STRING:  # skipped by their lengths: a vocabulary is never decoded here
            buf, pos = self._buf, self._pos
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            self._pos = pos
            return StringArray(count)
        raise UnreadableHere(f"metadata array of type {item}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{num_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, tuple(int(d) for d in dims), kind, offset

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int):
        import gguf

        qtype = gguf.GGMLQuantizationType(kind)
        np_dims = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        if kind in _PLAIN_TENSORS:
            dtype: Any = _PLAIN_TENSORS[kind]
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            dtype, count = np.uint8, count // block * type_size
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, qtype)
        data = np.frombuffer(self._buf, dtype, count, start + offset).reshape(np_dims)
        return Tensor(name, qtype, dims, data)


def read_gguf(path: str) -> Any:
    """The file's reader: a `GGUFFile`, or `gguf.GGUFReader` for a file it does not handle
    (both have `fields` and `tensors`; read a field with `field_value`)."""
    try:
        return GGUFFile(path)
    except UnreadableHere:
        import gguf

        return gguf.GGUFReader(path)


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value from either reader: a scalar or str, an array (its len() is its
    count), or `default` where the file has no such key."""
    value = reader.fields.get(key, None)
    if value is None:
        return default
    return value if isinstance(reader, GGUFFile) else value.contents()  # a gguf ReaderField
