"""Constrained decoding: token masks from grammars (llguidance), for JSON output and forced calls.

:class:`TokenConstraint` is what the engine's sampler reads (``GenerateRequest.constraint``):
``mask(n)`` -> the tokens the grammar allows next (bool, shape (n,)), ``accept(id)`` after each
token. Once the grammar is complete only the model's end-of-turn tokens are allowed, so the
answer ends there. llguidance was chosen over xgrammar by the measured cost per token on our
tokenizers (bench/results/grammar_mask.md, docs/decisions/0009-constrained-decoding.md).

Grammars (Lark, llguidance's dialect):

* :func:`json_grammar` - ``response_format`` ``json_object`` (any object) or ``json_schema``;
  JSON written as ``json.dumps`` writes it (", " and ": ", no other whitespace).
* :func:`call_grammar` - ``tool_choice`` "required" / a named function: the text the model's
  chat template writes for one call of an offered tool, with the arguments constrained by the
  tool's JSON schema. The text around the arguments is taken from the template itself (a call
  rendered with placeholder arguments), so every family's format is followed without a table;
  the template's special tokens are required as those tokens (``<[id]>``), not spelled out.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from datetime import datetime
from typing import Any

import numpy as np

from ..chat_template import THINK_OPEN, render

#: JSON as json.dumps and the templates' tojson write it.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KEY, _VALUE, _ID = "colibri_k", "colibri_v", "colibri0"
_KEY2, _NUMBER, _REASONING = "colibri_k2", 7340033, "colibri_r"


class GrammarError(ValueError):
    """A grammar or schema the library cannot compile (the message says why)."""


_lock = threading.Lock()
_LL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> its llguidance tokenizer


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of an engine.tokenizer.Tokenizer (built once per tokenizer:
    about a second for a 150k vocabulary)."""
    with _lock:
        lt = _LL.get(tokenizer)
        if lt is None:
            import llguidance
            lt = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                                        eos_token=sorted(tokenizer.eos_ids))
            _LL[tokenizer] = lt
        return lt


class TokenConstraint:
    """A grammar's token mask over one generation (llguidance ``LLMatcher``).

    ``mask(n) -> np.ndarray`` bool (n,): True for the tokens allowed next (ids beyond the
    tokenizer's vocabulary never are); ``accept(token_id)``; ``done``: the grammar is complete;
    ``error``: "" or what went wrong. Raises GrammarError when the grammar does not compile.
    """

    def __init__(self, tokenizer, grammar: str):
        import llguidance
        import llguidance.numpy as lnp
        self._lt = ll_tokenizer(tokenizer)
        self._lnp = lnp
        self.matcher = llguidance.LLMatcher(self._lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self._bits = lnp.allocate_token_bitmask(1, self._lt.vocab_size)
        self.error = ""

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def mask(self, n: int) -> np.ndarray:
        self._lnp.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        out = np.zeros(n, dtype=bool)
        m = min(n, self._lt.vocab_size)
        out[:m] = bits[:m].astype(bool)
        return out

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(int(token_id)) and not self.error:
            self.error = self.matcher.get_error()


def _schema_with_style(schema: dict) -> dict:
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


def json_rule(schema: dict | None) -> str:
    """A Lark ``%json`` rule body for ``schema`` (None: any JSON object)."""
    schema = {"type": "object"} if schema is None else schema
    return "%json" + json.dumps(_schema_with_style(schema), ensure_ascii=False)


def _literal(tokenizer, text: str) -> list[str]:
    """Lark items matching ``text`` exactly, its added tokens as those tokens."""
    added = [t for t in getattr(tokenizer, "added_tokens", {}) if t and not t.isspace()]
    items: list[str] = []
    if not added:
        return [json.dumps(text, ensure_ascii=False)] if text else []
    alt = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))
    pos = 0
    for m in alt.finditer(text):
        if m.start() > pos:
            items.append(json.dumps(text[pos:m.start()], ensure_ascii=False))
        items.append(f"<[{tokenizer.token_to_id(m.group(0))}]>")
        pos = m.end()
    if pos < len(text):
        items.append(json.dumps(text[pos:], ensure_ascii=False))
    return items


def answer_prefix(tokenizer) -> list[str]:
    """What opens an answer before its text: gpt-oss's ``<|channel|>final<|message|>``
    (its prompt ends with ``<|start|>assistant``); nothing for other families."""
    from ..harmony import is_harmony
    if is_harmony(tokenizer):
        return _literal(tokenizer, "<|channel|>final<|message|>")
    return []


