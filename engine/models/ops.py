"""The decoder's stateless arithmetic over the kernels: a projection or a SwiGLU expert on slab
views of any weight kind, the KV cache's lazily mapped arrays, RoPE / YaRN tables, softmax
top-k routing. Re-exported by engine/models/base.py (``base.run_expert``, ``base.kv_zeros``, ...).

Key: T tokens, D hidden, I expert width, E experts, K experts per token.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from ..kernel_choice import K
from ..quant import deinterleave_q4
from .tensors import EXPERT_PROJS

def linear_views(kind: str, v: dict, proj: str, x: np.ndarray, out: np.ndarray, gs: int) -> np.ndarray:
    """out[T, O] = x[T, N] @ W^T (+ the bias "{proj}.b" when the slab holds one) for the
    projection ``proj`` of the slab views ``v`` at weight kind ``kind``."""
    if kind == "gguf":  # GGUF blocks as published: the slab's header names the projection's type
        from .. import kernels_gguf
        from ..gguf_blocks import PROJS
        kernels_gguf.linear(x, v[proj + ".q"], int(v["types"][PROJS.index(proj)]), out)
        b = v.get(proj + ".b")
        if b is not None:
            out += b
        return out
    w, s = v[proj + ".w"], v.get(proj + ".s")
    if kind == "int8":
        K.linear_q8(x, w, s, out)
    elif kind == "int4" and w.ndim == 3:  # interleaved slab (store format 4)
        if K.q4_interleaved_ok(gs):
            K.linear_q4i(x, w, s, gs, out)
        else:
            K.linear_q4(x, deinterleave_q4(w), s, gs, out)
    elif kind == "int4":
        K.linear_q4(x, w, s, gs, out)
    elif kind == "mxfp4":
        K.linear_mxfp4(x, w, s, out)
    elif kind == "f16":
        K.linear_f16(x, w, K.F16_TABLE, out)
    else:
        K.linear_f32(x, w, out)
    b = v.get(proj + ".b")
    if b is not None:
        out += b
    return out


def run_expert(kind: str, v: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray, gs: int) -> None:
    """out[T, D] = down(silu(gate(x)) * up(x)) for x [T, D] with the weight views ``v``
    (slab fields "gate_proj.w", "gate_proj.s", ...); h [T, I] is scratch. int4 weights stored
    interleaved (3-D views, store format 4) run K.expert_q4i, or, on a CPU without the SIMD
    int4 kernels, K.expert_q4 on row-major copies: the same values either way. "gguf": a
    GGUF-born slab's blocks as published (engine.kernels_gguf)."""
    if kind == "gguf":
        from .. import kernels_gguf
        kernels_gguf.run_expert(v, x, h, out)
        return
    if kind == "mxfp4":  # no fused kernel: three MXFP4 matmuls
        u = linear_views(kind, v, "up_proj", x, np.empty_like(h), gs)
        linear_views(kind, v, "gate_proj", x, h, gs)
        h *= u / (np.float32(1.0) + np.exp(-h))
        linear_views(kind, v, "down_proj", h, out, gs)
        return
    if kind == "int8":
        K.expert_q8(x, v["gate_proj.w"], v["gate_proj.s"], v["up_proj.w"], v["up_proj.s"],
                    v["down_proj.w"], v["down_proj.s"], h, out)
    elif kind == "int4" and v["gate_proj.w"].ndim == 3:
        if K.q4_interleaved_ok(gs):
            K.expert_q4i(x, v["gate_proj.w"], v["gate_proj.s"], v["up_proj.w"], v["up_proj.s"],
                         v["down_proj.w"], v["down_proj.s"], gs, h, out)
        else:
            K.expert_q4(x, deinterleave_q4(v["gate_proj.w"]), v["gate_proj.s"], deinterleave_q4(v["up_proj.w"]),
                        v["up_proj.s"], deinterleave_q4(v["down_proj.w"]), v["down_proj.s"], gs, h, out)
    elif kind == "int4":
        K.expert_q4(x, v["gate_proj.w"], v["gate_proj.s"], v["up_proj.w"], v["up_proj.s"],
                    v["down_proj.w"], v["down_proj.s"], gs, h, out)
    elif kind == "f16":
        K.expert_f16(x, v["gate_proj.w"], v["up_proj.w"], v["down_proj.w"], K.F16_TABLE, h, out)
    else:
        K.expert_f32(x, v["gate_proj.w"], v["up_proj.w"], v["down_proj.w"], h, out)


