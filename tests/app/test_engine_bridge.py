"""EngineController / EngineWorker against the real engine on a tiny model."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt

from engine import (ChatMessage, EngineConfig, EngineFailure, Finished, GenerateRequest, Loaded,
                    SamplingParams, StepMetrics, TokenEvent)
from colibri_app.engine_bridge import EngineController


def _engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(("colibri-io", "colibri-pilot"))]


def test_worker_streams_tokens_then_finished(qtbot, app_store):
    c = EngineController()
    w = c.worker
    got, loaded = [], []
    # collected on the worker thread in emission order
    for sig in (w.token, w.metrics, w.residency, w.finished):
        sig.connect(got.append, Qt.DirectConnection)
    w.loaded.connect(loaded.append, Qt.DirectConnection)
    try:
        c.open(EngineConfig(store=app_store, cap=4, pinning=False))
        qtbot.waitUntil(lambda: bool(loaded), timeout=120000)
        assert isinstance(loaded[0], Loaded) and loaded[0].num_experts == 8
        req = GenerateRequest(messages=(ChatMessage("user", "hello"),), sampling=SamplingParams(max_new_tokens=10))
        c.generate(req)
        qtbot.waitUntil(lambda: bool(got and isinstance(got[-1], Finished)), timeout=120000)
        c.job_done()
        ev = got[-1]
        assert isinstance(ev, Finished) and ev.finish_reason == "length" and ev.generated_tokens == 10
        tokens = [e for e in got if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == list(range(10))
        assert "".join(t.text for t in tokens) == ev.text
        assert isinstance(got[-1], Finished)
        assert any(isinstance(e, StepMetrics) for e in got)
    finally:
        assert c.shutdown()
    assert c.lane.closed and c.lane.tasks() == []
    assert _engine_threads() == []


def test_open_failure_is_a_signal(qtbot, tmp_path):
    c = EngineController()
    failed = []
    c.worker.failed.connect(failed.append, Qt.DirectConnection)
    try:
        c.open(EngineConfig(store=str(tmp_path / "missing-store")))
        qtbot.waitUntil(lambda: bool(failed), timeout=120000)
        ev = failed[0]
        assert isinstance(ev, EngineFailure) and ev.kind == "store" and "missing-store" in ev.message
    finally:
        c.shutdown()


def test_metrics_are_rate_limited(qtbot, app_store):
    c = EngineController()
    metrics, tokens = [], []
    # count in the worker thread: what the worker emits, not what the GUI got round to
    c.worker.metrics.connect(metrics.append, Qt.DirectConnection)
    c.worker.token.connect(tokens.append, Qt.DirectConnection)
    done = []
    c.worker.loaded.connect(done.append, Qt.DirectConnection)
    c.worker.finished.connect(done.append, Qt.DirectConnection)
    try:
        c.open(EngineConfig(store=app_store, pinning=False))
        qtbot.waitUntil(lambda: bool(done), timeout=120000)
        c.generate(GenerateRequest(prompt="hello", sampling=SamplingParams(max_new_tokens=120)))
        qtbot.waitUntil(lambda: bool(len(done) == 2), timeout=120000)
        c.job_done()
        ev = done[-1]
        assert len(tokens) == 120
        assert 1 <= len(metrics) < 120
        # ~10 Hz plus the final flush
        decode_s = ev.generated_tokens / max(ev.decode_tok_per_s, 1e-9)
        assert len(metrics) <= 10 * decode_s + 3
        assert metrics[-1].token_index == 119  # the last state is never dropped
    finally:
        c.shutdown()
