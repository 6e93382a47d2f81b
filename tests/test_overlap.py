"""Streaming overlap: checksums verified by the reader threads, old stores still
open, realistic routing replayed deterministically, values identical across placement."""

from __future__ import annotations

import json
import shutil
import threading
import time
import zlib

import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from engine.errors import ExpertReadError, StoreError
from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore
from engine.trace import RecordedRouting, TraceRecorder, load_trace


def _corrupt(store_dir, layer, expert):
    m = json.loads((store_dir / "manifest.json").read_text())
    e = m["experts"][layer][expert]
    with open(store_dir / e["file"], "r+b") as fh:
        fh.seek(e["offset"] + 17)
        b = fh.read(1)
        fh.seek(e["offset"] + 17)
        fh.write(bytes([b[0] ^ 0x5A]))


def test_new_stores_carry_xxh3_and_the_current_version(tiny_store):
    m = json.loads((tiny_store / "manifest.json").read_text())
    assert m["version"] == 4 and m["checksum"] == "xxh3_64"
    assert all(isinstance(e["xxh3_64"], int) for row in m["experts"] for e in row)


def test_reader_thread_verifies_and_names_the_corrupt_expert(tiny_store, tmp_path):
    """A corrupt slab fails in the reader thread, the compute thread gets the error naming the
    expert, the layer and the checksum; the compute thread itself never reads a slab."""
    dst = tmp_path / "st"
    shutil.copytree(tiny_store, dst)
    _corrupt(dst, 1, 3)
    st = ExpertStore(dst)
    readers = []
    real_read = st.read

    def spy(layer, expert, buf, verify=False):
        readers.append(threading.current_thread().name)
        return real_read(layer, expert, buf, verify)
    st.read = spy
    E = st.args.num_experts
    cache = ExpertCache(st, st.args.num_moe_layers, E, cap=2, checksum="first", io_threads=1)
    try:
        for e in cache.prepare(1, [0, 3]):  # cap 2: both reserved by prepare
            if e == 3:
                with pytest.raises(ExpertReadError, match=r"expert 3 of layer 1 fails its xxh3_64 checksum.*colibri convert"):
                    cache.acquire(1, 3)
            else:
                cache.acquire(1, e)
                cache.release(1, e)
        # another layer's reads: also on a reader thread
        for e in cache.prepare(0, [1, 2]):
            cache.acquire(0, e)
            cache.release(0, e)
    finally:
        cache.close()
        st.close()
    assert readers and all(n.startswith("colibri-io") for n in readers), readers
    assert threading.main_thread().name not in readers


def test_acquire_without_a_slot_is_read_by_a_reader(tiny_store):
    st = ExpertStore(tiny_store)
    names = []
    real_read = st.read
    st.read = lambda *a, **k: (names.append(threading.current_thread().name), real_read(*a, **k))[1]
    cache = ExpertCache(st, st.args.num_moe_layers, st.args.num_experts, cap=1, checksum="always", io_threads=1)
    try:
        order = cache.prepare(0, [2, 5, 6])  # one slot: 5 and 6 find none until 2 is released
        for e in order:
            cache.acquire(0, e)
            cache.release(0, e)
        assert cache.stats.loads == 3
    finally:
        cache.close()
        st.close()
    assert len(names) == 3 and all(n.startswith("colibri-io") for n in names), names


def _as_version_1(store_dir):
    """Rewrite a store's manifest as a version-1 store (zlib crc32 per slab), as older engines wrote."""
    m = json.loads((store_dir / "manifest.json").read_text())
    for row in m["experts"]:
        for e in row:
            with open(store_dir / e["file"], "rb") as fh:
                fh.seek(e["offset"])
                e["crc32"] = zlib.crc32(fh.read(e["length"]))
            del e["xxh3_64"]
    m["version"], m["checksum"] = 1, "crc32"
    (store_dir / "manifest.json").write_text(json.dumps(m))


def test_version_1_store_still_opens_and_verifies_crc32(tiny_store, tmp_path):
    dst = tmp_path / "v1"
    shutil.copytree(tiny_store, dst)
    _as_version_1(dst)
    cfg = EngineConfig(store=str(dst), history=False, pinning=False, checksum="always")
    req = GenerateRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=4))
    with Engine.open(cfg) as eng:
        assert eng.store.checksum_kind == "crc32"
        v1 = list(eng.generate(req))[-1].token_ids
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, pinning=False)) as eng:
        v2 = list(eng.generate(req))[-1].token_ids
    assert v1 == v2
    _corrupt(dst, 0, 0)
    st = ExpertStore(dst)
    try:
        with pytest.raises(ExpertReadError, match="expert 0 of layer 0 fails its crc32 checksum"):
            st.read(0, 0, st.new_buffer(), verify=True)
    finally:
        st.close()


