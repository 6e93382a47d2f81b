"""Model families without torch: the family registry and its error messages, the converter and
store for every family (per-expert and fused expert tensors, stores written straight from the
seed), and greedy ids that do not depend on cache size, policy, PILOT mode or workers."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import convert_checkpoint
from engine.config import EngineConfig, ModelArgs
from engine.errors import ConfigError
from engine.events import Finished, GenerateRequest, SamplingParams
from engine.expert_store import ExpertStore
from engine.generate import Engine
from engine.models import SUPPORTED_MODEL_TYPES, family_for
from engine.quant import slab_layout
from engine.kernels import _Q4_SIMD as K_SIMD
from engine.bench.synthetic import (CONFIGS, PRESETS, deepseek_v2_config, deepseek_v3_config, deepseek_v32_config,
                              dots1_config, ernie4_5_moe_config, glm4_moe_config, glm4_moe_lite_config, glm_moe_dsa_config, mixtral_config,
                              olmoe_config, qwen2_moe_config, qwen3_5_moe_config, qwen3_5_moe_text_config,
                              qwen3_moe_config, qwen3_next_config, write_checkpoint, write_store_from_seed,
                              deepseek_v4_config, gemma4_config, gemma4_text_config, granitemoehybrid_config, hunyuan_v1_moe_config, kimi_linear_config, lfm2_moe_config, llama4_config, llama4_text_config, minimax_m2_config)

# Family configs with dense layers, GQA, shared experts and windows (small but streaming).
FAMILY_CONFIGS = {
    "olmoe": olmoe_config(num_hidden_layers=3, num_key_value_heads=2),
    "qwen3_moe": qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1,
                                  num_experts_per_tok=3),
    "qwen3_moe-step": qwen3_moe_config(num_hidden_layers=4, decoder_sparse_step=2, use_sliding_window=True,
                                       sliding_window=5),
    "mixtral": mixtral_config(num_hidden_layers=3, sliding_window=6, head_dim=32),
    "qwen2_moe": qwen2_moe_config(num_hidden_layers=3, mlp_only_layers=[0], num_key_value_heads=2),
    "deepseek_v3": deepseek_v3_config(),
    "deepseek_v2": deepseek_v2_config(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    "glm4_moe": glm4_moe_config(),
    "glm4_moe_lite": glm4_moe_lite_config(mlp_layer_types=["dense", "sparse", "sparse", "dense"],
                                          num_hidden_layers=4),
    # sparse attention: the 20-token prompt + 12 new tokens exceed index_topk 8
    "deepseek_v32": deepseek_v32_config(),
    "glm_moe_dsa": glm_moe_dsa_config(),
    # hybrid: Gated DeltaNet layers 0-2 + a gated full-attention layer 3; layer 1 dense
    "qwen3_next": qwen3_next_config(mlp_only_layers=[1]),
    "qwen3_5_moe_text": qwen3_5_moe_text_config(num_hidden_layers=3, layer_types=[
        "linear_attention", "full_attention", "linear_attention"]),
    "qwen3_5_moe": qwen3_5_moe_config(num_hidden_layers=2, num_experts_per_tok=3),  # as published: text_config, model.language_model.*
    # pair-rotated RoPE, softmax router with a selection-only bias, a shared expert, layer 0 dense
    "ernie4_5_moe": ernie4_5_moe_config(),
    # sigmoid routing over 2 groups with the bias, a shared expert, layer 0 dense, the last layer sliding
    "dots1": dots1_config(),
    # q/k norms after RoPE with NTK alpha, a shared MLP beside top-2 softmax experts
    "hunyuan_v1_moe": hunyuan_v1_moe_config(),
    # whole-projection q/k norms, rotary over half of each head, sigmoid routing with the bias
    "minimax_m2": minimax_m2_config(),
    # chunks of 7 (the 20-token prompt + 12 new tokens cross them), a NoPE layer with temperature
    # tuning, input-scaled top-1 experts and a shared expert on layers 1 and 3; top-2 as published
    "llama4_text": llama4_text_config(attention_chunk_size=7),
    "llama4": llama4_config(num_experts_per_tok=2, attention_chunk_size=7),
    # sliding / full layers of two head sizes with K = V on full ones, GeGLU experts beside a dense
    # GeGLU, per-expert scales, layer scalars, soft-capped logits
    "gemma4_text": gemma4_text_config(),
    "gemma4": gemma4_config(attention_k_eq_v=False, top_k_experts=3),
    # gated short convolutions carrying their state across calls, sigmoid routing with the bias
    "lfm2_moe": lfm2_moe_config(),
    # Mamba2 layers carrying conv inputs and state across calls, a NoPE attention layer, multipliers
    "granitemoehybrid": granitemoehybrid_config(),
    # KDA layers carrying conv inputs and a per-channel-decay state, a NoPE latent-attention layer
    "kimi_linear": kimi_linear_config(),
    # residual streams, sliding / compressed sparse / heavily compressed attention with sinks,
    # a hash-routed first layer, clamped SwiGLU experts
    "deepseek_v4": deepseek_v4_config(),
}


OWN_EXPERT_MLP = ("gpt_oss", "gemma4_text", "gemma4", "deepseek_v4")  # not SwiGLU: the arena kernels do not run them
DENSE_BESIDE_EXPERTS = ("gemma4_text", "gemma4")  # a resident MLP in every MoE layer


@pytest.fixture(scope="module")
def family_stores(tmp_path_factory):
    """name -> (checkpoint folder, int8 store) for every FAMILY_CONFIGS entry."""
    out = {}
    for name, cfg in FAMILY_CONFIGS.items():
        d = tmp_path_factory.mktemp("fam")
        ck = write_checkpoint(d / name, cfg, seed=11, std=0.1)
        out[name] = (ck, convert_checkpoint(ck, d / f"{name}-int8", quant="int8"))
    return out


def _greedy(store, **kw) -> tuple[int, ...]:
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, **kw)
    with Engine.open(cfg) as eng:
        req = GenerateRequest(prompt_ids=tuple(range(5, 25)),
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
        fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
        assert fin.error == "", fin.error
        assert eng.cache.L == eng.args.num_moe_layers
        return fin.token_ids


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_greedy_ids_do_not_depend_on_placement(family_stores, name):
    _, store = family_stores[name]
    E = ModelArgs.from_hf_config(store).num_experts
    ref = _greedy(store, cap=E, policy="lru", pilot=0)
    assert len(ref) == 12
    for kw in (dict(cap=1, policy="lfru", pilot=0, reserve_cache=True), dict(cap=2, policy="ema", pilot=3, pilot_workers=2),
               dict(cap=3, policy="lru", pilot=1, pilot_workers=1, wide=2, spec_precision=0.0),
               dict(cap=2, policy="ema", pilot=2, pinning=True, pin_per_layer=1),
               dict(cap=E, policy="lru", pilot=0, threads=1, idle_fill=True),
               dict(cap=2, policy="ema", pilot=1, threads=2, idle_fill=True)):
        assert _greedy(store, **kw) == ref, kw


def _prefill_logits(store, sorted_path=True, **kw) -> np.ndarray:
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, **kw)
    with Engine.open(cfg) as eng:
        if not sorted_path:
            eng.model._sorted_memo = False  # one expert_q4 call per expert (the old path)
        logits = eng.model.forward(np.arange(5, 25), 0, all_logits=True)
        return logits, eng.model._sorted_memo


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_int4_prefill_does_not_depend_on_placement(family_stores, tmp_path, name):
    """An int4 store's prefill logits (20 tokens, every position) are bit-identical whether a
    chunk's resident experts run in one experts_q4_sorted call (all resident, or some) or one
    expert_q4 call each, at every cap, with PILOT and pinning."""
    ck, _ = family_stores[name]
    store = convert_checkpoint(ck, tmp_path / "int4", quant="int4")
    E = ModelArgs.from_hf_config(store).num_experts
    ref, _ = _prefill_logits(store, sorted_path=False, cap=E, pilot=0)
    took = set()
    for kw in (dict(cap=E, pilot=0), dict(cap=1, policy="lfru", pilot=0), dict(cap=2, policy="ema", pilot=2),
               dict(cap=3, pilot=1, pinning=True, pin_per_layer=1), dict(cap=E, pilot=0, threads=1)):
        got, path = _prefill_logits(store, **kw)
        took.add(path)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), kw
    # gpt-oss (clamped SwiGLU with biases, MXFP4) and Gemma 4 (GeGLU) have their own expert MLP:
    # never the sorted path
    assert took == ({False} if name in OWN_EXPERT_MLP else {True}), took


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_store_records_family_and_moe_layers(family_stores, name):
    _, store = family_stores[name]
    m = json.loads((store / "manifest.json").read_text())
    a = ModelArgs.from_hf_config(store)
    assert m["model_type"] == a.model_type == FAMILY_CONFIGS[name]["model_type"]
    assert m["num_layers"] == a.num_moe_layers == len(m["experts"]) == len(m["moe_layers"])
    assert m["moe_layers"] == list(a.moe_layers) and m["num_hidden_layers"] == a.num_hidden_layers
    # one read per expert: every slab is one aligned run of slot_bytes
    lay = slab_layout("int8", a.hidden_size, a.moe_intermediate_size)
    assert all(e["length"] == lay["slot_bytes"] and e["offset"] % 4096 == 0 for row in m["experts"] for e in row)
    dense = load_file(str(store / "dense.safetensors"))
    for i in range(a.num_hidden_layers):
        if i in a.moe_layers:
            assert f"layers.{i}.router" in dense
            assert (f"layers.{i}.mlp.gate_proj.w" in dense) == (name in DENSE_BESIDE_EXPERTS)
            assert (f"layers.{i}.shared_expert.up_proj.w" in dense) == (a.shared_expert_intermediate_size > 0)
        else:  # dense layers are resident and have no router
            assert f"layers.{i}.mlp.down_proj.w" in dense and f"layers.{i}.router" not in dense


def test_mixtral_experts_are_w1_gate_w3_up_w2_down(family_stores):
    ck, _ = family_stores["mixtral"]
    store = convert_checkpoint(ck, ck.with_name("mixtral-f32"), quant="f32")
    w = load_file(str(ck / "model.safetensors"))
    with ExpertStore(store, o_direct=False) as st:
        buf = st.new_buffer()
        st.read(1, 3, buf)
        v = st.views(buf)
        p = "model.layers.1.block_sparse_moe.experts.3."
        for ours, hf in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            np.testing.assert_array_equal(v[ours + ".w"], w[p + hf + ".weight"].astype(np.float32))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_expert_tensors_convert_like_per_expert(family_stores, tmp_path, name):
    """transformers 5 holds experts as 3-D gate_up_proj [E, 2I, D] / down_proj [E, D, I]; a
    checkpoint written that way converts to the same store as the per-expert one."""
    ck, _ = family_stores[name]
    a = ModelArgs.from_hf_config(ck)
    fam = family_for(a.model_type)
    w = load_file(str(ck / "model.safetensors"))
    fused = {}
    for k, v in w.items():
        if ".experts." not in k:
            fused[k] = v
    for i in a.moe_layers:
        en = fam.expert_names(a, i)
        pre = f"model.layers.{i}.mlp.experts."
        fused[pre + "gate_up_proj"] = np.stack([np.concatenate([w[en.name(e, "gate_proj")], w[en.name(e, "up_proj")]])
                                                for e in range(a.num_experts)])
        fused[pre + "down_proj"] = np.stack([w[en.name(e, "down_proj")] for e in range(a.num_experts)])
    d = tmp_path / "fused"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((ck / f).read_bytes())
    save_file(fused, str(d / "model.safetensors"))
    s1 = convert_checkpoint(ck, tmp_path / "per-expert", quant="int4")
    s2 = convert_checkpoint(d, tmp_path / "fused-store", quant="int4")
    for j in range(a.num_moe_layers):
        f = f"experts/layer_{j:03d}.bin"
        assert (s1 / f).read_bytes() == (s2 / f).read_bytes()


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_store_from_seed_equals_converted_checkpoint(tmp_path, model_type, quant):
    cfg = CONFIGS[model_type](num_hidden_layers=2, **({"mlp_only_layers": [0]} if "qwen" in model_type else {}))
    ck = write_checkpoint(tmp_path / "ck", cfg, seed=4, tokenizer=False)
    s1 = convert_checkpoint(ck, tmp_path / "converted", quant=quant)
    s2 = write_store_from_seed(tmp_path / "seeded", cfg, quant=quant, seed=4)
    d1, d2 = load_file(str(s1 / "dense.safetensors")), load_file(str(s2 / "dense.safetensors"))
    assert d1.keys() == d2.keys() and all(np.array_equal(d1[k], d2[k]) for k in d1)
    m1, m2 = (json.loads((s / "manifest.json").read_text()) for s in (s1, s2))
    assert m1["experts"] == m2["experts"]  # offsets, lengths and crc32 of every slab
    assert m2["model_type"] == model_type and m2["source"].startswith("synthetic seed 4")
    assert (s2 / "tokenizer.json").exists() and not (tmp_path / "seeded.files").exists()
    with ExpertStore(s2, o_direct=False) as st:
        assert st.args.model_type == model_type


def test_presets_have_the_published_shapes():
    q = ModelArgs.from_dict(PRESETS["qwen3-30b-a3b"])
    assert (q.model_type, q.num_hidden_layers, q.num_moe_layers, q.num_experts, q.num_experts_per_tok) == \
        ("qwen3_moe", 48, 48, 128, 8)
    assert (q.hidden_size, q.moe_intermediate_size, q.num_attention_heads, q.num_key_value_heads,
            q.head_dim, q.vocab_size, q.qk_norm, q.norm_topk_prob) == (2048, 768, 32, 4, 128, 151936, "head", True)
    slot = slab_layout("int8", q.hidden_size, q.moe_intermediate_size)["slot_bytes"]
    assert 29e9 < slot * 48 * 128 < 31e9  # the routed experts alone exceed this machine's 24 GiB
    m = ModelArgs.from_dict(PRESETS["mixtral-8x7b"])
    assert (m.model_type, m.num_hidden_layers, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.hidden_size, m.num_key_value_heads, m.head_dim) == ("mixtral", 32, 8, 2, 14336, 4096, 8, 128)


def test_gemma4_preset_has_the_published_size():
    """Gemma 4 26B-A4B's text tower: 25.2 B parameters, 3.8 B of them active a token, as Google gives them."""
    g = ModelArgs.from_dict(PRESETS["gemma-4-26b-a4b"])
    assert (g.model_type, g.num_hidden_layers, g.num_moe_layers, g.num_experts, g.num_experts_per_tok,
            g.moe_intermediate_size, g.hidden_size) == ("gemma4_text", 30, 30, 128, 8, 704, 2816)
    experts = g.num_moe_layers * g.num_experts * 3 * g.hidden_size * g.moe_intermediate_size
    assert 25.1e9 < g.dense_param_count() + experts < 25.3e9
    assert 3.75e9 < g.dense_param_count() + experts * 8 / 128 < 3.85e9


