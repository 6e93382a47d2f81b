"""gpt-oss: parity against transformers' own GptOssForCausalLM, the MXFP4 store
quantization (format, kernel, converter, size), and greedy ids across placement and prefix reuse.

The checkpoints are tiny (hidden 64, 3 layers, 8 experts) and every prompt is longer than the
sliding window, so the sliding layers really mask. The MXFP4 checkpoint is written the way
openai/gpt-oss-* are published: ``*_blocks`` uint8 [E, O, N/32, 16] + ``*_scales`` uint8
[E, O, N/32] (random codes and exponents), ``quantization_config.quant_method: mxfp4``; the
oracle is transformers' GptOssForCausalLM holding the weights transformers' own
``convert_moe_packed_tensors`` decodes from those bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import convert_checkpoint
from engine.config import EngineConfig, ModelArgs
from engine.errors import ConfigError
from engine.events import Finished, GenerateRequest, SamplingParams
from engine.expert_store import ExpertStore
from engine.generate import Engine
from engine.models import dense_bytes, expert_slot_bytes
from engine.quant import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4, slab_layout
from engine.bench.synthetic import PRESETS, gpt_oss_config, write_checkpoint

V = 256
BASE = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, eos_token_id=0, pad_token_id=0,
            bos_token_id=None, num_hidden_layers=3)
CONFIGS = {
    # GQA 4/2, head_dim 16 (heads x head_dim = 64), window 6, alternating sliding / full,
    # transformers' default YaRN (factor 32 over 4096, truncate false)
    "gqa-yarn-window6": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                             num_experts_per_tok=2, intermediate_size=32, sliding_window=6),
    # MHA 4/4, head_dim 32 (128 != hidden 64), window 5 on layers 1 and 2 only, top-3 of 6
    # experts of width 64, a tighter swiglu_limit so the clamps bite, YaRN x4 with truncation
    "mha-window5-limit": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_local_experts=6,
                              num_experts_per_tok=3, intermediate_size=64, sliding_window=5,
                              layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                              swiglu_limit=0.5, swiglu_alpha=1.5,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                               "original_max_position_embeddings": 64}),
}


def hf_model(tmp_path, name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from parity_helpers import saved_model
    return saved_model(tmp_path, name, "GptOssConfig", "GptOssForCausalLM", **{**BASE, **CONFIGS[name]})


@pytest.mark.parity
@pytest.mark.parametrize("name", list(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, name):
    from parity_helpers import assert_f32_parity
    m, d = hf_model(tmp_path, name)
    store = convert_checkpoint(d, tmp_path / "f32", quant="f32")
    a = ModelArgs.from_hf_config(store)
    assert a.model_type == "gpt_oss" and a.expert_bias and a.rope_scaling
    assert list(a.layer_windows) == [CONFIGS[name]["sliding_window"] if t == "sliding_attention" else 0
                                     for t in m.config.layer_types]
    if name.startswith("mha"):  # the clamps really act on these activations
        assert a.swiglu_limit == 0.5
    # 150 prefill positions: longer than the windows and than one prefill chunk (PREFILL_CHUNK 128),
    # so a window straddles the chunk boundary; then 16 cached decode steps
    assert_f32_parity(m, store, V, n_prefill=150)


# --- MXFP4 ------------------------------------------------------------------------------------

def test_nibble_order_and_scales_match_transformers():
    """Our decoding of MXFP4 bytes equals transformers' convert_moe_packed_tensors on random
    blocks and every scale byte but 255 (which is NaN in OCP MX)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(3)
    E, O, G = 2, 6, 3
    blocks = rng.integers(0, 256, (E, O, G, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (E, O, G), dtype=np.uint8)
    scales[0, 0, :] = (0, 127, 254)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=torch.float32).numpy()  # [E, N, O] (transposed)
    for e in range(E):
        ours = dequantize_mxfp4(blocks[e].reshape(O, G * 16), scales[e])  # [O, N]
        np.testing.assert_array_equal(ours, ref[e].T)


