"""Where a model's tokenizer files are, and the tokenizer loaded from them, without torch.

The detokenizer and the front need only the tokenizer: importing the weight loaders (and so
torch) for it cost each of them seconds of start-up. A GGUF file's vocabulary is converted
to a Hugging Face tokenizer directory once and cached (`converted_tokenizer_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from cadence import envs
from cadence.model_loader.locate import is_gguf

logger = logging.getLogger(__name__)

GENERIC_TOKENIZER = "TokenizersBackend"  # transformers' fast tokenizer over tokenizer.json


def tokenizer_dir(path: str, tokenizer_path: str | None = None) -> str:
    """A local directory holding the model's tokenizer files (tokenizer.json, its config and
    chat template): the model's own, or the converted one of a GGUF file."""
    source = tokenizer_path or path
    return converted_tokenizer_dir(source) if is_gguf(source) else source


def load_tokenizer(path: str, tokenizer_path: str | None = None):
    """The model's own tokenizer (with its chat template) as a transformers fast tokenizer."""
    directory = tokenizer_dir(path, tokenizer_path)
    generic = _generic_class(directory)
    if generic is not None:
        return generic.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _generic_class(directory: str):
    """transformers' generic fast tokenizer class when `directory` names it (as every GGUF
    conversion does), which is the class AutoTokenizer would pick; None otherwise.

    AutoTokenizer's module imports torch (2-3 s of CPU in each process that only needs the
    tokenizer: the detokenizer, the front); the class itself does not."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if name != GENERIC_TOKENIZER or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    import transformers

    return getattr(transformers, name, None)


def file_key(path: str) -> str:
    """A short key naming one version of a file (its path, size and modification time)."""
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def converted_tokenizer_dir(path: str) -> str:
    """Convert the GGUF vocabulary to a Hugging Face tokenizer once; later loads reuse it.

    The conversion (transformers' own GGUF tokenizer conversion) takes seconds; the cached
    tokenizer.json loads in a fraction of that. A server's front, scheduler and detokenizer
    all ask for it as they start, and so do servers started together: one process converts,
    holding a lock file beside the cache, while the others wait on the lock and then read
    what it wrote. The conversion is written to a temporary directory and renamed into
    place, so that no reader ever sees half of one, even after a crash midway.
    """
    target = os.path.join(envs.cache_dir(), "tokenizers", file_key(path))
    if _is_converted(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with locked(target + ".lock"):
        if not _is_converted(target):  # else converted by another process while we waited
            _convert_tokenizer(path, target)
    return target


def _is_converted(target: str) -> bool:
    return os.path.exists(os.path.join(target, "tokenizer.json"))


@contextlib.contextmanager
def locked(lock_path: str) -> Iterator[None]:
    """An exclusive lock between processes (released by the kernel if the holder dies). The
    lock file stays: removing it would let a late process lock a file nobody else sees."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_tokenizer(path: str, target: str) -> None:
    from transformers import AutoTokenizer

    logger.info("Converting the GGUF tokenizer of %s (once; cached in %s)", path, target)
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp", dir=os.path.dirname(target))
    try:
        tokenizer.save_pretrained(tmp)
        if os.path.exists(target):  # a directory without tokenizer.json: not a conversion
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