def test_transformers5_qwen3_config_names(tmp_path):
    """transformers 5's save_pretrained writes Qwen3's expert count as num_local_experts."""
    cfg = qwen3_moe_config()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert ModelArgs.from_dict(cfg).num_experts == 8
    cfg = qwen3_moe_config(rope_parameters=None, rope_theta=5000.0)
    assert ModelArgs.from_dict(cfg).rope_theta == 5000.0


def test_unsupported_model_type_is_one_line_naming_the_families():
    with pytest.raises(ConfigError) as ei:
        ModelArgs.from_dict({"model_type": "llama"}, "x/config.json")
    msg = str(ei.value)
    assert "\n" not in msg and "x/config.json" in msg and "'llama'" in msg
    for t in ("olmoe", "qwen3_moe", "mixtral", "qwen2_moe"):
        assert t in msg


def test_gguf_only_folder_gets_a_clear_message(tmp_path):
    (tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for call in (lambda: ModelArgs.from_hf_config(tmp_path), lambda: convert_checkpoint(tmp_path, tmp_path / "out")):
        with pytest.raises(ConfigError) as ei:
            call()
        msg = str(ei.value)
        assert "colibri convert" in msg and "safetensors" in msg and "\n" not in msg
    # config.json next to the GGUF but no safetensors: the same advice
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe_config()))
    with pytest.raises(ConfigError, match="import a GGUF with `colibri convert"):
        convert_checkpoint(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("make,key", [
    (qwen3_moe_config, "moe_intermediate_size"), (qwen2_moe_config, "shared_expert_intermediate_size"),
    (mixtral_config, "num_local_experts"), (olmoe_config, "intermediate_size")])
def test_missing_key_names_file_and_key(make, key):
    cfg = make()
    del cfg[key]
    with pytest.raises(ConfigError) as ei:
        ModelArgs.from_dict(cfg, "m/config.json")
    assert "m/config.json" in str(ei.value) and f"'{key}'" in str(ei.value)


def test_dense_layers_need_intermediate_size_and_valid_layer_lists():
    cfg = qwen3_moe_config(mlp_only_layers=[0])
    del cfg["intermediate_size"]
    with pytest.raises(ConfigError, match="'intermediate_size'"):
        ModelArgs.from_dict(cfg)
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelArgs.from_dict(qwen3_moe_config(mlp_only_layers=[7]))
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelArgs.from_dict(qwen2_moe_config(use_sliding_window=True, sliding_window=None))
    a = ModelArgs.from_dict(qwen2_moe_config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                                             max_window_layers=3))
    assert a.layer_windows == (16, 0, 16, 0)  # transformers 5: even layers below max_window_layers