def kv_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array for a KV cache whose memory the OS maps page by page as positions are
    first written: a private anonymous mapping (zero pages on first touch), advised against
    transparent huge pages where the platform has the advice (a 2 MB page faulted in for one
    position of each head would map the whole cache within a few tokens). A KV cache laid out
    position by position along its context axis then holds, in RAM, the positions the
    conversation has reached, not the whole context: the RAM the rest would take is the expert
    cache's until the context grows (engine.sizing.KV_OPEN_TOKENS). Values are those of
    np.zeros."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        mm = mmap.mmap(-1, n)  # Windows: private pagefile-backed memory, committed on first touch
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(mm, dtype).reshape(shape)


def rope_tables(head_dim: int, theta: float, n_pos: int,
                scaling: tuple[tuple[str, float], ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [n_pos, head_dim // 2], computed in float32 as transformers does
    (inv_freq = 1 / theta^(2j / S); angle = pos * inv_freq). ``head_dim``: the rotated width.

    ``scaling`` (YaRN, :func:`yarn_params`): inv_freq blended between interpolated
    (inv / factor) and extrapolated frequencies by a linear ramp between the dimensions of
    beta_fast and beta_slow rotations over original_max_position_embeddings, and cos/sin
    multiplied by the attention factor (0.1 ln(factor) + 1, or the mscale / mscale_all_dim
    ratio); source: transformers' modeling_rope_utils._compute_yarn_parameters (after Peng et
    al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models").
    """
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                    / np.float32(head_dim)))).astype(np.float32)
    factor = np.float32(1.0)
    if scaling:
        inv, factor = _yarn(head_dim, theta, dict(scaling))
    ang = np.arange(n_pos, dtype=np.float32)[:, None] * inv[None, :]  # [C, S/2]
    return (np.cos(ang) * factor).astype(np.float32), (np.sin(ang) * factor).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, p: dict) -> tuple[np.ndarray, np.float32]:
    """(inv_freq float32 [dim/2], attention factor): transformers' _compute_yarn_parameters."""
    factor = p["factor"]
    orig = p["original_max_position_embeddings"]
    if "attention_factor" in p:
        att = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        att = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
    else:
        att = yarn_mscale(factor)

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"] or 32.0), correction_dim(p["beta_slow"] or 1.0)
    if p.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extra = np.float32(1.0) / pos_freqs
    inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_factor = np.float32(1.0) - ramp
    inv = inter * (np.float32(1.0) - extra_factor) + extra * extra_factor
    return inv.astype(np.float32), np.float32(att)


_LAST_PROBS: tuple | None = None  # (logits array, its softmax) of the last route() call


def route(router_logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, top-k (lowest id on ties), optional renormalisation
    (K.route_softmax: the numba kernel and its numpy twin give the same bits).

    router_logits float32 [T, E] -> (indices int64 [T, K], weights float32 [T, K]).
    Mixtral's "softmax over the selected logits" equals this with norm_topk_prob=True.
    """
    global _LAST_PROBS
    T, E = router_logits.shape
    idx = np.empty((T, k), np.int64)
    w = np.empty((T, k), np.float32)
    p = np.empty((T, E), np.float32)
    K.route_softmax(np.ascontiguousarray(router_logits, np.float32), k, bool(norm_topk_prob), idx, w, p)
    _LAST_PROBS = (router_logits, p)  # mean_router_probs of the same logits reuses it
    return idx, w


def mean_router_probs(router_logits: np.ndarray) -> np.ndarray:
    """Mean over rows of the router softmax: float32 [T, E] logits -> float32 [E] probabilities
    (the per-call input of the cache's "ema" eviction policy). The softmax :func:`route` just
    computed of the same logits array is reused (the same values either way)."""
    last = _LAST_PROBS
    if last is not None and last[0] is router_logits:
        p = last[1]
    else:
        T, E = router_logits.shape
        p = np.empty((T, E), np.float32)
        K.route_softmax(np.ascontiguousarray(router_logits, np.float32), 1, False, np.empty((T, 1), np.int64),
                        np.empty((T, 1), np.float32), p)
    if p.shape[0] == 1:  # the mean of one row is the row (x / 1 is exact)
        return p[0]
    return p.mean(axis=0, dtype=np.float32)


def softmax_rows(router_logits: np.ndarray) -> np.ndarray:
    """The router softmax of each row: float32 [n, E] logits -> float32 [n, E] probabilities,
    by the kernel :func:`route` uses (K.route_softmax), so row i equals
    ``mean_router_probs(router_logits[i:i + 1])``."""
    n, E = router_logits.shape
    p = np.empty((n, E), np.float32)
    K.route_softmax(np.ascontiguousarray(router_logits, np.float32), 1, False, np.empty((n, 1), np.int64),
                    np.empty((n, 1), np.float32), p)
    return p

def mlp_views(dense: dict, prefix: str) -> dict:
    return {f"{p}.{k}": dense[f"{prefix}{p}.{k}"] for p in EXPERT_PROJS for k in ("w", "s")
            if f"{prefix}{p}.{k}" in dense}
