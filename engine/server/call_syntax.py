"""What every call format shares: a parsed :class:`Call`, the :class:`ToolFormat` base and the
helpers that read argument values (engine.server.tools and engine.server.call_formats hold the
formats)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Call:
    """One parsed call: the function's name, its arguments (a JSON object) and the id the model
    wrote (Mistral's calls carry one; None otherwise)."""

    name: str
    arguments: dict
    id: str | None = field(default=None, compare=False)


def _json_object(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return v if isinstance(v, dict) else None


def _param_types(tools: list[dict] | None, name: str) -> dict[str, Any]:
    for t in tools or ():
        if t["function"]["name"] == name:
            props = (t["function"].get("parameters") or {}).get("properties")
            return {k: (v or {}).get("type") for k, v in props.items()} if isinstance(props, dict) else {}
    return {}


def _typed_value(raw: str, typ: Any) -> Any:
    """An XML-style parameter value: text for a string parameter, else JSON when it parses."""
    if typ == "string" or (isinstance(typ, list) and "string" in typ and len(typ) == 1):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


class ToolFormat:
    """How one family writes calls. ``starts``: the texts that open the calls in an answer
    (decoded with special tokens shown); :meth:`parse` reads the text from the first start to
    the end -> (calls, text left over) or None when it is not a well-formed call."""

    name = ""
    starts: tuple[str, ...] = ()
    raw_decode = True   # the answer is decoded with special tokens shown (their markers are special)

    def parse(self, text: str, tools: list[dict] | None) -> tuple[list[Call], str] | None:
        raise NotImplementedError

    def decoder(self, tokenizer):
        return tokenizer.incremental_decoder(skip_special_tokens=not self.raw_decode)

    @staticmethod
    def _blocks(text: str, open_: str, close: str) -> tuple[list[str], str] | None:
        """The bodies of ``open_ ... close`` blocks and the text between them; the last block
        may be unclosed (the model's end-of-turn token may follow its last call directly)."""
        bodies, rest, pos = [], [], 0
        while True:
            i = text.find(open_, pos)
            if i < 0:
                rest.append(text[pos:])
                break
            rest.append(text[pos:i])
            j = text.find(close, i + len(open_))
            if j < 0:
                bodies.append(text[i + len(open_):])
                break
            bodies.append(text[i + len(open_):j])
            pos = j + len(close)
        return (bodies, "".join(rest).strip()) if bodies else None
