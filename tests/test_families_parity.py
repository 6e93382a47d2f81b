"""Every model family against transformers' own classes (the independent oracle).

Qwen3MoeForCausalLM, MixtralForCausalLM and Qwen2MoeForCausalLM checkpoints are built and saved
by transformers (save_pretrained) in two or more configurations each (dense layers through
mlp_only_layers / decoder_sparse_step, GQA ratios, head_dim != hidden / heads, shared-expert
sizes, sliding windows); we convert them and compare logits at every prefill position and over
16 cached decode steps (f32 store) and the teacher-forced KL of the int8 and int4 stores.
OLMoE's parity tests are in test_parity.py; greedy ids across cache size, policy, PILOT mode and
workers for every family are in test_families.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import convert_checkpoint  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from parity_helpers import (assert_f32_parity, fake_quantized_copy, hf_logits, kl, saved_model,  # noqa: E402
                            teacher_forced_agreement)

pytestmark = pytest.mark.parity

V = 256
BASE = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, eos_token_id=0, pad_token_id=0,
            bos_token_id=None, num_hidden_layers=3)

# name -> (transformers config class, model class, config kwargs)
CONFIGS = {
    # Qwen3: GQA 8/2 with head_dim 16 (heads x head_dim = 128 != hidden 64), layer 0 dense
    "qwen3-dense-layer-gqa": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=True)),
    # Qwen3: every second layer sparse (decoder_sparse_step 2), sliding window of 8, MHA
    "qwen3-sparse-step-window": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, intermediate_size=80, decoder_sparse_step=2, norm_topk_prob=False,
        use_sliding_window=True, sliding_window=8, num_hidden_layers=4)),
    # Mixtral: GQA 8/2, no window
    "mixtral-gqa": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=32)),
    # Mixtral: sliding window 8, head_dim 32 from config (hidden / heads would be 16), MHA
    "mixtral-window-headdim": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_local_experts=6,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=8)),
    # Mixtral at expert width 64 with a trained-like router (see test_mixtral_width_64_int8_kl)
    "mixtral-wide-router": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=64)),
    # Mixtral at expert width 64, every matrix (router included) N(0, 0.08)
    "mixtral-wide": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=64)),
    # Qwen2: q/k/v biases, wide shared expert, MHA, all layers sparse
    "qwen2-shared-wide": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=96, intermediate_size=64)),
    # Qwen2: GQA 8/2, narrow shared expert, layer 1 dense, norm_topk_prob true
    "qwen2-dense-layer-gqa": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64,
        mlp_only_layers=[1], norm_topk_prob=True)),
}


# Router redraw per config (None: the N(0, 0.08) of every matrix)
ROUTER_STD = {"mixtral-wide-router": 0.25}


def hf_model(tmp_path, name):
    cfg_cls, model_cls, kw = CONFIGS[name]
    return saved_model(tmp_path, name, cfg_cls, model_cls, router_std=ROUTER_STD.get(name), **{**BASE, **kw})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, name):
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / f"{name}-f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.model_type == m.config.model_type
    if "dense" in name or "step" in name:
        assert 0 < a.num_moe_layers < a.num_hidden_layers
    assert max(a.layer_windows) == (8 if "window" in name else 0)
    assert_f32_parity(m, store, V)  # 24 prefill positions > the window of 8: the window really masks


# int8 per-row: the bound. int4 group-32: the bounds of test_parity.py's OLMoE test
# (mean KL <= 5e-3 nats, top-1 >= 0.85 on these near-flat random logits).
@pytest.mark.parametrize("quant,kl_bound,top1_bound", [("int8", 1e-3, 0.9), ("int4", 5e-3, 0.85)])
@pytest.mark.parametrize("name", ["qwen3-dense-layer-gqa", "qwen3-sparse-step-window", "mixtral-gqa",
                                  "mixtral-window-headdim", "qwen2-dense-layer-gqa", "qwen2-shared-wide"])
def test_quantized_kl_against_transformers(tmp_path, name, quant, kl_bound, top1_bound, record_property):
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / f"store-{quant}", quant=quant)
    mean_kl, top1 = teacher_forced_agreement(m, store, V)
    record_property("mean_kl", mean_kl)
    record_property("top1_agreement", top1)
    print(f"{name} {quant}: mean KL {mean_kl:.2e} nats, top-1 agreement {top1:.3f}")
    assert mean_kl <= kl_bound
    assert top1 >= top1_bound


# Mixtral at expert width 64. With every matrix N(0, 0.08), the weights
# of the width-32 "mixtral-gqa" seed at width 64 give our int8 store a mean KL of 2.6e-3 nats and
# int4 7.8e-3, above the bounds the width-32 config meets. The cause is the random config, not our
# code: transformers' own MixtralForCausalLM with the same weights rounded by an independent torch
# quantizer (fake_quantized_copy: per-row int8 / group-32 int4, routers exact, float activations)
# has mean KL 2.1e-3 (int8) and 7.8e-3 (int4) against the exact model. Such a router on normed
# inputs gives logits of std 0.08 x sqrt(64) = 0.64 over 8 experts: near-flat, so the rounding
# upstream flips the top-2 choice of 3.6% of (token, layer) pairs in transformers itself (1.4% at
# width 32), and a flip swaps an expert carrying about half of the layer's update, which is larger
# at width 64. The rest (ours 2.6e-3 vs 2.1e-3 at int8) is the integer kernels' per-block int8
# quantization of the activations (llama.cpp's Q8_0 scheme).
#
# Trained routers are not that flat (Mixtral's top-2 carry most of the router's probability), so
# the int8 bound (<= 1e-3) is checked at width 64 on "mixtral-wide-router": routers drawn
# from N(0, 0.25) (router logits of std ~2 on normed inputs), every other matrix N(0, 0.08) as in
# every config here. Measured: mean KL 6.5e-4, top-1 0.93. "mixtral-wide" (flat routers) stays
# checked against the error of its own rounded weights: ours may exceed what transformers shows
# with the rounded weights by at most the int8 bound (measured int8 1.57e-3 vs 0.91e-3, int4
# 5.71e-3 vs 5.43e-3), so a real fault there (a wrong scale, routing or accumulation: KL far above
# the rounding's) still fails. int4 at width 64 exceeds the OLMoE bound (5e-3) in transformers
# itself (rounded weights 5.4e-3 here; 6.3e-3 with the trained-like router on the "mixtral-gqa"
# seed, ours 6.4e-3), so the int4 bound stays checked at width 32 (test above) and width 64 is
# checked against its rounded weights only.

def test_mixtral_width_64_int8_kl(tmp_path, record_property):
    m, d = hf_model(tmp_path, "mixtral-wide-router")
    store = convert_checkpoint(d, tmp_path / "store-int8", quant="int8")
    mean_kl, top1 = teacher_forced_agreement(m, store, V)
    record_property("mean_kl", mean_kl)
    print(f"mixtral-wide-router int8: mean KL {mean_kl:.2e} nats, top-1 agreement {top1:.3f}")
    assert mean_kl <= 1e-3
    assert top1 >= 0.9


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_mixtral_width_64_error_is_the_rounded_weights(tmp_path, quant, record_property):
    """Flat random routers at width 64: our KL against transformers is the KL transformers itself
    shows with the same weights rounded the same way (independent torch quantizer), plus at most
    the int8 bound for what quantizing the activations adds."""
    m, d = hf_model(tmp_path, "mixtral-wide")
    store = convert_checkpoint(d, tmp_path / f"store-{quant}", quant=quant)
    ours, _ = teacher_forced_agreement(m, store, V)
    ids = np.random.default_rng(1).integers(0, V, 256).tolist()  # teacher_forced_agreement's ids
    ref = hf_logits(m, ids)
    rounded = float(kl(ref, hf_logits(fake_quantized_copy(m, quant), ids)).mean())
    record_property("mean_kl", ours)
    record_property("rounded_weights_kl", rounded)
    print(f"mixtral-wide {quant}: ours {ours:.2e} nats, transformers on the rounded weights {rounded:.2e}")
    assert ours <= rounded + 1e-3
