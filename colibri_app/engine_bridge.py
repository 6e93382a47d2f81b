"""The engine off the GUI thread: EngineWorker (owns the Engine; its methods run on the
engine lane) and EngineController (GUI side: submits open / generate / reset / close as tasks
of one serial :class:`~colibri_app.workers.Lane`, stops, shuts down).

Requests are frozen dataclasses (:class:`OpenRequest`, :class:`GenerationJob`); events come
out as past-tense signals of the worker, each ``Signal(object)`` carrying one engine event
dataclass, emitted on the lane thread (queued to GUI-thread receivers). Stop is the task's
``threading.Event`` handed to ``Engine.generate``: the lane is busy inside the decode loop, so
only a flag can reach it. Metrics and residency are rate-limited here (~10 Hz, latest kept).
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, Signal

from engine import (Engine, EngineConfig, EngineError, EngineFailure, ErrorKind, Finished, GenerateRequest,
                    LoadProgress, ResidencySnapshot, StepMetrics, TokenEvent, prepare_kernel_variants)
from engine import error_text
from engine.library import default_store

from .workers import Lane, Throttle

log = logging.getLogger(__name__)

#: Command-line words in engine messages and what the app calls the same thing (the CLI keeps
#: its own words; the app shows these). Applied in order.
_APP_WORDS: tuple[tuple[str, str], ...] = (
    (r"(re-?run|run) `colibri convert[^`]*`( again)?", "add the model again (File › Add model…)"),
    (r"re-convert it(: | with )`?colibri convert --overwrite [^`\n;]*`?", "add the model again (File › Add model…)"),
    (r"convert your own copy with `colibri convert`", "add your own copy (File › Add model…)"),
    (r"`colibri models` lists your converted stores; make a new one with `colibri convert [^`]*`",
     "File › Models… lists your models; add one with File › Add model…"),
    (r"convert it first, e\.g\. `colibri convert [^`]*`", "add it with File › Add model…"),
    (r"\(`colibri convert --overwrite` refuses NaN/inf weights and names the tensor\)",
     "(adding it again checks every weight and names a broken tensor)"),
    (r"; pass --overwrite to replace it", "; choose another folder or allow replacing it"),
    (r" \(--overwrite only replaces a store\)", ""),
)


def app_words(message: str) -> str:
    """``message`` from the engine in the app's words: no command lines (`colibri convert
    --overwrite`) and settings by their label in the dialog ("RAM budget"), not their file key
    (``ram_budget_gb``)."""
    import re

    from engine import settings_table
    out = message
    for pat, rep in _APP_WORDS:
        out = re.sub(pat, rep, out)
    for st in settings_table():
        out = re.sub(rf"setting '{st.name}'", st.label, out)
        out = re.sub(rf"(?<![\w-]){re.escape(st.flag)}\b", f"“{st.label}”", out)
        out = re.sub(rf"\b{st.name}\b", f"“{st.label}”", out) if "_" in st.name else out
    return out


EMIT_INTERVAL_S = 0.1  # metrics / residency / progress: at most ~10 emits per second
GIL_SWITCH_S = 0.001   # the GUI thread gets the GIL back within ~1 ms (Python's default: 5 ms)
SHUTDOWN_TIMEOUT_S = 30.0
# its child is killed at once; the thread may still wait on another process's compile lock
# (a daemon thread: it never holds the app open)
VARIANTS_STOP_S = 5.0


@dataclass(frozen=True)
class OpenRequest:
    """Open a model. ``config.store == ""`` means the bundled default model (converted on
    first use into the user data directory, with progress)."""

    config: EngineConfig
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class GenerationJob:
    """One generation: the request and the stop flag the engine polls between tokens."""

    job_id: int
    request: GenerateRequest
    cancel: threading.Event


class EngineWorker(QObject):
    """Owns the Engine. Its methods run on the engine lane (one thread, one task at a time);
    it never touches widgets. The object itself lives on the GUI thread."""

    progress = Signal(object)    #: LoadProgress while converting / opening
    loaded = Signal(object)      #: Loaded: the engine is ready
    token = Signal(object)       #: TokenEvent, one per generated token
    metrics = Signal(object)     #: StepMetrics, latest of each ~100 ms
    residency = Signal(object)   #: ResidencySnapshot, latest of each ~100 ms
    finished = Signal(object)    #: Finished: a generation ended (always after its tokens)
    failed = Signal(object)      #: EngineFailure: opening or starting a generation failed
    closed = Signal()            #: the engine was closed

    def __init__(self):
        super().__init__()
        self.engine: Engine | None = None
        self._progress = Throttle(EMIT_INTERVAL_S)
        self.variants = None  # the background compile of the other settings' kernels (KernelVariants)

    # --- run on the lane thread ---------------------------------------------------------------

    def open_engine(self, req: OpenRequest) -> None:
        """Close any open engine, convert the default model if needed, open the store."""
        self.close_engine()
        cfg = req.config
        try:
            if not cfg.store:
                cfg = replace(cfg, store=str(default_store(progress=self._report, cancel=req.cancel)))
            self.engine = Engine.open(cfg, progress=self._report)
        except EngineError as e:
            if not req.cancel.is_set():
                self.failed.emit(EngineFailure(kind=e.kind, message=str(e), detail=type(e).__name__))
            return
        except Exception as e:  # noqa: BLE001 - every failure becomes a signal, never a crash
            log.exception("opening the model failed")
            self.failed.emit(EngineFailure(kind=ErrorKind.INTERNAL, message=f"Opening the model failed: {e}",
                                           detail=traceback.format_exc()))
            return
        self.loaded.emit(self.engine.loaded)
        self._prepare_variants(self.engine.config)

    def _prepare_variants(self, config: EngineConfig) -> None:
        """Compile the kernels a PILOT or KV-type change would need in the background, so that
        change reopens the model in seconds; one run per store (the set is the same from either
        end of a switch)."""
        if self.variants is not None and self.variants.config.store == config.store:
            return
        if self.variants is not None:
            self.variants.stop(VARIANTS_STOP_S)
        self.variants = prepare_kernel_variants(config)

    def final(self) -> None:
        """At shutdown: close the engine and end a background compile."""
        self.close_engine()
        if self.variants is not None:
            self.variants.stop(VARIANTS_STOP_S)

    def generate(self, job: GenerationJob) -> None:
        """Run one generation, emitting its events; Finished is always the last one."""
        if self.engine is None:
            self.failed.emit(EngineFailure(kind=ErrorKind.INTERNAL, message="No model is open.",
                                           detail="generate before loaded"))
            return
        try:
            events = self.engine.generate(job.request, job.cancel)
        except EngineError as e:
            self.failed.emit(EngineFailure(kind=e.kind, message=str(e), detail=type(e).__name__))
            return
        except Exception as e:  # noqa: BLE001
            self.failed.emit(EngineFailure(kind=ErrorKind.REQUEST, message=str(e), detail=traceback.format_exc()))
            return
        throttles = {StepMetrics: (Throttle(EMIT_INTERVAL_S), self.metrics),
                     ResidencySnapshot: (Throttle(EMIT_INTERVAL_S), self.residency)}
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    self.token.emit(ev)
                elif type(ev) in throttles:
                    throttle, signal = throttles[type(ev)]
                    if throttle.offer(ev):
                        signal.emit(ev)
                elif isinstance(ev, Finished):
                    # the last values, so the panels end on the final state
                    for throttle, signal in throttles.values():
                        last = throttle.take_pending()
                        if last is not None:
                            signal.emit(last)
                    self.finished.emit(ev)
        except Exception as e:  # noqa: BLE001 - the engine reports errors as Finished; belt and braces
            log.exception("generation crashed")
            self.finished.emit(Finished(finish_reason="error", prompt_tokens=0, generated_tokens=0, text="",
                                        token_ids=(), ttft_s=0.0, decode_tok_per_s=0.0, prefill_tok_per_s=0.0,
                                        hit_rate=0.0, mb_per_token=0.0, felt_wait_s=0.0,
                                        error=f"{type(e).__name__}: {e}"))

    def reset_history(self) -> None:
        """Forget the routing heat and pins of the open model (Settings › Reset history)."""
        if self.engine is not None:
            try:
                self.engine.reset_history()
            except OSError as e:
                self.failed.emit(EngineFailure(kind=ErrorKind.IO,
                                               message=f"The routing history could not be reset: {error_text(e)}"))

    def close_engine(self) -> None:
        """Close the engine (joins its threads). Idempotent."""
        if self.engine is not None:
            eng, self.engine = self.engine, None
            try:
                eng.close()
            except Exception:  # noqa: BLE001
                log.exception("closing the engine failed")
            self.closed.emit()

    # --- helpers ------------------------------------------------------------------------------

    def _report(self, ev: LoadProgress) -> None:
        if self._progress.offer(ev, force=ev.done >= ev.total):
            self.progress.emit(ev)


class EngineController(QObject):
    """GUI-side handle on the engine lane: open, generate, stop, shutdown.

    Connect to the worker's signals (``controller.worker.<signal>``); GUI-thread receivers get
    them queued.
    """

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.worker = EngineWorker()
        # one thread: open, generate, reset and close run in the order they were asked for;
        # at shutdown the lane cancels what is queued or running, then closes the engine
        self.lane = Lane("engine", threads=1, final=self.worker.final)
        self._job: GenerationJob | None = None
        self._open: OpenRequest | None = None
        self._next_id = 1
        self._shut = False
        # The engine thread runs Python between its numba kernels; without this the GUI thread
        # can wait a full switch interval per slot it runs while an answer streams.
        if sys.getswitchinterval() > GIL_SWITCH_S:
            sys.setswitchinterval(GIL_SWITCH_S)

    @property
    def generating(self) -> bool:
        """True between :meth:`generate` and the job's finished / failed event."""
        return self._job is not None

    @property
    def job(self) -> GenerationJob | None:
        """The generation in progress (between :meth:`generate` and :meth:`job_done`)."""
        return self._job

    def open(self, config: EngineConfig) -> None:
        """Ask the lane to (re)open a model; any running generation is stopped first."""
        self.stop()
        if self._open is not None:
            self._open.cancel.set()  # a conversion still running for an older request
        req = self._open = OpenRequest(config)
        self.lane.submit(lambda ctx: self.worker.open_engine(req), "engine-open", cancel=req.cancel)

    def generate(self, request: GenerateRequest) -> GenerationJob:
        """Queue a generation; returns the job (its ``cancel`` is the stop flag)."""
        job = GenerationJob(self._next_id, request, threading.Event())
        self._next_id += 1
        self._job = job
        self.lane.submit(lambda ctx: self.worker.generate(job), "engine-generate", cancel=job.cancel,
                         skip_if_cancelled=False)   # the engine answers a set flag with Finished
        return job

    def idle_residency(self) -> ResidencySnapshot | None:
        """The open engine's residency now, when no answer is being generated (the generation
        sends its own snapshots), else None. Called from the GUI thread: the engine reads the
        cache under its lock."""
        eng = self.worker.engine
        if eng is None or self._job is not None or self._shut:
            return None
        try:
            return eng.residency_snapshot()
        except Exception:  # noqa: BLE001 - an engine closing on its lane right now: skip this poll
            return None

    def reset_history(self) -> None:
        """Ask the lane to forget the model's routing heat (runs after any generation)."""
        self.lane.submit(lambda ctx: self.worker.reset_history(), "engine-reset-history")

    def job_done(self) -> None:
        """Called by the GUI when the current job's finished / failed event arrived."""
        self._job = None

    def stop(self) -> None:
        """Ask the running generation to end (within one token or one prefill layer)."""
        if self._job is not None:
            self._job.cancel.set()

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Stop the generation and any conversion, close the engine on its lane, and wait for
        the lane to end. Returns True when it ended within ``timeout_s`` seconds."""
        if self._shut:
            return True
        self._shut = True
        self.stop()
        if self._open is not None:
            self._open.cancel.set()
        return self.lane.shutdown(timeout_s)
