"""``colibri bench gguf`` / ``colibri bench peers``: llama.cpp and transformers beside our engine.

gguf   writes a GGUF (Q8_0, Q4_0 or F16 matrices) in llama.cpp's "olmoe" layout of an OLMoE
       checkpoint, or in its "qwen3moe" layout of a Qwen3-MoE one, streaming: one tensor (or one
       layer's experts) in memory at a time. The source is a Hugging Face checkpoint
       (``--checkpoint``) or, with ``--preset P --from-seed``, the seeded random weights that
       ``bench make-synthetic`` writes (engine.bench.synthetic.SeededSource: the same bf16-rounded
       numbers as ``write_checkpoint`` and ``write_store_from_seed`` for the same seed), for
       shapes whose bf16 checkpoint does not fit the disk (Qwen3-30B-A3B: 61 GB).

llama.cpp's conventions this writer follows (src/models/olmoe.cpp, src/models/qwen3moe.cpp,
convert_hf_to_gguf.py / conversion/qwen.py):
  - RoPE is NEOX style (rotate-half, as in transformers), so attn_q / attn_k are written
    unpermuted (the Llama converter's permutation does not apply).
  - olmoe: attn_q_norm / attn_k_norm are full-width vectors applied before the head reshape,
    both of shape {n_embd}: grouped-query attention (k_norm narrower than n_embd) cannot load;
    the top-k routing weights are never renormalised (norm_w = false in build_moe_ffn), so a
    checkpoint with norm_topk_prob = true would compute something else; refused. No clip_qkv.
  - qwen3moe: attn_q_norm / attn_k_norm are per-head vectors {head_dim} (Qwen3's q/k norm),
    GQA allowed, ``qwen3moe.attention.key_length`` = ``value_length`` = head_dim; the top-k
    weights are always renormalised (norm_w = true), so norm_topk_prob = false is refused; every
    layer is MoE (mlp_only_layers / decoder_sparse_step != 1 refused), no sliding window, no
    q/k/v bias; ``feed_forward_length`` = intermediate_size and ``expert_feed_forward_length``
    = moe_intermediate_size (the expert width).
  - experts are stacked 3-D tensors: ffn_gate_exps / ffn_up_exps numpy [n_expert, n_ff, n_embd]
    (ggml {n_embd, n_ff, n_expert}), ffn_down_exps numpy [n_expert, n_embd, n_ff];
    ffn_gate_inp numpy [n_expert, n_embd].
  - 1-D norms and the router (ffn_gate_inp) stay F32; every other matrix is of the chosen type
    (F16 when a row is not a multiple of 32, as the converter falls back), except that with Q4_0
    ``output.weight`` is Q8_0: ``llama-quantize ... Q4_0`` would give it Q6_K, which gguf-py
    cannot write in numpy; Q8_0 is the nearest larger type it can.
  - the checkpoint's byte-level BPE tokenizer when it has a tokenizer.json (tokenizer.ggml.model
    "gpt2", pre "gpt-2"), else a vocab-less model: ``tokenizer.ggml.model = "none"`` plus
    ``<arch>.vocab_size`` (llama.cpp then sizes its dummy vocabulary from vocab_size); token ids
    are fed directly.

Q4_0 (ggml block_q4_0): per 32 values one f16 scale d = v / -8 (v the value of largest
magnitude) and 16 bytes of nibbles q + 8 (element j in the low nibble of byte j, element j + 16
in the high one), value = (nibble - 8) * d, quantized here by gguf.quants (ggml's reference
quantize_row_q4_0). With ``--expert-draw codes`` (make-synthetic's fast draw, int4 codes and
group-32 scales drawn directly) the experts are not re-quantized: the store's int4 codes (value
= (nibble - 8) * scale, the same mapping) are repacked into Q4_0 blocks with the scale rounded
to f16, so llama.cpp computes with the store's very expert weights.
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

BLOCK = 32  # Q8_0 / Q4_0 values per block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # Q8_0: 32 int8 + f16 scale; Q4_0: 16 nibble bytes + f16 scale
Q8_BLOCK, Q8_BYTES = BLOCK, BLOCK_BYTES["q8_0"]
GGUF_TYPES = ("q8_0", "q4_0", "f16")
LLAMA_ARCHS = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe"}  # our model_type -> llama.cpp architecture


def llama_arch(args, where: str) -> str:
    """llama.cpp's architecture name for ``args``; raise ConfigError when llama.cpp's graph for
    it would compute a different model (or there is none here)."""
    arch = LLAMA_ARCHS.get(args.model_type)
    if arch is None:
        raise ConfigError(f"{where}: model_type {args.model_type!r}: the GGUF writer knows "
                          f"{', '.join(LLAMA_ARCHS)} (llama.cpp {', '.join(LLAMA_ARCHS.values())})")
    if args.clip_qkv is not None:
        raise ConfigError(f"{where}: clip_qkv = {args.clip_qkv}; llama.cpp's {arch} graph has no q/k/v clamp")
    if arch == "olmoe":
        if args.num_key_value_heads != args.num_attention_heads:
            raise ConfigError(f"{where}: num_key_value_heads ({args.num_key_value_heads}) != num_attention_heads "
                              f"({args.num_attention_heads}); llama.cpp's olmoe architecture has k_norm of width "
                              f"n_embd and cannot load a grouped-query OLMoE")
        if args.norm_topk_prob:
            raise ConfigError(f"{where}: norm_topk_prob = true; llama.cpp's olmoe graph never renormalises the "
                              f"top-k routing weights, so the GGUF would be a different model")
        return arch
    if not args.norm_topk_prob:
        raise ConfigError(f"{where}: norm_topk_prob = false; llama.cpp's qwen3moe graph always renormalises "
                          f"the top-k routing weights, so the GGUF would be a different model")
    if tuple(args.moe_layers) != tuple(range(args.num_hidden_layers)):
        raise ConfigError(f"{where}: dense MLP layers (mlp_only_layers {list(args.mlp_only_layers)}, "
                          f"decoder_sparse_step {args.decoder_sparse_step}); llama.cpp's qwen3moe graph has "
                          f"experts in every layer")
    if any(args.layer_windows):
        raise ConfigError(f"{where}: sliding-window attention; llama.cpp's qwen3moe graph has none")
    if args.attention_bias:
        raise ConfigError(f"{where}: attention_bias = true; not written for llama.cpp's qwen3moe")
    return arch


def _check_llama_compatible(args, where: str) -> None:
    """Raise ConfigError when llama.cpp's graph would compute a different model."""
    llama_arch(args, where)


