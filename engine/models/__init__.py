"""Model families, one file each (mlx-lm's layout): ``ModelArgs`` parsed from config.json
with Hugging Face key names, the checkpoint-name mapping (``dense_tensors``,
``expert_names``) and the ``Model`` (the shared decoder of base.py, configured by the args).

Registry by config.json ``model_type``: :data:`FAMILIES`, :func:`family_for`,
:func:`build_model`. Layer indexing (MoE-layer rows vs transformer layers): see base.py.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import ConfigError
from .base import register_family_lookup
from . import (deepseek_v2, deepseek_v3, deepseek_v32, deepseek_v4, dots1, ernie4_5_moe, gemma4, gemma4_text, glm4_moe, glm4_moe_lite,
               glm_moe_dsa, gpt_oss, granitemoehybrid, hunyuan_v1_moe, kimi_linear, lfm2_moe, llama4, llama4_text, minimax_m2, mixtral, olmoe, qwen2_moe,
               qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next)

FAMILIES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (olmoe, qwen3_moe, mixtral, qwen2_moe, deepseek_v2,
                                                           deepseek_v3, glm4_moe, gpt_oss, glm4_moe_lite,
                                                           deepseek_v32, glm_moe_dsa, qwen3_next,
                                                           qwen3_5_moe_text, qwen3_5_moe, ernie4_5_moe, dots1,
                                                           hunyuan_v1_moe, minimax_m2, llama4_text, llama4,
                                                           gemma4_text, gemma4, lfm2_moe,
                                                           granitemoehybrid, kimi_linear, deepseek_v4)}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
FAMILY_NAMES = {m.MODEL_TYPE: m.DISPLAY_NAME for m in FAMILIES.values()}


def supported_text() -> str:
    """One line listing the supported families, e.g. for error messages and the wizard."""
    return ", ".join(f"{t} ({FAMILY_NAMES[t]})" for t in SUPPORTED_MODEL_TYPES)


def family_for(model_type, path: str = "config.json") -> ModuleType:
    """The family module of ``model_type``.

    Raises:
        ConfigError: one line naming ``path``, the model_type and the supported families.
    """
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise ConfigError(f"{path}: model_type {model_type!r} is not supported; supported "
                          f"families: {supported_text()}")
    return fam


register_family_lookup(family_for)


def build_model(args, dense: dict, dense_quant: str, expert_quant: str, experts, context_length: int,
                group_size: int = 32, kv_dtype: str = "f16", embed_rows=None):
    """The family's Model over resident ``dense`` tensors and an ExpertProvider (see base.MoEModel;
    kv_dtype "f16" or "f32": the KV cache element; embed_rows: the embedding table read from the
    store row by row, engine.expert_store.EmbeddingRows, instead of ``dense``'s)."""
    return family_for(args.model_type).Model(args, dense, dense_quant, expert_quant, experts,
                                             context_length, group_size, kv_dtype=kv_dtype, embed_rows=embed_rows)


def dense_bytes(args, quant: str, group_size: int = 32, dense_quant: str | None = None,
                only: tuple[str, ...] | None = None) -> int:
    """Bytes of the tensors of dense.safetensors (the manifest's ``dense_bytes``) of a store of
    ``args`` converted at ``quant``: exact, from the same tensor list the converter writes
    (attention, norms, routers, biases, shared experts, dense-layer MLPs, embeddings).
    ``dense_quant``: the dense tensors' quantization when not the default for ``quant``
    (``--dense-quant``); ``only``: count just these store names (e.g. ("embed_tokens",))."""
    import numpy as np

    from ..quant import LM_HEAD_QUANT, field_specs
    dq = dense_quant or ("int8" if quant in ("int8", "int4", "mxfp4") else quant)
    seen, total = set(), 0
    fam = family_for(args.model_type)
    for t in fam.dense_tensors(args):
        if t.ours in seen or (only is not None and t.ours not in only):
            continue
        seen.add(t.ours)
        if t.kind == "keep":
            total += int(np.prod(t.shape)) * 4
        else:
            q = LM_HEAD_QUANT.get(dq, dq) if t.ours in ("embed_tokens", "lm_head") else dq  # as convert.py stores them
            for _, shape2 in (fam.split_shapes(args, t) if t.split else [(t.ours, t.shape)]):
                total += sum(int(np.prod(shape)) * dt.itemsize for _, dt, shape in field_specs(q, *shape2, group_size))
    return total


def embedding_bytes(args, quant: str, group_size: int = 32, dense_quant: str | None = None) -> int:
    """Bytes of the token-embedding table (``embed_tokens``) of such a store: part of
    dense.safetensors, but the engine reads it row by row (engine.expert_store.EmbeddingRows),
    so it takes no RAM."""
    return dense_bytes(args, quant, group_size, dense_quant, only=("embed_tokens",))


def expert_slot_bytes(args, quant: str, group_size: int = 32) -> int:
    """Bytes of one routed expert's slab (one read, 4096-aligned) at ``quant``; the routed
    experts of a store take ``args.num_moe_layers * args.num_experts`` of them."""
    from ..quant import slab_layout
    return slab_layout(quant, args.hidden_size, args.moe_intermediate_size, group_size,
                       bias=args.expert_bias)["slot_bytes"]
