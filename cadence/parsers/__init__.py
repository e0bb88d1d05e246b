"""Parsers of a model's text: tool calls (`--tool-call-parser`) and reasoning
(`--reasoning-parser`), by name. Pure text work, no engine, nothing heavy: the server's
arguments check the names against this module."""

from __future__ import annotations

from cadence.parsers.reasoning import ReasoningParser
from cadence.parsers.tool_calls import HermesParser, Llama3Parser, ToolCallParser

# name -> the parser class; aliases name the model families that write the same format
_TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
}
TOOL_CALL_PARSERS = tuple(_TOOL_CALL_PARSERS)
# name -> whether the model's answer starts inside its reasoning
_REASONING_PARSERS = {"deepseek-r1": True, "qwen3": False}
REASONING_PARSERS = tuple(_REASONING_PARSERS)


def tool_call_parser(name: str) -> ToolCallParser:
    if name not in _TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    return _TOOL_CALL_PARSERS[name]()


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in _REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_PARSERS)}"
        )
    return ReasoningParser(_REASONING_PARSERS[name])
