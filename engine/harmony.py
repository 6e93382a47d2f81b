"""The harmony response format of gpt-oss: generated token ids -> displayed text.

gpt-oss answers in messages on *channels* (OpenAI's harmony format, the model card of
gpt-oss-120b / gpt-oss-20b and the openai/harmony renderer describe it):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the prompt ends with ``<|start|>assistant``, so the first message's header starts at
``<|channel|>``). Tool calls are ``<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>ARGS<|call|>``. Every marker is a special token, so a plain decode (special tokens
skipped) would run the channel names into the text ("analysisREASONING...finalANSWER").

:class:`HarmonyDecoder` streams the ids like :class:`engine.tokenizer.IncrementalDecoder` but
follows the message structure: headers (role, channel, recipient, constraint) are not shown;
the content of analysis messages is wrapped in one ``<think>...</think>`` block, so the engine's
reasoning split (:func:`engine.chat_template.split_reasoning`, the server's ReasoningSplitter,
the app's collapsed reasoning view) treats it as every other model's reasoning; final and
commentary content is the answer. A saved answer ``<think>R</think>A`` goes back to the template
as ``thinking`` / ``reasoning_content`` R and ``content`` A (chat_template.history_message), the
fields gpt-oss templates read.

:func:`is_harmony` decides from the tokenizer: the four markers are special tokens and a chat
template writes ``<|channel|>``.
"""

from __future__ import annotations

from typing import Sequence

from .detokenizer import IncrementalDecoder

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # each ends a message
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HEADER_LIMIT = 32  # ids a header may take before <|message|>; beyond it (and with no <|channel|>) it is text
CALL_MARK, ARGS_MARK = "<|channel|>", "<|message|>"  # around a call's header with show_calls


def is_harmony(tokenizer) -> bool:
    """True when ``tokenizer`` (engine.tokenizer.Tokenizer) speaks harmony: <|start|>,
    <|channel|>, <|message|> and <|end|> are special tokens and a chat template uses <|channel|>."""
    added = getattr(tokenizer, "added_tokens", {})
    return (all(added.get(m) for m in MARKERS)
            and any("<|channel|>" in t for t in tokenizer.chat_templates.values()))


class HarmonyDecoder:
    """Streams generated ids to text along the harmony messages (see the module docstring).

    ``push(id) -> str`` (possibly ""), ``flush() -> str`` once at the end, like
    IncrementalDecoder. The concatenation of all pushes and the flush is: for each message in
    order, its content (decoded as :meth:`Tokenizer.decode` decodes it, special tokens dropped),
    with a run of consecutive analysis messages inside ``<think>`` ... ``</think>`` (closed when
    a message of another channel starts, or at the end). A message whose header names no
    channel counts as final. Header text (role, channel name, ``to=...``, ``<|constrain|>json``)
    is never shown, except for output that never follows the format: more than HEADER_LIMIT ids
    with no <|channel|> and no <|message|> are shown as a final message. With ``show_calls``
    (the server, when the request offers tools), a message addressed ``to=functions.NAME`` is
    shown as ``<|channel|>HEADER<|message|>ARGUMENTS`` (HEADER as written, special tokens shown).
    """

    HEADER, CONTENT = "header", "content"

    def __init__(self, tokenizer, show_calls: bool = False) -> None:
        self._tok = tokenizer
        self.show_calls = show_calls
        self._make = lambda: IncrementalDecoder(tokenizer)
        self._id = {m: tokenizer.token_to_id(m) for m in MARKERS + ENDS}
        self._ends = {self._id[m] for m in ENDS if self._id[m] is not None}
        self.state = self.HEADER  # the prompt's <|start|>assistant opened the first header
        self._header: list[int] = []
        self._content = None
        self._channel = "final"
        self._in_think = False
        self.channels: list[str] = []  # the channel of every message so far (for callers / tests)
        self._pending = ""  # text a continued message's header opened, shown with the first push

    def _channel_of(self, header: Sequence[int]) -> str:
        """The channel a header names: the first word after <|channel|> (final if none)."""
        ch = self._id["<|channel|>"]
        if ch not in header:
            return "final"
        after = list(header[header.index(ch) + 1:])
        words = self._tok.decode(after).split()
        return words[0] if words else "final"

    def continuing(self, header: Sequence[int]) -> "HarmonyDecoder":
        """Start inside the message whose header (the ids between ``<|start|>`` and
        ``<|message|>``) the prompt already wrote: the answer continues a prefilled message, so
        its first ids are content, not a header. Returns self."""
        self._header = list(header)
        self._pending = self._open()
        return self

    def _open(self) -> str:
        self._channel = self._channel_of(self._header)
        self.channels.append(self._channel)
        header = self._tok.decode(self._header, skip_special_tokens=False)
        self._header = []
        self._content = self._make()
        self.state = self.CONTENT
        if self.show_calls and " to=functions." in " " + header.replace("<|channel|>", " "):
            # a function call: shown with its header, so the caller can parse name and arguments
            out = THINK_CLOSE if self._in_think else ""
            self._in_think = False
            return out + CALL_MARK + header.split("<|channel|>")[-1] + ARGS_MARK
        if self._channel == "analysis" and not self._in_think:
            self._in_think = True
            return THINK_OPEN
        if self._channel != "analysis" and self._in_think:
            self._in_think = False
            return THINK_CLOSE
        return ""

    def push(self, token_id: int) -> str:
        """One generated id -> the newly shown text."""
        if self._pending:
            out, self._pending = self._pending, ""
            return out + self.push(token_id)
        t = int(token_id)
        if self.state == self.CONTENT:
            if t in self._ends or t == self._id["<|start|>"]:
                out = self._content.flush()
                self._content = None
                self.state = self.HEADER
                return out
            return self._content.push(t)
        if t == self._id["<|message|>"]:
            return self._open()
        if t == self._id["<|start|>"]:
            self._header = []
            return ""
        self._header.append(t)
        if len(self._header) > HEADER_LIMIT and self._id["<|channel|>"] not in self._header:
            # no harmony header after all (a model that does not follow the format): show it all
            ids, self._header = self._header, []
            out = self._open()
            return out + "".join(self._content.push(i) for i in ids)
        return ""

    def flush(self) -> str:
        """End of generation -> the held-back text (and the closing </think> of an open block)."""
        out, self._pending = self._pending, ""
        out += self._content.flush() if self._content is not None else ""
        self._content = None
        if self._in_think:
            self._in_think = False
            out += THINK_CLOSE
        return out
