"""``colibri bench gguf`` / ``colibri bench peers``: llama.cpp and transformers beside our engine.

gguf   writes a Q8_0 GGUF of an OLMoE Hugging Face checkpoint in llama.cpp's "olmoe" layout
       (what llama.cpp's convert_hf_to_gguf.py writes for OlmoeForCausalLM), streaming: one
       tensor (or one expert) in memory at a time.

llama.cpp's OLMoE conventions this writer follows (src/models/olmoe.cpp, convert_hf_to_gguf.py):
  - RoPE is NEOX style (rotate-half, as in transformers), so attn_q / attn_k are written
    unpermuted (the Llama converter's permutation does not apply).
  - attn_q_norm / attn_k_norm are full-width vectors applied before the head reshape, both of
    shape {n_embd}: grouped-query attention (k_norm narrower than n_embd) cannot load.
  - the top-k routing weights are never renormalised (norm_w = false in build_moe_ffn), so a
    checkpoint with norm_topk_prob = true would compute something else; refused.
  - no clip_qkv clamp in the graph; refused when set.
  - experts are stacked 3-D tensors: ffn_gate_exps / ffn_up_exps numpy [n_expert, n_ff, n_embd]
    (ggml {n_embd, n_ff, n_expert}), ffn_down_exps numpy [n_expert, n_embd, n_ff];
    ffn_gate_inp numpy [n_expert, n_embd]; the expert width is ``feed_forward_length``.
  - 1-D norms and the router (ffn_gate_inp) stay F32; every other matrix is Q8_0 (F16 when a
    row is not a multiple of 32, as the converter falls back).
  - a vocab-less model: ``tokenizer.ggml.model = "none"`` plus ``olmoe.vocab_size`` (llama.cpp
    then sizes its dummy vocabulary from vocab_size); token ids are fed directly.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..errors import ConfigError
from .common import PeakRss

Q8_BLOCK, Q8_BYTES = 32, 34  # Q8_0: 32 int8 + one f16 scale per block

def _check_llama_compatible(args, where: str) -> None:
    """Raise ConfigError when llama.cpp's olmoe graph would compute a different model."""
    if args.num_key_value_heads != args.num_attention_heads:
        raise ConfigError(f"{where}: num_key_value_heads ({args.num_key_value_heads}) != num_attention_heads "
                          f"({args.num_attention_heads}); llama.cpp's olmoe architecture has k_norm of width "
                          f"n_embd and cannot load a grouped-query OLMoE")
    if args.norm_topk_prob:
        raise ConfigError(f"{where}: norm_topk_prob = true; llama.cpp's olmoe graph never renormalises the "
                          f"top-k routing weights, so the GGUF would be a different model")
    if args.clip_qkv is not None:
        raise ConfigError(f"{where}: clip_qkv = {args.clip_qkv}; llama.cpp's olmoe graph has no q/k/v clamp")

def _q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 bytes of a float32 matrix (rows quantized independently), via gguf.quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    return quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType.Q8_0)

GGUF_TYPES = ("q8_0", "f16")

