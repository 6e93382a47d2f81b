"""Convert a Hugging Face OLMoE checkpoint into a colibri expert store.

Store layout (folder)::

    manifest.json        format name/version, model_type, quant, alignment, slab layout,
                         per layer: slot bytes; per expert: file, offset, length, crc32
    dense.safetensors    embeddings, attention, norms, router, lm_head (canonical names)
    experts/layer_NNN.bin  one 4096-aligned contiguous slab per expert holding gate_proj,
                         up_proj, down_proj and their scales (one read loads one expert: the
                         seeds' "consolidated expert I/O")
    config.json, tokenizer files, generation_config.json   copied from the source

The conversion streams tensor by tensor (peak RSS ~ the dense weights plus one expert) and
publishes atomically: everything is written to ``DST.partial/``, fsynced, and renamed to DST.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from .checkpoint import Checkpoint, hf_names
from .errors import CheckpointError, EngineError
from .events import LoadProgress
from .paths import fsync_dir
from .quant import ALIGN, QUANTS, quantize, slab_layout

FORMAT_NAME = "colibri-expert-store"
FORMAT_VERSION = 1
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "README.md", "LICENSE")


class ConversionCancelled(EngineError):
    """The user cancelled a conversion; nothing was published."""

    kind = "cancelled"


def dense_quant_for(quant: str) -> str:
    """Default quantization of the resident dense matrices (attention, embedding, lm_head):
    int8 for the int8 and int4 stores, else exact. ``convert --dense-quant`` overrides it."""
    return "int8" if quant in ("int8", "int4") else quant


# --dense-quant int4 quantizes the attention matrices only; embedding and lm_head stay int8.
# Measured on tests/test_parity.py's int4 model (teacher-forced mean KL vs transformers):
# dense int8 8.2e-4 nats, int4 attention 1.3e-2, int4 attention + lm_head + embedding 2.1e-2
# (llama.cpp's Q4_0 files likewise keep the output matrix at higher precision). The default
# stays int8 for that quality; int4 dense is the option for speed.
LM_HEAD_QUANT = {"int4": "int8"}


def _put(dense: dict, name: str, w: np.ndarray, quant: str, group_size: int = 32) -> None:
    for k, v in quantize(w, quant, group_size).items():
        dense[f"{name}.{k}"] = np.ascontiguousarray(v)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, quant: str = "int8",
                       overwrite: bool = False, group_size: int = 32,
                       progress: Callable[[LoadProgress], None] | None = None,
                       cancel: threading.Event | None = None,
                       extra_manifest: dict | None = None, dense_quant: str | None = None) -> Path:
    """Convert the HF OLMoE folder ``src`` into a store at ``dst``.

    Args:
        quant: "int8" (per-row), "int4" (group-wise, ``group_size`` columns per scale, two
            values per byte), "f16" or "f32" (exact, for tests).
        dense_quant: quantization of the resident dense matrices (one of QUANTS; None = the
            default of :func:`dense_quant_for`). int4 uses ``group_size`` like the experts.
        overwrite: replace an existing store at ``dst``.
        progress: called with LoadProgress(stage="convert", done=bytes, total=bytes, unit="B").
        cancel: set it to stop; raises ConversionCancelled and leaves no store behind.

    Returns: the store path.

    Raises:
        ConfigError / CheckpointError: the source is invalid (raised before writing anything).
        FileExistsError: ``dst`` exists and overwrite is False.
        ConversionCancelled: ``cancel`` was set.
    """
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst}: a store already exists; pass --overwrite to replace it")
    ck = Checkpoint(src)
    args = ck.args
    D, I, E, L = args.hidden_size, args.intermediate_size, args.num_experts, args.num_hidden_layers
    dq = dense_quant_for(quant) if dense_quant is None else dense_quant
    if dq not in QUANTS:
        raise ValueError(f"--dense-quant {dq!r}: choose one of {', '.join(QUANTS)}")
    if "int4" in (quant, dq) and group_size % 2:
        raise ValueError(f"--group-size {group_size}: int4 needs an even group size (32 is the default)")
    if quant == "int4" and (D % group_size or I % group_size):
        raise CheckpointError(f"{src}: int4 needs hidden_size ({D}) and intermediate_size ({I}) to be "
                              f"multiples of the group size {group_size}; use int8")
    HS = args.num_attention_heads * args.head_dim
    if dq == "int4" and (D % group_size or HS % group_size):
        raise CheckpointError(f"{src}: --dense-quant int4 needs hidden_size ({D}) and heads x head size "
                              f"({HS}) to be multiples of the group size {group_size}; use int8")
    partial = dst.with_name(dst.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    (partial / "experts").mkdir(parents=True)

    layout = slab_layout(quant, D, I, group_size)
    total = sum(ck.nbytes(n) for n in hf_names(args))
    done = 0
    last_report = 0.0

    def report(msg: str, force: bool = False) -> None:
        nonlocal last_report
        now = time.monotonic()
        if progress and (force or now - last_report > 0.1):
            last_report = now
            progress(LoadProgress("convert", done, total, "B", msg))

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise ConversionCancelled(f"conversion of {src} cancelled; nothing was written to {dst}")

    try:
        dense: dict[str, np.ndarray] = {}
        experts_meta = []
        for i in range(L):
            hp = f"model.layers.{i}."
            cp = f"layers.{i}."
            for hf, ours, how in (("input_layernorm.weight", "input_layernorm", None),
                                  ("post_attention_layernorm.weight", "post_attention_layernorm", None),
                                  ("self_attn.q_norm.weight", "q_norm", None),
                                  ("self_attn.k_norm.weight", "k_norm", None),
                                  ("mlp.gate.weight", "router", None),
                                  ("self_attn.q_proj.weight", "q_proj", dq),
                                  ("self_attn.k_proj.weight", "k_proj", dq),
                                  ("self_attn.v_proj.weight", "v_proj", dq),
                                  ("self_attn.o_proj.weight", "o_proj", dq)):
                check_cancel()
                w = ck.get(hp + hf)
                if how is None:
                    dense[cp + ours] = w  # norms and router stay float32: routing is sensitive
                else:
                    _put(dense, cp + ours, w, how, group_size)
                done += ck.nbytes(hp + hf)
                report(hp + hf)
            # Experts: one slab each, appended to this layer's file at 4096-aligned offsets.
            rel = f"experts/layer_{i:03d}.bin"
            metas = []
            slab = np.zeros(layout["slot_bytes"], dtype=np.uint8)
            with open(partial / rel, "wb") as f:
                for e in range(E):
                    check_cancel()
                    slab[:] = 0
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        name = f"{hp}mlp.experts.{e}.{proj}.weight"
                        parts = quantize(ck.get(name), quant, group_size)
                        for k, arr in parts.items():
                            _, off, _, _ = next(x for x in layout["fields"] if x[0] == f"{proj}.{k}")
                            b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                            slab[off:off + b.size] = b
                        done += ck.nbytes(name)
                    offset = f.tell()
                    f.write(slab.tobytes())
                    metas.append({"file": rel, "offset": offset, "length": layout["slot_bytes"],
                                  "crc32": zlib.crc32(slab)})
                    report(f"{hp}mlp.experts.{e}")
                f.flush()
                os.fsync(f.fileno())
            experts_meta.append(metas)
        check_cancel()
        for hf, ours in (("model.embed_tokens.weight", "embed_tokens"), ("model.norm.weight", "norm")):
            w = ck.get(hf)
            if ours == "norm":
                dense["norm"] = w
            else:  # the embedding: one row read per token, so int4 would save no time
                _put(dense, ours, w, "int8" if dq == "int4" else dq, group_size)
            done += ck.nbytes(hf)
        lm_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
        _put(dense, "lm_head", ck.get(lm_name), LM_HEAD_QUANT.get(dq, dq), group_size)
        if not args.tie_word_embeddings:
            done += ck.nbytes(lm_name)
        report("dense weights", force=True)
        dense_path = partial / "dense.safetensors"
        save_file(dense, str(dense_path), metadata={"format": FORMAT_NAME, "dense_quant": dq})
        dense_bytes = sum(v.nbytes for v in dense.values())
        del dense
        with open(dense_path, "rb+") as f:
            os.fsync(f.fileno())
        for name in COPIED_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, partial / name)
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": args.model_type,
            "model_name": src.name,
            "source": str(src.resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "quant": quant,
            "dense_quant": dq,
            "group_size": group_size if "int4" in (quant, dq) else None,
            "alignment": ALIGN,
            "checksum": "crc32",
            "dense_file": "dense.safetensors",
            "dense_bytes": dense_bytes,
            "slab_layout": {"fields": [list(x) for x in layout["fields"]],
                            "data_bytes": layout["data_bytes"], "slot_bytes": layout["slot_bytes"]},
            "slot_bytes": [layout["slot_bytes"]] * L,
            "num_layers": L,
            "num_experts": E,
            "experts": experts_meta,
            **(extra_manifest or {}),
        }
        mpath = partial / "manifest.json"
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(partial / "experts")
        fsync_dir(partial)
        if dst.exists():
            old = dst.with_name(dst.name + f".old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(partial, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, dst)
        fsync_dir(dst.parent)
        report("done", force=True)
        return dst
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        ck.close()
