"""Function calling on the server: the request's ``tools`` / ``tool_choice`` checked, assistant
``tool_calls`` given back to the chat template, and the calls a model writes parsed out of its
answer.

Checks raise :class:`ToolsError` (the API turns it into a 400 naming the parameter).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .call_formats import Gemma4Format, HunyuanFormat, MiniMaxFormat, PythonicFormat
from .call_syntax import Call, ToolFormat, _json_object, _param_types, _typed_value  # noqa: F401 - names callers use


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
            raise ToolsError("'tool_choice' \"required\" asks for a function call, but the request has no 'tools': "
                             "list the functions the model may call in 'tools', or leave 'tool_choice' out for a "
                             "plain answer", "tool_choice")
        return ToolChoice(value if tools else "none")
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        offered = [t["function"]["name"] for t in tools or ()]
        if name not in offered:
            among = (f"which is not among the 'tools' ({', '.join(map(repr, offered))}): name one of them or add "
                     f"it to 'tools'" if offered else "but the request has no 'tools': list the function in 'tools'")
            raise ToolsError(f"'tool_choice' names the function {name!r}, {among}", "tool_choice")
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


# --- the calls a model writes ---------------------------------------------------------------------


class HermesFormat(ToolFormat):
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``."""

    name, starts = "hermes", ("<tool_call>",)

    def parse(self, text, tools):
        got = self._blocks(text, "<tool_call>", "</tool_call>")
        if got is None:
            return None
        calls = []
        for body in got[0]:
            obj = _json_object(body.strip())
            if obj is None or not isinstance(obj.get("name"), str):
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = _json_object(args)
            if not isinstance(args, dict):
                return None
            calls.append(Call(obj["name"], args))
        return calls, got[1]


class QwenCoderFormat(ToolFormat):
    """Qwen3-Coder: ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n</tool_call>``."""

    name, starts = "qwen3_coder", ("<tool_call>", "<function=")
    _fn = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def parse(self, text, tools):
        body = text.replace("<tool_call>", "").replace("</tool_call>", "")
        calls, pos, rest = [], 0, []
        for m in self._fn.finditer(body):
            rest.append(body[pos:m.start()])
            pos = m.end()
            name = m.group(1).strip()
            types = _param_types(tools, name)
            args = {}
            for p in self._param.finditer(m.group(2)):
                raw = p.group(2)
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                args[p.group(1).strip()] = _typed_value(raw, types.get(p.group(1).strip()))
            calls.append(Call(name, args))
        rest.append(body[pos:])
        return (calls, "".join(rest).strip()) if calls else None


class GlmFormat(ToolFormat):
    """GLM-4.5 / 4.6: ``<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``
    (string values as they are, others as JSON)."""

    name, starts = "glm45", ("<tool_call>",)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, text, tools):
        got = self._blocks(text, "<tool_call>", "</tool_call>")
        if got is None:
            return None
        calls = []
        for body in got[0]:
            head, _, tail = body.partition("<arg_key>")
            name = head.strip()
            if not name or "\n" in name or "<" in name:
                return None
            types = _param_types(tools, name)
            tail = "<arg_key>" + tail if tail else ""
            args = {k.strip(): _typed_value(v, types.get(k.strip())) for k, v in self._pair.findall(tail)}
            if self._pair.sub("", tail).strip():
                return None
            calls.append(Call(name, args))
        return calls, got[1]


class DeepSeekFormat(ToolFormat):
    """DeepSeek-V3 / R1 (``<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``)
    and V3.1 (``<｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``), inside
    ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``."""

    name = "deepseek"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    starts = (BEGIN, CALL)

    def parse(self, text, tools):
        text = text.replace(self.BEGIN, "").replace(self.END, "")
        got = self._blocks(text, self.CALL, self.CALL_END)
        if got is None:
            return None
        calls = []
        for body in got[0]:
            left, sep, right = body.partition(self.SEP)
            if not sep:
                return None
            if left.strip() == "function" and "\n" in right:   # V3 / R1
                name, _, rest = right.partition("\n")
                rest = rest.strip()
                if rest.startswith("```"):
                    rest = rest[3:].removeprefix("json").strip()
                    rest = rest[:-3] if rest.endswith("```") else rest
                args = _json_object(rest.strip())
            else:                                                 # V3.1
                name, args = left, _json_object(right.strip())
            if args is None or not name.strip():
                return None
            calls.append(Call(name.strip(), args))
        return calls, got[1]


