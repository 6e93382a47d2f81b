"""Llama 4's language model (``model_type: llama4_text``; the text tower of Llama-4-Scout-17B-16E
and Llama-4-Maverick-17B-128E, engine/models/llama4.py for the multimodal checkpoint).

Follows transformers' models/llama4/modeling_llama4.py (Llama4TextModel). What differs from the
shared decoder:

- RoPE layers and NoPE layers (``no_rope_layers``: 1 = RoPE; by default every
  ``no_rope_layer_interval``-th layer has none). RoPE rotates adjacent pairs as complex numbers;
  as for ERNIE, the rows of q_proj and k_proj are reordered head by head at load (evens, then
  odds), which turns the pairs into the halves of rotate-half without changing any score.
  ``rope_parameters`` of type "llama3" scale the frequencies (factor, low / high frequency
  factors over original_max_position_embeddings).
- RoPE layers RMS-normalise each head of q and k without a weight after RoPE (``use_qk_norm``)
  and attend in chunks of ``attention_chunk_size``: a query at p sees the keys of its own chunk
  (p // chunk x chunk .. p) only. NoPE layers attend causally to everything and, with
  ``attn_temperature_tuning``, scale q at position p by
  1 + attn_scale x log1p(floor((p + 1) / floor_scale)).
- MoE layers (``moe_layers``, by default every ``interleave_moe_layer_step``-th): the router
  takes the top-K logits and their sigmoids scale the expert's input (not its output, which the
  SwiGLU would not commute with); a resident shared expert of the experts' width runs for every
  token. Dense layers have an MLP of width ``intermediate_size_mlp``.

Experts are stored fused as transformers holds them: feed_forward.experts.gate_up_proj
[E, D, 2I] (gate columns first, then up) and down_proj [E, I, D], read one expert at a time.

Not the one-call decode step (K.decode_layers_t1): its router weighs expert outputs by a
softmax and it has no chunked, NoPE or shared-expert layers.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj; model.layers.N.feed_forward.router.weight,
.experts.{gate_up_proj, down_proj}, .shared_expert.{gate,up,down}_proj; dense layers
model.layers.N.feed_forward.{gate,up,down}_proj.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..kernel_choice import K
from . import base
from .ernie4_5_moe import pairs_to_halves

MODEL_TYPE = "llama4_text"
DISPLAY_NAME = "Llama 4"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Llama 4 text config.json (Llama4TextConfig names).

    Attributes:
        rope_layers: per layer, whether it applies RoPE (and the q/k norm and chunking).
        attention_chunk_size: 0 = RoPE layers attend to everything too.
        llama3_rope: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
            or () for plain RoPE.
    """

    rope_layers: tuple[bool, ...] = ()
    attention_chunk_size: int = 0
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    llama3_rope: tuple[float, ...] = ()

    @property
    def has_chunks(self) -> bool:
        return bool(self.attention_chunk_size)

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**text_fields(cfg, path, DISPLAY_NAME))