def _encode_q(x: np.ndarray, kind: str) -> np.ndarray:
    """Q8_0 / Q4_0 bytes of a float32 matrix (rows quantized independently), via gguf.quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    qt = GGMLQuantizationType.Q8_0 if kind == "q8_0" else GGMLQuantizationType.Q4_0
    return quantize(np.ascontiguousarray(x, dtype=np.float32), qt)


def _q8_0(x: np.ndarray) -> np.ndarray:
    return _encode_q(x, "q8_0")


def int4_codes_to_q4_0(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Our int4 (engine.quant: nibble q + 8, low nibble = even column, high = odd, one scale per
    group of 32 along the row: half bits in store format 3, float32 before) as Q4_0 bytes
    [O, N / 32 * 18]: the same nibbles regrouped (element j low, j + 16 high), the scale as f16
    (exactly ours for a format-3 store; rounded from float32 for an older one).

    Raises: ValueError: the scales are not one per 32 columns.
    """
    O, half = w.shape
    N = half * 2
    if s.shape != (O, N // BLOCK):
        raise ValueError(f"int4 -> Q4_0 needs group size {BLOCK}: scales {s.shape} for a [{O}, {N}] matrix")
    nib = np.empty((O, N), np.uint8)
    nib[:, 0::2] = w & 0x0F
    nib[:, 1::2] = w >> 4
    nib = nib.reshape(O, N // BLOCK, 2, BLOCK // 2)
    out = np.empty((O, N // BLOCK, BLOCK_BYTES["q4_0"]), np.uint8)
    s16 = s.view(np.float16) if s.dtype == np.uint16 else s.astype(np.float16)
    out[:, :, :2] = np.ascontiguousarray(s16).view(np.uint8).reshape(O, N // BLOCK, 2)
    out[:, :, 2:] = nib[:, :, 0, :] | (nib[:, :, 1, :] << 4)
    return out.reshape(O, -1)


def gguf_plan(args, matrix_type: str = "q8_0") -> list[tuple[str, tuple[int, ...], str, tuple]]:
    """The tensors of the GGUF in write order: (gguf name, numpy shape, kind, source).

    kind: "f32" (norms, router), else ``matrix_type`` ("q8_0" / "q4_0" fall back to "f16" for a
    row length that is not a multiple of 32; output.weight is "q8_0" under "q4_0"). source:
    ("one", hf_name) or ("experts", layer, proj). The architecture is llama_arch(args).
    """
    if matrix_type not in GGUF_TYPES:
        raise ConfigError(f"GGUF type {matrix_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    arch = LLAMA_ARCHS.get(args.model_type, "olmoe")

    def kind_of(cols: int, t: str = matrix_type) -> str:
        return t if t != "f16" and cols % BLOCK == 0 else "f16"
    D, E, V = args.hidden_size, args.num_experts, args.vocab_size
    I = args.moe_intermediate_size if arch == "qwen3moe" else args.intermediate_size
    qn, kn = (args.head_dim, args.head_dim) if arch == "qwen3moe" else (args.q_dim, args.kv_dim)
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
            (b + "attn_q_norm.weight", (qn,), "f32", ("one", p + "self_attn.q_norm.weight")),
            (b + "attn_k_norm.weight", (kn,), "f32", ("one", p + "self_attn.k_norm.weight")),
            (b + "ffn_norm.weight", (D,), "f32", ("one", p + "post_attention_layernorm.weight")),
            (b + "ffn_gate_inp.weight", (E, D), "f32", ("one", p + "mlp.gate.weight")),
            (b + "ffn_gate_exps.weight", (E, I, D), kind_of(D), ("experts", i, "gate_proj")),
            (b + "ffn_up_exps.weight", (E, I, D), kind_of(D), ("experts", i, "up_proj")),
            (b + "ffn_down_exps.weight", (E, D, I), kind_of(I), ("experts", i, "down_proj")),
        ]
    plan.append(("output_norm.weight", (D,), "f32", ("one", "model.norm.weight")))
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    plan.append(("output.weight", (V, D), kind_of(D, "q8_0" if matrix_type == "q4_0" else matrix_type),
                 ("one", lm)))
    return plan


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    if kind in BLOCK_BYTES:
        return n // BLOCK * BLOCK_BYTES[kind]
    return n * (2 if kind == "f16" else 4)


def plan_bytes(args, matrix_type: str) -> int:
    """Bytes of the tensor data of gguf_plan(args, matrix_type) (the file adds its header)."""
    return sum(_nbytes(s, k) for _, s, k, _ in gguf_plan(args, matrix_type))


def _encode(x: np.ndarray, kind: str, row_chunk: int = 8192) -> np.ndarray:
    """``kind`` encoding of float32 ``x``; a large matrix is quantized in row chunks (bounded
    temporaries)."""
    if kind in BLOCK_BYTES:
        if x.ndim == 2 and x.shape[0] > row_chunk:
            out = np.empty((x.shape[0], x.shape[1] // BLOCK * BLOCK_BYTES[kind]), np.uint8)
            for r in range(0, x.shape[0], row_chunk):
                out[r:r + row_chunk] = _encode_q(x[r:r + row_chunk], kind)
            return out
        return _encode_q(x, kind)
    return x.astype(np.float16 if kind == "f16" else np.float32, copy=False)


def _layer_experts(src, layer: int, kinds: dict[str, str], E: int) -> dict[str, np.ndarray]:
    """The three stacked expert tensors of ``layer`` ({proj: [E, ...] encoded}), each expert read
    once (``src.expert``). A source drawing int4 codes directly (SeededSource with
    expert_draw="codes") gives them as codes: repacked into Q4_0 for a "q4_0" tensor, else
    dequantized and encoded (the store's exact weights)."""
    from ..quant import dequantize
    out: dict[str, np.ndarray] = {}
    for e in range(E):
        parts = src.quantized_expert(layer, e, "int4", BLOCK) if hasattr(src, "quantized_expert") else None
        ws = None if parts is not None else src.expert(layer, e)
        for proj, kind in kinds.items():
            if parts is not None:
                q = parts[proj]
                if kind == "q4_0":
                    enc = int4_codes_to_q4_0(q["w"], q["s"])
                else:
                    enc = _encode(dequantize(q, "int4", BLOCK), kind)
            else:
                enc = _encode(ws[proj], kind)
            if proj not in out:
                out[proj] = np.empty((E, *enc.shape), enc.dtype)
            out[proj][e] = enc
        del parts, ws
    return out


def _add_vocab(w, folder: Path, vocab_size: int, where: str) -> None:
    """The byte-level BPE tokenizer of ``folder`` (tokenizer.json, tokenizer_config.json) as GGUF
    metadata: tokenizer.ggml.model "gpt2" with the GPT-2 pre-tokenizer (what a ByteLevel
    pre-tokenizer with its default regex is), tokens padded to ``vocab_size`` as llama.cpp's
    converter pads them, merges, BOS / EOS and the chat template."""
    import json

    import gguf
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    m, pre = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
    if m.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ConfigError(f"{folder / 'tokenizer.json'}: only a byte-level BPE tokenizer with the GPT-2 "
                          f"pre-tokenizer is written into the GGUF")
    ids = {**m["vocab"], **{t["content"]: t["id"] for t in tj.get("added_tokens", [])}}
    special = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in ids.items():
        if i >= vocab_size:
            raise ConfigError(f"{where}: token id {i} is beyond vocab_size {vocab_size}")
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([x if isinstance(x, str) else " ".join(x) for x in m.get("merges", [])])
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        t = tc.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        if isinstance(t, str) and t in ids:
            add(ids[t])
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if isinstance(tc.get("chat_template"), str):
        w.add_chat_template(tc["chat_template"])
    elif (folder / "chat_template.jinja").is_file():
        w.add_chat_template((folder / "chat_template.jinja").read_text(encoding="utf-8"))


def _write(src, out: Path, *, matrix_type: str, overwrite: bool, name: str, where: str, log,
           vocab_dir: Path | None = None) -> dict:
    """Write ``src`` (Checkpoint or SeededSource: ``args``, ``get(hf_name)``, ``expert(l, e)``)
    as a GGUF at ``out`` (via ``out.partial``, fsynced, renamed); with the tokenizer of
    ``vocab_dir`` when it holds a tokenizer.json, else vocabulary-less."""
    import gguf
    from ..fsutil import fsync_dir
    t0 = time.perf_counter()
    a = src.args
    arch = llama_arch(a, where)
    plan = gguf_plan(a, matrix_type)
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(None, arch)
    w.add_name(name)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_block_count(a.num_hidden_layers)
    w.add_feed_forward_length(a.intermediate_size)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(a.moe_intermediate_size)
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_expert_count(a.num_experts)
    w.add_expert_used_count(a.num_experts_per_tok)
    w.add_vocab_size(a.vocab_size)
    ftype = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
             "f16": gguf.LlamaFileType.MOSTLY_F16}[matrix_type]
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab_dir is not None and (Path(vocab_dir) / "tokenizer.json").is_file():
        _add_vocab(w, Path(vocab_dir), a.vocab_size, where)
    else:
        w.add_tokenizer_model("none")
    raw = {"f32": None, "f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0,
           "q4_0": gguf.GGMLQuantizationType.Q4_0}
    np_dt = {"f32": np.float32, "f16": np.float16, "q8_0": np.float32, "q4_0": np.float32}
    for tname, shape, kind, _ in plan:
        w.add_tensor_info(tname, shape, np.dtype(np_dt[kind]), _nbytes(shape, kind), raw_dtype=raw[kind])
    try:
        w.write_header_to_file(partial)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        layer_cache: dict[str, np.ndarray] = {}
        for tname, shape, kind, srcref in plan:
            if srcref[0] == "experts":
                _, layer, proj = srcref
                if not layer_cache:
                    kinds = {r[2]: k for _, _, k, r in plan if r[0] == "experts" and r[1] == layer}
                    layer_cache = _layer_experts(src, layer, kinds, a.num_experts)
                data = layer_cache.pop(proj)
            else:
                data = _encode(src.get(srcref[1]), kind)
            if data.nbytes != _nbytes(shape, kind):
                raise CheckpointError(f"{where}: tensor {tname} encoded to {data.nbytes} bytes, "
                                      f"expected {_nbytes(shape, kind)}")
            w.write_tensor_data(data)
            del data
            if srcref[0] == "experts" and not layer_cache:
                log(f"  layer {srcref[1] + 1}/{a.num_hidden_layers} written ({time.perf_counter() - t0:.0f} s)")
        f = w.fout[0]
        f.flush()
        os.fsync(f.fileno())
        w.close()
        os.replace(partial, out)
        fsync_dir(out.parent)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    n_params = sum(int(np.prod(s)) for _, s, _, _ in plan)
    return {"path": str(out), "bytes": out.stat().st_size, "tensors": len(plan),
            "seconds": time.perf_counter() - t0, "params": n_params, "arch": arch}


def write_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, matrix_type: str = "q8_0",
               overwrite: bool = False, log=print) -> dict:
    """Write a Q8_0 (``matrix_type="q4_0"``: Q4_0, ``"f16"``: F16) GGUF of an OLMoE (llama.cpp
    "olmoe") or Qwen3-MoE ("qwen3moe") HF checkpoint.

    Tensors are read one at a time (pread through engine.checkpoint.Checkpoint, page cache
    dropped behind) and written as soon as they are encoded, so peak RSS is about one layer's
    stacked expert tensors encoded plus one source matrix in float32, whatever the model size.
    The file is written to ``out + ".partial"``, fsynced, then renamed.

    Returns: {"path", "bytes", "tensors", "seconds", "params", "arch"}.
    Raises:
        ConfigError: the model uses something llama.cpp's graph does not (see llama_arch);
        CheckpointError: the checkpoint is incomplete;
        FileExistsError: ``out`` exists and ``overwrite`` is false;
        ImportError: the ``gguf`` package is missing (pip install -e .[peers]).
    """
    from ..checkpoint import Checkpoint
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass --overwrite to replace it)")
    ck = Checkpoint(checkpoint)
    try:
        return _write(ck, out, matrix_type=matrix_type, overwrite=overwrite, name=Path(checkpoint).name,
                      where=str(Path(checkpoint) / "config.json"), log=log, vocab_dir=Path(checkpoint))
    finally:
        ck.close()


def write_gguf_from_seed(config: dict, out: str | os.PathLike, *, seed: int = 0, matrix_type: str = "q4_0",
                         expert_draw: str = "exact", dtype: str = "bf16", std: float = 0.05,
                         overwrite: bool = False, name: str | None = None, log=print) -> dict:
    """Write the GGUF of the seeded random model ``config`` straight from the seed, no checkpoint:
    the weights of ``write_checkpoint(folder, config, seed, dtype, std=std)`` (and of
    ``write_store_from_seed(..., seed, dtype, std, expert_draw=expert_draw)``), so the file is
    byte-identical to ``write_gguf`` of that checkpoint (``expert_draw="exact"``).

    ``expert_draw="codes"``: the experts are the int4 codes and group-32 scales that
    ``write_store_from_seed(expert_draw="codes")`` draws (SeededSource.quantized_expert), copied
    into Q4_0 blocks (scale rounded to f16) for ``matrix_type="q4_0"``, dequantized and encoded
    otherwise. ~100x less CPU for the experts than the float draw + quantization.

    Peak RSS: the largest dense tensor in float32 (the embedding) plus one layer's experts
    encoded. Returns / raises: as write_gguf (ConfigError for an invalid config).
    """
    from .synthetic import SeededSource
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass --overwrite to replace it)")
    src = SeededSource(config, seed, dtype, std, expert_draw)
    return _write(src, out, matrix_type=matrix_type, overwrite=overwrite, name=name or out.stem,
                  where=f"seeded {config.get('model_type')} config", log=log)


def require_modules(modules, what: str) -> None:
    """Raise ConfigError naming the missing optional package(s) and the extra to install."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extra = ".[parity] (torch, transformers)" if {"torch", "transformers"} & set(missing) else \
            ".[peers] (llama-cpp-python, gguf)"
        raise ConfigError(f"{what} needs {', '.join(missing)}: pip install -e {extra}")

def cmd_gguf(a) -> int:
    """``colibri bench gguf``: write the GGUF (of a checkpoint, or of a preset from the seed),
    print size, time and peak RSS. Returns 0, or 2 on bad arguments / too little disk."""
    import shutil
    import sys
    require_modules(("gguf",), "colibri bench gguf")
    if a.from_seed != (a.preset is not None):
        print("--from-seed and --preset go together (a preset's seeded weights); without them give "
              "--checkpoint", file=sys.stderr)
        return 2
    if not a.from_seed and (a.layers or a.expert_draw != "exact"):
        print("--layers / --expert-draw apply to --from-seed only", file=sys.stderr)
        return 2
    with PeakRss() as pr:
        if a.from_seed:
            from ..config import ModelArgs
            from .make_synthetic import cut_layers, preset_config
            try:
                cfg, name = cut_layers(preset_config(a.preset), a.preset, a.layers)
            except ValueError as e:
                print(e, file=sys.stderr)
                return 2
            out = Path(a.out or f"bench/work/{name}-{a.type}"
                       + ("-codes" if a.expert_draw == "codes" else "") + ".gguf")
            need = plan_bytes(ModelArgs.from_dict(cfg), a.type)
            out.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(out.parent).free
            if free < need * 1.01 + a.keep_free_gb * 1e9:
                print(f"not enough disk: the GGUF takes {need / 1e9:.2f} GB, {free / 1e9:.1f} GB free at "
                      f"{out.parent} (keeping {a.keep_free_gb:g} GB free)", file=sys.stderr)
                return 2
            print(f"writing {out} ({need / 1e9:.2f} GB, {a.type}, seed {a.seed}, expert draw {a.expert_draw})",
                  flush=True)
            r = write_gguf_from_seed(cfg, out, seed=a.seed, matrix_type=a.type, expert_draw=a.expert_draw,
                                     overwrite=a.overwrite, name=name,
                                     log=lambda m: print(m, flush=True))
        else:
            r = write_gguf(a.checkpoint, a.out or "bench/work/1b-q8_0.gguf", matrix_type=a.type,
                           overwrite=a.overwrite)
    r["peak_rss_bytes"] = max(pr.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"wrote {r['path']}: {r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors, {r['params'] / 1e9:.3f} B "
          f"params in {r['seconds']:.0f} s; peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB")
    return 0


def add_parser(bs) -> None:
    """Register `gguf` under ``colibri bench``."""
    from .synthetic import EXPERT_DRAWS
    from .make_synthetic import preset_names
    g = bs.add_parser("gguf", help="write a GGUF (llama.cpp olmoe / qwen3moe; Q8_0, Q4_0 or F16) of an HF "
                      "checkpoint, or of a preset's seeded weights (--preset P --from-seed)")
    g.add_argument("--checkpoint", default="bench/work/1b-hf")
    g.add_argument("--out", default=None,
                   help="the GGUF (default bench/work/1b-q8_0.gguf, or bench/work/<preset>[-<N>l]-<type>"
                        "[-codes].gguf with --from-seed)")
    g.add_argument("--type", choices=GGUF_TYPES, default="q8_0",
                   help="matrix type (norms and router stay F32; with q4_0 output.weight is Q8_0)")
    g.add_argument("--preset", choices=preset_names(), default=None,
                   help="with --from-seed: the make-synthetic preset whose seeded weights to write")
    g.add_argument("--from-seed", action="store_true",
                   help="no checkpoint: the weights `bench make-synthetic --preset P --seed S` writes (the "
                        "same bf16-rounded numbers as its store, e.g. with --direct-store)")
    g.add_argument("--seed", type=int, default=0, help="--from-seed: the seed (make-synthetic's --seed)")
    g.add_argument("--layers", type=int, default=0, help="--from-seed: keep the first N layers (as make-synthetic)")
    g.add_argument("--expert-draw", choices=EXPERT_DRAWS, default="exact",
                   help="--from-seed: as make-synthetic --direct-store; 'codes' copies the store's int4 "
                        "expert codes into Q4_0 (fast, the store's exact expert weights)")
    g.add_argument("--keep-free-gb", type=float, default=3.0,
                   help="--from-seed: refuse unless this much disk stays free afterwards (GB)")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(fn=cmd_gguf)
