"""The hybrid families' recurrent state without torch: prefix reuse is exact (greedy ids with
reuse equal a fresh prefill: next turn from the live state, regenerate from the prefill
snapshot, a divergence inside the answer or the prompt from the snapshot or position 0, and
after a cancelled prefill), the chunked rule equals the recurrence, a forward at a position
whose state is unknown is refused, and the sizing counts the state with the KV cache.
(Parity against transformers: test_hybrid_parity.py; greedy ids across placements:
test_families.py.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import convert_checkpoint, sizing
from engine.cli.run import describe_store
from engine.config import EngineConfig, ModelArgs
from engine.events import Finished, FinishReason, GenerateRequest, SamplingParams
from engine.generate import Engine
from engine import kernels, kernels_ref
from engine.models.kimi_linear import kimi_delta
from engine.bench.synthetic import (granitemoehybrid_config, kimi_linear_config, lfm2_moe_config, qwen3_5_moe_text_config,
                                    qwen3_next_config, write_checkpoint)

HYBRID = {
    "qwen3_next": qwen3_next_config(mlp_only_layers=[1]),
    "qwen3_5_moe_text": qwen3_5_moe_text_config(num_hidden_layers=3, layer_types=[
        "linear_attention", "full_attention", "linear_attention"]),
    # short convolutions (their last inputs the state) around an attention layer
    "lfm2_moe": lfm2_moe_config(num_hidden_layers=4),
    # Mamba2 layers (conv inputs and the SSM state) around an attention layer
    "granitemoehybrid": granitemoehybrid_config(num_hidden_layers=4),
    # Kimi Delta Attention layers (conv inputs and the per-channel-decay state) around NoPE MLA
    "kimi_linear": kimi_linear_config(num_hidden_layers=4),
}


@pytest.fixture(scope="module")
def hybrid_stores(tmp_path_factory):
    out = {}
    for name, cfg in HYBRID.items():
        d = tmp_path_factory.mktemp("hybrid")
        ck = write_checkpoint(d / name, cfg, seed=5, std=0.1)
        out[name] = convert_checkpoint(ck, d / f"{name}-int8", quant="int8")
    return out


class Calls:
    """Records (pos0, T) of every model.forward call."""

    def __init__(self, model):
        self.calls, fwd = [], model.forward

        def spy(ids, pos0, *a, **kw):
            self.calls.append((int(pos0), len(ids)))
            return fwd(ids, pos0, *a, **kw)
        model.forward = spy


def _gen(eng, ids, n=8, cancel=None) -> Finished:
    req = GenerateRequest(prompt_ids=tuple(int(t) for t in ids), sampling=SamplingParams(temperature=0.0,
                                                                                         max_new_tokens=n))
    return [e for e in eng.generate(req, cancel) if isinstance(e, Finished)][-1]


def _fresh(eng, ids, n=8) -> tuple[int, ...]:
    eng.forget_prefix()
    fin = _gen(eng, ids, n)
    assert fin.error == ""
    return fin.token_ids


@pytest.mark.parametrize("name", list(HYBRID))
def test_prefix_reuse_gives_the_ids_of_a_fresh_prefill(hybrid_stores, name):
    cfg = EngineConfig(store=str(hybrid_stores[name]), history=False, o_direct=False, cap=8, context_length=512)
    with Engine.open(cfg) as eng, Engine.open(cfg) as ref:
        spy = Calls(eng.model)
        A = list(range(7, 7 + 70))  # longer than one chunk of the delta rule (64)
        out1 = _gen(eng, A).token_ids
        assert out1 == _fresh(ref, A) and len(out1) == 8
        fed = len(A) + len(out1) - 1  # the last answer token is sampled, not fed

        # next turn: the whole previous run is reused, from the live state
        spy.calls.clear()
        ids2 = A + list(out1) + [40, 41, 42]
        assert _gen(eng, ids2).token_ids == _fresh(ref, ids2)
        assert spy.calls[0] == (fed, len(ids2) - fed)

        # regenerate the same prompt: the snapshot before the prompt's last token
        spy.calls.clear()
        ids3 = list(ids2)
        assert _gen(eng, ids3).token_ids == _fresh(ref, ids3)
        assert spy.calls[0] == (len(ids3) - 1, 1)

        # diverging inside the previous answer: back to that prompt's snapshot, the rest recomputed
        ids4 = ids3 + [50, 51, 52, 53] + [60]
        out4 = _gen(eng, ids4).token_ids
        spy.calls.clear()
        ids5 = ids4 + list(out4[:3]) + [70, 71]
        assert _gen(eng, ids5).token_ids == _fresh(ref, ids5)
        assert spy.calls[0] == (len(ids4) - 1, len(ids5) - len(ids4) + 1)

        # diverging inside the prompt, before the snapshot: from position 0
        spy.calls.clear()
        ids6 = A[:20] + [90, 91, 92]
        assert _gen(eng, ids6).token_ids == _fresh(ref, ids6)
        assert spy.calls[0] == (0, len(ids6))


class _CancelAtLayer:
    """Sets ``event`` at the second MoE layer of the next forward."""

    def __init__(self, event):
        self.event, self.seen = event, 0

    def on_after_moe(self, layer, x):
        self.seen += 1
        if self.seen == 2:
            self.event.set()


@pytest.mark.parametrize("name", list(HYBRID))
def test_cancelled_prefill_leaves_no_stale_state(hybrid_stores, name):
    """A prefill cancelled between layers leaves some linear layers advanced and others not;
    the next generation must not continue from that state."""
    cfg = EngineConfig(store=str(hybrid_stores[name]), history=False, o_direct=False, cap=8, context_length=512)
    with Engine.open(cfg) as eng, Engine.open(cfg) as ref:
        A = list(range(3, 3 + 40))
        out = _gen(eng, A).token_ids
        ids = A + list(out) + list(range(100, 160))
        cancel = threading.Event()
        obs = _CancelAtLayer(cancel)
        eng.subscribe(obs)
        fin = _gen(eng, ids, cancel=cancel)
        eng.unsubscribe(obs)
        assert fin.finish_reason == FinishReason.CANCELLED and fin.generated_tokens == 0
        assert eng.model.state_pos == -1
        assert _gen(eng, ids).token_ids == _fresh(ref, ids)
        assert _gen(eng, A).token_ids == out  # and again from the start of the history


def test_forward_at_an_unknown_state_is_refused(hybrid_stores):
    cfg = EngineConfig(store=str(hybrid_stores["qwen3_next"]), history=False, o_direct=False, context_length=64)
    with Engine.open(cfg) as eng:
        m = eng.model
        m.forward(np.arange(10), 0)
        assert (m.state_pos, m.snap_pos) == (10, 9)
        with pytest.raises(ValueError, match=r"rewind\(5\)"):
            m.forward(np.arange(3), 5)
        assert m.rewind(5) == 0 and m.rewind(9) == 9 and m.state_pos == 9
        m.forward(np.array([9]), 9)  # from the snapshot
        assert m.rewind(12) == 10
        m.forward(np.array([10]), 10)
        m.forward(np.arange(4), 0)  # a new prefill, a new snapshot
        assert (m.state_pos, m.snap_pos) == (4, 3)
        m.forward(np.array([5]), 0)  # rewriting the history drops the snapshot taken after it
        assert (m.state_pos, m.snap_pos) == (1, -1)
        assert m.rewind(3) == 1


def _recurrence(q, k, v, g, beta, S):
    """The gated delta rule token by token (the definition): [H, T, dv], S updated."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float64)
    for t in range(q.shape[1]):
        S *= np.exp(g[:, t])[:, None, None]
        delta = (v[:, t] - np.einsum("hk,hkv->hv", k[:, t], S)) * beta[:, t, None]
        S += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hk,hkv->hv", q[:, t], S)
    return out