class KimiFormat(ToolFormat):
    """Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>...``."""

    name = "kimi_k2"
    starts = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")

    def parse(self, text, tools):
        for s in self.starts:
            text = text.replace(s, "")
        text = text.replace("<|tool_calls_section_end|>", "").replace("<|tool_call_section_end|>", "")
        got = self._blocks(text, "<|tool_call_begin|>", "<|tool_call_end|>")
        if got is None:
            return None
        calls = []
        for body in got[0]:
            ident, sep, args = body.partition("<|tool_call_argument_begin|>")
            name = ident.strip().removeprefix("functions.").rsplit(":", 1)[0]
            obj = _json_object(args.strip())
            if not sep or obj is None or not name:
                return None
            calls.append(Call(name, obj))
        return calls, got[1]


class MistralFormat(ToolFormat):
    """Mistral / Mixtral: ``[TOOL_CALLS] [{"name": N, "arguments": {...}, "id": ...}]`` (v3) or
    ``[TOOL_CALLS]N[ARGS]{...}`` (v11)."""

    name, starts = "mistral", ("[TOOL_CALLS]",)

    def parse(self, text, tools):
        calls, rest = [], []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part and not part.startswith("["):
                name, _, args = part.partition("[ARGS]")
                obj, end = self._raw(args.strip())
                if obj is None or not isinstance(obj, dict):
                    return None
                calls.append(Call(name.strip(), obj))
                rest.append(args.strip()[end:])
                continue
            arr, end = self._raw(part)
            if isinstance(arr, dict):
                arr = [arr]
            if not isinstance(arr, list) or not arr:
                return None
            for c in arr:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                    return None
                args = c.get("arguments", {})
                args = _json_object(args) if isinstance(args, str) else args
                if not isinstance(args, dict):
                    return None
                cid = c.get("id")
                calls.append(Call(c["name"], args, cid if isinstance(cid, str) and cid else None))
            rest.append(part[end:])
        return (calls, "".join(rest).strip()) if calls else None

    @staticmethod
    def _raw(s: str):
        try:
            return json.JSONDecoder().raw_decode(s)
        except (ValueError, RecursionError):
            return None, 0


class DsmlFormat(ToolFormat):
    """DeepSeek-V3.2 / V4 (DSML): ``<｜DSML｜function_calls>`` (or ``tool_calls``) around
    ``<｜DSML｜invoke name="N"><｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke>``;
    a value is text when ``string="true"``, JSON otherwise."""

    name = "dsml"
    D = "｜DSML｜"
    starts = (f"<{D}function_calls>", f"<{D}tool_calls>", f"<{D}invoke ")
    _invoke = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)(?:</｜DSML｜invoke>|$)', re.S)
    _param = re.compile(r'<｜DSML｜parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</｜DSML｜parameter>', re.S)

    def parse(self, text, tools):
        for w in ("function_calls", "tool_calls"):
            text = text.replace(f"<{self.D}{w}>", "").replace(f"</{self.D}{w}>", "")
        calls, pos, rest = [], 0, []
        for m in self._invoke.finditer(text):
            rest.append(text[pos:m.start()])
            pos = m.end()
            name, body = m.group(1).strip(), m.group(2)
            types = _param_types(tools, name)
            args = {}
            for p in self._param.finditer(body):
                key, raw = p.group(1), p.group(3)
                if p.group(2) == "true":
                    args[key] = raw
                elif p.group(2) == "false":
                    try:
                        args[key] = json.loads(raw)
                    except (ValueError, RecursionError):
                        return None
                else:
                    args[key] = _typed_value(raw, types.get(key))
            if self._param.sub("", body).strip():
                return None
            calls.append(Call(name, args))
        rest.append(text[pos:])
        return (calls, "".join(rest).strip()) if calls else None


class Llama4Format(ToolFormat):
    """Llama 4: JSON objects ``{"name": N, "parameters": {...}}`` one after another, after an
    optional ``<|python_start|>...<|python_end|>`` block (its text is content), as Llama 4's
    published template renders a call and asks the model to write one."""

    name = "llama4_json"
    PY, PY_END = "<|python_start|>", "<|python_end|>"
    starts = (PY, '{"name"')

    def parse(self, text, tools):
        rest = ""
        if text.startswith(self.PY):
            rest, sep, text = text[len(self.PY):].partition(self.PY_END)
            if not sep:  # the calls may sit inside the block
                rest, text = "", rest
        calls, dec, pos = [], json.JSONDecoder(), 0
        while True:
            while pos < len(text) and text[pos] in " \t\n;,":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                obj, pos = dec.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return None
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            args = _json_object(args) if isinstance(args, str) else args
            if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                return None
            calls.append(Call(obj["name"], args))
        return (calls, (rest + text[pos:]).strip()) if calls else None