def test_store_from_before_families_still_opens(tiny_store, tmp_path):
    """Stores converted before manifests recorded moe_layers (every layer was MoE) still open."""
    import shutil
    s = shutil.copytree(tiny_store, tmp_path / "old")
    m = json.loads((s / "manifest.json").read_text())
    for k in ("moe_layers", "num_hidden_layers"):
        m.pop(k)
    (s / "manifest.json").write_text(json.dumps(m))
    with ExpertStore(s, o_direct=False) as st:
        assert st.args.num_moe_layers == m["num_layers"]


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_size_functions_match_the_store(family_stores, name):
    from engine.models import dense_bytes, expert_slot_bytes
    _, store = family_stores[name]
    m = json.loads((store / "manifest.json").read_text())
    a = ModelArgs.from_hf_config(store)
    assert dense_bytes(a, "int8") == m["dense_bytes"]
    assert expert_slot_bytes(a, "int8") == m["slab_layout"]["slot_bytes"]
    # a tied lm_head is stored beside the embedding (its own quantization) but is no parameter of its own
    assert a.dense_param_count() == sum(int(np.prod(v.shape)) for k, v in
                                        load_file(str(store / "dense.safetensors")).items()
                                        if not k.endswith(".s") and not (a.tie_word_embeddings and k.startswith("lm_head")))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_trace_and_heat_use_moe_layer_rows(family_stores, tmp_path, name):
    """Families with dense layers: traces, heat and pins have one row per MoE layer, and the
    replay of a trace reproduces the engine's hit/miss counts exactly."""
    from engine.trace import TraceRecorder, load_trace, replay_policy
    _, store = family_stores[name]
    a = ModelArgs.from_hf_config(store)
    assert a.num_moe_layers < a.num_hidden_layers
    stream = np.random.default_rng(8).integers(10, 290, 50).tolist()
    req = GenerateRequest(prompt_ids=tuple(stream[:10]), forced_ids=tuple(stream[10:]),
                          sampling=SamplingParams(max_new_tokens=40))
    cfg = EngineConfig(store=str(store), cap=3, policy="ema", pinning=True, pin_per_layer=1, pilot=0,
                       history=True, o_direct=False, idle_fill=False)
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng)
        list(eng.generate(req))
        counts = (eng.cache.stats.hits, eng.cache.stats.misses, eng.cache.stats.pinned_hits)
        assert eng.heat.counts.shape == (a.num_moe_layers, a.num_experts)
        assert eng.loaded.num_layers == a.num_moe_layers
        rec.save(tmp_path / "t.jsonl")
    head, recs = load_trace(tmp_path / "t.jsonl")
    assert head["num_layers"] == a.num_moe_layers
    assert {r["l"] for r in recs if "l" in r} == set(range(a.num_moe_layers))
    r = replay_policy(head, recs, 3, "ema", True)
    assert (r["hits"], r["misses"], r["pinned_hits"]) == counts
    heat = json.loads((store / "routing_heat.json").read_text())
    assert heat["num_layers"] == a.num_moe_layers
    with Engine.open(cfg) as eng:  # the saved heat loads back and pre-warms the pins
        assert eng.heat.tokens > 0 and eng.loaded.prewarmed_experts > 0


# --- routing identical across placement, RSS guard firing included ----------------------
#
# The Qwen3-30B-A3B-shaped benchmark once reported 1344 distinct experts for one int8 cell where
# the other cells of the same store and forced stream reported 1057. The id hashes of a forced
# stream agree trivially (the ids are forced), so they could not tell; this test compares what
# actually depends on the values: every MoE call's top-k ids, in order (the bench's routing
# digest, engine.bench.arm.TouchedExperts), at the path the big cells take: a store written from
# the seed with expert codes drawn directly, O_DIRECT reads, 128 experts top-8 (a prefill call
# routes to more experts than the cap, so experts are evicted inside one call), and the RSS guard
# lowering the cap during the prefill and between tokens.

def _routing_run(store, read_rss=None, **kw):
    from engine.bench.arm import TouchedExperts
    from engine.bench.common import forced_stream
    cfg = EngineConfig(store=str(store), history=False, pinning=False, o_direct=True, context_length=64, **kw)
    opened = Engine.open(cfg) if read_rss is None else Engine.open(cfg, read_rss=read_rss)
    with opened as eng:
        if read_rss is not None:
            read_rss.eng = eng
        touched = TouchedExperts(eng.args.num_moe_layers, eng.args.num_experts)
        eng.subscribe(touched)
        s = forced_stream(eng.args.vocab_size, 24, 0)
        req = GenerateRequest(prompt_ids=tuple(s[:8]), forced_ids=tuple(s[8:]),
                              sampling=SamplingParams(max_new_tokens=16))
        fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
        assert fin.error == "", fin.error
        logits = eng.model.forward(np.asarray(s[-1:]), len(s) - 1)  # one more step: the values
        return dict(ids=fin.token_ids, routing=touched.digest(), mask=touched.mask.copy(),
                    logits=logits, fired=eng.guard.fired, evictions=eng.cache.stats.evictions,
                    final_cap=eng.cache.cap)


class _GuardRss:
    """RSS seen by the guard: the cache's bytes + a fixed base, over the budget on every 5th
    look from the 10th on (so the guard fires in the prefill's layer-start polls and later)."""

    def __init__(self, budget_gb):
        self.budget = int(budget_gb * 1e9)
        self.n = 0
        self.eng = None

    def __call__(self):
        base = int(0.3e9) + (self.eng.cache.resident_bytes() if self.eng is not None else 0)
        if threading.current_thread().name.startswith(("colibri-populate", "colibri-fill")):
            return base  # the cache's background growth asking (grow_ok): not the guard's looks
        self.n += 1
        if self.eng is not None and self.n >= 10 and self.n % 5 == 0:
            return self.budget + 1
        return base


@pytest.fixture(scope="module")
def routed_store(tmp_path_factory):
    cfg = qwen3_moe_config(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_experts=128,
                           num_experts_per_tok=8, vocab_size=300)
    return write_store_from_seed(tmp_path_factory.mktemp("routed") / "int8", cfg, quant="int8", seed=0,
                                 expert_draw="codes")


