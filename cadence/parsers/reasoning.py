"""Reasoning in a model's text: `<think>...</think>` split from the answer.

Like the tool-call parsers, `extract` reads the whole text so far and answers the reasoning
and the answer as far as each can be shown: a possible start of a marker is held back until
the text says what it is, so what was shown is never taken back.

Two conventions (`--reasoning-parser`):
- deepseek-r1: the chat template opens the reasoning, so the answer starts inside it (an
  explicit `<think>` is skipped); everything before `</think>` is reasoning, and a text that
  never closes it is all reasoning;
- qwen3: reasoning only where the text starts with `<think>`; otherwise all of it is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str
    content: str
    is_reasoning_done: bool  # the reasoning ended (or there is none): what follows is content


def _held_back(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning

    def extract(self, text: str, is_final: bool) -> Split:
        lead = len(text) - len(text.lstrip())
        if not is_final and len(text) > lead and START.startswith(text[lead:]):
            return Split("", "", False)  # maybe the start of <think>: wait and see
        if text.startswith(START, lead):
            begin = lead + len(START)
        elif self.starts_in_reasoning:
            begin = 0
        else:
            return Split("", text, True)
        end = text.find(END, begin)
        if end < 0:
            keep = len(text) if is_final else len(text) - _held_back(text, END)
            return Split(text[begin:keep].lstrip(), "", is_final)
        return Split(text[begin:end].lstrip(), text[end + len(END) :].lstrip(), True)
