"""``colibri bench gguf --from-seed``: the GGUF of a seeded model written without a checkpoint is
the checkpoint's GGUF, in llama.cpp's qwen3moe layout.

- from the seed (no checkpoint) == from ``write_checkpoint``'s checkpoint, byte for byte, for
  F16, Q8_0 and Q4_0 (same seed: the same bf16-rounded weights, the same encoder);
- the qwen3moe layout: keys (expert width, head_dim), per-head q/k norms, 3-D experts, and the
  Q4_0 tensors decode to the checkpoint's weights within Q4_0's rounding;
- ``expert_draw="codes"``: the Q4_0 experts are the int4 store's own codes (decode to the
  store's dequantized slabs, scale rounded to f16);
- refusals (what llama.cpp's qwen3moe graph cannot compute) and the CLI's;
- llama.cpp's logits on the from-seed GGUF (F16, Q8_0) match transformers' Qwen3MoeForCausalLM
  on the checkpoint, when llama-cpp-python is importable (skipped otherwise).

Needs the ``gguf`` package (the ``peers`` extra); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.bench.gguf import gguf_plan, int4_codes_to_q4_0, plan_bytes, write_gguf, write_gguf_from_seed  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.bench.synthetic import SeededSource, qwen3_moe_config, write_checkpoint  # noqa: E402
from llama_helpers import agreement, import_llama_cpp, llama_logits  # noqa: E402
from llama_helpers import kl as _kl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = qwen3_moe_config(hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                       num_experts_per_tok=2, vocab_size=512, max_position_embeddings=512)
SEED, STD = 11, 0.08
IDS = [int(x) for x in np.random.default_rng(7).integers(1, 512, 40)]
QT = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
      "q4_0": gguf.GGMLQuantizationType.Q4_0}
quiet = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("q3ck") / "ck", CFG, seed=SEED, tokenizer=False, std=STD)


@pytest.fixture(scope="module")
def seed_ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3seed")
    return {t: write_gguf_from_seed(CFG, d / f"seed-{t}.gguf", seed=SEED, std=STD, matrix_type=t, **quiet)["path"]
            for t in ("f16", "q8_0", "q4_0")}


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_from_seed_equals_checkpoint_gguf(kind, tiny_ck, seed_ggufs, tmp_path):
    ck_path = tmp_path / f"ck-{kind}.gguf"
    write_gguf(tiny_ck, ck_path, matrix_type=kind, **quiet)
    ra, a = _tensors(seed_ggufs[kind])
    rb, b = _tensors(ck_path)
    assert list(a) == list(b) == [n for n, *_ in gguf_plan(ModelArgs.from_dict(CFG), kind)]
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name
    kv = {f.name: f.contents() for f in ra.fields.values() if not f.name.startswith("GGUF.")}
    kv_ck = {f.name: f.contents() for f in rb.fields.values() if not f.name.startswith("GGUF.")}
    assert {k: v for k, v in kv.items() if k != "general.name"} == \
        {k: v for k, v in kv_ck.items() if k != "general.name"}
    total = sum(int(t.n_bytes) for t in ra.tensors)
    assert total == plan_bytes(ModelArgs.from_dict(CFG), kind)


def test_qwen3moe_layout_and_q4_0_values(tiny_ck, seed_ggufs):
    r, t = _tensors(seed_ggufs["q4_0"])
    kv = {f.name: f.contents() for f in r.fields.values()}
    assert kv["general.architecture"] == "qwen3moe" and kv["tokenizer.ggml.model"] == "none"
    for key, want in [("qwen3moe.block_count", 2), ("qwen3moe.embedding_length", 128),
                      ("qwen3moe.feed_forward_length", 192), ("qwen3moe.expert_feed_forward_length", 64),
                      ("qwen3moe.attention.head_count", 4), ("qwen3moe.attention.head_count_kv", 2),
                      ("qwen3moe.attention.key_length", 32), ("qwen3moe.attention.value_length", 32),
                      ("qwen3moe.expert_count", 8), ("qwen3moe.expert_used_count", 2), ("qwen3moe.vocab_size", 512),
                      ("qwen3moe.context_length", 512), ("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_0))]:
        assert kv[key] == want, key
    # ggml dimension order (fastest first)
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [128, 64, 8]
    assert list(t["blk.0.ffn_down_exps.weight"].shape) == [64, 128, 8]
    assert list(t["blk.0.attn_q.weight"].shape) == [128, 128] and list(t["blk.0.attn_k.weight"].shape) == [128, 64]
    assert list(t["blk.1.attn_q_norm.weight"].shape) == [32] and list(t["blk.1.attn_k_norm.weight"].shape) == [32]
    F32 = gguf.GGMLQuantizationType.F32
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type == F32 and t["blk.0.attn_k_norm.weight"].tensor_type == F32
    assert t["blk.1.ffn_up_exps.weight"].tensor_type == QT["q4_0"] and t["token_embd.weight"].tensor_type == QT["q4_0"]
    assert t["output.weight"].tensor_type == QT["q8_0"]  # llama-quantize would give Q6_K
    from engine.checkpoint import Checkpoint
    with Checkpoint(tiny_ck) as c:
        w = c.get("model.layers.1.mlp.experts.5.down_proj.weight")
        qn = c.get("model.layers.0.self_attn.k_norm.weight")
    deq = gguf.quants.dequantize(np.asarray(t["blk.1.ffn_down_exps.weight"].data), QT["q4_0"])
    assert deq.shape == (8, 128, 64)
    # Q4_0's step is d = amax / 8: half a step of error, a whole one where the side opposite
    # the block's largest magnitude clips at +7 d
    amax = np.abs(w).reshape(128, 2, 32).max(-1, keepdims=True)
    err = np.abs(deq[5] - w).reshape(128, 2, 32)
    assert (err <= amax / 8 * 1.01).all() and np.median(err / amax) < 1 / 32
    assert np.array_equal(np.asarray(t["blk.0.attn_k_norm.weight"].data), qn)


def test_codes_draw_is_the_int4_store(tmp_path):
    """expert_draw="codes": the Q4_0 experts decode to the int4 store's slabs exactly (scale in
    f16); a q8_0 GGUF of the same draw holds the dequantized codes (Q8_0-rounded)."""
    from engine.expert_store import ExpertStore
    from engine.quant import deinterleave_q4, dequantize
    from engine.bench.synthetic import write_store_from_seed
    cfg = dict(CFG, num_hidden_layers=1)
    out = write_gguf_from_seed(cfg, tmp_path / "c.gguf", seed=3, matrix_type="q4_0", expert_draw="codes", **quiet)
    st = write_store_from_seed(tmp_path / "st", cfg, quant="int4", seed=3, expert_draw="codes", tokenizer=False)
    _, t = _tensors(out["path"])
    src = SeededSource(cfg, 3, expert_draw="codes")
    with ExpertStore(st) as s:
        buf = s.new_buffer()
        for e in (0, 6):
            s.read(0, e, buf)
            v = s.views(buf)
            parts = src.quantized_expert(0, e, "int4", 32)
            for proj, gname in (("gate_proj", "ffn_gate_exps"), ("down_proj", "ffn_down_exps")):
                w = v[f"{proj}.w"]
                w = deinterleave_q4(w) if w.ndim == 3 else w  # format 4: interleaved where the CPU reads that faster
                assert np.array_equal(w, parts[proj]["w"])  # the store holds the drawn codes
                deq = gguf.quants.dequantize(np.asarray(t[f"blk.0.{gname}.weight"].data), QT["q4_0"])[e]
                assert parts[proj]["s"].dtype == np.uint16  # store format 3: half bits, as Q4_0's d
                assert np.array_equal(deq, dequantize(parts[proj], "int4", 32)), (e, proj)
    # the repacking alone, on random codes of a known matrix
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (3, 32), dtype=np.uint8)
    s = rng.random((3, 2), dtype=np.float32) + 0.5
    back = gguf.quants.dequantize(int4_codes_to_q4_0(w, s), QT["q4_0"])
    assert np.array_equal(back, dequantize({"w": w, "s": s.astype(np.float16).astype(np.float32)}, "int4", 32))


@pytest.mark.parametrize("kw, match", [(dict(norm_topk_prob=False), "norm_topk_prob"),
                                       (dict(mlp_only_layers=[1]), "dense MLP layers"),
                                       (dict(attention_bias=True), "attention_bias")])
def test_refuses_what_llama_cpp_qwen3moe_cannot_run(kw, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        write_gguf_from_seed(qwen3_moe_config(**kw), tmp_path / "x.gguf", **quiet)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_cli_from_seed(tmp_path, monkeypatch, capsys):
    """`colibri bench gguf --preset P --from-seed --layers N`: the written file is the plan's
    size and holds the cut preset (the preset's config replaced by a tiny one of the same
    family, so the test stays fast); bad combinations are refused with exit code 2."""
    import argparse
    from engine.bench import gguf as bench_gguf
    from engine.bench import make_synthetic
    monkeypatch.setattr(make_synthetic, "preset_config", lambda name: dict(CFG, num_hidden_layers=3))
    sub = argparse.ArgumentParser().add_subparsers()
    bench_gguf.add_parser(sub)

    def run(*argv):
        a = sub.choices["gguf"].parse_args(list(argv))
        return a.fn(a)
    out = tmp_path / "m.gguf"
    assert run("--preset", "qwen3-30b-a3b", "--from-seed", "--layers", "2", "--type", "q4_0", "--expert-draw", "codes",
               "--out", str(out), "--keep-free-gb", "0") == 0
    assert f"wrote {out}" in capsys.readouterr().out
    r, t = _tensors(out)
    assert {f.name: f.contents() for f in r.fields.values()}["qwen3moe.block_count"] == 2
    assert sum(int(x.n_bytes) for x in r.tensors) == plan_bytes(ModelArgs.from_dict(dict(CFG, num_hidden_layers=2)),
                                                                "q4_0")
    with pytest.raises(FileExistsError):
        run("--preset", "qwen3-30b-a3b", "--from-seed", "--out", str(out), "--keep-free-gb", "0")
    for argv, msg in [(("--from-seed", "--out", str(out)), "--preset"), (("--layers", "2"), "--from-seed only"),
                      (("--preset", "qwen3-30b-a3b", "--from-seed", "--layers", "9"), "--layers 9"),
                      (("--preset", "qwen3-30b-a3b", "--from-seed", "--out", str(tmp_path / "n.gguf"),
                        "--keep-free-gb", "1e9"), "not enough disk")]:
        assert run(*argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
def _transformers_logits(folder) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.Qwen3MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([IDS])).logits[0].numpy()


def _dequantized_checkpoint(gguf_path, ck, dst) -> Path:
    """An HF checkpoint (float32) of the weights a GGUF holds, decoded: what llama.cpp computes
    with, so transformers on it isolates llama.cpp's runtime from the weights' rounding."""
    import shutil
    from safetensors.numpy import save_file
    _, t = _tensors(gguf_path)
    out = {}
    for name, shape, _, src in gguf_plan(ModelArgs.from_dict(CFG), "f16"):
        a = gguf.quants.dequantize(np.asarray(t[name].data), t[name].tensor_type).reshape(shape).astype(np.float32)
        if src[0] == "one":
            out[src[1]] = a
        else:
            for e in range(shape[0]):
                out[f"model.layers.{src[1]}.mlp.experts.{e}.{src[2]}.weight"] = np.ascontiguousarray(a[e])
    dst.mkdir()
    shutil.copy(Path(ck) / "config.json", dst / "config.json")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def hf_logits(tiny_ck):
    return _transformers_logits(tiny_ck)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_llama_cpp_logits_on_seed_gguf_match_transformers(kind, tiny_ck, seed_ggufs, hf_logits, tmp_path):
    """F16: llama.cpp on the from-seed GGUF = transformers on the checkpoint up to f16 rounding
    (layout and conventions exact). Q8_0 / Q4_0: against transformers on the GGUF's decoded
    weights, so only llama.cpp's activation quantization is left (the weights' own rounding
    moves this tiny random model a lot: Q8_0 weights alone give a mean KL ~6e-3 vs the
    checkpoint, Q4_0 ~6e-2, routing flips among near-tied experts; bounded loosely). The Q4_0
    / Q8_0 block layout itself is checked above (byte-equal to gguf.quants of the checkpoint,
    decoded values within a step of the checkpoint's)."""
    llama_cpp = import_llama_cpp()
    ref = hf_logits if kind == "f16" else \
        _transformers_logits(_dequantized_checkpoint(seed_ggufs[kind], tiny_ck, tmp_path / "deq"))
    got, _ = llama_logits(llama_cpp, seed_ggufs[kind], IDS, threads=1)
    assert got.shape == ref.shape == (len(IDS), 512)
    agree, margin, max_abs, scale, kl = agreement(ref, got)
    kl_ck = _kl(hf_logits, got)
    vs = "the checkpoint" if kind == "f16" else "its decoded weights"
    print(f"\nqwen3moe GGUF {kind} (from seed) vs transformers f32 on {vs}, {len(IDS)} positions: top-1 "
          f"agreement {agree.mean():.3f}, max |dlogit| {max_abs:.4f} of max |logit| {scale:.3f}, KL mean "
          f"{kl.mean():.2e} median {np.median(kl):.2e} max {kl.max():.2e}; vs the checkpoint: KL mean "
          f"{kl_ck.mean():.2e}")
    if kind == "f16":
        assert agree.all() and max_abs <= 0.01 * scale and kl.max() < 1e-5
    else:  # a few positions flip a near-tied expert under llama.cpp's Q8_0 activations
        assert agree.mean() >= 0.8 and np.median(kl) < 2e-3 and kl.mean() < 2e-2 and kl.max() < 0.2
        assert kl_ck.mean() < 0.15  # the weights' rounding (see the docstring), not a different model