def test_routing_identical_across_cap_guard_pilot_threads(routed_store):
    ref = _routing_run(routed_store, cap=128, pilot=0)
    assert ref["evictions"] == 0 and ref["mask"].sum(axis=1).max() > 24  # prefill: > cap 24 below
    runs = {
        "cap 9": _routing_run(routed_store, cap=9, pilot=0, reserve_cache=True),
        "cap 24 lfru": _routing_run(routed_store, cap=24, pilot=0, policy="lfru", idle_fill=True),
        "guard from cap 24": _routing_run(routed_store, _GuardRss(1.0), ram_budget_gb=1.0, cap=24, pilot=0),
        "guard + PILOT 2 workers, 1 thread": _routing_run(routed_store, _GuardRss(1.0), ram_budget_gb=1.0,
                                                           cap=24, pilot=2, pilot_workers=2, threads=1),
    }
    for name, r in runs.items():
        assert r["evictions"] > 0, name  # the path with evictions inside one MoE call
        if name.startswith("guard"):
            assert r["fired"] >= 2 and r["final_cap"] < 24, (name, r["fired"], r["final_cap"])
        assert r["ids"] == ref["ids"], name
        assert r["routing"] == ref["routing"], name
        assert (r["mask"] == ref["mask"]).all(), name
        assert np.array_equal(r["logits"], ref["logits"]), name


def test_rope_scaling_beside_rope_parameters_is_not_ignored():
    """A legacy rope_scaling next to a default rope_parameters is read (YaRN) or refused (linear),
    never dropped; two different scaling types are refused."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    a = ModelArgs.from_dict(deepseek_v3_config(rope_scaling=yarn))
    assert dict(a.rope_scaling)["factor"] == 4.0
    with pytest.raises(ConfigError, match="rope_type 'linear'"):
        ModelArgs.from_dict(glm4_moe_config(rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ConfigError, match="keep one"):
        ModelArgs.from_dict(deepseek_v3_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                                               rope_scaling={"type": "linear", "factor": 2.0}))


@pytest.mark.parametrize("gs", [0, -4, 7, 5000])
def test_bad_group_size_is_one_clear_error(tmp_path, gs):
    from engine.cli.main import main
    ck = write_checkpoint(tmp_path / "ck", glm4_moe_config(num_hidden_layers=2), seed=1, tokenizer=False)
    assert main(["convert", str(ck), str(tmp_path / "out"), "--quant", "int4", "--group-size", str(gs)]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,n_index", [("deepseek_v32", 3), ("glm_moe_dsa", 2)])
def test_info_counts_the_indexer_keys_in_the_kv_cache(family_stores, name, n_index):
    """Sparse attention: ``colibri info`` names the indexer and counts its keys (index_head_dim
    values on each layer that runs one) next to the latent in the KV bytes per token."""
    from engine.cli.run import describe_store
    from engine.sizing import kv_bytes
    _, store = family_stores[name]
    a = ModelArgs.from_hf_config(store)
    assert a.indexer_layers == tuple(range(3))[:n_index] and a.index_topk == 8
    per_token = 3 * (32 + 8) + n_index * 16
    assert a.kv_values_all_layers == per_token and kv_bytes(a, 10) == 10 * per_token * 2
    text = describe_store(str(store))
    assert f"40 values per token and layer + 16 indexer-key values on the {n_index} layers with an indexer" in text
    assert f"({per_token * 4} B per token of context at f32" in text.replace(".0 B", " B")
    assert "index_topk 8 past tokens" in text
    assert ("1 of 3 layers reuse the previous layer's choice" in text) == (name == "glm_moe_dsa")


def _n(n: int, kind: str) -> str:
    return f"{n} {kind} layer" + ("" if n == 1 else "s")


def _listed(idx) -> str:
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(map(str, idx))


@pytest.mark.parametrize("name", [n for n in FAMILY_CONFIGS if n != "deepseek_v4"])  # its own test below
def test_info_describes_every_layer_as_its_config_says(family_stores, name):
    """``colibri info`` against config.json as transformers reads it: the sliding-window,
    chunked and full-attention layers (window, chunk, which layers), NoPE layers, the dense
    layers' MLP width, shared experts, and the per-kind heads and head sizes of Gemma 4."""
    import transformers
    from engine.cli.run import describe_store
    ck, store = family_stores[name]
    c = transformers.AutoConfig.from_pretrained(ck).get_text_config()
    L, text = c.num_hidden_layers, describe_store(str(store))
    types = getattr(c, "layer_types", None)
    if types is None:  # one window for every layer (Mixtral, Qwen3-MoE with use_sliding_window)
        slides = getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True)
        types = ["sliding_attention" if slides else "full_attention"] * L
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    chunked = [i for i, t in enumerate(types) if t == "chunked_attention"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if sliding and len(sliding) == L:
        assert f"every layer attends a sliding window of {c.sliding_window} tokens" in text
    elif sliding:
        assert f"{_n(len(sliding), 'sliding-window')} (window {c.sliding_window} tokens" in text
        assert _listed(sliding) in text and _n(len(full), "full-attention") in text
        assert _listed(full) in text
    else:
        assert "sliding" not in text
    if chunked:
        assert f"{_n(len(chunked), 'chunked-attention RoPE')} (each query sees its own chunk of " \
               f"{c.attention_chunk_size} tokens" in text
    recurrent = [t for t in types if t in ("conv", "linear_attention")]
    if recurrent:  # each hybrid's own kind of recurrent layer carries the state
        kind = {"lfm2_moe": "gated short-convolution", "granitemoehybrid": "Mamba2"}.get(c.model_type, "linear-attention")
        assert f"recurrent state of the {_n(len(recurrent), kind)} " in text
    nope = [i for i, r in enumerate(getattr(c, "no_rope_layers", None) or []) if not r]
    if nope:
        assert f"{_n(len(nope), 'NoPE')} (causal over all tokens" in text and f"{_listed(nope)})" in text
    moe = getattr(c, "moe_layers", None)
    if moe is not None:  # Llama 4: the others are dense, of width intermediate_size_mlp
        dense = [i for i in range(L) if i not in moe]
        assert f"dense MLP (layers {', '.join(map(str, dense))}, resident, width {c.intermediate_size_mlp})" in text
        assert f"one shared expert per MoE layer, width {c.intermediate_size} " in text
    elif "dense MLP" in text:
        assert f"resident, width {c.intermediate_size})" in text
    if c.model_type == "gemma4_text":  # heads and head size per layer, as transformers holds them
        def shape(i):
            layer = c.per_layer_config[i]
            return layer.num_key_value_heads, layer.head_dim
        (skv, sd), (fkv, fd) = shape(sliding[0]), shape(full[0])
        assert {shape(i) for i in sliding} == {(skv, sd)} and {shape(i) for i in full} == {(fkv, fd)}
        assert f"(window {c.sliding_window} tokens: KV heads {skv}, head size {sd}" in text
        assert f"{_n(len(full), 'full-attention')} (KV heads {fkv}, head size {fd}" in text
        assert ("K = V" in text) == bool(c.attention_k_eq_v)
        assert f"soft-capped at {c.final_logit_softcapping:g}" in text
        assert f"dense GeGLU MLP of width {c.intermediate_size} runs beside the experts in every layer" in text
        assert (f"{2 * skv * sd} values per token on each sliding-window layer ({len(sliding)} of them), "
                f"{2 * fkv * fd} values per token on each full-attention layer ({len(full)} of them)") in text


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("name,per_token", [
    ("gemma4", 64 + 128 + 128),  # a sliding layer (2 KV heads of 16) + two full ones (2 of 32)
    ("lfm2_moe", 64),  # the one attention layer; the conv layers' state apart, any context
    ("granitemoehybrid", 64),  # the one attention layer; the Mamba2 layers' state apart
    ("kimi_linear", 32 + 16),  # the one latent-attention layer (kv_lora_rank + qk_rope_head_dim)
    # a sliding key row of 32 per layer; the compressor inputs (CSA: kv and gate of 2 x 32 and the
    # indexer's 2 x 16; HCA: 32 and 32) and 1 / m of an entry (CSA: (32 + 16) / 4, HCA: 32 / 8)
    ("deepseek_v4", 4 * 32 + 2 * (192 + 12) + (64 + 4)),
    ("llama4", 4 * 64), ("ernie4_5_moe", 3 * 64)])
def test_kv_cache_bytes_are_what_sizing_plans(family_stores, name, per_token, kv_dtype):
    """The KV cache a model allocates is the one sizing plans (Engine.open's budget): per layer
    of its own shape (Gemma 4), only the attention layers plus the recurrent state (LFM2, Granite)."""
    from engine.sizing import kv_bytes
    _, store = family_stores[name]
    a = ModelArgs.from_hf_config(store)
    assert a.kv_values_all_layers == per_token
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, context_length=96, kv_dtype=kv_dtype)
    with Engine.open(cfg) as eng:
        assert eng.model.kv_bytes == kv_bytes(a, 96, kv_dtype) == eng.plan.kv


