"""The fast GGUF reader presents every field and tensor as gguf.GGUFReader does, on files
gguf's own writer makes (every scalar and array type, plain and quantized tensors, a custom
alignment) and on the shipped model, in a fraction of the time."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from cadence.model_loader.gguf_file import GGUFFile, StringArray, field_value, read_gguf
from cadence.model_loader.locate import default_model_path


def assert_same(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own pseudo-keys
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        mine, ref = field_value(ours, key), field_value(theirs, key)
        if isinstance(mine, StringArray):
            assert len(mine) == len(ref), key
        elif isinstance(mine, np.ndarray):
            assert np.array_equal(mine, np.asarray(ref).reshape(-1)), key
        else:
            assert mine == pytest.approx(ref), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name


def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(tmp_path):
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int32("t.i32", -7)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-9)
    writer.add_bool("t.bool", True)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.25, 0.5])
    writer.add_array("t.strs", ["a", "bb", "ccc", ""])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32))
    blocks = gguf.quants.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same(path)
    reader = read_gguf(path)
    assert isinstance(reader, GGUFFile)
    assert field_value(reader, "t.str") == "héllo"
    assert len(field_value(reader, "t.strs")) == 4
    assert field_value(reader, "absent", 3) == 3


def test_the_shipped_model_reads_as_gguf_reads_it_and_fast():
    path = default_model_path()
    assert_same(path)
    start = time.perf_counter()
    GGUFFile(path)
    # gguf.GGUFReader: ~5 s; this reader ~0.1 s, and well under the bound on a busy machine
    assert time.perf_counter() - start < 2.5


def test_not_a_gguf_file_is_a_value_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(path))


@pytest.mark.parametrize("keep", [40, 2_000_000], ids=["in-the-header", "in-the-tensors"])
def test_a_cut_short_file_says_so_and_names_it(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(keep))
    with pytest.raises(ValueError, match="cut.gguf: the GGUF file is truncated or corrupt"):
        read_gguf(str(path))
