"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): multi-head latent attention
(engine/models/mla.py) where each query attends only the ``index_topk`` past tokens a light
scorer, the *indexer*, picks; shared by the ``deepseek_v32`` and ``glm_moe_dsa`` families.

Per layer that runs its own indexer, for a query at position p and a past token n <= p
(Hi = index_n_heads, Di = index_head_dim, dr = qk_rope_head_dim):

    q_i  = wq_b(qa)                      [Hi, Di]   qa = q_a_layernorm(q_a_proj(h)), MLA's q LoRA
    k_i  = LayerNorm(wk(h))              [Di]       (weight and bias, eps 1e-6), cached per token
    rope on the first dr values of every q_i head and of k_i (GLM-5: interleaved pairs, as its
                                                     MLA; DeepSeek-V3.2: rotate-half halves)
    w    = weights_proj(h) * Hi^-0.5     [Hi]
    I[p, n] = sum_h w_h * relu(q_i,h . k_i[n] * Di^-0.5)

and the query attends (MLA, absorbed) the min(index_topk, p + 1) positions n <= p with the
largest I[p, n]; while p + 1 <= index_topk that is every causal position, so short prompts
are plain MLA. The cache holds, per token, the latent (kv_lora_rank + qk_rope_head_dim values,
every layer) and the indexer key k_i (index_head_dim values, on the layers that run an
indexer), at the KV cache's element type.

GLM-5's cross-layer sharing (``indexer_types``): a "shared" layer has no indexer and reuses the
selection of the nearest earlier "full" layer for the same tokens; layer 0 must be "full".

Ties. transformers selects with ``torch.topk``, whose order among exactly equal scores is an
implementation detail (on the CPU its full forward and its cached decode can pick different
tokens: with few indexer heads many ReLU'd scores are exactly 0). Our rule: the larger score
first, and among exactly equal scores the lower position first (:func:`topk_positions`). It
differs from transformers only on exact ties; parity tests use enough indexer heads that
none occur.

Sources: transformers' models/deepseek_v32/modeling_deepseek_v32.py (DeepseekV32Indexer,
DeepseekV32Attention) and models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaIndexer and its
``indexer_types``, ``GlmMoeDsaConfig.__post_init__`` for their defaults); DeepSeek-V3.2-Exp's
report for the design.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base, deepseek_v3, mla
from .base import K, Linear, Tensor

INDEXER_LN_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(index_head_dim, eps=1e-6))


@dataclass(frozen=True, kw_only=True)
class DSAArgs(deepseek_v3.ModelArgs):
    """DeepSeek-V3 args plus the indexer (Hugging Face names): index_n_heads, index_head_dim,
    index_topk; ``indexer_layers``: transformer layers that run their own indexer (the others
    reuse the previous one's selection); ``indexer_rope_interleave``: the indexer rotates
    interleaved pairs (GLM-5) or rotate-half halves (DeepSeek-V3.2)."""

    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_layers: tuple[int, ...] = ()
    indexer_rope_interleave: bool = True

    @property
    def kv_values_all_layers(self) -> int:
        """The latent on every layer plus index_head_dim indexer-key values on each layer
        that runs an indexer."""
        return self.num_hidden_layers * self.kv_values_per_token + len(self.indexer_layers) * self.index_head_dim

    def indexer_param_count(self) -> int:
        """Parameters of one layer's indexer: wq_b, wk, k_norm (weight and bias), weights_proj."""
        D, Hi, Di = self.hidden_size, self.index_n_heads, self.index_head_dim
        return Hi * Di * self.q_lora_rank + Di * D + 2 * Di + Hi * D

    def dense_param_count(self) -> int:
        return super().dense_param_count() + len(self.indexer_layers) * self.indexer_param_count()