def test_glm5_preset_sizes_its_latent_and_indexer_cache():
    """GLM-5's shape: the KV cache per token is 78 layers x (512 + 64) latent values plus 78 x 128
    indexer-key values, 109,824 bytes at f16 (the expanded heads would be 78 x 2 x 64 x 256)."""
    from engine.sizing import kv_bytes
    a = ModelArgs.from_dict(PRESETS["glm-5"])
    assert (a.model_type, a.num_hidden_layers, a.num_moe_layers, a.num_experts, a.index_topk) == \
        ("glm_moe_dsa", 78, 75, 256, 2048)
    assert a.kv_values_all_layers == 78 * (512 + 64) + 78 * 128
    assert kv_bytes(a, 1) == 109_824


def _logits_prefill_then_decode(store, steps: int = 5, **kw) -> tuple[np.ndarray, bool]:
    """Logits of a 20-token prefill (every position), ``steps`` greedy decode steps (T = 1),
    then a second 12-token prefill (its experts mostly resident by then), stacked; and whether
    any attention matrix ran interleaved."""
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, **kw)
    with Engine.open(cfg) as eng:
        m = eng.model
        out = [m.forward(np.arange(5, 25), 0, all_logits=True)]
        for s in range(steps):
            out.append(m.forward(np.array([int(np.argmax(out[-1][-1]))]), 20 + s))
        out.append(m.forward(np.arange(40, 52), 20 + steps, all_logits=True))
        il = any(getattr(ly.get(n), "il", False) for ly in m.layers for n in ("q_proj", "o_proj"))
        return np.concatenate(out), il


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_interleaved_int4_attention_is_bit_identical(family_stores, tmp_path, monkeypatch, name):
    """int4 attention matrices stored row-interleaved (K.linear_q4i / linears_q4i) give the same
    prefill and decode logits, bit for bit, as the row-major kernels, in every family."""
    import engine.models.base as base
    ck, _ = family_stores[name]
    try:
        store = convert_checkpoint(ck, tmp_path / "s", quant="int4", dense_quant="int4")
    except Exception as e:  # noqa: BLE001 - a family whose dense widths int4 cannot take
        if "multiple of the group size" in str(e):
            pytest.skip(str(e))
        raise
    got, il = _logits_prefill_then_decode(store)
    monkeypatch.setattr(base, "INTERLEAVE_Q4", False)
    ref, il_off = _logits_prefill_then_decode(store)
    assert not il_off
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    if name in ("olmoe", "qwen3_moe", "mixtral") and K_SIMD:
        assert il  # the standard attention's int4 matrices took the interleaved kernels


@pytest.mark.parametrize("name,kv_dtype,quant", [
    *[(n, kv, "int4") for n in ("olmoe", "qwen3_moe", "mixtral") for kv in ("f16", "f32")],
    ("olmoe", "f16", "int8"), ("qwen3_moe", "f32", "int8"), ("mixtral", "f16", "int8")])
def test_decode_attention_in_one_call_is_bit_identical(family_stores, tmp_path, monkeypatch, name, kv_dtype, quant):
    """K.attention_t1 (a decode step's attention block in one kernel call) gives the same logits,
    bit for bit, as the block's separate kernels, for the three q / k norm kinds (OLMoE "proj",
    Qwen3 "head", Mixtral none: without a sliding window, which keeps the separate kernels),
    both KV cache kinds and both attention weight kinds (int4 interleaved, int8); and it is the
    path those layers take."""
    import engine.models.base as base
    if not K_SIMD and quant == "int4":
        pytest.skip("the interleaved int4 kernels need the SIMD path")
    if name == "mixtral":
        ck = tmp_path / "ck"
        ck = write_checkpoint(ck, mixtral_config(num_hidden_layers=2, head_dim=32), seed=3, std=0.1)
    else:
        ck, _ = family_stores[name]
    store = convert_checkpoint(ck, tmp_path / "s", quant=quant, dense_quant=quant)
    taken = []
    real = base.MoEModel._attention_t1_args

    def spy(self, i):
        r = real(self, i)
        taken.append(r is not None)
        return r
    monkeypatch.setattr(base.MoEModel, "_attention_t1_args", spy)
    got, _ = _logits_prefill_then_decode(store, kv_dtype=kv_dtype)
    assert taken and all(taken)
    monkeypatch.setattr(base, "ATTENTION_T1", False)
    taken.clear()
    ref, _ = _logits_prefill_then_decode(store, kv_dtype=kv_dtype)
    assert taken and not any(taken)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def _decode_all_resident(store, policy: str, kv_dtype: str, steps: int = 6, observer=None):
    """With every expert resident: logits of a 20-token prefill (every position), ``steps``
    greedy decode steps and a second 12-token prefill, stacked; and the cache's bookkeeping
    after them (counters, use clock, last use, routed_now, busy counts, eviction order, the
    routing heat)."""
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, policy=policy,
                       kv_dtype=kv_dtype, pinning=False, idle_fill=False)
    with Engine.open(cfg) as eng:
        m, c = eng.model, eng.cache
        for layer in range(c.L):
            c.load_experts(layer, np.arange(c.E))
        if m._decode_plan() is not None:  # compiled in the background after open
            assert m.wait_decode_ready(900)
        if observer is not None:
            eng.subscribe(observer)
        out = [m.forward(np.arange(5, 25), 0, all_logits=True)]
        for s in range(steps):
            out.append(m.forward(np.array([int(np.argmax(out[-1][-1]))]), 20 + s))
        out.append(m.forward(np.arange(40, 52), 20 + steps, all_logits=True))
        st = c.stats.snapshot()
        state = (st, c.clock, c.last_use.copy(), c.routed_now.copy(), c.slot_busy.copy(), c.prob_ema.copy(),
                 [list(ly.lru) for ly in c.layers],
                 [{h: list(b) for h, b in sorted(ly.buckets.items())} for ly in c.layers],
                 [list(ly.staged) for ly in c.layers], eng.heat.counts.copy())
        return np.concatenate(out), state


def _same_state(a, b) -> None:
    counts = [{k: v for k, v in s[0].items() if not k.endswith("_s")} for s in (a, b)]  # not the seconds
    assert counts[0] == counts[1] and a[1] == b[1]
    for x, y in zip(a[2:], b[2:]):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("name,kv_dtype,policy,quant", [("olmoe", "f16", "lru", "int4"), ("olmoe", "f32", "ema", "int4"),
                                                        ("qwen3_moe", "f16", "lfru", "int4"),
                                                        ("mixtral", "f32", "lru", "int4"),
                                                        ("olmoe", "f16", "ema", "int8"),
                                                        ("qwen3_moe", "f32", "lru", "int8")])
