"""Chat templates: loading, rendering exactly as transformers does, control-token marking, reasoning.

Rendering follows transformers' ``apply_chat_template`` (transformers/utils/chat_template_utils.py,
read for its semantics, reimplemented here with jinja2):

* jinja2's *immutable sandbox* with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
  extension and a ``{% generation %}`` block (rendered as its body); helpers ``raise_exception``,
  ``strftime_now``, ``tojson`` (``json.dumps`` with ``ensure_ascii=False`` and the ``indent`` /
  ``separators`` / ``sort_keys`` arguments, no HTML escaping), ``namespace`` (no underscore names)
  and ``dict``. Chat templates come from the internet: they are untrusted code, and here an unsafe
  attribute access raises at once instead of rendering as an empty value.
* Template variables: ``messages`` (None-valued keys dropped; a message carrying ``reasoning_content``,
  ``thinking`` or ``reasoning`` gets both ``thinking`` and ``reasoning_content``), ``tools`` (JSON
  schemas), ``documents``, ``add_generation_prompt``, the named special tokens of
  tokenizer_config.json (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
  ``cls_token``, ``mask_token``) and any extra template keyword (``enable_thinking``, ...), which
  override the special tokens.
* Template sources, as transformers' loader: ``chat_template.jinja`` (the "default" template) and
  ``additional_chat_templates/<name>.jinja`` replace tokenizer_config.json's ``chat_template`` (a
  string, or a list of ``{"name", "template"}``); a processor's legacy ``chat_template.json`` is used
  when nothing else declares a template. With several named templates, ``tool_use`` is chosen when
  tools are given and it exists, else ``default``.

Control tokens: a user who pastes ``<|im_end|>`` must not end the turn. As
transformers' ``apply_chat_template(..., sanitize_control_tokens=True)``, every control token inside
a caller string (message contents, tool calls, tools, documents, template keywords) is wrapped in two
private-use markers (U+F0000, U+F0001) before rendering; :meth:`engine.tokenizer.Tokenizer.encode_chat`
encodes a marked token as plain text and everything else (the template's own markers included)
normally. Control tokens are the special added tokens plus the tokenizer_config.json
``chat_control_tokens`` list, or, without that list, the non-whitespace added tokens that appear in
the template's literal text (``<think>``, ``<tool_call>``).

Reasoning: :func:`split_reasoning` splits a leading ``<think>...</think>`` block off an answer;
:func:`history_message` turns a saved assistant answer into the message the template expects
(``content`` = the answer, ``reasoning_content`` = the reasoning), so templates that keep reasoning
(Qwen3, for the turns after the last user query) get it and the others drop it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from .errors import TokenizerError

#: Private-use characters that wrap a control token found in caller text (the same code points as
#: transformers, so a rendered chat marked by either library reads the same).
CONTROL_START = "\U000f0000"
CONTROL_END = "\U000f0001"

#: Names of the special-token variables templates see (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")

#: Message fields that carry reasoning; the first is the one most templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


# --- sandboxed environment ---------------------------------------------------------------


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute access raises at once instead of
    rendering as an empty Undefined (so a template probing ``__class__`` fails loudly)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant output for training masks):
    rendered as its body, as transformers does when it is not tracking masks."""

    tags = {"generation"}

    def parse(self, parser):  # noqa: ANN001 - jinja2 API
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateDict:
    """``dict(...)`` in templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile_cached(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def compile_template(source: str, where: str) -> jinja2.Template:
    """Compile a chat template in the sandbox -> jinja2.Template (cached by source).

    Raises TokenizerError naming ``where`` when the template does not compile.
    """
    try:
        return _compile_cached(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the chat template of {where} does not compile: {e}") from e


@lru_cache(maxsize=32)
def template_literal_text(source: str) -> str:
    """Every literal string of a template (its text and its string constants) joined by NUL, so
    a substring search cannot match across two of them. Returns "" for a template that does not
    compile (the compile error is reported when it is rendered)."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateError:
        return ""
    parts = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    parts |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(parts))


