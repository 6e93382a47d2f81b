"""The Q8_0 GGUF that ``colibri bench gguf`` writes is the same model: llama.cpp's logits on a
fixed token sequence match transformers' (bf16 checkpoint read in float32) at every position.

Needs the optional ``peers`` extra (llama-cpp-python, gguf) and torch + transformers; skipped
otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.bench.gguf import gguf_plan, write_gguf  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from llama_helpers import agreement, import_llama_cpp, llama_logits  # noqa: E402
from engine.bench.synthetic import olmoe_config, write_checkpoint  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512,
           max_position_embeddings=512)
IDS = [int(x) for x in np.random.default_rng(7).integers(1, 512, 40)]


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers")
    return write_checkpoint(d / "ck", olmoe_config(**CFG), seed=11, tokenizer=False, std=0.08)


@pytest.fixture(scope="module", params=["q8_0", "f16"])
def olmoe_gguf(request, tiny_ck, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_gguf(tiny_ck, out, matrix_type=request.param, log=lambda *_: None)
    return tiny_ck, out, request.param


@pytest.fixture(scope="module")
def hf_logits(tiny_ck):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.OlmoeForCausalLM.from_pretrained(str(tiny_ck), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([IDS])).logits[0].numpy()


def test_gguf_layout_matches_llama_cpp_olmoe(olmoe_gguf):
    ck, out, kind = olmoe_gguf
    r = gguf.GGUFReader(str(out))
    kv = {f.name: f for f in r.fields.values()}

    def val(k):
        f = kv[k]
        return f.contents()
    assert val("general.architecture") == "olmoe"
    assert val("tokenizer.ggml.model") == "none"
    for key, want in [("olmoe.block_count", 2), ("olmoe.embedding_length", 128), ("olmoe.feed_forward_length", 64),
                      ("olmoe.attention.head_count", 4), ("olmoe.attention.head_count_kv", 4),
                      ("olmoe.expert_count", 8), ("olmoe.expert_used_count", 2), ("olmoe.vocab_size", 512),
                      ("olmoe.context_length", 512)]:
        assert val(key) == want, key
    tensors = {t.name: t for t in r.tensors}
    args = ModelArgs.from_dict(olmoe_config(**CFG))
    assert list(tensors) == [n for n, *_ in gguf_plan(args, kind)]
    F32 = gguf.GGMLQuantizationType.F32
    MAT = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.F16
    # ggml dimension order (fastest first): experts are {n_embd, n_ff, n_expert} / {n_ff, n_embd, n_expert}
    assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [128, 64, 8]
    assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [64, 128, 8]
    assert list(tensors["blk.1.ffn_gate_inp.weight"].shape) == [128, 8]
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == F32
    assert tensors["blk.0.attn_k_norm.weight"].tensor_type == F32
    assert tensors["token_embd.weight"].tensor_type == MAT
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == MAT
    # the stacked tensor holds expert e at index e (dequantize and compare with the checkpoint)
    from engine.checkpoint import Checkpoint
    with Checkpoint(ck) as c:
        w = c.get("model.layers.1.mlp.experts.5.down_proj.weight")
    deq = gguf.quants.dequantize(np.asarray(tensors["blk.1.ffn_down_exps.weight"].data), MAT)
    assert deq.shape == (8, 128, 64)
    assert np.abs(deq[5] - w).max() <= np.abs(w).max() / (127 if kind == "q8_0" else 1000)


def test_refuses_what_llama_cpp_olmoe_cannot_run(tmp_path):
    ck = write_checkpoint(tmp_path / "gqa", olmoe_config(num_key_value_heads=2), seed=1, tokenizer=False)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        write_gguf(ck, tmp_path / "x.gguf")
    ck = write_checkpoint(tmp_path / "norm", olmoe_config(norm_topk_prob=True), seed=1, tokenizer=False)
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        write_gguf(ck, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_llama_cpp_logits_match_transformers(olmoe_gguf, hf_logits):
    """F16 GGUF: the same numbers up to f16 rounding (layout and conventions exact). Q8_0: the
    weight and activation quantization noise of llama.cpp's Q8_0 kernels only: small KL, and
    top-1 differs only where transformers' two best logits are nearly tied."""
    llama_cpp = import_llama_cpp()
    ck, out, kind = olmoe_gguf
    ref = hf_logits
    got, llm = llama_logits(llama_cpp, out, IDS, threads=2)
    assert got.shape == ref.shape == (len(IDS), 512)
    agree, margin, max_abs, scale, kl = agreement(ref, got)
    print(f"\nGGUF {kind} vs transformers f32 over {len(IDS)} positions: top-1 agreement {agree.mean():.3f} "
          f"(disagreements at reference top-2 margins {np.round(margin[~agree], 3).tolist()}, median margin "
          f"{np.median(margin):.3f}), max |dlogit| {max_abs:.4f} of max |logit| {scale:.3f}, "
          f"KL mean {kl.mean():.2e} max {kl.max():.2e}")
    if kind == "f16":
        assert agree.all()
        assert max_abs <= 0.01 * scale
        assert kl.max() < 1e-5
    else:
        assert agree.mean() >= 0.9
        assert (margin[~agree] < 0.1).all()
        assert max_abs <= 0.1 * scale
        assert kl.mean() < 1e-3 and kl.max() < 5e-3
    # the decode path (single-token evals on the KV cache) gives the batched prefill's logits
    llm.reset()
    llm.eval(IDS[:30])
    for t in IDS[30:]:
        llm.eval([t])
    step = np.array(llm.scores[:len(IDS)], dtype=np.float32)
    assert np.abs(step[30:] - got[30:]).max() <= 0.01 * scale
