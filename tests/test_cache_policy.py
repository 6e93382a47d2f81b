"""Eviction policies (engine/cache/policy.py): pure bookkeeping driven directly, no cache, no
threads; and the registry (engine/cache/registry.py) as the one place a policy is added."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from engine.cache.policy import EMA, LFRU, LRU, EvictionPolicy, LayerOrder
from engine.cache.registry import POLICY_CLASSES, make_policy


class _Stats:
    victim_scans = 0


class _NullStore:
    """A store whose reads return at once and fill nothing."""

    slot_bytes = 4096

    def read(self, layer, expert, buf, verify=False):
        return self.slot_bytes

    def views(self, buf):
        return {}


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


def _cycle_trace(tmp_path):
    """A one-layer trace cycling over experts 0, 1, 2 (one per call) 30 times: at cap 2 LRU
    never hits, a policy keeping the oldest does."""
    import json

    from engine.trace import TRACE_FORMAT
    head = {"format": TRACE_FORMAT, "version": 1, "num_layers": 1, "num_experts": 8, "top_k": 1, "cap": 2,
            "policy": "lru", "pins": [[]], "heat": [[0] * 8]}
    recs = [{"f": i, "l": 0, "idx": [[i % 3]]} for i in range(30)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [head] + recs) + "\n")
    return path


def test_the_policy_simulator_drives_the_bookkeeping_alone(monkeypatch, tmp_path):
    """replay_policy replays a trace on the slot table and its policy: no ExpertCache, no
    thread, no read."""
    import threading

    from engine.expert_cache import ExpertCache
    from engine.trace import load_trace, replay_policy

    def no_cache(*a, **k):
        raise AssertionError("the simulator built an ExpertCache")

    monkeypatch.setattr(ExpertCache, "__init__", no_cache)
    threads = threading.active_count()
    head, recs = load_trace(_cycle_trace(tmp_path))
    r = replay_policy(head, recs, 2, "lru", False)
    assert (r["hits"], r["misses"]) == (0, 30) and threading.active_count() == threads
    assert replay_policy(head, recs, 3, "lru", False)["misses"] == 3


class MRU(EvictionPolicy):
    """What a new policy's file holds: the most recent idle slot goes first."""

    name = "mru"

    def pick(self, ly, layer, busy, experts, stats):
        for s in reversed(ly.lru):
            stats.victim_scans += 1
            if busy[s] == 0 and s not in ly.staged:
                return s
        return -1


def test_a_registered_policy_is_what_the_cache_and_the_simulator_evict_by(monkeypatch, tmp_path):
    """Adding a policy is its class plus its entry in engine/cache/registry.py: the setting's
    choices are the registry's, the cache builds it by name, and the policy simulator
    (``colibri bench replay``) replays it beside the others."""
    from engine.expert_cache import ExpertCache
    from engine.settings import POLICIES
    from engine.trace import replay_all

    assert POLICIES == tuple(POLICY_CLASSES)
    monkeypatch.setitem(POLICY_CLASSES, "mru", MRU)
    cache = ExpertCache(_NullStore(), 1, 8, 2, policy="mru", io_threads=1)
    try:
        for e in (0, 1, 2):
            cache.acquire(0, e)
            cache.release(0, e)
        assert cache.is_present(0, 0) and not cache.is_present(0, 1)  # LRU would have dropped 0
    finally:
        cache.close()
    row, = replay_all(_cycle_trace(tmp_path), [2])
    assert row["lru"] == 0.0 and row["mru"] > 0.3 and row["belady"] >= row["mru"]


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'.*lru"):
        make_policy("fifo", np.zeros((1, 2), np.int64), np.zeros((1, 2)), 2)