def json_grammar(tokenizer, schema: dict | None, prompt_opened: bool = False) -> str:
    """The grammar of an answer that is one JSON value of ``schema`` (None: any object).
    ``prompt_opened``: the prompt opened a ``<think>`` block, which is closed first."""
    head = answer_prefix(tokenizer) + (_literal(tokenizer, "</think>\n\n") if prompt_opened else [])
    return "start: " + " ".join(head + ["answer"]) + "\nanswer: " + json_rule(schema) + "\n"


# --- forced calls ---------------------------------------------------------------------------------


def _turn_text(src: str, msgs: list[dict], call: dict, tools, special, kwargs, eos: list[str],
               added=()) -> str:
    """The text the template writes for an assistant turn holding ``call``, up to its
    end-of-turn token. ``added``: the tokenizer's added tokens; where the generation prompt
    ends in text the rendered turn leaves out (Gemma 4's empty thought channel), the turn
    starts at the added token the two renderings part in."""
    kw = dict(tools=tools, special_tokens=special, template_kwargs=kwargs, now=datetime.now())
    prefix = render(src, "the chat template", msgs, add_generation_prompt=True, **kw)
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    try:
        full = render(src, "the chat template", msgs + [turn], **kw)
    except Exception:  # noqa: BLE001 - templates that concatenate the arguments as a string
        fn = call["function"]
        turn["tool_calls"] = [{**call, "function": {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}}]
        full = render(src, "the chat template", msgs + [turn], **kw)
    n = 0
    while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
        n += 1
    text = None
    if n < len(prefix) and prefix[n:].lstrip().startswith(THINK_OPEN):
        # the prompt opens a reasoning block (MiniMax-M2): the turn closes it empty, as the
        # template writes a turn whose reasoning is a placeholder cut out again
        with_r = render(src, "the chat template", msgs + [{**turn, "reasoning_content": _REASONING}], **kw)
        if with_r.startswith(prefix) and _REASONING in with_r[len(prefix):]:
            text = with_r[len(prefix):].replace(_REASONING, "", 1)
    if text is None:
        if n < len(prefix):
            n = min([m.start() for t in added if t for m in re.finditer(re.escape(t), full) if m.start() < n < m.end()]
                    + [n])
        text = full[n:]
    cut = min((i for i in (text.find(e) for e in eos if e) if i >= 0), default=len(text))
    return text[:cut]


def _added_markup(none: str, one: str, added) -> tuple[int, str]:
    """What ``one`` (a call rendered with one argument) has beyond ``none`` (without) -> (where
    it starts, the text between their common prefix and suffix); a cut inside an added token
    (``</tool_call>`` and ``<arg_key>`` share "<") moves to its edge, so every token stays whole."""
    spans = [(mt.start(), mt.end()) for t in added for mt in re.finditer(re.escape(t), one)]
    i = 0
    while i < min(len(none), len(one)) and none[i] == one[i]:
        i += 1
    i = min([a for a, b in spans if a < i < b] + [i])
    j = 0
    while j < min(len(none), len(one)) - i and none[-1 - j] == one[-1 - j]:
        j += 1
    j = min([len(one) - b for a, b in spans if a < len(one) - j < b] + [j])
    return i, one[i:len(one) - j]


def _is_text(schema: dict) -> bool:
    """A value the XML-style formats write as bare text (others as JSON)."""
    return schema.get("type") == "string" and not ({"enum", "const", "pattern", "format"} & set(schema))


def _value_rule(schema: dict) -> str:
    if _is_text(schema):
        # XML-style text: no markup, no newline (the template's own newlines surround it)
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        lo = max(1, int(lo)) if isinstance(lo, int) else 1
        return "/[^<\\n]{" + str(lo) + "," + (str(int(hi)) if isinstance(hi, int) and hi >= lo else "") + "}/"
    return json_rule(schema)


