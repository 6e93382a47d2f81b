"""Function calling on the server: the request's ``tools`` / ``tool_choice`` checked, assistant
``tool_calls`` given back to the chat template, and the calls a model writes parsed out of its
answer.

Checks raise :class:`ToolsError` (the API turns it into a 400 naming the parameter).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class ToolsError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` / ``tool_calls``; ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> list[dict] | None:
    """The request's ``tools``: a list of ``{"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: JSON-schema object, "strict"?: bool}}`` -> the list (None
    when absent). Raises ToolsError."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ToolsError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ToolsError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"parameters\": {{...}}}}}}", where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ToolsError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if name in names:
            raise ToolsError(f"{where}: the function name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], (str, type(None))):
            raise ToolsError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolsError(f"{where}.function.parameters must be a JSON schema object",
                             f"{where}.function.parameters")
        if "strict" in fn and not isinstance(fn["strict"], (bool, type(None))):
            raise ToolsError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: mode "auto" (the model may call), "none" (no tools in the prompt, no
    parsing), "required" (a call of one offered tool is forced) or "function" (a call of
    ``name`` is forced)."""

    mode: str = "auto"
    name: str | None = None


def check_tool_choice(value: Any, tools: list[dict] | None) -> ToolChoice:
    """Raises ToolsError for a value the API does not define, or a function not offered."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ToolsError(f"'tool_choice' = {value!r}: must be \"auto\", \"none\", \"required\" or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
        if value == "required" and not tools:
            raise ToolsError("'tool_choice' is \"required\" but the request offers no 'tools'", "tool_choice")
        return ToolChoice(value if tools else "none")
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise ToolsError(f"'tool_choice' names the function {name!r}, which is not among the 'tools'",
                             "tool_choice")
        return ToolChoice("function", name)
    raise ToolsError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}", "tool_choice")


def check_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` -> a list of ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` with ``arguments`` as the client sent it (a JSON string
    or an object). Raises ToolsError."""
    if not isinstance(calls, list):
        raise ToolsError(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise ToolsError(f"{w} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}", w)
        fn = c["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolsError(f"{w}.function.name must be a non-empty string", f"{w}.function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise ToolsError(f"{w}.function.arguments must be a JSON string (or an object)", f"{w}.function.arguments")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise ToolsError(f"{w}.id must be a string", f"{w}.id")
        out.append({**({"id": c["id"]} if c.get("id") else {}), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def arguments_as(calls: list[dict], as_object: bool) -> list[dict]:
    """``calls`` with every ``arguments`` a dict (``as_object``; a string that is not a JSON
    object is kept) or a JSON string (an object is dumped as ``json.dumps`` writes it)."""
    out = []
    for c in calls:
        a = c["function"]["arguments"]
        if as_object and isinstance(a, str):
            try:
                parsed = json.loads(a)
            except ValueError:
                parsed = None
            a = parsed if isinstance(parsed, dict) else a
        elif not as_object and not isinstance(a, str):
            a = json.dumps(a, ensure_ascii=False)
        out.append({**c, "function": {**c["function"], "arguments": a}})
    return out
