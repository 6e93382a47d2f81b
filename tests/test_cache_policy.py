"""Eviction policies (engine/cache/policy.py): pure bookkeeping driven directly, no cache, no
threads; and the registry as the one place a policy is added."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cache.policy import EMA, LFRU, LRU, POLICY_CLASSES, EvictionPolicy, LayerOrder, make_policy


class _Stats:
    victim_scans = 0


def _tracked(cls, experts, heat=None, ema=None):
    """One layer whose slots 0..n-1 hold ``experts`` and were tracked in that order."""
    E = 8
    heat = np.zeros((1, E), np.int64) if heat is None else np.asarray([heat], np.int64)
    ema = np.zeros((1, E), np.float64) if ema is None else np.asarray([ema], np.float64)
    pol = cls(heat, ema, len(experts))
    ly = LayerOrder()
    for s, e in enumerate(experts):
        pol.track(ly, 0, s, e)
    return pol, ly, np.zeros(len(experts), np.int32), np.asarray(experts, np.int32)


def test_lru_evicts_the_least_recent_idle_slot():
    pol, ly, busy, ex = _tracked(LRU, [4, 5, 6])
    pol.touch(ly, 0, 0, 4)  # order now 1, 2, 0
    busy[1] = 1
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 2


def test_lfru_evicts_the_least_recent_slot_of_the_lowest_heat():
    pol, ly, busy, ex = _tracked(LFRU, [1, 2, 3, 4], heat=[0, 5, 1, 1, 9, 0, 0, 0])
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 1  # experts 2 and 3 share heat 1: the older
    pol.untrack(ly, 0, 1)
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 2


def test_ema_evicts_the_lowest_score_ties_least_recent():
    pol, ly, busy, ex = _tracked(EMA, [1, 2, 3], ema=[0, 0.5, 0.1, 0.1, 0, 0, 0, 0])
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 1


@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
def test_a_staged_speculation_goes_only_when_nothing_else_can(name):
    pol, ly, busy, ex = _tracked(POLICY_CLASSES[name], [1, 2])
    ly.staged[0] = None
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 1
    busy[1] = 1
    assert pol.victim(ly, 0, busy, ex, _Stats(), allow_staged=False) == -1
    assert pol.victim(ly, 0, busy, ex, _Stats()) == 0


def test_a_registered_policy_is_what_the_cache_evicts_by(monkeypatch):
    from engine.expert_cache import ExpertCache
    from engine.trace import _NullStore

    class MRU(EvictionPolicy):  # the most recent slot goes first
        name = "mru"

        def pick(self, ly, layer, busy, experts, stats):
            return next((s for s in reversed(ly.lru) if busy[s] == 0 and s not in ly.staged), -1)

    monkeypatch.setitem(POLICY_CLASSES, "mru", MRU)
    cache = ExpertCache(_NullStore(), 1, 8, 2, policy="mru", io_threads=1)
    try:
        for e in (0, 1, 2):
            cache.acquire(0, e)
            cache.release(0, e)
        assert cache.is_present(0, 0) and not cache.is_present(0, 1)  # LRU would have dropped 0
    finally:
        cache.close()


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'.*lru"):
        make_policy("fifo", np.zeros((1, 2), np.int64), np.zeros((1, 2)), 2)
