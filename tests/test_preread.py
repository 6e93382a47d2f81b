"""The pre-read (setting idle_fill, on by default): one sequential pass over the store's experts
from open, in large reads in file order, that a demand read always goes before; a first answer
after it reads nothing on demand, and its tokens are those of a run without it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore


def _answer(eng, n=12):
    req = GenerateRequest(prompt_ids=(5, 6, 7, 8, 9), sampling=SamplingParams(max_new_tokens=n))
    fin = list(eng.generate(req))[-1]
    assert fin.error == ""
    return fin


def test_a_first_answer_after_the_pass_reads_no_expert_on_demand(medium_store):
    """With the default settings a store that fits its budget is read whole at open; the first
    answer then has no miss and no demand byte, and its tokens equal those of a run with the
    pass off (which reads its experts on demand)."""
    # a budget with room for the test process beside the whole store (an automatic one is the
    # RSS at open plus what the model needs, which a first kernel compile here can outgrow)
    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        assert eng.config.idle_fill  # the default
        assert eng.cache.wait_filled(timeout=600.0)
        assert eng.cache.residency().all()
        on = _answer(eng)
        assert eng.cache.stats.misses == 0 and eng.cache.stats.demand_bytes == 0
        assert on.hit_rate == 1.0
    with Engine.open(EngineConfig(idle_fill=False, **cfg)) as eng:
        off = _answer(eng)
        assert eng.cache.stats.misses > 0 and eng.cache.stats.fill_loads == 0
    assert on.token_ids == off.token_ids and on.text == off.text


def _recording_store(path, gate_first_run: threading.Event | None = None):
    """An ExpertStore whose positional reads are recorded as (offset, buffers, bytes); with
    ``gate_first_run`` the first read of more than one buffer waits for it (``run_started``
    is set when it begins)."""
    store = ExpertStore(path, o_direct=False)
    calls: list[tuple[int, int, int]] = []
    real = store._preadv
    run_started = threading.Event()
    lock = threading.Lock()

    def preadv(fd, bufs, offset):
        with lock:
            first_run = len(bufs) > 1 and not run_started.is_set()
            if first_run:
                run_started.set()
        if first_run and gate_first_run is not None:
            assert gate_first_run.wait(600.0)
        n = real(fd, bufs, offset)
        with lock:
            calls.append((offset, len(bufs), n))
        return n
    store._preadv = preadv
    return store, calls, run_started


def test_the_pass_reads_back_to_back_slabs_in_one_read_each_run(medium_store):
    """Each layer's slabs lie back to back in its file: the pass reads them with one positional
    read of many buffers, in file order, and the bytes are those of one read per slab
    (checksums verified on the way: no read error)."""
    store, calls, _ = _recording_store(medium_store)
    a = store.args
    L, E = a.num_moe_layers, a.num_experts
    cache = ExpertCache(store, L, E, E, policy="lru", io_threads=1, fill=True)
    try:
        cache.preread.pass_run = 6  # runs of 6, 6, 4 slabs per layer
        assert cache.start_fill() and cache.wait_filled(timeout=600.0)
        assert cache.residency().all() and cache.stats.read_errors == 0
        assert cache.stats.fill_loads == L * E and cache.stats.demand_bytes == 0
        assert [c[1] for c in calls] == [6, 6, 4] * L
        assert all(n == k * store.slot_bytes for _o, k, n in calls)
        for layer in range(L):  # file order: each layer's runs at ascending offsets
            offs = [c[0] for c in calls[3 * layer:3 * layer + 3]]
            assert offs == sorted(offs)
        one = store.new_buffer()
        for layer in range(L):
            for e in range(E):
                store.read(layer, e, one)
                v = cache.acquire(layer, e)
                try:
                    got = cache.arena[cache.memory.offset(layer, cache.where[layer, e]):][:store.slot_bytes]
                    assert np.array_equal(got, one)
                finally:
                    cache.release(layer, e)
                assert v
    finally:
        cache.close()
        store.close()


def test_a_demand_read_during_the_pass_goes_first(medium_store):
    """A demand read that arrives while a pass run is in flight is read at once, beside it (the
    pass run cannot hold it back), and the pass starts its next run only after it: the last
    expert of the last layer, which the pass would read last, is resident while the pass's
    first run still waits."""
    gate = threading.Event()
    store, calls, run_started = _recording_store(medium_store, gate)
    a = store.args
    L, E = a.num_moe_layers, a.num_experts
    cache = ExpertCache(store, L, E, E, policy="lru", io_threads=1, fill=True)
    try:
        cache.preread.pass_run = 4
        assert cache.start_fill()
        assert run_started.wait(600.0)
        last = (L - 1, E - 1)
        cache.prepare(L - 1, [E - 1])
        v = cache.acquire(*last)  # served while the pass's first run is held
        cache.release(*last)
        assert v and not gate.is_set()
        assert cache.stats.demand_bytes == store.slot_bytes and cache.stats.misses == 1
        assert calls == [(store.experts[last[0]][last[1]]["offset"], 1, store.slot_bytes)]
        gate.set()
        assert cache.wait_filled(timeout=600.0)
        assert cache.residency().all()
        # after the demand read: the held run, then the rest of the pass (the demanded expert
        # not read again)
        assert calls[1][1] == 4 and sum(k for _o, k, _n in calls[1:]) == L * E - 1
    finally:
        gate.set()
        cache.close()
        store.close()


def test_a_held_pass_reads_nothing_until_released(medium_store):
    """hold_fill (the engine holds the pass while it generates: its demand reads then have the
    disk and the cores alone) stops the pass before any run; release_fill lets it read the
    whole store."""
    store, calls, _ = _recording_store(medium_store)
    a = store.args
    cache = ExpertCache(store, a.num_moe_layers, a.num_experts, a.num_experts, policy="lru", io_threads=1, fill=True)
    try:
        cache.hold_fill()
        assert cache.start_fill()
        for _ in range(6000):  # the fill thread has woken and seen the hold (it clears the wake first)
            if not cache.preread.wake_event.is_set():
                break
            threading.Event().wait(0.01)
        with cache.lock:  # a run starts only after the hold check, under this lock
            assert cache.stats.fill_loads == 0 and cache.preread.inflight == 0 and calls == []
        assert cache.fill_pending() == a.num_moe_layers * a.num_experts
        cache.release_fill()
        assert cache.wait_filled(timeout=600.0) and cache.residency().all()
    finally:
        cache.close()
        store.close()


def test_a_first_answer_asked_at_open_follows_the_pass(medium_store, monkeypatch):
    """A question asked while the pass still runs (a one-shot `colibri run`, or one typed right
    at open) on a store that fits: the prefill waits for the pass layer by layer instead of
    reading on demand beside it, so the answer reads nothing on demand and its tokens equal a
    run with the pass off. The pass's reads are held until the answer's forward starts, so the
    answer certainly begins before the pass has read anything."""
    from engine.observers import Observer

    gate = threading.Event()
    real = ExpertStore.read_run

    def gated(self, *args, **kwargs):
        assert gate.wait(600.0)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(ExpertStore, "read_run", gated)

    class OpenGate(Observer):
        def on_forward_start(self, pos0, num_tokens):
            gate.set()

    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        a = eng.args
        assert eng.cache.stats.fill_loads == 0 and not gate.is_set()
        eng.model.subscribe(OpenGate())
        on = _answer(eng)
        assert eng.cache.stats.misses == 0 and eng.cache.stats.demand_bytes == 0
        assert eng.cache.stats.fill_loads == a.num_moe_layers * a.num_experts
    with Engine.open(EngineConfig(idle_fill=False, **cfg)) as eng:
        off = _answer(eng)
        assert eng.cache.stats.misses > 0
    assert on.token_ids == off.token_ids and on.text == off.text


def _spy_collapses(monkeypatch):
    """(calls, done): the cache's MADV_COLLAPSE calls (address, bytes), and an event set at each."""
    import engine.expert_cache as ec
    real = ec._populate_call()
    if real is None:
        pytest.skip("libc madvise is Linux's")
    calls, done = [], threading.Event()

    def spy(addr, n, advice):
        if advice == ec.MADV_COLLAPSE:
            calls.append((addr, n))
            done.set()
        return real(addr, n, advice)

    monkeypatch.setattr(ec, "_populate_call", lambda: spy)
    return calls, done