def _as_version_2_int4(src, dst):
    """Rewrite an int4 store (format 3: half-precision group scales) as format 2 wrote it:
    float32 scales, so every slab is re-laid out (new offsets, lengths, checksums)."""
    import xxhash

    from engine.quant import int4_scales, slab_layout, slab_views
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    a = json.loads((dst / "config.json").read_text())
    lay = slab_layout("int4", a["hidden_size"], a["intermediate_size"], m["group_size"], f32_int4_scales=True)
    new3 = m["slab_layout"]
    out = open(dst / "experts_v2.bin", "wb")
    off = 0
    for row in m["experts"]:
        for e in row:
            with open(src / e["file"], "rb") as fh:
                fh.seek(e["offset"])
                v = slab_views(np.frombuffer(fh.read(e["length"]), np.uint8), new3)
            buf = np.zeros(lay["slot_bytes"], np.uint8)
            for name, o, dt, shape in lay["fields"]:
                x = int4_scales(v[name]) if name.endswith(".s") else v[name]
                buf[o:o + x.nbytes] = np.ascontiguousarray(x, np.dtype(dt)).view(np.uint8).reshape(-1)
            out.write(buf.tobytes())
            e.update(file="experts_v2.bin", offset=off, length=lay["slot_bytes"], xxh3_64=xxhash.xxh3_64_intdigest(buf))
            off += lay["slot_bytes"]
    out.close()
    m["slab_layout"] = json.loads(json.dumps(lay))
    m["slot_bytes"] = [lay["slot_bytes"]] * len(m["slot_bytes"])
    m["version"] = 2
    (dst / "manifest.json").write_text(json.dumps(m))
    return lay, new3


@pytest.mark.slow  # every q4 kernel compiled again for float32 scales: ~45 s on 2 cores
def test_version_2_int4_store_with_float32_scales_opens_and_decodes_the_same(tiny_checkpoint, tmp_path):
    """Format 3 stores int4 group scales as half bits (slabs ~10% smaller); a format-2 int4
    store (float32 scales) still opens, verifies and gives the same tokens and logits."""
    from engine import convert_checkpoint
    v3 = convert_checkpoint(tiny_checkpoint, tmp_path / "v3", quant="int4", expert_layout="row_major")
    lay2, lay3 = _as_version_2_int4(v3, tmp_path / "v2")
    assert json.loads((v3 / "manifest.json").read_text())["version"] == 4  # half scales since 3
    assert {f[0]: f[2] for f in lay3["fields"]}["gate_proj.s"] == "<u2"
    assert lay3["data_bytes"] < lay2["data_bytes"]
    req = GenerateRequest(prompt_ids=(5, 6, 7, 9), sampling=SamplingParams(max_new_tokens=6))
    got = {}
    for name, d in (("v3", v3), ("v2", tmp_path / "v2")):
        with Engine.open(EngineConfig(store=str(d), history=False, pinning=False, checksum="always", cap=2)) as eng:
            assert eng.store.quant == "int4"
            got[name] = (list(eng.generate(req))[-1].token_ids, eng.model.forward(np.array([5, 6, 7]), 0, all_logits=True))
    assert got["v2"][0] == got["v3"][0]
    assert np.array_equal(got["v2"][1], got["v3"][1])


def test_unknown_store_version_asks_for_a_reconvert(tiny_store, tmp_path):
    dst = tmp_path / "v9"
    shutil.copytree(tiny_store, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["version"] = 9
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"store version 9.*reads versions 1, 2, 3, 4.*colibri convert --overwrite"):
        ExpertStore(dst)


# --- realistic routing ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logits_trace(tiny_store, tmp_path_factory):
    """A logits trace of the tiny model (2 layers x 8 experts, top-2), teacher forced."""
    path = tmp_path_factory.mktemp("tr") / "t.jsonl"
    stream = np.random.default_rng(4).integers(10, 200, 40).tolist()
    cfg = EngineConfig(store=str(tiny_store), history=False, pinning=False, pilot=0, speculation="off")
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng, logits=True)
        list(eng.generate(GenerateRequest(prompt_ids=tuple(stream[:1]), forced_ids=tuple(stream[1:]),
                                          sampling=SamplingParams(max_new_tokens=39))))
        rec.save(path)
    return path


def test_trace_records_router_and_predictor_logits(logits_trace):
    head, recs = load_trace(logits_trace)
    assert head["logits"] is True
    calls = [r for r in recs if "l" in r]
    assert all(len(r["lg"]) == len(r["idx"]) and len(r["lg"][0]) == 8 for r in calls)
    # the recorded logits reproduce the recorded routing (top-2, lowest id on ties)
    for r in calls:
        for row, ids in zip(r["lg"], r["idx"]):
            assert sorted(np.argsort(-np.asarray(row), kind="stable")[:2].tolist()) == sorted(ids)
    # decode steps of layer 1 carry the distance-1 predictor (from layer 0's post-attention residual)
    assert sum("pl" in r and "1" in r["pl"] for r in calls if r["l"] == 1) >= 30


def test_realistic_mapping_is_deterministic_and_keeps_the_choices(logits_trace):
    a = RecordedRouting(logits_trace, num_layers=4, num_experts=16, seed=0)
    b = RecordedRouting(logits_trace, num_layers=4, num_experts=16, seed=0)
    c = RecordedRouting(logits_trace, num_layers=4, num_experts=16, seed=1)
    assert np.array_equal(a.src_of, b.src_of) and not np.array_equal(a.src_of, c.src_of)
    assert a.src_layer.tolist() == [0, 0, 1, 1]  # layer t -> t * L_src // L_dst
    pos = np.arange(30)
    for t in range(4):
        la, lb = a.real_logits(t, pos), b.real_logits(t, pos)
        assert np.array_equal(la, lb)
        s = a.src_layer[t]
        for p in pos:
            big = set(np.argsort(-la[p], kind="stable")[:4].tolist())  # top-4 of 16
            small = np.argsort(-a.real[p, s], kind="stable")[:2]  # top-2 of 8
            # the big top-4 is exactly the two blocks of the source's top-2
            assert big == {int(d) for d in np.nonzero(np.isin(a.src_of[t], small))[0]}
    with pytest.raises(ValueError, match="multiple"):
        RecordedRouting(logits_trace, num_layers=4, num_experts=12)