def test_decode_step_in_one_call_is_bit_identical(family_stores, tmp_path, monkeypatch, name, kv_dtype, policy,
                                                  quant):
    """K.decode_layers_t1 (every layer of a decode step in one kernel call, when every expert
    is resident) gives the same logits, bit for bit, as the per-layer calls, and leaves the
    cache's bookkeeping (counters, use clock, eviction order, routing heat, EMA) as they do,
    for the three q / k norm kinds, both KV kinds, the three eviction policies, int4 and int8
    stores; it is the
    path those decode steps take, and an observer that is not token-batched (a TraceRecorder-
    like spy of on_after_attention) keeps the per-layer path, seeing every layer."""
    import engine.models.base as base
    if not K_SIMD and quant == "int4":
        pytest.skip("the interleaved int4 kernels need the SIMD path")
    if name == "mixtral":  # no sliding window (its layers keep the separate attention kernels)
        ck = write_checkpoint(tmp_path / "ck", mixtral_config(num_hidden_layers=2, head_dim=32), seed=3, std=0.1)
    elif name == "qwen3_moe":  # every layer MoE (a dense layer keeps the per-layer path)
        ck = write_checkpoint(tmp_path / "ck", qwen3_moe_config(num_hidden_layers=3, num_experts_per_tok=3),
                              seed=5, std=0.1)
    else:
        ck, _ = family_stores[name]
    store = convert_checkpoint(ck, tmp_path / "s", quant=quant, dense_quant=quant)
    calls = []
    real = base.MoEModel._decode_step_all

    def spy(self, x, pos, cancel=None):
        r = real(self, x, pos)
        if pos >= 20:  # the helper's decode steps (not the engine's warm-up step at open)
            calls.append(r)
        return r
    monkeypatch.setattr(base.MoEModel, "_decode_step_all", spy)
    got, got_state = _decode_all_resident(store, policy, kv_dtype)
    assert calls and all(calls)  # every decode step ran in one call

    class Spy:
        def __init__(self):
            self.seen = []

        def on_after_attention(self, layer, x):
            self.seen.append(layer)

    spy_obs = Spy()
    calls.clear()
    watched, watched_state = _decode_all_resident(store, policy, kv_dtype, observer=spy_obs)
    assert calls and not any(calls)
    L = ModelArgs.from_hf_config(store / "config.json").num_hidden_layers
    assert len(spy_obs.seen) == L * (2 + 6)  # both prefills and every decode step, layer by layer
    monkeypatch.setattr(base, "DECODE_T1", False)
    calls.clear()
    ref, ref_state = _decode_all_resident(store, policy, kv_dtype)
    assert calls and not any(calls)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(watched.view(np.uint32), ref.view(np.uint32))
    _same_state(got_state, ref_state)
    _same_state(watched_state, ref_state)


def _expert_order(c) -> list:
    """Each layer's eviction order as expert ids (LRU order, or LFRU buckets in order) and its
    resident experts, sorted: what the policy decides, whatever slot numbers the experts got
    (the engine's warm-up at open leaves the free-slot stack in an order that depends on
    whether the one-call decode step had compiled by then)."""
    out = []
    for layer, ly in enumerate(c.layers):
        order = list(ly.lru) if c.policy != "lfru" else [s for b in ly.buckets.values() for s in b]
        out.append(([int(c.slot_expert[layer, s]) for s in order],
                    sorted(int(e) for e in c.slot_expert[layer] if e >= 0)))
    return out


def _cache_consistent(c) -> list:
    """Broken invariants of ExpertCache's bookkeeping: a slot in a layer's eviction order that is
    not resident or is pinned, a free slot in it, a live count that is not the slots in use."""
    bad = []
    for layer, ly in enumerate(c.layers):
        order = list(ly.lru) if c.policy != "lfru" else [s for b in ly.buckets.values() for s in b]
        for s in order:
            e = c.slot_expert[layer, s]
            if c.slot_state[layer, s] != c.RESIDENT_STATE or e < 0 or c.pinned[layer, e]:
                bad.append((layer, int(s)))
        if set(order) & set(ly.free):
            bad.append(("free slot in the order", layer))
        if int((c.slot_state[layer] != 0).sum()) != ly.live:
            bad.append(("live", layer))
    return bad


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_decode_step_in_one_call_with_the_cap_lowered_around_it(family_stores, tmp_path, policy):
    """The RSS guard polls at the step's start (token-batched on_layer_start, before any take):
    when it lowers the cap there, the step takes the per-layer path, with the logits and cache
    state of a run that never had the one-call path. A cap lowered by another thread between
    the kernel and the cache's bookkeeping (the app's setting) leaves a consistent cache: the
    evicted slots are counted as the hits they were and stay out of the eviction order."""
    if not K_SIMD:
        pytest.skip("the interleaved int4 kernels need the SIMD path")
    import engine.models.base as base
    ck, _ = family_stores["olmoe"]
    store = convert_checkpoint(ck, tmp_path / "s", quant="int4", dense_quant="int4")
    res = {}
    for one_call in (True, False):
        base.DECODE_T1 = one_call
        try:
            with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0,
                                          pinning=False, policy=policy, idle_fill=False)) as eng:
                m, c = eng.model, eng.cache
                for layer in range(c.L):
                    c.load_experts(layer, np.arange(c.E))
                assert not one_call or m.wait_decode_ready(900)
                out = [m.forward(np.arange(5, 25), 0)]
                eng.guard.step(0)
                eng.guard._loads_seen = -1  # loads it has not looked at (a generation cut inside forward)
                shots = [eng.guard.budget + 3 * c.slot_bytes * c.L]  # over the budget once
                eng.guard.read_rss = lambda: shots.pop() if shots else 0
                out.append(m.forward(np.array([7]), 20))
                assert not shots and c.cap < c.E  # the guard fired at the step's start
                for p in range(21, 40):
                    out.append(m.forward(np.array([(p * 7) % 200 + 1]), p))
                assert _cache_consistent(c) == []
                st = {k: v for k, v in c.stats.snapshot().items() if not k.endswith("_s")}
                res[one_call] = (np.concatenate(out), st, c.cap, _expert_order(c))
        finally:
            base.DECODE_T1 = True
    assert np.array_equal(res[True][0].view(np.uint32), res[False][0].view(np.uint32))
    assert res[True][1:] == res[False][1:]

    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, pinning=False,
                                  policy=policy)) as eng:
        m, c = eng.model, eng.cache
        for layer in range(c.L):
            c.load_experts(layer, np.arange(c.E))
        assert m.wait_decode_ready(900)
        m.forward(np.arange(5, 25), 0)
        real = c.take_resident_layers

        def lowered_meanwhile(run, l0=0, after_run=None):
            def after(stop):
                if after_run is not None:
                    after_run(stop)
                c.set_cap(2)  # another thread, between the two holds of the lock
            return real(run, l0, after)
        c.take_resident_layers = lowered_meanwhile
        hits0 = c.stats.hits
        assert m._decode_step_all(np.zeros((1, m.args.hidden_size), np.float32), 20)
        assert c.stats.hits - hits0 == m.args.num_experts_per_tok * c.L  # every take counted
        assert _cache_consistent(c) == []
        assert all(ly.live <= 2 for ly in c.layers)


def _decode_streaming(store, policy: str, cap: int, steps: int = 24):
    """Decode with ``cap`` slots per layer (fewer than the experts: misses are read mid-step):
    the logits of a 20-token prefill and ``steps`` greedy decode steps, and the cache's
    bookkeeping after them (as _decode_all_resident, plus which expert each slot holds)."""
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, policy=policy, cap=cap,
                       pinning=False, checksum="always", idle_fill=False)
    with Engine.open(cfg) as eng:
        m, c = eng.model, eng.cache
        if m._decode_plan() is not None:
            assert m.wait_decode_ready(900)
        out = [m.forward(np.arange(5, 25), 0)]
        for s in range(steps):
            out.append(m.forward(np.array([int(np.argmax(out[-1][-1]))]), 20 + s))
        st = c.stats.snapshot()
        state = (st, c.clock, c.last_use.copy(), c.routed_now.copy(), c.prob_ema.copy(), _expert_order(c),
                 [sorted(int(c.slot_expert[layer, s]) for s in ly.staged) for layer, ly in enumerate(c.layers)],
                 eng.heat.counts.copy())
        return np.concatenate(out), state


