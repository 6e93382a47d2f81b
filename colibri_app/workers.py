"""The app's one background-work framework: tasks on lanes of pooled threads.

A :class:`Task` runs ``fn(ctx)`` off the GUI thread; ``ctx`` (:class:`TaskContext`) carries the
cooperative cancel flag (a ``threading.Event`` the function polls) and a rate-limited
``progress`` callback. The task reports through Qt signals, delivered on the GUI thread for
receivers that live there (queued connections): ``progress(object)`` while it runs, then exactly
one of ``result(object)`` / ``error(EngineFailure)``, then ``finished()``.

A :class:`Lane` is a ``QThreadPool`` with a fixed number of threads (1 = strictly serial, as the
engine needs: open, generate, close in order). Engine, wizard and library work all go through
lanes. A pooled thread ends when its function returns: nothing on the GUI thread has to run for
a worker to stop, so shutdown works when the event loop no longer runs (the cause of a SIGABRT when
a ``QThread`` could only be quit by a GUI-thread slot).

Shutdown: :func:`shutdown_all` (connected to ``QCoreApplication.aboutToQuit`` and called by the
main window when it closes) cancels every task of every lane and joins their threads with a
bounded wait, from the GUI thread, before Qt objects are destroyed. A lane whose threads did not
end in time is kept referenced in :data:`STUCK` (a pool cannot be destroyed while its thread
runs); ``colibri_app.__main__`` then leaves with ``os._exit``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Callable

from PySide6.QtCore import QCoreApplication, QObject, Qt, QThreadPool, Signal

from engine import Cancelled, EngineFailure, ErrorKind, error_kind

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.05   # default: at most ~20 progress signals per second
SHUTDOWN_TIMEOUT_S = 10.0    # bounded join at app exit (a download stops within one chunk)

#: Lanes whose threads did not end within the shutdown wait (kept alive on purpose).
STUCK: list["Lane"] = []
Slots = Callable | list | None
_LANES: list["Lane"] = []
_hooked = False


TaskCancelled = Cancelled  # the engine's one Cancelled (kind ErrorKind.CANCELLED)


def failure_from(e: BaseException) -> EngineFailure:
    """The :class:`EngineFailure` a task reports for exception ``e``.

    ``kind`` is :func:`engine.error_kind` (the error's own kind for engine errors, EXISTS for
    FileExistsError, DISK for other OSErrors, INTERNAL otherwise). ``detail`` is the traceback.
    """
    return EngineFailure(kind=error_kind(e), message=str(e) or type(e).__name__,
                         detail="".join(traceback.format_exception(e)))


class Throttle:
    """Rate limit for a stream of events where only the latest matters.

    :meth:`offer` returns True when the event should be sent now (at most one per
    ``interval_s`` seconds); otherwise it is kept as pending, and :meth:`take_pending` hands the
    last one out (to send when the stream ends, so a display ends on the final state).
    """

    def __init__(self, interval_s: float):
        self.interval_s = float(interval_s)
        self._last = float("-inf")
        self.pending: Any = None

    def offer(self, ev: Any, force: bool = False) -> bool:
        """True if ``ev`` is due (or ``force``); else remember it as pending."""
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last, self.pending = now, None
            return True
        self.pending = ev
        return False

    def take_pending(self) -> Any:
        """The last event held back since the last one sent, or None; clears it."""
        ev, self.pending = self.pending, None
        return ev


class TaskContext:
    """What a task function gets: ``cancel`` (threading.Event), ``progress(ev)``, ``check()``."""

    def __init__(self, task: "Task", interval_s: float):
        self._task = task
        self.cancel: threading.Event = task.cancel_event
        self._throttle = Throttle(interval_s)

    @property
    def cancelled(self) -> bool:
        """True once the task was asked to stop."""
        return self.cancel.is_set()

    def check(self) -> None:
        """Raise :class:`TaskCancelled` if the task was asked to stop."""
        if self.cancel.is_set():
            raise TaskCancelled("cancelled")

    def progress(self, ev: Any) -> None:
        """Report progress (rate-limited; an event with ``done >= total`` always goes out)."""
        final = getattr(ev, "total", 0) and getattr(ev, "done", 0) >= getattr(ev, "total", 0)
        if self._throttle.offer(ev, force=bool(final)):
            self._task.progress.emit(ev)


class Task(QObject):
    """One unit of background work, created by :meth:`Lane.submit`.

    Signals: ``progress(object)``, ``result(object)``, ``error(EngineFailure)``, ``finished()``
    (after result or error, always). Create and use it on the GUI thread; ``fn`` runs on a lane
    thread. The object has no Qt parent: it may outlive the widget that started it.
    """

    progress = Signal(object)
    result = Signal(object)
    error = Signal(object)
    finished = Signal()

    def __init__(self, fn: Callable[[TaskContext], Any], name: str = "task",
                 progress_interval_s: float = PROGRESS_INTERVAL_S, cancel: threading.Event | None = None,
                 skip_if_cancelled: bool = True):
        super().__init__()
        self.skip_if_cancelled = skip_if_cancelled
        self.fn, self.name = fn, name
        self.cancel_event = cancel if cancel is not None else threading.Event()
        self._done = threading.Event()
        self._interval = progress_interval_s
        self.setObjectName(name)

    @property
    def running(self) -> bool:
        """True until the function has returned or raised (or the task was skipped)."""
        return not self._done.is_set()

    def cancel(self) -> None:
        """Ask the function to stop (it polls ``ctx.cancel``); safe from any thread."""
        self.cancel_event.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block up to ``timeout_s`` seconds until the task ended; True if it did."""
        return self._done.wait(timeout_s)

    def _run(self) -> None:
        """Runs on a lane thread."""
        threading.current_thread().name = f"colibri-{self.name}"   # for logs and stack dumps
        try:
            if self.skip_if_cancelled and self.cancel_event.is_set():
                raise TaskCancelled(f"{self.name} was cancelled before it started")
            value = self.fn(TaskContext(self, self._interval))
        except BaseException as e:  # noqa: BLE001 - every failure becomes a signal, never a crash
            if not isinstance(e, TaskCancelled) and getattr(e, "kind", None) != ErrorKind.CANCELLED:
                log.debug("task %s failed", self.name, exc_info=True)
            self.error.emit(failure_from(e))
        else:
            self.result.emit(value)
        finally:
            self._done.set()
            self.finished.emit()