# --- loading and choosing templates ---------------------------------------------------------


_LFS_MAGIC = b"version https://git-lfs"


def check_not_lfs_pointer(path: Path) -> None:
    """Raise TokenizerError when ``path`` is unreadable or a Git LFS pointer instead of the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LFS_MAGIC))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e}); check the file permissions") from e
    if head == _LFS_MAGIC:
        raise TokenizerError(
            f"{path} is a Git LFS pointer file, not the real file; fetch the content with "
            f"`git lfs pull` in the model folder or re-download the model with huggingface_hub")


def _read_text(path: Path) -> str:
    check_not_lfs_pointer(path)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e}); check the file or re-download it") from e


def _named_templates(value: Any, source: Path) -> dict[str, str]:
    """tokenizer_config.json ``chat_template``: a string or a list of {"name", "template"}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, (list, tuple)):
        out: dict[str, str] = {}
        for t in value:
            if not (isinstance(t, Mapping) and isinstance(t.get("name"), str)
                    and isinstance(t.get("template"), str)):
                raise TokenizerError(f"{source}: chat_template list entries must be objects with "
                                     f"string 'name' and 'template'; got {t!r:.80}")
            out[t["name"]] = t["template"]
        return out
    raise TokenizerError(f"{source}: chat_template must be a string or a list of named "
                         f"templates, got {type(value).__name__}")