class HarmonyFormat(ToolFormat):
    """gpt-oss (harmony): a message ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>ARGS``
    ending in ``<|call|>``. The answer is decoded by :class:`engine.harmony.HarmonyDecoder` with
    ``show_calls``, which shows such a message with its header (reasoning and answer as usual)."""

    name = "harmony"
    raw_decode = False

    def __init__(self, header: list[int] | None = None, show_calls: bool = True):
        # header: the prompt ends inside a message with this header (a prefill the answer
        # continues); show_calls False: only that decoding is wanted (no tools offered)
        self.header, self.show_calls = header, show_calls

    @property
    def starts(self):
        from ..harmony import CALL_MARK
        return (CALL_MARK,) if self.show_calls else ()

    def decoder(self, tokenizer):
        from ..harmony import HarmonyDecoder
        dec = HarmonyDecoder(tokenizer, show_calls=self.show_calls)
        return dec.continuing(self.header) if self.header is not None else dec

    def parse(self, text, tools):
        from ..harmony import ARGS_MARK, CALL_MARK
        calls = []
        for part in text.split(CALL_MARK)[1:]:
            header, sep, args = part.partition(ARGS_MARK)
            m = re.search(r"to=functions\.([^\s<]+)", header)
            obj = _json_object(args.strip())
            if not sep or obj is None or m is None:
                return None
            calls.append(Call(m.group(1), obj))
        return (calls, "") if calls else None


def tool_format(tokenizer) -> ToolFormat | None:
    """The call format of a model, from its chat template (and harmony tokens); None when the
    template shows no known format (the answer is then returned as text)."""
    from ..harmony import is_harmony
    if is_harmony(tokenizer):
        return HarmonyFormat()
    sources = "\0".join(getattr(tokenizer, "chat_templates", {}).values())
    if "｜DSML｜" in sources:
        return DsmlFormat()
    if "<｜tool▁call▁begin｜>" in sources or "tool▁calls▁begin" in sources:
        return DeepSeekFormat()
    if "<|tool_call_begin|>" in sources or "tool_calls_section_begin" in sources:
        return KimiFormat()
    if "[TOOL_CALLS]" in sources:
        return MistralFormat()
    for marker, fmt in (("<|tool_call>", Gemma4Format), ("<minimax:tool_call>", MiniMaxFormat),
                        ("<tool_calls>", HunyuanFormat), ("<|tool_list_start|>", PythonicFormat)):
        if marker in sources:
            return fmt()
    if "<arg_key>" in sources:
        return GlmFormat()
    if "<function=" in sources and "<parameter=" in sources:
        return QwenCoderFormat()
    if "<tool_call>" in sources:
        return HermesFormat()
    if "<|python_start|>" in sources and '"parameters": ' in sources:
        return Llama4Format()
    return None


class CallSplitter:
    """Streams an answer's content, holding back a possible start of a call; from the first
    start on everything is kept until :meth:`finish` parses it.

    ``push(text) -> content``; ``finish() -> (content, calls)``: the calls (empty when none, or
    when the text is not well-formed, which then comes back as content).
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self._held = ""
        self._calls: str | None = None

    @property
    def in_call(self) -> bool:
        return self._calls is not None

    def push(self, text: str) -> str:
        if self._calls is not None:
            self._calls += text
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.fmt.starts) if i >= 0]
        if hits:
            i = min(hits)
            self._held, self._calls = "", buf[i:]
            return buf[:i]
        k = 0
        for s in self.fmt.starts:
            for n in range(min(len(s) - 1, len(buf)), k, -1):
                if buf.endswith(s[:n]):
                    k = n
                    break
        self._held = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k]

    def finish(self) -> tuple[str, list[Call]]:
        held, self._held = self._held, ""
        if self._calls is None:
            return held, []
        text, self._calls = self._calls, None
        try:
            got = self.fmt.parse(text, self.tools)
        except Exception:  # noqa: BLE001 - a malformed call is returned as text, never a 500
            got = None
        if got is None:
            return held + text, []
        calls, rest = got
        return held + rest, calls