def test_a_full_arena_is_asked_onto_huge_pages_once(medium_store, monkeypatch):
    """Once the pass has filled every slot, the whole arena is asked onto huge pages
    (MADV_COLLAPSE), once: the blocks two slots share too, which the advice at open leaves out."""
    calls, done = _spy_collapses(monkeypatch)
    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        assert eng.cache.wait_filled(timeout=600.0) and eng.cache.residency().all()
        assert done.wait(600.0)
        _answer(eng)  # a pass woken again finds the arena collapsed already
        eng.cache.start_fill()
        assert eng.cache.wait_filled(timeout=600.0)
        base, total = eng.cache.arena.ctypes.data, eng.cache.arena.nbytes
        assert calls[0][0] == base and sum(n for _a, n in calls) == total
        assert all(a + n == b for (a, n), (b, _m) in zip(calls, calls[1:]))  # in steps, each byte once


def test_a_collapse_pauses_when_an_answer_starts_and_resumes_after_it(medium_store, monkeypatch):
    """The collapse runs in steps: an answer that begins during one stops it before its next
    step (the answer waits on one step's copying, not the whole arena's), and the answer's end
    wakes the pass, which goes on from where it paused: every byte asked once, steps ending on
    huge-page boundaries."""
    from engine.cache import preread
    from engine.cache.arena import MADV_COLLAPSE
    calls, done = _spy_collapses(monkeypatch)
    page = 64 << 10  # the test's arena is under one huge page: steps of 64 KB "huge pages"
    monkeypatch.setattr(preread, "HUGE_PAGE", page)
    monkeypatch.setattr(preread, "COLLAPSE_CHUNK", 2 * page)
    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        c = eng.cache
        assert c.wait_filled(timeout=600.0) and c.residency().all()
        deadline = time.monotonic() + 600  # only a hang trips it
        while not c.preread.collapsed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.preread.collapsed  # the pass's own collapse; now one driven by hand from the start
        with c.lock:
            c.preread.collapsed, c.preread.collapse_at = False, 0
        calls.clear()
        real = c.memory.madvise

        def spy(addr, n, advice):
            if advice == MADV_COLLAPSE and not calls:  # an answer begins during the first step
                c.begin_answer()
            return real(addr, n, advice)

        monkeypatch.setattr(c.memory, "madvise", spy)
        c.collapse_full()
        assert len(calls) == 1 and not c.preread.collapsed and c.preread.answers == 1
        c.end_answer()  # wakes the pass, which resumes
        while not c.preread.collapsed and time.monotonic() < deadline:
            time.sleep(0.01)
        base, total = c.arena.ctypes.data, c.arena.nbytes
        assert total > 6 * page and c.preread.collapsed
        assert calls[0][0] == base and sum(n for _a, n in calls) == total and len(calls) > 2
        assert all(a + n == b for (a, n), (b, _m) in zip(calls, calls[1:]))
        assert all((a + n) % page == 0 for a, n in calls[:-1])


