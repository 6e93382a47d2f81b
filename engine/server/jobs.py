"""One engine, many clients: a bounded FIFO of generation jobs run one at a time.

A :class:`Job` is one request already tokenized (prompt ids, sampling, stop strings). The HTTP
side submits it to the :class:`JobQueue`; the queue's dispatcher thread hands jobs, in
submission order, to a *runner* that runs ``fn(engine)`` where the engine computes:
:class:`DirectRunner` on the dispatcher thread itself (``colibri serve``), or the app's engine
lane (the chat and the server share that one thread, colibri_app). :func:`run_job` turns the
engine's events into the job's deltas (the reasoning split, then stop strings on the answer,
applied on the engine thread, so a stop string ends the generation at the token that completed it) and its
final record. A job cancelled while waiting never reaches the engine; one cancelled while
running ends at the engine's next cancel check (after the current token).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import EngineError
from ..events import Finished, FinishReason, GenerateRequest, SamplingParams, StepMetrics, TokenEvent
from ..observers import Observer
from .textstream import AnswerFilter
from .tools import CallSplitter

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds its maximum of waiting jobs; ``retry_after_s`` estimates when to retry."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server is busy: {waiting} request{' is' if waiting == 1 else 's are'} waiting "
                         f"for the engine")
        self.waiting, self.retry_after_s = waiting, retry_after_s


class NoModel(Exception):
    """No model is open (the app is loading or switching models)."""


@dataclass
class JobResult:
    """How a job ended. finish_reason: "stop" (EOS or a stop string), "length" (max_tokens or
    the context), "cancelled" (the client left) or "error" (``error`` says what; ``status`` is
    the HTTP status to answer with). Token counts in tokens; prefill_tokens: prompt tokens
    actually computed (the rest came from the reused KV prefix)."""

    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0
    error: str = ""
    status: int = 200
    finished: Finished | None = None
    tool_calls: tuple = ()    # engine.server.tools.Call parsed from the answer
    stop_sequence: str | None = None  # the stop string that ended the answer


@dataclass(eq=False)
class Job:
    """One generation request.

    ids: prompt token ids; sampling: SamplingParams (max_new_tokens included); stops: stop
    strings; chat: split ``<think>`` reasoning from the content; prompt_opened: the prompt ends
    inside a reasoning block; emit: called on the engine thread with ``("delta", reasoning,
    content)`` and finally ``("done", JobResult)`` (must be thread-safe and quick);
    model_key: identity of the engine the ids were made for (the runner checks it).
    """

    ids: list[int]
    sampling: SamplingParams
    emit: Callable[[tuple], None]
    stops: tuple[str, ...] = ()
    chat: bool = False
    prompt_opened: bool = False
    model_key: object = None
    docs: tuple = ()               # the documentation entries given with the last question (DocEntry)
    tool_format: object = None     # engine.server.tools.ToolFormat: parse the calls of the answer
    tools: list | None = None      # the request's tools (parameter types for XML-style calls)
    constraint: object = None      # engine.server.grammar.TokenConstraint: the sampler's token mask
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "new"             # new, queued, running, done
    tokens: int = 0                # TokenEvents seen so far (engine thread)
    tokens_at_cancel: int | None = None  # tokens when a client disconnect set cancel
    t_submit: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0
    result: JobResult | None = None

    def client_gone(self) -> None:
        """The client disconnected: stop the generation (or never start it)."""
        if self.tokens_at_cancel is None and self.state != "done":
            self.tokens_at_cancel = self.tokens
        self.cancel.set()

    def finish(self, result: JobResult) -> None:
        self.result, self.state, self.t_end = result, "done", time.perf_counter()
        self.emit(("done", result))


class PrefillSpy(Observer):
    """Records the first forward call of a generation: ``pos0`` (KV rows reused from the
    previous conversation) and ``num_tokens`` (prompt tokens computed)."""

    def __init__(self):
        self.first: tuple[int, int] | None = None

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        if self.first is None:
            self.first = (int(pos0), int(num_tokens))


def run_job(engine, job: Job, stats=None) -> None:
    """Run ``job`` on ``engine`` (on the thread that computes) and emit its deltas and result.
    ``stats``: a ServerStats fed with the step metrics and the result. Never raises."""
    calls = CallSplitter(job.tool_format, job.tools) if job.tool_format is not None else None
    # with a call format the answer is decoded here, with the markers of calls shown
    dec = job.tool_format.decoder(engine.tokenizer) if job.tool_format is not None else None
    filt = AnswerFilter(job.stops, job.chat, job.prompt_opened, calls)
    spy = PrefillSpy()

    def deliver(r: str, c: str) -> None:
        if r or c:
            job.emit(("delta", r, c))

    stopped = False
    fin: Finished | None = None
    engine.model.subscribe(spy)
    try:
        events = engine.generate(GenerateRequest(prompt_ids=tuple(job.ids), sampling=job.sampling,
                                                   docs_entries=job.docs, constraint=job.constraint), job.cancel)
        for ev in events:
            if isinstance(ev, TokenEvent):
                job.tokens += 1
                if stopped:
                    continue
                r, c, stopped = filt.push(ev.text if dec is None else dec.push(ev.token_id))
                if stopped:
                    job.cancel.set()  # the engine ends right after this token
                deliver(r, c)
            elif isinstance(ev, StepMetrics):
                if stats is not None:
                    stats.on_step(ev)
            elif isinstance(ev, Finished):
                fin = ev
    except (EngineError, ValueError) as e:  # raised before any compute (request checks)
        result = JobResult("error", len(job.ids), 0, 0, str(e), 400)
        if stats is not None:
            stats.on_result(job, result)
        job.finish(result)
        return
    except Exception as e:  # noqa: BLE001 - reported to the client, never a crash of the queue
        log.exception("generation failed")
        result = JobResult("error", len(job.ids), 0, 0, f"{type(e).__name__}: {e}", 500)
        if stats is not None:
            stats.on_result(job, result)
        job.finish(result)
        return
    finally:
        engine.model.unsubscribe(spy)
    if dec is not None and not stopped:
        r, c, stopped = filt.push(dec.flush())
        deliver(r, c)
    deliver(*filt.flush())
    prefill = spy.first[1] if spy.first else 0
    if fin is None:
        result = JobResult("error", len(job.ids), job.tokens, prefill, "the engine ended without a result", 500)
    elif fin.finish_reason == FinishReason.ERROR:
        result = JobResult("error", fin.prompt_tokens, fin.generated_tokens, prefill, fin.error, 500, fin)
    else:
        reason = ("stop" if stopped or fin.finish_reason == FinishReason.STOP else
                  "cancelled" if fin.finish_reason == FinishReason.CANCELLED else "length")
        if filt.calls and reason == "stop":
            reason = "tool_calls"
        result = JobResult(reason, fin.prompt_tokens, fin.generated_tokens, prefill, finished=fin,
                           tool_calls=tuple(filt.calls), stop_sequence=filt.stop.matched)
    if stats is not None:
        stats.on_result(job, result)
    job.finish(result)


class DirectRunner:
    """Runs jobs on one engine, on the queue's dispatcher thread (``colibri serve``)."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, fn: Callable[[object], None], job: Job) -> None:
        fn(self.engine)


