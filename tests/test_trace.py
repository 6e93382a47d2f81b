"""Route traces: replaying a recorded run through our policy reproduces the engine's counts."""

from __future__ import annotations

import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from engine.trace import TraceRecorder, load_trace, replay_all, replay_belady, replay_policy


@pytest.mark.parametrize("policy,pinning,cap", [("lru", False, 5), ("lfru", False, 6), ("lru", True, 8),
                                                    ("ema", False, 5), ("ema", True, 8)])
def test_replay_reproduces_engine_counts_exactly(medium_store, tmp_path, policy, pinning, cap):
    cfg = EngineConfig(store=str(medium_store), cap=cap, policy=policy, pinning=pinning, pilot=0,
                       history=False, idle_fill=False)  # the replay starts from an empty cache
    stream = np.random.default_rng(8).integers(10, 500, 70).tolist()
    req = GenerateRequest(prompt_ids=tuple(stream[:20]), forced_ids=tuple(stream[20:]),
                          sampling=SamplingParams(max_new_tokens=50))
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng)
        list(eng.generate(req))
        engine_counts = (eng.cache.stats.hits, eng.cache.stats.misses, eng.cache.stats.pinned_hits)
        rec.save(tmp_path / "t.jsonl")
    head, recs = load_trace(tmp_path / "t.jsonl")
    r = replay_policy(head, recs, cap, policy, pinning)
    assert (r["hits"], r["misses"], r["pinned_hits"]) == engine_counts
    if pinning:
        assert any("pin" in x for x in recs) and engine_counts[2] > 0


def test_belady_bounds_every_policy(medium_store, tmp_path):
    cfg = EngineConfig(store=str(medium_store), cap=4, pilot=1, history=False, pinning=False)
    stream = np.random.default_rng(9).integers(10, 500, 60).tolist()
    req = GenerateRequest(prompt_ids=tuple(stream[:10]), forced_ids=tuple(stream[10:]),
                          sampling=SamplingParams(max_new_tokens=50))
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng)
        list(eng.generate(req))
        rec.save(tmp_path / "t.jsonl")
    head, recs = load_trace(tmp_path / "t.jsonl")
    assert any(r.get("pred") for r in recs if "l" in r)  # PILOT predictions recorded
    rows = replay_all(tmp_path / "t.jsonl", [1, 4, 8, 16])
    for row in rows:
        assert row["belady"] >= max(row["lru"], row["lfru"]) - 1e-12
    assert rows[-1]["belady"] == rows[-1]["lru"]  # cap = all experts: only cold misses
    assert replay_belady(head, recs, 16)["misses"] <= 16 * head["num_layers"]