def gguf_plan(args, matrix_type: str = "q8_0") -> list[tuple[str, tuple[int, ...], str, tuple]]:
    """The tensors of the olmoe GGUF in write order: (gguf name, numpy shape, kind, source).

    kind: "f32" (norms, router), else ``matrix_type`` ("q8_0" falls back to "f16" for a row
    length that is not a multiple of 32). source: ("one", hf_name) or ("experts", layer, proj).
    """
    if matrix_type not in GGUF_TYPES:
        raise ConfigError(f"GGUF type {matrix_type!r}: choose one of {', '.join(GGUF_TYPES)}")

    def kind_of(cols: int) -> str:
        return "q8_0" if matrix_type == "q8_0" and cols % Q8_BLOCK == 0 else "f16"
    D, I, E, V = args.hidden_size, args.intermediate_size, args.num_experts, args.vocab_size
    plan = [("token_embd.weight", (V, D), kind_of(D), ("one", "model.embed_tokens.weight"))]
    for i in range(args.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (D,), "f32", ("one", p + "input_layernorm.weight")),
            (b + "attn_q.weight", (args.q_dim, D), kind_of(D), ("one", p + "self_attn.q_proj.weight")),
            (b + "attn_k.weight", (args.kv_dim, D), kind_of(D), ("one", p + "self_attn.k_proj.weight")),
            (b + "attn_v.weight", (args.kv_dim, D), kind_of(D), ("one", p + "self_attn.v_proj.weight")),
            (b + "attn_output.weight", (D, args.q_dim), kind_of(args.q_dim),
             ("one", p + "self_attn.o_proj.weight")),
            (b + "attn_q_norm.weight", (args.q_dim,), "f32", ("one", p + "self_attn.q_norm.weight")),
            (b + "attn_k_norm.weight", (args.kv_dim,), "f32", ("one", p + "self_attn.k_norm.weight")),
            (b + "ffn_norm.weight", (D,), "f32", ("one", p + "post_attention_layernorm.weight")),
            (b + "ffn_gate_inp.weight", (E, D), "f32", ("one", p + "mlp.gate.weight")),
            (b + "ffn_gate_exps.weight", (E, I, D), kind_of(D), ("experts", i, "gate_proj")),
            (b + "ffn_up_exps.weight", (E, I, D), kind_of(D), ("experts", i, "up_proj")),
            (b + "ffn_down_exps.weight", (E, D, I), kind_of(I), ("experts", i, "down_proj")),
        ]
    plan.append(("output_norm.weight", (D,), "f32", ("one", "model.norm.weight")))
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    plan.append(("output.weight", (V, D), kind_of(D), ("one", lm)))
    return plan

def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    if kind == "q8_0":
        return n // Q8_BLOCK * Q8_BYTES
    return n * (2 if kind == "f16" else 4)