def test_trace_without_logits_is_refused(tiny_store, tmp_path):
    cfg = EngineConfig(store=str(tiny_store), history=False, pinning=False)
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng)
        list(eng.generate(GenerateRequest(prompt_ids=(3, 4), sampling=SamplingParams(max_new_tokens=2))))
        rec.save(tmp_path / "plain.jsonl")
    with pytest.raises(ValueError, match="no router logits.*--logits"):
        RecordedRouting(tmp_path / "plain.jsonl", 4, 16)


def test_realistic_routing_values_identical_across_placement(medium_store, logits_trace):
    """The medium model (4 layers x 16 experts, top-4) driven by the tiny model's routing:
    the replayed routing is what the model uses, and logits are byte-identical across cap,
    PILOT modes, workers and read threads."""
    from engine.bench.arm import run_arm
    base = dict(history=False, pinning=False, routing_trace=str(logits_trace))
    rows = [run_arm(str(medium_store), dict(base, **o), 8, 16, 0) for o in (
        dict(cap=16, pilot=0), dict(cap=4, pilot=0, io_threads=1), dict(cap=4, pilot=0, io_threads=4),
        dict(cap=4, pilot=1, spec_precision=0.0), dict(cap=4, pilot=2, pilot_workers=4, spec_precision=0.0),
        dict(cap=5, pilot=3, io_threads=2))]
    assert len({r["sha256_logits"] for r in rows}) == 1, [r["sha256_logits"] for r in rows]
    assert all(r["routing"] == "realistic" for r in rows)
    assert sum(r["spec"]["spec_issued"] for r in rows) > 0  # PILOT acted on the replayed predictions
    forced = run_arm(str(medium_store), dict(history=False, pinning=False, cap=4, pilot=0), 8, 16, 0)
    assert forced["routing"] == "forced" and forced["sha256_logits"] != rows[0]["sha256_logits"]


def test_replayed_routing_is_the_routing_the_model_uses(medium_store, logits_trace):
    from engine.observers import Observer
    rr = RecordedRouting(logits_trace, 4, 16, seed=0)
    seen = []

    class Spy(Observer):
        def on_route(self, layer, idx, router_logits):
            seen.append((layer, idx.copy()))
    cfg = EngineConfig(store=str(medium_store), history=False, pinning=False, cap=6, pilot=1)
    with Engine.open(cfg) as eng:
        RecordedRouting(logits_trace, 4, 16, seed=0).install(eng.model)
        eng.subscribe(Spy())
        list(eng.generate(GenerateRequest(prompt_ids=(1, 2, 3, 4, 5), forced_ids=(6, 7, 8, 9),
                                          sampling=SamplingParams(max_new_tokens=4))))
    # prefill (5 rows at positions 0..4), then one row per decode step
    pos = {l: 0 for l in range(4)}
    for layer, idx in seen:
        n = idx.shape[0]
        want = np.argsort(-rr.real_logits(layer, np.arange(pos[layer], pos[layer] + n)), axis=1, kind="stable")[:, :4]
        assert np.array_equal(idx, want), layer
        pos[layer] += n
    assert pos[0] == 5 + 3  # 4 forced tokens: the last is emitted without a forward


@pytest.mark.parametrize("cap", [6, 16])
def test_replayed_routing_runs_in_the_one_call_decode_step(medium_store, logits_trace, monkeypatch, cap):
    """A replayed routing (RecordedRouting) hands the decode step's logits to the one-call path
    (routing_replay.step_logits): streaming (cap 6 of 16) or all resident, pilot 0, the kernel
    runs and the logits of every forward are bit-identical to the per-layer path's, with the
    replayed routing (the realistic arms of `bench overlap` measure the product's decode path)."""
    import engine.models.base as base
    from engine.expert_cache import ExpertCache
    runs = []
    real = ExpertCache.take_resident_layers

    def spy(self, *a, **kw):
        runs.append(1)
        return real(self, *a, **kw)
    monkeypatch.setattr(ExpertCache, "take_resident_layers", spy)
    out = {}
    for one_call in (True, False):
        monkeypatch.setattr(base, "DECODE_T1", one_call)
        runs.clear()
        cfg = EngineConfig(store=str(medium_store), history=False, pinning=False, cap=cap, pilot=0, o_direct=False)
        with Engine.open(cfg) as eng:
            m = eng.model
            if one_call:
                assert m.wait_decode_ready(900)
            if cap == 16:
                for layer in range(4):
                    eng.cache.load_experts(layer, range(16))
            rr = RecordedRouting(logits_trace, 4, 16, seed=0).install(m)
            logits = [m.forward(np.arange(1, 6), 0)]
            for p in range(5, 25):
                logits.append(m.forward(np.array([p + 3]), p))
            assert np.array_equal(rr.step_logits(7)[2], rr.real_logits(2, [7])[0])
            rr.uninstall()
            assert m.routing_replay is None
        assert bool(runs) == one_call
        out[one_call] = np.concatenate(logits)
    assert np.array_equal(out[True].view(np.uint32), out[False].view(np.uint32))


