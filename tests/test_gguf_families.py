"""GGUF import of ``deepseek2`` files (DeepSeek-V2 / V3, Kimi-K2: MLA) and ``glm4moe`` files
(GLM-4.5: partial rotary, q/k norms, biases): group-limited routing with a score bias, shared
experts and leading dense layers, as llama.cpp's own converter writes them.

The files are made here by llama.cpp's ``convert_hf_to_gguf.py`` from tiny random checkpoints
(F16), so the names, the metadata keys and the split ``attn_k_b`` / ``attn_v_b`` layout are
llama.cpp's. An F16 file imported with f16 dense weights holds the very f16 numbers an f16
store of the same checkpoint holds, so both compute the same logits (to float rounding), here
at top-2 with 4 groups of which 2 are kept: names, MLA sizes, router, its score bias, the
scaling factor and the groups all come through the metadata. Files older than the split carry
``attn_kv_b`` whole; the same weights rewritten that way import to the same store.

Needs $LLAMA_CPP_DIR (a llama.cpp source tree: convert_hf_to_gguf.py and gguf-py; its
``models/ggml-vocab-qwen2.gguf`` gives the tokenizer the converter recognises), torch and
transformers; skipped otherwise. llama.cpp's own logits on these files are compared in
tests/test_gguf_oracle.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")

from llama_helpers import convert_command, llama_cpp_dir  # noqa: E402

from engine.convert import convert_checkpoint  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.gguf_import import GGUFModel, convert_gguf  # noqa: E402
from engine.gguf_tokenizer import tokenizer_files  # noqa: E402
from engine.bench.synthetic import (deepseek_v2_config, deepseek_v3_config, glm4_moe_config, qwen3_next_config,
                                    write_checkpoint)  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import open_model  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (checkpoint folder, its F16 GGUF made by llama.cpp's converter)."""
    d = llama_cpp_dir()
    if d is None:
        pytest.skip("needs $LLAMA_CPP_DIR: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    root = tmp_path_factory.mktemp("ds")
    with GGUFModel(d / "models" / "ggml-vocab-qwen2.gguf") as g:
        tok = tokenizer_files(g)
        vocab = len(g.kv["tokenizer.ggml.tokens"])
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            if family == "deepseek_v3":  # q LoRA, sigmoid router with its score bias, 4 groups of 2 kept
                cfg = deepseek_v3_config(vocab_size=vocab, num_nextn_predict_layers=0)
            elif family == "deepseek_v2":  # V2-Lite-like: plain q_proj, softmax greedy, 2 shared experts
                cfg = deepseek_v2_config(vocab_size=vocab, routed_scaling_factor=1.5)
            elif family == "qwen3_next":  # Gated DeltaNet 2 key / 4 value heads, full attention every 4th
                cfg = qwen3_next_config(vocab_size=vocab, num_hidden_layers=5, eos_token_id=151643)
            else:  # GQA 8/2 with biases and q/k norms, partial rotary 0.5, 2 groups of which 1 kept, layer 0 dense
                cfg = glm4_moe_config(vocab_size=vocab, num_nextn_predict_layers=0)
            ck = write_checkpoint(root / f"ck-{family}", cfg, seed=5, tokenizer=False, std=0.08)
            for name, text in tok.items():
                (ck / name).write_text(text, encoding="utf-8")
            out = root / f"{family}-F16.gguf"
            env = {**os.environ, "PYTHONPATH": str(d / "gguf-py")}
            r = subprocess.run(convert_command(d, ck, out, family), env=env, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-3000:]
            cache[family] = ck, out
        return cache[family]

    return get


def _logits(folder: Path, ids) -> np.ndarray:
    model, store, cache = open_model(folder, kv_dtype="f32")
    try:
        return model.forward(np.asarray(ids), 0, all_logits=True)
    finally:
        cache.close()
        store.close()


def _rewrite(src: Path, dst: Path, *, join_kv_b: bool = False, drop_key: str = "") -> Path:
    """``src`` written again with gguf's writer: MLA's attn_k_b [H, r, dn] / attn_v_b [H, dv, r]
    joined back into attn_kv_b [H * (dn + dv), r] (the layout before llama.cpp split it), or
    one metadata key left out."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", drop_key):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if join_kv_b and t.name.endswith("attn_v_b.weight"):
            continue
        if join_kv_b and t.name.endswith("attn_k_b.weight"):
            kb = np.asarray(t.data)  # [H, r, dn] f16
            vb = np.asarray(tensors[t.name.replace("attn_k_b", "attn_v_b")].data)  # [H, dv, r]
            kv = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1)
            w.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kv.reshape(-1, kv.shape[-1])))
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_f16_gguf_computes_what_the_f16_store_computes(family, made, tmp_path):
    """llama.cpp's F16 file of a tiny DeepSeek or GLM-4 MoE (layer 0 dense, top-2 of 8, shared
    experts) imports to its family (deepseek2: sigmoid + score bias = V3, softmax = V2) with the
    checkpoint's sizes, and computes the f16 store's logits at every position."""
    ck, f = made(family)
    if family != "glm4_moe":
        with GGUFModel(f) as g:
            assert "blk.0.attn_k_b.weight" in g.tensors and "blk.0.attn_kv_b.weight" not in g.tensors
    st = convert_gguf(f, tmp_path / "st", dense_quant="f16")
    ref = convert_checkpoint(ck, tmp_path / "ref", quant="f16", dense_quant="f16")
    from engine.models import family_for
    got_cfg, want_cfg = (json.loads((p / "config.json").read_text()) for p in (st, ck))
    assert got_cfg["model_type"] == family
    got_a, want_a = (family_for(family).ModelArgs.from_dict(c) for c in (got_cfg, want_cfg))
    keys = ("n_group", "topk_group", "n_shared_experts", "moe_layers", "routed_scaling_factor", "norm_topk_prob",
            "scoring_func", "topk_method", "router_bias", "rope_scaling", "num_key_value_heads", "head_dim")
    keys += (("rotary_dim", "qk_norm", "attention_bias") if family == "glm4_moe" else
             ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"))
    for k in keys:
        assert getattr(got_a, k) == getattr(want_a, k), k
    ids = np.random.default_rng(7).integers(1, 151000, 24)
    got, want = _logits(st, ids), _logits(ref, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_qwen3next_f16_gguf_computes_what_the_f16_store_computes(made, tmp_path):
    """llama.cpp's F16 file of a tiny Qwen3-Next (linear layers 0-2 and 4, full attention at 3)
    imports with its linear attention mapped back (in_proj_qkvz from attn_qkv + attn_gate, A_log
    from ssm_a = -exp(A_log), the norms' +1 removed, conv1d unsqueezed) and computes the f16
    store's logits at every position."""
    ck, f = made("qwen3_next")
    st = convert_gguf(f, tmp_path / "st", dense_quant="f16")
    ref = convert_checkpoint(ck, tmp_path / "ref", quant="f16", dense_quant="f16")
    from engine.models import family_for
    got_cfg, want_cfg = (json.loads((p / "config.json").read_text()) for p in (st, ck))
    assert got_cfg["model_type"] == "qwen3_next"
    got_a, want_a = (family_for("qwen3_next").ModelArgs.from_dict(c) for c in (got_cfg, want_cfg))
    for k in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "rotary_dim", "shared_expert_intermediate_size",
              "num_key_value_heads", "head_dim", "norm_topk_prob"):
        assert getattr(got_a, k) == getattr(want_a, k), k
    ids = np.random.default_rng(7).integers(1, 151000, 24)
    got, want = _logits(st, ids), _logits(ref, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_joined_kv_b_file_imports_as_the_split_one(made, tmp_path):
    """A deepseek2 file with attn_kv_b whole (converted before llama.cpp split it) gives the
    store the split file gives: the same dense tensors (names, dtypes, shapes, bytes) and
    metadata, the same expert slabs, the same logits. dense.safetensors is compared tensor by
    tensor, not as a file: safetensors writes its ``__metadata__`` keys in hash-map order,
    which differs from one write to the next, so two writes of the same tensors can differ in
    the header's bytes."""
    _ck, f = made("deepseek_v3")
    old = _rewrite(f, tmp_path / "old.gguf", join_kv_b=True)
    with GGUFModel(old) as g:
        assert "blk.0.attn_kv_b.weight" in g.tensors and "blk.0.attn_k_b.weight" not in g.tensors
    a = convert_gguf(f, tmp_path / "a", dense_quant="f16")
    b = convert_gguf(old, tmp_path / "b", dense_quant="f16")
    from safetensors import safe_open
    with safe_open(a / "dense.safetensors", "np") as fa, safe_open(b / "dense.safetensors", "np") as fb:
        assert fa.metadata() == fb.metadata() and sorted(fa.keys()) == sorted(fb.keys())
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes(), k
    assert (a / "experts/layer_000.bin").read_bytes() == (b / "experts/layer_000.bin").read_bytes()
    ids = np.arange(1, 17)
    assert np.array_equal(_logits(a, ids), _logits(b, ids))


@pytest.mark.parametrize("key", ["deepseek2.attention.kv_lora_rank", "deepseek2.rope.dimension_count",
                                 "deepseek2.expert_feed_forward_length"])
def test_deepseek2_missing_key_is_one_line_naming_it(key, made, tmp_path, capsys):
    from engine.cli.main import main
    _ck, f = made("deepseek_v3")
    bad = _rewrite(f, tmp_path / "bad.gguf", drop_key=key)
    with pytest.raises(ConfigError, match=f"has no {key}"):
        convert_gguf(bad, tmp_path / "st")
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]
    assert not (tmp_path / "st").exists()
