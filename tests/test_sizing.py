"""engine/sizing.py is the one sizing rule: what the wizard and the settings dialog predict is
what Engine.open then does."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineConfig, ModelArgs, convert_checkpoint
from engine import sizing
from engine.sizing import GB


def _manifest(store):
    return json.loads((store / "manifest.json").read_text())


@pytest.mark.parametrize("over", [
    dict(context_length=0, ram_budget_gb=1.0),
    dict(context_length=100, ram_budget_gb=0.27116),  # a budget that holds only 5 slots per layer
    dict(context_length=64, ram_budget_gb=None),      # automatic budget
    dict(context_length=0, ram_budget_gb=1.0, cap=3),
])
def test_prediction_equals_engine_open(medium_store, monkeypatch, over):
    """plan_for_store (what the settings dialog shows for "auto") and estimate (the wizard's
    numbers before a download) against the Engine's own BudgetPlan after Engine.open."""
    rss = 300_000_000
    monkeypatch.setattr(sizing, "probe_available", lambda: (4 * GB, True))
    cfg = EngineConfig(store=str(medium_store), pinning=False, history=False, **over)
    predicted = sizing.plan_for_store(medium_store, cfg, rss_now=rss)
    args = ModelArgs.from_hf_config(medium_store)
    before = sizing.estimate(args, "int8", cfg.context_length)  # from config.json alone
    with Engine.open(cfg, read_rss=lambda: rss) as eng:
        assert eng.plan == predicted
        assert (before.dense_bytes, before.kv_bytes, before.slots_bytes, before.context_length) == (
            eng.loaded.dense_bytes, eng.plan.kv, eng.plan.slot_bytes_sum, eng.context_length)
        assert before.ram_needed == eng.plan.dense + eng.plan.kv + eng.plan.slot_bytes_sum + eng.plan.reserve
        assert eng.cache.cap == predicted.cap and eng.cache.slots == predicted.slots