def test_misses_are_read_in_compute_order_one_at_a_time():
    """io_threads=1: a layer's misses are read one after another, in the order prepare returns
    (the order the layer computes them), so the first needed is never behind the others."""
    import time as _t

    class SlowStore:
        slot_bytes = 4096
        path = "."
        experts = None

        def __init__(self):
            self.order, self.inflight, self.max_inflight = [], 0, 0
            self.lk = threading.Lock()

        def read(self, layer, expert, buf, verify=False):
            with self.lk:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
                self.order.append(expert)
            _t.sleep(0.01)
            with self.lk:
                self.inflight -= 1
            return 4096

        def views(self, buf):
            return {}
    st = SlowStore()
    cache = ExpertCache(st, 1, 16, cap=8, io_threads=1)
    try:
        cache.prepare(0, [2, 7])
        for e in (2, 7):
            cache.acquire(0, e)
            cache.release(0, e)
        st.order.clear()
        order = cache.prepare(0, [2, 4, 7, 9, 12])  # the engine passes ascending ids (np.unique)
        assert order == [2, 7, 4, 9, 12]  # hits first, then misses by id
        for e in order:
            cache.acquire(0, e)
            cache.release(0, e)
    finally:
        cache.close()
    assert st.order == [4, 9, 12] and st.max_inflight == 1


def test_arena_offsets_past_2_gib_do_not_wrap():
    """Slot ids from the int32 index arrays: the arena offset of a slot past 2 GiB must not
    wrap (it did: 7B store, 4 GB budget, cap 31 -> a 3.1 GB arena, evicted slots overlapped
    others and decoding produced NaN logits). The arena is virtual: nothing is touched."""
    class BigSlabStore:
        slot_bytes = 64 << 20

        def read(self, layer, expert, buf, verify=False):
            return self.slot_bytes

        def views(self, buf):
            return {}
    cache = ExpertCache(BigSlabStore(), 2, 40, cap=20, io_threads=1)  # 2.7 GB arena
    try:
        base = cache.arena.ctypes.data
        for layer, slot in ((1, np.int32(19)), (1, np.int64(10)), (0, 19)):
            b = cache.memory.buf(layer, slot)
            assert b.ctypes.data - base == (layer * 20 + int(slot)) * (64 << 20)
            assert b.size == 64 << 20
    finally:
        cache.close()


def test_reserve_and_fill_stay_inside_the_ram_budget(tiny_store, monkeypatch):
    """The engine asks RSS + slot (+ KV before the model is built) + headroom within the
    budget before the reservation or the idle fill grows the process (a reservation once took a 7B int4 store's RSS to 4.03 GB at
    a 4.0 GB budget and a 4 GB cgroup killed it). A fake RSS (a base + the arena's faulted
    slots) leaves room for 5 slots: the reservation stops there, the fill reads into no new
    slot, and generation still works (demand loads: the RSS guard's business)."""
    holder = {}

    def fake_rss():
        c = holder.get("cache")
        return holder["base"] + (int(c.memory.faulted.sum()) * c.slot_bytes if c is not None else 0)
    ctx = 512  # the KV the plan sets aside at open is then the whole context's (sizing.KV_OPEN_TOKENS)
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, cap=3,
                                  context_length=ctx)) as eng:
        slot, plan = eng.cache.slot_bytes, eng.plan
    assert plan.kv_set_aside == plan.kv
    budget_gb = (plan.dense + plan.kv + plan.reserve + 3 * eng.args.num_moe_layers * slot) / 1e9 + 1e-6
    from engine.ram_budget import GROWTH_HEADROOM_BYTES
    # room for 5 slots beside the KV cache the plan sets aside (not in the RSS before the
    # context reaches it: the engine counts it in)
    holder["base"] = int(budget_gb * 1e9) - GROWTH_HEADROOM_BYTES - 5 * slot - slot // 2 - plan.kv
    import engine.engine_setup as G  # where Engine.open builds its cache

    class Seen(G.ExpertCache):  # the fake RSS sees the arena from the cache's first thread on
        def __init__(self, *a, **kw):
            holder["cache"] = self
            self._faulted = np.zeros(1, bool)
            super().__init__(*a, **kw)
    monkeypatch.setattr(G, "ExpertCache", Seen)
    for over in (dict(reserve_cache=True), dict(idle_fill=True)):
        with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, ram_budget_gb=budget_gb,
                                      pinning=False, context_length=ctx, **over), read_rss=fake_rss) as eng:
            c = eng.cache
            assert c is holder["cache"] and c.cap == 3 and c.grow_ok is not None
            if c.populate.thread is None or not c.populate.thread.is_alive():
                pytest.skip("no MADV_POPULATE_WRITE here")
            assert c.wait_populated(timeout=600.0) and c.wait_filled(timeout=600.0)
            assert c.grow_stopped and int(c.memory.faulted.sum()) <= 5
            if over.get("idle_fill"):
                assert c.stats.fill_loads <= 5
            req = GenerateRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=3))
            assert list(eng.generate(req))[-1].error == ""
            holder.pop("cache")


