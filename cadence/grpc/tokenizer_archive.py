"""The tokenizer directory as one zip archive, for the scheduler service's GetTokenizer.

SGLang's gateway reads the tokenizer from GetModelInfo's `tokenizer_path` when it can see
that directory; when it cannot (another machine), it asks GetTokenizer for the files.
The archive is flat (files at its root), holds only the tokenizer's and the model config's
files, and is built once per directory, off the event loop, then served from memory. Every
entry carries a fixed timestamp, so the same files always give the same bytes and the
same SHA-256 across restarts.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import zipfile
from collections.abc import Iterator

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk
# What the gateway accepts (it refuses larger archives); ours are far smaller.
MAX_ENTRIES = 50
MAX_BYTES = 500 * 1024 * 1024
# Whichever of these the directory holds; chat templates under any *.jinja name too.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry


def archive_names(directory: str) -> list[str]:
    """The files of `directory` that go into the archive, in archive order."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    names += sorted(
        n
        for n in os.listdir(directory)
        if n.endswith(".jinja") and n not in names and os.path.isfile(os.path.join(directory, n))
    )
    return names


def build_archive(directory: str) -> tuple[bytes, str]:
    """The zip archive of `directory`'s tokenizer files and its hex SHA-256. Raises
    FileNotFoundError when the directory holds none, ValueError past the gateway's limits."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the tokenizer directory {directory} does not exist")
    names = archive_names(directory)
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {directory}")
    if len(names) > MAX_ENTRIES:
        raise ValueError(f"{len(names)} tokenizer files: more than {MAX_ENTRIES} entries")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            with open(os.path.join(directory, name), "rb") as f:
                archive.writestr(entry, f.read())
    data = buf.getvalue()
    if len(data) > MAX_BYTES:
        raise ValueError(f"the tokenizer archive has {len(data)} bytes: more than {MAX_BYTES}")
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[tuple[bytes, str]]:
    """(piece, sha256) pairs of at most CHUNK_BYTES each, in order; only the last piece
    carries the digest, the others an empty string."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        yield data[start:end], sha256 if end >= len(data) else ""


class TokenizerArchive:
    """One directory's archive, built on a worker thread by the first caller and kept;
    callers that arrive meanwhile share that build. A failed build is not kept."""

    def __init__(self, directory: str):
        self.directory = directory
        self._built: tuple[bytes, str] | None = None
        self._building: asyncio.Future | None = None

    async def get(self) -> tuple[bytes, str]:
        if self._built is not None:
            return self._built
        if self._building is None:
            self._building = asyncio.ensure_future(asyncio.to_thread(build_archive, self.directory))
        building = self._building
        try:
            self._built = await asyncio.shield(building)
        except BaseException:
            if building.done():  # failed (not a caller that went away): the next call retries
                self._building = None
            raise
        return self._built
