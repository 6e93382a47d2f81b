"""Tokenizer, chat template and streaming detokenizer for a Hugging Face model folder.

The tokenizer itself is the model's ``tokenizer.json`` run by the ``tokenizers`` library.
The chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json`` and is
rendered like transformers does it: jinja2's *sandboxed* environment with ``trim_blocks``
and ``lstrip_blocks``, plus the helpers templates expect (``raise_exception``,
``strftime_now``, ``tojson``, ``namespace``, ``dict``, ``loopcontrols``). Chat templates
come from the internet and are untrusted code; any unsafe attribute access raises.

The stop set (``eos_ids``) is the union of every EOS id the folder declares:
``generation_config.json`` (often a list), ``config.json`` and the ``eos_token`` of
``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers

from .errors import TokenizerError
from .events import ChatMessage

log = logging.getLogger(__name__)

_LFS_MAGIC = b"version https://git-lfs"
_REPLACEMENT = "\ufffd"


# --- file helpers -----------------------------------------------------------------------


def _check_not_lfs_pointer(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LFS_MAGIC))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e}); check the file permissions") from e
    if head == _LFS_MAGIC:
        raise TokenizerError(
            f"{path} is a Git LFS pointer file, not the real file; fetch the content with "
            f"`git lfs pull` in the model folder or re-download the model with huggingface_hub")


def _read_json(path: Path) -> Any:
    """Parse an optional JSON file; None when it does not exist. Raises TokenizerError."""
    if not path.is_file():
        return None
    _check_not_lfs_pointer(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e}); re-download this file") from e


def _token_str(value: Any) -> str | None:
    """bos_token / eos_token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    """eos_token_id: an int, a list of ints or null."""
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any, source: Path) -> str | None:
    """chat_template: a string, or a list of {"name", "template"} (take "default")."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        tmpl = named.get("default")
        if isinstance(tmpl, str):
            return tmpl
        raise TokenizerError(
            f"{source}: chat_template is a list of named templates without a 'default' one "
            f"(found {sorted(str(n) for n in named)}); add a 'default' template")
    raise TokenizerError(f"{source}: chat_template must be a string or a list of named "
                         f"templates, got {type(value).__name__}")


# --- sandboxed jinja environment ---------------------------------------------------------


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute access raises at once instead of
    rendering as an empty Undefined (so a template probing ``__class__`` fails loudly)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (used by some templates to mark assistant
    output for training masks): rendered as its body."""

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


def _compile_template(source: str, where: str) -> jinja2.Template:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the chat template of {where} does not compile: {e}") from e


# --- tokenizer ----------------------------------------------------------------------------


MessageLike = ChatMessage | Mapping[str, Any]


