"""Helpers shared by the app tests that wait for an answer to end."""

from __future__ import annotations

from PySide6.QtCore import Qt


def wait_finished(qtbot, win, action, timeout=1_800_000):
    """Run ``action`` and wait until the window has handled the answer's end; returns Finished.
    The timeout only catches a hang: a first answer may compile kernels, minutes on a busy machine.

    (Events are collected with a plain callable: pytest-qt's waitSignal on a signal emitted
    from another thread would stop its timer from that thread.)"""
    got = []
    win.controller.worker.finished.connect(got.append, Qt.DirectConnection)
    try:
        action()
        assert win.answer is not None
        qtbot.waitUntil(lambda: bool(got and win.answer is None), timeout=timeout)
    finally:
        win.controller.worker.finished.disconnect(got.append)
    return got[-1]


def send(qtbot, win, text, timeout=1_800_000):
    """Send and wait for the answer to end; returns the Finished event."""
    return wait_finished(qtbot, win, lambda: win.send(text), timeout)
