"""The KV cache grows with the context used: its pages are mapped as positions are written, the
plan sets aside the KV of the first KV_OPEN_TOKENS only, and the expert cache gives slots back
(RssGuard.make_room) before the KV's next positions would take the RSS past the budget."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from engine.config import ModelArgs
from engine.models import base
from engine.sizing import KV_OPEN_TOKENS, GB, estimate, estimate_store, kv_bytes, plan_cap, plan_estimate, read_manifest
from engine.bench.synthetic import deepseek_v3_config, deepseek_v32_config, mixtral_config, olmoe_config, qwen3_next_config, write_checkpoint

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) tells resident pages on Linux")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(a: np.ndarray) -> int:
    """Bytes of ``a``'s memory in RAM now (mincore(2) over its pages)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = a.ctypes.data // PAGE * PAGE
    n = -(-(a.ctypes.data + a.nbytes - start) // PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * PAGE


def kv_arrays(model) -> list[np.ndarray]:
    return [getattr(model, n) for n in ("k_cache", "v_cache", "kv_cache", "index_cache") if hasattr(model, n)]


def most_for(a: np.ndarray, n: int) -> int:
    """The most bytes ``n`` positions can map of a KV array laid out [..., C, row]: every block
    of C rows maps the pages of its first n rows (one more where a block starts inside a page)."""
    blocks = int(np.prod(a.shape[:-2]))
    row = a.shape[-1] * a.itemsize
    return blocks * (-(-n * row // PAGE) + 1) * PAGE


# one of each kind of KV cache: multi-head (GQA), sliding window, MLA's latent KV, MLA with
# the sparse-attention indexer's key cache, hybrid recurrent (linear attention + full layers)
KINDS = {
    "mha": olmoe_config(num_hidden_layers=2, num_key_value_heads=2, hidden_size=128, num_attention_heads=4),
    "sliding_window": mixtral_config(num_hidden_layers=2, sliding_window=6, head_dim=32),
    "mla": deepseek_v3_config(),
    "mla_indexer": deepseek_v32_config(),
    "hybrid_recurrent": qwen3_next_config(mlp_only_layers=[1]),
}


@pytest.fixture(scope="module")
def kind_stores(tmp_path_factory):
    from engine import convert_checkpoint
    out = {}
    for name, cfg in KINDS.items():
        d = tmp_path_factory.mktemp("kv")
        out[name] = convert_checkpoint(write_checkpoint(d / name, cfg, seed=7, std=0.1), d / f"{name}-int8", quant="int8")
    return out


def _ids(eng, n=10) -> tuple[int, ...]:
    req = GenerateRequest(prompt_ids=tuple(range(5, 25)), sampling=SamplingParams(max_new_tokens=n))
    fin = list(eng.generate(req))[-1]
    assert fin.error == "", fin.error
    return fin.token_ids


@linux
@pytest.mark.parametrize("kind", list(KINDS))
def test_kv_memory_grows_with_the_positions_written(kind_stores, kind, monkeypatch):
    """At a 1,024-token context a 30-token exchange maps the pages of its 30 positions of each
    KV array, not the whole context; the greedy ids equal those of a KV cache mapped whole up
    front (np.zeros filled in), for every kind of KV cache."""
    cfg = EngineConfig(store=str(kind_stores[kind]), history=False, o_direct=False, context_length=1024)
    with Engine.open(cfg) as eng:
        arrays = kv_arrays(eng.model)
        assert arrays and all(a.shape[-2] == 1024 for a in arrays)
        lazy = _ids(eng)
        n = 20 + len(lazy)
        for a in arrays:
            assert 0 < resident_bytes(a) <= min(most_for(a, n), a.nbytes // 2), (kind, resident_bytes(a), a.nbytes)

    def filled(shape, dtype):
        a = np.empty(shape, dtype)
        a.fill(0)
        return a
    monkeypatch.setattr(base, "kv_zeros", filled)
    with Engine.open(cfg) as eng:
        assert all(resident_bytes(a) >= a.nbytes for a in kv_arrays(eng.model))
        assert _ids(eng) == lazy


def test_the_cap_sets_aside_the_kv_of_the_first_tokens_only():
    """OLMoE-1B-7B's shape at int4 in a 4 GB budget with the default 4,096-token context: the
    cap is planned beside the KV of the first KV_OPEN_TOKENS (67 MB), not of the whole context
    (537 MB); the smallest budget a model opens with still counts the whole context's KV."""
    args = ModelArgs.from_dict(olmoe_config(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
        max_position_embeddings=4096))
    est = estimate(args, "int4", 0)
    assert est.context_length == 4096 and est.kv_bytes == kv_bytes(args, 4096) == 536_870_912
    assert est.kv_open_bytes == kv_bytes(args, KV_OPEN_TOKENS) == est.kv_bytes * KV_OPEN_TOKENS // 4096
    p = plan_estimate(est, 4.0, None)
    assert p.slots == (4 * GB - est.dense_bytes - est.kv_open_bytes - est.reserve_bytes) // est.slot_bytes
    whole_kv = (4 * GB - est.dense_bytes - est.kv_bytes - est.reserve_bytes) // est.slot_bytes
    assert abs(p.slots - whole_kv - (est.kv_bytes - est.kv_open_bytes) / est.slot_bytes) <= 1
    assert p.slots >= whole_kv + 130 and p.kv == est.kv_bytes and p.kv_set_aside == est.kv_open_bytes
    assert "KV (up to" in p.describe()
    # the wizard's verdict before a download applies the same plan to its share of available RAM
    from engine.sizing import AVAILABLE_SHARE, ram_verdict
    avail = -(-4 * GB // AVAILABLE_SHARE)
    _, msg = ram_verdict(est, 8, 16 * GB, int(avail))
    fit = plan_estimate(est, int(AVAILABLE_SHARE * avail) / GB, None).slots // 16
    assert fit >= 59 and f"about {fit} expert slots per layer fit" in msg, msg
    # the refusal counts the whole context: one slot per layer beside 537 MB of KV
    need = est.dense_bytes + est.kv_bytes + est.reserve_bytes + 16 * est.slot_bytes
    plan_cap(64, [est.slot_bytes] * 16, est.dense_bytes, est.kv_bytes, need / GB, None, kv_open=est.kv_open_bytes)
    from engine.errors import BudgetError
    with pytest.raises(BudgetError):
        plan_cap(64, [est.slot_bytes] * 16, est.dense_bytes, est.kv_bytes, (need - est.slot_bytes) / GB, None,
                 kv_open=est.kv_open_bytes)


@linux
def test_the_cache_gives_slots_back_before_the_kv_grows_past_the_budget(medium_store):
    """A budget (measured by a fake RSS: a base + the arena's pages + the KV's mapped pages)
    whose cap was planned beside the KV of KV_OPEN_TOKENS: an exchange that runs past them
    gives slots back before its KV's new positions are written, so the RSS never goes over the
    budget, and the ids are those of a cache that never shrinks."""
    args = ModelArgs.from_hf_config(medium_store)
    est = estimate_store(args, read_manifest(medium_store), 2048)
    holder = {}

    def fake_rss():
        eng = holder.get("eng")
        c = holder.get("cache")
        kv = sum(resident_bytes(a) for a in kv_arrays(eng.model)) if eng is not None and hasattr(eng, "model") else 0
        return holder["base"] + (c.resident_bytes() if c is not None else 0) + kv
    # room for the dense weights, the reserve, the KV of the first tokens and 40 slots of 64
    room = est.dense_bytes + est.reserve_bytes + est.kv_open_bytes + 40 * est.slot_bytes
    full = est.dense_bytes + est.reserve_bytes + est.kv_bytes + 4 * est.slot_bytes
    budget = max(room, full) + 1000
    holder["base"] = est.dense_bytes + est.reserve_bytes  # the plan's own count of what is not cache or KV
    import engine.engine_setup as S  # where Engine.open builds its cache
    real = S.ExpertCache

    class Seen(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            holder["cache"] = self
    S.ExpertCache = Seen
    try:
        cfg = EngineConfig(store=str(medium_store), history=False, o_direct=False, pinning=False,
                           context_length=2048, ram_budget_gb=budget / GB, idle_fill=False)
        with Engine.open(cfg, read_rss=fake_rss) as eng:
            holder["eng"] = eng
            # the KV alone: the forward's activations are inside the reserve the fake RSS counts whole
            eng.model.forward_scratch_bytes = lambda T: 0
            slots0 = eng.cache.slots
            assert slots0 == min(64, (budget - est.dense_bytes - est.kv_open_bytes - est.reserve_bytes) // est.slot_bytes)
            req = GenerateRequest(prompt_ids=tuple(i % 400 + 5 for i in range(KV_OPEN_TOKENS + 40)),
                                  sampling=SamplingParams(max_new_tokens=100))
            fin = list(eng.generate(req))[-1]
            assert fin.error == ""
            assert eng.cache.slots < slots0 and eng.guard.fired >= 1
            assert eng.guard.peak <= budget
        holder.clear()
        with Engine.open(EngineConfig(store=str(medium_store), history=False, o_direct=False, pinning=False,
                                      context_length=2048, cap=16, idle_fill=False)) as eng:
            assert list(eng.generate(req))[-1].token_ids == fin.token_ids
    finally:
        S.ExpertCache = real


def test_a_long_prompt_makes_room_for_its_activations_and_gives_it_back(medium_store):
    """A long prompt whose forward's activations (MoEModel.forward_scratch_bytes, here 10
    slots' worth more than the budget's spare room, counted in a fake RSS while the forward
    runs) would pass the budget once its layers fill the cache: the cache gives those slots
    back before the forward and gets them back after it, the RSS never passes the budget, and
    the ids are those of a cache that never shrinks."""
    args = ModelArgs.from_hf_config(medium_store)
    est = estimate_store(args, read_manifest(medium_store), 2048)
    holder = {"scratch": 0}

    def fake_rss():
        c = holder.get("cache")
        return holder["base"] + (c.resident_bytes() if c is not None else 0) + holder["scratch"]
    # the fake RSS leaves the KV out and the budget holds all of it: only the activations press
    budget = est.dense_bytes + est.reserve_bytes + est.kv_bytes + 40 * est.slot_bytes + 1000
    holder["base"] = est.dense_bytes + est.reserve_bytes
    import engine.engine_setup as S
    real = S.ExpertCache

    class Seen(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            holder["cache"] = self
    S.ExpertCache = Seen
    during = []
    try:
        cfg = EngineConfig(store=str(medium_store), history=False, o_direct=False, pinning=False,
                           context_length=2048, ram_budget_gb=budget / GB, idle_fill=False, cap=10)
        with Engine.open(cfg, read_rss=fake_rss) as eng:
            model = eng.model
            need = est.kv_bytes + 10 * est.slot_bytes
            # a long prompt's forward (a short one's, and a draft's verify, fit the reserve)
            model.forward_scratch_bytes = lambda T: need if T > 32 else 0
            forward = model.forward

            def counted(ids, pos0, *a, **kw):  # the activations exist while the forward runs
                if len(ids) > 32:
                    holder["scratch"] = need
                    during.append((eng.cache.slots, fake_rss()))
                try:
                    return forward(ids, pos0, *a, **kw)
                finally:
                    holder["scratch"] = 0
            model.forward = counted
            prompt = tuple(i % 400 + 5 for i in range(300))
            req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=8))
            list(eng.generate(GenerateRequest(prompt_ids=prompt[:40], sampling=SamplingParams(max_new_tokens=40))))
            slots0 = eng.cache.slots
            assert slots0 == 40
            fin = list(eng.generate(req))[-1]
            assert fin.error == ""
            assert during[-1][0] <= slots0 - 10 and during[-1][1] <= budget
            assert eng.guard.peak <= budget
            assert eng.cache.slots == slots0  # given back
        holder.clear()
        with Engine.open(EngineConfig(store=str(medium_store), history=False, o_direct=False, pinning=False,
                                      context_length=2048, idle_fill=False)) as eng:
            assert list(eng.generate(req))[-1].token_ids == fin.token_ids
    finally:
        S.ExpertCache = real


@pytest.mark.parametrize("cap", [4, 16])
def test_the_activation_estimate_covers_what_a_forward_allocates(medium_store, cap):
    """MoEModel.forward_scratch_bytes is at least the peak of what a forward's Python side
    allocates (numpy arrays, traced), and not far above it, for a long prompt prefilled
    layer by layer (a streaming cache) and chunk by chunk (every expert cached)."""
    import tracemalloc
    with Engine.open(EngineConfig(store=str(medium_store), history=False, o_direct=False, pinning=False,
                                  context_length=2048, cap=cap, idle_fill=False)) as eng:
        ids = np.array([i % 400 + 5 for i in range(600)])
        eng.model.forward(ids[:8], 0)  # kernels compiled, caches touched
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            eng.model.forward(ids, 0)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        est = eng.model.forward_scratch_bytes(len(ids))
        assert peak <= est <= 4 * peak, (peak, est)