def _encode(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "q8_0":
        return _q8_0(x)
    return x.astype(np.float16 if kind == "f16" else np.float32, copy=False)

def _produce(ck, shape, kind, src, row_chunk: int = 8192) -> np.ndarray:
    """The encoded bytes/values of one planned tensor; large matrices are encoded in row
    chunks and experts one at a time, so peak memory is one source matrix plus the output."""
    if src[0] == "experts":
        _, layer, proj = src
        E = shape[0]
        out = None
        for e in range(E):
            x = ck.get(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
            enc = _encode(x, kind)
            if out is None:
                out = np.empty((E, *enc.shape), enc.dtype)
            out[e] = enc
            del x, enc
        return out
    x = ck.get(src[1])
    if x.ndim == 2 and kind == "q8_0" and x.shape[0] > row_chunk:
        out = np.empty((x.shape[0], x.shape[1] // Q8_BLOCK * Q8_BYTES), np.uint8)
        for r in range(0, x.shape[0], row_chunk):
            out[r:r + row_chunk] = _q8_0(x[r:r + row_chunk])
        return out
    return _encode(x, kind)

def write_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, matrix_type: str = "q8_0",
               overwrite: bool = False, log=print) -> dict:
    """Write a Q8_0 (or, with ``matrix_type="f16"``, F16) GGUF in llama.cpp's "olmoe"
    architecture of an OLMoE HF checkpoint.

    Tensors are read one at a time (pread through engine.checkpoint.Checkpoint, page cache
    dropped behind) and written as soon as they are encoded, so peak RSS is about one stacked
    expert tensor in Q8_0 plus one source matrix in float32, whatever the model size. The file
    is written to ``out + ".partial"``, fsynced, then renamed.

    Returns: {"path", "bytes", "tensors", "seconds", "params"}.
    Raises:
        ConfigError: the model uses something llama.cpp's olmoe graph does not (GQA,
            norm_topk_prob, clip_qkv); CheckpointError: the checkpoint is incomplete;
        FileExistsError: ``out`` exists and ``overwrite`` is false;
        ImportError: the ``gguf`` package is missing (pip install -e .[peers]).
    """
    import gguf
    from ..checkpoint import Checkpoint
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass --overwrite to replace it)")
    t0 = time.perf_counter()
    ck = Checkpoint(checkpoint)
    try:
        a = ck.args
        _check_llama_compatible(a, str(Path(checkpoint) / "config.json"))
        plan = gguf_plan(a, matrix_type)
        partial = out.with_name(out.name + ".partial")
        out.parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.OLMOE])
        w.add_name(Path(checkpoint).name)
        w.add_context_length(a.max_position_embeddings)
        w.add_embedding_length(a.hidden_size)
        w.add_block_count(a.num_hidden_layers)
        w.add_feed_forward_length(a.intermediate_size)
        w.add_head_count(a.num_attention_heads)
        w.add_head_count_kv(a.num_key_value_heads)
        w.add_rope_freq_base(a.rope_theta)
        w.add_layer_norm_rms_eps(a.rms_norm_eps)
        w.add_expert_count(a.num_experts)
        w.add_expert_used_count(a.num_experts_per_tok)
        w.add_vocab_size(a.vocab_size)
        ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if matrix_type == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
        w.add_file_type(ftype)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_tokenizer_model("none")
        raw = {"f32": None, "f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0}
        np_dt = {"f32": np.float32, "f16": np.float16, "q8_0": np.float32}
        for name, shape, kind, _ in plan:
            w.add_tensor_info(name, shape, np.dtype(np_dt[kind]), _nbytes(shape, kind), raw_dtype=raw[kind])
        try:
            w.write_header_to_file(partial)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for k, (name, shape, kind, src) in enumerate(plan):
                data = _produce(ck, shape, kind, src)
                if data.nbytes != _nbytes(shape, kind):
                    raise CheckpointError(f"{checkpoint}: tensor {name} encoded to {data.nbytes} bytes, "
                                          f"expected {_nbytes(shape, kind)}")
                w.write_tensor_data(data)
                del data
                if src[0] == "experts" and src[2] == "down_proj":
                    log(f"  layer {src[1] + 1}/{a.num_hidden_layers} written")
            f = w.fout[0]
            f.flush()
            os.fsync(f.fileno())
            w.close()
            os.replace(partial, out)
            from ..fsutil import fsync_dir
            fsync_dir(out.parent)
        except BaseException:
            w.close()
            partial.unlink(missing_ok=True)
            raise
        n_params = sum(int(np.prod(s)) for _, s, _, _ in plan)
        return {"path": str(out), "bytes": out.stat().st_size, "tensors": len(plan),
                "seconds": time.perf_counter() - t0, "params": n_params}
    finally:
        ck.close()

def require_modules(modules, what: str) -> None:
    """Raise ConfigError naming the missing optional package(s) and the extra to install."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extra = ".[parity] (torch, transformers)" if {"torch", "transformers"} & set(missing) else \
            ".[peers] (llama-cpp-python, gguf)"
        raise ConfigError(f"{what} needs {', '.join(missing)}: pip install -e {extra}")

def cmd_gguf(a) -> int:
    """``colibri bench gguf``: write the GGUF, print size, time and peak RSS."""
    require_modules(("gguf",), "colibri bench gguf")
    with PeakRss() as pr:
        r = write_gguf(a.checkpoint, a.out, matrix_type=a.type, overwrite=a.overwrite)
    r["peak_rss_bytes"] = max(pr.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"wrote {r['path']}: {r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors, {r['params'] / 1e9:.3f} B "
          f"params in {r['seconds']:.0f} s; peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB")
    return 0


def add_parser(bs) -> None:
    """Register `gguf` under ``colibri bench``."""
    g = bs.add_parser("gguf", help="write a Q8_0 GGUF (llama.cpp olmoe) of an OLMoE HF checkpoint")
    g.add_argument("--checkpoint", default="bench/work/1b-hf")
    g.add_argument("--out", default="bench/work/1b-q8_0.gguf")
    g.add_argument("--type", choices=GGUF_TYPES, default="q8_0", help="matrix type (norms and router stay F32)")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(fn=cmd_gguf)
