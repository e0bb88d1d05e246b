"""OpenAI tool calling on the request side: checking `tools`, `tool_choice` and
`parallel_tool_calls`, and planning how a chat request calls tools.

A plan says what the chat template sees (the tools, unless tool_choice is "none"), which
constraint the grammar engine enforces (tool_choice "required" or a named function: the model
cannot answer anything else) and how the answer is read back (a `ToolCallParser`). With
"auto", the answer is read with the server's --tool-call-parser; without one, it is text.

Pure functions, no I/O; every user error is an `InvalidParameter` naming the OpenAI field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cadence.errors import InvalidParameter
from cadence.parsers import tool_call_parser
from cadence.parsers.tool_calls import JsonArrayParser, NamedParser, ToolCallParser
from cadence.serving.errors import loads_bounded

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    template_tools: list[dict] | None  # the `tools` the chat template gets
    constraint: dict | None  # a JSON schema the answer must follow, or None
    parser: ToolCallParser | None  # reads tool calls from the answer; None: the answer is text
    max_calls: int | None  # 1 when parallel_tool_calls is false


def check_tools(tools: list | None, tool_choice: Any, parallel: Any) -> None:
    """The tool fields of a chat request; raises InvalidParameter naming the one at fault."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", "parallel_tool_calls must be true or false")
    names = [_check_tool(i, tool) for i, tool in enumerate(tools or [])]
    if len(names) > MAX_TOOLS:
        raise InvalidParameter("tools", f"tools has {len(names)} entries; at most {MAX_TOOLS}")
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tools: two functions have the same name")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise InvalidParameter("tool_choice", 'tool_choice "required" needs tools')
        return
    name = named_choice(tool_choice)
    if name not in names:
        raise InvalidParameter(
            "tool_choice", f"tool_choice names the function {name!r}, which is not in tools"
        )


def named_choice(tool_choice: Any) -> str:
    """The function name of a named tool_choice ({"type": "function", "function": {"name"}})."""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise InvalidParameter(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    return name


def _check_tool(i: int, tool: Any) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidParameter(
            "tools", f'tools[{i}].type must be "function" (the only kind served), got {kind!r}'
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidParameter("tools", f"tools[{i}].function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidParameter(
            "tools",
            f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidParameter("tools", f"tools[{i}].function.parameters must be a JSON schema")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise InvalidParameter("tools", f"tools[{i}].function.description must be a string")
    return name


def plan(
    tools: list | None, tool_choice: Any, parallel: bool | None, parser_name: str | None
) -> ToolPlan:
    """How a checked request calls tools (see the module docstring)."""
    if not tools or tool_choice == "none":
        return ToolPlan(None, None, None, None)
    max_calls = 1 if parallel is False else None
    if tool_choice == "required":
        return ToolPlan(tools, required_schema(tools, max_calls), JsonArrayParser(), max_calls)
    if isinstance(tool_choice, dict):
        name = named_choice(tool_choice)
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return ToolPlan(tools, _parameters(function), NamedParser(name), 1)
    parser = tool_call_parser(parser_name) if parser_name else None
    return ToolPlan(tools, None, parser, max_calls)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict], max_calls: int | None) -> dict:
    """tool_choice "required": an array of at least one call of the given functions."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t["function"]),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as chat templates expect them: `arguments` as an object (OpenAI
    sends JSON text). Raises InvalidParameter for a malformed `tool_calls`."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            out.append(message)
            continue
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise InvalidParameter(
                "messages", f"messages[{i}].tool_calls must be a list, on an assistant message"
            )
        out.append(
            {**message, "tool_calls": [_template_call(i, j, c) for j, c in enumerate(calls)]}
        )
    return out


def _template_call(i: int, j: int, call: Any) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameter(
            "messages", f"messages[{i}].tool_calls[{j}] must have function.name and arguments"
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        label = f"messages[{i}].tool_calls[{j}].function.arguments"
        try:
            arguments = loads_bounded(arguments, label) if arguments.strip() else {}
        except InvalidParameter as e:
            raise InvalidParameter("messages", str(e)) from None
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}
