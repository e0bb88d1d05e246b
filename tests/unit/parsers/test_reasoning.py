"""The <think> splitter: both conventions, whole and streamed, never taking back what it
showed."""

from __future__ import annotations

import pytest

from cadence.parsers import reasoning_parser


@pytest.mark.parametrize(
    "name, text, reasoning, content",
    [
        ("qwen3", "<think>\nI should greet.\n</think>\n\nHello!", "I should greet.\n", "Hello!"),
        ("qwen3", "Hello!", "", "Hello!"),
        ("qwen3", "<think>never closed", "never closed", ""),
        ("deepseek-r1", "I should greet.</think>Hello!", "I should greet.", "Hello!"),
        ("deepseek-r1", "<think>x</think>y", "x", "y"),
        ("deepseek-r1", "all reasoning", "all reasoning", ""),
    ],
)
def test_whole_and_streamed_splits_agree(name, text, reasoning, content):
    parser = reasoning_parser(name)
    split = parser.extract(text, is_final=True)
    assert (split.reasoning, split.content) == (reasoning, content)
    shown_r = shown_c = ""
    for end in range(1, len(text) + 1):
        part = parser.extract(text[:end], end == len(text))
        assert part.reasoning.startswith(shown_r) and part.content.startswith(shown_c)
        shown_r, shown_c = part.reasoning, part.content
    assert (shown_r, shown_c) == (reasoning, content)
