"""Expert cache invariants, the RAM budget, routing heat files, and placement-never-changes-values."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import numpy as np
import pytest

from engine import BudgetError, Engine, EngineConfig, ExpertReadError, Finished, GenerateRequest, SamplingParams
from engine.expert_cache import ExpertCache
from engine.heat import FILENAME, RoutingHeat
from engine.ram_budget import GB, RssGuard
from engine.sizing import plan_cap

SLOT = 4096


class FakeStore:
    """Slabs whose bytes encode (layer, expert); optional injected read failures."""

    slot_bytes = SLOT

    def __init__(self, fail_rate=0.0, seed=0):
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.reads = 0

    @staticmethod
    def pattern(layer, expert):
        return (layer * 131 + expert * 7 + 1) % 251

    def read(self, layer, expert, buf, verify=False):
        with self.lock:
            self.reads += 1
            fail = self.rng.random() < self.fail_rate
        if fail:
            raise ExpertReadError(f"injected failure reading expert {expert} of layer {layer}")
        buf[:] = self.pattern(layer, expert)
        return SLOT

    def views(self, buf):
        return {"buf": buf}


def test_stress_threads_shrinking_cap_and_read_failures():
    L, E, cap = 2, 64, 16
    store = FakeStore(fail_rate=0.10, seed=1)
    cache = ExpertCache(store, L, E, cap, policy="lru", io_threads=4)
    stop = threading.Event()
    problems: list[str] = []

    def user(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                layer = rng.randrange(L)
                es = sorted(rng.sample(range(E), 3))
                cache.prepare(layer, es)
                for e in es:
                    try:
                        v = cache.acquire(layer, e)
                    except ExpertReadError:
                        continue
                    try:
                        if not (v["buf"] == FakeStore.pattern(layer, e)).all():
                            problems.append(f"buffer for ({layer},{e}) holds another expert")
                    finally:
                        cache.release(layer, e)
        except Exception as e:  # noqa: BLE001 - a user that dies leaves its reservations behind
            problems.append(f"user {seed}: {type(e).__name__}: {e}")

    def shrinker():
        rng = random.Random(7)
        while not stop.is_set():
            cache.set_cap(rng.randint(4, cap))
            time.sleep(0.02)

    def checker():
        while not stop.is_set():
            with cache.lock:
                for layer in range(L):
                    live = cache.live_slots(layer)
                    if live > cache.layers[layer].cap:
                        problems.append(f"layer {layer}: {live} live slots > cap {cache.layers[layer].cap}")
                    states = set(np.unique(cache.slot_state[layer]).tolist())
                    if not states <= {0, 1, 2}:
                        problems.append(f"unknown slot states {states}")
            time.sleep(0.005)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=shrinker), threading.Thread(target=checker)]
    for t in threads:
        t.start()
    # at least 10 s and 1000 reads of stress (a busy machine takes longer for the reads)
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end or store.reads <= 1000:
        assert time.monotonic() < t_end + 600 and not problems, problems[:5]
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(600)  # only a hang trips it
        assert not t.is_alive(), f"{t.name} did not stop; problems: {problems[:5]}"
    assert not problems, problems[:5]
    assert store.reads > 1000
    # No slot leaked by the failures: every layer can still hold `cap` experts at once.
    store.fail_rate = 0.0
    final = cache.cap
    for layer in range(L):
        held = list(range(final))
        cache.prepare(layer, held)
        for e in held:
            cache.acquire(layer, e)
        assert cache.live_slots(layer) == final
        for e in held:
            cache.release(layer, e)
    cache.close()


def _two_lookups_fill_the_layer_with_unclaimed_loads(policy):
    """Cap 4: lookup A counts expert 0 as a hit and reserves slots for its misses 10, 11, 12;
    lookup B's miss 20 evicts A's hit. Every slot now holds a demand load no take has claimed
    (not evictable until taken), and A's take of expert 0 comes first."""
    cache = ExpertCache(FakeStore(), 1, 64, 4, policy=policy, io_threads=1)
    cache.load_experts(0, [0])
    assert cache.prepare(0, [0, 10, 11, 12, 13]) == [0, 10, 11, 12, 13]
    cache.prepare(0, [20])
    assert cache.wait_demand_idle(600)
    assert sorted(cache.slot_expert[0].tolist()) == [10, 11, 12, 20]
    return cache


@pytest.mark.parametrize("policy", ["lru", "lfru", "ema"])
def test_a_take_finding_only_unclaimed_loads_reads_again_the_last_needed(policy, monkeypatch):
    """The take used to wait for a slot that only its own later takes could free (the stress
    test above hung with its threads so interleaved): the unclaimed load of the highest id
    gives way now, and is read again at its own take."""
    from engine.cache import lookups
    monkeypatch.setattr(lookups, "STALL_TIMEOUT_S", 5.0)  # without the fix: an error, not a hang
    cache = _two_lookups_fill_the_layer_with_unclaimed_loads(policy)
    try:
        v = cache.acquire(0, 0)
        assert (v["buf"] == FakeStore.pattern(0, 0)).all()
        assert sorted(cache.slot_expert[0].tolist()) == [0, 10, 11, 12]  # 20 gave way
        cache.release(0, 0)
        for e in (10, 11, 12, 13, 20):
            assert (cache.acquire(0, e)["buf"] == FakeStore.pattern(0, e)).all()
            cache.release(0, e)
        assert cache.live_slots(0) == 4
    finally:
        cache.close()


def test_lowering_the_cap_frees_loads_no_take_will_claim():
    """A caller that never takes its lookup's loads (an error ended it) left slots nothing
    could evict: lowering the cap waited for them forever."""
    cache = _two_lookups_fill_the_layer_with_unclaimed_loads("lru")
    try:
        t = threading.Thread(target=cache.set_cap, args=(1,), daemon=True)
        t.start()
        t.join(600)  # only a hang trips it
        assert not t.is_alive(), "set_cap waited for loads no take will claim"
        assert cache.live_slots(0) == 1
        assert (cache.acquire(0, 0)["buf"] == FakeStore.pattern(0, 0)).all()
        cache.release(0, 0)
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_cost_per_miss_does_not_grow_with_cap(policy):
    """Victim choice inspects O(1) slots per miss whatever the cap (counted, not timed;
    `colibri bench` reports the wall-clock cost)."""
    per_miss = {}
    for cap in (4, 256):
        E = 1024
        cache = ExpertCache(FakeStore(), 1, E, cap, policy=policy, io_threads=1)
        rng = np.random.default_rng(0)
        heat = cache.heat
        misses0 = 0
        for e in rng.integers(0, E, 100_000):
            heat[0, e] += 1
            cache.prepare(0, [int(e)])
            cache.acquire(0, int(e))
            cache.release(0, int(e))
        st = cache.stats
        misses0 = st.misses
        assert misses0 > 50_000
        per_miss[cap] = st.victim_scans / misses0
        cache.close()
    assert per_miss[4] <= 2.0 and per_miss[256] <= 2.0, per_miss
    assert per_miss[256] <= 2 * per_miss[4] + 0.5


def test_lfru_evicts_least_recent_of_the_coldest():
    cache = ExpertCache(FakeStore(), 1, 16, 3, policy="lfru", io_threads=1)
    cache.heat[0, :] = [5, 1, 1, 9] + [0] * 12
    for e in (0, 1, 2):
        cache.prepare(0, [e])
        cache.acquire(0, e)
        cache.release(0, e)
    cache.prepare(0, [3])  # must evict 1 (heat 1, older than 2)
    cache.acquire(0, 3)
    cache.release(0, 3)
    res = cache.residency()[0]
    assert res[1] == 0 and res[0] == 1 and res[2] == 1 and res[3] == 1
    cache.close()


