"""The front's tokenizer encodes through the Rust backend; the ids must be the wrapper's."""

from __future__ import annotations

TEXTS = [
    "Hello world",
    "",
    "  leading and trailing spaces  ",
    "naïve café, 東京, emoji 🚀!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "line\n\nbreaks\tand\ttabs",
    "x" * 300,
]


def test_backend_encode_matches_the_tokenizer(engine):
    tok = engine.client.tokenizer
    assert tok.backend is not None  # the default model has a fast tokenizer: the fast path runs
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == engine.tokenizer.encode(
                text, add_special_tokens=special
            ), (text, special)