@pytest.mark.parametrize("policy,quant", [("lru", "int4"), ("lfru", "int8"), ("ema", "int4")])
def test_streaming_decode_runs_resident_layers_in_one_call(family_stores, tmp_path, monkeypatch, policy, quant):
    """With fewer slots than experts a decode step runs each run of layers whose experts are
    resident in one K.decode_layers_t1 call and the layer that stops it (an expert missing:
    read, waited for) the per-layer way: logits bit-identical to the per-layer path, the
    cache's bookkeeping (counters, clock, eviction order, which expert each slot holds,
    routing heat, EMA) the same; and the kernel really ran both whole and partial runs. A
    replaced router (RecordedRouting) keeps the per-layer path."""
    if not K_SIMD and quant == "int4":
        pytest.skip("the interleaved int4 kernels need the SIMD path")
    import engine.models.base as base
    from engine.expert_cache import ExpertCache
    ck, _ = family_stores["olmoe"]
    store = convert_checkpoint(ck, tmp_path / "s", quant=quant, dense_quant=quant)
    a = ModelArgs.from_hf_config(store / "config.json")
    stops = []
    real = ExpertCache.take_resident_layers

    def spy(self, run, l0=0, after_run=None):
        stop = real(self, run, l0, after_run)
        stops.append((l0, stop))
        return stop
    monkeypatch.setattr(ExpertCache, "take_resident_layers", spy)
    cap = max(1, a.num_experts // 3)
    got, got_state = _decode_streaming(store, policy, cap)
    L = a.num_hidden_layers
    assert any(stop == L for _, stop in stops) and any(0 <= stop < L for _, stop in stops)
    assert any(l0 > 0 for l0, _ in stops)  # a run resumed after a layer that read its misses
    stops.clear()
    monkeypatch.setattr(base, "DECODE_T1", False)
    ref, ref_state = _decode_streaming(store, policy, cap)
    assert not stops
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    _same_state(got_state, ref_state)
    monkeypatch.setattr(base, "DECODE_T1", True)
    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, cap=cap,
                                  pinning=False)) as eng:
        eng.model.router_logits = eng.model.router_logits  # an instance attribute, as RecordedRouting sets
        assert not base.MoEModel._decode_step_all(eng.model, np.zeros((1, a.hidden_size), np.float32), 0)


def test_streaming_decode_step_polls_cancel_before_a_waiting_layer(family_stores, tmp_path):
    """The one-call decode step of a streaming step checks ``cancel`` before a layer that
    waits for its experts, as the per-layer path checks between layers."""
    if not K_SIMD:
        pytest.skip("the interleaved int4 kernels need the SIMD path")
    from engine.errors import Cancelled
    ck, _ = family_stores["olmoe"]
    store = convert_checkpoint(ck, tmp_path / "s", quant="int4", dense_quant="int4")
    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, cap=1,
                                  pinning=False)) as eng:
        m = eng.model
        assert m.wait_decode_ready(900)
        m.forward(np.arange(5, 25), 0)
        ev = threading.Event()
        ev.set()
        with pytest.raises(Cancelled):
            m.forward(np.array([7]), 20, cancel=ev)


def _wide_experts(cfg: dict, width: int = 128) -> dict:
    """``cfg`` with expert (and dense MLP) widths of ``width`` columns, so int4 expert slabs can
    be stored interleaved (engine.quant.int4_interleavable: multiples of 64), with down_proj
    rows of two 64-column pairs (with one pair, interleaving by 4 rows moves no byte)."""
    cfg = json.loads(json.dumps(cfg))
    for c in (cfg, cfg.get("text_config") or {}):
        for k in ("moe_intermediate_size", "intermediate_size"):
            if k in c:
                c[k] = width
    return cfg


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_interleaved_int4_experts_are_bit_identical(tmp_path, monkeypatch, name):
    """A store whose int4 expert slabs are interleaved (store format 4, --expert-layout
    interleaved_4) gives the same prefill and decode logits, bit for bit, as the row-major
    store of the same checkpoint, in every family: with every expert resident (the arena
    kernels experts_q4_t1 / experts_q4_sorted), with 2 slots per layer (misses through
    run_expert's expert_q4i), and on a CPU without the interleaved kernels (de-interleaved
    copies run the row-major kernels)."""
    import engine.models.base as base
    from engine.quant import int4_interleavable
    cfg = _wide_experts(FAMILY_CONFIGS[name])
    a = ModelArgs.from_dict(cfg)
    assert int4_interleavable(a.hidden_size, a.moe_intermediate_size, 32)
    ck = write_checkpoint(tmp_path / "ck", cfg, seed=7)
    rm = convert_checkpoint(ck, tmp_path / "rm", quant="int4", expert_layout="row_major")
    il = convert_checkpoint(ck, tmp_path / "il", quant="int4", expert_layout="interleaved_4")
    assert ExpertStore(rm, o_direct=False).expert_layout == "row_major"
    st = ExpertStore(il, o_direct=False)
    assert st.expert_layout == "interleaved_4"
    assert [f[3] for f in st.layout["fields"] if f[0] == "down_proj.w"] == [[a.hidden_size // 4, 2, 128]]
    ref, _ = _logits_prefill_then_decode(rm)
    for kw in ({}, {"cap": 2}):
        got, _ = _logits_prefill_then_decode(il, **kw)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), kw
    monkeypatch.setattr(base.K, "q4_interleaved_ok", lambda gs: False)
    got, _ = _logits_prefill_then_decode(il, cap=2)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_expert_layout_choice_is_checked_before_writing(family_stores, tmp_path):
    """--expert-layout interleaved_4 on widths it cannot take, or on int8, is a clear error and
    writes nothing; auto picks interleaved_4 only where it fits (and this CPU runs it)."""
    from engine.convert import expert_layout_for
    ck, _ = family_stores["olmoe"]  # expert width 32: not a multiple of 64
    for quant in ("int4", "int8"):
        with pytest.raises(ValueError, match="interleaved_4 needs int4 experts"):
            convert_checkpoint(ck, tmp_path / quant, quant=quant, expert_layout="interleaved_4")
        assert not (tmp_path / quant).exists()
    with pytest.raises(ValueError, match="expert layout 'il': choose one of auto, row_major, interleaved_4"):
        expert_layout_for("int4", 128, 64, 32, "il")
    assert expert_layout_for("int4", 128, 96, 32) == "row_major"
    assert expert_layout_for("int8", 128, 64, 32) == "row_major"
    assert expert_layout_for("int4", 128, 64, 32) == ("interleaved_4" if K_SIMD else "row_major")
    s = convert_checkpoint(ck, tmp_path / "auto", quant="int4")
    assert json.loads((s / "manifest.json").read_text())["expert_layout"] == "row_major"


def test_embedding_rows_of_recent_ids_are_not_read_again(family_stores, tmp_path):
    """A decode step embeds one token a step: the rows of ids embedded lately are kept, so
    embedding them again reads nothing from the dense file, with the same bytes; an id not
    seen before is read."""
    ck, _ = family_stores["olmoe"]
    store = convert_checkpoint(ck, tmp_path / "s", quant="int4", dense_quant="int4")
    with ExpertStore(store, o_direct=False) as st:
        rows = st.embedding_rows()
        reads = []
        real = rows._read

        def counted(fd, bufs, off):
            reads.append(off)
            return real(fd, bufs, off)
        rows._read = counted
        ids = np.array([7, 3, 7], np.int64)
        local, w, s = rows.rows(ids)
        n = len(reads)
        assert n == 2 * len(rows.parts)  # ids 3 and 7, each part's row
        local2, w2, s2 = rows.rows(ids[::-1])
        assert len(reads) == n
        assert w2[local2].tobytes() == w[local][::-1].tobytes()
        assert s2[local2].tobytes() == s[local][::-1].tobytes()
        rows.rows(np.array([5]))
        assert len(reads) == n + len(rows.parts)


@pytest.mark.parametrize("quant,dense_quant", [("int8", None), ("int4", "int4"), ("f16", None), ("f32", None)])
def test_embedding_rows_come_from_the_store_bit_identical(family_stores, tmp_path, quant, dense_quant):
    """The engine leaves the token-embedding table in the store and reads the rows a forward
    needs (ExpertStore.embedding_rows): the same rows as the table loaded whole, bit for bit,
    for every dense quantization (int8, int4, f16, f32), repeated and unsorted ids; Engine.open
    keeps it out of RAM (the loaded dense bytes lack it); an id outside the vocabulary and a
    truncated dense file are named errors, not a crash."""
    from engine.errors import StoreError
    from engine.expert_store import EMBED_TENSORS
    from engine.models import embedding_bytes
    ck, _ = family_stores["olmoe"]
    kw = {"dense_quant": dense_quant} if dense_quant else {}
    store = convert_checkpoint(ck, tmp_path / "s", quant=quant, **kw)
    ids = np.array([7, 3, 7, 0, 41, 3], np.int64)
    with ExpertStore(store, o_direct=False) as st:
        whole = st.load_dense()
        rows = st.embedding_rows()
        a = st.args
        assert rows.num_rows == a.vocab_size and rows.nbytes == embedding_bytes(a, quant, st.group_size, st.dense_quant)
        local, w, s = rows.rows(ids)
        assert np.array_equal(w[local].view(np.uint8), whole["embed_tokens.w"][ids].view(np.uint8))
        if "embed_tokens.s" in whole:
            assert np.array_equal(s[local].view(np.uint8), whole["embed_tokens.s"][ids].view(np.uint8))
        else:
            assert s is None
        for bad in (-1, a.vocab_size):
            with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
                rows.rows(np.array([1, bad]))
        rest = st.load_dense(exclude=EMBED_TENSORS)
        assert set(whole) - set(rest) == {n for n in EMBED_TENSORS if n in whole}
        n_open = st.open_files
        again = st.embedding_rows()  # shares the descriptor: nothing left open after close
        assert st.open_files == n_open and np.array_equal(again.rows(ids)[1], w)
    with pytest.raises(StoreError, match="the store is closed"):  # never another file's bytes
        rows.rows(ids)
    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0)) as eng:
        assert eng.model.embed_rows is not None
        assert eng.loaded.dense_bytes == sum(v.nbytes for v in rest.values())
        x = eng.model.embed(ids)
        eng.model.embed_rows = None  # the whole table in RAM: the same rows
        eng.model.embed_w, eng.model.embed_s = whole["embed_tokens.w"], whole.get("embed_tokens.s")
        assert np.array_equal(x.view(np.uint32), eng.model.embed(ids).view(np.uint32))
    # a dense file cut inside the embedding table: named, before any compute
    p = store / "dense.safetensors"
    with ExpertStore(store, o_direct=False) as st:
        rows = st.embedding_rows()
        off = max(o for _n, _d, _s, o, _r in rows.parts)
        with open(p, "r+b") as f:
            f.truncate(off + 10)
        with pytest.raises(StoreError, match="short read of row .* embed_tokens"):
            rows.rows(np.array([a.vocab_size - 1]))