def call_grammar(tokenizer, msgs: list[dict], tools: list[dict], name: str | None,
                 template_kwargs: dict | None = None) -> str:
    """The grammar of an answer that is one call of ``name`` (None: any of ``tools``), written
    as the model's chat template writes calls. Raises GrammarError when the template does not
    write calls in a way this can follow."""
    src = tokenizer.chat_template_source(tools=tools)
    special = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token") if getattr(tokenizer, k, None)}
    eos = [tokenizer.id_to_token(i) for i in tokenizer.eos_ids]
    kwargs = dict(template_kwargs or {})
    added = tuple(t for t in getattr(tokenizer, "added_tokens", {}) if t)
    rules, alts = [], []
    for k, t in enumerate(tools):
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        schema = fn.get("parameters") or {"type": "object", "properties": {}}

        def text(args):
            return _turn_text(src, msgs, {"id": _ID, "type": "function", "function": {"name": fn["name"], "arguments": args}},
                              tools, special, kwargs, eos, added)
        one = text({_KEY: _VALUE})
        placeholder = json.dumps({_KEY: _VALUE}, ensure_ascii=False)
        if placeholder in one:                       # the arguments are written as JSON
            before, _, after = one.partition(placeholder)
            body = _literal(tokenizer, before) + [f"args{k}"] + _literal(tokenizer, after)
            rules.append(f"args{k}: " + json_rule({**schema, "type": "object"}))
        else:                                        # XML-style: one piece of markup per argument
            none = text({})
            # the markup one argument adds: what ``one`` has between the common prefix and
            # suffix of the two renderings; a cut inside an added token (``</tool_call>`` and
            # ``<arg_key>`` share "<") moves to its edge, so every token stays whole
            i, pair = _added_markup(none, one, added)
            if _KEY not in pair or _VALUE not in pair:
                raise GrammarError("the chat template does not write a call's arguments in a form that can be forced")
            # a number's markup (Gemma 4 quotes only strings, DSML marks them string="false") and
            # what the template writes between two arguments (Gemma 4's comma)
            number = _added_markup(none, text({_KEY: _NUMBER}), added)[1]
            number = number if _KEY in number and str(_NUMBER) in number else pair.replace(_VALUE, str(_NUMBER))
            two = text({_KEY: _VALUE, _KEY2: _VALUE})
            a = two.find(pair)
            b = two.find(pair.replace(_KEY, _KEY2), a + len(pair)) if a >= 0 else -1
            sep = two[a + len(pair):b] if b >= 0 else ""
            props = schema.get("properties") or {}
            items = []
            for key in [p for p in props if p in (schema.get("required") or [])]:
                sub = props[key] or {}
                kb, _, rest = (pair if _is_text(sub) else number).partition(_KEY)
                mid, _, va = rest.partition(_VALUE if _is_text(sub) else str(_NUMBER))
                items += (_literal(tokenizer, sep) if items and sep else []) + _literal(tokenizer, kb + key + mid)
                items += [f"v{k}_{len(rules)}"] + _literal(tokenizer, va)
                rules.append(f"v{k}_{len(rules)}: " + _value_rule(sub))
            body = _literal(tokenizer, none[:i]) + items + _literal(tokenizer, none[i:])
        alts.append(" ".join(_with_id(body)))
    if not alts:
        raise GrammarError(f"no offered tool is named {name!r}")
    return "start: " + " | ".join("(" + a + ")" for a in alts) + "\n" + "\n".join(rules) + "\n"


def _with_id(items: list[str]) -> list[str]:
    """A call id the template writes (Mistral's 9 characters) becomes free: the model writes one."""
    out = []
    for it in items:
        if it.startswith('"') and _ID in it:
            parts = json.loads(it).split(_ID)
            for n, p in enumerate(parts):
                if p:
                    out.append(json.dumps(p, ensure_ascii=False))
                if n < len(parts) - 1:
                    out.append("/[A-Za-z0-9]{9}/")
        else:
            out.append(it)
    return out


def compile_checked(tokenizer, grammar: str) -> TokenConstraint:
    """A TokenConstraint for ``grammar``; GrammarError when it does not compile."""
    try:
        return TokenConstraint(tokenizer, grammar)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError / RuntimeError with the reason
        raise GrammarError(str(e)) from None


def schema_of(response_format: Any) -> tuple[bool, dict | None]:
    """``response_format`` -> (constrained, schema or None for any object). Raises ValueError
    naming what is wrong."""
    if response_format is None:
        return False, None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}")
    kind = response_format["type"]
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    js = response_format.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise ValueError("'response_format.json_schema' must be an object with a 'schema' object")
    return True, js.get("schema") or {"type": "object"}
