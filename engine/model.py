"""OLMoE forward pass (prefill and decode) over a converted store.

Key: T tokens in this call, D hidden, V vocab, E experts, K experts per token, I expert width,
H query heads, Hkv KV heads, S head size, C context capacity, L layers.

Follows transformers' models/olmoe/modeling_olmoe.py: pre-norm blocks; q_norm / k_norm
RMSNorms over the whole projected q and k; rotate-half RoPE; softmax router over all E
experts, top-K (lowest id wins ties), optional renormalisation (norm_topk_prob).
Routed experts come through an ``ExpertProvider`` (acquire/release), so the cache, the budget
and the prefetcher can change where bytes live without touching any arithmetic.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Protocol

import numpy as np

from .config import ModelArgs
from .errors import EngineError
from .quant import kind_of

if os.environ.get("COLIBRI_NO_NUMBA"):
    from . import kernels_ref as K
else:
    try:
        from . import kernels as K
    except ImportError:  # numba missing: slow but correct
        from . import kernels_ref as K

PREFILL_CHUNK = 128


class Cancelled(EngineError):
    """Generation was cancelled through the cancel event."""

    kind = "cancelled"


class ExpertProvider(Protocol):
    """Where expert weights come from. ``prepare`` announces the experts a layer is about to
    use (so misses can be read concurrently) and may return the order to compute them in
    (resident ones first); ``acquire`` returns the slab's views and pins it until ``release``."""

    def prepare(self, layer: int, experts: np.ndarray) -> list[int] | None: ...
    def acquire(self, layer: int, expert: int) -> dict: ...
    def release(self, layer: int, expert: int) -> None: ...


class Linear:
    """A resident dense matrix [O, N] in one of the kinds of kernels.py."""

    def __init__(self, dense: dict, name: str, kind: str, group_size: int = 32):
        self.w = dense[name + ".w"]
        self.s = dense.get(name + ".s")
        # the arrays say what they are: a store may mix kinds (int4 attention, int8 lm_head)
        self.kind = kind_of(self.w, self.s)
        self.gs = group_size
        self.out_features = self.w.shape[0]

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.kind == "int8":
            K.linear_q8(x, self.w, self.s, out)
        elif self.kind == "f32":
            K.linear_f32(x, self.w, out)
        elif self.kind == "f16":
            K.linear_f16(x, self.w, K.F16_TABLE, out)
        else:
            K.linear_q4(x, self.w, self.s, self.gs, out)
        return out


def run_expert(kind: str, v: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray, gs: int) -> None:
    """out[T, D] = expert(x[T, D]) with the slab views ``v``; h [T, I] is scratch."""
    if kind == "int8":
        K.expert_q8(x, v["gate_proj.w"], v["gate_proj.s"], v["up_proj.w"], v["up_proj.s"],
                    v["down_proj.w"], v["down_proj.s"], h, out)
    elif kind == "int4":
        K.expert_q4(x, v["gate_proj.w"], v["gate_proj.s"], v["up_proj.w"], v["up_proj.s"],
                    v["down_proj.w"], v["down_proj.s"], gs, h, out)
    elif kind == "f16":
        K.expert_f16(x, v["gate_proj.w"], v["up_proj.w"], v["down_proj.w"], K.F16_TABLE, h, out)
    else:
        K.expert_f32(x, v["gate_proj.w"], v["up_proj.w"], v["down_proj.w"], h, out)


