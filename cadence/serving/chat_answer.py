"""A chat choice's text as OpenAI's assistant message: reasoning split off
(`reasoning_content`), tool calls read out (`tool_calls`, finish_reason "tool_calls"), the
rest as `content`; whole (`message`) or as stream deltas (`ChatAnswerStream`).

The stream re-reads the whole text of its choice at every delta and sends what grew since
the last one; the parsers hold back a possible start of a marker, so nothing sent is ever
taken back and the deltas add up to the whole answer.
"""

from __future__ import annotations

from typing import Any

from cadence.parsers.reasoning import ReasoningParser
from cadence.parsers.tool_calls import ToolCallParser, ToolCallStream, finished_calls
from cadence.serving.chat_tools import ToolPlan


class ChatAnswer:
    """How one chat request's answers are read: its tool plan and reasoning parser."""

    def __init__(
        self,
        plan: ToolPlan,
        reasoning: ReasoningParser | None = None,
        stream_reasoning: bool = True,
        is_constrained: bool = False,
    ):
        self.parser: ToolCallParser | None = plan.parser
        self.max_calls = plan.max_calls
        # The grammar of a constrained answer starts at its first token: a forced tool call is
        # JSON alone, and other constraints hold reasoning only if they spell out <think>.
        if plan.constraint is not None or (
            is_constrained and reasoning is not None and reasoning.starts_in_reasoning
        ):
            reasoning = None
        self.reasoning = reasoning
        self.stream_reasoning = stream_reasoning

    @property
    def is_plain(self) -> bool:
        """Text goes to `content` unchanged."""
        return self.parser is None and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish_reason) of a finished choice."""
        reasoning = None
        content: str | None = text
        if self.reasoning is not None:
            split = self.reasoning.extract(text, is_final=True)
            reasoning, content = split.reasoning.rstrip() or None, split.content
        calls = []
        if self.parser is not None:
            found = self.parser.extract(content, is_final=True)
            calls = finished_calls(found)[: self.max_calls]
            if calls:
                content = found.content.strip() or None
        message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [c.to_openai() for c in calls] or None,
            "refusal": None,
        }
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self) -> ChatAnswerStream:
        return ChatAnswerStream(self)


class ChatAnswerStream:
    """One streamed choice: `update(delta_text, is_final)` gives the delta's fields."""

    def __init__(self, answer: ChatAnswer):
        self.answer = answer
        self.text = ""
        self.num_reasoning = 0  # characters of reasoning sent
        self.tools = (
            ToolCallStream(answer.parser, answer.max_calls) if answer.parser is not None else None
        )
        self.num_content = 0  # characters of content sent (without a tool parser)

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def update(self, delta: str, is_final: bool) -> dict[str, Any]:
        """The new `content`, `reasoning_content` and `tool_calls` (only those with news)."""
        if self.answer.is_plain:
            return {"content": delta} if delta else {}
        self.text += delta
        fields: dict[str, Any] = {}
        content = self.text
        if self.answer.reasoning is not None:
            split = self.answer.reasoning.extract(self.text, is_final)
            content = split.content
            if self.answer.stream_reasoning or split.is_reasoning_done:
                new = split.reasoning[self.num_reasoning :]
                if new:
                    fields["reasoning_content"] = new
                    self.num_reasoning = len(split.reasoning)
        if self.tools is not None:
            new_content, calls = self.tools.update(content, is_final)
            if calls:
                fields["tool_calls"] = calls
        else:
            new_content = content[self.num_content :]
            self.num_content = len(content)
        if new_content:
            fields["content"] = new_content
        return fields