def test_info_gives_deepseek_v4_kv_bytes_per_token(family_stores):
    """colibri info names DeepSeek-V4's attention kinds and gives its KV cache per token of
    context: the sliding key rows, the compressor inputs and the compressed entries."""
    from engine.cli.run import describe_store
    _, store = family_stores["deepseek_v4"]
    text = describe_store(str(store), 96)
    assert "KV cache    604 values per token over the 4 layers" in text
    assert "(2.4 kB per token of context at f32, 1.2 kB at f16)" in text
    assert "1 sliding layer (window 8), 2 compressed sparse layers (every 4 positions, the indexer keeps 3" in text
    assert "1 heavily compressed layer (every 8 positions)" in text and "3 residual streams" in text
    assert "compressed layers and their compressors: theta 160000, YaRN scaling factor 4" in text


NEW_FAMILY_FILE = '''"""OLMoE whose router logits are divided by a temperature from config.json
(``router_temperature``, 1.0 when absent): a mechanism no other family has."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import base, olmoe

MODEL_TYPE = "olmoe_tempered"
DISPLAY_NAME = "OLMoE tempered"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(olmoe.ModelArgs):
    router_temperature: float = 1.0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        t = base.num(cfg, "router_temperature", path, 1e-3, 1e3, integer=False, default=1.0)
        return replace(super().from_dict(cfg, path), router_temperature=t)


dense_tensors = olmoe.dense_tensors
expert_names = olmoe.expert_names


class Model(base.MoEModel):
    def router_logits(self, j: int, h: np.ndarray) -> np.ndarray:
        return super().router_logits(j, h) / np.float32(self.args.router_temperature)
'''

NEW_FAMILY_RUN = '''
import json, sys
from pathlib import Path
import numpy as np
import engine
from engine import convert_checkpoint, family_name, supported_families
from engine.config import EngineConfig, ModelArgs
from engine.generate import Engine
from engine.models import dense_bytes
from engine.bench.synthetic import olmoe_config, write_checkpoint

tmp = Path(sys.argv[1])
out = {"engine": engine.__file__, "name": family_name("olmoe_tempered"),
       "listed": "olmoe_tempered (OLMoE tempered)" in supported_families()}
for name, cfg in [("olmoe", olmoe_config()), ("t1", olmoe_config(model_type="olmoe_tempered")),
                  ("t05", olmoe_config(model_type="olmoe_tempered", router_temperature=0.05))]:
    ck = write_checkpoint(tmp / name / "ck", cfg, seed=3, std=0.1)  # the same weights for all three
    store = convert_checkpoint(ck, tmp / name / "int4", quant="int4")
    args = ModelArgs.from_hf_config(store)
    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, cap=2, pilot=1)) as eng:
        lg = eng.model.forward(np.arange(5, 17), 0, all_logits=True)
    manifest = json.loads((store / "manifest.json").read_text())
    out[name] = {"logits": lg.tolist(), "sized": dense_bytes(args, "int4") == manifest["dense_bytes"]}
print("RESULT " + json.dumps(out))
'''


def test_a_family_is_one_new_file_plus_its_registration(tmp_path):
    """Adding a family: a copy of the engine gets one new file, engine/models/<family>.py (a
    mechanism of its own: tempered router logits), and its import and entry in FAMILIES; with
    nothing else changed it is listed and named, converts, sizes and runs (streaming, PILOT).
    At temperature 1 its logits are OLMoE's on the same weights, bit for bit; at 0.05 the
    routing and so the logits differ (its own step ran)."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "checkout"
    shutil.copytree(root / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "engine" / "models" / "olmoe_tempered.py").write_text(NEW_FAMILY_FILE)
    init = copy / "engine" / "models" / "__init__.py"
    text, n_import = re.subn(r"\nfrom \. import \(", "\nfrom . import (olmoe_tempered, ", init.read_text(), count=1)
    text, n_entry = re.subn(r"(FAMILIES: dict\[str, ModuleType\] = \{m\.MODEL_TYPE: m for m in \()",
                            r"\1olmoe_tempered, ", text, count=1)
    assert n_import == n_entry == 1  # the registration: one import, one entry
    init.write_text(text)
    # the numpy kernels: a fresh copy's numba kernels would compile from scratch, the same values
    env = {**os.environ, "PYTHONPATH": str(copy), "COLIBRI_NO_NUMBA": "1"}
    p = subprocess.run([sys.executable, "-P", "-c", NEW_FAMILY_RUN, str(tmp_path / "work")], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert res["engine"].startswith(str(copy))
    assert res["name"] == "OLMoE tempered" and res["listed"]
    assert res["olmoe"]["sized"] and res["t1"]["sized"] and res["t05"]["sized"]
    assert res["t1"]["logits"] == res["olmoe"]["logits"]
    assert res["t05"]["logits"] != res["olmoe"]["logits"]
