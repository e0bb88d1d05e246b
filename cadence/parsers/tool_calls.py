"""Tool calls in a model's text: each format's parser, and the stream of OpenAI deltas.

A parser reads the whole text written so far (`extract(text, is_final)`) and answers the
plain text safe to show and the tool calls as far as they go: a call's name once written,
and the raw JSON text of its arguments, a prefix while the model still writes them. Raw
text, so that the argument fragments streamed one after the other add up to exactly the
arguments of the finished call, as OpenAI's streams do.

Formats:
- hermes (Qwen 2.5/3, Hermes, and Cadence's SmolLM2 tool template):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- llama3: `<|python_tag|>{"name": ..., "parameters": {...}}`, or the JSON object alone,
  several separated by `;`;
- json_array (tool_choice "required", grammar-enforced): `[{"name": ..., "parameters": ...}]`;
- named (a named tool_choice, grammar-enforced): the text is the arguments object itself.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from cadence.parsers.json_scan import loads_or_none, object_fields, skip_ws


@dataclass
class ToolCallDraft:
    """A tool call as far as the text shows it."""

    name: str | None  # None until the name is written in full
    arguments: str = ""  # raw JSON text of the arguments so far ("" before they start)
    is_complete: bool = False  # the call's JSON is closed


@dataclass
class Extraction:
    content: str  # plain text, safe to show (a possible start of a call held back)
    calls: list[ToolCallDraft] = field(default_factory=list)


@dataclass
class ToolCall:
    """A finished call, as it goes into `message.tool_calls`."""

    name: str
    arguments: str  # a JSON object as text
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def call_from_object(text: str, start: int) -> tuple[ToolCallDraft | None, int | None]:
    """The call whose JSON object starts at text[start], and the object's end (None while
    unfinished). None for something that is not an object."""
    fields, end = object_fields(text, start)
    if skip_ws(text, start) >= len(text) or text[skip_ws(text, start)] != "{":
        return None, None
    name = None
    if "name" in fields and fields["name"][1] is not None:
        value = loads_or_none(text[fields["name"][0] : fields["name"][1]])
        name = value if isinstance(value, str) else None
    args_key = "arguments" if "arguments" in fields else "parameters"
    arguments = ""
    if args_key in fields:
        a_start, a_end = fields[args_key]
        arguments = text[a_start:a_end] if a_end is not None else text[a_start:]
    elif end is not None:
        arguments = "{}"
    return ToolCallDraft(name, arguments, end is not None), end


class ToolCallParser(ABC):
    @abstractmethod
    def extract(self, text: str, is_final: bool) -> Extraction:
        """Content and calls of `text`; with `is_final`, nothing is held back."""


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str, is_final: bool) -> Extraction:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) if is_final else len(text) - _held_back(text, self.START)
            return Extraction(text[:keep])
        calls, i, tail_start = [], first, None
        while i >= 0:
            draft, end = call_from_object(text, i + len(self.START))
            if draft is not None:
                calls.append(draft)
            if end is None:
                break
            close = text.find(self.END, end)
            after = close + len(self.END) if close >= 0 else end
            i = text.find(self.START, after)
            if i < 0:
                tail_start = after
        content = text[:first]
        if is_final and tail_start is not None and text[tail_start:].strip():
            content += text[tail_start:]
        return Extraction(content, calls)


class Llama3Parser(ToolCallParser):
    TAG = "<|python_tag|>"

    def extract(self, text: str, is_final: bool) -> Extraction:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start += len(self.TAG)
        elif not text.startswith("{", start):
            if not is_final and start < len(text) and self.TAG.startswith(text[start:]):
                return Extraction("")
            return Extraction(text)
        calls, i = [], start
        while True:
            draft, end = call_from_object(text, i)
            if draft is None:
                break
            calls.append(draft)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i += 1
            elif i >= len(text):
                break
            else:
                break
        if not calls and is_final:
            return Extraction(text)
        return Extraction("", calls)


class JsonArrayParser(ToolCallParser):
    """tool_choice "required": a JSON array of {"name", "parameters"} (grammar-enforced)."""

    def extract(self, text: str, is_final: bool) -> Extraction:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Extraction(text if is_final else "")
        calls, i = [], i + 1
        while True:
            i = skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            draft, end = call_from_object(text, i)
            if draft is None:
                break
            calls.append(draft)
            if end is None:
                break
            i = end
        return Extraction("", calls)


class NamedParser(ToolCallParser):
    """A named tool_choice: the text is the arguments of that one function."""

    def __init__(self, name: str):
        self.name = name

    def extract(self, text: str, is_final: bool) -> Extraction:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Extraction("", [ToolCallDraft(self.name)])
        _, end = object_fields(text, start)
        return Extraction("", [ToolCallDraft(self.name, text[start:end], end is not None)])


def finished_calls(extraction: Extraction) -> list[ToolCall]:
    """The calls of a finished text whose name and arguments are valid JSON."""
    calls = []
    for draft in extraction.calls:
        if not draft.is_complete or not draft.name:
            continue
        args = loads_or_none(draft.arguments)
        if not isinstance(args, dict):
            continue
        calls.append(ToolCall(draft.name, json.dumps(args, ensure_ascii=False)))
    return calls


class ToolCallStream:
    """The OpenAI deltas of one streamed choice: feed the whole text so far each time.

    A call is announced (index, id, type, name, empty arguments) once its name is written,
    then its arguments follow as text fragments. With `max_calls`, later calls are dropped.
    """

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.num_content = 0  # characters of content sent
        self.sent: list[int] = []  # per announced call: characters of arguments sent
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.sent)

    def update(self, text: str, is_final: bool) -> tuple[str, list[dict]]:
        """(new content, new tool-call deltas) since the last update."""
        found = self.parser.extract(text, is_final)
        content = found.content[self.num_content :]
        self.num_content = max(self.num_content, len(found.content))
        deltas = []
        calls = found.calls if self.max_calls is None else found.calls[: self.max_calls]
        for index, draft in enumerate(calls):
            if index == len(self.sent):
                if draft.name is None:
                    break
                self.ids.append(new_call_id())
                self.sent.append(0)
                deltas.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": draft.name, "arguments": ""},
                    }
                )
            args = draft.arguments
            if len(args) > self.sent[index]:
                deltas.append({"index": index, "function": {"arguments": args[self.sent[index] :]}})
                self.sent[index] = len(args)
        return content, deltas
