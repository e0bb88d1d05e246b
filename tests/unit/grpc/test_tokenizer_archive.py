"""The tokenizer archive GetTokenizer streams: flat, only tokenizer files, reproducible."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import zipfile

import pytest

from cadence.grpc import tokenizer_archive as ta


def make_dir(path, **files):
    for name, text in files.items():
        (path / name).write_text(text)
    return str(path)


def test_the_archive_is_flat_holds_tokenizer_files_only_and_matches_its_digest(tmp_path):
    directory = make_dir(
        tmp_path,
        **{
            "tokenizer.json": "{}",
            "tokenizer_config.json": "{}",
            "chat_template.jinja": "{{ messages }}",
            "tool_use.jinja": "{{ tools }}",
            "model.safetensors": "weights",
        },
    )
    data, sha256 = ta.build_archive(directory)
    assert sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert names == [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tool_use.jinja",
    ]


def test_the_same_files_give_the_same_bytes_whatever_their_times(tmp_path):
    directory = make_dir(tmp_path, **{"tokenizer.json": "{}"})
    first = ta.build_archive(directory)
    os.utime(tmp_path / "tokenizer.json", (1, 1))
    assert ta.build_archive(directory) == first


def test_a_directory_without_tokenizer_files_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        ta.build_archive(make_dir(tmp_path, **{"weights.bin": "x"}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ta.build_archive(str(tmp_path / "missing"))


def test_chunks_put_the_digest_on_the_last_piece_only():
    data = bytes(range(256)) * 600  # 153,600 bytes: 3 pieces
    pieces = list(ta.chunks(data, "abc"))
    assert [len(p) for p, _ in pieces] == [65536, 65536, 22528]
    assert [d for _, d in pieces] == ["", "", "abc"]
    assert b"".join(p for p, _ in pieces) == data
    assert list(ta.chunks(b"x", "d")) == [(b"x", "d")]


async def test_concurrent_callers_share_one_build_and_a_failure_is_retried(tmp_path):
    archive = ta.TokenizerArchive(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        await archive.get()
    make_dir(tmp_path, **{"tokenizer.json": "{}"})
    first, second = await asyncio.gather(archive.get(), archive.get())
    assert first is second