class JobQueue:
    """Bounded FIFO of jobs and the dispatcher thread that runs them one at a time.

    Args:
        runner: ``runner(fn, job)`` runs ``fn(engine)`` where the engine computes and returns
            when it is done; raises NoModel when no model is open.
        max_waiting: jobs that may wait (the running one not counted); one more is refused
            with QueueFull.
        stats: ServerStats (optional).
    """

    def __init__(self, runner: Callable, max_waiting: int = 16, stats=None):
        self.runner, self.max_waiting, self.stats = runner, int(max_waiting), stats
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self.running: Job | None = None
        self._closed = False
        self._durations: collections.deque[float] = collections.deque(maxlen=16)
        self._thread = threading.Thread(target=self._loop, name="colibri-server-queue", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting for the engine (not the running one)."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """A job is on the engine now."""
        return self.running is not None

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: the mean recent job time times the jobs ahead."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, int(round(mean * (len(self._waiting) + 1))))

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO). Raises QueueFull when max_waiting jobs already wait, and
        RuntimeError after close()."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(len(self._waiting), self.retry_after_s())
            job.state, job.t_submit = "queued", time.perf_counter()
            self._waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Remove a job that is still waiting (its client left); True if it was waiting."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
        self._end(job, JobResult("cancelled"))
        return True

    def _end(self, job: Job, result: JobResult) -> None:
        if self.stats is not None:
            self.stats.on_result(job, result)
        job.finish(result)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel the waiting and running jobs and join the dispatcher thread."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cond.notify_all()
        for j in waiting:
            self._end(j, JobResult("cancelled"))
        if self.running is not None:
            self.running.cancel.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                job.state, job.t_start = "running", time.perf_counter()
                self.running = job
            try:
                if job.cancel.is_set():
                    self._end(job, JobResult("cancelled"))
                else:
                    self.runner(lambda eng, j=job: run_job(eng, j, self.stats), job)
                    if job.state != "done":  # the runner could not run it (engine closed, ...)
                        self._end(job, JobResult("error", error="the engine did not run the request", status=503))
            except NoModel as e:
                self._end(job, JobResult("error", error=str(e) or "no model is open", status=503))
            except Exception as e:  # noqa: BLE001 - the queue goes on
                log.exception("server job failed")
                if job.state != "done":
                    self._end(job, JobResult("error", error=f"{type(e).__name__}: {e}", status=500))
            finally:
                self._durations.append(time.perf_counter() - job.t_start)
                self.running = None