def test_no_collapse_while_an_answer_holds_the_pass(medium_store, monkeypatch):
    """The kernel's copying of a collapse slowed a first answer's decode about 3x: while the
    engine holds the pre-read (an answer), collapse_full does nothing; the last release_fill
    wakes the pass, which collapses then."""
    calls, done = _spy_collapses(monkeypatch)
    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        c = eng.cache
        assert c.wait_filled(timeout=600.0) and c.residency().all()
        assert done.wait(600.0)            # collapsed once nothing held it
        # as if it had not collapsed yet, then an answer holds the pass (hold_fill), or lets the pass
        # run to follow it (begin_answer): no collapse until its end wakes the pass, which collapses
        for hold, release in ((c.hold_fill, c.release_fill), (c.begin_answer, c.end_answer)):
            assert c.preread.collapse_idle.wait(600.0)
            n = len(calls)
            with c.lock:
                c.preread.collapsed, c.preread.collapse_at = False, 0
            hold()
            c.collapse_full()
            assert len(calls) == n and not c.preread.collapsed
            release()
            deadline = time.monotonic() + 600  # only a hang trips it
            while len(calls) == n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(calls) == n + 1


def test_a_store_that_fits_asks_for_its_embedding_table_in_the_page_cache(medium_store, monkeypatch):
    """A store that fits its budget has its token-embedding table asked into the OS's page cache
    at open (POSIX_FADV_WILLNEED over each part's bytes), so a decode step finds a new id's row in
    memory; a store whose experts do not all fit leaves the table's pages to the OS."""
    import os

    import engine.expert_store as es
    asked = []
    real = os.posix_fadvise

    class Os:
        POSIX_FADV_WILLNEED = os.POSIX_FADV_WILLNEED

        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def posix_fadvise(fd, off, n, advice):
            if advice == os.POSIX_FADV_WILLNEED:
                asked.append((off, n))
            return real(fd, off, n, advice)

    monkeypatch.setattr(es, "os", Os())
    cfg = dict(store=str(medium_store), history=False, o_direct=False, pinning=False, ram_budget_gb=4.0)
    with Engine.open(EngineConfig(**cfg)) as eng:
        rows = eng.model.embed_rows
        want = sorted((off, row * rows.num_rows) for _n, _dt, _s, off, row in rows.parts)
        assert sorted(asked) == want and want
        before = _answer(eng).token_ids
    asked.clear()
    with Engine.open(EngineConfig(cap=2, **cfg)) as eng:
        assert eng.plan.slots < eng.cache.L * eng.cache.E
        assert asked == []
        assert _answer(eng).token_ids == before