def load_chat_templates(folder: str | Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The chat templates of a model folder -> {name: jinja source} ("default" for the main one).

    ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` take precedence over
    ``tokenizer_config["chat_template"]`` (as transformers' loader); a processor's
    ``chat_template.json`` is read only when neither declares a template. {} when none exists.
    Raises TokenizerError for an unreadable file or a malformed declaration.
    """
    folder = Path(folder)
    files: dict[str, str] = {}
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        files["default"] = _read_text(jinja_path)
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for p in sorted(extra_dir.glob("*.jinja")):
            files[p.stem] = _read_text(p)
    if files:
        return files
    templates = _named_templates(tokenizer_config.get("chat_template"),
                                 folder / "tokenizer_config.json")
    if templates:
        return templates
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        try:
            data = json.loads(_read_text(legacy))
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{legacy}: not valid JSON ({e}); re-download this file") from e
        if not isinstance(data, Mapping):
            raise TokenizerError(f"{legacy}: expected a JSON object with a 'chat_template' key")
        return _named_templates(data.get("chat_template"), legacy)
    return {}


def select_template(templates: Mapping[str, str], name: str | None, has_tools: bool,
                    where: str) -> str:
    """Pick the template to render -> jinja source.

    ``name`` picks a named template; otherwise ``tool_use`` when tools are given and it exists,
    else ``default``. Raises TokenizerError when there is no template or no usable choice.
    """
    if not templates:
        raise TokenizerError(no_template_message(where))
    if name is not None:
        if name not in templates:
            raise TokenizerError(f"{where} has no chat template named {name!r} "
                                 f"(it has {sorted(templates)})")
        return templates[name]
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise TokenizerError(f"{where} has several chat templates but no 'default' one "
                         f"(found {sorted(templates)}); name the template to use or add a 'default'")


def no_template_message(where: str, system_prompt: bool = False) -> str:
    """The one-line explanation shown when chat is asked of a model without a chat template."""
    tail = " and the system prompt is not used" if system_prompt else ""
    return (f"{where} has no chat template (tokenizer_config.json chat_template / chat_template.jinja), "
            f"so it cannot take chat messages; use a raw prompt: raw mode sends your text to the "
            f"model as plain text to continue{tail} (colibri run --raw, or 'Use raw mode' in the "
            f"app), or add the model's chat template to the folder")


def raw_mode_warning(where: str, has_template: bool, system_prompt: bool) -> str:
    """The one-line CLI warning when a prompt runs raw without the user choosing it, or when a
    system prompt is given in raw mode (where it cannot be used)."""
    if has_template:
        return "warning: --system is not used with --raw (raw mode sends only the prompt text)"
    dropped = "; the system prompt is not used" if system_prompt else ""
    return (f"warning: {where} has no chat template, so the prompt is sent as raw text for the model "
            f"to continue{dropped}; pass --raw to choose raw mode knowingly (and silence this warning)")


# --- template data -----------------------------------------------------------------------


def plain_data(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types (str, int, float, bool, None, dict, list,
    tuple): what a sandboxed template may see. Dataclasses become dicts; str/int/float
    subclasses become the base type; any other object becomes the string ``<TypeName>``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """Messages (dicts or dataclasses) -> list of dicts without None-valued keys.

    Raises TokenizerError for a message that is not a dict or dataclass."""
    out = []
    for m in messages:
        if dataclasses.is_dataclass(m) and not isinstance(m, type):
            m = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        if not isinstance(m, Mapping):
            raise TokenizerError(f"chat messages must be ChatMessage objects or dicts with role and "
                                 f"content, got {type(m).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    """A message with reasoning under any of REASONING_FIELDS also gets it as ``thinking``
    (gpt-oss templates) and ``reasoning_content`` (most others); key order as transformers."""
    out = []
    for m in messages:
        r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


def render(source: str, where: str, messages: Any, *, tools: Any = None, documents: Any = None,
           add_generation_prompt: bool = False, special_tokens: Mapping[str, str] | None = None,
           template_kwargs: Mapping[str, Any] | None = None, now: datetime | None = None) -> str:
    """Render one conversation with a chat template -> str, as transformers' apply_chat_template.

    ``messages``: dicts (or dataclasses) with "role" and "content" and any other field the
    template reads (tool_calls, reasoning_content, ...). ``tools``: list of JSON-schema dicts.
    ``documents``: list of dicts. ``special_tokens``: bos_token etc.; ``template_kwargs``
    override them. ``now``: the instant ``strftime_now`` shows (the clock's when None), so that
    renderings compared with each other show one time. Raises TokenizerError when the template does not compile, calls
    raise_exception, breaks the sandbox or fails on the input (the message names ``where``).
    """
    template = compile_template(source, where)
    if tools is not None:
        tools = list(tools)
        for t in tools:
            if not isinstance(t, Mapping):
                raise TokenizerError(f"tools must be JSON-schema dicts, got {type(t).__name__}")
    if documents is not None:
        documents = list(documents)
        for d in documents:
            if not isinstance(d, Mapping):
                raise TokenizerError("documents must be a list of dicts with 'title' and 'text' keys")
    msgs = alias_reasoning_fields(plain_data(normalize_messages(messages)))
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(plain_data(dict(template_kwargs or {})))
    variables.update(messages=msgs, tools=plain_data(tools), documents=plain_data(documents),
                     add_generation_prompt=bool(add_generation_prompt))
    if now is not None:
        variables["strftime_now"] = now.strftime
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the chat template of {where} failed: {e}") from e
    except Exception as e:  # template code errors such as TypeError on bad messages
        raise TokenizerError(f"the chat template of {where} failed: {type(e).__name__}: {e}") from e


def cut_after_final_message(rendered: str, messages: list[dict]) -> str:
    """``rendered`` (a conversation rendered without a generation prompt) cut right after the
    last message's text, so that generation continues that message (transformers'
    ``continue_final_message``). Templates often strip a message's text, so the stripped text
    is looked for when the text as given is not there. Raises TokenizerError when the last
    message has no text or the template does not write it."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise TokenizerError("the last message has no text to continue")
    for needle in (content, content.strip()):
        i = rendered.rfind(needle)
        if i >= 0:
            return rendered[:i + len(needle)]
    raise TokenizerError("the chat template does not write the last message's text as given, so the "
                         "answer cannot continue it")


# --- control tokens ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ControlTokens:
    """Which added tokens are control tokens for one template, and the regexes to mark them.

    tokens: the control token strings. all_added: every added token string (a marked piece must
    be one of them). Build with :meth:`build`.
    """

    tokens: tuple[str, ...]
    all_added: tuple[str, ...]

    @classmethod
    def build(cls, added: Mapping[str, bool], template_source: str,
              chat_control_tokens: Any = None) -> ControlTokens:
        """``added``: {token string: special flag} of the tokenizer's added tokens.

        Control tokens = the special ones, plus ``chat_control_tokens`` (tokenizer_config.json)
        when given, else the non-whitespace added tokens found in the template's literal text.
        """
        if chat_control_tokens is not None:
            extra = {t for t in chat_control_tokens if isinstance(t, str)}
            tokens = [t for t, special in added.items() if special or t in extra]
        else:
            literal = template_literal_text(template_source)
            tokens = [t for t, special in added.items()
                      if special or (t in literal and not t.isspace())]
        return cls(tuple(tokens), tuple(added))

    def _control_re(self) -> re.Pattern:
        return _alternation(self.tokens)

    def marker_re(self) -> re.Pattern:
        """Splits a marked rendering into [text, token-or-None, text, ...]: a marked added token
        is captured; a lone marker (a template's split() cut a pair) captures None."""
        return _marker_re(self.all_added)

    def mark(self, obj: Any) -> Any:
        """Wrap every control token in the strings of ``obj`` (recursively through dicts, lists
        and tuples; dict keys untouched) in CONTROL_START/CONTROL_END. Marker characters already
        in a string are removed first, so they cannot forge a marked token."""
        if isinstance(obj, str):
            obj = obj.replace(CONTROL_START, "").replace(CONTROL_END, "")
            return self._control_re().sub(lambda m: CONTROL_START + m.group(0) + CONTROL_END, obj)
        if isinstance(obj, Mapping):
            return {k: self.mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.mark(v) for v in obj]
        return obj


@lru_cache(maxsize=64)
def _alternation(tokens: tuple[str, ...]) -> re.Pattern:
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


@lru_cache(maxsize=16)
def _marker_re(tokens: tuple[str, ...]) -> re.Pattern:
    alt = _alternation(tokens).pattern
    return re.compile(f"{CONTROL_START}({alt}){CONTROL_END}|[{CONTROL_START}{CONTROL_END}]")


# --- reasoning ------------------------------------------------------------------------------


def split_reasoning(text: str) -> tuple[str, str]:
    """Split a leading reasoning block off a model answer -> (reasoning, answer).

    Recognised forms (Qwen3 / DeepSeek-R1 style):
      ``<think>R</think>A``  -> (R, A)
      ``R</think>A``         -> (R, A)   the prompt opened the block (templates ending in <think>)
      ``<think>R`` unclosed  -> (R, "")  still thinking (streaming)
      anything else          -> ("", text)
    R has its surrounding newlines stripped, A its leading newlines (as Qwen3's template does).
    Only a block at the start counts: a ``<think>`` later in the text is part of the answer.
    """
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        inner = body[len(THINK_OPEN):]
        close = inner.find(THINK_CLOSE)
        if close < 0:
            return inner.strip("\n"), ""
        return inner[:close].strip("\n"), inner[close + len(THINK_CLOSE):].lstrip("\n")
    close = text.find(THINK_CLOSE)
    if close >= 0 and THINK_OPEN not in text[:close]:
        return text[:close].strip("\n"), text[close + len(THINK_CLOSE):].lstrip("\n")
    return "", text


def reasoning_open(text: str) -> bool:
    """True while ``text`` starts a ``<think>`` block that is not closed yet (streaming)."""
    body = text.lstrip()
    return body.startswith(THINK_OPEN) and THINK_CLOSE not in body


def history_message(role: str, content: str) -> dict[str, str]:
    """A saved chat turn -> the message dict sent to the template.

    An assistant answer that starts with a reasoning block becomes
    ``{"role": "assistant", "content": answer, "reasoning_content": reasoning}``: templates that
    keep reasoning (Qwen3, for turns after the last user query) read ``reasoning_content``; the
    others never see it. Other turns are passed as they are.
    """
    if role == "assistant":
        reasoning, answer = split_reasoning(content)
        if reasoning or answer != content:
            return {"role": role, "content": answer, "reasoning_content": reasoning}
    return {"role": role, "content": content}
