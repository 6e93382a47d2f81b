"""The call formats of Gemma 4, MiniMax-M2, Hunyuan and LFM2 (see :class:`engine.server.call_syntax.ToolFormat`):
each reads the calls its family's published chat template writes for an assistant turn's
``tool_calls``, and the calls its model writes.
"""

from __future__ import annotations

import ast
import json
import re

from .call_syntax import Call, ToolFormat, _json_object, _param_types, _typed_value


class _Gemma4Reader:
    """Gemma 4's argument syntax: ``{key:value,...}`` with bare keys (or keys between ``<|"|>``),
    strings between ``<|"|>`` markers (no escapes inside), ``[...]`` lists, numbers, ``true`` /
    ``false`` and ``null`` (the template writes a Python ``None`` as ``None``). Raises ValueError
    on anything else."""

    Q = '<|"|>'

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def _take(self, lit: str) -> bool:
        if self.s.startswith(lit, self.i):
            self.i += len(lit)
            return True
        return False

    def _string(self) -> str:
        j = self.s.find(self.Q, self.i)
        if j < 0:
            raise ValueError("an unclosed string")
        out, self.i = self.s[self.i:j], j + len(self.Q)
        return out

    def value(self):
        self._ws()
        if self._take(self.Q):
            return self._string()
        if self._take("{"):
            return self.mapping()
        if self._take("["):
            items = []
            self._ws()
            if self._take("]"):
                return items
            while True:
                items.append(self.value())
                self._ws()
                if self._take("]"):
                    return items
                if not self._take(","):
                    raise ValueError("a list item not followed by ',' or ']'")
        m = re.compile(r"[^,}\]]+").match(self.s, self.i)
        if m is None:
            raise ValueError("a missing value")
        self.i = m.end()
        word = m.group(0).strip()
        if word in ("null", "None"):
            return None
        v = json.loads(word)   # numbers, true, false; anything else is not this syntax
        if isinstance(v, (dict, list, str)):
            raise ValueError(f"an unexpected value {word!r}")
        return v

    def mapping(self) -> dict:
        """The members after an opening ``{`` up to its ``}``."""
        out: dict = {}
        self._ws()
        if self._take("}"):
            return out
        while True:
            self._ws()
            if self._take(self.Q):
                key = self._string()
            else:
                j = self.s.find(":", self.i)
                if j < 0:
                    raise ValueError("a key without ':'")
                key = self.s[self.i:j].strip()
                if not key or any(c in key for c in "{}[],"):
                    raise ValueError(f"a malformed key {key!r}")
                self.i = j
            self._ws()
            if not self._take(":"):
                raise ValueError("a key not followed by ':'")
            out[key] = self.value()
            self._ws()
            if self._take("}"):
                return out
            if not self._take(","):
                raise ValueError("a member not followed by ',' or '}'")


class Gemma4Format(ToolFormat):
    """Gemma 4: ``<|tool_call>call:N{key:value,...}<tool_call|>`` per call (values as
    :class:`_Gemma4Reader` reads them); a ``<|tool_response>`` the model writes after its calls
    (where the template waits for the results) is not content."""

    name, starts = "gemma4", ("<|tool_call>",)
    CALL, END, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"

    def parse(self, text, tools):
        got = self._blocks(text, self.CALL, self.END)
        if got is None:
            return None
        calls = []
        for body in got[0]:
            m = re.match(r"call:([^{\s]+)\{", body)
            if m is None:
                return None
            r = _Gemma4Reader(body)
            r.i = m.end()
            try:
                args = r.mapping()
            except (ValueError, RecursionError):
                return None
            if body[r.i:].strip():
                return None
            calls.append(Call(m.group(1), args))
        rest = got[1]
        rest = rest[:-len(self.RESPONSE)].rstrip() if rest.endswith(self.RESPONSE) else rest
        return calls, rest


class MiniMaxFormat(ToolFormat):
    """MiniMax-M2: ``<minimax:tool_call>`` around ``<invoke name="N"><parameter name="K">V</parameter>...</invoke>``;
    a value is text for a string parameter, else JSON when it parses (the template writes strings
    as they are and other values with tojson)."""

    name = "minimax_m2"
    BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
    starts = (BEGIN,)
    _invoke = re.compile(r'<invoke name="([^"]+)">(.*?)(?:</invoke>|$)', re.S)
    _param = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)

    def parse(self, text, tools):
        got = self._blocks(text, self.BEGIN, self.END)
        if got is None:
            return None
        calls = []
        for body in got[0]:
            pos = 0
            for m in self._invoke.finditer(body):
                if body[pos:m.start()].strip():
                    return None
                pos = m.end()
                name, inner = m.group(1).strip(), m.group(2)
                types = _param_types(tools, name)
                args = {p.group(1): _typed_value(p.group(2), types.get(p.group(1))) for p in self._param.finditer(inner)}
                if self._param.sub("", inner).strip():
                    return None
                calls.append(Call(name, args))
            if body[pos:].strip():
                return None
        return (calls, got[1]) if calls else None


class HunyuanFormat(ToolFormat):
    """Hunyuan-A13B: ``<tool_calls>[{"name": N, "arguments": {...}}, ...]</tool_calls>``."""

    name, starts = "hunyuan", ("<tool_calls>",)

    def parse(self, text, tools):
        got = self._blocks(text, "<tool_calls>", "</tool_calls>")
        if got is None:
            return None
        calls = []
        for body in got[0]:
            try:
                arr = json.loads(body.strip())
            except (ValueError, RecursionError):
                return None
            if not isinstance(arr, list) or not arr:
                return None
            for c in arr:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                    return None
                args = c.get("arguments", {})
                args = _json_object(args) if isinstance(args, str) else args
                if not isinstance(args, dict):
                    return None
                calls.append(Call(c["name"], args))
        return calls, got[1]


class PythonicFormat(ToolFormat):
    """LFM2: ``<|tool_call_start|>[N(key=value, ...), ...]<|tool_call_end|>``, Python call syntax
    whose values are literals (read with ``ast.literal_eval``: nothing is evaluated)."""

    name = "pythonic"
    BEGIN, END = "<|tool_call_start|>", "<|tool_call_end|>"
    starts = (BEGIN,)

    def parse(self, text, tools):
        got = self._blocks(text, self.BEGIN, self.END)
        if got is None:
            return None
        calls = []
        for body in got[0]:
            try:
                tree = ast.parse(body.strip(), mode="eval").body
            except (SyntaxError, ValueError, RecursionError):
                return None
            items = tree.elts if isinstance(tree, ast.List) else [tree]
            for c in items:
                if not isinstance(c, ast.Call) or c.args or not isinstance(c.func, (ast.Name, ast.Attribute)):
                    return None
                try:
                    args = {k.arg: ast.literal_eval(k.value) for k in c.keywords if k.arg is not None}
                except (ValueError, TypeError, SyntaxError, RecursionError):
                    return None
                if len(args) != len(c.keywords):
                    return None
                calls.append(Call(ast.unparse(c.func), args))
        return (calls, got[1]) if calls else None