def _random_trace(seed, L=3, E=12, K=3, calls=120):
    """A random trace with pre-warmed pins in its header, pin events and "ema" probabilities."""
    rng = np.random.default_rng(seed)
    heat = rng.integers(0, 20, (L, E))
    head = {"num_layers": L, "num_experts": E, "top_k": K, "cap": 4, "policy": "lru", "pin_per_layer": 2,
            "pins": [sorted(rng.choice(E, 2, replace=False).tolist()) for _ in range(L)], "heat": heat.tolist()}
    recs = []
    for i in range(calls):
        if i % 40 == 39:
            recs.append({"pin": []})
        rows = [sorted(rng.choice(E, K, replace=False).tolist()) for _ in range(int(rng.integers(1, 4)))]
        p = rng.random(E)
        recs.append({"f": i, "l": int(rng.integers(L)), "idx": rows, "p": (p / p.sum()).tolist()})
    return head, recs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_policy_simulator_counts_what_the_cache_counts(seed):
    """replay_policy (the slot table alone) and the threaded ExpertCache fed the same calls
    (prepare, then acquire + release of each expert, pre-warmed pins loaded first) count the
    same hits, misses and pinned hits, for every policy, with and without pinning."""
    from engine.expert_cache import ExpertCache
    from engine.heat import choose_pins, pins_per_layer
    from engine.trace import _initial_pins, replay_policy

    head, recs = _random_trace(seed)
    L, E = head["num_layers"], head["num_experts"]
    for cap in (3, 5, 12):
        for name in POLICY_CLASSES:
            for pinning in (False, True):
                heat = np.asarray(head["heat"], np.int64).copy()
                cache = ExpertCache(_NullStore(), L, E, cap, name, heat=heat, io_threads=1)
                try:
                    pins0 = _initial_pins(head, cap) if pinning else []
                    if any(pins0):
                        p = np.zeros((L, E), bool)
                        for layer, ids in enumerate(pins0):
                            p[layer, ids] = True
                        cache.set_pinned(p)
                        for layer, ids in enumerate(pins0):
                            cache.load_experts(layer, ids)
                    for r in recs:
                        if "pin" in r:
                            if pinning:
                                cache.set_pinned(choose_pins(heat, pins_per_layer(cap, head["pin_per_layer"])))
                            continue
                        idx = np.asarray(r["idx"], np.int64)
                        np.add.at(heat[r["l"]], idx.reshape(-1), 1)
                        cache.observe_probs(r["l"], np.asarray(r["p"], np.float32))
                        for e in cache.prepare(r["l"], np.unique(idx)):
                            cache.acquire(r["l"], int(e))
                            cache.release(r["l"], int(e))
                    want = (cache.stats.hits, cache.stats.misses, cache.stats.pinned_hits)
                finally:
                    cache.close()
                r = replay_policy(head, recs, cap, name, pinning)
                assert (r["hits"], r["misses"], r["pinned_hits"]) == want, (cap, name, pinning)
                assert not pinning or cap < 3 or want[2] > 0


# the new file: the class above as a file of the package would hold it
NEW_POLICY_FILE = ('"""Most recently used first: the newest idle slot of a layer is the victim."""\n\n'
                   "from __future__ import annotations\n\nfrom .policy import EvictionPolicy\n\n\n"
                   + inspect.getsource(MRU))

NEW_POLICY_RUN = '''
import json, sys
import engine
from engine.cli.main import build_parser
from engine.config import EngineConfig
from engine.events import Finished, GenerateRequest, SamplingParams
from engine.generate import Engine
from engine.settings import ENGINE_SETTINGS, POLICIES
from engine.trace import replay_all

trace, store = sys.argv[1], sys.argv[2]
run = build_parser("run")._subparsers._group_actions[0].choices["run"]
flag = next(a for a in run._actions if "--policy" in a.option_strings)
out = {"engine": engine.__file__, "setting": "mru" in POLICIES and "mru" in
       next(s for s in ENGINE_SETTINGS if s.name == "policy").choices, "flag": "mru" in flag.choices,
       "replay": replay_all(trace, [2])[0]}
for policy in ("lru", "mru"):
    with Engine.open(EngineConfig(store=store, history=False, o_direct=False, cap=2, policy=policy)) as eng:
        req = GenerateRequest(prompt_ids=tuple(range(5, 25)), sampling=SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=8))
        fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
        out[policy] = {"ids": list(fin.token_ids), "class": type(eng.cache.table.policy).__name__}
print("RESULT " + json.dumps(out))
'''


def test_a_policy_is_one_new_file_plus_its_registration(tiny_store, tmp_path):
    """Adding a policy: a copy of the engine gets one new file, engine/cache/mru.py, and its
    import and entry in engine/cache/registry.py; with nothing else changed, in a fresh process,
    it is a choice of the setting and of `colibri run --policy`, `colibri bench replay` compares
    it, and the cache evicts by it, with the same greedy ids as LRU (placement changes speed
    only)."""
    import json
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "checkout"
    shutil.copytree(root / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "engine" / "cache" / "mru.py").write_text(NEW_POLICY_FILE)
    reg = copy / "engine" / "cache" / "registry.py"
    text, n_import = re.subn(r"\n(from \.policy import [^\n]*\n)", r"\n\1from .mru import MRU\n", reg.read_text(),
                             count=1)
    text, n_entry = re.subn(r"(for cls in \()", r"\1MRU, ", text, count=1)
    assert n_import == n_entry == 1  # the registration: one import, one entry
    reg.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(copy), "COLIBRI_NO_NUMBA": "1"}  # numpy kernels: no compile
    p = subprocess.run([sys.executable, "-P", "-c", NEW_POLICY_RUN, str(_cycle_trace(tmp_path)), str(tiny_store)],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert res["engine"].startswith(str(copy)) and res["setting"] and res["flag"]
    assert res["replay"]["lru"] == 0.0 and res["replay"]["mru"] > 0.3
    assert res["mru"]["class"] == "MRU" and res["lru"]["class"] == "LRU"
    assert res["mru"]["ids"] == res["lru"]["ids"] and len(res["mru"]["ids"]) == 8