def test_two_growers_asking_at_once_get_one_yes_for_the_last_slot():
    """The populate thread and the idle-fill pass both ask grow_ok before adding a slot's
    pages; the pages come in after the answer, so a yes holds its bytes until ``grown``: asked
    twice before the first slot's pages are in, the budget's last slot is given once (both
    were told yes on a busy machine and the cache grew one slot past the budget)."""
    from engine.cache.populate import PopulateAhead

    class Owner:
        slot_bytes = 100
        lock = threading.Lock()
    rss = {"now": 1000}
    asked = []

    def grow_ok(nbytes):
        asked.append(nbytes)
        return rss["now"] + nbytes <= 1100  # room for one slot
    p = PopulateAhead(Owner(), 2, grow_ok)
    assert p.may_grow(1)  # the populate thread: yes, its pages not in yet
    assert not p.may_grow(2) and not p.grow_stopped  # a no to more leaves fewer open
    assert not p.may_grow(1) and p.grow_stopped  # the pre-read: the held slot counts
    assert asked == [100, 300, 200]
    rss["now"] += 100  # the first slot's pages are in the RSS now
    p.grown(1)
    assert p.growing == 0
    p.allow_growth()
    assert not p.may_grow(1)  # still no room: the RSS has it
    p.allow_growth()
    rss["now"] -= 100  # the slot given back (a lower cap)
    assert p.may_grow(1) and p.growing == 100
    p.grown(1)
    p.grown(1)  # given back twice: never below zero
    assert p.growing == 0


def test_reserve_cache_setting_reserves_the_whole_cap(tiny_store):
    """The settings reserve_cache (every slot under the cap populated ahead) and idle_fill
    (a store that fits becomes resident) reach the cache and the CLI (``colibri run --reserve-cache``); the bench's first-touch probe measures."""
    from engine.bench.overlap import measure_first_touch
    from engine.cli.main import build_parser
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, reserve_cache=True,
                                  cap=3)) as eng:
        assert eng.cache.populate_ahead == eng.cache.max_cap == 3
        assert eng.cache.wait_populated(timeout=600.0)
        if eng.cache.populate.thread is not None and eng.cache.populate.thread.is_alive():
            assert eng.cache.memory.faulted.all()
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, cap=3)) as eng:
        assert eng.cache.populate_ahead == 2
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, idle_fill=True)) as eng:
        assert eng.cache.fill and eng.cache.preread.thread is not None  # started after the warm-up
        assert eng.cache.wait_filled(timeout=600.0)
        assert eng.cache.residency().all()  # the tiny store fits: wholly resident, then all-resident decode
        req = GenerateRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=3))
        assert list(eng.generate(req))[-1].error == ""
    a = build_parser().parse_args(["run", "--model", str(tiny_store), "--reserve-cache", "--idle-fill",
                                   "--prompt", "x"])
    assert a.reserve_cache is True and a.idle_fill is True
    gbps = measure_first_touch(0.01)
    assert gbps is None or gbps > 0


class _GatedStore:
    """A store whose reads block until ``go`` is set (per expert), recording the order and
    whether each read was speculative (by the reading thread's name)."""

    slot_bytes = 4096
    path = "."
    experts = None

    def __init__(self):
        self.started: list[tuple[int, str]] = []
        self.go: dict[int, threading.Event] = {}
        self.lk = threading.Lock()

    def read(self, layer, expert, buf, verify=False):
        with self.lk:
            self.started.append((expert, threading.current_thread().name))
            ev = self.go.setdefault(expert, threading.Event())
        assert ev.wait(600)
        return 4096

    def views(self, buf):
        return {}

    def release(self, expert):
        with self.lk:
            self.go.setdefault(expert, threading.Event()).set()


def test_reserved_speculation_reads_while_the_lock_is_held_and_demand_takes_queued_ones_over():
    """ExpertCache.speculate_now (PILOT right before a one-call decode run): the slots are
    reserved at once; the speculation reader starts the reads in claim order without the
    cache's lock (a run holds it), one at a time; a demand lookup of a reserved expert whose
    read has not started reads it as a demand read at once (not behind the speculations
    queued before it); cancel_speculations gives the unstarted ones back as stale drops."""
    import time as _t
    from engine.expert_cache import ExpertCache
    st = _GatedStore()
    cache = ExpertCache(st, 1, 16, cap=8, io_threads=1)
    try:
        cache.demand_inflight = 1  # holds the reader back (demand first) until the lock is taken
        for e in (3, 5, 9):
            assert cache.speculate_now(0, e) >= 0
        with cache.lock:  # as a one-call run holds it: the first read still starts
            cache.demand_inflight = 0
            deadline = _t.monotonic() + 600  # only a hang trips it
            while not st.started and _t.monotonic() < deadline:
                _t.sleep(0.001)
        assert [e for e, _ in st.started] == [3] and st.started[0][1] == "colibri-spec-io"
        assert cache.stats.spec_issued == 3 and all(cache.where[0, e] >= 0 for e in (3, 5, 9))
        hits, slots, misses = cache.take_split(0, [9])  # 9 queued behind 5: taken over
        assert misses == [9] and cache.stats.spec_issued == 2
        deadline = _t.monotonic() + 600  # only a hang trips it
        while len(st.started) < 2 and _t.monotonic() < deadline:
            _t.sleep(0.001)
        assert st.started[1] == (9, "colibri-io-0")  # a demand read, beside the speculation in flight
        st.release(9)
        cache.acquire(0, 9)
        cache.release(0, 9)
        assert cache.cancel_speculations() == 1  # 5 never started
        assert cache.where[0, 5] == -1 and cache.stats.spec_dropped_stale == 1 and cache.stats.spec_issued == 1
        st.release(3)
        deadline = _t.monotonic() + 600  # only a hang trips it
        while cache.stats.spec_completed < 1 and _t.monotonic() < deadline:
            _t.sleep(0.001)
        assert cache.stats.spec_completed == 1 and cache.is_present(0, 3)
        cache.demand_inflight = 1  # 11 stays queued: close gives its slot back
        assert cache.speculate_now(0, 11) >= 0
    finally:
        cache.close()
    assert cache.where[0, 11] == -1 and [e for e, _ in st.started] == [3, 9]


