"""The front process's tokenizer: the model's Hugging Face tokenizer, made fast on the
hot path and kept off the event loop for large inputs."""

from __future__ import annotations

import asyncio

# Texts longer than this are tokenized on a worker thread (the tokenizer's batch call
# releases the GIL), so a large prompt never stalls the event loop for other clients.
OFF_LOOP_TOKENIZE_CHARS = 16384


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
        # No token is longer than the longest vocabulary entry (a byte-level or
        # sentencepiece key has at least one character per decoded character).
        vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
        self.max_token_chars = max((len(k) for k in vocab), default=64)
        self._texts: dict[int, str] = {}  # id -> decoded text, for logprobs with text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`, as `tokenizer.encode` gives them."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, on a worker thread for a long text (the event loop keeps serving)."""
        if len(text) <= OFF_LOOP_TOKENIZE_CHARS or self.backend is None:
            return self.encode(text, add_special_tokens)
        encode_batch = self.backend.encode_batch
        loop = asyncio.get_running_loop()
        encodings = await loop.run_in_executor(
            None, lambda: encode_batch([text], add_special_tokens=add_special_tokens)
        )
        return encodings[0].ids

    async def encode_batch_async(
        self, texts: list[str] | list[tuple[str, str]]
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, token type ids) of each text, or of each (query, document) pair encoded as
        one sequence, with special tokens; one call into the tokenizer for all of them (on a
        worker thread when they are long)."""
        if self.backend is None:  # a slow (Python) tokenizer: one call per text
            out = []
            for text in texts:
                enc = self.hf(*text) if isinstance(text, tuple) else self.hf(text)
                ids = enc["input_ids"]
                out.append((ids, enc.get("token_type_ids") or [0] * len(ids)))
            return out
        encode_batch = self.backend.encode_batch
        if sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts) <= (
            OFF_LOOP_TOKENIZE_CHARS
        ):
            encodings = encode_batch(texts)
        else:
            loop = asyncio.get_running_loop()
            encodings = await loop.run_in_executor(None, encode_batch, texts)
        return [(e.ids, e.type_ids) for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, on a worker thread for a long list (as `encode_async`)."""
        if (
            len(ids) <= OFF_LOOP_TOKENIZE_CHARS
            or self.backend is None
            or getattr(self.hf, "clean_up_tokenization_spaces", False)
        ):
            return self.decode(ids, skip_special_tokens)
        decode_batch = self.backend.decode_batch
        loop = asyncio.get_running_loop()
        texts = await loop.run_in_executor(
            None, lambda: decode_batch([ids], skip_special_tokens=skip_special_tokens)
        )
        return texts[0]

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached: logprobs with text ask for the same ones again)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.hf.decode([token_id])
        return text

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.hf.apply_chat_template(messages, **kwargs)
