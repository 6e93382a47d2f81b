"""engine/sizing.py is the one sizing rule: what the wizard and the settings dialog predict is
what Engine.open then does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine import Engine, EngineConfig, ModelArgs, convert_checkpoint
from engine import sizing
from engine.sizing import GB


def _manifest(store):
    return json.loads((store / "manifest.json").read_text())


@pytest.mark.parametrize("over", [
    dict(context_length=0, ram_budget_gb=1.0),
    dict(context_length=100, ram_budget_gb=0.20116),  # a budget that holds only 5 slots per layer
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
        assert eng.cache.cap == predicted.cap


@pytest.mark.parametrize("quant", ["int8", "int4", "f16"])
def test_dense_bytes_from_args_equal_the_store(tiny_checkpoint, tmp_path, quant):
    store = convert_checkpoint(tiny_checkpoint, tmp_path / quant, quant=quant)
    m = _manifest(store)
    args = ModelArgs.from_hf_config(tiny_checkpoint)
    assert sizing.dense_bytes(args, quant) == m["dense_bytes"]
    assert [sizing.slot_bytes(args, quant)] * args.num_hidden_layers == m["slot_bytes"]


def test_verdict_uses_the_same_cap_rule(tiny_store):
    args = ModelArgs.from_hf_config(tiny_store)
    est = sizing.estimate_store(args, _manifest(tiny_store), 128)
    avail = 2 * est.ram_needed
    verdict, msg = sizing.ram_verdict(est, args.num_experts_per_tok, 10 * avail, avail)
    plan = sizing.plan_estimate(est, sizing.AVAILABLE_SHARE * avail / GB, None)
    assert verdict == "ok" and f"about {plan.cap} expert slots per layer" in msg
    assert sizing.ram_verdict(est, 2, est.ram_needed - 1, est.ram_needed)[0] == "refuse"


def test_a_new_family_plugs_in_through_dense_shapes():
    """A family whose ModelArgs has dense_shapes() is sized from it (no change in sizing.py)."""
    base = ModelArgs.from_dict({"model_type": "olmoe", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                "intermediate_size": 32, "vocab_size": 128})

    other = SimpleNamespace(  # another family's args: only what sizing reads, plus dense_shapes()
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=4, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        dense_shapes=lambda: ([(100, 64)], 1000))  # one int8 matrix + 1000 float32 values
    assert sizing.dense_bytes(other, "int8") == 100 * 64 + 100 * 4 + 4000
    assert sizing.dense_bytes(base, "int8") != sizing.dense_bytes(other, "int8")
    est = sizing.estimate(other, "int8", 0)
    assert est.context_length == 512 and est.kv_bytes == 2 * 2 * 4 * 512 * 16 * 4