def test_speculations_queued_before_a_run_are_started_before_it(monkeypatch):
    """Pilot.on_run_start queues its speculations (speculate_now) and then hands them off
    (ExpertCache.hand_off_speculations): it returns once the speculation reader has started
    the first read, so the read is on the disk before the run takes both cores (without the
    hand-off the woken reader waited for a core behind the run's threads). The reader here is
    always late (it moves only once the hand-off waits for it, as on a busy machine), both
    before it took the queued read and after (taken, not started). No hand-off while a demand
    read is in flight (the reader waits for it first) or with nothing queued."""
    import engine.cache.io as cache_io
    import engine.cache.speculation as cache_spec
    import engine.expert_cache as EC
    monkeypatch.setattr(cache_io, "HANDOFF_WAIT_S", 600.0)  # only a hang trips it
    st = _GatedStore()
    cache = EC.ExpertCache(st, 1, 16, cap=8, io_threads=1)
    waiting = threading.Event()  # the hand-off waits for the reader's start
    real_wait = cache.spec.started_cv.wait

    def wait(timeout=None):
        waiting.set()
        return real_wait(timeout)
    cache.spec.started_cv.wait = wait
    real_loop = cache.spec._read_loop

    def late_loop():  # woken by the first speculate_now, the reader gets a core only later
        waiting.wait(600)
        real_loop()
    cache.spec._read_loop = late_loop
    try:
        assert cache.hand_off_speculations() is False  # nothing queued (no reader started yet)
        assert cache.speculate_now(0, 3) >= 0
        assert cache.hand_off_speculations() is True
        assert cache.spec.started == 1            # the reader started the read before it returned
        assert st.started == [(3, "colibri-spec-io")]
        st.release(3)
        deadline = time.monotonic() + 600  # only a hang trips it
        while cache.stats.spec_completed < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        while cache.spec.reading and time.monotonic() < deadline:  # the reader is idle again
            time.sleep(0.001)

        polling = threading.Event()  # the reader took 5 and polls for the demand read to end

        class _LateTime:  # the reader's polls sleep until the hand-off waits for it
            def __getattr__(self, name):
                return getattr(time, name)

            def sleep(self, s):
                if threading.current_thread().name == "colibri-spec-io":
                    polling.set()
                    waiting.wait(600)
                time.sleep(s)
        waiting.clear()
        monkeypatch.setattr(cache_spec, "time", _LateTime())
        cache.demand_inflight = 1  # a demand read in flight: the reader waits for it, no hand-off
        slot = cache.speculate_now(0, 5)
        assert slot >= 0
        assert polling.wait(600) and cache.spec.waiting == (0, 5, slot)
        assert cache.hand_off_speculations() is False  # False: it did not wait
        cache.demand_inflight = 0  # the demand read ended: the reader has 5 but has not started it
        assert cache.hand_off_speculations() is True
        assert cache.spec.started == 2 and [e for e, _ in st.started] == [3, 5]
        st.release(5)
    finally:
        waiting.set()
        for e in range(16):
            st.release(e)
        cache.close()


def test_a_worker_cannot_reserve_for_a_layer_a_run_reached():
    """A PILOT worker that waited for the cache's lock through a one-call run must not reserve
    a slot for a layer the run reached (its read would be wasted and would delay the stop
    layer's demand read): try_speculate answers PASSED until the next token
    (cancel_speculations without ``below``), and Pilot counts that as a stale drop."""
    from engine.expert_cache import ExpertCache, SpecRefused
    st = _GatedStore()
    cache = ExpertCache(st, 4, 16, cap=8, io_threads=1)
    try:
        E = np.zeros((4, 1), np.int64)
        # a run from layer 2 that stopped at once (layer 2's expert not resident)
        stop = cache.take_resident_layers(lambda *a: (-1 - 2, E, E, E.astype(bool), np.zeros(4, np.int64), 4), 2)
        assert stop == 2
        assert cache.try_speculate(1, 5) == SpecRefused.PASSED
        assert cache.try_speculate(2, 5) == SpecRefused.PASSED  # its experts are taken on demand next
        assert cache.speculate_now(2, 6) == SpecRefused.PASSED
        slot = cache.try_speculate(3, 5)
        assert slot >= 0
        cache.cancel_speculations()  # a new token: every layer is ahead again
        assert cache.try_speculate(1, 5) >= 0
        assert cache.stats.spec_issued == 2
    finally:
        for e in range(16):
            st.release(e)
        cache.close()