def test_quantize_mxfp4_rounds_to_the_nearest_code():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 96)) * rng.choice([1e-3, 1.0, 50.0], (16, 1))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    p, s = quantize_mxfp4(w)
    assert p.dtype == np.uint8 and p.shape == (16, 48) and s.dtype == np.uint8 and s.shape == (16, 3)
    d = dequantize_mxfp4(p, s)
    assert (d[0, :32] == 0).all()
    # the largest magnitude of a block lands in [4, 8) x 2^X, so it is representable (<= 6 or saturating)
    scale = np.repeat(2.0 ** (s.astype(np.int32) - 127), 32, axis=1)
    v = w / scale
    grid = np.abs(FP4_VALUES[:8])
    best = grid[np.abs(np.abs(v)[..., None] - grid).argmin(-1)] * np.sign(v)
    np.testing.assert_array_equal(d, (best * scale).astype(np.float32))
    p2, s2 = quantize_mxfp4(d)  # decoded values are codes already: the round trip is exact
    np.testing.assert_array_equal(dequantize_mxfp4(p2, s2), d)


@pytest.mark.parametrize("T", [1, 3, 17])
def test_linear_mxfp4_kernel(T):
    K = pytest.importorskip("engine.kernels")
    from engine import kernels_ref as R
    rng = np.random.default_rng(T)
    O, N = 37, 96
    p, s = quantize_mxfp4(rng.standard_normal((O, N)).astype(np.float32))
    x = rng.standard_normal((T, N)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize_mxfp4(p, s).astype(np.float64).T
    got, twin = np.empty((T, O), np.float32), np.empty((T, O), np.float32)
    K.linear_mxfp4(x, p, s, got)
    R.linear_mxfp4(x, p, s, twin)
    bound = 2 * (N + 2) * 2.0 ** -24 * (np.abs(x) @ np.abs(dequantize_mxfp4(p, s)).T) + 1e-30
    assert (np.abs(got - ref) <= bound).all() and (np.abs(twin - ref) <= bound).all()
    one = np.empty((1, O), np.float32)  # a row does not depend on the other rows of the call
    K.linear_mxfp4(x[-1:], p, s, one)
    np.testing.assert_array_equal(one[0], got[-1])


def test_attention_sink_kernel():
    K = pytest.importorskip("engine.kernels")
    from engine import kernels_ref as R
    rng = np.random.default_rng(5)
    T, H, Hkv, S, C, pos0 = 4, 4, 2, 16, 12, 5
    q = rng.standard_normal((T, H, S)).astype(np.float32)
    kc = rng.standard_normal((Hkv, C, S)).astype(np.float32)
    vc = rng.standard_normal((Hkv, C, S)).astype(np.float32)
    sinks = np.array([-2.0, 0.0, 3.0, 30.0], np.float32)  # 30: the sink takes nearly all the weight
    got, twin = np.empty_like(q), np.empty_like(q)
    K.attention_sink(q, kc, vc, pos0, np.float32(0.25), sinks, got)
    R.attention_sink(q, kc, vc, pos0, np.float32(0.25), sinks, twin)
    np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-6)
    for t in range(T):  # float64 reference: softmax over [scores, sink], sink column dropped
        n = pos0 + t + 1
        for h in range(H):
            sc = kc[h // 2, :n].astype(np.float64) @ q[t, h] * 0.25
            z = np.append(sc, sinks[h])
            p = np.exp(z - z.max())
            p /= p.sum()
            np.testing.assert_allclose(got[t, h], p[:-1] @ vc[h // 2, :n], rtol=1e-4, atol=1e-6)
    assert np.abs(got[:, 3]).max() < 1e-6  # sink 30: the real keys keep ~e^-25 of the weight


def _mxfp4_checkpoint(tmp_path, name="gqa-yarn-window6"):
    """(transformers model holding the decoded weights, MXFP4 checkpoint folder, source expert bytes)."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    m, d = hf_model(tmp_path, name)
    cfg = m.config
    E, D, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(7)
    w = load_file(str(d / "model.safetensors"))
    src_bytes = 0
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            pre = f"model.layers.{i}.mlp.experts."
            for proj, (O, N) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
                blocks = rng.integers(0, 256, (E, O, N // 32, 16), dtype=np.uint8)
                # e8m0 exponents around 2^-4 (weights ~0.1, like the parity models' N(0, 0.08))
                scales = rng.integers(127 - 6, 127 - 3, (E, O, N // 32), dtype=np.uint8)
                deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)  # [E, N, O]: the parameter's layout
                getattr(layer.mlp.experts, proj).copy_(deq)
                del w[pre + proj]
                w[pre + proj + "_blocks"], w[pre + proj + "_scales"] = blocks, scales
                src_bytes += blocks.nbytes + scales.nbytes + w[pre + proj + "_bias"].nbytes
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(c))
    return m, d, src_bytes


@pytest.mark.parity
def test_mxfp4_checkpoint_converts_as_is_and_matches_transformers(tmp_path):
    """An MXFP4 checkpoint converts at --quant mxfp4 with its codes and scales kept byte for
    byte (no int8, no float round trip), runs at f32 parity with transformers on the decoded
    weights, and its expert slabs hold within 5% of the MXFP4 source bytes."""
    from parity_helpers import assert_f32_parity
    m, d, src_bytes = _mxfp4_checkpoint(tmp_path)
    store = convert_checkpoint(d, tmp_path / "mx", quant="mxfp4", dense_quant="f32")
    man = json.loads((store / "manifest.json").read_text())
    assert man["quant"] == "mxfp4"
    src = load_file(str(d / "model.safetensors"))
    with ExpertStore(store, o_direct=False) as st:
        assert st.quant == "mxfp4"
        buf = st.new_buffer()
        for i, e in ((0, 3), (2, 7)):
            st.read(i, e, buf)
            v = st.views(buf)
            pre = f"model.layers.{i}.mlp.experts."
            gb, gs = src[pre + "gate_up_proj_blocks"][e], src[pre + "gate_up_proj_scales"][e]
            np.testing.assert_array_equal(v["gate_proj.w"], gb[0::2].reshape(gb.shape[0] // 2, -1))
            np.testing.assert_array_equal(v["up_proj.w"], gb[1::2].reshape(gb.shape[0] // 2, -1))
            np.testing.assert_array_equal(v["gate_proj.s"], gs[0::2])
            np.testing.assert_array_equal(v["down_proj.w"], src[pre + "down_proj_blocks"][e].reshape(64, -1))
            np.testing.assert_array_equal(v["down_proj.s"], src[pre + "down_proj_scales"][e])
            np.testing.assert_array_equal(v["up_proj.b"], src[pre + "gate_up_proj_bias"][e][1::2])
            np.testing.assert_array_equal(v["down_proj.b"], src[pre + "down_proj_bias"][e])
    n_experts = man["num_layers"] * man["num_experts"]
    data = man["slab_layout"]["data_bytes"] * n_experts  # the slabs' bytes without the 4096 padding
    assert abs(data - src_bytes) <= 0.05 * src_bytes, (data, src_bytes)
    assert_f32_parity(m, store, V)
    # the same checkpoint into a float store decodes the codes exactly: the same logits
    assert_f32_parity(m, convert_checkpoint(d, tmp_path / "f32", quant="f32"), V)


def test_gpt_oss_120b_mxfp4_store_stays_near_the_published_size():
    """gpt-oss-120b at mxfp4: the routed experts take what the published MXFP4 tensors take
    (within 5%; 4096-byte slab padding and float32 biases included), ~61 GB, not int8's ~115 GB."""
    a = ModelArgs.from_dict(PRESETS["gpt-oss-120b"])
    assert (a.num_hidden_layers, a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size,
            a.layer_windows[:2]) == (36, 128, 4, 2880, 2880, (128, 0))
    D, I, n = a.hidden_size, a.moe_intermediate_size, a.num_moe_layers * a.num_experts
    published = n * (2 * I * D // 2 + 2 * I * D // 32 + D * I // 2 + D * I // 32 + (2 * I + D) * 2)  # bf16 biases
    ours = n * expert_slot_bytes(a, "mxfp4")
    assert abs(ours - published) <= 0.05 * published, (ours, published)
    assert 58e9 < ours < 64e9 and n * expert_slot_bytes(a, "int8") > 1.8 * ours


def test_mxfp4_refused_for_dense_and_odd_widths(tmp_path):
    from engine.errors import CheckpointError
    ck = write_checkpoint(tmp_path / "ck", gpt_oss_config(), seed=1, tokenizer=False)
    with pytest.raises(ValueError, match="--dense-quant 'mxfp4'"):
        convert_checkpoint(ck, tmp_path / "a", quant="int8", dense_quant="mxfp4")
    ck2 = write_checkpoint(tmp_path / "ck2", gpt_oss_config(intermediate_size=48), seed=1, tokenizer=False)
    with pytest.raises(CheckpointError, match="multiples of 32"):
        convert_checkpoint(ck2, tmp_path / "b", quant="mxfp4")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bad_layer_types_name_the_key():
    with pytest.raises(ConfigError, match="'layer_types'"):
        ModelArgs.from_dict(gpt_oss_config(layer_types=["sliding_attention", "linear_attention"]), "g/config.json")
    with pytest.raises(ConfigError, match="'layer_types'"):
        ModelArgs.from_dict(gpt_oss_config(layer_types=["full_attention"]))


# --- placement and prefix reuse -----------------------------------------------------------------

@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    ck = write_checkpoint(d / "ck", gpt_oss_config(num_hidden_layers=3, sliding_window=5), seed=11, std=0.1)
    return {q: convert_checkpoint(ck, d / q, quant=q) for q in ("int8", "mxfp4")}


PROMPT = tuple(range(5, 25))  # 20 tokens > the window of 5


def _greedy(eng, prompt=PROMPT, n=12) -> tuple[int, ...]:
    req = GenerateRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
    fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
    assert fin.error == "", fin.error
    return fin.token_ids


def _open(store, **kw):
    return Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, **kw))


@pytest.mark.parametrize("quant", ["int8", "mxfp4"])
def test_greedy_ids_do_not_depend_on_placement(stores, quant):
    store = stores[quant]
    E = ModelArgs.from_hf_config(store).num_experts
    with _open(store, cap=E, policy="lru", pilot=0) as eng:
        ref = _greedy(eng)
    assert len(ref) == 12
    for kw in (dict(cap=1, policy="lfru", pilot=0), dict(cap=2, policy="ema", pilot=3, pilot_workers=2),
               dict(cap=3, policy="lru", pilot=1, pilot_workers=1, wide=2, spec_precision=0.0),
               dict(cap=2, policy="ema", pilot=2, pinning=True, pin_per_layer=1),
               dict(cap=2, policy="ema", pilot=1, threads=1)):
        with _open(store, **kw) as eng:
            assert _greedy(eng) == ref, kw


@pytest.mark.parametrize("quant", ["int8", "mxfp4"])
def test_prefix_reuse_equals_a_fresh_prefill(stores, quant):
    """A second request sharing 26 tokens (past the window) with the first reuses those KV
    rows and gives the ids a fresh engine gives."""
    store = stores[quant]
    second = None
    with _open(store, cap=3, pilot=0) as eng:
        first = _greedy(eng)
        second = PROMPT + first[:6] + ((41 if first[6] == 40 else 40), 41, 42)
        starts = []
        fwd = eng.model.forward

        def spy(ids, start, **kw):
            starts.append(start)
            return fwd(ids, start, **kw)
        eng.model.forward = spy
        reused = _greedy(eng, second)
        assert starts[0] == len(PROMPT) + 6  # the prefill started after the reused rows
    with _open(store, cap=3, pilot=0) as eng:
        assert _greedy(eng, second) == reused


def test_store_sizes_and_layout(stores):
    for quant, store in stores.items():
        m = json.loads((store / "manifest.json").read_text())
        a = ModelArgs.from_hf_config(store)
        assert dense_bytes(a, quant) == m["dense_bytes"] and m["dense_quant"] == "int8"
        lay = slab_layout(quant, a.hidden_size, a.moe_intermediate_size, bias=True)
        assert expert_slot_bytes(a, quant) == m["slab_layout"]["slot_bytes"] == lay["slot_bytes"]
        assert {f[0] for f in m["slab_layout"]["fields"]} >= {"gate_proj.b", "up_proj.b", "down_proj.b"}
        assert all(e["length"] == lay["slot_bytes"] and e["offset"] % 4096 == 0 for row in m["experts"] for e in row)
        assert a.dense_param_count() == sum(int(np.prod(v.shape)) for k, v in
                                            load_file(str(store / "dense.safetensors")).items()
                                            if not k.endswith(".s"))


# --- harmony: the chat template and the channels of the answer -------------------------------------

HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|return|>", "<|call|>"]
REASONED = ("<|channel|>analysis<|message|>The user asks if 7 is prime. It has no divisor.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Yes, 7 is prime.<|return|>")


def _harmony_folder(d):
    """A harmony tokenizer folder: byte-level BPE + the markers as special tokens, the
    gpt-oss-style template of tests/chat_templates/gpt_oss.jinja, eos <|return|> / <|call|>."""
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The user asks if 7 is prime. It has no divisor. Yes, 7 is prime. analysis final"] * 5,
                            trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in HARMONY_SPECIAL])
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text((Path(__file__).parent / "chat_templates" / "gpt_oss.jinja").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"}))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]}))
    return d


def _stream(tok, ids):
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    return "".join(pieces) + dec.flush(), dec


def test_harmony_channels_become_reasoning_and_answer(tmp_path):
    from engine.chat_template import split_reasoning
    from engine.harmony import HarmonyDecoder
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(_harmony_folder(tmp_path))
    assert tok.eos_ids == {tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")}
    text, dec = _stream(tok, tok.encode(REASONED))
    assert isinstance(dec, HarmonyDecoder) and dec.channels == ["analysis", "final"]
    assert text == "<think>The user asks if 7 is prime. It has no divisor.</think>Yes, 7 is prime."
    assert split_reasoning(text) == ("The user asks if 7 is prime. It has no divisor.", "Yes, 7 is prime.")
    # cut inside the analysis (max_new_tokens): still thinking, nothing shown as the answer
    cut = tok.encode(REASONED)[:8]
    assert split_reasoning(_stream(tok, cut)[0])[1] == ""
    # a tool call on the commentary channel: the header (recipient, constraint) is not shown
    call = tok.encode('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                      '{"city": "P"}<|call|>')
    text, dec = _stream(tok, call)
    assert text == '{"city": "P"}' and dec.channels == ["commentary"]
    # output that never follows the format is still shown
    assert _stream(tok, tok.encode("Yes, 7 is prime. " * 8))[0] == "Yes, 7 is prime. " * 8
    # with the special tokens shown, the plain decoder (raw harmony text)
    assert not isinstance(tok.incremental_decoder(skip_special_tokens=False), HarmonyDecoder)


def test_harmony_chat_through_the_engine(tmp_path):
    """A gpt-oss store with a harmony tokenizer: the prompt is the model's template (ending in
    <|start|>assistant), the answer's analysis channel comes back as a <think> block, and the
    next turn gives the template the answer as content (the template drops old reasoning)."""
    from engine.chat_template import split_reasoning
    from engine.events import ChatMessage
    ck = write_checkpoint(tmp_path / "ck", gpt_oss_config(num_hidden_layers=2), seed=3, tokenizer=False)
    _harmony_folder(ck)
    store = convert_checkpoint(ck, tmp_path / "st", quant="int8")
    with _open(store, cap=2, pilot=0) as eng:
        msgs = (ChatMessage("system", "Answer briefly."), ChatMessage("user", "Is 7 prime?"))
        prompt = eng.tokenizer.apply_chat_template(msgs)
        assert prompt.endswith("<|start|>user<|message|>Is 7 prime?<|end|><|start|>assistant")
        assert "# Instructions\n\nAnswer briefly." in prompt
        forced = tuple(eng.tokenizer.encode(REASONED))
        req = GenerateRequest(messages=msgs, forced_ids=forced, sampling=SamplingParams(max_new_tokens=len(forced)))
        fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
        assert fin.error == "", fin.error
        assert split_reasoning(fin.text) == ("The user asks if 7 is prime. It has no divisor.", "Yes, 7 is prime.")
        nxt = eng.tokenizer.apply_chat_template(msgs + (ChatMessage("assistant", fin.text), ChatMessage("user", "9?")))
        assert "<|start|>assistant<|channel|>final<|message|>Yes, 7 is prime.<|end|><|start|>user" in nxt
        assert "divisor" not in nxt


def test_mxfp4_store_from_seed(tmp_path):
    """write_store_from_seed at mxfp4 equals converting the seeded checkpoint (float experts
    rounded by quantize_mxfp4); the "codes" draw (the benchmarks' big stores) opens and runs."""
    from engine.bench.synthetic import write_store_from_seed
    cfg = gpt_oss_config(num_hidden_layers=2)
    s1 = convert_checkpoint(write_checkpoint(tmp_path / "ck", cfg, seed=4, tokenizer=False), tmp_path / "a",
                            quant="mxfp4")
    s2 = write_store_from_seed(tmp_path / "b", cfg, quant="mxfp4", seed=4)
    m1, m2 = (json.loads((s / "manifest.json").read_text()) for s in (s1, s2))
    assert m1["experts"] == m2["experts"] and m1["slab_layout"] == m2["slab_layout"]
    s3 = write_store_from_seed(tmp_path / "c", cfg, quant="mxfp4", seed=4, expert_draw="codes")
    with _open(s3, cap=2, pilot=0) as eng:
        assert len(_greedy(eng, n=4)) == 4


def test_mxfp4_swiglu_expert_of_other_families():
    """--quant mxfp4 also serves the SwiGLU experts of the other families (run_expert)."""
    from engine.models.base import run_expert
    from engine.quant import quantize
    rng = np.random.default_rng(2)
    D, I, T = 64, 96, 3
    v, deq = {}, {}
    for p, (O, N) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
        parts = quantize(rng.standard_normal((O, N)).astype(np.float32) * 0.2, "mxfp4")
        v.update({f"{p}.{k}": a for k, a in parts.items()})
        deq[p] = dequantize_mxfp4(parts["w"], parts["s"]).astype(np.float64)
    x = rng.standard_normal((T, D)).astype(np.float32)
    out = np.empty((T, D), np.float32)
    run_expert("mxfp4", v, x, np.empty((T, I), np.float32), out, 32)
    g, u = x @ deq["gate_proj"].T, x @ deq["up_proj"].T
    ref = (g / (1 + np.exp(-g)) * u) @ deq["down_proj"].T
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_published_config_json_keys():
    """config.json as openai/gpt-oss-120b publishes it (legacy rope_scaling + rope_theta, MXFP4
    quantization_config, experts_per_token beside num_experts_per_tok)."""
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
           "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
           "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False,
           "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
               "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    a = ModelArgs.from_dict(cfg)
    assert a.rope_theta == 150000 and dict(a.rope_scaling)["factor"] == 32.0 and dict(a.rope_scaling)["truncate"] == 0
    assert a.layer_windows[:3] == (128, 0, 128) and a.num_experts == 128 and a.swiglu_alpha == 1.702


@pytest.mark.parametrize("quant", ["mxfp4", "int8"])
@pytest.mark.parametrize("byte,code", [(255, 0x11), (254, 0x77)], ids=["nan-scale", "beyond-f32"])
def test_mxfp4_scale_that_decodes_to_nan_or_inf_is_refused_naming_the_tensor(tmp_path, quant, byte, code):
    """A scale byte 255 (NaN in OCP MX) or 254 under a code of magnitude >= 2 (beyond float32)
    is refused at convert with the checkpoint's own ``*_scales`` name, the expert, row and
    block - also at --quant mxfp4, where the bytes are otherwise kept as they are (before: the
    store was written and `colibri run` then failed on non-finite logits)."""
    from engine.errors import CheckpointError
    cfg = gpt_oss_config(num_hidden_layers=2)
    ck = write_checkpoint(tmp_path / "ck", cfg, seed=1, tokenizer=False)
    f = next(ck.glob("model*.safetensors"))
    w = load_file(str(f))
    E, D, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    rng = np.random.default_rng(0)
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        for proj, (O, N) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
            w.pop(pre + proj, None)
            for e in range(E):  # per-expert names, if the writer used them
                for k in [k for k in w if k.startswith(f"{pre}{e}.")]:
                    del w[k]
            w.setdefault(pre + proj + "_bias", np.zeros((E, O), np.float32))
            w[pre + proj + "_blocks"] = rng.integers(0, 256, (E, O, N // 32, 16), dtype=np.uint8)
            w[pre + proj + "_scales"] = np.full((E, O, N // 32), 120, np.uint8)
    bad = "model.layers.1.mlp.experts.down_proj_scales"
    w[bad][2, 5, 0] = byte
    w["model.layers.1.mlp.experts.down_proj_blocks"][2, 5, 0, 3] = code
    save_file(w, str(f), metadata={"format": "pt"})
    c = json.loads((ck / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4"}
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '{bad}' expert 2 row 5 block 0: scale byte {byte}"):
        convert_checkpoint(ck, tmp_path / "st", quant=quant)
    assert not (tmp_path / "st").exists()


def test_interleaved_int4_experts_give_the_same_logits(tmp_path, monkeypatch):
    """gpt-oss runs its own expert MLP through linear_views: an int4 store whose expert slabs
    are interleaved (store format 4) gives the same logits, bit for bit, as the row-major store
    (K.linear_q4i), also where the interleaved kernels do not run (de-interleaved copies)."""
    import engine.models.base as base
    ck = write_checkpoint(tmp_path / "ck", gpt_oss_config(intermediate_size=128, sliding_window=5), seed=3, std=0.1)
    rm = convert_checkpoint(ck, tmp_path / "rm", quant="int4", expert_layout="row_major")
    il = convert_checkpoint(ck, tmp_path / "il", quant="int4", expert_layout="interleaved_4")
    assert ExpertStore(il, o_direct=False).expert_layout == "interleaved_4"

    def logits(store):
        with _open(store, cap=3, pilot=0) as eng:
            m = eng.model
            out = [m.forward(np.arange(5, 25), 0, all_logits=True)]
            for s in range(4):
                out.append(m.forward(np.array([int(np.argmax(out[-1][-1]))]), 20 + s))
            return np.concatenate(out)
    ref = logits(rm)
    assert np.array_equal(logits(il).view(np.uint32), ref.view(np.uint32))
    monkeypatch.setattr(base.K, "q4_interleaved_ok", lambda gs: False)
    assert np.array_equal(logits(il).view(np.uint32), ref.view(np.uint32))


def test_info_describes_the_sliding_and_full_layers_sinks_and_clamp(stores):
    """``colibri info`` against config.json as transformers reads it: which layers slide (and
    their window), which attend fully, the attention sinks and the clamped SwiGLU experts."""
    import transformers
    from engine.cli.run import describe_store
    text = describe_store(str(stores["int8"]))
    c = transformers.AutoConfig.from_pretrained(stores["int8"])
    sliding = [i for i, t in enumerate(c.layer_types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    assert (f"{len(sliding)} sliding-window layers (window {c.sliding_window} tokens: layers "
            f"{', '.join(map(str, sliding))}), {len(full)} full-attention layer (layer {full[0]})") in text
    assert "attention sinks" in text and "q/k/v biases" in text
    assert f"SwiGLU clamped at {c.swiglu_limit:g} (alpha {c.swiglu_alpha:g}), expert biases" in text