def dsa_fields(cfg: dict, path: str, family: str, *, shared_layers: bool) -> dict:
    """DSAArgs fields of a DeepSeek-V3.2 / GLM-5 config.json, validated, with transformers'
    defaults for absent keys (first_k_dense_replace 3; GLM-5's ``indexer_types`` from
    ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``).
    ``shared_layers``: the family reads ``indexer_types`` (GLM-5); DeepSeek-V3.2 runs an
    indexer on every layer.

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    cfg = dict(cfg)
    cfg.pop("rope_interleave", None)  # the MLA of both always rotates interleaved pairs
    v = deepseek_v3.layer_typed_fields(cfg, path, family, first_k_dense_default=3)
    v.pop("rope_interleave")
    L = v["num_hidden_layers"]
    if not v["q_lora_rank"]:
        raise ConfigError(f"{path}: key 'q_lora_rank' is required for {family}: the sparse-attention indexer "
                          f"reads the q LoRA activations")

    def n(key, lo, hi, default=None):
        return base.num(cfg, key, path, lo, hi, integer=True, family=family, default=default)

    Di = n("index_head_dim", 2, 1 << 16, default=128)
    if Di < v["qk_rope_head_dim"]:
        raise ConfigError(f"{path}: index_head_dim ({Di}) must be at least qk_rope_head_dim "
                          f"({v['qk_rope_head_dim']}): the indexer rotates its first qk_rope_head_dim values")
    full = tuple(range(L))
    if shared_layers:
        full = tuple(i for i, t in enumerate(indexer_types(cfg, path, L)) if t == "full")
    return dict(**v, index_n_heads=n("index_n_heads", 1, 1 << 12, default=64 if not shared_layers else 32),
                index_head_dim=Di, index_topk=n("index_topk", 1, 1 << 24, default=2048), indexer_layers=full,
                indexer_rope_interleave=shared_layers, rope_interleave=True)


def indexer_types(cfg: dict, path: str, L: int) -> list[str]:
    """GLM-5's per-layer indexer mode, "full" or "shared", as GlmMoeDsaConfig derives it:
    ``indexer_types``, else ``index_topk_pattern`` ("FSS..." or a list), else layer i is full
    iff max(i - offset + 1, 0) % freq == 0 (``index_topk_freq``, default 1: every layer;
    ``index_skip_topk_offset``, default 2).

    Raises:
        ConfigError: a malformed list or pattern, or layer 0 "shared" (it has no earlier
            selection to reuse).
    """
    types = cfg.get("indexer_types")
    key = "indexer_types"
    if types is None and cfg.get("index_topk_pattern") is not None:
        key, pat = "index_topk_pattern", cfg["index_topk_pattern"]
        if isinstance(pat, str):
            if any(c not in "FS" for c in pat):
                raise ConfigError(f"{path}: key 'index_topk_pattern' must be a string of F and S, got {pat!r}")
            types = [{"F": "full", "S": "shared"}[c] for c in pat]
        else:
            types = pat
    if types is None:
        freq = max(base.num(cfg, "index_topk_freq", path, 1, 1 << 12, integer=True, default=1), 1)
        off = base.num(cfg, "index_skip_topk_offset", path, 0, 1 << 12, integer=True, default=2)
        types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"{path}: key '{key}' must give 'full' or 'shared' for each of the {L} layers, "
                          f"got {types!r}")
    if types[0] != "full":
        raise ConfigError(f"{path}: key '{key}' makes layer 0 'shared', but a shared layer reuses an earlier "
                          f"layer's selection; layer 0 must be 'full'")
    return types


def attention_tensors(args: DSAArgs, i: int) -> list[Tensor]:
    """MLA's tensors of layer i plus, on an indexer layer, the indexer: Hugging Face
    ``model.layers.i.self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` -> ``layers.i.indexer.*``
    (weights_proj [Hi, D] kept float32, as transformers keeps it; k_norm weight and bias)."""
    out = mla.attention_tensors(args, i)
    if i in args.indexer_layers:
        D, Hi, Di = args.hidden_size, args.index_n_heads, args.index_head_dim
        a, c = f"model.layers.{i}.self_attn.indexer.", f"layers.{i}.indexer."
        out += [Tensor(a + "wq_b.weight", c + "wq_b", (Hi * Di, args.q_lora_rank), "quant"),
                Tensor(a + "wk.weight", c + "wk", (Di, D), "quant"),
                Tensor(a + "k_norm.weight", c + "k_norm", (Di,), "keep"),
                Tensor(a + "k_norm.bias", c + "k_norm.bias", (Di,), "keep"),
                Tensor(a + "weights_proj.weight", c + "weights_proj", (Hi, D), "keep")]
    return out


def dense_tensors(args: DSAArgs) -> list[Tensor]:
    return base.decoder_tensors(args, "mlp", shared="mlp.shared_experts.", attention=attention_tensors)


def topk_positions(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` positions with the largest ``scores`` (float32 [n], n >= k), ascending int64
    [k]. Exact ties: the lower position first (all positions above the k-th largest value,
    then the lowest positions equal to it)."""
    n = scores.shape[0]
    if k >= n:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(scores, n - k)[n - k]
    above = np.flatnonzero(scores > kth)
    equal = np.flatnonzero(scores == kth)[: k - len(above)]
    return np.sort(np.concatenate([above, equal])).astype(np.int64)


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    d = x - mu
    var = (d * d).mean(axis=-1, keepdims=True, dtype=np.float32)
    return (d / np.sqrt(var + np.float32(eps)) * w + b).astype(np.float32)


class DSAModel(mla.MLAModel):
    """MLA with the DeepSeek sparse-attention indexer and its key cache.

    ``index_cache`` [n_indexer_layers, C, index_head_dim] (float32, or IEEE-half bits as uint16
    for kv_dtype "f16"), one row per layer in ``args.indexer_layers``; counted in ``kv_bytes``.
    """

    def attention_weights(self, dense: dict, p: str) -> dict:
        ly = super().attention_weights(dense, p)
        q = p + "indexer."
        if q + "wk.w" in dense:
            ly["indexer"] = {"wq_b": Linear(dense, q + "wq_b", self.dense_quant, self.gs),
                             "wk": Linear(dense, q + "wk", self.dense_quant, self.gs),
                             "k_norm": dense[q + "k_norm"], "k_norm_bias": dense[q + "k_norm.bias"],
                             "weights_proj": dense[q + "weights_proj"]}
        return ly

    def alloc_kv(self) -> None:
        super().alloc_kv()
        a = self.args
        self.index_row = {layer: n for n, layer in enumerate(a.indexer_layers)}
        self.index_cache = base.kv_zeros((len(a.indexer_layers), self.C, a.index_head_dim),
                                         base.KV_DTYPES[self.kv_dtype])  # [Li, C, Di]
        dr = a.qk_rope_head_dim
        self.index_perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) \
            if a.indexer_rope_interleave else None
        self._selection = None  # the last indexer layer's selection (for "shared" layers)

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.nbytes + self.index_cache.nbytes

    def _streams(self) -> bool:
        """As MoEModel's, but False when a layer reuses an earlier layer's selection (GLM-5's
        "shared" layers): the layer-by-layer prefill runs a layer over every chunk before the
        next layer, and holding a full layer's selection for the whole prompt (index_topk
        positions per token) would cost more than the chunk-by-chunk prefill's expert reads."""
        return super()._streams() and len(self.args.indexer_layers) == self.args.num_hidden_layers

    def _rope_head(self, x: np.ndarray, pos0: int) -> None:
        """In place on x float32 [T, n, Di]: RoPE on the first qk_rope_head_dim values."""
        dr, T = self.args.qk_rope_head_dim, x.shape[0]
        part = x[:, :, :dr] if self.index_perm is None else x[:, :, :dr][:, :, self.index_perm]
        part = np.ascontiguousarray(part)
        K.rope(part, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
        x[:, :, :dr] = part

    def select(self, i: int, h: np.ndarray, qa: np.ndarray | None, pos0: int, T: int) -> list | None:
        """The indexer's choice for the T queries at pos0.. (see the module docstring): None
        while every query has at most index_topk causal positions, else per query None (all
        causal positions) or its index_topk positions (:func:`topk_positions`). A layer without
        an indexer reuses the previous indexer layer's choice (computed earlier in this
        forward chunk for the same tokens)."""
        a, ly = self.args, self.layers[i]
        if "indexer" not in ly:
            return self._selection
        ix = ly["indexer"]
        Hi, Di, k = a.index_n_heads, a.index_head_dim, a.index_topk
        key = ix["wk"](h, np.empty((T, Di), np.float32))  # [T, Di]
        key = _layernorm(key, ix["k_norm"], ix["k_norm_bias"], INDEXER_LN_EPS)[:, None, :]  # [T, 1, Di]
        self._rope_head(key, pos0)
        kc = self.index_cache[self.index_row[i]]  # [C, Di]
        self._kv_write(kc[pos0:pos0 + T], key[:, 0])
        n = pos0 + T
        t0 = max(0, k - pos0)  # queries before t0 see at most k causal positions: all of them
        if t0 >= T:
            self._selection = None
            return None
        m = T - t0
        q = ix["wq_b"](np.ascontiguousarray(qa[t0:]), np.empty((m, Hi * Di), np.float32)).reshape(m, Hi, Di)
        self._rope_head(q, pos0 + t0)
        w = np.empty((m, Hi), np.float32)
        K.linear_f32(np.ascontiguousarray(h[t0:]), ix["weights_proj"], w)
        w *= np.float32(Hi ** -0.5)
        keys = kc[:n] if self.kv_dtype == "f32" else kc[:n].view(np.float16).astype(np.float32)  # [n, Di]
        scale = np.float32(Di ** -0.5)
        score = np.zeros((m, n), np.float32)  # [m, n]
        for hh in range(Hi):
            s = q[:, hh] @ keys.T
            s *= scale
            np.maximum(s, 0, out=s)
            score += w[:, hh:hh + 1] * s
        sel = [None] * t0 + [topk_positions(score[t, :pos0 + t0 + t + 1], k) for t in range(m)]
        self._selection = sel
        return sel
