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
        qtbot.waitUntil(lambda: bool(loaded), timeout=1_800_000)
        assert isinstance(loaded[0], Loaded) and loaded[0].num_experts == 8
        req = GenerateRequest(messages=(ChatMessage("user", "hello"),), sampling=SamplingParams(max_new_tokens=10))
        c.generate(req)
        qtbot.waitUntil(lambda: bool(got and isinstance(got[-1], Finished)), timeout=1_800_000)
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
        qtbot.waitUntil(lambda: bool(failed), timeout=1_800_000)
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
        qtbot.waitUntil(lambda: bool(done), timeout=1_800_000)
        c.generate(GenerateRequest(prompt="hello", sampling=SamplingParams(max_new_tokens=120)))
        qtbot.waitUntil(lambda: bool(len(done) == 2), timeout=1_800_000)
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


def test_an_opened_model_gets_the_other_settings_kernels_compiled_in_the_background(qtbot, app_store, tmp_path,
                                                                                    monkeypatch):
    """Once the model is open, the kernels a PILOT or KV-type change needs are compiled in
    lower-priority children, so the Settings dialog then announces no compile for PILOT on.
    The children are replaced by a function that fills the cache folder as a compile would."""
    from engine import compile_needed, kernel_prepare, kernels
    cache = tmp_path / "numba"
    monkeypatch.setattr(kernels, "CACHE_DIR", str(cache))
    monkeypatch.setattr(kernels, "SHIPPED_KINDS", frozenset())  # no pre-built kernels in this cache
    monkeypatch.delenv(kernel_prepare.IN_PROCESS_ENV, raising=False)
    monkeypatch.setattr(kernel_prepare, "_FAILED", set())
    runs = []

    def child(cfg, entry, niceness=0, stop=None):
        runs.append((cfg["pilot"], cfg["kv_dtype"], niceness))
        (cache / "kernels_4f2a").mkdir(parents=True, exist_ok=True)
        (cache / "kernels_4f2a" / "attention.rmsnorm-10.py311.nbi").write_bytes(b"index")
        return 0
    monkeypatch.setattr(kernel_prepare, "_run_child", child)
    c = EngineController()
    loaded = []
    c.worker.loaded.connect(loaded.append, Qt.DirectConnection)
    try:
        c.open(EngineConfig(store=app_store, pinning=False))
        qtbot.waitUntil(lambda: bool(loaded) and c.worker.variants is not None, timeout=1_800_000)
        assert c.worker.variants.finished.wait(600)  # only a hang trips this
        n = kernel_prepare.BACKGROUND_NICENESS
        assert runs == [(0, "f16", 0), (1, "f16", n), (0, "f32", n), (1, "f32", n)]
        assert compile_needed(app_store, EngineConfig(store=app_store, pilot=1)) == (False, None)
    finally:
        assert c.shutdown()
