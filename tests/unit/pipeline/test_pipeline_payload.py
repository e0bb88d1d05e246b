"""The payload codec: tensors out (placeholders with path, shape, dtype, offset, size), one
aligned buffer, and back in, equal to the byte; no pickle anywhere."""

from __future__ import annotations

import re
import warnings

import msgspec
import pytest
import torch

from cadence.pipeline.payload import ALIGN, buffer_from_frame, extract, restore


def _dtypes() -> list[torch.dtype]:
    """Every dtype torch can hold and copy elements of (quantized and sub-byte shells excluded)."""
    found = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in found:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "experimental" and "deprecated" dtypes
                torch.zeros(2, dtype=dtype).view(torch.uint8).clone()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        found.append(dtype)
    return sorted(found, key=str)


DTYPES = _dtypes()


def _random(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype`: every bit pattern, NaNs included."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _roundtrip(obj, via_frame: bool = False):
    extracted = extract(obj)
    header = msgspec.msgpack.decode(
        msgspec.msgpack.encode(extracted.header), type=type(extracted.header)
    )
    buf = extracted.pack() if extracted.nbytes else None
    if via_frame and buf is not None:
        buf = buffer_from_frame(bytes(buf.numpy()))
    return restore(header, buf), extracted


def _assert_equal(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and _same(got, want), (got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            _assert_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_equal(g, w)
    else:
        assert got == want and type(got) is type(want)


def test_every_dtype_in_nested_dicts_and_lists():
    assert {torch.bool, torch.bfloat16, torch.float8_e4m3fn, torch.complex64} <= set(DTYPES)
    payload = {
        "by_dtype": {str(d): _random((3, 5), d, i) for i, d in enumerate(DTYPES)},
        "lists": [[_random((7,), d, 100 + i)] for i, d in enumerate(DTYPES)],
        "scalars": [_random((), d, 200 + i) for i, d in enumerate(DTYPES)],
    }
    got, extracted = _roundtrip(payload)
    _assert_equal(got, payload)
    assert len(extracted.header.tensors) == 3 * len(DTYPES)


def test_placeholders_carry_path_shape_dtype_and_aligned_offsets():
    payload = {"audio": [torch.zeros(3, 4, dtype=torch.bfloat16)], "ids": (1, torch.arange(5))}
    extracted = extract(payload)
    metas = extracted.header.tensors
    assert [(m.path, m.shape, m.dtype, m.size) for m in metas] == [
        ("audio[0]", (3, 4), "bfloat16", 24),
        ("ids[1]", (5,), "int64", 40),
    ]
    assert all(m.offset % ALIGN == 0 for m in metas)
    assert metas[1].offset >= metas[0].offset + metas[0].size
    assert extracted.nbytes == metas[-1].offset + metas[-1].size


def test_empty_and_non_contiguous_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    payload = {
        "empty": torch.empty(0, 3),
        "empty_int": torch.empty(2, 0, dtype=torch.int8),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "neg_view": torch.tensor([1.0, -2.0])._neg_view(),
        "grad": torch.ones(2, requires_grad=True) * 2,
    }
    got, _ = _roundtrip(payload)
    for key in ("empty", "empty_int"):
        assert got[key].shape == payload[key].shape and got[key].dtype == payload[key].dtype
    for key in ("transposed", "strided", "expanded", "conj", "neg_view"):
        assert torch.equal(got[key], payload[key].resolve_conj().resolve_neg()), key
    assert torch.equal(got["grad"], torch.full((2,), 2.0)) and not got["grad"].requires_grad


def test_no_tensors_has_no_buffer():
    payload = {"text": "héllo", "n": [1, 2.5, None, True], "raw": b"\x00\xff", "t": (1, (2,))}
    got, extracted = _roundtrip(payload)
    assert extracted.nbytes == 0 and extracted.header.tensors == []
    _assert_equal(got, payload)
    assert restore(extract(None).header, None) is None


class _Dict(dict):
    pass


def test_plain_payloads_encode_as_the_walk_does():
    """Plain data skips the walk; what it encodes to must not depend on which path ran."""
    payload = {"text": "hi", 3: [1, 2.5, None, True, b"\x01"], "d": {"e": []}}
    extracted = extract(payload)
    assert bytes(extracted.header.skeleton) == msgspec.msgpack.encode(payload)
    assert extracted.nbytes == 0 and extracted.tensors == []
    # Not plain by exact type: a tuple, a dict subclass, a bool key; the walk handles them.
    assert restore(extract({"t": (1, 2)}).header, None) == {"t": (1, 2)}
    assert restore(extract(_Dict(a=[1])).header, None) == {"a": [1]}
    with pytest.raises(TypeError, match="keys are str or int"):
        extract({True: 1})


def test_through_a_frame_copy_and_a_single_tensor_without_copy():
    payload = {"x": torch.arange(10, dtype=torch.float64), "y": [torch.ones(3, dtype=torch.int16)]}
    got, _ = _roundtrip(payload, via_frame=True)
    _assert_equal(got, payload)
    single = torch.arange(6, dtype=torch.float32)
    packed = extract(single).pack()
    assert packed.data_ptr() == single.data_ptr()  # its own buffer: no copy
    assert torch.equal(restore(extract(single).header, packed), single)


def test_restored_tensors_are_views_of_the_buffer():
    extracted = extract({"a": torch.ones(4), "b": torch.zeros(4)})
    buf = extracted.pack()
    got = restore(extracted.header, buf)
    got["b"].add_(3)
    assert torch.equal(restore(extracted.header, buf)["b"], torch.full((4,), 3.0))


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"a": {1, 2}}, "a"),
        ({"a": [object()]}, "a[0]"),
        ({(1, 2): 3}, "$"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "q"),
        ({"s": torch.ones(2, 2).to_sparse()}, "s"),
    ],
)
def test_values_msgpack_cannot_carry_are_refused_naming_where(bad, where):
    with pytest.raises(TypeError, match=f"at {re.escape(where)}"):
        extract(bad)


def test_a_short_buffer_or_a_bad_placeholder_is_an_error():
    extracted = extract({"a": torch.ones(16)})
    with pytest.raises(ValueError, match="bytes of tensor data"):
        restore(extracted.header, torch.empty(8, dtype=torch.uint8))
    header = extracted.header
    header.skeleton = msgspec.Raw(
        msgspec.msgpack.encode({"a": msgspec.msgpack.Ext(1, (5).to_bytes(4, "little"))})
    )
    with pytest.raises(ValueError, match="placeholder 5"):
        restore(header, extracted.pack())
    no_tensors = extract({"a": 1}).header  # the path for payloads without tensors
    no_tensors.skeleton = header.skeleton
    with pytest.raises(ValueError, match="placeholder 5 has no tensor"):
        restore(no_tensors, None)