def rope_tables(head_dim: int, theta: float, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [n_pos, head_dim // 2], computed in float32 as transformers does
    (inv_freq = 1 / theta^(2j / S); angle = pos * inv_freq)."""
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                    / np.float32(head_dim)))).astype(np.float32)
    ang = np.arange(n_pos, dtype=np.float32)[:, None] * inv[None, :]  # [C, S/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def route(router_logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, top-k (lowest id on ties), optional renormalisation.

    router_logits float32 [T, E] -> (indices int64 [T, K], weights float32 [T, K]).
    """
    z = router_logits - router_logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)  # [T, E]
    idx = np.argsort(-p, axis=1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(p, idx, axis=1).astype(np.float32)  # [T, K]
    if norm_topk_prob:
        w /= w.sum(axis=1, keepdims=True)
    return idx, w


def mean_router_probs(router_logits: np.ndarray) -> np.ndarray:
    """Mean over rows of the router softmax: float32 [T, E] logits -> float32 [E] probabilities
    (the per-call input of the cache's "ema" eviction policy)."""
    z = router_logits - router_logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return p.mean(axis=0, dtype=np.float32)


class OlmoeModel:
    """Resident dense weights + KV cache + an ExpertProvider.

    Args:
        args: ModelArgs. dense: canonical dense tensors (convert.py names).
        dense_quant / expert_quant: weight kinds. experts: the ExpertProvider.
        context_length: KV capacity C in tokens.
    """

    def __init__(self, args: ModelArgs, dense: dict, dense_quant: str, expert_quant: str,
                 experts: ExpertProvider, context_length: int, group_size: int = 32):
        self.args = a = args
        self.C = context_length
        self.experts = experts
        self.expert_quant = expert_quant
        self.gs = group_size
        dq = dense_quant
        self.embed_w = dense["embed_tokens.w"]
        self.embed_s = dense.get("embed_tokens.s")
        self.embed_kind = kind_of(self.embed_w, self.embed_s)
        self.lm_head = Linear(dense, "lm_head", dq, group_size)
        self.norm = dense["norm"]
        self.layers = []
        for i in range(a.num_hidden_layers):
            p = f"layers.{i}."
            self.layers.append({
                "input_layernorm": dense[p + "input_layernorm"],
                "post_attention_layernorm": dense[p + "post_attention_layernorm"],
                "q_norm": dense[p + "q_norm"], "k_norm": dense[p + "k_norm"],
                "router": dense[p + "router"],
                "q_proj": Linear(dense, p + "q_proj", dq, group_size),
                "k_proj": Linear(dense, p + "k_proj", dq, group_size),
                "v_proj": Linear(dense, p + "v_proj", dq, group_size),
                "o_proj": Linear(dense, p + "o_proj", dq, group_size),
            })
        L, Hkv, S = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
        # Filled (not np.zeros, whose pages appear lazily) so the KV the budget reserves is
        # resident from the start: RSS then matches the plan instead of creeping up later.
        self.k_cache = np.empty((L, Hkv, self.C, S), dtype=np.float32)  # [L, Hkv, C, S]
        self.v_cache = np.empty((L, Hkv, self.C, S), dtype=np.float32)
        self.k_cache.fill(0.0)
        self.v_cache.fill(0.0)
        self.cos, self.sin = rope_tables(S, a.rope_theta, self.C)  # [C, S/2]
        self.scale = np.float32(S ** -0.5)
        # Observers: routing (layer, idx[T, K]) and PILOT hooks; set by the engine.
        self.on_route: Callable[[int, np.ndarray, np.ndarray], None] | None = None
        self.on_after_attention: Callable[[int, np.ndarray], None] | None = None
        self.on_after_moe: Callable[[int, np.ndarray], None] | None = None
        self.on_layer_start: Callable[[int], None] | None = None

    @property
    def kv_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    # --- blocks -----------------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        D = self.args.hidden_size
        x = np.empty((len(ids), D), dtype=np.float32)  # [T, D]
        if self.embed_kind == "int8":
            K.embed_q8(ids, self.embed_w, self.embed_s, x)
        elif self.embed_kind == "int4":
            K.embed_q4(ids, self.embed_w, self.embed_s, self.gs, x)
        elif self.embed_kind == "f16":
            x[:] = K.F16_TABLE[self.embed_w[ids]]
        else:
            x[:] = self.embed_w[ids]
        return x

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = np.empty_like(x)  # [T, D]
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q = ly["q_proj"](h, np.empty((T, H * S), np.float32))  # [T, H*S]
        k = ly["k_proj"](h, np.empty((T, Hkv * S), np.float32))  # [T, Hkv*S]
        v = ly["v_proj"](h, np.empty((T, Hkv * S), np.float32))  # [T, Hkv*S]
        K.rmsnorm(q, ly["q_norm"], a.rms_norm_eps, q)
        K.rmsnorm(k, ly["k_norm"], a.rms_norm_eps, k)
        if a.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        q3 = q.reshape(T, H, S)
        k3 = k.reshape(T, Hkv, S)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        K.rope(q3, cos, sin)
        K.rope(k3, cos, sin)
        self.k_cache[i, :, pos0:pos0 + T] = k3.transpose(1, 0, 2)
        self.v_cache[i, :, pos0:pos0 + T] = v.reshape(T, Hkv, S).transpose(1, 0, 2)
        att = np.empty((T, H, S), np.float32)  # [T, H, S]
        K.attention(q3, self.k_cache[i], self.v_cache[i], pos0, self.scale, att)
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))  # [T, D]

    def router_logits(self, i: int, h: np.ndarray) -> np.ndarray:
        out = np.empty((h.shape[0], self.args.num_experts), np.float32)  # [T, E]
        K.linear_f32(h, self.layers[i]["router"], out)
        return out

    def moe(self, i: int, x: np.ndarray) -> np.ndarray:
        """Routed experts of layer i for the rows of x [T, D]; returns [T, D].

        Rows are grouped by expert so each routed expert is acquired once per call (never once
        per (token, rank): the prefill "reload storm"); outputs are combined in rank order.
        """
        a = self.args
        T, D = x.shape
        h = np.empty_like(x)
        K.rmsnorm(x, self.layers[i]["post_attention_layernorm"], a.rms_norm_eps, h)
        logits = self.router_logits(i, h)  # [T, E]
        idx, w = route(logits, a.num_experts_per_tok, a.norm_topk_prob)  # [T, K]
        if self.on_route is not None:
            self.on_route(i, idx, logits)
        uniq = np.unique(idx)  # ascending expert ids
        order = self.experts.prepare(i, uniq)
        y = np.zeros((T, idx.shape[1], D), np.float32)  # [T, K, D]
        scratch = np.empty((T, a.intermediate_size), np.float32)  # [T, I]
        for e in (uniq if order is None else order):  # outputs land by rank: order never changes values
            rows, ranks = np.nonzero(idx == e)
            n = len(rows)
            xe = h if n == T else np.ascontiguousarray(h[rows])  # [n, D]; rows are sorted
            out = np.empty((n, D), np.float32)
            views = self.experts.acquire(i, int(e))
            try:
                run_expert(self.expert_quant, views, xe, scratch[:n], out, self.gs)
            finally:
                self.experts.release(i, int(e))
            y[rows, ranks] = out
        moe = y[:, 0] * w[:, 0:1]
        for k in range(1, idx.shape[1]):
            moe += y[:, k] * w[:, k:k + 1]
        return moe

    # --- forward ----------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool = False,
                cancel: threading.Event | None = None) -> np.ndarray:
        """Run tokens ``ids`` (int [T]) at positions pos0..pos0+T-1, writing the KV cache.

        Returns float32 logits [T, V] if all_logits else [1, V] (last position).
        Raises:
            Cancelled: ``cancel`` was set (polled between chunks and layers).
            ValueError: the positions exceed the context capacity.
        """
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if pos0 + T > self.C:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.C} tokens")
        outs = []
        for c0 in range(0, T, PREFILL_CHUNK):
            chunk = ids[c0:c0 + PREFILL_CHUNK]
            x = self.embed(chunk)  # [t, D]
            for i in range(self.args.num_hidden_layers):
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled")
                if self.on_layer_start is not None:
                    self.on_layer_start(i)
                x += self.attention(i, x, pos0 + c0)
                if self.on_after_attention is not None:
                    self.on_after_attention(i, x)
                x += self.moe(i, x)
                if self.on_after_moe is not None:
                    self.on_after_moe(i, x)
            if all_logits:
                outs.append(self.logits(x))
            elif c0 + PREFILL_CHUNK >= T:
                outs.append(self.logits(x[-1:]))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = np.empty_like(x)
        K.rmsnorm(x, self.norm, self.args.rms_norm_eps, h)
        return self.lm_head(h, np.empty((x.shape[0], self.args.vocab_size), np.float32))  # [T, V]