def text_fields(cfg: dict, path: str, family: str) -> dict:
    """ModelArgs fields of a Llama 4 text config (Llama4TextConfig names), validated.

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    v = base.common_args(cfg, path, family, expert_width_key="intermediate_size",
                         experts_keys=("num_local_experts",), eps_default=1e-5, theta_default=500000.0,
                         rope_types=("default", "llama3"))
    L = v["num_hidden_layers"]
    if base.flag(cfg, "attention_bias", path, False):
        raise ConfigError(f"{path}: attention_bias=true is not supported for {family}")
    nrl = cfg.get("no_rope_layers")
    if nrl:
        if not isinstance(nrl, list) or len(nrl) != L or any(x not in (0, 1) for x in nrl):
            raise ConfigError(f"{path}: key 'no_rope_layers' must list 1 (RoPE) or 0 (no RoPE) for each of the "
                              f"{L} layers, got {nrl!r}")
        rope_layers = tuple(bool(x) for x in nrl)
    else:
        every = base.num(cfg, "no_rope_layer_interval", path, 1, 1 << 16, integer=True, default=4)
        rope_layers = tuple((i + 1) % every != 0 for i in range(L))
    moe = cfg.get("moe_layers")
    if moe is not None:
        moe = base.int_list(cfg, "moe_layers", path, L)
    else:
        step = base.num(cfg, "interleave_moe_layer_step", path, 1, L, integer=True, default=1)
        moe = tuple(range(step - 1, L, step))
    width = v["moe_intermediate_size"]
    if len(moe) < L:
        v["intermediate_size"] = base.num(cfg, "intermediate_size_mlp", path, 1, 1 << 24, integer=True,
                                          family=family)
    chunk = cfg.get("attention_chunk_size")
    chunk = 0 if chunk is None else base.num(cfg, "attention_chunk_size", path, 1, 1 << 30, integer=True)
    llama3 = ()
    if base.rope_type(cfg, path) == "llama3":
        rope, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
        src, where = {**scaling, **rope}, path + " rope_parameters"
        llama3 = (base.num(src, "factor", where, 1.0, 1e6, integer=False),
                  base.num(src, "low_freq_factor", where, 1e-6, 1e6, integer=False),
                  base.num(src, "high_freq_factor", where, 1e-6, 1e6, integer=False),
                  float(base.num(src, "original_max_position_embeddings", where, 1, 1 << 30, integer=True)))
        if llama3[1] == llama3[2]:
            raise ConfigError(f"{where}: low_freq_factor and high_freq_factor must differ")
    return dict(**v, norm_topk_prob=False, moe_layers=moe, layer_windows=(0,) * L, rope_layers=rope_layers,
                shared_expert_intermediate_size=width, shared_expert_gated=False, scoring_func="sigmoid",
                attention_chunk_size=chunk, use_qk_norm=base.flag(cfg, "use_qk_norm", path, True),
                attn_temperature_tuning=base.flag(cfg, "attn_temperature_tuning", path, True),
                floor_scale=base.num(cfg, "floor_scale", path, 1e-6, 1e12, integer=False, default=8192.0),
                attn_scale=base.num(cfg, "attn_scale", path, 0.0, 1e6, integer=False, default=0.1),
                llama3_rope=llama3)


def _rename(t: base.Tensor, prefix: str) -> base.Tensor:
    hf = t.hf.replace(".mlp.shared_expert.", ".feed_forward.shared_expert.").replace(".mlp.", ".feed_forward.")
    hf = hf.replace(".feed_forward.gate.weight", ".feed_forward.router.weight")
    if prefix != "model." and hf.startswith("model."):
        hf = prefix + hf[len("model."):]
    elif hf == "lm_head.weight" and prefix != "model.":
        hf = prefix[:-len("model.")] + hf
    return t._replace(hf=hf)


def dense_tensors(args: ModelArgs, prefix: str = "model.") -> list[base.Tensor]:
    """The decoder's resident tensors under ``prefix`` ("model." here; the multimodal checkpoint's
    "language_model.model.", its lm_head then "language_model.lm_head.weight")."""
    return [_rename(t, prefix) for t in base.decoder_tensors(args, "mlp")]


def expert_tensors(args: ModelArgs, i: int, mxfp4: bool = False, prefix: str = "model.") -> dict:
    """The fused expert tensors of layer i with their shapes (``mxfp4``: a layout Llama 4 is
    never published in, so a name no checkpoint holds)."""
    D, I, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
    p = f"{prefix}layers.{i}.feed_forward.experts."
    if mxfp4:
        return {p + "gate_up_proj_blocks": (E, 2 * I, D // 32, 16)}
    return {p + "gate_up_proj": (E, D, 2 * I), p + "down_proj": (E, I, D)}


def expert_from_fused(args: ModelArgs, i: int, rows: dict[str, np.ndarray], prefix: str = "model.") -> dict:
    """One expert's slices of :func:`expert_tensors` (float32, expert axis removed: gate_up [D, 2I],
    down [I, D]) -> the store's gate_proj / up_proj [I, D] and down_proj [D, I]."""
    p = f"{prefix}layers.{i}.feed_forward.experts."
    I = args.moe_intermediate_size
    gu = rows[p + "gate_up_proj"]
    return {"gate_proj": np.ascontiguousarray(gu[:, :I].T), "up_proj": np.ascontiguousarray(gu[:, I:].T),
            "down_proj": np.ascontiguousarray(rows[p + "down_proj"].T)}


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.feed_forward.experts.")


