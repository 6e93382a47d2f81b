"""DeepSeek sparse attention (GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``) against
transformers' own GlmMoeDsaForCausalLM and DeepseekV32ForCausalLM, two configurations each,
with prompts several times ``index_topk`` long so the indexer's choice matters at most
positions: f32 logits at every prefill position and over 16 cached decode steps, the int8
store's teacher-forced KL, the indexer-key cache in the KV bytes, the absorbed path equal to
the expanded one under the selection, and our rule on exact ties.

Ties: the indexer sums ReLU'd scores; with 2 indexer heads and random weights many
scores are exactly 0 and transformers' own full forward and cached decode pick different
tokens (logits differ by O(1)). The configurations here use 16 indexer heads, where
transformers' full forward and cached decode agree to 2e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import convert_checkpoint, sizing  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.models.dsa import topk_positions  # noqa: E402
from parity_helpers import (assert_absorbed_equals_expanded, assert_f32_parity, fake_quantized_copy, hf_decode_logits, hf_logits, kl,  # noqa: E402
                            open_model, saved_model, teacher_forced_agreement)

pytestmark = pytest.mark.parity

V = 256
BASE = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, eos_token_id=0, pad_token_id=0,
            bos_token_id=None, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, index_n_heads=16)

CONFIGS = {
    # GLM-5 shape: dense layer 0, layer 1 "shared" (reuses layer 0's selection), 2 groups (1 kept),
    # routed scaling 2.5, index_topk 8 over 40-token prompts
    "glm5-dense-shared": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8, index_head_dim=16,
        indexer_types=["full", "shared", "full"])),
    # every layer MoE with its own indexer, index_head_dim 24 (8 rotated + 16 not), top-3, topk 13
    "glm5-allmoe-wide-index": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=0, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, index_topk=13, index_head_dim=24)),
    # DeepSeek-V3.2 shape: dense layer 0, 4 groups of 2 (2 kept), index_topk 8
    "dsv32-dense-groups": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8, index_head_dim=16)),
    # all MoE, one group, YaRN with mscale, index_topk 11, index_head_dim 32
    "dsv32-allmoe-yarn": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, index_topk=11, index_head_dim=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def hf_model(tmp_path, name, router_std=None, **over):
    cfg_cls, model_cls, kw = CONFIGS[name]
    m, d = saved_model(tmp_path, name, cfg_cls, model_cls, router_std=router_std, **{**BASE, **kw, **over})
    with torch.no_grad():  # the correction bias is a zero buffer after init: give it values
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    m.save_pretrained(d)
    return m, d


@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, name):
    m, d = hf_model(tmp_path, name)
    # transformers' own full forward and cached decode agree here (no exact ties)
    rng = np.random.default_rng(7)
    ids, steps = rng.integers(0, V, 30).tolist(), rng.integers(0, V, 6).tolist()
    assert np.abs(hf_logits(m, ids + steps)[30:] - hf_decode_logits(m, ids, steps)).max() < 1e-4
    store = convert_checkpoint(d, tmp_path / f"{name}-f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.model_type == m.config.model_type and a.index_topk == m.config.index_topk
    assert a.indexer_layers == tuple(i for i in range(3) if getattr(m.config, "indexer_types", ["full"] * 3)[i]
                                     == "full")
    assert_f32_parity(m, store, V, n_prefill=40)


# int8. The absolute bound (1e-3 nats) is not met on these random weights, and the
# cause is the sparse selection of the random model, not our store: transformers' own model with
# the same weights rounded by an independent torch quantizer (fake_quantized_copy: per-row int8,
# routers, norms and weights_proj exact, float activations) has mean KL 2.8e-2 ("glm5-dense-shared")
# and 3.8e-2 ("dsv32-allmoe-yarn") against the exact model at index_topk 8; ours: 3.0e-2 and
# 3.5e-2. The rounding moves index scores a little; at the selection boundary that swaps tokens,
# and with random weights attention over the 8 selected tokens is near-uniform, so each swap moves
# about 1/8 of the attention. Fed the exact model's selection, our int8 store measures 3.5e-3 and
# 7.8e-4, as plain MLA does on these weights (DeepSeek-V3's note in test_deepseek_glm_parity.py).
# Wider selections dilute it (index_topk 128 of the 256 positions, routers N(0, 0.25): rounded
# 2.8e-3 / 1.9e-3, ours 3.6e-3 / 2.0e-3). So the test checks ours against the rounding's own KL,
# with a margin for what ours rounds beyond the weights (the f16 KV cache and indexer keys, the
# int8 kernels' activation blocks), which swaps a few more boundary tokens: ours <= 1.25 x
# rounded + 1e-3. A real fault fails it: without the selection (dense MLA) the int8 store's mean KL
# is 0.29 / 0.20 nats, with the indexer's RoPE left out 0.24 / 0.17. These random weights are the
# worst case. On trained weights (tests/test_int8_trained.py: both configurations trained on text,
# the indexer by KL towards the main attention as DeepSeek-V3.2 does, its top-8 then holding 99%
# of the best top-8's attention mass) the issue's bound holds: on held-out text ours 2.8e-4 / 7.1e-5
# against the rounded weights' 1.6e-4 / 5.7e-5, while the selection itself matters there (the
# trained GLM-5 model's sparse vs dense attention differ by 8.4e-2 nats).
@pytest.mark.parametrize("name", ["glm5-dense-shared", "dsv32-allmoe-yarn"])
def test_int8_kl_against_the_roundings_own(tmp_path, name, record_property):
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / f"{name}-int8", quant="int8")
    ours, top1 = teacher_forced_agreement(m, store, V)
    ids = np.random.default_rng(1).integers(0, V, 256).tolist()  # teacher_forced_agreement's ids
    rounded = float(kl(hf_logits(m, ids), hf_logits(fake_quantized_copy(m, "int8"), ids)).mean())
    record_property("mean_kl", ours)
    print(f"{name} int8: mean KL {ours:.2e} nats (transformers with rounded weights {rounded:.2e}), "
          f"top-1 agreement {top1:.3f}")
    assert ours <= 1.25 * rounded + 1e-3
    assert top1 >= 0.5


def test_indexer_keys_are_in_the_kv_cache_and_absorbed_equals_expanded(tmp_path):
    m, d = hf_model(tmp_path, "glm5-dense-shared")
    store = convert_checkpoint(d, tmp_path / "f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.kv_values_per_token == a.kv_lora_rank + a.qk_rope_head_dim == 40
    # latent on 3 layers + 16 indexer-key values on the 2 layers that run an indexer
    assert a.kv_values_all_layers == 3 * 40 + 2 * 16
    assert sizing.kv_bytes(a, 100) == 100 * (3 * 40 + 2 * 16) * 2
    ours, st, cache = open_model(store, context=64, kv_dtype="f32")
    try:
        assert ours.kv_bytes == 64 * (3 * 40 + 2 * 16) * 4
        ids = np.random.default_rng(3).integers(0, V, 30)
        assert_absorbed_equals_expanded(ours, ids, 20)
    finally:
        cache.close()
        st.close()


def test_exact_ties_go_to_the_lower_position():
    """Our documented rule: the larger index score first, among exactly equal scores the lower
    position (transformers' torch.topk leaves that order to the implementation)."""
    s = np.array([0.0, 2.0, 0.0, 0.0, 1.0, 0.0], np.float32)
    assert topk_positions(s, 3).tolist() == [0, 1, 4]
    assert topk_positions(s, 4).tolist() == [0, 1, 2, 4]
    assert topk_positions(np.zeros(5, np.float32), 2).tolist() == [0, 1]
    assert topk_positions(s, 6).tolist() == list(range(6))
    assert topk_positions(np.array([3.0, -1.0, 3.0, 5.0], np.float32), 2).tolist() == [0, 3]


@pytest.mark.parametrize("name", ["glm5-dense-shared", "dsv32-dense-groups"])
def test_streamed_prefill_computes_the_cached_models_logits(tmp_path, name):
    """A prompt longer than a prefill chunk on a cache of 2 experts per layer (the layer-by-layer
    prefill where every layer runs its own indexer; chunk by chunk where a "shared" layer reuses
    the previous layer's selection) computes the logits of the model with every expert cached."""
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / "int8", quant="int8")
    ids = np.random.default_rng(5).integers(0, V, 150)
    got = []
    for cap in (None, 2):
        ours, st, cache = open_model(store, cap=cap)
        try:
            got.append(ours.forward(ids, 0, all_logits=True))
        finally:
            cache.close()
            st.close()
    np.testing.assert_allclose(got[1], got[0], atol=1e-5 * np.abs(got[0]).max())