def test_demand_takes_over_a_speculation_the_reader_holds_while_demand_reads_run():
    """The speculation reader took a reserved expert and waits for the demand reads in flight
    (demand first); a demand lookup of that expert reads it as a demand read at once instead
    of waiting behind every demand read, the less urgent ones included (priority inversion),
    and the reader then skips it: one read, on a demand reader."""
    import time as _t
    from engine.expert_cache import ExpertCache
    st = _GatedStore()
    cache = ExpertCache(st, 1, 16, cap=8, io_threads=1)
    try:
        cache.demand_inflight = 1  # a demand read in flight: the reader takes 3 and waits
        slot = cache.speculate_now(0, 3)
        assert slot >= 0
        deadline = _t.monotonic() + 600  # only a hang trips it
        while cache.spec.waiting != (0, 3, slot) and _t.monotonic() < deadline:
            _t.sleep(0.001)
        assert cache.spec.waiting == (0, 3, slot) and not st.started
        hits, slots, misses = cache.take_split(0, [3])
        assert misses == [3] and cache.stats.spec_issued == 0 and cache.spec.waiting is None
        deadline = _t.monotonic() + 600  # only a hang trips it
        while not st.started and _t.monotonic() < deadline:
            _t.sleep(0.001)
        assert st.started == [(3, "colibri-io-0")]  # beside the demand read in flight: it is needed now
        st.release(3)
        cache.acquire(0, 3)
        cache.release(0, 3)
        assert cache.is_present(0, 3) and cache.stats.misses == 1
        cache.demand_inflight = 0  # the reader leaves its wait and finds the read taken over
    finally:
        cache.close()  # joins the reader: it has passed its check of the taken-over read
    assert st.started == [(3, "colibri-io-0")] and cache.stats.spec_completed == 0


@pytest.mark.parametrize("replayed", [False, True])
def test_pilot_keeps_the_one_call_decode_step(medium_store, logits_trace, monkeypatch, replayed):
    """PILOT (mode 3, draft on) no longer forces the per-layer decode path: decode steps run in
    K.decode_layers_t1, PILOT predicts at the layers that stop a run from their own layer
    (a replayed routing's recorded predictor of layer t from layer src < t, never the real
    logits of a layer not yet reached), reserves its speculations before the next run
    (speculate_now; the workers idled here, so it is the only way in) and their reads
    complete; logits bit-identical to pilot 0 on the per-layer path."""
    import engine.models.base as base
    from engine.expert_cache import ExpertCache
    runs, claims, preds = [], [], []
    real_take, real_spec = ExpertCache.take_resident_layers, ExpertCache.speculate_now

    def take(self, *a, **kw):
        runs.append(1)
        return real_take(self, *a, **kw)

    def spec(self, layer, expert, guard=None):
        claims.append(layer)
        return real_spec(self, layer, expert, guard)
    monkeypatch.setattr(ExpertCache, "take_resident_layers", take)
    monkeypatch.setattr(ExpertCache, "speculate_now", spec)
    from engine.prefetch import Pilot

    def idle_worker(self):  # the workers take nothing: what PILOT queues is reserved before runs
        while not self._closed:
            time.sleep(0.01)
    monkeypatch.setattr(Pilot, "_work", idle_worker)
    out = {}
    for pilot, one_call in ((3, True), (0, False)):
        monkeypatch.setattr(base, "DECODE_T1", one_call)
        runs.clear()
        cfg = EngineConfig(store=str(medium_store), history=False, pinning=False, cap=6, pilot=pilot,
                           o_direct=False, spec_precision=0.0)
        with Engine.open(cfg) as eng:
            m = eng.model
            if one_call:
                assert m.wait_decode_ready(900)
            rr = None
            if replayed:
                rr = RecordedRouting(logits_trace, 4, 16, seed=0).install(m)
                orig = rr.pred_logits
                rr.pred_logits = lambda t, src, pos: (preds.append((t, src)), orig(t, src, pos))[1]
            logits = [m.forward(np.arange(1, 6), 0)]
            for p in range(5, 45):
                logits.append(m.forward(np.array([p + 3]), p))
            if pilot:
                assert eng.pilot.drafts + eng.pilot.drafts_skipped > 0
                st = eng.cache.stats
                deadline = time.monotonic() + 600  # only a hang trips it
                while st.spec_completed == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert eng.pilot.claimed > 0 and st.spec_completed > 0
            if rr is not None:
                rr.uninstall()
        assert bool(runs) == one_call
        out[pilot] = np.concatenate(logits)
    assert claims
    if replayed:
        assert preds and all(0 <= src < t <= src + 3 for t, src in preds), preds
    assert np.array_equal(out[3].view(np.uint32), out[0].view(np.uint32))