def llama3_inv_freq(S: int, theta: float, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """float32 [S/2]: transformers' _compute_llama3_parameters (in float32 as it computes them):
    long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, S, 2, dtype=np.float32) / np.float32(S))))
    inv = inv.astype(np.float32)
    low_wl, high_wl = old / low, old / high
    wl = (np.float32(2 * math.pi) / inv).astype(np.float32)
    f = np.float32(factor)
    scaled = np.where(wl > low_wl, inv / f, inv).astype(np.float32)
    smooth = ((np.float32(old) / wl - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((np.float32(1) - smooth) * scaled / f + smooth * scaled).astype(np.float32)
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


class Model(base.MoEModel):
    """The Llama 4 text forward: RoPE / NoPE layers, chunked attention, weightless q/k norms,
    temperature-tuned NoPE queries, input-scaled sigmoid top-K experts beside a shared expert."""

    def attention_weights(self, dense: dict, p: str) -> dict:
        """q_proj / k_proj rows reordered head by head (pairs to halves; exact at every quantization)."""
        a = self.args
        S = a.head_dim
        dense = dict(dense)
        for n, heads in (("q_proj", a.num_attention_heads), ("k_proj", a.num_key_value_heads)):
            rows = (np.arange(heads)[:, None] * S + pairs_to_halves(S)[None, :]).reshape(-1)
            for f in (".w", ".s"):
                arr = dense.get(p + n + f)
                if arr is not None:
                    dense[p + n + f] = np.ascontiguousarray(arr[rows])
        return super().attention_weights(dense, p)

    def alloc_kv(self) -> None:
        super().alloc_kv()
        a = self.args
        if a.llama3_rope:
            inv = llama3_inv_freq(a.head_dim, a.rope_theta, *a.llama3_rope)
            ang = np.arange(self.C, dtype=np.float32)[:, None] * inv[None, :]
            self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.unit = np.ones(a.head_dim, np.float32)  # the weightless q/k norm

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Layer i's attention on x float32 [T, D] at positions pos0..: RoPE layers rotate, norm
        and attend within their chunk; NoPE layers scale q by the temperature and attend causally."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32), np.empty((T, Hkv * S), np.float32),
                                np.empty((T, Hkv * S), np.float32)))
        q3, k3 = q.reshape(T, H, S), k.reshape(T, Hkv, S)
        rope = a.rope_layers[i]
        if rope:
            K.rope(q3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
            K.rope(k3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
            if a.use_qk_norm:
                q2, k2 = q.reshape(-1, S), k.reshape(-1, S)
                K.rmsnorm(q2, self.unit, a.rms_norm_eps, q2)
                K.rmsnorm(k2, self.unit, a.rms_norm_eps, k2)
        elif a.attn_temperature_tuning:
            p = np.arange(pos0, pos0 + T, dtype=np.float32)
            scale = (np.log1p(np.floor((p + np.float32(1.0)) / np.float32(a.floor_scale))) * np.float32(a.attn_scale)
                     + np.float32(1.0)).astype(np.float32)
            q3 *= scale[:, None, None]
        self._kv_append(i, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        kc, vc = self.k_cache[i], self.v_cache[i]
        c = a.attention_chunk_size if rope else 0
        if not c:
            self._attend(q3, kc, vc, pos0, None, att)
        else:  # each run of queries in one chunk sees that chunk's keys up to itself
            t = 0
            while t < T:
                start = (pos0 + t) // c * c
                n = min(T - t, start + c - (pos0 + t))
                self._attend(q3[t:t + n], kc[:, start:], vc[:, start:], pos0 + t - start, None, att[t:t + n])
                t += n
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The top-K logits (larger first, lower id on ties) and their sigmoids."""
        idx = np.argsort(-logits, axis=1, kind="stable")[:, :self.args.num_experts_per_tok]
        top = np.take_along_axis(logits, idx, axis=1).astype(np.float32)
        return idx.astype(np.int64), (np.float32(1.0) / (np.float32(1.0) + np.exp(-top))).astype(np.float32)

    def moe(self, j: int, x: np.ndarray) -> np.ndarray:
        """MoE layer j on x [T, D]: each chosen expert runs on the normed row times its sigmoid
        weight (one row per token and rank, summed over the ranks), plus the shared expert."""
        a = self.args
        ly = self.layers[self.moe_layer_ids[j]]
        T, D = x.shape
        Kk = a.num_experts_per_tok
        h = np.empty_like(x)
        K.rmsnorm(x, ly["post_attention_layernorm"], a.rms_norm_eps, h)
        logits = self.router_logits(j, h)
        idx, w = self.route(j, logits)
        self.observers.publish("on_route", j, idx, logits)
        rows = (h[:, None, :] * w[:, :, None]).reshape(T * Kk, D)  # [T*K, D]: the scaled inputs
        one = np.ones((T * Kk, 1), np.float32)
        fields = self._t1_plan() if T * Kk == 1 else None
        if fields is not None:
            routed = self._moe_t1(j, rows, idx.reshape(-1, 1), one, fields, x)
        else:
            routed = self._moe_grouped(j, rows, idx.reshape(-1, 1), one)
        out = self.dense_mlp(ly["shared_expert"], h, a.shared_expert_intermediate_size)
        out += routed.reshape(T, Kk, D).sum(axis=1, dtype=np.float32) if Kk > 1 else routed
        return out