# One store per family, with what sizing must get right: Qwen dense layers (resident MLPs, no
# expert row), Qwen2's shared expert (resident), GQA (KV rows per transformer layer), expert
# width != dense width.
FAMILY_CONFIGS = {
    "olmoe": dict(num_hidden_layers=3, num_key_value_heads=2),
    "qwen3_moe": dict(num_hidden_layers=4, mlp_only_layers=[1], num_key_value_heads=2, num_experts_per_tok=3),
    "mixtral": dict(num_hidden_layers=3, head_dim=32, num_key_value_heads=2),
    "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[0], num_key_value_heads=2),
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    from engine.bench.synthetic import CONFIGS, write_checkpoint
    d = tmp_path_factory.mktemp("sizing-fam")
    return {name: write_checkpoint(d / name, CONFIGS[name](**kw), seed=7) for name, kw in FAMILY_CONFIGS.items()}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("quant", ["int8", "int4", "f16"])
def test_dense_and_slot_bytes_from_args_equal_the_store(family_checkpoints, tmp_path, name, quant):
    ck = family_checkpoints[name]
    store = convert_checkpoint(ck, tmp_path / quant, quant=quant)
    m = _manifest(store)
    args = ModelArgs.from_hf_config(ck)
    from engine.models import embedding_bytes
    # the dense file holds the embedding table, which stays in the store (read row by row)
    assert sizing.dense_bytes(args, quant) + embedding_bytes(args, quant) == m["dense_bytes"]
    assert sizing.store_dense_bytes(args, m) == sizing.dense_bytes(args, quant)
    assert embedding_bytes(args, quant) > 0
    assert [sizing.slot_bytes(args, quant)] * args.num_moe_layers == m["slot_bytes"]
    est = sizing.estimate(args, quant, 0)
    assert est.expert_bytes == args.num_moe_layers * args.num_experts * sizing.slot_bytes(args, quant)
    on_disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    assert abs(est.store_bytes - on_disk) < 0.1 * on_disk + 64 * 1024


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_verdict_before_conversion_equals_engine_open_for_every_family(family_checkpoints, tmp_path,
                                                                       monkeypatch, name):
    """The wizard's numbers from config.json alone (dense, KV, slots, cap, budget) are what
    Engine.open does with the converted store."""
    ck = family_checkpoints[name]
    args = ModelArgs.from_hf_config(ck)
    if name != "olmoe" and name != "mixtral":
        assert args.num_moe_layers < args.num_hidden_layers  # dense layers are exercised
    store = convert_checkpoint(ck, tmp_path / "int8", quant="int8")
    rss = 200_000_000
    monkeypatch.setattr(sizing, "probe_available", lambda: (3 * GB, True))
    before = sizing.estimate(args, "int8", 96)
    budget_gb = (before.dense_bytes + before.kv_bytes + before.reserve_bytes + 3 * before.slots_bytes + 100) / GB
    for over in (dict(ram_budget_gb=budget_gb), dict(ram_budget_gb=None), dict(ram_budget_gb=1.0, cap=2)):
        cfg = EngineConfig(store=str(store), pinning=False, history=False, context_length=96, **over)
        predicted = sizing.plan_estimate(before, cfg.ram_budget_gb, cfg.cap, rss_now=rss)
        with Engine.open(cfg, read_rss=lambda: rss) as eng:
            assert eng.plan == predicted
            assert (before.dense_bytes, before.kv_bytes, before.slots_bytes) == (
                eng.loaded.dense_bytes, eng.plan.kv, eng.plan.slot_bytes_sum)
            # the default KV cache is f16: 2 bytes per element, and the arrays are what the plan says
            assert before.kv_bytes == 2 * args.num_hidden_layers * args.num_key_value_heads * 96 * args.head_dim * 2
            assert eng.model.kv_bytes == before.kv_bytes and eng.model.k_cache.dtype == np.uint16
            assert eng.cache.cap == predicted.cap and eng.cache.L == args.num_moe_layers
        if over.get("ram_budget_gb") == budget_gb:
            assert predicted.cap == 3


def test_verdict_uses_the_same_cap_rule(tiny_store):
    args = ModelArgs.from_hf_config(tiny_store)
    est = sizing.estimate_store(args, _manifest(tiny_store), 128)
    avail = 2 * est.ram_needed
    verdict, msg = sizing.ram_verdict(est, args.num_experts_per_tok, 10 * avail, avail)
    plan = sizing.plan_estimate(est, sizing.AVAILABLE_SHARE * avail / GB, None)
    assert verdict == "ok" and f"about {plan.slots // plan.layers} expert slots per layer" in msg
    assert sizing.ram_verdict(est, 2, est.ram_needed - 1, est.ram_needed)[0] == "refuse"


@pytest.mark.parametrize("make,kw", [
    ("qwen3_moe_config", dict(num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1)),  # a dense layer
    ("qwen2_moe_config", dict(num_hidden_layers=3, mlp_only_layers=[0], num_key_value_heads=2)),  # shared experts
    ("mixtral_config", dict(num_hidden_layers=2, head_dim=32)),
    ("qwen3_next_config", dict(mlp_only_layers=[1])),  # KV in the full layer only, + the recurrent state
])
def test_every_family_is_sized_as_engine_open_does(tmp_path, make, kw):
    """The numbers before a download (from config.json alone) equal Engine.open's for every
    family: its dense tensors, its expert width and one slot per MoE layer only."""
    from engine.bench import synthetic
    ck = synthetic.write_checkpoint(tmp_path / "ck", getattr(synthetic, make)(**kw), seed=1)
    store = convert_checkpoint(ck, tmp_path / "st", quant="int8")
    args = ModelArgs.from_hf_config(ck)
    est = sizing.estimate(args, "int8", 64)
    cfg = EngineConfig(store=str(store), context_length=64, ram_budget_gb=1.0, pinning=False, history=False)
    with Engine.open(cfg, read_rss=lambda: 0) as eng:
        assert (est.dense_bytes, est.kv_bytes, est.slots_bytes) == (
            eng.loaded.dense_bytes, eng.plan.kv, eng.plan.slot_bytes_sum)
        assert len(est.layer_slot_bytes) == args.num_moe_layers == eng.cache.L
        assert sizing.plan_estimate(est, 1.0, None) == eng.plan
    on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert est.store_bytes == pytest.approx(on_disk, rel=0.15)


def test_plan_counts_single_slots_and_engine_open_holds_them(medium_store):
    """The budget's room in single slots: a budget 2.5 slots short of cap c in every layer gives
    c x L - 3 slots (cap c, three layers with c - 1), not c - 1 in every layer; Engine.open's
    cache holds exactly that many, and describe() says so."""
    from engine.sizing import plan_cap
    L, E, one = 4, 16, 1_000_000
    dense, kv, reserve = 50_000_000, 10_000_000, 20_000_000
    budget = dense + kv + reserve + 6 * L * one - 2 * one - one // 2
    p = plan_cap(E, [one] * L, dense, kv, budget / GB, None, reserve=reserve)
    assert (p.slots, p.cap, p.layers) == (6 * L - 3, 6, L)
    assert p.describe().startswith("5.2 slots/layer (21 in all, 5-6 per layer)")
    q = plan_cap(E, [one] * L, dense, kv, budget / GB, 3, reserve=reserve)  # an explicit cap
    assert (q.slots, q.cap) == (3 * L, 3) and q.describe().startswith("3 slots/layer:")
    assert "more than the budget" not in q.describe()
    big = plan_cap(E, [one] * L, dense, kv, budget / GB, 8, reserve=reserve)  # more than the room
    assert big.describe().endswith("; cap 8 is more than the budget holds (5.2 per layer): the RSS guard "
                                   "will lower it, or raise the RAM budget")
    full = plan_cap(E, [one] * L, dense, kv, 100.0, None, reserve=reserve)  # the whole model fits
    assert (full.slots, full.cap) == (E * L, E)
    with pytest.raises(sizing.BudgetError):  # not one slot in every layer
        plan_cap(E, [one] * L, dense, kv, (dense + kv + reserve + L * one - 1) / GB, None, reserve=reserve)
    probe = EngineConfig(store=str(medium_store), pinning=False, history=False, context_length=64)
    with Engine.open(probe.with_(cap=2)) as eng:
        base = eng.plan.dense + eng.plan.kv + eng.plan.reserve
        slot, M = eng.cache.slot_bytes, eng.cache.L
    cfg = probe.with_(ram_budget_gb=(base + (3 * M + 1) * slot + slot // 2) / GB)
    with Engine.open(cfg, read_rss=lambda: base) as eng:
        assert (eng.plan.slots, eng.plan.cap) == (3 * M + 1, 4)
        assert eng.cache.slots == 3 * M + 1 and sorted(eng.cache.layer_caps()) == [3] * (M - 1) + [4]


_RELEASE_PROBE = r'''
import json, re, sys
from engine.config import EngineConfig
from engine.generate import Engine
from engine.events import GenerateRequest, SamplingParams, TokenEvent
from engine import ram_budget

def llvm_rss():
    tot, name = 0, ""
    for line in open("/proc/self/smaps"):
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header: range perms offset dev inode path
            head = line.split(None, 5)
            name = head[5].strip() if len(head) > 5 else ""
        elif line.startswith("Rss:") and "libllvmlite" in name:
            tot += int(line.split()[1]) * 1024
    return tot

real = ram_budget.release_compiler_memory
if sys.argv[2] == "off":  # the engine as it was: nothing given back
    import engine.engine_setup, engine.models.fused_decode  # where Engine.open and the warm thread call it
    engine.engine_setup.release_compiler_memory = engine.models.fused_decode.release_compiler_memory = lambda: 0
cfg = EngineConfig(store=sys.argv[1], pinning=False, history=False, context_length=64, pilot=0)
with Engine.open(cfg) as eng:
    assert eng.model.wait_decode_ready(600)
    req = GenerateRequest(prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=8, temperature=0.0))
    ids = [ev.token_id for ev in eng.generate(req) if isinstance(ev, TokenEvent)]
    after_answer = llvm_rss()
    released = real()
    print(json.dumps({"ids": ids, "llvm_after_answer": after_answer, "released": released,
                      "llvm_after_release": llvm_rss()}))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc/self/smaps are Linux's")
def test_compiler_memory_is_given_back_once_the_kernels_are_loaded(medium_store, tmp_path):
    """LLVM's pages (~70 MB resident after numba loads its cached kernels) are not the expert
    cache's to lose: Engine.open and the one-call decode step's warm thread give them back
    (release_compiler_memory), the answer is token for token the same, and what stays resident
    of LLVM after an answer is a fraction of what an engine that keeps them holds. The probes
    load their own copy of llvmlite: MADV_PAGEOUT leaves pages another process maps (this
    one's, which imported numba), as it should."""
    import shutil
    import subprocess
    import llvmlite
    probe = tmp_path / "probe.py"
    probe.write_text(_RELEASE_PROBE)
    shutil.copytree(Path(llvmlite.__file__).parent, tmp_path / "site" / "llvmlite")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(Path(__file__).resolve().parents[1])])}
    out = {}
    for arm in ("off", "on", "off"):  # the first run fills numba's cache for the others
        r = subprocess.run([sys.executable, str(probe), str(medium_store), arm], env=env,
                           capture_output=True, text=True, timeout=3600)
        assert r.returncode == 0, r.stderr[-3000:]
        out[arm] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["on"]["ids"] == out["off"]["ids"] and len(out["on"]["ids"]) == 8
    kept = out["off"]["llvm_after_answer"]
    assert kept > 30_000_000, kept  # what numba's loaded kernels keep of LLVM resident
    assert out["on"]["llvm_after_answer"] < kept / 3, (out["on"], kept)
    assert out["off"]["released"] > 30_000_000 and out["off"]["llvm_after_release"] < kept / 3


_PREPARE_PROBE = r'''
import json, sys
from engine.config import EngineConfig
from engine.generate import Engine
from engine.events import GenerateRequest, SamplingParams, TokenEvent
from engine import kernels, kernel_prepare
from numba.core.registry import CPUDispatcher

cfg = EngineConfig(store=sys.argv[1], pinning=False, history=False, context_length=64, pilot=0, cap=int(sys.argv[2]))
with Engine.open(cfg) as eng:
    assert eng.model.wait_decode_ready(900)
    ids = []
    for prompt in ((1, 2, 3), (1, 2, 3, 4, 5)):  # the second prefill finds experts of the first resident
        req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=8, temperature=0.0))
        ids += [ev.token_id for ev in eng.generate(req) if isinstance(ev, TokenEvent)]
    compiled = sum(sum(d.stats.cache_misses.values()) for d in vars(kernels).values() if isinstance(d, CPUDispatcher))
    loaded = sum(sum(d.stats.cache_hits.values()) for d in vars(kernels).values() if isinstance(d, CPUDispatcher))
    marker = kernel_prepare.marker_path(kernels.CACHE_DIR, kernel_prepare.kernel_kind(eng.args, eng.store, eng.config))
    print(json.dumps({"ids": ids, "prepare_s": eng.kernel_prepare_s, "compiled": compiled, "loaded": loaded,
                      "marker": marker.exists(), "rss": eng.read_rss()}))
'''


@pytest.mark.slow
@pytest.mark.parametrize("cap", [4, 16])
def test_first_open_compiles_in_a_child_process(medium_checkpoint, tmp_path, cap):
    """On a fresh numba cache, Engine.open compiles the kernels in a child process
    (engine.kernel_prepare) and then only loads them: it compiles none itself, its RSS after an
    answer is well below an engine that compiled in process (the compiler's ~500 MB), the
    tokens are the same, and the next open finds the marker and starts no child. On an int4
    store (the precision of models bigger than RAM), streaming (cap 4 of 16 experts: decode
    stops at layers with misses and runs their hits and misses apart) and all resident (cap
    16), with two answers: the second prompt's prefill finds resident experts (the child once
    left K.experts_q4_sorted to the engine, which compiled it at its first such prefill)."""
    import subprocess
    from engine import convert_checkpoint
    medium_store = convert_checkpoint(medium_checkpoint, tmp_path / "medium-int4", quant="int4")
    probe = tmp_path / "probe.py"
    probe.write_text(_PREPARE_PROBE)
    base = {k: v for k, v in os.environ.items() if k != "COLIBRI_COMPILE_IN_PROCESS"}
    # A fresh cache compiles only without the pre-built kernels (they would be loaded instead).
    base.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), COLIBRI_SHIPPED_KERNELS="0")

    def run(cache, **env):
        r = subprocess.run([sys.executable, str(probe), str(medium_store), str(cap)], capture_output=True, text=True,
                           env={**base, "NUMBA_CACHE_DIR": str(tmp_path / cache), **env}, timeout=3600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    child = run("fresh-a")
    again = run("fresh-a")
    here = run("fresh-b", COLIBRI_COMPILE_IN_PROCESS="1")
    assert child["prepare_s"] > 0 and child["marker"] and child["compiled"] == 0 and child["loaded"] > 10, child
    assert again["prepare_s"] == 0 and again["compiled"] == 0, again
    assert here["compiled"] > 10 and not here["marker"], here
    assert child["ids"] == again["ids"] == here["ids"]
    assert here["rss"] - child["rss"] > 150_000_000, (here["rss"], child["rss"])