@pytest.mark.parametrize("impl", [kernels, kernels_ref], ids=["numba", "numpy"])
@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (130, 64), (17, 4)])
def test_chunked_rule_equals_the_recurrence(impl, T, chunk):
    rng = np.random.default_rng(T)
    H, dk, dv = 3, 8, 5
    q = rng.standard_normal((H, T, dk)).astype(np.float32)
    k = rng.standard_normal((H, T, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((H, T, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (H, T)).astype(np.float32)
    g[0, T // 2] = -200.0  # a decay far below the floor: the state before it is forgotten
    beta = rng.uniform(0.0, 1.0, (H, T)).astype(np.float32)
    S0 = rng.standard_normal((H, dk, dv)).astype(np.float32)
    S1, S2 = S0.copy(), S0.astype(np.float64)
    got = np.empty((H, T, dv), np.float32)
    impl.gated_delta(q, k, v, g, beta, S1, chunk, got)
    want = _recurrence(q, k, v, g, beta, S2)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(S1, S2, atol=2e-5 * np.abs(S2).max())


def _channel_recurrence(q, k, v, g, beta, S):
    """The delta rule with a decay per key channel, token by token (the definition)."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float64)
    for t in range(q.shape[1]):
        S *= np.exp(g[:, t])[:, :, None]
        delta = (v[:, t] - np.einsum("hk,hkv->hv", k[:, t], S)) * beta[:, t, None]
        S += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hk,hkv->hv", q[:, t], S)
    return out


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (130, 64), (17, 4)])
def test_kimi_delta_chunks_equal_the_recurrence(T, chunk):
    """Kimi Delta Attention's chunked rule (a decay per key channel) equals the token-by-token
    recurrence, across chunk edges, with decays down to e^-200 in one channel."""
    rng = np.random.default_rng(T)
    H, dk, dv = 3, 8, 5
    q = rng.standard_normal((H, T, dk)).astype(np.float32)
    k = rng.standard_normal((H, T, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((H, T, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (H, T, dk)).astype(np.float32)
    g[0, T // 2, 1] = -200.0
    beta = rng.uniform(0.0, 1.0, (H, T)).astype(np.float32)
    S0 = rng.standard_normal((H, dk, dv)).astype(np.float32)
    S1, S2 = S0.copy(), S0.astype(np.float64)
    got = kimi_delta(q, k, v, g, beta, S1, chunk)
    want = _channel_recurrence(q, k, v, g, beta, S2)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(S1, S2, atol=2e-5 * np.abs(S2).max())


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_sizing_counts_full_layer_kv_and_the_recurrent_state(hybrid_stores, kv_dtype):
    store = hybrid_stores["qwen3_next"]
    a = ModelArgs.from_hf_config(store)
    assert a.full_layers == (3,) and a.linear_layers == (0, 1, 2) and a.num_kv_layers == 1
    state = 2 * 3 * 4 * (a.conv_dim * 3 + 4 * 16 * 16)  # live + snapshot, float32, 3 linear layers
    assert a.recurrent_state_bytes == state
    per = {"f16": 2, "f32": 4}[kv_dtype]
    assert sizing.kv_bytes(a, 96, kv_dtype) == 1 * 2 * 2 * 16 * 96 * per + state
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, context_length=96, kv_dtype=kv_dtype)
    with Engine.open(cfg) as eng:
        assert eng.model.kv_bytes == sizing.kv_bytes(a, 96, kv_dtype) == eng.plan.kv
        assert eng.model.k_cache.shape == (1, 2, 96, 16)
    text = describe_store(str(store), 96)
    assert "1 gated full-attention layer (" in text and "3 Gated DeltaNet linear-attention layers" in text
    assert "recurrent state of the 3 linear-attention layers" in text


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_kimi_linear_sizing_counts_the_latent_cache_and_the_kda_state(hybrid_stores, kv_dtype):
    store = hybrid_stores["kimi_linear"]
    a = ModelArgs.from_hf_config(store)
    assert a.full_layers == (1,) and a.linear_layers == (0, 2, 3) and a.num_kv_layers == 1
    state = 2 * 3 * 4 * (3 * 64 * 3 + 4 * 16 * 16)  # live + snapshot, float32, 3 KDA layers
    assert a.recurrent_state_bytes == state
    per = {"f16": 2, "f32": 4}[kv_dtype]
    assert sizing.kv_bytes(a, 96, kv_dtype) == 1 * (32 + 16) * 96 * per + state  # one latent row per token
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, context_length=96, kv_dtype=kv_dtype)
    with Engine.open(cfg) as eng:
        assert eng.model.kv_bytes == sizing.kv_bytes(a, 96, kv_dtype) == eng.plan.kv
        assert eng.model.kv_cache.shape == (1, 1, 96, 48)
    text = describe_store(str(store), 96)
    assert "1 multi-head latent attention layer (heads 4, no RoPE, kv_lora_rank 32" in text
    assert "3 Kimi Delta Attention linear-attention layers (4 heads of 16, conv 4)" in text
    assert "recurrent state of the 3 linear-attention layers" in text
    assert "rope        none (attention without rotary embeddings)" in text


def test_kimi_linear_48b_preset_reads_the_published_config():
    """The published config.json (1-based layer lists in linear_attn_config, num_experts_per_token,
    moe_renormalize, ...) gives the published shape."""
    from engine.bench.synthetic import PRESETS
    a = ModelArgs.from_dict(PRESETS["kimi-linear-48b-a3b"])
    assert (a.num_hidden_layers, a.num_moe_layers, a.full_layers) == (27, 26, (3, 7, 11, 15, 19, 23, 26))
    assert (a.num_experts, a.num_experts_per_tok, a.n_shared_experts, a.norm_topk_prob) == (256, 8, 1, True)
    assert (a.linear_num_heads, a.linear_head_dim, a.linear_conv_kernel_dim, a.kv_values_per_token) == (32, 128, 4, 576)
    # live + snapshot state of 20 KDA layers: conv 3 x 12288 + S 32 x 128 x 128, float32
    assert a.recurrent_state_bytes == 2 * 20 * 4 * (3 * 12288 + 32 * 128 * 128) == 89_784_320
    assert sizing.kv_bytes(a, 4096) == 7 * 576 * 4096 * 2 + a.recurrent_state_bytes
    assert a.max_position_embeddings == 1048576 and not a.use_rope
    from engine.models import kimi_linear
    names = {t.hf for t in kimi_linear.dense_tensors(a)}
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the published dense layer's names
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names


def test_qwen3_next_80b_preset_sizes():
    from engine.bench.synthetic import PRESETS
    a = ModelArgs.from_dict(PRESETS["qwen3-next-80b-a3b"])
    assert (a.num_hidden_layers, a.num_moe_layers, len(a.full_layers), a.full_layers[:2]) == (48, 48, 12, (3, 7))
    assert (a.num_experts, a.num_experts_per_tok, a.rotary_dim, a.conv_dim) == (512, 10, 64, 8192)
    # live + snapshot state of 36 linear layers: conv 3 x 8192 + S 32 x 128 x 128, float32
    assert a.recurrent_state_bytes == 2 * 36 * 4 * (3 * 8192 + 32 * 128 * 128) == 158_072_832
    assert sizing.kv_bytes(a, 4096) == 12 * 2 * 2 * 256 * 4096 * 2 + a.recurrent_state_bytes
    assert 2.3e9 < a.dense_param_count() < 2.4e9  # attention, linear layers, shared experts, embeddings


@pytest.mark.parametrize("make", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("key", ["linear_num_value_heads", "linear_key_head_dim"])
def test_config_missing_a_linear_attention_key_names_it(tmp_path, make, key):
    """A config.json without a linear-attention width (transformers' default then applies, 32
    value heads / 128 wide, which the weights contradict) is refused naming the absent key and
    the default used - not only the tensor whose shape disagrees."""
    import json

    from engine.errors import CheckpointError
    from engine.bench.synthetic import qwen3_5_moe_config
    cfg = qwen3_next_config(num_hidden_layers=2) if make == "qwen3_next" else qwen3_5_moe_config(num_hidden_layers=2)
    ck = write_checkpoint(tmp_path / "ck", cfg, seed=1, tokenizer=False)
    c = json.loads((ck / "config.json").read_text())
    del (c.get("text_config") or c)[key]
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=rf"linear_attn.*config.json has no '{key}'.*default"):
        convert_checkpoint(ck, tmp_path / "st", quant="int8")


def test_config_missing_linear_num_key_heads_names_it(tmp_path):
    """Without linear_num_key_heads transformers' default 16 does not divide the 4 value heads:
    the error says the key is absent, not only that 4 is not a multiple of 16."""
    from engine.errors import ConfigError
    import json
    ck = write_checkpoint(tmp_path / "ck", qwen3_next_config(num_hidden_layers=2), seed=1, tokenizer=False)
    c = json.loads((ck / "config.json").read_text())
    del c["linear_num_key_heads"]
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=r"ck/config.json: .*'linear_num_key_heads' is absent \(transformers' default 16\)"):
        convert_checkpoint(ck, tmp_path / "st", quant="int8")


def test_positions_outside_the_context_are_refused_before_any_compute(hybrid_stores, tiny_store):
    """A negative position (numpy's slices would wrap to the cache's end: the one-call decode
    attention wrote K and V at row C - 1) or one past the context is a ValueError naming it,
    and the KV cache is untouched; for the standard model and the hybrid one."""
    for store in (tiny_store, hybrid_stores["qwen3_next"]):
        cfg = EngineConfig(store=str(store), history=False, o_direct=False, context_length=64)
        with Engine.open(cfg) as eng:
            m = eng.model
            m.forward(np.arange(4), 0)
            before = m.k_cache.copy(), m.v_cache.copy()
            with pytest.raises(ValueError, match="position -1 is negative"):
                m.forward(np.array([3]), -1)
            with pytest.raises(ValueError, match="exceed the context of 64 tokens"):
                m.forward(np.arange(3), 62)
            assert np.array_equal(m.k_cache, before[0]) and np.array_equal(m.v_cache, before[1])


def test_deepseek_v4_prefix_reuse_recomputes_the_compressed_entries(tmp_path):
    """DeepSeek-V4's compressed entries are recomputed from their stored inputs when a reused
    prefix ends inside a compression window: the next turn, a regenerate and a divergence
    inside the answer give the ids of a fresh prefill."""
    from engine.bench.synthetic import deepseek_v4_config
    ck = write_checkpoint(tmp_path / "ck", deepseek_v4_config(), seed=5, std=0.1)
    store = convert_checkpoint(ck, tmp_path / "st", quant="int8")
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, cap=8, context_length=256)
    with Engine.open(cfg) as eng, Engine.open(cfg) as ref:
        A = list(range(7, 7 + 21))  # ends inside a window of 4 and one of 8
        out1 = _gen(eng, A).token_ids
        assert out1 == _fresh(ref, A)
        ids2 = A + list(out1) + [40, 41, 42]
        assert _gen(eng, ids2).token_ids == _fresh(ref, ids2)
        assert _gen(eng, ids2).token_ids == _fresh(ref, ids2)  # regenerate
        ids3 = ids2 + [50, 51, 52]
        out3 = _gen(eng, ids3).token_ids
        ids4 = ids3 + list(out3[:3]) + [70, 71]  # diverges after 3 answer tokens
        assert _gen(eng, ids4).token_ids == _fresh(ref, ids4)
        ids5 = A[:13] + [90, 91, 92]  # inside the first prompt
        assert _gen(eng, ids5).token_ids == _fresh(ref, ids5)