@pytest.mark.parametrize("replayed", [False, True])
def test_pilot_predicts_inside_one_call_runs(medium_store, logits_trace, monkeypatch, replayed):
    """PILOT inside a one-call run (K.decode_layers_t1's ``look``): the kernel predicts layer t
    from layer t - 1's post-attention residual with layer t's norm and router (mode 1; a
    replayed routing's recorded predictor), and when the prediction holds an expert not in the
    cache the run stops after layer t - 1, so the read is queued before layer t's router. The
    kernel's predictor logits equal Python's mode 1 prediction of the same layer and position
    bit for bit; predictions that stopped a run are read speculatively and used; logits stay
    bit-identical to pilot 0 on the per-layer path."""
    import engine.models.base as base
    from engine.prefetch import Pilot
    seen = {}
    real_predict = Pilot.predict

    def predict(self, t, x, dist=1, src=None, logits=None):
        if logits is not None:
            seen.setdefault(("kernel", self.pos_last, t), np.array(logits, np.float32))
        elif x is not None and dist == 1 and not replayed:
            h = np.empty_like(x)
            base.K.rmsnorm(x, self.model.moe_norm(t), self.model.args.rms_norm_eps, h)
            seen.setdefault(("python", self.pos_last, t), self.model.router_logits(t, h)[0].copy())
        return real_predict(self, t, x, dist, src, logits)
    monkeypatch.setattr(Pilot, "predict", predict)
    out, stops = {}, {}
    for pilot, one_call in ((1, True), (1, False), (0, False)):
        monkeypatch.setattr(base, "DECODE_T1", one_call)
        cfg = EngineConfig(store=str(medium_store), history=False, pinning=False, cap=6, pilot=pilot,
                           o_direct=False, spec_precision=0.0, pilot_draft=False)
        with Engine.open(cfg) as eng:
            m = eng.model
            if one_call:
                assert m.wait_decode_ready(900)
            rr = RecordedRouting(logits_trace, 4, 16, seed=0).install(m) if replayed else None
            logits = [m.forward(np.arange(1, 6), 0)]
            for p in range(5, 45):
                logits.append(m.forward(np.array([p + 3]), p))
                if pilot and one_call:  # let the reads of one token land before the next
                    deadline = time.monotonic() + 600  # only a hang trips it
                    while eng.cache.stats.spec_completed < eng.cache.stats.spec_issued and time.monotonic() < deadline:
                        time.sleep(0.002)
            if pilot:
                stops[one_call] = eng.pilot.run_stops
                if one_call:
                    assert m.run_lookahead is eng.pilot and eng.cache.stats.spec_used > 0
            if rr is not None:
                rr.uninstall()
        out[(pilot, one_call)] = np.concatenate(logits)
    assert stops[True] > 0 and stops[False] == 0  # the per-layer path predicts at every layer instead
    assert np.array_equal(out[(1, True)].view(np.uint32), out[(0, False)].view(np.uint32))
    assert np.array_equal(out[(1, False)].view(np.uint32), out[(0, False)].view(np.uint32))
    if not replayed:
        both = [k[1:] for k in seen if k[0] == "kernel" and ("python",) + k[1:] in seen]
        assert both, sorted(seen)[:8]
        for pos, t in both:
            assert np.array_equal(seen[("kernel", pos, t)].view(np.uint32), seen[("python", pos, t)].view(np.uint32))


@pytest.mark.parametrize("over", [dict(pilot=0, cap=16, warm_all=True), dict(pilot=0, cap=6),
                                  dict(pilot=1, cap=6), dict(pilot=1, cap=6, routing_trace=True)])
def test_bench_arms_decode_through_the_one_call_step(medium_store, logits_trace, monkeypatch, over):
    """run_arm (every arm of bench overlap, pilot, cache, matrix) decodes through the product's
    one-call step: its routing recorder (TouchedExperts) is token-batched, so it no longer
    forces the per-layer path, and the routing digest and logits are those of the per-layer
    path."""
    import engine.models.base as base
    from engine.bench.arm import run_arm
    calls = []
    real = base.K.decode_layers_t1

    def spy(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(base.K, "decode_layers_t1", spy)
    o = dict(over, history=False, pinning=False, o_direct=False)
    if o.pop("routing_trace", False):
        o["routing_trace"] = str(logits_trace)
    rows = {}
    for one_call in (True, False):
        monkeypatch.setattr(base, "DECODE_T1", one_call)
        calls.clear()
        rows[one_call] = run_arm(str(medium_store), o, 6, 12, 0)
        n = len(calls) - 1  # less the background compile's warm-up call
        assert (n >= 11) if one_call else (n <= 0), n
        assert rows[one_call]["one_call_steps"] == (rows[one_call]["decode_steps"] + 1 if one_call else 0)
    assert rows[True]["sha256_logits"] == rows[False]["sha256_logits"]
    assert rows[True]["sha256_routing"] == rows[False]["sha256_routing"]


def test_speculations_finished_during_a_run_are_parked_and_the_next_read_starts():
    """A one-call run holds the cache's lock for milliseconds: the speculation reader parks
    each read it finishes meanwhile and starts the next (it used to wait for the lock after
    the first), and the next holder that looks at slots publishes them:
    after the run, all of them are hits."""
    import time as _t
    from engine.expert_cache import ExpertCache
    st = _GatedStore()
    for e in (2, 4, 6):
        st.release(e)  # reads complete at once
    cache = ExpertCache(st, 1, 16, cap=8, io_threads=1)
    try:
        cache.demand_inflight = 1  # hold the reader back until the "run" holds the lock
        for e in (2, 4, 6):
            assert cache.speculate_now(0, e) >= 0
        with cache.lock:
            cache.demand_inflight = 0
            deadline = _t.monotonic() + 600  # only a hang trips it
            while len(st.started) < 3 and _t.monotonic() < deadline:
                _t.sleep(0.001)
            assert [e for e, _ in st.started] == [2, 4, 6]  # all three read while the lock was held
            while len(cache.spec.done) < 3 and _t.monotonic() < deadline:  # the last one parks
                _t.sleep(0.001)
            assert all(cache.slot_state[0, cache.where[0, e]] != cache.RESIDENT_STATE for e in (2, 4, 6))
            assert len(cache.spec.done) == 3  # parked: the run holds the lock
        hits, slots, misses = cache.take_split(0, [2, 4, 6])
        assert hits == [2, 4, 6] and misses == [] and cache.stats.spec_completed == 3
        cache.release_slots(0, slots)
    finally:
        cache.close()
