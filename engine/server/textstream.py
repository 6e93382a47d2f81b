"""Streaming text filters of the server: stop strings and the ``<think>`` reasoning split.

Both work on the text of each token as it is decoded (``TokenEvent.text``) and never take back
what they emitted, so the concatenated deltas of a streamed answer equal the text of the same
answer returned whole (the server runs the same filters for both). :class:`AnswerFilter` chains
them: the reasoning split first, then the stop strings on the answer only (a stop string the
model writes while reasoning does not end the answer, as in llama.cpp's server and vLLM).
"""

from __future__ import annotations

from ..chat_template import THINK_CLOSE, THINK_OPEN


def _held_suffix(text: str, needles) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``needles``
    (text that may still become a needle once more text arrives)."""
    best = 0
    for n in needles:
        for k in range(min(len(n) - 1, len(text)), best, -1):
            if text.endswith(n[:k]):
                best = k
                break
    return best


class StopMatcher:
    """OpenAI ``stop`` strings: the text before the first occurrence of any of them is kept,
    the stop string and everything after it are dropped.

    ``push(text) -> (emit, stopped)``: the text that is certain not to be part of a stop string
    (a suffix that may begin one is held back), and True once a stop string appeared.
    ``flush() -> str``: at the end of the generation, the held-back text (no stop appeared).
    """

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf, False
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            self._held, self.stopped = "", True
            return buf[:cut], True
        k = _held_suffix(buf, self.stops)
        self._held = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k], False

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class ReasoningSplitter:
    """Splits a streamed answer into reasoning and content, as ``engine.split_reasoning`` splits
    a whole one (the app shows the same split): a leading ``<think>R</think>A`` block gives
    reasoning R (surrounding newlines stripped) and content A (leading newlines stripped).

    ``prompt_opened``: the rendered prompt ended with ``<think>`` (templates that open the block
    for the model), so the answer starts inside the reasoning. Without it, text that does not
    start with ``<think>`` is all content (a streamed delta is never taken back, so a ``</think>``
    later in such an answer stays content).

    ``push(text) -> (reasoning_delta, content_delta)``; ``flush()`` at the end, the same pair.
    ``saw_reasoning``: a reasoning block was opened.
    """

    START, REASON, ANSWER = "start", "reason", "answer"

    def __init__(self, prompt_opened: bool = False):
        self.state = self.REASON if prompt_opened else self.START
        self.saw_reasoning = prompt_opened
        self._buf = ""            # START: text not decided yet; REASON: text not emitted yet
        self._r_started = False   # reasoning text emitted (leading newlines dropped before)
        self._a_started = False   # content emitted (leading newlines dropped before, after a block)

    def push(self, text: str) -> tuple[str, str]:
        if self.state == self.ANSWER:
            return "", self._answer(text)
        self._buf += text
        if self.state == self.START:
            body = self._buf.lstrip()
            if len(body) < len(THINK_OPEN) and THINK_OPEN.startswith(body):
                return "", ""
            if not body.startswith(THINK_OPEN):
                self.state, out, self._buf, self._a_started = self.ANSWER, self._buf, "", True
                return "", out
            self.state, self.saw_reasoning = self.REASON, True
            self._buf = body[len(THINK_OPEN):]
        close = self._buf.find(THINK_CLOSE)
        if close >= 0:
            reasoning, rest = self._buf[:close], self._buf[close + len(THINK_CLOSE):]
            self._buf, self.state = "", self.ANSWER
            return self._reasoning(reasoning.rstrip("\n")), self._answer(rest)
        hold = _held_suffix(self._buf, (THINK_CLOSE,))
        ready = self._buf[:len(self._buf) - hold]
        keep = len(ready) - len(ready.rstrip("\n"))  # trailing newlines wait: they may end the block
        ready = ready[:len(ready) - keep]
        self._buf = self._buf[len(ready):]
        return self._reasoning(ready), ""

    def flush(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self.state == self.START:
            self.state = self.ANSWER
            return "", buf
        if self.state == self.REASON:
            return self._reasoning(buf.rstrip("\n")), ""
        return "", ""

    def _reasoning(self, text: str) -> str:
        if not self._r_started:
            text = text.lstrip("\n")
            self._r_started = bool(text)
        return text

    def _answer(self, text: str) -> str:
        if not self._a_started:
            text = text.lstrip("\n")
            self._a_started = bool(text)
        return text


class AnswerFilter:
    """Reasoning split (chat only), then function calls (when ``calls``, a
    engine.server.tools.CallSplitter, is given: text from a call's start on is kept for
    parsing), then stop strings on the content.

    ``push(text) -> (reasoning, content, stopped)``: the deltas of one token's text, and True
    once a stop string appeared in the content (nothing more comes after it);
    ``flush() -> (reasoning, content)`` at the end of the generation; ``calls``: the parsed
    calls after flush (engine.server.tools.Call; empty when none or malformed).
    """

    def __init__(self, stops: tuple[str, ...] = (), chat: bool = False, prompt_opened: bool = False,
                 calls=None):
        self.stop = StopMatcher(stops)
        self.split = ReasoningSplitter(prompt_opened) if chat else None
        self.splitter = calls
        self.calls: list = []

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def push(self, text: str) -> tuple[str, str, bool]:
        if self.stop.stopped:
            return "", "", True
        r, c = self.split.push(text) if self.split is not None else ("", text)
        if self.splitter is not None:
            c = self.splitter.push(c)
        c, stopped = self.stop.push(c)
        return r, c, stopped

    def flush(self) -> tuple[str, str]:
        if self.stop.stopped:
            return "", ""
        r, c = self.split.flush() if self.split is not None else ("", "")
        if self.splitter is not None:
            c = self.splitter.push(c)
            rest, self.calls = self.splitter.finish()
            c += rest
        c, stopped = self.stop.push(c)
        return r, c if stopped else c + self.stop.flush()