class Lane:
    """A pool of ``threads`` worker threads running :class:`Task` s, started in submission
    order (with one thread: one after the other).

    Args:
        name: names its tasks (logs, and the Python name of the thread running one).
        threads: 1 for serial work (the engine), more for independent jobs.
        final: run on the lane after the cancelled tasks when the lane shuts down (the engine
            lane closes the engine there); its errors are logged, never raised.
    """

    def __init__(self, name: str, threads: int = 1, final: Callable[[], Any] | None = None):
        self.name = name
        self.final = final
        self.pool = QThreadPool()
        self.pool.setObjectName(f"colibri-{name}")
        self.pool.setMaxThreadCount(max(1, int(threads)))
        self.pool.setExpiryTimeout(-1)   # keep the threads (the engine stays on one thread)
        self._tasks: list[Task] = []      # not ended yet (pruned on submit)
        self._alive: set[Task] = set()    # not yet released (see _start)
        self._lock = threading.Lock()
        self.closed = False
        _LANES.append(self)
        _hook_app_quit()

    def submit(self, fn: Callable[[TaskContext], Any], name: str = "", *,
               progress: Slots = None, result: Slots = None, error: Slots = None, finished: Slots = None,
               progress_interval_s: float = PROGRESS_INTERVAL_S, cancel: threading.Event | None = None,
               skip_if_cancelled: bool = True) -> Task:
        """Queue ``fn(ctx)`` and return its Task.

        ``progress``, ``result``, ``error``, ``finished``: receivers (a callable or a list) that
        are connected to the task's signals *before* it starts; a receiver connected after
        ``submit`` returned may miss a task that already ended.
        ``cancel``: use this event as the task's stop flag (default: a new one).
        ``skip_if_cancelled``: a task cancelled before it started reports ``error`` (kind
        "cancelled") without calling ``fn``; False calls ``fn`` anyway (it sees the flag set).

        Raises:
            RuntimeError: the lane was shut down.
        """
        if self.closed:
            raise RuntimeError(f"the {self.name} lane is shut down")
        task = Task(fn, name or self.name, progress_interval_s, cancel, skip_if_cancelled)
        for signal, slots in ((task.progress, progress), (task.result, result), (task.error, error),
                              (task.finished, finished)):
            for slot in (slots if isinstance(slots, (list, tuple)) else [slots] if slots else []):
                signal.connect(slot)
        self._start(task)
        return task

    def _start(self, task: Task) -> None:
        # The lane keeps the Python object alive until its last signal has been delivered on the
        # GUI thread: a Task collected earlier takes its queued deliveries with it. The release
        # is connected last, so it is delivered after every receiver connected before it.
        task.finished.connect(lambda t=task: self._release(t), Qt.QueuedConnection)
        with self._lock:
            self._tasks = [t for t in self._tasks if t.running]
            self._tasks.append(task)
            self._alive.add(task)
        self.pool.start(task._run)

    def _release(self, task: Task) -> None:
        with self._lock:
            self._alive.discard(task)

    def tasks(self) -> list[Task]:
        """Tasks not yet ended."""
        with self._lock:
            return [t for t in self._tasks if t.running]

    def cancel_all(self) -> None:
        """Ask every queued or running task to stop."""
        for t in self.tasks():
            t.cancel()

    def begin_shutdown(self, cancel: bool = True) -> None:
        """Refuse new tasks, cancel the queued and running ones (unless ``cancel`` is False),
        and queue the lane's ``final`` function (e.g. closing the engine) after them."""
        if self.closed:
            return
        if cancel:
            self.cancel_all()
        self.closed = True
        if self.final is not None:
            def final(ctx) -> None:
                try:
                    self.final()
                except Exception:  # noqa: BLE001 - shutting down: log, go on
                    log.exception("the %s lane's final step failed", self.name)
            self._start(Task(final, f"{self.name}-final"))

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every thread of the lane to end; True if they
        did. A lane left running is kept in :data:`STUCK`."""
        ok = self.pool.waitForDone(int(max(0.0, timeout_s) * 1000))
        if ok:
            if self in _LANES:
                _LANES.remove(self)
        else:
            log.error("the %s threads did not end within %.1f s; leaving them behind: %s",
                      self.name, timeout_s, [t.name for t in self.tasks()])
            if self not in STUCK:
                STUCK.append(self)
        return ok

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S, cancel: bool = True) -> bool:
        """:meth:`begin_shutdown` then :meth:`join`. Returns True when every thread ended."""
        self.begin_shutdown(cancel)
        return self.join(timeout_s)


def lanes() -> list[Lane]:
    """Lanes not shut down yet."""
    return list(_LANES)


def shutdown_all(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """Cancel every task of every lane, then join them (one shared deadline of ``timeout_s``).
    Call on the GUI thread at exit; True when every thread ended."""
    live = list(_LANES)
    for ln in live:
        ln.begin_shutdown()
    deadline = time.monotonic() + timeout_s
    ok = True
    for ln in live:
        ok = ln.join(deadline - time.monotonic()) and ok
    return ok


def _hook_app_quit() -> None:
    global _hooked
    app = QCoreApplication.instance()
    if not _hooked and app is not None:
        app.aboutToQuit.connect(shutdown_all)
        _hooked = True
