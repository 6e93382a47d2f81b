"""The 16-bit KV cache: the kv_dtype setting, its accuracy on the bundled default
model, and the RAM per token of context it saves in the sizing rule, the budget and
``colibri info``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import Engine, EngineConfig, ModelArgs, convert_checkpoint, sizing
from engine.cli.run import describe_store
from engine.library import default_model_dir
from engine.units import format_bytes

MODEL = default_model_dir()
KL_BOUND = 1e-4  # nats; measured 3.5e-8 for f16 (bf16 emulated: 4.9e-5)


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="default model not trained yet")
def test_f16_kv_teacher_forced_kl_on_default_model(tmp_path):
    """Teacher-forced over the bundled model's whole held-out sample (64 sequences, ~7,000
    positions; f32 store, so only the KV element differs): mean KL(f32 KV || f16 KV) <= 1e-4
    nats, same argmax.

    The mean is carried by a few positions where a half-precision rounding flips a near-tied
    routing or attention choice (the shipped model: median 6e-8, max 0.026 at one position);
    over the first 12 sequences only (~2,600 positions) one such position decided the result
    (a candidate model measured 2.4e-4 there from a single position at 0.18, 2.9e-7 without
    it), so the test uses the whole sample."""
    store = convert_checkpoint(MODEL, tmp_path / "f32", quant="f32")
    seqs = [json.loads(x)["ids"] for x in (MODEL / "heldout_sample.jsonl").read_text().splitlines() if x.strip()]
    assert len(seqs) == 64
    logits = {}
    for kv in ("f32", "f16"):
        cfg = EngineConfig(store=str(store), pilot=0, pinning=False, history=False, kv_dtype=kv)
        with Engine.open(cfg) as eng:
            assert eng.model.k_cache.dtype == (np.uint16 if kv == "f16" else np.float32)
            logits[kv] = [eng.model.forward(np.asarray(s), 0, all_logits=True).astype(np.float64) for s in seqs]
    kls, same = [], []
    for r, g in zip(logits["f32"], logits["f16"]):
        lp, lq = _log_softmax(r), _log_softmax(g)
        kls.append((np.exp(lp) * (lp - lq)).sum(axis=1))
        same.append(r.argmax(axis=1) == g.argmax(axis=1))
    kl = np.concatenate(kls)
    print(f"f16 KV vs f32 KV: mean KL {kl.mean():.2e} nats over {kl.size} positions, "
          f"top-1 agreement {np.concatenate(same).mean():.4f}")
    assert kl.mean() <= KL_BOUND
    assert np.concatenate(same).mean() >= 0.99


def test_kv_ram_per_token_halved(tiny_store, monkeypatch):
    """f16 (the default) takes half the bytes per token of context of f32 in the sizing rule, in
    the engine's budget plan and arrays, and in ``colibri info``; at the same budget the cap
    is at least as large."""
    args = ModelArgs.from_hf_config(tiny_store)
    manifest = sizing.read_manifest(tiny_store)
    f16 = sizing.estimate_store(args, manifest, 512)
    f32 = sizing.estimate_store(args, manifest, 512, "f32")
    assert f16.kv_bytes * 2 == f32.kv_bytes > 0
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim
    assert f16.kv_bytes == per_token * 2 * 512
    assert sizing.estimate(args, "int8", 512).kv_bytes * 2 == sizing.estimate(args, "int8", 512, kv_dtype="f32").kv_bytes
    with pytest.raises(ValueError, match="kv_dtype"):
        sizing.kv_bytes(args, 512, "int3")
    budget = (f32.ram_needed + 4 * f32.slot_bytes) / sizing.GB
    plans = {}
    for kv in ("f16", "f32"):
        cfg = EngineConfig(store=str(tiny_store), pinning=False, history=False, context_length=512,
                           ram_budget_gb=budget, kv_dtype=kv)
        with Engine.open(cfg, read_rss=lambda: 0) as eng:
            plans[kv] = eng.plan
            assert eng.model.kv_bytes == eng.plan.kv == (f16 if kv == "f16" else f32).kv_bytes
    assert plans["f16"].kv * 2 == plans["f32"].kv
    assert plans["f16"].cap >= plans["f32"].cap
    info = describe_store(str(tiny_store), 512)
    assert f"KV {format_bytes(f16.kv_bytes)}" in info


def test_kv_dtype_is_one_setting():
    """Declared once in the settings table: validated, default f16, a ``colibri run`` flag."""
    from engine import ConfigError
    from engine.settings import setting
    s = setting("kv_dtype")
    assert s.default == "f16" and s.choices == ("f16", "f32") and s.needs_reload
    assert EngineConfig().kv_dtype == "f16"
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(store="x", kv_dtype="bf8").validated()