def test_pinned_experts_survive_lru_pressure():
    cache = ExpertCache(FakeStore(), 1, 32, 4, policy="lru", io_threads=1)
    pins = np.zeros((1, 32), bool)
    pins[0, 5] = True
    cache.prepare(0, [5])
    cache.acquire(0, 5)
    cache.release(0, 5)
    cache.set_pinned(pins)
    for e in range(6, 30):
        cache.prepare(0, [e])
        cache.acquire(0, e)
        cache.release(0, e)
    assert cache.residency()[0, 5] == 2  # PINNED
    cache.close()


# --- budget ---------------------------------------------------------------------------------

def test_auto_cap_is_monotone_in_budget_and_refuses_impossible():
    caps = [plan_cap(64, [6_000_000] * 16, 1 * GB, GB // 4, b, None).cap for b in np.linspace(1.7, 40, 60)]
    assert caps == sorted(caps) and caps[0] >= 1 and caps[-1] == 64
    with pytest.raises(BudgetError, match=r"1\.00 GB.*dense weights \(1\.00 GB\).*needed"):
        plan_cap(64, [6_000_000] * 16, 1 * GB, GB // 4, 1.0, None)
    assert plan_cap(64, [6_000_000] * 16, GB, GB // 4, 30, 7).cap == 7  # explicit cap wins


def test_engine_refuses_impossible_budget(tiny_store):
    with pytest.raises(BudgetError, match=r"MB needed\. Raise the RAM budget"):
        Engine.open(EngineConfig(store=str(tiny_store), ram_budget_gb=0.1))


def test_rss_guard_lowers_cap_and_it_holds(medium_store):
    """A fake RSS reader reports 110% of the budget from token 20: the guard fires, live
    slots stay under the new cap for 1000 more steps, and the ids do not change."""
    budget_gb = 2.0
    base = dict(store=str(medium_store), ram_budget_gb=budget_gb, cap=16, pilot=0, pinning=False,
                history=False, context_length=1200)
    stream = np.random.default_rng(4).integers(10, 500, 1040).tolist()
    req = GenerateRequest(prompt_ids=tuple(stream[:16]), forced_ids=tuple(stream[16:]),
                          sampling=SamplingParams(max_new_tokens=1020))
    with Engine.open(EngineConfig(**base)) as eng:
        ref = [e for e in eng.generate(req) if isinstance(e, Finished)][0].token_ids

    step = {"n": 0}

    def fake_rss():
        return int(1.10 * budget_gb * GB) if step["n"] >= 20 else int(0.5 * budget_gb * GB)

    with Engine.open(EngineConfig(**base), read_rss=fake_rss) as eng:
        # The excess (0.2 GB) is more than this small model's whole cache, so the cap falls
        # to its floor of 1 at the first guard point after token 20 (token 32).
        caps_after = []
        for ev in eng.generate(req):
            if type(ev).__name__ == "StepMetrics":
                step["n"] = ev.token_index
                if eng.guard.fired:
                    caps_after.append(ev.cap_per_layer)
                    for layer in range(eng.cache.L):
                        assert eng.cache.live_slots(layer) <= eng.cache.cap
            if isinstance(ev, Finished):
                ids = ev.token_ids
        assert eng.guard.fired >= 1
        assert len(caps_after) >= 980 and max(caps_after) < 16
        assert len(set(caps_after)) == 1  # the lowered cap holds: no slot regrows
    assert ids == ref


# --- placement never changes values ------------------------------------------------------------

def _ids(store, **over):
    cfg = EngineConfig(store=str(store), **{"history": False, **over})
    req = GenerateRequest(prompt_ids=tuple(range(5, 45)), sampling=SamplingParams(max_new_tokens=24))
    with Engine.open(cfg) as eng:
        fin = [e for e in eng.generate(req) if isinstance(e, Finished)][0]
        assert fin.finish_reason in ("length", "stop"), fin.error
        return fin.token_ids


def test_greedy_ids_identical_across_cache_settings(medium_store):
    E = 16
    ref = _ids(medium_store, cap=E, pilot=0)
    assert len(ref) == 24
    for cap in (1, 2, E // 2, E):
        for policy in ("lru", "lfru"):
            for pinning in (True, False):
                for o_direct in (True, False):
                    got = _ids(medium_store, cap=cap, policy=policy, pinning=pinning, o_direct=o_direct,
                               pilot=0, history=True)
                    assert got == ref, (cap, policy, pinning, o_direct)
    for cap in (1, E // 2):  # the router-probability EMA policy
        for pinning in (True, False):
            got = _ids(medium_store, cap=cap, policy="ema", pinning=pinning, pilot=1, history=True)
            assert got == ref, (cap, "ema", pinning)


# --- heat files --------------------------------------------------------------------------------

def test_heat_file_roundtrip_and_mismatch(tmp_path):
    h = RoutingHeat(4, 8, "x")
    h.observe(1, np.array([[1, 2], [2, 3]]))
    h.pinned[1, 2] = True
    h.tokens = 2
    h.save(tmp_path)
    h.counts[0, 0] = 5
    h.save(tmp_path)  # twice in a row: atomic replace
    assert not list(tmp_path.glob("*.tmp"))
    r = RoutingHeat(4, 8)
    assert r.load(tmp_path) and r.counts[0, 0] == 5 and r.counts[1, 2] == 2 and r.pinned[1, 2]
    # dimensions of another model: ignored with a message, moved aside (never deleted)
    p = tmp_path / FILENAME
    good = p.read_text()
    other = RoutingHeat(4, 16)
    assert not other.load(tmp_path) and "do not match" in other.message and other.counts.sum() == 0
    aside = list(tmp_path.glob(FILENAME + ".bad-*"))
    assert len(aside) == 1 and aside[0].read_text() == good and str(aside[0]) in other.message
    assert not p.exists() and not other.keep_file
    # truncated: moved aside too
    p.write_text(good[:40])
    t = RoutingHeat(4, 8)
    assert not t.load(tmp_path) and "ignoring routing history" in t.message
    assert len(list(tmp_path.glob(FILENAME + ".bad-*"))) == 2


@pytest.mark.parametrize("case", ["newer version", "another engine", "unreadable"])
def test_a_heat_file_this_build_cannot_use_is_never_overwritten(tmp_path, case):
    """Busy, newer or another program's: ignored, left as it is, not saved over (until the
    user resets the history)."""
    p = tmp_path / FILENAME
    d = json.loads(RoutingHeat(4, 8, "x").to_json())
    if case == "newer version":
        d["version"] = 2
    elif case == "another engine":
        d["engine"] = "glm_moe_dsa"
    if case == "unreadable":
        p.mkdir()                       # a read error, not a broken file
        before = None
    else:
        p.write_text(json.dumps(d))
        before = p.read_text()
    h = RoutingHeat(4, 8, "x")
    assert not h.load(tmp_path) and h.keep_file and "left as it is" in h.message
    h.observe(0, np.array([[1, 2]]))
    h.save(tmp_path)
    assert (p.is_dir() if before is None else p.read_text() == before)
    assert not list(tmp_path.glob(FILENAME + ".bad-*"))
    if before is not None:
        h.save(tmp_path, force=True)    # "Reset routing history" replaces it
        assert json.loads(p.read_text())["counts"][0][1] == 1


def test_pins_persist_and_prewarm(medium_store, tmp_path):
    import shutil
    st = tmp_path / "store"
    shutil.copytree(medium_store, st)
    (st / FILENAME).unlink(missing_ok=True)
    cfg = EngineConfig(store=str(st), cap=8, pilot=0, pinning=True, history=True)
    req = GenerateRequest(prompt_ids=tuple(range(5, 40)), sampling=SamplingParams(max_new_tokens=8))
    with Engine.open(cfg) as eng:
        list(eng.generate(req))
        assert eng.cache.pinned.any()
    saved = json.loads((st / FILENAME).read_text())
    assert any(saved["pinned"])
    with Engine.open(cfg) as eng:
        assert eng.loaded.prewarmed_experts == sum(len(r) for r in saved["pinned"]) > 0
        assert "pre-warmed" in eng.loaded.message
        res = eng.cache.residency()
        assert (res == 2).sum() == eng.loaded.prewarmed_experts
        eng.reset_history()
        assert not eng.cache.pinned.any()
    assert not any(json.loads((st / FILENAME).read_text())["pinned"])


def test_ema_policy_evicts_lowest_router_probability():
    """The "ema" victim is the evictable expert the router has leaned towards least."""
    cache = ExpertCache(FakeStore(), 1, 8, 3, policy="ema", io_threads=1)
    try:
        p = np.zeros(8)
        p[[0, 1, 2]] = [0.5, 0.1, 0.4]
        cache.observe_probs(0, p)
        for e in (0, 1, 2):  # expert 1 is the most recently used but the least probable
            cache.prepare(0, [e])
            cache.acquire(0, e)
            cache.release(0, e)
        cache.prepare(0, [1])
        cache.acquire(0, 1)
        cache.release(0, 1)
        cache.observe_probs(0, np.eye(8)[5])
        cache.prepare(0, [5])
        cache.acquire(0, 5)
        cache.release(0, 5)
        assert cache.where[0, 1] < 0 and cache.where[0, 5] >= 0  # LRU would have evicted 0
        assert cache.where[0, 0] >= 0 and cache.where[0, 2] >= 0
    finally:
        cache.close()


def _state(cache):
    st = cache.stats
    return (st.hits, st.misses, st.spec_used, cache.clock, cache.last_use.copy(), cache.slot_busy.copy(),
            cache.residency().copy(), [list(ly.lru) for ly in cache.layers])


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_acquire_many_changes_state_as_one_acquire_each(policy):
    """acquire_many / release_many (a decode step's hits in one lock round-trip) leave the cache
    exactly as acquire / release of each expert in turn: counters, use clock, busy counts,
    eviction order; an expert evicted after prepare_split is read again through acquire."""
    def run(many):
        cache = ExpertCache(FakeStore(), 1, 16, 6, policy=policy, io_threads=1)
        try:
            for step in ([0, 1, 2, 3], [2, 3, 4, 5], [5, 0, 1, 2], [7, 8, 2, 3]):
                hits, misses = cache.prepare_split(0, sorted(step))
                if many:
                    views = cache.acquire_many(0, hits)
                    assert [int(v["buf"][0]) for v in views] == [FakeStore.pattern(0, e) for e in hits]
                    cache.release_many(0, hits)
                else:
                    for e in hits:
                        cache.acquire(0, e)
                        cache.release(0, e)
                for e in misses:
                    cache.acquire(0, e)
                    cache.release(0, e)
            # a hit evicted between prepare_split and acquire_many is loaded again by acquire
            hits, _ = cache.prepare_split(0, [2, 3])
            with cache.lock:
                cache.table.evict(0, int(cache.where[0, 3]))
            views = cache.acquire_many(0, hits) if many else [cache.acquire(0, e) for e in hits]
            assert [int(v["buf"][0]) for v in views] == [FakeStore.pattern(0, e) for e in hits]
            cache.release_many(0, hits) if many else [cache.release(0, e) for e in hits]
            return _state(cache)
        finally:
            cache.close()
    a, b = run(False), run(True)
    assert a[:4] == b[:4]
    for x, y in zip(a[4:7], b[4:7]):
        assert np.array_equal(x, y)
    assert a[7] == b[7]


@pytest.mark.parametrize("policy", ["lru", "lfru", "ema"])
def test_take_split_changes_state_as_prepare_split_and_acquire_many(policy):
    """take_split / release_slots (a decode step's lookup and its hits taken in one lock
    round-trip) leave the cache exactly as prepare_split + acquire_many / release_many:
    counters, use clock, busy counts, residency, eviction order; the slots it returns hold the
    hits' slabs at slot_offsets; a speculation it hits counts as used."""
    whole = []

    def run(take):
        cache = ExpertCache(FakeStore(), 2, 16, 6, policy=policy, io_threads=1)
        if take:
            inner = cache.table.take_all
            cache.table.take_all = lambda *a: (whole.append(a[1].tolist()), inner(*a))[1]
        try:
            # (layer, experts, a speculation staged before the lookup): misses, mixed lookups,
            # all-hit lookups (take_split's whole-array path), speculations hit by both kinds
            steps = ((0, [0, 1, 2, 3], None), (1, [2, 3, 4, 5], None), (0, [5, 0, 1, 2], None),
                     (1, [7, 8, 2, 3], 8), (0, [9, 10, 11, 12], None), (1, [2, 9, 13, 1], None),
                     (1, [2, 9, 13, 1], None), (1, [14, 2, 9, 1], 14), (0, [9, 10, 11, 12], None))
            for layer, step, spec in steps:
                if spec is not None:  # a staged speculation, then hit
                    slot = cache.try_speculate(layer, spec)
                    cache.load_speculative(layer, spec, slot)
                    with cache.lock:
                        while cache.slot_state[layer, slot] != 2:  # _RESIDENT
                            cache.wait_slots()
                if take:
                    hits, slots, misses = cache.take_split(layer, sorted(step))
                    offs = cache.slot_offsets(layer, slots)
                    assert [int(cache.arena[o]) for o in offs] == [FakeStore.pattern(layer, e) for e in hits]
                    cache.release_slots(layer, slots)
                else:
                    hits, misses = cache.prepare_split(layer, sorted(step))
                    cache.acquire_many(layer, hits)
                    cache.release_many(layer, hits)
                for e in misses:
                    cache.acquire(layer, e)
                    cache.release(layer, e)
            assert not cache.slot_busy.any()
            return _state(cache)
        finally:
            cache.close()
    a, b = run(False), run(True)
    assert a[:4] == b[:4] and a[2] == 2  # both speculations were used
    assert [1, 2, 9, 14] in whole and len(whole) >= 2  # the whole-array path ran, one with a speculation
    for x, y in zip(a[4:7], b[4:7]):
        assert np.array_equal(x, y)
    assert a[7] == b[7]


def test_acquire_many_releases_what_it_took_when_a_read_fails():
    """A failing read inside acquire_many releases the experts it had already acquired (no slot
    stays busy) and raises the named ExpertReadError."""
    store = FakeStore()
    cache = ExpertCache(store, 1, 16, 6, policy="lru", io_threads=1)
    try:
        cache.prepare_split(0, [0, 1])
        for e in (0, 1):
            cache.acquire(0, e)
            cache.release(0, e)
        store.fail_rate = 1.0
        with pytest.raises(ExpertReadError, match="expert 9"):
            cache.acquire_many(0, [0, 1, 9])
        assert int(cache.slot_busy.sum()) == 0
    finally:
        cache.close()


def test_giving_back_experts_does_not_wake_idle_reader_threads(monkeypatch):
    """Releasing an expert (8 per MoE layer of a decode step) wakes only threads that wait for a
    slot, not the idle reader threads: with one condition for everything, every release woke
    every reader, which took the GIL and the lock and slept again (~1.6 ms per MoE layer on a
    busy machine). Counted wake-ups, not timed."""
    import engine.expert_cache as EC
    wakeups: dict[str, int] = {}

    class Counting(threading.Condition):
        def wait(self, timeout=None):
            r = super().wait(timeout)
            name = threading.current_thread().name
            wakeups[name] = wakeups.get(name, 0) + 1
            return r

        def parked(self):  # threads waiting in it that no notify has woken (lock held)
            return len(self._waiters)

    monkeypatch.setattr(EC.threading, "Condition", Counting)
    cache = ExpertCache(FakeStore(), 1, 8, 8, policy="lru", io_threads=2)
    try:
        cache.load_experts(0, np.arange(8))  # every expert resident: the readers go idle
        # both readers wait for a read and no wake-up of theirs is pending (a reader woken for
        # a load another one took may not have run yet on a busy machine)
        assert _wait_for(lambda: cache.demand.queued_cv.parked() == 2)
        before = {k: v for k, v in wakeups.items() if k.startswith("colibri-io")}
        for _ in range(200):
            hits, misses = cache.prepare_split(0, [1, 5])
            assert hits == [1, 5] and not misses
            cache.acquire_many(0, hits)
            time.sleep(0.0002)  # a kernel runs without the GIL: a woken thread gets to run
            cache.release_many(0, hits)
            with cache.lock:
                assert cache.demand.queued_cv.parked() == 2  # the release woke no reader
        with cache.lock:
            after = {k: v for k, v in wakeups.items() if k.startswith("colibri-io")}
        assert after == before, (before, after)
    finally:
        cache.close()


def _arena_mapping(cache):
    """(perms of the /proc/self/smaps mapping holding the cache arena, bytes of the arena's own
    pages that are resident). The resident bytes come from /proc/self/pagemap (bit 63: page
    present) over the arena's address range only: the kernel merges the arena's mapping with an
    adjacent private anonymous one (another test's numpy buffers), whose Rss smaps would count
    too (a full test run saw 94 MB for a 32 MB arena)."""
    addr = cache.arena.ctypes.data
    perms = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if lo <= addr < hi:
                    perms = head[1]
                    break
    page = os.sysconf("SC_PAGE_SIZE")
    first, n = addr // page, (addr + cache.arena.nbytes + page - 1) // page - addr // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(n * 8), np.uint64)
    return perms, int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


def _huge_advised_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """The address ranges inside [lo, hi) whose /proc/self/smaps VmFlags carry "hg" (MADV_HUGEPAGE)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = (max(a, lo), min(b, hi)) if a < hi and b > lo else None
            elif head[0] == "VmFlags:" and cur is not None and "hg" in head[1:]:
                out.append(cur)
    return sorted(out)


_THP = (__import__("os").path.exists("/proc/self/smaps") and hasattr(__import__("mmap"), "MADV_HUGEPAGE")
        and __import__("os").path.isdir("/sys/kernel/mm/transparent_hugepage"))


@pytest.mark.skipif(not _THP, reason="Linux /proc, MADV_HUGEPAGE and a kernel with transparent huge pages only")
def test_huge_page_advice_covers_whole_blocks_inside_each_slot_only():
    """The arena asks for transparent huge pages slot by slot: exactly the 2 MB-aligned blocks
    that lie wholly inside one slot, never a block two slots share (so filling a slot never
    faults its neighbour's pages in), as the kernel's own record (smaps VmFlags "hg") shows."""
    import engine.expert_cache as ec

    class Store(_MBStore):
        slot_bytes = 3 * (1 << 20) + 4096 * 7  # 3 MB + 7 pages: slots straddle blocks unevenly

    cache = ExpertCache(Store(), 2, 5, 4, policy="lru", io_threads=1)  # a cap under the experts
    try:
        base, n, sb, H = cache.arena.ctypes.data, 8, Store.slot_bytes, ec.HUGE_PAGE
        want = []
        for i in range(n):  # whole blocks inside slot i, by brute force over every block
            a, b = base + i * sb, base + (i + 1) * sb
            blocks = [x for x in range(a - a % H, b, H) if x >= a and x + H <= b]
            if blocks:
                want.append((blocks[0], blocks[-1] + H))
        got = _huge_advised_ranges(base, base + n * sb)
        merged = []
        for a, b in got:  # adjacent VMAs with the same flags may be reported apart or merged
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        assert merged == want and want
        assert cache.huge_bytes == sum(b - a for a, b in want)
    finally:
        cache.close()


@pytest.mark.skipif(not _THP, reason="Linux /proc, MADV_HUGEPAGE and a kernel with transparent huge pages only")
def test_an_arena_that_will_be_filled_is_advised_whole_as_huge_pages(monkeypatch):
    """A cap that holds every expert, or a pre-read that fills the cap, fills every slot, so the whole arena is advised at once
    (one mapping, whatever the room for more): the blocks two slots share are on huge pages
    from their first read, not only after the collapse that waits for the first answer's end."""
    import engine.expert_cache as ec

    class Store(_MBStore):
        slot_bytes = 3 * (1 << 20) + 4096 * 7

    monkeypatch.setattr(ec, "_mapping_room", lambda: 3)  # too little room for slot interiors
    # the engine passes the slots it planned: every one of them here
    cache = ExpertCache(Store(), 2, 5, 5, policy="lru", io_threads=1, slots=10)
    try:
        base, nbytes = cache.arena.ctypes.data, cache.arena.nbytes
        assert nbytes == 10 * Store.slot_bytes
        got = _huge_advised_ranges(base, base + nbytes)
        assert got and got[0][0] <= base and got[-1][1] >= base + nbytes
        assert all(a2 == b1 for (_, b1), (a2, _) in zip(got, got[1:]))  # one unbroken span
        assert cache.huge_bytes >= nbytes
    finally:
        cache.close()
    # a cap under the experts that the pre-read (fill) fills: every slot is filled too
    cache = ExpertCache(Store(), 2, 5, 4, policy="lru", io_threads=1, fill=True)
    try:
        base, nbytes = cache.arena.ctypes.data, cache.arena.nbytes
        got = _huge_advised_ranges(base, base + nbytes)
        assert got and got[0][0] <= base and got[-1][1] >= base + nbytes
        assert cache.huge_bytes >= nbytes
    finally:
        cache.close()


@pytest.mark.skipif(not _THP, reason="Linux /proc, MADV_HUGEPAGE and a kernel with transparent huge pages only")
def test_huge_page_advice_never_takes_more_than_half_the_mappings_left(monkeypatch):
    """Each advised slot interior is a memory mapping of its own (up to 2 per slot); at the
    process's limit (vm.max_map_count) a thread or an mmap can no longer be made, which hung an
    ExpertCache opened near it. With too little room nothing is advised
    and no mapping is split; with room, the advice goes ahead."""
    import engine.expert_cache as ec

    class Store(_MBStore):
        slot_bytes = 3 * (1 << 20) + 4096 * 7

    def maps_in(cache):
        base = cache.arena.ctypes.data
        return len(_huge_advised_ranges(base, base + 8 * Store.slot_bytes))

    # 8 slots (cap 4 of 5 experts) of 3 MB + 7 pages: at least one has a whole huge page inside
    # (2 mappings), so a room of 3 (half: 1) is short, and 2 * 2 * 10 is enough whatever the
    # arena's alignment
    monkeypatch.setattr(ec, "_mapping_room", lambda: 3)
    cache = ExpertCache(Store(), 2, 5, 4, policy="lru", io_threads=1)
    try:
        assert cache.huge_bytes == 0 and maps_in(cache) == 0
    finally:
        cache.close()
    monkeypatch.setattr(ec, "_mapping_room", lambda: None)  # /proc does not tell: no advice either
    cache = ExpertCache(Store(), 2, 5, 4, policy="lru", io_threads=1)
    try:
        assert cache.huge_bytes == 0 and maps_in(cache) == 0
    finally:
        cache.close()
    monkeypatch.setattr(ec, "_mapping_room", lambda: 2 * 2 * 10)
    cache = ExpertCache(Store(), 2, 5, 4, policy="lru", io_threads=1)
    try:
        assert cache.huge_bytes > 0 and maps_in(cache) > 0
    finally:
        cache.close()
    room = ec._mapping_room()
    assert room is not None and 0 < room < 10 ** 7  # the real reading: limit minus /proc/self/maps


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_cap_reduction_gives_memory_back_to_the_os():
    """The arena is private anonymous memory: a shared anonymous mapping (Python's mmap
    default) is shmem, where MADV_DONTNEED drops the RSS but keeps every page allocated."""
    class BigStore(FakeStore):
        slot_bytes = 1 << 20

        def read(self, layer, expert, buf, verify=False):
            buf[:] = self.pattern(layer, expert)
            return self.slot_bytes

    E = 16
    cache = ExpertCache(BigStore(), 1, E, E, policy="lru", io_threads=2)
    try:
        cache.load_experts(0, list(range(E)))
        perms, full = _arena_mapping(cache)
        assert perms is not None and perms[3] == "p", f"arena mapping {perms}: not private"
        assert full >= E * (1 << 20)
        cache.set_cap(4)
        _, after = _arena_mapping(cache)
        assert after <= full - (E - 4) * (1 << 20) + (1 << 20)
        for e in range(E):  # what stayed resident still reads back its own bytes
            if cache.where[0, e] >= 0:
                v = cache.acquire(0, e)
                assert int(v["buf"][0]) == BigStore.pattern(0, e)
                cache.release(0, e)
    finally:
        cache.close()


def _wait_for(pred, seconds=600.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_ahead_faults_the_next_free_slots_only():
    """The next ``populate_ahead`` free slots of each layer get their pages before a read
    needs them; no more (the RSS grows with use), and a cap reduction gives back the ones it
    leaves no room for. The pages' contents are never changed."""
    MB = 1 << 20

    class BigStore(FakeStore):
        slot_bytes = MB

        def read(self, layer, expert, buf, verify=False):
            buf[:] = self.pattern(layer, expert)
            return self.slot_bytes

    L, E = 2, 16
    cache = ExpertCache(BigStore(), L, E, E, policy="lru", io_threads=2)
    try:
        if cache.populate.thread is None:
            pytest.skip("no libc madvise")
        ahead = cache.populate_ahead
        # at open: the top `ahead` free slots of every layer
        assert _wait_for(lambda: int(cache.memory.faulted.sum()) == ahead * L or not cache.populate.thread.is_alive())
        if not cache.populate.thread.is_alive():
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        time.sleep(0.2)
        assert int(cache.memory.faulted.sum()) == ahead * L  # not more
        _, rss = _arena_mapping(cache)
        assert ahead * L * MB <= rss <= (ahead * L + 1) * MB
        # three loads in layer 0: the populater follows the free stack
        cache.load_experts(0, [0, 1, 2])
        nxt = cache.layers[0].free[-ahead:]
        assert _wait_for(lambda: all(cache.memory.faulted[0, v] for v in nxt))
        time.sleep(0.2)
        assert int(cache.memory.faulted[0].sum()) == 3 + ahead
        for e in (0, 1, 2):  # populate never touched loaded bytes
            v = cache.acquire(0, e)
            assert np.all(v["buf"] == BigStore.pattern(0, e))
            cache.release(0, e)
        # a cap of 2: layer 0 keeps its two residents and no free slot has room; layer 1's
        # two populated free slots still have room
        cache.set_cap(2)
        time.sleep(0.2)
        assert int(cache.memory.faulted[0].sum()) == 2
        assert int(cache.memory.faulted[1].sum()) == min(ahead, 2)
        _, rss = _arena_mapping(cache)
        assert rss <= (2 + min(ahead, 2) + 1) * MB
    finally:
        cache.close()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_reserve_faults_every_slot_under_the_cap():
    """``reserve`` (the setting reserve_cache): every slot the cap allows gets its pages from
    open, round robin over the layers; ``wait_populated`` returns once they are in; a lower cap
    gives back the free slots it leaves no room for; loaded bytes are never touched."""
    MB = 1 << 20
    L, E = 3, 16
    cache = ExpertCache(_MBStore(), L, E, E, policy="lru", io_threads=2, reserve=True)
    try:
        if cache.populate.thread is None:
            pytest.skip("no libc madvise")
        assert cache.populate_ahead == E
        cache.load_experts(1, [0, 1, 2])  # loads racing the reservation
        assert cache.wait_populated(timeout=600.0)
        if not cache.populate.thread.is_alive():
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        assert cache.populate_pending() == 0
        assert int(cache.memory.faulted.sum()) >= L * E - 3  # every slot (the 3 loaded ones were read into)
        _, rss = _arena_mapping(cache)
        assert (L * E - 1) * MB <= rss <= (L * E + 1) * MB
        for e in (0, 1, 2):
            v = cache.acquire(1, e)
            assert np.all(v["buf"] == _MBStore.pattern(1, e))
            cache.release(1, e)
        cache.set_cap(4)
        assert cache.wait_populated(timeout=600.0)
        _, rss = _arena_mapping(cache)
        assert rss <= (4 * L + 1) * MB, rss
        assert cache.populate_pending() == 0
    finally:
        cache.close()
    assert cache.populate_pending() == 0  # closed: nothing pending, wait returns at once
    assert cache.wait_populated(timeout=0.0)


def test_background_growth_stops_where_grow_ok_says_no():
    """``grow_ok`` (the engine: RSS + slot within the RAM budget): the reservation faults in
    slots only while it says yes, then stops (grow_stopped, nothing pending, wait_populated
    returns); the idle fill likewise reads into no slot that is not faulted in yet; demand
    loads go on (the RSS guard's business); a lower cap lets background growth ask again.
    A reservation once pushed a 4 GB budget's RSS to 4.03 GB and the cgroup killed it."""
    L, E = 2, 16
    allowed = {"n": 5}  # slots the "budget" has room for
    asked = []

    def grow_ok(nbytes):
        asked.append(nbytes)
        return len(asked) <= allowed["n"]
    cache = ExpertCache(_MBStore(), L, E, E, policy="lru", io_threads=1, reserve=True, grow_ok=grow_ok)
    try:
        if cache.populate.thread is None:
            pytest.skip("no libc madvise")
        assert cache.wait_populated(timeout=600.0)
        if not cache.populate.thread.is_alive():
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        assert cache.grow_stopped and cache.populate_pending() == 0
        assert int(cache.memory.faulted.sum()) == 5 and set(asked) == {_MBStore.slot_bytes}
        n_asked = len(asked)
        cache.load_experts(0, range(8))  # demand loads never ask
        assert cache.residency()[0, :8].all() and len(asked) == n_asked
        allowed["n"] = 10 ** 9
        cache.set_cap(12)  # lower: may grow again, up to the new cap
        assert cache.wait_populated(timeout=600.0) and not cache.grow_stopped
        assert int(cache.memory.faulted.sum()) == 2 * 12
    finally:
        cache.close()
    cache = ExpertCache(FakeStore(), L, 8, 8, policy="lru", io_threads=1, fill=True, grow_ok=lambda n: False)
    try:
        # three slots of layer 0 have their pages in (not the top of its free stack): the fill
        # takes those first, skips layer 1 (any slot there would grow the process), reads 3
        free0 = cache.layers[0].free
        cache.memory.faulted[0, [free0[0], free0[2], free0[4]]] = True
        assert cache.start_fill()
        assert cache.wait_filled(timeout=600.0)
        assert cache.stats.fill_loads == 3 and cache.grow_stopped and cache.fill_pending() == 0
        assert cache.residency()[0].sum() == 3 and cache.residency()[1].sum() == 0
    finally:
        cache.close()


def test_a_slot_populated_after_the_fill_paused_wakes_the_fill():
    """The fill thread paused on the budget (every layer's free slots not faulted in, grow_ok
    no) while the populate thread, which had asked first, faulted a slot in: that wakes the
    fill, which reads into it, so wait_filled returns (it used to hang)."""
    L, E = 2, 8
    gate = threading.Event()

    def grow_ok(n):
        if threading.current_thread().name == "colibri-populate":
            gate.wait(600)  # the populate thread asked before the budget filled up
            return True
        return False  # the fill thread: the budget says no
    c = ExpertCache(_MBStore(), L, E, 4, policy="lru", io_threads=1, reserve=True, fill=True, grow_ok=grow_ok)
    try:
        if c.populate.thread is None:
            pytest.skip("no libc madvise")
        time.sleep(0.2)
        assert c.start_fill()
        time.sleep(0.3)  # the fill found no faulted slot and paused
        assert c.stats.fill_loads == 0
        gate.set()
        for _ in range(500):  # the populate thread faults its slot in
            if int(c.memory.faulted.sum()) or not c.populate.thread.is_alive():
                break
            time.sleep(0.01)
        assert c.wait_filled(timeout=600.0)
        if int(c.memory.faulted.sum()):
            assert c.stats.fill_loads >= 1
    finally:
        gate.set()
        c.close()


def test_without_reserve_only_the_next_slots_are_pending():
    """Off (the default): populate_pending counts at most ``populate_ahead`` slots per layer."""
    L, E = 2, 16
    cache = ExpertCache(_MBStore(), L, E, E, policy="lru", io_threads=1)
    try:
        assert cache.populate_ahead == 2
        assert 0 <= cache.populate_pending() <= 2 * L * _MBStore.slot_bytes
        assert cache.wait_populated(timeout=600.0)
    finally:
        cache.close()


def test_idle_fill_makes_a_store_that_fits_resident_without_evicting():
    """``fill`` (the setting idle_fill): after start_fill every expert of a store that fits the
    cap is read, speculatively (spec_bytes), with no eviction; with a smaller cap each layer's
    free slots take its hottest experts (heat; ties: the lowest id) and nothing more."""
    L, E = 3, 8
    cache = ExpertCache(FakeStore(), L, E, E, policy="lru", io_threads=1, fill=True)
    try:
        assert cache.fill_pending() == 0  # not started: nothing pending, no thread
        assert cache.start_fill()
        assert cache.wait_filled(timeout=600.0)
        assert cache.residency().all()
        assert cache.stats.loads == cache.stats.fill_loads == L * E and cache.stats.evictions == 0
        assert cache.stats.spec_bytes == L * E * FakeStore.slot_bytes and cache.stats.demand_bytes == 0
        assert cache.stats.spec_issued == cache.stats.spec_completed == 0  # PILOT's counters untouched
    finally:
        cache.close()
    heat = np.zeros((L, E), np.int64)
    heat[0, [6, 2]] = [5, 9]
    heat[1, 7] = 1
    cache = ExpertCache(FakeStore(), L, E, 3, policy="lru", heat=heat, io_threads=1, fill=True)
    try:
        cache.load_experts(2, [5])  # a demand load first: the fill takes the remaining room only
        cache.start_fill()
        assert cache.wait_filled(timeout=600.0)
        res = cache.residency()
        assert set(np.flatnonzero(res[0])) == {2, 6, 0}
        assert set(np.flatnonzero(res[1])) == {7, 0, 1}
        assert set(np.flatnonzero(res[2])) == {5, 0, 1}
        assert cache.stats.evictions == 0
        for layer in range(L):  # the filled bytes are the experts' own
            for e in np.flatnonzero(res[layer]):
                v = cache.acquire(layer, int(e))
                assert int(v["buf"][0]) == FakeStore.pattern(layer, int(e))
                cache.release(layer, int(e))
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["lru", "lfru", "ema"])
def test_idle_fill_loads_are_the_first_victims(policy):
    """A fill load nothing routes to is evicted before any expert the routing used: routing
    4, 5, 4, 5 ... at cap 4 over a filled layer misses twice, then hits (a fill load kept
    from eviction until used, as PILOT's are, made every access a miss)."""
    cache = ExpertCache(FakeStore(), 1, 8, 4, policy=policy, io_threads=1, fill=True)
    try:
        cache.start_fill()
        assert cache.wait_filled(timeout=600.0)
        assert set(np.flatnonzero(cache.residency()[0])) == {0, 1, 2, 3}
        for e in [4, 5] * 5:
            cache.observe_probs(0, np.eye(8, dtype=np.float32)[e])
            cache.prepare(0, [e])
            cache.acquire(0, e)
            cache.release(0, e)
        assert cache.stats.misses == 2 and cache.stats.hits == 8
    finally:
        cache.close()


def test_idle_fill_does_not_retry_a_failing_expert_and_stops_on_close():
    """A fill read that fails is counted once and not retried (it used to be picked again at
    once, forever); the others fill. close() waits for a fill read in flight and leaves no
    thread."""
    from engine.generate import engine_threads_alive

    class BadStore(FakeStore):
        def read(self, layer, expert, buf, verify=False):
            if (layer, expert) == (0, 3):
                raise OSError("bad sector")
            return super().read(layer, expert, buf, verify)

    cache = ExpertCache(BadStore(), 2, 8, 8, policy="lru", io_threads=1, fill=True)
    try:
        cache.start_fill()
        assert cache.wait_filled(timeout=600.0)
        assert _wait_for(lambda: cache.stats.read_errors >= 1)
        assert cache.stats.read_errors == 1
        res = cache.residency()
        assert res[0, 3] == 0 and int((res != 0).sum()) == 15
    finally:
        cache.close()
    gate, started = threading.Event(), threading.Event()

    class SlowStore(FakeStore):
        def read(self, layer, expert, buf, verify=False):
            started.set()
            gate.wait(600)
            return super().read(layer, expert, buf, verify)

    cache = ExpertCache(SlowStore(), 2, 8, 8, policy="lru", io_threads=1, fill=True)
    cache.start_fill()
    assert started.wait(600)
    closer = threading.Thread(target=cache.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # waits for the read in flight
    gate.set()
    closer.join(600)
    assert not closer.is_alive()
    assert not [n for n in engine_threads_alive() if n == "colibri-fill"]
    assert cache.stats.fill_loads == 0 and cache.populate_pending() == 0 and cache.fill_pending() == 0


def test_idle_fill_waits_while_a_demand_read_is_in_flight():
    """The fill reads only while no demand read is in flight (one disk, no gain from depth)."""
    gate = threading.Event()

    class SlowStore(FakeStore):
        def read(self, layer, expert, buf, verify=False):
            if (layer, expert) == (0, 5):
                gate.wait(600)
            return super().read(layer, expert, buf, verify)

    cache = ExpertCache(SlowStore(), 2, 8, 8, policy="lru", io_threads=1, fill=True)
    try:
        t = threading.Thread(target=lambda: (cache.acquire(0, 5), cache.release(0, 5)))
        t.start()
        assert _wait_for(lambda: cache.demand_inflight == 1)
        cache.start_fill()
        time.sleep(0.3)
        assert cache.stats.loads == 0 and cache.stats.fill_loads == 0
        gate.set()
        t.join(600)
        assert cache.wait_filled(timeout=600.0)
        assert cache.residency().all() and cache.stats.demand_bytes == FakeStore.slot_bytes
    finally:
        gate.set()
        cache.close()


class _MBStore(FakeStore):
    slot_bytes = 1 << 20

    def read(self, layer, expert, buf, verify=False):
        buf[:] = self.pattern(layer, expert)
        return self.slot_bytes


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_rss_guard_counts_populated_slots_as_cache_memory():
    """Free slots populated ahead are cache memory (inside the cap's plan), so the RSS guard
    must not count them as memory outside the cache: that lowered the cap by up to
    ``populate_ahead`` slots more than the budget asks for."""
    MB = 1 << 20
    L, E = 4, 16
    cache = ExpertCache(_MBStore(), L, E, E, policy="lru", io_threads=2)
    try:
        if cache.populate.thread is None:
            pytest.skip("no libc madvise")
        for layer in range(L):
            cache.load_experts(layer, list(range(6)))
        want = (6 + cache.populate_ahead) * L
        assert _wait_for(lambda: int(cache.memory.faulted.sum()) == want or not cache.populate.thread.is_alive())
        if int(cache.memory.faulted.sum()) != want:
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        floor = 300 * MB
        budget = floor + 4 * L * MB  # room for cap 4 in every layer
        guard = RssGuard(cache, budget, read_rss=lambda: floor + _arena_mapping(cache)[1])
        guard.step(0)
        assert guard.fired == 1
        assert 3 <= cache.cap <= 4, guard.trail  # 4 (3 if the kernel rounds the RSS up a little)
    finally:
        cache.close()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_failed_populate_leaves_no_pages_the_cache_does_not_know(monkeypatch):
    """A populate that fails part way (ENOMEM, EINTR, ...) may have faulted pages in: they must
    still be known to the cache, or a cap reduction never gives them back."""
    import engine.expert_cache as ec

    MB = 1 << 20
    real = ec._populate_call()
    if real is None:
        pytest.skip("no libc madvise")
    calls = []

    def flaky(addr, n, advice):
        r = real(addr, n, advice)  # the pages come in, then the call reports a failure
        calls.append(r)
        return r if r != 0 else -1

    monkeypatch.setattr(ec, "_populate_call", lambda: flaky)
    cache = ExpertCache(_MBStore(), 1, 16, 16, policy="lru", io_threads=1)
    try:
        assert _wait_for(lambda: not cache.populate.thread.is_alive())
        if calls[0] != 0:
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        assert len(calls) == 1  # the thread stops at the failure
        _, rss = _arena_mapping(cache)
        assert rss <= cache.resident_bytes(), rss  # no arena page the cache does not know of
        cache.load_experts(0, [3])
        cache.set_cap(1)
        _, rss = _arena_mapping(cache)
        assert rss <= cache.resident_bytes() <= MB, rss
    finally:
        cache.close()


def test_cache_opens_without_ctypes(monkeypatch):
    """A Python without ctypes (no _ctypes/libffi) opens the cache without populate-ahead."""
    import sys
    monkeypatch.setitem(sys.modules, "ctypes", None)
    monkeypatch.setitem(sys.modules, "ctypes.util", None)
    cache = ExpertCache(FakeStore(), 1, 8, 4, policy="lru", io_threads=1)
    try:
        assert cache.populate.thread is None
        cache.load_experts(0, [1, 2])
        v = cache.acquire(0, 2)
        assert int(v["buf"][0]) == FakeStore.pattern(0, 2)
        cache.release(0, 2)
    finally:
        cache.close()


def test_populate_ahead_faults_the_next_slot_first(monkeypatch):
    """The slot a load takes next (the top of the free stack) is populated first."""
    import engine.expert_cache as ec

    if ec._populate_call() is None:
        pytest.skip("no libc madvise")
    order = []
    gate = threading.Event()

    def record(addr, n, advice):
        gate.wait(600)
        order.append(addr)
        return 0

    monkeypatch.setattr(ec, "_populate_call", lambda: record)
    cache = ExpertCache(FakeStore(), 1, 8, 8, policy="lru", io_threads=1)
    try:
        nxt = cache.layers[0].free[-1]
        base = cache.arena.ctypes.data
        gate.set()
        assert _wait_for(lambda: len(order) >= 2)
        assert order[0] == base + cache.memory.offset(0, nxt)
    finally:
        cache.close()


def test_interrupted_populate_is_retried_not_given_up(monkeypatch):
    """EINTR / EAGAIN from the populate (a signal, a transient shortage) leaves the slot for
    the next wake; only EINVAL / ENOMEM stop the thread for the session."""
    import ctypes
    import errno as _errno

    import engine.expert_cache as ec

    real = ec._populate_call()
    if real is None:
        pytest.skip("no libc madvise")
    calls = []

    def interrupted_once(addr, n, advice):
        calls.append(addr)
        if len(calls) == 1:
            ctypes.set_errno(_errno.EINTR)
            return -1
        return real(addr, n, advice)

    monkeypatch.setattr(ec, "_populate_call", lambda: interrupted_once)
    cache = ExpertCache(_MBStore(), 1, 16, 16, policy="lru", io_threads=1)
    try:
        time.sleep(0.2)
        assert cache.populate.thread.is_alive()
        cache.load_experts(0, [0])  # a load wakes it
        assert _wait_for(lambda: int(cache.memory.faulted.sum()) >= 1 + cache.populate_ahead
                         or not cache.populate.thread.is_alive())
        if not cache.populate.thread.is_alive():
            pytest.skip("kernel without MADV_POPULATE_WRITE")
        assert len(calls) >= 2
    finally:
        cache.close()


def test_residency_matches_a_slot_by_slot_reading_of_the_cache_state():
    """cache.residency() (whole-array) against the slot-by-slot rule it implements: a live slot's
    expert is LOADING while its read runs, else PINNED or RESIDENT; experts in no slot ABSENT."""
    import engine.expert_cache as ec
    from engine.events import ABSENT, LOADING, PINNED, RESIDENT

    L, E, cap = 3, 12, 7
    cache = ExpertCache(_MBStore(), L, E, cap, policy="lru", io_threads=1)
    try:
        rng = np.random.default_rng(5)
        for trial in range(20):
            with cache.lock:
                cache.slot_state[:] = rng.choice([ec.FREE, ec.LOADING, ec.RESIDENT], size=(L, cap))
                cache.slot_expert[:] = -1
                for layer in range(L):
                    cache.slot_expert[layer] = rng.choice(E, cap, replace=False)
                cache.pinned[:] = rng.random((L, E)) < 0.3
                want = np.full((L, E), ABSENT, np.int8)
                for layer in range(L):
                    for s in range(cap):
                        st, e = cache.slot_state[layer, s], cache.slot_expert[layer, s]
                        if st == ec.LOADING:
                            want[layer, e] = LOADING
                        elif st == ec.RESIDENT:
                            want[layer, e] = PINNED if cache.pinned[layer, e] else RESIDENT
            got = cache.residency()
            assert got.dtype == np.int8 and np.array_equal(got, want), trial
        with cache.lock:  # leave a state close() can handle: nothing live
            cache.slot_state[:] = ec.FREE
            cache.slot_expert[:] = -1
    finally:
        cache.close()


# --- slots counted singly: layers with cap or cap - 1 (sizing, set_slots, the RSS guard) ------------

def test_set_slots_spreads_single_slots_over_the_broadest_layers_and_evicts_to_them():
    """``set_slots(n)``: every layer gets n // L slots and n % L layers one more, those whose
    routing reached the most distinct experts; lowering evicts each layer down to its own cap
    and no layer ever holds more than its cap."""
    L, E = 4, 16
    heat = np.zeros((L, E), np.int64)
    heat[2, :9] = 1  # layer 2 routed to the most experts, then layer 0
    heat[0, :5] = 1
    cache = ExpertCache(FakeStore(), L, E, 8, policy="lru", heat=heat, io_threads=2)
    try:
        for layer in range(L):
            cache.load_experts(layer, list(range(8)))
        assert cache.slots == 32 and cache.cap == 8
        n = cache.set_slots(22)  # 5 in every layer, one more in the 2 broadest (2, then 0)
        assert cache.layer_caps() == [6, 5, 6, 5] and cache.slots == 22 and cache.cap == 6
        assert n == 32 - 22
        assert [cache.live_slots(layer) for layer in range(L)] == [6, 5, 6, 5]
        for layer in range(L):  # misses keep each layer within its own cap
            cache.load_experts(layer, list(range(8, 16)))
            assert cache.live_slots(layer) == cache.layer_caps()[layer]
        cache.set_slots(1)  # clamped: one slot per layer at least
        assert cache.layer_caps() == [1] * L
        cache.set_slots(10 ** 6)  # clamped: the arena's width
        assert cache.layer_caps() == [8] * L
    finally:
        cache.close()
    with pytest.raises(ValueError, match="slots 3 must be between num_layers"):
        ExpertCache(FakeStore(), L, E, 8, slots=3)
    c2 = ExpertCache(FakeStore(), L, E, 8, slots=30, io_threads=1)
    try:  # an empty cache starts with the spread (no heat: the lower layers get the extra)
        assert c2.layer_caps() == [8, 8, 7, 7] and c2.slots == 30
    finally:
        c2.close()


def test_rss_guard_drops_the_slots_an_overrun_needs_not_one_per_layer():
    """An RSS 1.5 slots over the budget costs 2 slots, not one in each of the 8 layers (the
    7B int4 model at 4 GB: a 7 MB overrun took its cap from 61 to 59, 113 MB)."""
    L, E = 8, 16
    cache = ExpertCache(FakeStore(), L, E, 6, policy="lru", io_threads=2)
    try:
        for layer in range(L):
            cache.load_experts(layer, list(range(6)))
        assert cache.slots == 48
        slot = cache.slot_bytes
        other = 10_000_000
        budget = other + 48 * slot
        rss = {"v": budget + slot + slot // 2}
        guard = RssGuard(cache, budget, read_rss=lambda: rss["v"])
        msg = guard.step(0)
        assert guard.fired == 1 and cache.slots == 46, guard.trail
        assert sorted(cache.layer_caps()) == [5, 5] + [6] * 6
        assert guard.trail[0][2:] == (6, 6, 48, 46)
        assert "expert slots 48 -> 46 (6 -> 5-6 per layer), 2 cached experts evicted" in msg
        rss["v"] = other + cache.resident_bytes()  # back within the budget: nothing more
        assert guard.step(1) is None and cache.slots == 46
    finally:
        cache.close()


def test_rss_guard_says_once_when_one_slot_per_layer_cannot_hold_the_budget():
    """At one slot per layer the guard has nothing left to give back: a budget the process
    cannot stay under gets one message naming the budget to set, not silence (a 0.27 GB budget
    on the default model ended at 1 slot per layer, 0.28 GB RSS, no word)."""
    L, E = 4, 8
    cache = ExpertCache(FakeStore(), L, E, 1, policy="lru", io_threads=1)
    try:
        for layer in range(L):
            cache.load_experts(layer, [0])
        slot = cache.slot_bytes
        budget = 50_000_000
        guard = RssGuard(cache, budget, read_rss=lambda: budget + 3_000_000)
        msg = guard.step(0)
        assert guard.fired == 0 and cache.slots == L
        outside = budget + 3_000_000 - L * slot
        assert msg == (f"RSS 53 MB is over the 50 MB RAM budget with one expert slot per layer: this budget "
                       f"cannot be held; raise it to at least {(outside + L * slot) / 1e6:,.0f} MB for one slot "
                       f"per layer, more for speed")
        assert guard.step(1) is None  # said once
    finally:
        cache.close()


class _GatedStore(FakeStore):
    """A FakeStore whose read of ``expert`` says it started and then waits for ``gate``."""

    def __init__(self, expert):
        super().__init__()
        self.expert = expert
        self.started = threading.Event()
        self.gate = threading.Event()

    def read(self, layer, expert, buf, verify=False):
        if expert == self.expert:
            self.started.set()
            self.gate.wait(600)
        return super().read(layer, expert, buf, verify)


@pytest.mark.parametrize("lookup", ["take_split", "prepare_split"])
def test_a_lookup_with_hits_returns_once_a_reader_took_its_miss(monkeypatch, lookup):
    """A decode step's lookup that found hits and misses returns only once an idle reader
    thread has taken the first miss's read (DemandReads.hand_off), so the read is on the disk
    while the hits compute. Without it the reader waited for a core behind the kernel's
    threads (measured: a median 1.7 ms from queueing to the read's start on 2 cores, as long
    as the hits' compute). The hand-off's time limit is raised so that the test does not
    depend on the machine's speed."""
    import engine.cache.io as cache_io
    monkeypatch.setattr(cache_io, "HANDOFF_WAIT_S", 30.0)
    store = _GatedStore(9)
    cache = ExpertCache(store, 1, 16, 6, policy="lru", io_threads=1)
    try:
        cache.load_experts(0, [0, 1])
        assert _wait_for(lambda: cache.demand.idle_readers == 1)  # the reader is idle
        taken = cache.demand.taken
        out = getattr(cache, lookup)(0, [0, 1, 9])
        assert cache.demand.taken == taken + 1 and not cache.demand.queue  # a reader took the miss
        assert store.started.wait(600)
        assert out[-1] == [9]
        store.gate.set()
        hits = out[0]
        if lookup == "take_split":
            cache.release_slots(0, out[1])
        else:
            cache.acquire_many(0, hits)
            cache.release_many(0, hits)
        cache.acquire(0, 9)
        cache.release(0, 9)
        assert hits == [0, 1] and not cache.slot_busy.any()
    finally:
        store.gate.set()
        cache.close()


def test_a_lookup_does_not_wait_for_a_busy_reader_or_without_hits(monkeypatch):
    """The hand-off waits only for an idle reader, and only when hits compute next: a lookup
    whose reader is busy with another read, or one with misses only (it waits for them in
    acquire at once), returns without waiting for its reads to start."""
    import engine.cache.io as cache_io
    monkeypatch.setattr(cache_io, "HANDOFF_WAIT_S", 30.0)
    store = _GatedStore(9)
    cache = ExpertCache(store, 1, 16, 6, policy="lru", io_threads=1)
    try:
        cache.load_experts(0, [0, 1])
        assert _wait_for(lambda: cache.demand.idle_readers == 1)  # the reader is idle
        waits = []                                            # the hand-off's waits, if any
        real_wait = cache.demand.taken_cv.wait
        cache.demand.taken_cv.wait = lambda timeout=None: (waits.append(timeout), real_wait(timeout))[1]
        hits, misses = cache.prepare_split(0, [9, 10])  # misses only
        assert hits == [] and misses == [9, 10]
        assert store.started.wait(600)  # the reader is now busy with 9, gated
        hits, slots, misses = cache.take_split(0, [0, 11])  # a hit and a miss, the reader busy
        assert waits == [] and misses == [11]
        cache.release_slots(0, slots)
        store.gate.set()
        for e in (9, 10, 11):
            cache.acquire(0, e)
            cache.release(0, e)
    finally:
        store.gate.set()
        cache.close()
