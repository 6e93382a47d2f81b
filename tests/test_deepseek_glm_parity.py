"""DeepSeek-V2, DeepSeek-V3 (Kimi-K2), GLM-4-MoE and GLM-4.7-Flash (glm4_moe_lite) against
transformers' own classes (sparse attention: test_dsa_parity.py).

Checkpoints are built and saved by transformers (save_pretrained) in two configurations per
family (with and without dense first layers, q LoRA or a plain q_proj, plain or
group-limited routing, YaRN, partial rotary, q/k norms and biases); we convert them and compare
logits at every prefill position and over 16 cached decode steps (f32 store), and the
teacher-forced KL of the int8 store. Also: the latent KV cache holds kv_lora_rank +
qk_rope_head_dim values per token and layer, the absorbed MLA equals the expanded one, the
grouped routers equal transformers' own, FP8 block-scaled checkpoints convert. Greedy ids across
cache size, policy, PILOT and threads for these families are in test_families.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import convert_checkpoint  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.models.routing import route_tokens  # noqa: E402
from engine import sizing  # noqa: E402
from parity_helpers import (assert_absorbed_equals_expanded, assert_f32_parity, fake_quantized_copy, hf_logits, kl, open_model,  # noqa: E402
                            saved_model, teacher_forced_agreement)

pytestmark = pytest.mark.parity

V = 256
BASE = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, eos_token_id=0, pad_token_id=0,
            bos_token_id=None, num_hidden_layers=3)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, intermediate_size=96)

CONFIGS = {
    # V3: q LoRA, dense layer 0, 4 groups of 2 experts, 2 groups kept, routed_scaling 2.5, YaRN
    "dsv3-dense-groups-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    # V3 (Kimi-K2 shape): plain q_proj, no dense layer, one group, 2 shared experts, no interleave
    "dsv3-qproj-onegroup": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_interleave=False)),
    # V2-Lite shape: plain q_proj, greedy softmax top-K, dense layer 0
    "dsv2-lite-greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        **MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0)),
    # V2: q LoRA, group-limited greedy (4 groups, 2 kept), routed_scaling 16
    "dsv2-group-limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        **MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0)),
    # GLM-4.5: GQA 8/2, head_dim 16, biases, q/k norm, partial rotary 0.5, dense layer 0, 2 groups
    "glm-qknorm-bias-groups": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5)),
    # GLM-4.5-Air shape: MHA, no q/k norm, no bias, every layer MoE, rotary 0.25 of head_dim 32
    "glm-air-allmoe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=0,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25})),
    # GLM-4.7-Flash: MLA with q LoRA, GLM routing over 2 groups (1 kept), mlp_layer_types' default
    # (layer 0 dense), routed scaling 1.8
    "glm-lite-qlora-groups": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        **MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True)),
    # plain q_proj, every layer MoE (mlp_layer_types), rotate-half RoPE, 2 shared experts, top-3
    "glm-lite-qproj-allmoe": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        **MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        mlp_layer_types=["sparse"] * 3, rope_interleave=False, norm_topk_prob=False)),
}


def hf_model(tmp_path, name):
    cfg_cls, model_cls, kw = CONFIGS[name]
    m, d = saved_model(tmp_path, name, cfg_cls, model_cls, **{**BASE, **kw})
    # the correction bias is a buffer (zeros after init): give it values so it matters
    with torch.no_grad():
        for n, b in list(m.named_buffers()) + list(m.named_parameters()):
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    m.save_pretrained(d)
    return m, d


@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, name):
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / f"{name}-f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.model_type == m.config.model_type
    # transformers saves no MTP layer (and no unused tensor): nothing is named as skipped
    import json
    assert "skipped" not in json.loads((store / "manifest.json").read_text())
    assert a.num_moe_layers == sum(hasattr(layer.mlp, "gate") for layer in m.model.layers)
    if "dense" in name or "lite-greedy" in name or "qlora-groups" in name:
        assert a.num_moe_layers == a.num_hidden_layers - 1
    assert_f32_parity(m, store, V, n_prefill=40)


# int8 per-row against transformers. The bound (1e-3 nats) holds for DeepSeek-V2 and
# GLM-4-MoE. DeepSeek-V3 on these random weights (N(0, 0.08)) measures 1.4e-3 ("qproj-onegroup":
# unnormalised sigmoid weights, 2 shared experts) and 3.2e-3 ("dense-groups-yarn": routed scaling
# 2.5, YaRN mscale^2 1.30); isolating tensors on the latter, int8 o_proj alone gives 1.8e-3 (8.4e-4
# with exact activations) while int8 experts alone give 5.8e-4. The cause is the random model, not
# our store: transformers' own DeepseekV3ForCausalLM with the same weights rounded by an independent
# torch quantizer (fake_quantized_copy) measures 2.1e-3 and 3.0e-3, so the test also checks ours
# against that (at most the int8 bound above it). The config is not the culprit either: logits
# have std 0.64 (max 2.9), no huge logit scale; the real configs' initializer_range (0.02) at
# hidden 64 gives near-uniform outputs (entropy 5.53 of ln 256 = 5.55 nats) where any KL is
# tiny (ours 1.9e-6 / 5.1e-6) and so proves nothing, and 1/sqrt(hidden) = 0.125 (the
# activation-preserving scale; the real 0.02 at hidden 7168 is 0.21 at hidden 64) gives 4.5e-3 /
# 7.2e-3 (rounded weights in transformers 2.6e-3 / 9.7e-3). A trained-like router (N(0, 0.25), as
# Mixtral's test) does not fix it either (2.7e-3 / 1.5e-3). GLM-4.7-Flash ("glm-lite-qlora-groups",
# the same MLA under GLM routing) is the same case: ours 2.6e-3, transformers with rounded weights
# 2.6e-3. On these random weights the bound is not met for V3 and GLM-4.7-Flash; the test pins
# what holds so a regression shows, and checks ours against the rounded weights' own KL (the worst
# case). On trained weights the bound holds for all three: tests/test_int8_trained.py trains
# these configurations briefly on text and measures, on held-out text, ours 5.2e-5
# ("qproj-onegroup"), 1.2e-4 ("dense-groups-yarn") and 3.7e-5 ("glm-lite-qlora-groups") against
# transformers' rounded weights' 4.3e-5, 7.6e-5 and 2.3e-5, asserting <= 1e-3.
@pytest.mark.parametrize("name,bound", [("dsv2-lite-greedy", 1e-3), ("glm-qknorm-bias-groups", 1e-3),
                                        ("glm-lite-qlora-groups", 4e-3),
                                        ("dsv3-qproj-onegroup", 2.5e-3), ("dsv3-dense-groups-yarn", 5e-3)])
def test_int8_kl_against_transformers(tmp_path, name, bound, record_property):
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / f"{name}-int8", quant="int8")
    mean_kl, top1 = teacher_forced_agreement(m, store, V)
    record_property("mean_kl", mean_kl)
    ids = np.random.default_rng(1).integers(0, V, 256).tolist()  # teacher_forced_agreement's ids
    rounded = float(kl(hf_logits(m, ids), hf_logits(fake_quantized_copy(m, "int8"), ids)).mean())
    print(f"{name} int8: mean KL {mean_kl:.2e} nats (transformers with rounded weights {rounded:.2e}), "
          f"top-1 agreement {top1:.3f}")
    assert mean_kl <= bound
    assert top1 >= 0.85
    if bound > 1e-3:  # above the bound: not above what the rounded weights do in transformers
        assert mean_kl <= rounded + 1e-3, rounded


def test_latent_kv_cache_size_and_absorbed_equals_expanded(tmp_path):
    m, d = hf_model(tmp_path, "dsv3-dense-groups-yarn")
    store = convert_checkpoint(d, tmp_path / "f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.kv_values_per_token == a.kv_lora_rank + a.qk_rope_head_dim == 40
    assert sizing.kv_bytes(a, 100, "f32") == a.num_hidden_layers * 100 * 40 * 4
    assert sizing.kv_bytes(a, 100) == a.num_hidden_layers * 100 * 40 * 2  # f16, the default
    # f32 cache: with the f16 one a last-bit difference upstream can round a latent value to the
    # neighbouring half (5e-4 relative), which shows as 2e-5 x the logit scale (absorbed and
    # expanded agree to 6e-7 on the same f32 cache)
    ours, st, cache = open_model(store, context=64, kv_dtype="f32")
    try:
        assert ours.kv_bytes == a.num_hidden_layers * 64 * 40 * 4
        ids = np.random.default_rng(3).integers(0, V, 20)
        assert_absorbed_equals_expanded(ours, ids, 12)
    finally:
        cache.close()
        st.close()


def _hf_router(v3: bool, **kw):
    name = "deepseek_v3" if v3 else "deepseek_v2"
    mod = getattr(transformers.models, name)
    cfg = getattr(transformers, "DeepseekV3Config" if v3 else "DeepseekV2Config")(
        **{**BASE, **MLA, "n_routed_experts": 8, "num_experts_per_tok": 2, **kw})
    return getattr(getattr(mod, f"modeling_{name}"), "DeepseekV3TopkRouter" if v3 else "DeepseekV2TopkRouter")(cfg)


@pytest.mark.parametrize("v3", [True, False])
def test_group_limited_router_equals_transformers(v3):
    """The grouped routers against transformers' own DeepseekV3TopkRouter (sigmoid, correction
    bias, groups by their top-2 sum) and DeepseekV2TopkRouter (softmax, groups by their max):
    the same experts with the same weights for 256 tokens."""
    kw = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5) if v3 else \
        dict(n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    r = _hf_router(v3, **kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        r.weight.copy_(torch.randn(8, 64, generator=g) * 0.3)
        if v3:
            r.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        logits, tw, ti = r(torch.randn(256, 64, generator=g))
    bias = r.e_score_correction_bias.numpy() if v3 else None
    idx, wt = route_tokens(logits.numpy(), 2, norm_topk_prob=v3, scoring_func="sigmoid" if v3 else "softmax",
                           topk_method="noaux_tc" if v3 else "group_limited_greedy", n_group=4, topk_group=2,
                           routed_scaling_factor=kw["routed_scaling_factor"], bias=bias)
    for t in range(256):
        mine = dict(zip(idx[t].tolist(), wt[t].tolist()))
        ref = dict(zip(ti[t].tolist(), tw[t].tolist()))
        assert mine.keys() == ref.keys(), t
        assert all(abs(mine[e] - ref[e]) <= 1e-5 * max(1.0, abs(ref[e])) for e in ref)


@pytest.mark.parametrize("v3", [True, False])
def test_router_ties_inside_the_choice_match_transformers(v3):
    """Exact ties that occur: experts 4-5 (group 2) are copies of experts 0-1 (group 0), router
    rows and correction biases alike, so groups 0 and 2 tie on every token and experts 0 and 4
    (1 and 5) tie whenever both groups are kept. Where the tie is inside the choice (both tied
    groups or experts kept, or both left out) transformers' choice is determined and ours equals
    it, experts and weights; where it straddles the boundary (torch.topk keeps whichever its C++
    library's nth_element leaves; see engine/models/routing.py) ours keeps the lower index."""
    kw = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5) if v3 else \
        dict(n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    r = _hf_router(v3, **kw)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        w = torch.randn(8, 64, generator=g) * 0.3
        w[4:6] = w[0:2]
        r.weight.copy_(w)
        if v3:
            b = torch.randn(8, generator=g) * 0.3
            b[4:6] = b[0:2]
            r.e_score_correction_bias.copy_(b)
        logits, tw, ti = r(torch.randn(512, 64, generator=g))
    z = logits.numpy()
    bias = r.e_score_correction_bias.numpy() if v3 else None
    idx, wt = route_tokens(z, 2, norm_topk_prob=v3, scoring_func="sigmoid" if v3 else "softmax",
                           topk_method="noaux_tc" if v3 else "group_limited_greedy", n_group=4, topk_group=2,
                           routed_scaling_factor=kw["routed_scaling_factor"], bias=bias)
    p = 1 / (1 + np.exp(-z)) + bias if v3 else np.exp(z) / np.exp(z).sum(1, keepdims=True)
    grp = p.reshape(-1, 4, 2)
    gs = np.sort(grp, axis=2)[:, :, ::-1][:, :, :2].sum(2) if v3 else grp.max(2)  # [T, 4] group scores
    inside = straddle = 0
    for t in range(512):
        top_groups = np.argsort(-gs[t], kind="stable")
        kept = np.repeat(np.isin(np.arange(4), top_groups[:2]), 2)
        choice = np.sort(np.where(kept, p[t], -np.inf))[::-1]
        group_tie_at_boundary = gs[t][top_groups[1]] == gs[t][top_groups[2]]
        if group_tie_at_boundary or choice[1] == choice[2]:
            straddle += 1
            assert group_tie_at_boundary and not {4, 5} & set(idx[t].tolist())  # we keep the lower group, 0
            continue
        inside += kept[0] and kept[4]  # both tied groups kept: experts 0 / 4 and 1 / 5 tie in the choice
        mine = dict(zip(idx[t].tolist(), wt[t].tolist()))
        ref = dict(zip(ti[t].tolist(), tw[t].tolist()))
        assert mine.keys() == ref.keys(), t
        assert all(abs(mine[e] - ref[e]) <= 1e-5 * max(1.0, abs(ref[e])) for e in ref)
    assert inside >= 50 and straddle >= 50, (inside, straddle)


def test_exact_ties_go_to_the_lower_index():
    """Our documented rule on exact ties (group scores or expert scores): larger first, then the
    lower index. (torch.topk on the CPU breaks exact ties by the order libstdc++'s nth_element
    leaves, e.g. topk([1, 1, .5, 1], 2) -> [1, 3]; exact ties do not occur with real-valued
    router weights, only with equal router rows.)"""
    logits = np.array([[1.0, 1.0, 0.5, 1.0, -2.0, -2.0, -2.0, -2.0]], np.float32)
    idx, _ = route_tokens(logits, 2, norm_topk_prob=True)
    assert idx.tolist() == [[0, 1]]
    # groups 0 (experts 0-1) and 2 (experts 4-5) tie; one group kept: the lower one
    z = np.array([[2.0, 1.0, -5.0, -5.0, 2.0, 1.0, -5.0, -5.0]], np.float32)
    idx, _ = route_tokens(z, 2, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                          n_group=4, topk_group=1, bias=np.zeros(8, np.float32))
    assert idx.tolist() == [[0, 1]]


def _to_fp8_blocks(w: "torch.Tensor", bo: int, bi: int):
    """w float32 [O, N] -> (float8_e4m3fn [O, N], scale_inv float32 [ceil(O/bo), ceil(N/bi)]) as
    the published FP8 checkpoints store them: per block, scale_inv = amax / 448 and
    weight = round_to_e4m3(w / scale_inv)."""
    O, N = w.shape
    so, si = -(-O // bo), -(-N // bi)
    s = torch.empty(so, si)
    q = torch.empty(O, N, dtype=torch.float8_e4m3fn)
    for a in range(so):
        for b in range(si):
            blk = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]
            s[a, b] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = (blk / s[a, b]).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_fp8_block_scaled_checkpoint_converts_and_matches(tmp_path, block):
    """An FP8 checkpoint made like DeepSeek-V3's (e4m3 weights + weight_scale_inv per block;
    embeddings, norms, routers and lm_head stay bf16/f32) converts, and the f32 store matches
    transformers run on the dequantized weights."""
    import json
    from safetensors.torch import load_file as tload, save_file as tsave
    m, d = hf_model(tmp_path, "dsv3-dense-groups-yarn")
    sd = tload(str(d / "model.safetensors"))
    bo, bi = block
    fp8 = {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith(("_proj.weight", "_mqa.weight")):  # attention, experts, shared, MLPs
            q, s = _to_fp8_blocks(v.float(), bo, bi)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            sd[k] = (q.float() * s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:v.shape[0], :v.shape[1]])
        else:
            fp8[k] = v
    f8 = tmp_path / "fp8"
    f8.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [bo, bi]}
    (f8 / "config.json").write_text(json.dumps(cfg))
    tsave(fp8, str(f8 / "model.safetensors"))
    deq = tmp_path / "dequantized"  # transformers on the dequantized weights: the oracle
    deq.mkdir()
    (deq / "config.json").write_text((d / "config.json").read_text())
    tsave({k: v.contiguous() for k, v in sd.items()}, str(deq / "model.safetensors"))
    oracle = getattr(transformers, CONFIGS["dsv3-dense-groups-yarn"][1]).from_pretrained(
        deq, attn_implementation="eager", dtype=torch.float32).eval()
    store = convert_checkpoint(f8, tmp_path / "fp8-f32", quant="f32")
    assert_f32_parity(oracle, store, V, n_prefill=24)
    assert (f8 / "model.safetensors").stat().st_size < 0.6 * (d / "model.safetensors").stat().st_size


def test_fp8_without_scales_is_a_clear_error(tmp_path):
    import json
    from safetensors.torch import load_file as tload, save_file as tsave
    from engine.errors import CheckpointError
    m, d = hf_model(tmp_path, "glm-air-allmoe")
    sd = tload(str(d / "model.safetensors"))
    k = "model.layers.0.self_attn.q_proj.weight"
    sd[k] = sd[k].to(torch.float8_e4m3fn)
    tsave(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        convert_checkpoint(d, tmp_path / "out", quant="int8")
    assert json.loads((d / "config.json").read_text())["model_type"] == "glm4_moe"
