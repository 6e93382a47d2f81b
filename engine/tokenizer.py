"""Tokenizer, chat template and streaming detokenizer for a Hugging Face model folder.

The tokenizer itself is the model's ``tokenizer.json`` run by the ``tokenizers`` library.
Chat templates are loaded, chosen and rendered exactly as transformers' ``apply_chat_template``
does (see chat_template.py); :meth:`Tokenizer.encode_chat` encodes the rendering so that only
the template's own markers become control-token ids: a control token typed or pasted by the user
is encoded as plain text (transformers' ``sanitize_control_tokens=True``).

The stop set (``eos_ids``) is the union of every EOS id the folder declares:
``generation_config.json`` (often a list), ``config.json`` (its text config's for a multimodal
model, as transformers reads it) and the ``eos_token`` of ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from . import chat_template as ct
from .chat_template import check_not_lfs_pointer as _check_not_lfs_pointer
from .detokenizer import IncrementalDecoder
from .errors import TokenizerError
from .events import ChatMessage
from .harmony import HarmonyDecoder, is_harmony
from .thought_channel import ThoughtChannelDecoder, is_thought_channel

log = logging.getLogger(__name__)



# --- file helpers -----------------------------------------------------------------------


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


def _config_eos(cfg: dict) -> list[int]:
    """config.json's EOS ids as transformers' GenerationConfig.from_model_config reads them: the
    top level's ``eos_token_id``, else its decoder's (``decoder``, ``generator`` or ``text_config``:
    a multimodal model such as Llama 4 or Gemma 4 keeps it there only)."""
    ids = _id_list(cfg.get("eos_token_id"))
    if ids:
        return ids
    for key in ("decoder", "generator", "text_config"):
        if isinstance(sub := cfg.get(key), dict) and sub:
            return _id_list(sub.get("eos_token_id"))
    return []


# --- tokenizer ----------------------------------------------------------------------------


MessageLike = ChatMessage | Mapping[str, Any]


class Tokenizer:
    """A model's tokenizer (``tokenizers.Tokenizer``) plus its chat templates and EOS ids.

    Build it with :meth:`from_dir`. Attributes:
      eos_ids: frozenset[int], every id that ends a generation.
      vocab_size: int, tokenizer vocabulary including added tokens (may be smaller than the
        model's embedding rows, which are often padded).
      has_chat_template: bool.
      chat_template: str | None, the default template (``chat_templates["default"]``).
      chat_templates: dict[str, str], every named template ("default", "tool_use", ...).
      special_tokens: dict[str, str], the named special tokens of tokenizer_config.json that
        templates see (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
        mask_token; only those declared).
      bos_token / eos_token: str | None, the BOS / EOS strings (eos falls back to the first
        EOS id of generation_config.json / config.json).
      bos_id: int | None, the id of bos_token.
      add_bos_token: bool, from tokenizer_config.json.
      name: str, the folder (used in error messages).
    """

    def __init__(self, hf: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, eos_ids: Iterable[int] = (),
                 extra_special: Mapping[str, str] | None = None, name: str = "tokenizer",
                 chat_templates: Mapping[str, str] | None = None,
                 chat_control_tokens: Sequence[str] | None = None) -> None:
        self._hf = hf
        self.name = name
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        if chat_template is not None:
            self.chat_templates["default"] = chat_template
        self.chat_template: str | None = self.chat_templates.get("default")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = bool(add_bos_token)
        self.bos_id: int | None = hf.token_to_id(bos_token) if bos_token else None
        ids = set(int(i) for i in eos_ids)
        if eos_token is not None and (eid := hf.token_to_id(eos_token)) is not None:
            ids.add(eid)
        self.eos_ids: frozenset[int] = frozenset(ids)
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (extra_special or {}).items() if k in ct.SPECIAL_TOKEN_NAMES}
        for k, v in (("bos_token", bos_token), ("eos_token", eos_token)):
            if v is not None:
                self.special_tokens.setdefault(k, v)
        self._chat_control_tokens = (list(chat_control_tokens)
                                     if chat_control_tokens is not None else None)
        self._added = {t.content: bool(t.special) for _, t in
                       sorted(hf.get_added_tokens_decoder().items())}
        self._newline_ids: list[int] | None = None
        self._max_token_chars: int | None = None

    @property
    def added_tokens(self) -> dict[str, bool]:
        """The added tokens' texts (the chat markers, tool-call tags...) -> whether each is
        special, in id order."""
        return self._added

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` underneath (as transformers' fast tokenizers name it),
        for libraries that build on its JSON form (the server's grammar mask)."""
        return self._hf

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (at least 1): a text of n characters
        takes at least n / max_token_chars tokens unless the normalizer removes characters
        (a byte-level entry's characters stand for bytes, never fewer than the text's)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max((len(t) for t in self._hf.get_vocab(with_added_tokens=True)),
                                               default=1))
        return self._max_token_chars

    # -- construction --

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, the chat templates and the EOS ids of a model folder.

        Reads tokenizer.json (required), tokenizer_config.json, special_tokens_map.json,
        chat_template.jinja,
        additional_chat_templates/*.jinja and chat_template.json (see
        chat_template.load_chat_templates for the precedence), generation_config.json and
        config.json (all optional).
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
        templates = ct.load_chat_templates(folder, tc)

        # the named special tokens as templates see them: tokenizer_config.json's, overridden by
        # an older special_tokens_map.json (as transformers loads them)
        stm = _read_json(folder / "special_tokens_map.json")
        stm = stm if isinstance(stm, dict) else {}
        declared = {k: s for k in ct.SPECIAL_TOKEN_NAMES
                    if (s := _token_str(stm[k] if k in stm else tc.get(k))) is not None}
        bos_token = declared.get("bos_token")
        eos_token = declared.get("eos_token")

        eos_ids: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            cfg = _read_json(folder / fname)
            if isinstance(cfg, dict):
                eos_ids += _config_eos(cfg) if fname == "config.json" else _id_list(cfg.get("eos_token_id"))
        if eos_token is None and eos_ids:
            eos_token = hf.id_to_token(eos_ids[0])
        if bos_token is None:
            gc = _read_json(folder / "generation_config.json")
            bos = _id_list(gc.get("bos_token_id")) if isinstance(gc, dict) else []
            if bos:
                bos_token = hf.id_to_token(bos[0])
        control = tc.get("chat_control_tokens")
        if control is not None and not (isinstance(control, list)
                                        and all(isinstance(t, str) for t in control)):
            raise TokenizerError(f"{tc_path}: chat_control_tokens must be a list of strings")

        tok = cls(hf, bos_token=bos_token, eos_token=eos_token,
                  add_bos_token=bool(tc.get("add_bos_token", False)), eos_ids=eos_ids,
                  extra_special=declared, name=str(folder), chat_templates=templates,
                  chat_control_tokens=control)
        # a token the folder did not declare is not shown to templates (as transformers)
        tok.special_tokens = declared
        if not tok.eos_ids:
            log.warning("%s declares no EOS token (generation_config.json / config.json / "
                        "tokenizer_config.json); generation will stop only at max_new_tokens",
                        folder)
        return tok

    # -- plain text --

    @property
    def has_chat_template(self) -> bool:
        """True when the folder ships a chat template (else only raw prompts can be run)."""
        return bool(self.chat_templates)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids (list[int]). This is raw mode: the text is the prompt.

        Special tokens written in ``text`` (e.g. ``<|endoftext|>``) become their single id.
        ``add_special_tokens=True`` runs the tokenizer's post-processor and, when
        tokenizer_config.json says add_bos_token, makes sure the ids start with one BOS.
        """
        # encode_batch releases the GIL while it works (encode holds it: ~0.3 s for 200 KB of
        # text, a frozen window when the app's worker thread tokenizes a long paste)
        ids = list(self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if add_special_tokens:
            ids = self._ensure_bos(ids)
        return ids

    def encode_as_text(self, text: str) -> list[int]:
        """Text -> ids with no added token recognised at all (special or not): ``<|im_end|>``
        becomes the ids of its characters. Runs normalizer, pre-tokenizer and model, as
        transformers' ``_encode_without_added_tokens``."""
        hf = self._hf
        if hf.normalizer is not None:
            text = hf.normalizer.normalize_str(text)
        splits = [text]
        if hf.pre_tokenizer is not None:
            splits = [s for s, _ in hf.pre_tokenizer.pre_tokenize_str(text)]
        return [t.id for s in splits for t in hf.model.tokenize(s)]

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

    def chat_template_source(self, name: str | None = None, tools: Any = None) -> str:
        """The template that a chat with these ``tools`` renders with (transformers' choice:
        ``name``, else ``tool_use`` when tools are given, else ``default``). Raises
        TokenizerError when the model has no chat template."""
        return ct.select_template(self.chat_templates, name, tools is not None, self.name)

    def apply_chat_template(self, messages: Iterable[MessageLike],
                            add_generation_prompt: bool = True, *, tools: Any = None,
                            documents: Any = None, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """Render a conversation with the model's own chat template -> prompt text, identical
        to transformers' ``apply_chat_template(..., tokenize=False)``.

        ``messages``: ChatMessage objects (an assistant ChatMessage is passed through
        chat_template.history_message: a leading <think> block goes to ``reasoning_content``)
        or dicts with "role", "content" and any other field (tool_calls, ...), passed as is.
        ``tools``: JSON-schema dicts; ``documents``: dicts; ``chat_template``: a template name;
        ``template_kwargs``: more template variables (``enable_thinking=False``, ...).
        Raises TokenizerError when the model has no chat template (never falls back to a
        template of another model), when the template does not compile, raises (its
        ``raise_exception``) or tries an unsafe operation in the sandbox.
        """
        source = self.chat_template_source(chat_template, tools)
        return ct.render(source, self.name, [self._message_dict(m) for m in messages],
                         tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt,
                         special_tokens=self.special_tokens, template_kwargs=template_kwargs)

    def encode_chat(self, messages: Iterable[MessageLike],
                    add_generation_prompt: bool = True, *, tools: Any = None,
                    documents: Any = None, chat_template: str | None = None,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """Render the conversation and tokenize it -> list[int], control-token safe.

        The ids equal transformers' ``apply_chat_template(..., tokenize=True,
        sanitize_control_tokens=True)``: control tokens written by the template become their
        ids; a control token inside a message, tool, document or template keyword (a pasted
        ``<|im_end|>``) is encoded as plain text (see chat_template.py). A conversation without
        such text gives exactly the ids of tokenizing the rendered string. If
        tokenizer_config.json asks for add_bos_token and the ids do not start with BOS, one is
        prepended (BOS is never doubled). ``continue_final_message``: the prompt ends inside the
        last message, right after its text (an assistant "prefill" the answer continues), as
        transformers' option of that name; ``add_generation_prompt`` is then ignored. Raises
        TokenizerError as apply_chat_template, when a control token cannot be written as plain
        text in this vocabulary, or when the last message's text cannot be found in the rendering.
        """
        source = self.chat_template_source(chat_template, tools)
        control = ct.ControlTokens.build(self._added, source, self._chat_control_tokens)
        msgs = control.mark(ct.normalize_messages([self._message_dict(m) for m in messages]))
        rendered = ct.render(source, self.name, msgs, tools=control.mark(tools),
                             documents=control.mark(documents),
                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                             special_tokens=self.special_tokens,
                             template_kwargs=control.mark(template_kwargs))
        if continue_final_message:
            rendered = ct.cut_after_final_message(rendered, msgs)
        return self._ensure_bos(self._encode_marked(rendered, control))

    def _encode_marked(self, rendered: str, control: ct.ControlTokens) -> list[int]:
        """Ids of a rendering whose caller-supplied control tokens are marked: marked tokens
        as plain text, the rest normally. Each piece after the first is encoded behind a
        newline that is then removed, so SentencePiece adds no prefix space mid-chat (the
        method of transformers' encode_marked_chat)."""
        pieces = control.marker_re().split(rendered)
        ids = self.encode(pieces[0])
        if len(pieces) == 1:
            return ids
        if self._newline_ids is None:
            self._newline_ids = self.encode("\n")
        nl = self._newline_ids
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue  # a lone marker: dropped, but it still separated the text around it
            as_text = i % 2 == 1
            enc = self.encode_as_text if as_text else self.encode
            piece_ids = enc("\n" + piece)
            piece_ids = piece_ids[len(nl):] if piece_ids[:len(nl)] == nl else enc(piece)
            if as_text and self._hf.token_to_id(piece) in piece_ids:
                raise TokenizerError(
                    f"{self.name}: the control token {piece!r} in a message cannot be encoded as "
                    f"plain text (this tokenizer produces it from its characters); remove it "
                    f"from the message")
            ids += piece_ids
        return ids

    @staticmethod
    def _message_dict(m: MessageLike) -> dict[str, Any]:
        if isinstance(m, ChatMessage):
            return ct.history_message(m.role, m.content)
        if isinstance(m, Mapping):
            return dict(m)
        raise TokenizerError(f"chat messages must be ChatMessage or dicts with role and "
                             f"content, got {type(m).__name__}")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` over this tokenizer; for a harmony tokenizer
        (gpt-oss, engine/harmony.py) with special tokens skipped, a HarmonyDecoder, which shows
        the analysis channel as a leading <think>...</think> block and the final channel as the answer;
        for Gemma 4's channels (engine/thought_channel.py), with or without the special tokens
        shown, a ThoughtChannelDecoder, which shows the thought channel as that block."""
        if skip_special_tokens and is_harmony(self):
            return HarmonyDecoder(self)
        if is_thought_channel(self):
            return ThoughtChannelDecoder(self, skip_special_tokens=skip_special_tokens)
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)
