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
import threading
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
    return _load_from_dir(tokenizer_dir(path, tokenizer_path))


def _load_from_dir(directory: str):
    generic = _generic_class(directory)
    if generic is not None:
        return generic.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


class TokenDecoder:
    """A tokenizer's `decode` alone, from its tokenizer.json through the `tokenizers` library:
    what a process that only turns ids into text (the detokenizer) needs, without importing
    transformers (~1.3 s of CPU at each start). Made only for a directory whose tokenizer is
    transformers' generic fast one and needs no clean-up of spaces, where transformers'
    decode is exactly the `tokenizers` decode (see `load_decoder`)."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class LightTokenizer(TokenDecoder):
    """What the scheduler asks of the model's tokenizer (`decode`, `encode`, the EOS and BOS
    ids) through `tokenizers` alone, so that its process does not import transformers (~1 s
    of CPU at each start). Used only where that is exact (`is_exact`). A grammar engine
    needs transformers' tokenizer: `transformers_tokenizer()` loads it at the first call
    (on the grammar queue's thread, at the first constrained request, whose engine imports
    transformers anyway)."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.directory = directory
        self._config = _tokenizer_config(directory)
        self.eos_token_id = self._special_id("eos_token")
        self.bos_token_id = self._special_id("bos_token")
        self._whole = None
        self._lock = threading.Lock()

    def _special_id(self, key: str) -> int | None:
        token = _special_token(self._config, key)
        return None if token is None else self._tokenizer.token_to_id(token)

    def is_exact(self) -> bool:
        """Whether it answers as transformers' tokenizer would, given that it decodes alone
        (`decodes_alone`): its config names its special tokens itself and they are in the
        vocabulary, it asks for no BOS/EOS insertion (add_bos_token / add_eos_token:
        transformers would rewrite the post-processor) and there is no separate
        special-tokens map."""
        if os.path.exists(os.path.join(self.directory, "special_tokens_map.json")):
            return False
        if "add_bos_token" in self._config or "add_eos_token" in self._config:
            return False
        return all(
            self._special_id(key) is not None
            for key in ("eos_token", "bos_token")
            if self._config.get(key) is not None
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def transformers_tokenizer(self):
        with self._lock:
            if self._whole is None:
                self._whole = _load_from_dir(self.directory)
            return self._whole


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def is_light_exact(directory: str) -> bool:
    """Whether a `LightTokenizer` of `directory` answers as transformers' tokenizer would."""
    return decodes_alone(directory) and LightTokenizer(directory).is_exact()


def load_scheduler_tokenizer(path: str, tokenizer_path: str | None = None):
    """The tokenizer the scheduler holds: a `LightTokenizer` where that is exact, else the
    whole transformers one."""
    directory = tokenizer_dir(path, tokenizer_path)
    if decodes_alone(directory):
        light = LightTokenizer(directory)
        if light.is_exact():
            return light
    return _load_from_dir(directory)


def load_decoder(path: str, tokenizer_path: str | None = None):
    """Something with the model's tokenizer's `decode(ids, skip_special_tokens=...)`: a
    `TokenDecoder` where that is exact, else the whole tokenizer (`load_tokenizer`)."""
    directory = tokenizer_dir(path, tokenizer_path)
    if decodes_alone(directory):
        return TokenDecoder(directory)
    return load_tokenizer(path, tokenizer_path)


def decodes_alone(directory: str) -> bool:
    """Whether `tokenizers` alone decodes the tokenizer in `directory` exactly as transformers
    would: its class is the generic fast tokenizer and its decode needs no clean-up."""
    config = _tokenizer_config(directory)
    return _is_generic(directory, config) and not _cleans_up_spaces(directory, config)


def _tokenizer_config(directory: str) -> dict:
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _cleans_up_spaces(directory: str, config: dict) -> bool:
    """Whether transformers' decode would rewrite the text after `tokenizers` (its clean-up
    of spaces before punctuation, which it skips for BPE models)."""
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    try:
        with open(os.path.join(directory, "tokenizer.json")) as f:
            model = json.load(f).get("model", {})
    except (OSError, ValueError, AttributeError):
        return True
    return not (isinstance(model, dict) and model.get("type") == "BPE")


def _generic_class(directory: str):
    """transformers' generic fast tokenizer class when `directory` names it (as every GGUF
    conversion does), which is the class AutoTokenizer would pick; None otherwise.

    AutoTokenizer's module imports torch (2-3 s of CPU in each process that only needs the
    tokenizer: the detokenizer, the front); the class itself does not."""
    if not _is_generic(directory, _tokenizer_config(directory)):
        return None
    import transformers

    return getattr(transformers, GENERIC_TOKENIZER, None)


def _is_generic(directory: str, config: dict) -> bool:
    return config.get("tokenizer_class") == GENERIC_TOKENIZER and os.path.isfile(
        os.path.join(directory, "tokenizer.json")
    )


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
    return cached_conversion(
        "tokenizers", "the GGUF tokenizer", path, "tokenizer.json", _convert_tokenizer
    )


def cached_conversion(kind: str, what: str, path: str, marker: str, convert) -> str:
    """The directory `convert(path, directory)` fills for this version of the file `path`,
    under the cache's `kind` folder (`what` names it in the log): made once, by one process holding a lock beside it
    while others wait; it counts as made once it holds the file `marker`. `convert` writes
    into a temporary directory, renamed into place when it returns."""
    target = os.path.join(envs.cache_dir(), kind, file_key(path))
    if os.path.exists(os.path.join(target, marker)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _locked(target + ".lock"):
        if os.path.exists(os.path.join(target, marker)):  # made while we waited
            return target
        logger.info("Converting %s of %s (once; cached in %s)", what, path, target)
        tmp = tempfile.mkdtemp(
            prefix=os.path.basename(target) + ".tmp", dir=os.path.dirname(target)
        )
        try:
            convert(path, tmp)
            if os.path.exists(target):  # a directory without its marker: not a conversion
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return target


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    """An exclusive lock between processes (released by the kernel if the holder dies). The
    lock file stays: removing it would let a late process lock a file nobody else sees."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_tokenizer(path: str, directory: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    tokenizer.save_pretrained(directory)