class Tokenizer:
    """A model's tokenizer (``tokenizers.Tokenizer``) plus its chat template and EOS ids.

    Build it with :meth:`from_dir`. Attributes:
      eos_ids: frozenset[int], every id that ends a generation.
      vocab_size: int, tokenizer vocabulary including added tokens (may be smaller than the
        model's embedding rows, which are often padded).
      has_chat_template: bool.
      bos_token / eos_token: str | None, the token strings templates see.
      bos_id: int | None, the id of bos_token.
      add_bos_token: bool, from tokenizer_config.json.
      name: str, the folder (used in error messages).
    """

    def __init__(self, hf: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, eos_ids: Iterable[int] = (),
                 extra_special: Mapping[str, str] | None = None, name: str = "tokenizer") -> None:
        self._hf = hf
        self.name = name
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = bool(add_bos_token)
        self.bos_id: int | None = hf.token_to_id(bos_token) if bos_token else None
        ids = set(int(i) for i in eos_ids)
        if eos_token is not None and (eid := hf.token_to_id(eos_token)) is not None:
            ids.add(eid)
        self.eos_ids: frozenset[int] = frozenset(ids)
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self._extra_special = dict(extra_special or {})
        self._template: jinja2.Template | None = None

    # -- construction --

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, the chat template and the EOS ids of a model folder.

        Reads tokenizer.json (required), tokenizer_config.json, chat_template.jinja (takes
        precedence over the config's chat_template, as in transformers),
        generation_config.json and config.json (all optional).
        Raises TokenizerError if tokenizer.json is missing, a Git LFS pointer or invalid,
        or if a JSON file cannot be parsed.
        """
        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"{tj} not found; the model folder needs the Hugging Face fast tokenizer file "
                f"tokenizer.json (download it from the model repository next to config.json)")
        _check_not_lfs_pointer(tj)
        try:
            hf = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tj}: cannot load the tokenizer ({e}); re-download "
                                 f"tokenizer.json") from e

        tc_path = folder / "tokenizer_config.json"
        tc = _read_json(tc_path) or {}
        if not isinstance(tc, dict):
            raise TokenizerError(f"{tc_path}: expected a JSON object")
        template = _pick_template(tc.get("chat_template"), tc_path)
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            _check_not_lfs_pointer(jinja_path)
            try:
                template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_path}: cannot read ({e})") from e

        bos_token = _token_str(tc.get("bos_token"))
        eos_token = _token_str(tc.get("eos_token"))
        extra = {k: s for k in ("pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
                 if (s := _token_str(tc.get(k))) is not None}

        eos_ids: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            cfg = _read_json(folder / fname)
            if isinstance(cfg, dict):
                eos_ids += _id_list(cfg.get("eos_token_id"))
        if eos_token is None and eos_ids:
            eos_token = hf.id_to_token(eos_ids[0])
        if bos_token is None:
            gc = _read_json(folder / "generation_config.json")
            bos = _id_list(gc.get("bos_token_id")) if isinstance(gc, dict) else []
            if bos:
                bos_token = hf.id_to_token(bos[0])

        tok = cls(hf, chat_template=template, bos_token=bos_token, eos_token=eos_token,
                  add_bos_token=bool(tc.get("add_bos_token", False)), eos_ids=eos_ids,
                  extra_special=extra, name=str(folder))
        if not tok.eos_ids:
            log.warning("%s declares no EOS token (generation_config.json / config.json / "
                        "tokenizer_config.json); generation will stop only at max_new_tokens",
                        folder)
        return tok

    # -- plain text --

    @property
    def has_chat_template(self) -> bool:
        """True when the folder ships a chat template."""
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids (list[int]).

        Special tokens written in ``text`` (e.g. ``<|endoftext|>``) become their single id.
        ``add_special_tokens=True`` runs the tokenizer's post-processor and, when
        tokenizer_config.json says add_bos_token, makes sure the ids start with one BOS.
        """
        ids = list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            ids = self._ensure_bos(ids)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text. Special tokens (EOS, ...) are dropped unless
        ``skip_special_tokens=False``. Incomplete UTF-8 sequences decode to U+FFFD."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None."""
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id, or None."""
        return self._hf.id_to_token(int(token_id))

    def _ensure_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            return [self.bos_id] + ids
        return ids

    # -- chat --

    def apply_chat_template(self, messages: Iterable[MessageLike],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render a conversation with the model's own chat template -> prompt text.

        ``messages``: ChatMessage objects or dicts with "role" and "content".
        ``extra``: more template variables (e.g. ``tools``), passed as is.
        Raises TokenizerError when the model has no chat template (never falls back to a
        template of another model), when the template does not compile, raises (its
        ``raise_exception``) or tries an unsafe operation in the sandbox.
        """
        if not self.has_chat_template:
            raise TokenizerError(
                f"{self.name} has no chat template (tokenizer_config.json chat_template / "
                f"chat_template.jinja); use a raw prompt instead of chat messages, or add the "
                f"model's chat template to the folder")
        if self._template is None:
            self._template = _compile_template(self.chat_template, self.name)
        msgs = [self._message_dict(m) for m in messages]
        variables: dict[str, Any] = dict(self._extra_special)
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(extra)
        variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt))
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template of {self.name} failed: {e}") from e
        except Exception as e:  # template code errors such as TypeError on bad messages
            raise TokenizerError(f"the chat template of {self.name} failed: "
                                 f"{type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Iterable[MessageLike],
                    add_generation_prompt: bool = True) -> list[int]:
        """Render the conversation and tokenize it -> list[int].

        Special tokens in the rendered text are parsed as single special ids. The
        post-processor is not run (templates write their own BOS); if tokenizer_config.json
        asks for add_bos_token and the text does not already start with BOS, one is
        prepended, so BOS is never doubled. Raises TokenizerError as apply_chat_template.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self._ensure_bos(self.encode(text, add_special_tokens=False))

    @staticmethod
    def _message_dict(m: MessageLike) -> dict[str, Any]:
        if isinstance(m, ChatMessage):
            return {"role": m.role, "content": m.content}
        if isinstance(m, Mapping):
            return dict(m)
        raise TokenizerError(f"chat messages must be ChatMessage or dicts with role and "
                             f"content, got {type(m).__name__}")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` over this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streams token ids to text without ever emitting a broken UTF-8 character.

    The approach of HF TextStreamer / vLLM: decode the window ``ids[prefix_offset:]`` and
    the already-emitted part ``ids[prefix_offset:read_offset]``; emit the new suffix only
    when the window's text does not end in U+FFFD (an incomplete character), then slide
    the window. ``push`` returns "" while a character is incomplete; ``flush`` emits
    whatever is held back at the end. The concatenation of all pushes and the flush equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``.

    ``prefix_ids``: optional context ids (e.g. the prompt tail) decoded with the window so
    decoders that treat the first token specially (SentencePiece's leading space) stream
    correctly; their text is not emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prefix_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prefix_ids]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one generated id -> the newly completed text (str, possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """End of generation -> the held-back text (may contain U+FFFD for a truncated
        character, exactly as ``decode`` would). Call it once, after the last push."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
