"""Gemma 4's thought channel: generated token ids -> displayed text with the reasoning in a
leading ``<think>...</think>`` block.

With thinking on (``enable_thinking``), Gemma 4 answers

    <|channel>thought\\nREASONING\\n<channel|>ANSWER<turn|>

(the published template renders a kept reasoning the same way, and strips a ``<|channel>...
<channel|>`` span from old answers). Both markers are special tokens, so a plain decode would
run the channel name and the reasoning into the answer ("thought\\nREASONING\\nANSWER").
:class:`ThoughtChannelDecoder` streams the ids like :class:`engine.detokenizer.IncrementalDecoder`
but shows ``<|channel>NAME\\n`` as ``<think>`` and ``<channel|>`` as ``</think>``, so the
engine's reasoning split (:func:`engine.chat_template.split_reasoning`, the server's
ReasoningSplitter and reasoning_content, the app's collapsed reasoning view) treats it as every
other model's reasoning, as engine/harmony.py does for gpt-oss's analysis channel.
"""

from __future__ import annotations

from .detokenizer import IncrementalDecoder

OPEN, CLOSE = "<|channel>", "<channel|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NAME_LIMIT = 64  # characters a channel name may take before its newline; beyond, they are reasoning


def is_thought_channel(tokenizer) -> bool:
    """True when ``tokenizer`` (engine.tokenizer.Tokenizer) writes Gemma 4's channels:
    ``<|channel>`` and ``<channel|>`` are special tokens and a chat template uses them."""
    added = getattr(tokenizer, "added_tokens", {})
    return (bool(added.get(OPEN)) and bool(added.get(CLOSE))
            and any(OPEN in t for t in tokenizer.chat_templates.values()))


class ThoughtChannelDecoder:
    """``push(id) -> str`` (possibly ""), ``flush() -> str`` once at the end, like
    IncrementalDecoder (``skip_special_tokens`` as there, for the other special tokens). The
    concatenation of all pushes and the flush is the plain decode with every ``<|channel>``
    id and the channel name after it (up to and with its newline) replaced by ``<think>``, and
    every ``<channel|>`` id that closes one by ``</think>`` (one with no channel open decodes as
    the plain special token: skipped, or shown with the special tokens). A block the generation
    leaves open stays open (the answer was cut while thinking), as a ``<think>`` block of the
    other families does."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._make = lambda: IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self._open, self._close = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
        self._text = self._make()
        self._name: str | None = None  # the channel name read so far (None: not in a header)
        self._inside = False  # a channel is open (a <channel|> without one is a plain special token)

    def push(self, token_id: int) -> str:
        """One generated id -> the newly shown text."""
        t = int(token_id)
        if t == self._open:
            out = self._end_name() + self._text.flush()
            self._text, self._name, self._inside = self._make(), "", True
            return out + THINK_OPEN
        if t == self._close and self._inside:
            self._inside = False
            out = self._text.flush()
            self._text = self._make()
            if self._name is not None:  # an empty channel (no newline after its name)
                self._name, out = None, ""
            return out + THINK_CLOSE
        return self._shown(self._text.push(t))

    def flush(self) -> str:
        """End of generation -> the held-back text (a channel name cut before its newline is
        a header, not shown)."""
        out = self._shown(self._text.flush())
        self._name = None
        return out

    def _shown(self, text: str) -> str:
        if self._name is None:
            return text
        self._name += text
        nl = self._name.find("\n")
        if nl >= 0:
            rest, self._name = self._name[nl + 1:], None
            return rest
        return self._end_name() if len(self._name) > NAME_LIMIT else ""

    def _end_name(self) -> str:
        """A header that ran past NAME_LIMIT or into another channel: its text is shown as reasoning."""
        name, self._name = self._name, None
        return name or ""
