"""colibri_app.workers: the one background-task framework (engine, wizard, library)."""

from __future__ import annotations

import threading
import time

import pytest

from engine import LoadProgress
from colibri_app import workers
from colibri_app.workers import Lane, Throttle


@pytest.fixture
def lane():
    ln = Lane("test", threads=1)
    yield ln
    ln.shutdown(10)


def _submit(lane, fn, **kw):
    """Submit with receivers connected before the task starts; returns (task, what it reported)."""
    got = {"progress": [], "result": [], "error": [], "finished": 0}
    task = lane.submit(fn, progress=got["progress"].append, result=got["result"].append,
                       error=got["error"].append,
                       finished=lambda: got.__setitem__("finished", got["finished"] + 1), **kw)
    return task, got


def test_serial_lane_runs_in_order_and_reports_on_the_gui_thread(qtbot, lane):
    order, threads = [], []

    def job(i):
        def fn(ctx):
            order.append(i)
            threads.append(threading.current_thread())
            time.sleep(0.01)
            return i * 10
        return fn
    tasks, got = zip(*[_submit(lane, job(i)) for i in range(5)])
    qtbot.waitUntil(lambda: all(g["finished"] == 1 for g in got), timeout=1_800_000)
    assert order == [0, 1, 2, 3, 4]
    assert [g["result"] for g in got] == [[0], [10], [20], [30], [40]]
    assert all(t is not threading.main_thread() for t in threads)
    assert all(not t.running for t in tasks) and lane.tasks() == []


def test_errors_become_failures_with_kinds(qtbot, lane):
    def boom(ctx):
        raise FileNotFoundError("no such file: model.safetensors")

    def exists(ctx):
        raise FileExistsError("the store exists")

    def bug(ctx):
        return 1 / 0
    got = [_submit(lane, f)[1] for f in (boom, exists, bug)]
    qtbot.waitUntil(lambda: all(g["finished"] for g in got), timeout=1_800_000)
    kinds = [g["error"][0].kind for g in got]
    assert kinds == ["disk", "exists", "internal"]
    assert "model.safetensors" in got[0]["error"][0].message
    assert "ZeroDivisionError" in got[2]["error"][0].detail
    assert all(g["result"] == [] for g in got)


def test_cancel_is_cooperative_and_queued_tasks_are_skipped(qtbot, lane):
    started = threading.Event()

    def loop(ctx):
        started.set()
        while True:
            ctx.check()
            time.sleep(0.005)
    ran = []
    first, g1 = _submit(lane, loop)
    queued, g2 = _submit(lane, lambda ctx: ran.append(1))
    assert started.wait(600)
    queued.cancel()
    first.cancel()
    qtbot.waitUntil(lambda: g1["finished"] and g2["finished"], timeout=1_800_000)
    assert g1["error"][0].kind == "cancelled" and g2["error"][0].kind == "cancelled"
    assert ran == []        # cancelled before it started: never ran
    # skip_if_cancelled=False: the function runs and sees the flag set
    ev = threading.Event()
    ev.set()
    seen = []
    _t, g = _submit(lane, lambda ctx: seen.append(ctx.cancelled) or "ran", cancel=ev, skip_if_cancelled=False)
    qtbot.waitUntil(lambda: g["finished"], timeout=1_800_000)
    assert seen == [True] and g["result"] == ["ran"]


def test_progress_is_rate_limited_and_ends_on_the_last_value(qtbot, lane):
    def fn(ctx):
        for i in range(1, 2001):
            ctx.progress(LoadProgress("download", i, 2000, "B", ""))
    _t, got = _submit(lane, fn, progress_interval_s=0.05)
    qtbot.waitUntil(lambda: got["finished"], timeout=1_800_000)
    assert 1 <= len(got["progress"]) < 100
    assert got["progress"][-1].done == 2000


def test_throttle_keeps_the_latest_pending():
    th = Throttle(3600)
    assert th.offer("a") and not th.offer("b") and not th.offer("c")
    assert th.take_pending() == "c" and th.take_pending() is None
    assert th.offer("d", force=True)


def test_shutdown_joins_without_the_event_loop_and_runs_final():
    """What the app does at exit: no GUI-thread slot has to run for a worker to end."""
    closed = []
    ln = Lane("test-final", threads=2, final=lambda: closed.append(threading.current_thread().name))
    started = threading.Barrier(3)

    def wait_for_cancel(ctx):
        started.wait(600)
        ctx.cancel.wait(600)
        return "stopped"
    tasks = [ln.submit(wait_for_cancel) for _ in range(2)]
    started.wait(600)
    assert workers.shutdown_all(600)         # no qtbot, no processEvents: joined from this thread
    assert all(not t.running for t in tasks) and closed and ln.closed
    with pytest.raises(RuntimeError, match="shut down"):
        ln.submit(lambda ctx: None)


def test_a_hung_task_is_left_behind_after_the_bounded_wait():
    release, started = threading.Event(), threading.Event()
    ln = Lane("test-hung", threads=1)
    t = ln.submit(lambda ctx: (started.set(), release.wait(600)))    # ignores its cancel flag
    assert started.wait(600)
    try:
        assert ln.shutdown(0.3) is False
        assert ln in workers.STUCK and t.running
    finally:
        release.set()
        assert ln.join(600)
        workers.STUCK.remove(ln)


def test_every_signal_arrives_though_the_caller_keeps_no_reference(qtbot, lane):
    """Many short tasks whose Task objects nobody keeps: their queued signals still arrive."""
    import gc
    got = []
    for i in range(200):
        lane.submit(lambda ctx, i=i: i, result=got.append, finished=gc.collect if i % 50 == 0 else None)
    qtbot.waitUntil(lambda: len(got) == 200, timeout=1_800_000)
    assert sorted(got) == list(range(200))
    qtbot.waitUntil(lambda: not lane._alive, timeout=1_800_000)   # and then they are released
