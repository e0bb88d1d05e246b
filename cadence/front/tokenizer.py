"""The front process's tokenizer: the model's Hugging Face tokenizer, made fast on the
hot path and kept off the event loop for large inputs.

Large inputs go to a small pool of worker threads of their own: the tokenizer's batch calls
release the GIL, so the event loop keeps serving meanwhile, and the pool's size bounds how
many large inputs are held in memory at once (the tokenizer takes ~100 bytes a character
while it works). What a large input freed is handed back to the system soon after
(`front.heap`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cadence.front.heap import HeapReleaser

# Texts longer than this are tokenized on a worker thread (the tokenizer's batch call
# releases the GIL), so a large prompt never stalls the event loop for other clients.
OFF_LOOP_TOKENIZE_CHARS = 16384
# Chats of more messages than this are rendered on a worker thread (~20 us a message).
OFF_LOOP_CHAT_MESSAGES = 256
# Inputs at least this large (characters, or ids) leave enough freed memory behind (tens
# of MiB) to be worth handing back to the system; smaller ones are reused by the next.
RELEASE_AFTER_SIZE = 1 << 18
# Large inputs worked on at once; each holds up to a few hundred MiB meanwhile.
MAX_LARGE_JOBS = 2

T = TypeVar("T")


class FrontTokenizer:
    """Wraps the model's tokenizer (`hf`, a transformers tokenizer with its chat template)."""

    def __init__(self, hf):
        self.hf = hf
        # A fast (Rust) tokenizer encodes through its `tokenizers` backend: the same ids
        # without the Python wrapping around it (several times the cost of the encoding
        # itself for a short prompt).
        self.backend = getattr(hf, "backend_tokenizer", None)
        if self.backend is not None and (self.backend.padding or self.backend.truncation):
            # A tokenizer.json may pad or cut every encoding (sentence-transformers' files
            # pad to 128): the server checks lengths itself and never pads. transformers'
            # own calls set both per call, so turning them off here changes nothing for it.
            self.backend.no_padding()
            self.backend.no_truncation()
        # Batches are encoded without character offsets where the library can (tokenizers
        # 0.20+): the same ids, in ~60% of the time and memory of a long text.
        self._encode_batch = (
            getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            if self.backend is not None
            else None
        )
        # No token is longer than the longest vocabulary entry (a byte-level or
        # sentencepiece key has at least one character per decoded character).
        vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
        self.max_token_chars = max((len(k) for k in vocab), default=64)
        self._texts: dict[int, str] = {}  # id -> decoded text, for logprobs with text
        self._pool = ThreadPoolExecutor(MAX_LARGE_JOBS, thread_name_prefix="cadence-tokenize")
        self.heap = HeapReleaser(self._pool)

    async def _off_loop(self, work: Callable[[], T], size: int) -> T:
        """`work()` on the tokenizer's worker threads; after a large one, what it and its
        request freed is handed back to the system."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            if size >= RELEASE_AFTER_SIZE:
                self.heap.note()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`, as `tokenizer.encode` gives them."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, on a worker thread for a long text (the event loop keeps serving)."""
        if len(text) <= OFF_LOOP_TOKENIZE_CHARS or self.backend is None:
            return self.encode(text, add_special_tokens)
        return (await self.encode_many_async([text], add_special_tokens))[0]

    async def encode_many_async(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """The token ids of each text, in one call into the tokenizer (on a worker thread
        when they are long together)."""
        encode_batch = self._encode_batch
        if encode_batch is None:  # a slow (Python) tokenizer: one call per text
            return [self.hf.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        size = sum(map(len, texts))

        def work() -> list[list[int]]:
            return [e.ids for e in encode_batch(texts, add_special_tokens=add_special_tokens)]

        if size <= OFF_LOOP_TOKENIZE_CHARS:
            return work()
        return await self._off_loop(work, size)

    async def encode_batch_async(
        self, texts: Sequence[str | tuple[str, str]]
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, token type ids) of each text, or of each (query, document) pair encoded as
        one sequence, with special tokens; one call into the tokenizer for all of them (on a
        worker thread when they are long)."""
        encode_batch = self._encode_batch
        if encode_batch is None:  # a slow (Python) tokenizer: one call per text
            out = []
            for text in texts:
                enc = self.hf(*text) if isinstance(text, tuple) else self.hf(text)
                ids = enc["input_ids"]
                out.append((ids, enc.get("token_type_ids") or [0] * len(ids)))
            return out
        size = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts)

        def work() -> list[tuple[list[int], list[int]]]:
            return [(e.ids, e.type_ids) for e in encode_batch(texts)]

        if size <= OFF_LOOP_TOKENIZE_CHARS:
            return work()
        return await self._off_loop(work, size)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, on a worker thread for a long list (as `encode_async`)."""
        return (await self.decode_many_async([ids], skip_special_tokens))[0]

    async def decode_many_async(
        self, id_lists: list[list[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """The text of each list of ids, on a worker thread when they are long together."""
        size = sum(map(len, id_lists))

        def one_by_one() -> list[str]:
            return [self.decode(ids, skip_special_tokens) for ids in id_lists]

        if size <= OFF_LOOP_TOKENIZE_CHARS:
            return one_by_one()
        if self.backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            # transformers cleans up spaces in Python: the thread gives the GIL back to the
            # loop every few milliseconds.
            return await self._off_loop(one_by_one, size)
        decode_batch = self.backend.decode_batch  # releases the GIL throughout
        return await self._off_loop(
            lambda: decode_batch(id_lists, skip_special_tokens=skip_special_tokens), size
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached: logprobs with text ask for the same ones again)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.hf.decode([token_id])
        return text

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.hf.apply_chat_template(messages, **kwargs)

    async def render_chat_async(self, messages: list[dict], **kwargs) -> str:
        """`apply_chat_template` (to text), on a worker thread for a long chat: the template
        engine runs Python, which gives the GIL back to the event loop every few ms."""
        size = sum(len(m.get("content") or "") for m in messages)
        if len(messages) <= OFF_LOOP_CHAT_MESSAGES and size <= OFF_LOOP_TOKENIZE_CHARS:
            return self.apply_chat_template(messages, tokenize=False, **kwargs)
        return await self._off_loop(
            lambda: self.apply_chat_template(messages, tokenize=False, **kwargs), size
        )
