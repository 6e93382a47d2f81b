"""The engine on a worker thread: EngineWorker (a QObject moved to a QThread) and
EngineController (GUI side: owns the thread, sends requests, stops and shuts down).

Requests go in as queued signals carrying frozen dataclasses (:class:`OpenRequest`,
:class:`GenerationJob`); events come out as past-tense signals, each ``Signal(object)``
carrying one engine event dataclass. Stop is a ``threading.Event`` handed to
``Engine.generate``: the worker is busy inside the decode loop, so a queued "stop" signal
would arrive too late. Metrics and residency are rate-limited here (~10 Hz, latest kept).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine import (Engine, EngineConfig, EngineError, EngineFailure, ErrorKind, Finished, GenerateRequest,
                    LoadProgress, ResidencySnapshot, StepMetrics, TokenEvent)
from engine.library import default_store

log = logging.getLogger(__name__)

EMIT_INTERVAL_S = 0.1  # metrics / residency / progress: at most ~10 emits per second
GIL_SWITCH_S = 0.001   # the GUI thread gets the GIL back within ~1 ms (Python's default: 5 ms)

# Threads that did not end on shutdown (a hung engine): kept referenced, because destroying a
# running QThread aborts the process. __main__ exits with os._exit when this is not empty.
STUCK_THREADS: list = []


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
    """Owns the Engine; lives on the worker thread. Never touches widgets."""

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
        self._last_progress = 0.0

    # --- slots (run on the worker thread) -----------------------------------------------------

    @Slot(object)
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

    @Slot(object)
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
        last_m = last_r = 0.0
        pending_m: StepMetrics | None = None
        pending_r: ResidencySnapshot | None = None
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    self.token.emit(ev)
                elif isinstance(ev, StepMetrics):
                    now = time.monotonic()
                    if now - last_m >= EMIT_INTERVAL_S:
                        self.metrics.emit(ev)
                        last_m, pending_m = now, None
                    else:
                        pending_m = ev
                elif isinstance(ev, ResidencySnapshot):
                    now = time.monotonic()
                    if now - last_r >= EMIT_INTERVAL_S:
                        self.residency.emit(ev)
                        last_r, pending_r = now, None
                    else:
                        pending_r = ev
                elif isinstance(ev, Finished):
                    # the last values, so the panels end on the final state
                    if pending_m is not None:
                        self.metrics.emit(pending_m)
                    if pending_r is not None:
                        self.residency.emit(pending_r)
                    self.finished.emit(ev)
        except Exception as e:  # noqa: BLE001 - the engine reports errors as Finished; belt and braces
            log.exception("generation crashed")
            self.finished.emit(Finished(finish_reason="error", prompt_tokens=0, generated_tokens=0, text="",
                                        token_ids=(), ttft_s=0.0, decode_tok_per_s=0.0, prefill_tok_per_s=0.0,
                                        hit_rate=0.0, mb_per_token=0.0, felt_wait_s=0.0,
                                        error=f"{type(e).__name__}: {e}"))

    @Slot()
    def reset_history(self) -> None:
        """Forget the routing heat and pins of the open model (Settings › Reset history)."""
        if self.engine is not None:
            try:
                self.engine.reset_history()
            except OSError as e:
                self.failed.emit(EngineFailure(kind=ErrorKind.IO,
                                               message=f"The routing history could not be reset: {e}"))

    @Slot()
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
        now = time.monotonic()
        if ev.done >= ev.total or now - self._last_progress >= EMIT_INTERVAL_S:
            self._last_progress = now
            self.progress.emit(ev)


class EngineController(QObject):
    """GUI-side handle on the worker thread: open, generate, stop, shutdown.

    Signals are re-exported from the worker (connect to ``controller.worker.<signal>``
    or to the same-named signals here).
    """

    open_requested = Signal(object)       #: OpenRequest -> worker.open_engine
    generate_requested = Signal(object)   #: GenerationJob -> worker.generate
    reset_history_requested = Signal()    #: -> worker.reset_history

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("colibri-engine-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        # thread.finished is emitted on the worker thread after its event loop ended (direct
        # connections): the engine is closed there, then the worker is deleted.
        self.thread.finished.connect(self.worker.close_engine)
        self.thread.finished.connect(self.worker.deleteLater)
        self.open_requested.connect(self.worker.open_engine)
        self.generate_requested.connect(self.worker.generate)
        self.reset_history_requested.connect(self.worker.reset_history)
        self._job: GenerationJob | None = None
        self._open: OpenRequest | None = None
        self._next_id = 1
        self._shut = False
        # The engine thread runs Python between its numba kernels; without this the GUI thread
        # can wait a full switch interval per slot it runs while an answer streams.
        if sys.getswitchinterval() > GIL_SWITCH_S:
            sys.setswitchinterval(GIL_SWITCH_S)
        self.thread.start()

    @property
    def generating(self) -> bool:
        """True between :meth:`generate` and the job's finished / failed event."""
        return self._job is not None

    def open(self, config: EngineConfig) -> None:
        """Ask the worker to (re)open a model; any running generation is stopped first."""
        self.stop()
        if self._open is not None:
            self._open.cancel.set()  # a conversion still running for an older request
        self._open = OpenRequest(config)
        self.open_requested.emit(self._open)

    def generate(self, request: GenerateRequest) -> GenerationJob:
        """Queue a generation; returns the job (its ``cancel`` is the stop flag)."""
        job = GenerationJob(self._next_id, request, threading.Event())
        self._next_id += 1
        self._job = job
        self.generate_requested.emit(job)
        return job

    def reset_history(self) -> None:
        """Ask the worker to forget the model's routing heat (runs after any generation)."""
        self.reset_history_requested.emit()

    def job_done(self) -> None:
        """Called by the GUI when the current job's finished / failed event arrived."""
        self._job = None

    def stop(self) -> None:
        """Ask the running generation to end (within one token or one prefill layer)."""
        if self._job is not None:
            self._job.cancel.set()

    def shutdown(self, timeout_ms: int = 30000) -> bool:
        """Stop the generation, quit the thread and wait for it; the engine is closed on the
        worker thread once the running slot returned (thread.finished). Returns True when the
        thread ended within ``timeout_ms``."""
        if self._shut:
            return True
        self._shut = True
        self.stop()
        if self._open is not None:
            self._open.cancel.set()
        self.thread.quit()
        ok = self.thread.wait(timeout_ms)
        if not ok:
            log.error("the engine thread did not end within %d ms; leaving it behind", timeout_ms)
            STUCK_THREADS.append((self.thread, self.worker))
        return ok
