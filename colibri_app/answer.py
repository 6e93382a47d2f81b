"""The answer being written: one object owns its text from the first token to the saved row.

:class:`AnswerStream` belongs to one conversation (``conv_id``) and one assistant message
(``asst_id``). The main window hands it the engine's events for the running generation; it
keeps the text (shown + not yet shown), the token count and the last metrics, shows new text
in the chat view at most every :data:`FLUSH_MS` when that conversation is on screen (and
the whole text again when the user comes back to it), and writes the message to the history:
a crash-safety checkpoint at most every :data:`SAVE_EVERY_S` while streaming (status
"streaming"; the next start marks it "interrupted") and every piece shown in between appended
(:meth:`History.append_stream`), so a kill -9 loses nothing that was on screen; then once with its final status, content
and numbers when it ends, is stopped, fails, or the window closes first.
Runs on the GUI thread only (it touches widgets and the history).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer

from engine import ErrorKind, Finished, StepMetrics, TokenEvent

from .history import COMPLETE, ERROR, STOPPED, STREAMING, History, _num

FLUSH_MS = 40          # streamed text reaches the transcript at most every 40 ms
SAVE_EVERY_S = 1.0     # crash-safety checkpoint of a streaming answer, at most once per second


@dataclass(frozen=True)
class AnswerEnd:
    """How an answer ended: ``status`` (history status: complete, stopped or error), the text
    kept (may be empty: then the answer row was removed), and for errors the banner ``kind``
    and ``message``."""

    status: str
    text: str
    kind: str = ""
    message: str = ""


class AnswerStream(QObject):
    """The answer in progress of conversation ``conv_id`` (see the module docstring).

    Args:
        history: the open History (the assistant row ``asst_id`` exists, status "streaming").
        chat: the ChatView; the answer's card is ``chat.view(asst_id)`` while that conversation
            is shown, else None.
        job: the engine job (``job.cancel`` is its stop flag).
        conv_id, user_id, asst_id: history ids of the conversation, the question, the answer.
    """

    def __init__(self, history: History, chat, job, conv_id: int, user_id: int, asst_id: int,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.history, self.chat, self.job = history, chat, job
        self.conv_id, self.user_id, self.asst_id = conv_id, user_id, asst_id
        self.text = ""        # shown in the card (and checkpointed)
        self.pending = ""     # received, not shown yet
        self.tokens = 0       # TokenEvents received
        self.metrics: StepMetrics | None = None
        self.ended: AnswerEnd | None = None
        self._last_save = time.monotonic()
        self.timer = QTimer(self)
        self.timer.setInterval(FLUSH_MS)
        self.timer.timeout.connect(self.flush)
        self.timer.start()

    @property
    def full_text(self) -> str:
        """Everything received so far."""
        return self.text + self.pending

    # --- engine events ------------------------------------------------------------------------

    def on_token(self, ev: TokenEvent) -> None:
        """Buffer a token's text (the flush timer shows it)."""
        if self.ended is None:
            self.pending += ev.text
            self.tokens += 1

    def on_metrics(self, m: StepMetrics) -> None:
        """Keep the latest per-token counters."""
        self.metrics = m

    def flush(self) -> None:
        """Show the buffered text in the card (if on screen); checkpoint it now and then."""
        if not self.pending or self.ended is not None:
            return
        piece, self.pending = self.pending, ""
        self.text += piece
        v = self.chat.view(self.asst_id)
        if v is not None:
            v.append_stream(piece)
        now = time.monotonic()
        if now - self._last_save >= SAVE_EVERY_S:
            self.history.update_message(self.asst_id, content=self.text)
            self._last_save = now
        else:  # what is shown is saved: a kill -9 now loses nothing of it
            self.history.append_stream(self.asst_id, piece)

    def show(self) -> None:
        """The conversation is on screen again (its cards were rebuilt from the history):
        put the whole text received so far into the answer's card."""
        self.text, self.pending = self.full_text, ""
        v = self.chat.view(self.asst_id)
        if v is not None and self.ended is None:
            v.set_content(self.text, STREAMING)

    # --- the end ------------------------------------------------------------------------------

    def finish(self, ev: Finished) -> AnswerEnd:
        """The engine's Finished: save the answer once with its status and numbers."""
        if ev.finish_reason == "error":
            return self.fail(ev.error or "The engine stopped with an error.", ErrorKind.GENERATION, ev)
        status = STOPPED if ev.finish_reason == "cancelled" else COMPLETE
        text = ev.text if ev.text or not self.full_text else self.full_text
        meta = {"tokens": ev.generated_tokens, "prompt_tokens": ev.prompt_tokens,
                "tok_per_s": round(ev.decode_tok_per_s, 2), "ttft_s": round(ev.ttft_s, 3),
                "hit_rate": round(ev.hit_rate, 4), "mb_per_token": round(ev.mb_per_token, 3),
                "finish_reason": ev.finish_reason}
        if ev.draft_tokens:  # speculative decoding drafted: its yield is shown with the answer
            meta["tokens_per_forward"] = round(ev.tokens_per_forward, 3)
            meta["draft_acceptance"] = round(ev.draft_acceptance, 3)
        if ev.dropped_messages:
            meta["dropped_messages"] = ev.dropped_messages
        if ev.sources:  # the documentation lookup's entries the model was given with the question
            meta["sources"] = list(ev.sources)
            meta["source_summaries"] = list(ev.source_summaries)
        if ev.finish_reason == "length" and 0 < ev.answer_room <= ev.generated_tokens and \
                ev.answer_room < self.job.request.sampling.max_new_tokens:
            meta["context_full"] = True
        if ev.seed is not None:  # shown under a sampled answer: Settings > Seed = it reproduces the answer
            row = self.history.message(self.asst_id)
            if row is None or _num(row.sampling.get("temperature", 1.0)) > 0:
                meta["seed"] = ev.seed
        self.history.update_message(self.asst_id, content=text, status=status, meta=meta)
        self.history.touch(self.conv_id)
        self._show_final(text, status, meta)
        return self._end(AnswerEnd(status, text))

    def fail(self, message: str, kind: ErrorKind, ev: Finished | None = None) -> AnswerEnd:
        """The generation failed (failed signal, or Finished with an error): keep what was
        written as an error answer; with nothing written, drop the answer row and mark the
        question as failed (so it stays out of the next context)."""
        text = ev.text if ev is not None and ev.text else self.full_text
        if text:
            meta = {"tokens": ev.generated_tokens, "finish_reason": "error"} if ev is not None else {}
            self.history.update_message(self.asst_id, content=text, status=ERROR, meta=meta)
            self._show_final(text, ERROR, meta)
        else:
            self.history.delete_message(self.asst_id)
            self.chat.remove_message(self.asst_id)
            self.history.update_message(self.user_id, status=ERROR)
            v = self.chat.view(self.user_id)
            if v is not None:
                v.set_content(v.content, ERROR)
        return self._end(AnswerEnd(ERROR, text, kind, message))

    def abandon(self) -> AnswerEnd:
        """No Finished will come (the window closes and the engine did not end in time):
        save what was received as a stopped answer."""
        text = self.full_text
        self.history.update_message(self.asst_id, content=text, status=STOPPED,
                                    meta={"finish_reason": "cancelled"})
        return self._end(AnswerEnd(STOPPED, text))

    def _show_final(self, text: str, status: str, meta: dict) -> None:
        v = self.chat.view(self.asst_id)
        if v is not None:
            v.set_content(text, status, meta)

    def _end(self, end: AnswerEnd) -> AnswerEnd:
        self.timer.stop()
        self.text, self.pending = end.text, ""
        self.ended = end
        return end
