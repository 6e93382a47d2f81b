"""Building blocks shared by every model family: config validation helpers, the common
``ModelArgs``, the checkpoint-name mapping types, and the decoder (attention, RMSNorm, RoPE,
router, routed experts through an ``ExpertProvider``, dense MLP, shared expert).

Key: T tokens in this call, D hidden, V vocab, E experts, K experts per token, I expert width,
H query heads, Hkv KV heads, S head size, C context capacity, L transformer layers,
M MoE layers (layers with routed experts; M <= L).

Layer indices. The model has L transformer layers; only M of them ("MoE layers") route to
experts. Everything about experts (the store's expert table, the cache, heat, pins, traces,
PILOT, the residency snapshot) is indexed by the MoE-layer index j in 0..M-1, where
``args.moe_layers[j]`` is the transformer layer it sits in. Dense layers (Qwen's
``mlp_only_layers`` / ``decoder_sparse_step``) have a resident MLP and no row anywhere in the
expert machinery. For OLMoE, Mixtral and the published Qwen MoE checkpoints M == L and the two
indices coincide.

Sources: transformers' models/{olmoe,qwen3_moe,mixtral,qwen2_moe}/modeling_*.py (the
arithmetic), mlx-lm's models/*.py (the one-file-per-family contract: args from config.json with
Hugging Face names, the checkpoint-name mapping, the forward).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from ..errors import Cancelled, ConfigError
from ..quant import deinterleave_q4, huge_empty, kind_of
from ..observers import ObserverList
from ..ram_budget import release_compiler_memory
from .routing import route_tokens

from ..kernel_choice import K

log = logging.getLogger(__name__)

# The family registry (engine/models/__init__.py, which imports every family and so this module)
# registers its lookup here: ModelArgs.from_dict dispatches to a family without importing it.
_FAMILY_FOR: list = []


def register_family_lookup(family_for) -> None:
    """Make ``family_for(model_type, path) -> family module`` the lookup of ModelArgs.from_dict."""
    _FAMILY_FOR[:] = [family_for]

PREFILL_CHUNK = 128
# int4 attention matrices stored row-interleaved (Linear.interleave, K.linear_q4i): a decode step
# reads each group of 4 rows in one pass. Values are bit-identical; tests turn it off to compare.
INTERLEAVE_Q4 = True
# A decode step's attention block in one kernel call (K.attention_t1) where the layer is the plain
# kind it runs; the same values either way. Tests turn it off to compare.
ATTENTION_T1 = True
DECODE_T1 = True  # a decode step's layers in one K.decode_layers_t1 call where it applies (_decode_step_all)
# A prompt longer than a chunk on a cache that cannot hold every expert runs layer by layer over
# the whole prompt (attention in chunks, the experts over waves of PREFILL_WAVE tokens), so each
# expert a layer needs is read once per wave, not once per chunk; the same values either way.
# A wave's expert rows take ~3 x wave x top-k x hidden x 4 bytes while it runs (Qwen3-30B-A3B:
# ~400 MB at 2048 tokens). Tests turn it off to compare.
PREFILL_BY_LAYER = True
PREFILL_WAVE = 2048
KV_DTYPES = {"f16": np.uint16, "f32": np.float32}  # KV cache element: IEEE half bits or float32
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # slab field names (store canonical)


# --- config.json validation helpers -------------------------------------------------------

def num(cfg: dict, key: str, path: str, lo: float, hi: float, *, integer: bool, default=None,
        family: str = "model"):
    """``cfg[key]`` checked to be a number in [lo, hi] (an int when ``integer``).

    Raises:
        ConfigError: naming ``path`` and ``key`` (missing without a default, wrong type, out of range).
    """
    if key not in cfg or cfg[key] is None:
        if default is not None:
            return default
        raise ConfigError(f"{path}: required key '{key}' is missing; this is not a complete "
                          f"{family} config.json (re-download the model's config.json)")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}: key '{key}' must be a number, got {type(v).__name__} {v!r}")
    if integer and (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{path}: key '{key}' must be an integer, got {v!r}")
    if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
        raise ConfigError(f"{path}: key '{key}' = {v!r} is out of range [{lo}, {hi}]")
    return int(v) if integer else float(v)


def flag(cfg: dict, key: str, path: str, default: bool) -> bool:
    """``cfg[key]`` as a bool (absent or null -> default). Raises ConfigError naming path/key."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: key '{key}' must be true or false, got {v!r}")
    return v


def int_list(cfg: dict, key: str, path: str, hi: int) -> tuple[int, ...]:
    """``cfg[key]`` as a tuple of ints in [0, hi) (absent or null -> ()). Raises ConfigError."""
    v = cfg.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < hi
                                      for x in v):
        raise ConfigError(f"{path}: key '{key}' must be a list of layer indices in [0, {hi}), got {v!r}")
    return tuple(sorted(set(v)))


def _rope_dicts(cfg: dict, path: str) -> tuple[dict, dict]:
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{path}: key 'rope_parameters' must be an object")
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{path}: key 'rope_scaling' must be an object or null")
    return rope, scaling


def rope_type(cfg: dict, path: str) -> str:
    """The RoPE type config.json asks for: ``rope_parameters.rope_type`` (transformers 5) or
    the legacy ``rope_scaling`` ``rope_type`` / ``type``; "default" when neither scales.

    Raises:
        ConfigError: the two keys name different scaling types.
    """
    rope, scaling = _rope_dicts(cfg, path)
    a = rope.get("rope_type") or "default"
    b = scaling.get("rope_type") or scaling.get("type") or "default"
    if a != "default" and b != "default" and a != b:
        raise ConfigError(f"{path}: rope_parameters says rope_type {a!r} but rope_scaling says {b!r}; keep one")
    return a if a != "default" else b


def rope_theta(cfg: dict, path: str, default: float = 10000.0, allow: tuple[str, ...] = ("default",)) -> float:
    """RoPE base from ``rope_parameters.rope_theta`` (transformers 5) or ``rope_theta`` (4.x).

    ``allow``: the rope types the family reads (its other parameters are parsed by
    :func:`yarn_params`).

    Raises:
        ConfigError: a rope type not in ``allow`` (linear, dynamic, ...) or a bad value.
    """
    rope, _ = _rope_dicts(cfg, path)
    rtype = rope_type(cfg, path)
    if rtype not in (None, *allow):
        raise ConfigError(f"{path}: rope_type {rtype!r} is not supported (only "
                          f"{', '.join(repr(a) for a in allow)}); remove rope_scaling from config.json to run "
                          f"at the native context length")
    if "rope_theta" in rope:
        return num(rope, "rope_theta", path + " rope_parameters", 1.0, 1e12, integer=False)
    return num(cfg, "rope_theta", path, 1.0, 1e12, integer=False, default=default)


def yarn_params(cfg: dict, path: str, max_pos: int) -> tuple[tuple[str, float], ...]:
    """YaRN RoPE scaling parameters (DeepSeek-V2/V3, Kimi-K2, GLM) as sorted (name, value)
    pairs, or () when config.json asks for plain RoPE. Names as transformers'
    ``_compute_yarn_parameters``: factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim, attention_factor (absent ones get its defaults).

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    if rope_type(cfg, path) != "yarn":
        return ()
    rope, scaling = _rope_dicts(cfg, path)
    src = {**rope, **scaling} if (rope.get("rope_type") or "default") == "default" else {**scaling, **rope}
    where = path + " rope_scaling"
    out = {"factor": num(src, "factor", where, 1.0, 1e6, integer=False),
           "original_max_position_embeddings": num(
               src, "original_max_position_embeddings", where, 1, 1 << 24, integer=True,
               default=cfg.get("original_max_position_embeddings") or max_pos),
           "beta_fast": num(src, "beta_fast", where, 0.0, 1e6, integer=False, default=32.0),
           "beta_slow": num(src, "beta_slow", where, 0.0, 1e6, integer=False, default=1.0)}
    for k in ("mscale", "mscale_all_dim", "attention_factor"):
        if src.get(k) is not None:
            out[k] = num(src, k, where, 0.0, 1e6, integer=False)
    out["truncate"] = 1.0 if flag(src, "truncate", where, True) else 0.0
    return tuple(sorted(out.items()))


def expert_groups(cfg: dict, path: str, num_experts: int, num_experts_per_tok: int,
                  topk_group_default: int | None = None) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router (DeepSeek, GLM), validated: the experts
    split evenly into n_group groups and the topk_group kept groups hold at least K experts.
    ``topk_group_default`` None = n_group.

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    E = num_experts
    n_group = num(cfg, "n_group", path, 1, E, integer=True, default=1)
    if E % n_group:
        raise ConfigError(f"{path}: the {E} routed experts must be a multiple of n_group ({n_group})")
    topk_group = num(cfg, "topk_group", path, 1, n_group, integer=True,
                     default=n_group if topk_group_default is None else topk_group_default)
    if num_experts_per_tok > topk_group * (E // n_group):
        raise ConfigError(f"{path}: num_experts_per_tok ({num_experts_per_tok}) exceeds the experts of "
                          f"topk_group ({topk_group}) groups of {E // n_group}")
    return n_group, topk_group


def sparse_layers(cfg: dict, path: str, v: dict, family: str) -> dict:
    """Qwen2-MoE / Qwen3-MoE layer kinds: layer i has routed experts iff i is not in
    ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0; the others are dense
    (their MLP width ``intermediate_size`` is then required). ``v``: common_args' dict, whose
    intermediate_size is updated. Returns the ModelArgs fields moe_layers,
    decoder_sparse_step, mlp_only_layers.

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    L = v["num_hidden_layers"]
    step = num(cfg, "decoder_sparse_step", path, 1, L, integer=True, default=1)
    only = int_list(cfg, "mlp_only_layers", path, L)
    moe = tuple(i for i in range(L) if i not in only and (i + 1) % step == 0)
    if len(moe) < L:
        v["intermediate_size"] = num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True, family=family)
    return {"moe_layers": moe, "decoder_sparse_step": step, "mlp_only_layers": only}


# --- arguments ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Architecture of a supported MoE checkpoint (Hugging Face names), the fields the shared
    decoder reads. Each family file's ``ModelArgs`` subclass fills them from its config.json.

    Attributes:
        intermediate_size: as config.json says: the expert width for OLMoE / Mixtral, the dense
            MLP width for the Qwen families. moe_intermediate_size: routed expert width I (the
            slab size depends on it). shared_expert_intermediate_size: 0 = no shared expert.
        qk_norm: "none", "proj" (OLMoE: RMSNorm over the whole projected q / k) or "head"
            (Qwen3: RMSNorm over each head's S values).
        attention_bias: q/k/v projections have biases (Qwen2-MoE).
        moe_layers: transformer layers with routed experts (ascending); the others are dense.
        layer_windows: per transformer layer, the sliding-window size in tokens (0 = full
            causal attention); a query at position p sees keys p - w + 1 .. p.
        shared_expert_gated: the shared expert is scaled by sigmoid(shared_expert_gate h)
            (Qwen2-MoE); DeepSeek / GLM add theirs ungated.
        rotary_dim: leading values of each head that RoPE rotates (GLM's
            ``partial_rotary_factor``); 0 = all of head_dim. rope_scaling: YaRN parameters
            (:func:`yarn_params`), () = plain RoPE.
        expert_bias: every routed expert projection has a float32 bias, stored in its slab
            (gpt-oss; :func:`engine.quant.slab_layout` ``bias``).
        scoring_func, topk_method, n_group, topk_group, routed_scaling_factor, router_bias: the
            router (engine/models/routing.py): "softmax" or "sigmoid" scores; "greedy",
            "group_limited_greedy" (DeepSeek-V2) or "noaux_tc" (DeepSeek-V3 / GLM: groups by
            the sum of their top-2 biased scores); router_bias: an ``e_score_correction_bias``
            used for the choice only.
        mtp_layers: multi-token-prediction layers a store keeps (engine/mtp.py): transformer
            layers num_hidden_layers.. after the decoder, listed in ``moe_layers`` (rows of the
            expert table and the cache) but not run by the decoder's forward. 0 from config.json.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    moe_intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    norm_topk_prob: bool
    tie_word_embeddings: bool
    clip_qkv: float | None = None
    qk_norm: str = "none"
    attention_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    moe_layers: tuple[int, ...] = ()
    layer_windows: tuple[int, ...] = ()
    rotary_dim: int = 0
    rope_scaling: tuple[tuple[str, float], ...] = ()
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    mtp_layers: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Values one token adds to one layer's KV cache: K and V of every KV head."""
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers holding a KV cache (all of them here; a hybrid family's full-attention ones)."""
        return self.num_hidden_layers

    @property
    def recurrent_state_bytes(self) -> int:
        """Bytes of per-layer recurrent state a family holds whatever the context length
        (linear attention, Qwen3-Next); counted with the KV cache by the budget. 0 here."""
        return 0

    @property
    def kv_values_all_layers(self) -> int:
        """Values one token adds to the KV cache over all layers (sizing's KV bytes):
        num_kv_layers x kv_values_per_token, unless a family caches more on some layers than on
        others (DeepSeek sparse attention's indexer keys)."""
        return self.num_kv_layers * self.kv_values_per_token

    @property
    def num_moe_layers(self) -> int:
        """M: layers with routed experts (rows of the expert table, the cache and the heat)."""
        return len(self.moe_layers)

    @property
    def moe_index(self) -> tuple[int, ...]:
        """Per transformer layer: its MoE-layer index j, or -1 for a dense layer."""
        idx = [-1] * (self.num_hidden_layers + self.mtp_layers)
        for j, i in enumerate(self.moe_layers):
            idx[i] = j
        return tuple(idx)

    def dense_param_count(self) -> int:
        """Parameters that stay resident (everything but the routed experts)."""
        D, V = self.hidden_size, self.vocab_size
        attn = D * self.q_dim + 2 * D * self.kv_dim + self.q_dim * D
        attn += {"proj": self.q_dim + self.kv_dim, "head": 2 * self.head_dim}.get(self.qk_norm, 0)
        attn += (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        M, L = self.num_moe_layers, self.num_hidden_layers
        moe = self.moe_resident_params()
        dense_mlp = 3 * D * self.intermediate_size
        return (V * D * (1 if self.tie_word_embeddings else 2) + L * (attn + 2 * D) + M * moe
                + (L - M) * dense_mlp + D)

    def moe_resident_params(self) -> int:
        """Resident parameters of one MoE layer: router [E, D] (+ correction bias [E]) and the
        shared expert (3 D Is, + its gate [D] when gated)."""
        D, E, Is = self.hidden_size, self.num_experts, self.shared_expert_intermediate_size
        return (E * D + (E if self.router_bias else 0)
                + ((3 * D * Is + (D if self.shared_expert_gated else 0)) if Is else 0))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Validate a parsed config.json with the parser of its ``model_type``'s family.

        Raises:
            ConfigError: naming ``path`` and the key; an unsupported model_type gets one line
                naming the supported families.
        """
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        return _FAMILY_FOR[0](cfg.get("model_type"), path).ModelArgs.from_dict(cfg, path)

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike) -> "ModelArgs":
        """Read and validate ``path`` (a config.json file or a folder holding one).

        Raises:
            ConfigError: the file is missing (a folder holding only GGUF files gets its own
                message), not JSON, or a key is invalid (file and key named).
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            check_not_gguf(p.parent)
            raise ConfigError(f"{p}: not found; a model folder needs its config.json") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read ({e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e}); the file is corrupt - re-download it") from None
        if len(text) > 64 << 20:
            raise ConfigError(f"{p}: implausibly large for a config.json ({len(text)} bytes)")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, str(p))


def check_not_gguf(folder: Path, has_config: bool = False) -> None:
    """Raise ConfigError when ``folder`` holds GGUF files but no Hugging Face checkpoint (no
    config.json, or - ``has_config`` - no safetensors beside it)."""
    try:
        ggufs = sorted(x.name for x in folder.glob("*.gguf"))
    except OSError:
        return
    if ggufs and (has_config or not (folder / "config.json").exists()):
        raise ConfigError(
            f"{folder}: holds GGUF file(s) ({ggufs[0]}{', ...' if len(ggufs) > 1 else ''}), not a Hugging Face "
            f"checkpoint (config.json and *.safetensors); import a GGUF with `colibri convert "
            f"{folder / ggufs[0]} STORE` (or the wizard's 'From this computer')")


def common_args(cfg: dict, path: str, family: str, *, expert_width_key: str,
                experts_keys: tuple[str, ...] = ("num_experts",), head_dim_must_tile: bool = False,
                eps_default: float = 1e-6, theta_default: float = 10000.0,
                rope_types: tuple[str, ...] = ("default",)) -> dict:
    """The keys every family shares, validated: returns a dict of ModelArgs fields.

    ``expert_width_key``: the config key of the routed expert width ("intermediate_size" for
    OLMoE / Mixtral, "moe_intermediate_size" for Qwen). ``experts_keys``: accepted names of
    the expert count, first present wins (transformers 5 writes Qwen3's as num_local_experts).

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    def n(key, lo, hi, **kw):
        return num(cfg, key, path, lo, hi, integer=True, family=family, **kw)

    v = {k: n(k, 1, hi) for k, hi in (("hidden_size", 1 << 20), ("num_hidden_layers", 4096),
                                      ("num_attention_heads", 1 << 16), ("vocab_size", 1 << 24),
                                      ("num_experts_per_tok", 1 << 20))}
    ek = next((k for k in experts_keys if cfg.get(k) is not None), experts_keys[0])
    v["num_experts"] = n(ek, 1, 1 << 20)
    v["moe_intermediate_size"] = n(expert_width_key, 1, 1 << 24)
    v["intermediate_size"] = n("intermediate_size", 1, 1 << 24, default=v["moe_intermediate_size"])
    heads = v["num_attention_heads"]
    kv = n("num_key_value_heads", 1, heads, default=heads)
    if heads % kv:
        raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv})")
    if v["num_experts_per_tok"] > v["num_experts"]:
        raise ConfigError(f"{path}: num_experts_per_tok ({v['num_experts_per_tok']}) exceeds "
                          f"{ek} ({v['num_experts']})")
    if cfg.get("head_dim") is None:
        if v["hidden_size"] % heads:
            raise ConfigError(f"{path}: hidden_size ({v['hidden_size']}) is not divisible by "
                              f"num_attention_heads ({heads}) and no head_dim is given")
        head_dim = v["hidden_size"] // heads
    else:
        head_dim = n("head_dim", 2, 1 << 16)
    if head_dim % 2:
        raise ConfigError(f"{path}: head_dim ({head_dim}) must be even for rotary embeddings")
    if head_dim_must_tile and head_dim * heads != v["hidden_size"]:
        raise ConfigError(f"{path}: num_attention_heads x head_dim = {heads * head_dim} must equal "
                          f"hidden_size ({v['hidden_size']}) for {family}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
    v.update(
        num_key_value_heads=kv, head_dim=head_dim, model_type=cfg["model_type"],
        max_position_embeddings=n("max_position_embeddings", 1, 1 << 24, default=4096),
        rms_norm_eps=num(cfg, "rms_norm_eps", path, 1e-12, 1.0, integer=False, default=eps_default),
        rope_theta=rope_theta(cfg, path, theta_default, rope_types),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", path, False),
    )
    return v


# --- checkpoint-name mapping ------------------------------------------------------------------

class Tensor(NamedTuple):
    """One resident tensor: Hugging Face name -> store canonical name.

    kind: "keep" (stored float32 as is: norms, routers, biases, gates) or "quant" (a matrix
    stored in the store's dense quantization). split: "" (stored as one tensor named
    ``ours``) or the name of a family transform that stores it as several tensors (MLA's
    kv_b_proj: ``family.split_shapes(args, t)`` lists them, ``family.split_tensor(args, t, w)``
    makes them from the float32 checkpoint tensor).
    """

    hf: str
    ours: str
    shape: tuple[int, ...]
    kind: str
    split: str = ""


@dataclass(frozen=True)
class ExpertNames:
    """Where layer ``layer``'s routed experts live in a checkpoint.

    Per-expert names (published checkpoints, and transformers' save_pretrained):
    ``f"{prefix}{e}.{hf_proj[p]}.weight"`` for p in gate_proj / up_proj / down_proj.
    Fused 3-D names (transformers 5's in-memory layout, written by some tools):
    ``{fused_prefix}gate_up_proj`` [E, 2I, D] (gate rows first, then up) and
    ``{fused_prefix}down_proj`` [E, D, I].
    """

    layer: int
    prefix: str
    hf_proj: dict = field(default_factory=lambda: {p: p for p in EXPERT_PROJS})
    fused_prefixes: tuple[str, ...] = ()

    def name(self, e: int, proj: str) -> str:
        return f"{self.prefix}{e}.{self.hf_proj[proj]}.weight"


def attention_tensors(args: ModelArgs, i: int) -> list[Tensor]:
    """Norms and attention of transformer layer i (q/k norms and biases as args say)."""
    D, S = args.hidden_size, args.head_dim
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    out = [Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    for p, o in (("q_proj", args.q_dim), ("k_proj", args.kv_dim), ("v_proj", args.kv_dim)):
        out.append(Tensor(f"{hp}self_attn.{p}.weight", cp + p, (o, D), "quant"))
    out.append(Tensor(hp + "self_attn.o_proj.weight", cp + "o_proj", (D, args.q_dim), "quant"))
    if args.qk_norm != "none":
        qn, kn = (args.q_dim, args.kv_dim) if args.qk_norm == "proj" else (S, S)
        out += [Tensor(hp + "self_attn.q_norm.weight", cp + "q_norm", (qn,), "keep"),
                Tensor(hp + "self_attn.k_norm.weight", cp + "k_norm", (kn,), "keep")]
    if args.attention_bias:
        out += [Tensor(f"{hp}self_attn.{p}.bias", f"{cp}{p}.bias", (o,), "keep")
                for p, o in (("q_proj", args.q_dim), ("k_proj", args.kv_dim), ("v_proj", args.kv_dim))]
    return out


def mlp_tensors(hf_prefix: str, our_prefix: str, D: int, I: int) -> list[Tensor]:
    """A resident SwiGLU MLP (dense layer or shared expert): gate/up [I, D], down [D, I]."""
    return [Tensor(f"{hf_prefix}gate_proj.weight", our_prefix + "gate_proj", (I, D), "quant"),
            Tensor(f"{hf_prefix}up_proj.weight", our_prefix + "up_proj", (I, D), "quant"),
            Tensor(f"{hf_prefix}down_proj.weight", our_prefix + "down_proj", (D, I), "quant")]


def global_tensors(args: ModelArgs) -> list[Tensor]:
    """Embeddings, final norm and lm_head (the tied embedding when tie_word_embeddings)."""
    D, V = args.hidden_size, args.vocab_size
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    return [Tensor("model.embed_tokens.weight", "embed_tokens", (V, D), "quant"),
            Tensor("model.norm.weight", "norm", (D,), "keep"),
            Tensor(lm, "lm_head", (V, D), "quant")]


def decoder_tensors(args: ModelArgs, block: str = "mlp", shared: str = "mlp.shared_expert.",
                    attention=None) -> list[Tensor]:
    """Every resident tensor of a pre-norm MoE decoder, Hugging Face -> store names.

    ``block``: the module holding the router and experts ("mlp" for OLMoE / Qwen,
    "block_sparse_moe" for Mixtral). MoE layers: router ``{block}.gate.weight`` [E, D] ->
    ``layers.i.router`` (float32), plus the shared expert (``mlp.shared_expert.*`` ->
    ``layers.i.shared_expert.*``, ``mlp.shared_expert_gate.weight`` [1, D]) when args has one.
    Dense layers: ``mlp.{gate,up,down}_proj`` -> ``layers.i.mlp.*``. ``shared``: the shared
    expert's module prefix (DeepSeek / GLM: "mlp.shared_experts."); its gate only when
    ``args.shared_expert_gated``; the router's ``e_score_correction_bias`` [E] ->
    ``layers.i.router_bias`` when ``args.router_bias``. ``attention``: the family's
    ``(args, i) -> [Tensor]`` for layer i's norms and attention (default
    :func:`attention_tensors`).
    """
    D, E = args.hidden_size, args.num_experts
    moe = set(args.moe_layers)
    out: list[Tensor] = []
    for i in range(args.num_hidden_layers):
        hp, cp = f"model.layers.{i}.", f"layers.{i}."
        out += (attention or attention_tensors)(args, i)
        if i in moe:
            out.append(Tensor(f"{hp}{block}.gate.weight", cp + "router", (E, D), "keep"))
            if args.router_bias:
                out.append(Tensor(f"{hp}{block}.gate.e_score_correction_bias", cp + "router_bias", (E,), "keep"))
            Is = args.shared_expert_intermediate_size
            if Is:
                out += mlp_tensors(hp + shared, cp + "shared_expert.", D, Is)
                if args.shared_expert_gated:
                    out.append(Tensor(hp + "mlp.shared_expert_gate.weight", cp + "shared_expert_gate", (1, D), "keep"))
        else:
            out += mlp_tensors(hp + "mlp.", cp + "mlp.", D, args.intermediate_size)
    return out + global_tensors(args)


def expert_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    D, I = args.hidden_size, args.moe_intermediate_size
    return {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}


def hf_names(family, args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a per-expert checkpoint of ``family`` holds, with its shape, in a fixed
    order (global tensors, then layer by layer: resident tensors, then experts; the seeded
    synthetic checkpoints draw tensor n from the seed [seed, n], so the order is part of them)."""
    tensors = family.dense_tensors(args)
    names = {t.hf: t.shape for t in tensors if not t.hf.startswith("model.layers.")}
    by_layer: dict[int, list[Tensor]] = {}
    for t in tensors:
        if t.hf.startswith("model.layers."):
            by_layer.setdefault(int(t.hf.split(".")[2]), []).append(t)
    shapes = expert_shapes(args)
    moe = set(args.moe_layers)
    for i in range(args.num_hidden_layers):
        names.update({t.hf: t.shape for t in by_layer.get(i, [])})
        if i in moe and hasattr(family, "expert_tensors"):  # fused experts only (gpt-oss)
            names.update(family.expert_tensors(args, i))
        elif i in moe:
            en = family.expert_names(args, i)
            for e in range(args.num_experts):
                for p in EXPERT_PROJS:
                    names[en.name(e, p)] = shapes[p]
    return names


# --- arithmetic -----------------------------------------------------------------------------


class ExpertProvider(Protocol):
    """Where expert weights come from. ``prepare`` announces the experts a layer is about to
    use (so misses can be read concurrently) and may return the order to compute them in
    (resident ones first); ``acquire`` returns the slab's views and pins it until ``release``.
    ``layer`` is the MoE-layer index j (see the module docstring).

    Optional: ``prepare_split(layer, experts) -> (hits, misses)`` (engine/expert_cache.py):
    ``prepare`` with the experts resident now apart, so a prefill chunk runs them in one call,
    taken with ``acquire_many(layer, experts) -> [views]`` and given back with
    ``release_many(layer, experts)`` (one lock round-trip each). ``take_split(layer, experts)
    -> (hits, slots, misses)`` with ``release_slots`` and ``slot_offsets``, and an ``arena``
    and ``store.layout``: a decode step's lookup and its hits taken at once, run in one kernel
    call reading the arena in place.

    Optional: ``dispatch(layer, xs, bounds, single)`` (engine/cluster.py). A provider that has
    it computes some experts elsewhere: its ``prepare`` returns only the experts to compute
    here, ``dispatch`` gets every expert's rows (``xs[lo:hi]`` for ``bounds[e] = (lo, hi)``,
    or the one row xs [1, D] when ``single``) and returns None or an object whose
    ``collect(outs, xs, scratch)`` fills rows lo:hi of outs [T*K, D] for the others."""

    def prepare(self, layer: int, experts: np.ndarray) -> list[int] | None: ...
    def acquire(self, layer: int, expert: int) -> dict: ...
    def release(self, layer: int, expert: int) -> None: ...


class Linear:
    """A resident dense matrix [O, N] in one of the kinds of engine/kernels, optional float32 bias [O].

    ``il``: the int4 rows are interleaved by groups of K.IL (:meth:`interleave`; w is then
    uint8 [O / IL, N / 64, IL * 32] and runs K.linear_q4i, bit-identical to K.linear_q4)."""

    il = False

    def __init__(self, dense: dict, name: str, kind: str, group_size: int = 32):
        self.w = dense[name + ".w"]
        self.s = dense.get(name + ".s")
        # the arrays say what they are: a store may mix kinds (int4 attention, int8 lm_head)
        self.kind = kind_of(self.w, self.s)
        self.bias = dense.get(name + ".bias")
        self.gs = group_size
        self.out_features = self.w.shape[0]

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.kind == "int8":
            K.linear_q8(x, self.w, self.s, out)
        elif self.kind == "f32":
            K.linear_f32(x, self.w, out)
        elif self.kind == "f16":
            K.linear_f16(x, self.w, K.F16_TABLE, out)
        elif self.kind == "mxfp4":
            K.linear_mxfp4(x, self.w, self.s, out)
        elif self.il:
            K.linear_q4i(x, self.w, self.s, self.gs, out)
        else:
            K.linear_q4(x, self.w, self.s, self.gs, out)
        if self.bias is not None:
            out += self.bias
        return out

    def interleave(self) -> "Linear":
        """Store int4 weights row-interleaved (K.interleave_q4) where K.q4_interleavable holds and
        INTERLEAVE_Q4 is on; a no-op otherwise. The values it computes do not change."""
        if INTERLEAVE_Q4 and self.kind == "int4" and not self.il and K.q4_interleavable(self.w, self.s, self.gs):
            w = K.interleave_q4(self.w)
            self.w = huge_empty(w.shape, w.dtype)  # streamed every token: huge pages (the loaded w's)
            self.w[...] = w
            self.il = True
        return self


class LinearGroup:
    """Resident matrices applied to the same input x [T, N] (the attention's q / k / v): one
    kernel call for all of them (K.linears_q4 / linears_q8: x quantized once, one parallel
    launch) when they are all int4 with the same scale dtype or all int8, with identical array
    types (one compiled specialization); otherwise each Linear on its own. Values are
    bit-identical either way (tests/test_kernels.py, tests/test_families.py)."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        first = parts[0]

        def sig(p):
            return (p.kind, p.il, p.gs, p.w.dtype, p.w.ndim, p.w.flags.c_contiguous, p.w.flags.writeable,
                    p.s.dtype, p.s.ndim, p.s.flags.c_contiguous, p.s.flags.writeable)
        same = (len(parts) > 1 and first.kind in ("int4", "int8")
                and all(p.kind == first.kind for p in parts) and all(sig(p) == sig(first) for p in parts))
        self.kind = first.kind if same else None
        self.il = same and first.il  # every part row-interleaved: K.linears_q4i
        self.w = tuple(p.w for p in parts)
        self.s = tuple(p.s for p in parts)
        self.gs = first.gs

    def __call__(self, x: np.ndarray, outs: tuple) -> tuple:
        """outs: float32 [T, O_m] per part, filled with x @ W_m^T (+ bias); returns outs."""
        if self.il:
            K.linears_q4i(x, self.w, self.s, self.gs, outs)
        elif self.kind == "int4":
            K.linears_q4(x, self.w, self.s, self.gs, outs)
        elif self.kind == "int8":
            K.linears_q8(x, self.w, self.s, outs)
        else:
            for p, o in zip(self.parts, outs):
                p(x, o)
            return outs
        for p, o in zip(self.parts, outs):
            if p.bias is not None:
                o += p.bias
        return outs


def layers_of_type(layer_types: tuple[str, ...], kind: str) -> tuple[int, ...]:
    """The indices of the transformer layers whose ``layer_types`` entry is ``kind``."""
    return tuple(i for i, t in enumerate(layer_types) if t == kind)


def tensor_params(args, tensors) -> int:
    """Parameters of ``tensors`` (the family's dense_tensors), a tied lm_head counted once."""
    return sum(int(np.prod(t.shape)) for t in tensors
               if not (args.tie_word_embeddings and t.ours == "lm_head"))


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


_T1_FIELDS = ("gate_proj.w", "gate_proj.s", "up_proj.w", "up_proj.s", "down_proj.w", "down_proj.s")
_ARENA_DTYPES = {"int4": (np.dtype(np.uint8), np.dtype(np.uint16)), "int8": (np.dtype(np.int8), np.dtype(np.float32))}


def mlp_views(dense: dict, prefix: str) -> dict:
    return {f"{p}.{k}": dense[f"{prefix}{p}.{k}"] for p in EXPERT_PROJS for k in ("w", "s")
            if f"{prefix}{p}.{k}" in dense}


class MoEModel:
    """Resident dense weights + KV cache + an ExpertProvider: the decoder every family shares
    (pre-norm blocks: x += attn(norm(x)); x += mlp(norm(x))).

    Args:
        args: a family's ModelArgs. dense: canonical dense tensors (store names, see the
            family files). dense_quant / expert_quant: weight kinds. experts: the
            ExpertProvider (indexed by MoE layer). context_length: KV capacity C in tokens.
            kv_dtype: "f16" (the cache holds K and V as IEEE half, rounded to nearest even
            from the float32 projections, clipped to +-65504; half the RAM of "f32") or "f32".
            embed_rows: the token-embedding table read from the store row by row
            (engine.expert_store.EmbeddingRows; Engine.open passes it, so the table takes no
            RAM), or None to use ``dense["embed_tokens.w"]`` / ``.s``.

    The KV cache holds C positions for every layer, also for sliding-window layers (the window
    only masks attention; it does not shrink the cache).

    Raises:
        ValueError: unknown kv_dtype.
    """

    def __init__(self, args: ModelArgs, dense: dict, dense_quant: str, expert_quant: str,
                 experts: ExpertProvider, context_length: int, group_size: int = 32,
                 kv_dtype: str = "f16", embed_rows=None):
        self.args = a = args
        self.C = context_length
        self.experts = experts
        self.expert_quant = expert_quant
        self.dense_quant = dq = dense_quant
        self.gs = group_size
        self.embed_rows = embed_rows  # the table read row by row (engine.expert_store.EmbeddingRows), or None
        self.embed_w = embed_rows.w if embed_rows is not None else dense["embed_tokens.w"]
        self.embed_s = embed_rows.s if embed_rows is not None else dense.get("embed_tokens.s")
        self.embed_kind = kind_of(self.embed_w, self.embed_s)
        self.lm_head = Linear(dense, "lm_head", dq, group_size)
        self.norm = dense["norm"]
        self.moe_index = a.moe_index
        self.num_moe_layers = a.num_moe_layers - a.mtp_layers  # the MTP layers' rows follow (engine/mtp.py)
        self.windows = a.layer_windows or (0,) * a.num_hidden_layers
        self.layers = []
        for i in range(a.num_hidden_layers):
            p = f"layers.{i}."
            ly = {"input_layernorm": dense[p + "input_layernorm"],
                  "post_attention_layernorm": dense[p + "post_attention_layernorm"]}
            ly.update(self.attention_weights(dense, p))
            if self.moe_index[i] >= 0:
                ly["router"] = dense[p + "router"]
                ly["router_bias"] = dense.get(p + "router_bias")
                if a.shared_expert_intermediate_size:
                    ly["shared_expert"] = mlp_views(dense, p + "shared_expert.")
                    ly["shared_expert_gate"] = dense.get(p + "shared_expert_gate")
            else:
                ly["mlp"] = mlp_views(dense, p + "mlp.")
            self.layers.append(ly)
        self.moe_layer_ids = list(a.moe_layers)[:self.num_moe_layers]
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self.kv_dtype = kv_dtype
        self.alloc_kv()
        self._offs_memo: dict[tuple[int, int], tuple] = {}  # _arena_offsets
        self._sorted_memo: bool | None = None  # _sorted_ok
        self._t1_memo: tuple | None = None  # _t1_plan
        self._il_memo: bool | None = None  # _slabs_interleaved
        self._att1_memo: dict[int, tuple | None] = {}  # _attention_t1_args
        self._dec_memo: tuple | None = None  # _decode_plan
        self.routing_replay = None  # a replayed routing's step_logits for the one-call step (engine/trace.py)
        self.run_lookahead = None  # PILOT's predictions inside one-call runs (engine.prefetch.Pilot.run_plan)
        self._no_look = np.zeros(a.num_hidden_layers, np.bool_)  # the kernel's look_want without PILOT
        self._decode_ready = threading.Event()  # K.decode_layers_t1 compiled for this model (start_decode_warm)
        self.one_call_steps = 0  # decode steps run by _decode_step_all (the rest ran layer by layer)
        # (pos0, ids, x, kept) after each forward's chunk: its final residual rows x float32 [T, D]
        # (the MTP drafter's input, engine/mtp.py); kept: the fed tokens that are final (a verify's
        # first only)
        self.hidden_sink = None
        # Observers (engine/observers.py): forward start, and per MoE layer (MoE-layer indices)
        # layer start, post-attention residual, routing, post-MoE residual. Dense layers
        # publish nothing.
        self.observers = ObserverList()

    def attention_weights(self, dense: dict, p: str) -> dict:
        """Layer ``p``'s attention weights (GQA: q/k/v/o Linear, optional q/k norms); a family
        with another attention (MLA) overrides this, :meth:`alloc_kv` and :meth:`attention`."""
        ly = {"q_norm": dense.get(p + "q_norm"), "k_norm": dense.get(p + "k_norm")}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ly[n] = Linear(dense, p + n, self.dense_quant, self.gs).interleave()
        ly["qkv"] = LinearGroup([ly["q_proj"], ly["k_proj"], ly["v_proj"]])
        return ly

    def alloc_kv(self) -> None:
        """The KV cache k_cache, v_cache [L, Hkv, C, S] (KV_DTYPES[kv_dtype]; :func:`kv_zeros`:
        its memory grows with the positions written) and the RoPE tables."""
        a = self.args
        L, Hkv, S = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
        self.k_cache = kv_zeros((L, Hkv, self.C, S), KV_DTYPES[self.kv_dtype])  # [L, Hkv, C, S]
        self.v_cache = kv_zeros((L, Hkv, self.C, S), KV_DTYPES[self.kv_dtype])
        self.rotary_dim = a.rotary_dim or S
        self.cos, self.sin = rope_tables(self.rotary_dim, a.rope_theta, self.C, a.rope_scaling)  # [C, R/2]
        self.scale = np.float32(S ** -0.5)

    def rewind(self, p: int) -> int:
        """Prepare to continue at a position s <= p whose cached state is valid, given that the
        KV rows of positions < p are; returns s (here p: the KV cache is positional). A family
        with recurrent state (Qwen3-Next) returns an earlier position it holds the state of."""
        return p

    def verify(self, ids: np.ndarray, pos0: int, cancel: threading.Event | None = None) -> np.ndarray:
        """A speculative draft's check (engine/speculative.py): logits float32 [T, V] of tokens
        ``ids`` (int [T]) at positions pos0..pos0+T-1, row t bit-identical to the logits a
        one-token forward at pos0 + t would give after the rows before it (the T > 1 kernels
        compute every row as the one-token ones do). Call :meth:`accept` next. Raises as
        :meth:`forward`."""
        return self.forward(ids, pos0, all_logits=True, cancel=cancel)

    def accept(self, n: int) -> None:
        """Keep the first ``n`` (1..T) positions of the last :meth:`verify`. The KV cache is
        positional: the rows past them are never read (attention reads only positions before
        its own) and the next forward overwrites them. A family with recurrent state rolls it
        back to pos0 + n (qwen3_next.py)."""

    def subscribe(self, observer) -> None:
        """Publish this model's forward, layer and routing events to ``observer`` (any object
        with some of the hooks of ``engine.observers.Observer``), after earlier subscribers."""
        self.observers.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        """Stop publishing to ``observer`` (no-op if it is not subscribed)."""
        self.observers.unsubscribe(observer)

    @property
    def kv_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    # --- blocks -----------------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Rows float32 [T, D] of tokens ``ids`` (int [T]) of the embedding table, held in RAM
        or read row by row from the store (``embed_rows``: the same values)."""
        D = self.args.hidden_size
        x = np.empty((len(ids), D), dtype=np.float32)  # [T, D]
        w, s = self.embed_w, self.embed_s
        if self.embed_rows is not None:
            ids, w, s = self.embed_rows.rows(ids)
        if self.embed_kind == "int8":
            K.embed_q8(ids, w, s, x)
        elif self.embed_kind == "int4":
            K.embed_q4(ids, w, s, self.gs, x)
        elif self.embed_kind == "f16":
            x[:] = K.F16_TABLE[w[ids]]
        else:
            x[:] = w[ids]
        return x

    def qk_norm(self, i: int, q: np.ndarray, k: np.ndarray) -> None:
        """In place: OLMoE ("proj") normalises the whole projection [T, H*S]; Qwen3 ("head")
        each head's S values (rows of the [T*H, S] view)."""
        a, ly = self.args, self.layers[i]
        if a.qk_norm == "proj":
            K.rmsnorm(q, ly["q_norm"], a.rms_norm_eps, q)
            K.rmsnorm(k, ly["k_norm"], a.rms_norm_eps, k)
        elif a.qk_norm == "head":
            S = a.head_dim
            q2, k2 = q.reshape(-1, S), k.reshape(-1, S)
            K.rmsnorm(q2, ly["q_norm"], a.rms_norm_eps, q2)
            K.rmsnorm(k2, ly["k_norm"], a.rms_norm_eps, k2)

    def _attention_t1_args(self, i: int) -> tuple | None:
        """The fixed arguments of K.attention_t1 for transformer layer i, or None when the layer
        is not the plain kind it runs: q / k / v / o all int4 row-interleaved or all int8, no biases, no
        q / k clipping, RoPE on every head dimension, no sliding window or sinks, a KV cache of
        this class's kinds, and a family that does not override the attention's steps.
        Memoised per layer."""
        memo = self._att1_memo
        if i in memo:
            return memo[i]
        a, ly = self.args, self.layers[i]
        qkv, o = ly.get("qkv"), ly.get("o_proj")
        cls = type(self)
        ok = (ATTENTION_T1 and hasattr(K, "attention_t1") and isinstance(qkv, LinearGroup)
              and len(qkv.parts) == 3 and isinstance(o, Linear)
              and ((qkv.il and o.il and o.gs == qkv.gs) or (qkv.kind == "int8" and o.kind == "int8"))
              and all(p.bias is None for p in qkv.parts) and o.bias is None
              and a.clip_qkv is None and self.rotary_dim == a.head_dim and not self.windows[i]
              and ly.get("sinks") is None and a.qk_norm in ("none", "proj", "head")
              and all(getattr(cls, f) is getattr(MoEModel, f)
                      for f in ("attention", "qk_norm", "_attend", "_kv_append", "_kv_write")))
        args = None
        if ok:
            qkn = {"none": 0, "proj": 1, "head": 2}[a.qk_norm]
            none = np.zeros(1, np.float32)
            args = (ly["input_layernorm"], a.rms_norm_eps, qkv.w, qkv.s, qkv.gs, qkn,
                    ly["q_norm"] if qkn else none, ly["k_norm"] if qkn else none, o.w, o.s)
        memo[i] = args
        return args

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if T == 1:
            f = self._attention_t1_args(i)
            if f is not None:  # one kernel call, the same values as the steps below
                ln_w, eps, w, s, gs, qkn, qn_w, kn_w, ow, osc = f
                out = np.empty_like(x)
                K.attention_t1(x, ln_w, eps, w, s, gs, qkn, qn_w, kn_w, self.cos[pos0:pos0 + 1],
                               self.sin[pos0:pos0 + 1], self.k_cache[i], self.v_cache[i], pos0, self.scale,
                               ow, osc, np.empty_like(x), np.empty((1, H * S), np.float32),
                               np.empty((1, Hkv * S), np.float32), np.empty((1, Hkv * S), np.float32),
                               np.empty((1, H * S), np.float32), out)
                return out
        h = np.empty_like(x)  # [T, D]
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32),  # [T, H*S]
                                np.empty((T, Hkv * S), np.float32),  # [T, Hkv*S]
                                np.empty((T, Hkv * S), np.float32)))  # [T, Hkv*S]
        self.qk_norm(i, q, k)
        if a.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        q3 = q.reshape(T, H, S)
        k3 = k.reshape(T, Hkv, S)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        if self.rotary_dim == S:
            K.rope(q3, cos, sin)
            K.rope(k3, cos, sin)
        else:  # partial rotary (GLM): the first rotary_dim values of each head turn
            R = self.rotary_dim
            for t3 in (q3, k3):
                part = np.ascontiguousarray(t3[:, :, :R])
                K.rope(part, cos, sin)
                t3[:, :, :R] = part
        self._kv_append(i, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)  # [T, H, S]
        kc, vc = self.k_cache[i], self.v_cache[i]
        w = self.windows[i]
        # Sliding window w: the query at position p sees keys p - w + 1 .. p (transformers'
        # mask kv_idx > q_idx - w). Queries at p < w see every earlier key (one causal call);
        # later ones attend a cache view starting at their window's first key.
        n_full = T if not w else min(T, max(0, w - pos0))
        sinks = ly.get("sinks")  # gpt-oss: a learned sink logit per head joins the softmax
        if n_full:
            self._attend(q3[:n_full], kc, vc, pos0, sinks, att[:n_full])
        for t in range(n_full, T):
            j0 = pos0 + t - w + 1
            self._attend(q3[t:t + 1], kc[:, j0:], vc[:, j0:], w - 1, sinks, att[t:t + 1])
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))  # [T, D]

    def draft_attention(self, j: int, x: np.ndarray, pos: int) -> np.ndarray | None:
        """Attention of MoE layer ``j``'s decoder layer on a draft residual x float32 [1, D] at
        position ``pos``, for a look ahead (PILOT's draft, engine/prefetch.py): float32 [1, D],
        the model left as it was (the KV rows the call writes at ``pos`` are put back). None
        when the family computes attention its own way (MLA, linear attention: more state than
        one row), or pos is outside the context; the caller then predicts without it."""
        if type(self).attention is not MoEModel.attention or x.shape[0] != 1 or not 0 <= pos < self.C:
            return None
        i = self.moe_layer_ids[j]
        k_row, v_row = self.k_cache[i, :, pos].copy(), self.v_cache[i, :, pos].copy()
        try:
            return self.attention(i, x, pos)
        finally:
            self.k_cache[i, :, pos] = k_row
            self.v_cache[i, :, pos] = v_row

    def _attend(self, q, kc, vc, pos0, sinks, out) -> None:
        if sinks is None:
            K.attention(q, kc, vc, pos0, self.scale, out)
        else:
            K.attention_sink(q, kc, vc, pos0, self.scale, sinks, out)

    def _kv_append(self, r: int, pos0: int, k3: np.ndarray, v3: np.ndarray) -> None:
        """Store the K and V rows k3, v3 float32 [T, Hkv, S] of positions pos0..pos0+T-1 in
        row r of the KV cache (k_cache / v_cache [L, Hkv, C, S])."""
        T = k3.shape[0]
        self._kv_write(self.k_cache[r, :, pos0:pos0 + T].transpose(1, 0, 2), k3)  # [T, Hkv, S] views
        self._kv_write(self.v_cache[r, :, pos0:pos0 + T].transpose(1, 0, 2), v3)

    def _kv_write(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write float32 K or V rows src into the cache slice dst (same shape, 2-D or 3-D, any
        strides) as the cache holds them: float32 as is; f16 rounded to nearest even and
        clipped to the finite half range, so a huge value stays finite instead of becoming inf
        (K.kv_put_f16: numpy's rounding bit for bit, without numpy's temporaries)."""
        if self.kv_dtype == "f32":
            dst[...] = src
        elif src.ndim == 2:
            K.kv_put_f16(src[None], dst[None])
        else:
            K.kv_put_f16(src, dst)

    def moe_norm(self, j: int) -> np.ndarray:
        """post_attention_layernorm weight float32 [D] of MoE layer j (PILOT's predictor input)."""
        return self.layers[self.moe_layer_ids[j]]["post_attention_layernorm"]

    def router_logits(self, j: int, h: np.ndarray) -> np.ndarray:
        """Router logits float32 [T, E] of MoE layer j for normed rows h [T, D]."""
        out = np.empty((h.shape[0], self.args.num_experts), np.float32)  # [T, E]
        K.linear_f32(h, self.layers[self.moe_layer_ids[j]]["router"], out)
        return out

    def dense_mlp(self, views: dict, h: np.ndarray, width: int) -> np.ndarray:
        """A resident SwiGLU MLP (dense layer or shared expert) of width ``width`` on h [T, D]."""
        out = np.empty_like(h)
        run_expert(self.dense_quant, views, h, np.empty((h.shape[0], width), np.float32), out, self.gs)
        return out

    def mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        """The feed-forward half of transformer layer i on x [T, D]: routed experts (plus the
        shared expert, if any) on MoE layers, the resident MLP on dense layers."""
        j = self.moe_index[i]
        if j >= 0:
            return self.moe(j, x)
        a = self.args
        h = np.empty_like(x)
        K.rmsnorm(x, self.layers[i]["post_attention_layernorm"], a.rms_norm_eps, h)
        return self.dense_mlp(self.layers[i]["mlp"], h, a.intermediate_size)

    def moe(self, j: int, x: np.ndarray) -> np.ndarray:
        """Routed experts of MoE layer j for the rows of x [T, D]; returns [T, D].

        Rows are grouped by expert so each routed expert is acquired once per call (never once
        per (token, rank): the prefill "reload storm"); outputs are combined in rank order.
        A shared expert (Qwen2-MoE) is resident and added as sigmoid(gate(h)) * shared(h).
        """
        a = self.args
        ly = self.layers[self.moe_layer_ids[j]]
        T, D = x.shape
        h = np.empty_like(x)
        K.rmsnorm(x, ly["post_attention_layernorm"], a.rms_norm_eps, h)
        logits = self.router_logits(j, h)  # [T, E]
        idx, w = self.route(j, logits)  # [T, K]
        self.observers.publish("on_route", j, idx, logits)
        fields = self._t1_plan() if T == 1 else None
        if fields is not None:
            moe = self._moe_t1(j, h, idx, w, fields, x)
        else:
            moe = self._moe_grouped(j, h, idx, w)
        if "shared_expert" in ly:
            s = self.dense_mlp(ly["shared_expert"], h, a.shared_expert_intermediate_size)
            if ly["shared_expert_gate"] is not None:
                g = np.empty((T, 1), np.float32)
                K.linear_f32(h, ly["shared_expert_gate"], g)
                s *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            moe += s
        return moe

    def _t1_plan(self) -> np.ndarray | None:
        """The byte offsets int64 [6] inside an expert's slab of its six weight arrays
        (_T1_FIELDS) when a decode step's resident experts can run in one K.experts_q4_t1 /
        _q8_t1 call reading the cache arena in place: int4 or int8 experts whose slab layout
        has the dtypes those kernels read, the SwiGLU expert, a provider with the arena and
        ``take_split`` (ExpertCache), and for interleaved slabs a CPU that runs the interleaved
        kernels (K.q4_interleaved_ok); else None (the grouped path). Memoised."""
        memo = self._t1_memo
        if memo is None:
            ex = self.experts
            fields = None
            layout = getattr(getattr(ex, "store", None), "layout", None)
            want = _ARENA_DTYPES.get(self.expert_quant)
            if (want is not None and layout is not None and hasattr(ex, "take_split")
                    and isinstance(getattr(ex, "arena", None), np.ndarray)
                    and type(self).expert_forward is MoEModel.expert_forward
                    and (not self._slabs_interleaved() or K.q4_interleaved_ok(self.gs))):
                at = {name: (int(off), np.dtype(dt)) for name, off, dt, shape in layout["fields"]}
                if all(f in at and at[f][1] == want[k % 2] for k, f in enumerate(_T1_FIELDS)):
                    fields = np.array([at[f][0] for f in _T1_FIELDS], np.int64)
            memo = self._t1_memo = (fields,)
        return memo[0]

    def _moe_t1(self, j: int, h: np.ndarray, idx: np.ndarray, w: np.ndarray, fields: np.ndarray,
                x: np.ndarray | None = None) -> np.ndarray:
        """The routed experts of a decode step (h [1, D] normed, idx/w [1, K] by rank): the
        experts resident at lookup time in one kernel call reading their slabs in the cache
        arena (K.experts_q4_t1 / _q8_t1; fields: _t1_plan's offsets inside a slab), then each
        miss as its read completes, by :func:`run_expert`. Every expert's row is bit-identical
        to :meth:`_moe_grouped`'s and the rows are combined in the same rank order, so the
        values do not depend on which experts were hits.

        With misses, before waiting for the first: ``on_moe_wait(j, x + the hits' weighted
        outputs, wait_s)`` to subscribers (x float32 [1, D], the residual the MoE block adds to;
        wait_s the cache's estimate of the seconds until the misses are in), the draft residual
        PILOT predicts the next layer from while the disk reads. It is a separate array; the
        layer's output is computed as without it."""
        D = h.shape[1]
        Kk = idx.shape[1]
        ranked = idx[0]
        order = np.argsort(ranked, kind="stable")  # rank positions of the experts, ascending ids
        cache = self.experts
        hits, slots, misses = cache.take_split(j, ranked[order])
        y = np.empty((1, Kk, D), np.float32)  # [1, K, D] by rank
        try:
            if hits:
                # rank position of each hit: the ascending ids that hit, in order
                pos = order if not misses else order[np.isin(ranked[order], hits)]
                offs = cache.slot_offsets(j, slots)[:, None] + fields[None, :]  # [n, 6]
                I = self.args.moe_intermediate_size
                scratch = np.empty((len(hits), I), np.float32)
                out = np.empty((len(hits), D), np.float32)
                if self.expert_quant == "int4":
                    K.experts_q4_t1(h, cache.arena, offs, I, self.gs, scratch, out, self._slabs_interleaved())
                else:
                    K.experts_q8_t1(h, cache.arena, offs, I, scratch, out)
                y[0, pos] = out
        finally:
            cache.release_slots(j, slots)
        if misses:
            rank_of = {int(e): k for k, e in enumerate(ranked.tolist())}
            if x is not None and self.observers.has("on_moe_wait"):
                for e in misses:  # the draft: the missing experts' rows count as zero
                    y[0, rank_of[e]] = 0.0
                draft = np.empty((1, D), np.float32)
                K.combine_ranked(y, w, draft)
                draft += x
                est = getattr(cache, "wait_estimate", None)
                self.observers.publish("on_moe_wait", j, draft, est(j, misses) if est is not None else 0.0)
            scratch = np.empty((1, self.args.moe_intermediate_size), np.float32)
            for e in misses:
                views = cache.acquire(j, e)
                try:
                    k = rank_of[e]
                    self.expert_forward(views, h, scratch, y[0, k:k + 1])
                finally:
                    cache.release(j, e)
        moe = np.empty((1, D), np.float32)
        K.combine_ranked(y, w, moe)
        return moe

    def _moe_grouped(self, j: int, h: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The routed experts for rows h [T, D] (normed), idx/w [T, K] by rank: rows grouped
        by expert, each expert acquired once and run on all its rows, combined by rank."""
        a = self.args
        T, D = h.shape
        Kk = idx.shape[1]
        # Group the T*K (token, rank) entries by expert with one stable sort: entry n = t*K + k,
        # so each expert's entries come out in ascending token order, contiguous; its tokens'
        # rows are gathered once into xs and its outputs land in one slice of outs.
        flat = idx.reshape(-1)
        by_e = np.argsort(flat, kind="stable")  # [T*K]
        sorted_e = flat[by_e]
        uniq, first = np.unique(sorted_e, return_index=True)  # ascending expert ids
        bounds = dict(zip(uniq.tolist(), zip(first.tolist(), first[1:].tolist() + [len(flat)])))
        if T > 1 and self._sorted_ok():
            return self._moe_sorted(j, h, w, by_e, uniq, bounds)
        order = self.experts.prepare(j, uniq)
        xs = h if T == 1 else h[by_e // Kk]  # [T*K, D] (T = 1: each expert sees the one row)
        outs = np.empty((T * Kk, D), np.float32)  # [T*K, D] in expert-sorted order
        scratch = np.empty((T, a.moe_intermediate_size), np.float32)  # [T, I]
        # A provider that computes experts elsewhere (engine/cluster.py) sends their rows now,
        # computes nothing of them here (its prepare returned only the local ones) and fills
        # their rows of outs in collect, while the local experts run below: the same rows,
        # the same kernel, so the sum below is the same.
        dispatch = getattr(self.experts, "dispatch", None)
        call = dispatch(j, xs, bounds, T == 1) if dispatch is not None else None
        for e in (uniq.tolist() if order is None else order):  # order never changes values
            lo, hi = bounds[int(e)]
            n = hi - lo
            views = self.experts.acquire(j, int(e))
            try:
                self.expert_forward(views, xs if T == 1 else xs[lo:hi], scratch[:n], outs[lo:hi])
            finally:
                self.experts.release(j, int(e))
        if call is not None:
            call.collect(outs, xs, scratch)
        y = np.empty((T * Kk, D), np.float32)
        y[by_e] = outs
        y = y.reshape(T, Kk, D)  # [T, K, D] by rank
        moe = np.empty((T, D), np.float32)
        K.combine_ranked(y, np.ascontiguousarray(w, dtype=np.float32), moe)
        return moe

    def _sorted_ok(self) -> bool:
        """Whether a prefill chunk's resident experts can run in one K.experts_q4_sorted call:
        int4 experts with half-precision scales (store format 3), the SwiGLU expert, a
        provider that keeps the slabs in one arena (ExpertCache) and computes nothing
        elsewhere (no cluster dispatch), and for interleaved slabs a CPU that runs the
        interleaved kernels (K.q4_interleaved_ok)."""
        ok = self._sorted_memo
        if ok is None:
            ex = self.experts
            ok = (self.expert_quant == "int4" and type(self).expert_forward is MoEModel.expert_forward
                  and isinstance(getattr(ex, "arena", None), np.ndarray)
                  and hasattr(ex, "prepare_split") and hasattr(ex, "acquire_many")
                  and getattr(ex, "dispatch", None) is None and self.args.hidden_size % 2 == 0
                  and (not self._slabs_interleaved() or K.q4_interleaved_ok(self.gs))
                  and self.args.moe_intermediate_size % self.gs == 0 and self.args.hidden_size % self.gs == 0)
            self._sorted_memo = ok
        return ok

    def _slabs_interleaved(self) -> bool:
        """Whether the store's int4 expert slabs hold interleaved weights (store format 4: the
        layout's w fields are 3-D, engine.quant.interleave_q4); the arena kernels then read them
        with il=True. Memoised."""
        il = self._il_memo
        if il is None:
            layout = getattr(getattr(self.experts, "store", None), "layout", None)
            il = self._il_memo = bool(layout) and any(len(f[3]) == 3 for f in layout["fields"])
        return il

    def _arena_offsets(self, j: int, e: int, views: dict) -> np.ndarray | None:
        """Byte offsets int64 [6] in the cache arena of expert e's six weight arrays
        (_T1_FIELDS), for the kernels that read slabs in place (experts_q4_t1 / _q8_t1 /
        experts_q4_sorted), or None when a view does not have the dtype they read (int4: uint8
        nibbles and uint16 half scales; int8: int8 and float32), is not contiguous, or its
        weights' layout (3-D: interleaved) is not the store's; memoised per (layer, expert)
        while the cache hands out the same views dict (a reload makes a new one)."""
        memo = self._offs_memo.get((j, e))
        if memo is not None and memo[0] is views:
            return memo[1]
        want = _ARENA_DTYPES.get(self.expert_quant)
        base = self.experts.arena.ctypes.data
        offs = np.empty(6, np.int64)
        for f, name in enumerate(_T1_FIELDS):
            v = views[name]
            if (want is None or v.dtype != want[f % 2] or not v.flags.c_contiguous
                    or (f % 2 == 0 and (v.ndim == 3) != self._slabs_interleaved())):
                return None
            offs[f] = v.ctypes.data - base
        self._offs_memo[(j, e)] = (views, offs)
        return offs

    def _moe_sorted(self, j: int, h: np.ndarray, w: np.ndarray, by_e: np.ndarray, uniq: np.ndarray,
                    bounds: dict) -> np.ndarray:
        """_moe_grouped's experts for a prefill chunk (h [T, D] normed, w [T, K]; by_e, uniq,
        bounds: the entries grouped by expert): the experts resident at prepare time in one
        K.experts_q4_sorted call reading their slabs in the arena, then each miss as its read
        completes (run_expert on its gathered rows); the outputs combined in rank order by
        K.combine_sorted. Every row is bit-identical to one expert_q4 call per expert, so the
        values do not depend on which experts were resident."""
        a = self.args
        T, D = h.shape
        Kk = w.shape[1]
        M = by_e.shape[0]
        tok = by_e // Kk  # [M] the row of h of each expert-ordered entry
        outs = np.empty((M, D), np.float32)  # [M, D] in expert-sorted order
        hits, misses = self.experts.prepare_split(j, uniq.tolist())
        if hits:
            views = self.experts.acquire_many(j, hits)
            try:
                offs = [self._arena_offsets(j, e, v) for e, v in zip(hits, views)]
                if any(o is None for o in offs):  # not in the arena: one expert at a time
                    run, misses = [], sorted(hits + misses)
                else:
                    run = hits
                if run:
                    spans = [bounds[e] for e in run]
                    starts = np.zeros(len(run) + 1, np.int64)
                    starts[1:] = np.cumsum([hi - lo for lo, hi in spans])
                    every = len(run) == len(uniq)  # all resident: straight into outs
                    # else the hits' entries, contiguous per expert, into a buffer of their
                    # own, then copied into their rows of outs
                    sel = None if every else np.concatenate([np.arange(lo, hi) for lo, hi in spans])
                    n = M if every else len(sel)
                    part = outs if every else np.empty((n, D), np.float32)
                    K.experts_q4_sorted(h, tok if every else tok[sel], starts, self.experts.arena, np.stack(offs),
                                        a.moe_intermediate_size, self.gs, K.current_threads(),
                                        np.empty((n, a.moe_intermediate_size), np.float32), part,
                                        self._slabs_interleaved())
                    if not every:
                        outs[sel] = part
            finally:
                self.experts.release_many(j, hits)
        if misses:
            scratch = np.empty((T, a.moe_intermediate_size), np.float32)  # [T, I]
            for e in misses:
                lo, hi = bounds[int(e)]
                views = self.experts.acquire(j, int(e))
                try:
                    self.expert_forward(views, h[tok[lo:hi]], scratch[:hi - lo], outs[lo:hi])
                finally:
                    self.experts.release(j, int(e))
        pos = np.empty(M, np.int64)
        pos[by_e] = np.arange(M)
        moe = np.empty((T, D), np.float32)
        K.combine_sorted(outs, pos.reshape(T, Kk), np.ascontiguousarray(w, dtype=np.float32), moe)
        return moe

    def expert_forward(self, views: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
        """One routed expert on rows x [T, D] into out [T, D] (h [T, I] scratch): SwiGLU
        (:func:`run_expert`); a family with another expert MLP (gpt-oss) overrides it, reading
        only ``args``, ``expert_quant`` and ``gs`` (engine/cluster.py runs it on workers that
        hold no dense weights: ``cluster.expert_function``)."""
        run_expert(self.expert_quant, views, x, h, out, self.gs)

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Experts and weights of MoE layer j for router logits float32 [T, E]: (idx int64
        [T, K] in rank order, w float32 [T, K]). Softmax top-K (:func:`route`) unless the
        args name another router (engine/models/routing.py: sigmoid, groups, bias)."""
        a = self.args
        if a.scoring_func == "softmax" and a.topk_method == "greedy" and a.routed_scaling_factor == 1.0:
            return route(logits, a.num_experts_per_tok, a.norm_topk_prob)
        return route_tokens(logits, a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob,
                            scoring_func=a.scoring_func, topk_method=a.topk_method, n_group=a.n_group,
                            topk_group=a.topk_group, routed_scaling_factor=a.routed_scaling_factor,
                            bias=self.layers[self.moe_layer_ids[j]]["router_bias"])

    # --- a decode step in one call ------------------------------------------------------------

    _OVERRIDABLE = ("forward", "attention", "mlp", "moe", "route", "router_logits", "moe_norm", "_moe_t1",
                    "expert_forward", "qk_norm", "_attend", "_kv_append", "_kv_write", "embed")

    def _decode_plan(self) -> tuple | None:
        """The fixed arguments of K.decode_layers_t1, or None when this model's decode steps
        cannot run in it: every layer a MoE layer whose attention runs in K.attention_t1
        (:meth:`_attention_t1_args`) with the same group size, q / k norm kind and array types,
        plain softmax top-k routing (no scaling, no bias, no shared expert), int4 or int8
        experts read in place from the cache arena (:meth:`_t1_plan`), and a family that
        overrides none of the steps. Memoised."""
        memo = self._dec_memo
        if memo is not None:
            return memo[0]
        plan = None
        a, cls = self.args, type(self)
        L = a.num_hidden_layers
        if (DECODE_T1 and hasattr(K, "decode_layers_t1") and L > 0
                and tuple(self.moe_index) == tuple(range(L)) and a.scoring_func == "softmax"
                and a.topk_method == "greedy" and a.routed_scaling_factor == 1.0
                and not a.shared_expert_intermediate_size and self.expert_quant in ("int4", "int8")
                and all(getattr(cls, f) is getattr(MoEModel, f) for f in self._OVERRIDABLE)
                and hasattr(self.experts, "take_resident_layers") and self._t1_plan() is not None):
            att = [self._attention_t1_args(i) for i in range(L)]
            lys = self.layers
            if (all(f is not None for f in att) and len({(f[4], f[5]) for f in att}) == 1
                    and all(ly.get("router_bias") is None and "shared_expert" not in ly
                            and isinstance(ly["router"], np.ndarray) and ly["router"].dtype == np.float32
                            for ly in lys)):
                from numba import typed, typeof  # the kernel is numba's (hasattr above)

                cols = {"ln": [f[0] for f in att], "w": [tuple(f[2]) for f in att], "s": [tuple(f[3]) for f in att],
                        "qn": [f[6] for f in att], "kn": [f[7] for f in att], "ow": [f[8] for f in att],
                        "os": [f[9] for f in att], "post": [ly["post_attention_layernorm"] for ly in lys],
                        "router": [ly["router"] for ly in lys]}
                if all(len({typeof(v) for v in col}) == 1 for col in cols.values()):
                    lists = {k: typed.List(col) for k, col in cols.items()}
                    plan = (lists, att[0][4], att[0][5], self._t1_plan(), self.expert_quant == "int4",
                            self._slabs_interleaved())
        self._dec_memo = (plan,)
        return plan

    def _decode_call(self, plan: tuple, x: np.ndarray, pos: int, kc: np.ndarray, vc: np.ndarray, outs: tuple,
                     l0: int = 0, forced: np.ndarray | None = None, look: tuple | None = None):
        """The function that runs K.decode_layers_t1 from layer ``l0`` on ``x`` at ``pos`` with KV
        caches kc, vc and output arrays ``outs`` (idx, w, logits, ss, pm, nspec, look_logits,
        upto: :meth:`_decode_outs`) once given the cache's arrays
        (ExpertCache.take_resident_layers' ``run``, which gets the clock, the taken experts and
        ``upto``); ``forced`` float32 [L, E]: the router logits to use instead of the routers' (a
        replayed routing); ``look`` (want bool [L], forced predictor logits float32 [L, E] or
        None): PILOT's predictions inside the run (Pilot.run_plan; the kernel's ``look``)."""
        lists, gs, qkn, fields, q4, il = plan
        a, cache = self.args, self.experts
        idx, w, logits, ss, pm, nspec, look_logits, upto = outs
        want, look_forced = look if look is not None else (self._no_look, None)

        def run(where, state, busy, last_use, routed_now, pinned, spec, resident, clock):
            c = K.decode_layers_t1(
                x, pos, self.cos[pos:pos + 1], self.sin[pos:pos + 1], kc, vc, self.scale,
                a.rms_norm_eps, lists["ln"], lists["w"], lists["s"], gs, qkn, lists["qn"], lists["kn"], lists["ow"],
                lists["os"], lists["post"], lists["router"], a.num_experts_per_tok, bool(a.norm_topk_prob), where,
                state, busy, last_use, routed_now, pinned, spec, resident, clock, cache.arena, cache.max_cap,
                cache.slot_bytes, fields, a.moe_intermediate_size, self.gs, q4, il, idx, w, logits, ss, pm, nspec,
                l0, forced if forced is not None else logits, forced is not None,
                look is not None, want, look_forced if look_forced is not None else logits, look_forced is not None,
                look_logits, upto)
            return c, np.sort(idx, axis=1), ss, pm, nspec, int(upto[0])
        return run

    def _decode_outs(self) -> tuple:
        a = self.args
        L, k, E = a.num_hidden_layers, a.num_experts_per_tok, a.num_experts
        return (np.empty((L, k), np.int64), np.empty((L, k), np.float32), np.empty((L, E), np.float32),
                np.empty((L, k), np.int64), np.empty((L, k), np.bool_), np.zeros(L, np.int64),
                np.zeros((L, E), np.float32), np.zeros(1, np.int64))

    def warm_decode_step(self) -> bool:
        """Compile (or load from numba's cache) K.decode_layers_t1 for this model's argument
        types now, so the first all-resident decode step does not compile it while it holds the
        cache's lock (a fresh install: ~1 min). Runs it once on scratch state: every expert of
        every layer mapped to slot 0 of a copy of the cache's bookkeeping arrays, a one-position
        copy of the KV cache, a zero input; the cache, the KV cache and the model are untouched
        (the arena is only read). Returns whether the model has the one-call decode step."""
        plan = self._decode_plan()
        cache = self.experts
        if plan is None:
            return False
        a = self.args
        L, Hkv, S = self.k_cache.shape[0], self.k_cache.shape[1], self.k_cache.shape[3]
        kc = np.zeros((L, Hkv, 1, S), self.k_cache.dtype)
        vc = np.zeros((L, Hkv, 1, S), self.v_cache.dtype)
        x = np.zeros((1, a.hidden_size), np.float32)
        run = self._decode_call(plan, x, 0, kc, vc, self._decode_outs())
        resident = cache.RESIDENT_STATE
        run(np.zeros_like(cache.where), np.full_like(cache.slot_state, resident), np.zeros_like(cache.slot_busy),
            np.zeros_like(cache.last_use), np.zeros_like(cache.routed_now), np.zeros_like(cache.pinned),
            np.zeros_like(cache.slot_spec), resident, 0)
        return True

    def start_decode_warm(self) -> None:
        """Compile K.decode_layers_t1 for this model in a background thread (:meth:`warm_decode_step`;
        numba's cache makes it ~a token's compute after the first time); decode steps use the one
        call only once it is done (the values are the same either way). On a fresh install the
        compile takes ~1 min of one core: done before "ready" it kept the app from opening for
        as long, done at the first all-resident step it ran inside the cache's lock."""
        if self._decode_plan() is None:
            return

        def warm():
            try:
                self.warm_decode_step()
                self._decode_ready.set()
                release_compiler_memory()  # LLVM's pages: loading this kernel was their last use
            except Exception as e:  # noqa: BLE001 - the per-layer path stays: the same values, slower
                log.warning("the one-call decode step could not be prepared (%s: %s); decoding layer by layer",
                            type(e).__name__, e)
        threading.Thread(target=warm, name="colibri-warm-decode", daemon=True).start()

    def wait_decode_ready(self, timeout: float | None = None) -> bool:
        """Block until the one-call decode step is compiled (True) or ``timeout`` seconds pass;
        False at once for a model without it (:meth:`_decode_plan`)."""
        if self._decode_plan() is None:
            return False
        return self._decode_ready.wait(timeout)

    def _decode_step_all(self, x: np.ndarray, pos: int, cancel: threading.Event | None = None) -> bool:
        """Every layer of a decode step (x float32 [1, D], updated in place), its runs of
        layers whose experts are resident each in one K.decode_layers_t1 call, when
        :meth:`_decode_plan` allows it, no method of this object was replaced (but
        ``forward`` by a wrapper, which reaches this step only through the class's forward, and
        ``router_logits`` by a replayed routing that also offers ``routing_replay.step_logits(pos)``:
        engine.trace.RecordedRouting, whose logits the kernel then takes) and every per-layer
        observer is token-batched (Observer.token_batched). From layer l0 (0 first): token-batched
        observers get ``on_layer_start`` of layers l0.. (the RSS guard polls there, before any
        take) and ``on_run_start(l0)`` (PILOT reserves the reads it wants during the run), the
        kernel runs layers until one has an expert that is not resident
        (ExpertCache.take_resident_layers, the cache's lock held), then ``on_route`` of the
        layers it ran, before the cache's bookkeeping of their takes (a layer's LFRU placement
        reads that layer's routing heat, as in the per-layer path). The layer that stopped it
        (its attention already run) gets ``on_after_attention``, takes its experts the
        per-layer way (:meth:`mlp`: misses read, waited for) and gets ``on_after_moe``; the
        next run starts after it. With PILOT (``run_lookahead``: Pilot.run_plan) the kernel
        also predicts each next layer and may stop after a layer whose next one's prediction
        holds an expert not in the cache (``upto``): PILOT queues it (Pilot.on_run_prediction)
        and the next run starts at that layer. With every expert resident that is
        one call per step; streaming, one call per run of resident layers instead of ~10
        kernel launches per layer from Python. The values are bit-identical to the per-layer
        path, and the cache's state ends as it leaves it (tests/test_families.py). Returns False,
        having computed nothing, when it does not apply (the per-layer path then publishes
        on_layer_start again: a second poll finds nothing new). Raises Cancelled when
        ``cancel`` is set before a layer that waits for its experts (as the per-layer path
        polls between layers)."""
        plan = self._decode_plan()
        cache = self.experts
        replay = self.routing_replay
        # (an instance's own ``forward``, a wrapper such as bench.arm's logits hash, runs this
        # step only through the class's forward: it does not change what the step computes)
        replaced = [f for f in self._OVERRIDABLE if f in self.__dict__ and f != "forward"]
        if (plan is None or not self._decode_ready.is_set() or not self.observers.token_batched()
                or (replaced and not (replay is not None and replaced == ["router_logits"]))):
            return False
        obs = self.observers
        L = self.args.num_hidden_layers
        forced = replay.step_logits(pos) if replay is not None else None
        l0 = 0
        while l0 < L:
            for j in range(l0, L):
                obs.publish("on_layer_start", j)
            obs.publish("on_run_start", l0)
            outs = self._decode_outs()
            idx, logits = outs[0], outs[2]
            lookahead = self.run_lookahead
            look = lookahead.run_plan(l0) if lookahead is not None else None

            def after_step(stop, l0=l0, idx=idx, logits=logits):  # the hooks before each layer's take
                if stop > l0:
                    obs.publish_route_layers(l0, idx[l0:stop], logits[l0:stop])
            stop = cache.take_resident_layers(
                self._decode_call(plan, x, pos, self.k_cache, self.v_cache, outs, l0, forced, look), l0, after_step)
            if stop < 0:  # nothing ran (the cache was closed)
                if l0 == 0:
                    return False
                self._run_layers(x, pos, l0, cancel)  # the rest layer by layer: a closed cache's errors there
                return True
            if l0 == 0:
                self.one_call_steps += 1
            if stop < L and outs[7][0] == stop:  # stopped for PILOT: layers up to stop - 1 ran in full
                lookahead.on_run_prediction(stop, outs[6][stop])
                l0 = stop
                continue
            if stop < L:  # its attention ran in the kernel: its experts the per-layer way
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled")
                obs.publish("on_after_attention", stop, x)
                x += self.mlp(stop, x)
                obs.publish("on_after_moe", stop, x)
            l0 = stop + 1
        return True

    # --- forward ----------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool = False,
                cancel: threading.Event | None = None) -> np.ndarray:
        """Run tokens ``ids`` (int [T]) at positions pos0..pos0+T-1, writing the KV cache.

        Returns float32 logits [T, V] if all_logits else [1, V] (last position).
        Raises:
            Cancelled: ``cancel`` was set (polled between chunks and layers).
            ValueError: the positions are negative or exceed the context capacity.
        """
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if pos0 < 0:  # numpy's slices would wrap (the KV row of a negative position is the cache's end)
            raise ValueError(f"position {pos0} is negative: positions start at 0")
        if pos0 + T > self.C:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.C} tokens")
        obs = self.observers
        obs.publish("on_forward_start", pos0, T)
        sink = self.hidden_sink
        if T > PREFILL_CHUNK and PREFILL_BY_LAYER and self._streams():
            x = self._prefill_by_layer(ids, pos0, cancel)
            if sink is not None:
                sink(pos0, ids, x, 1 if all_logits else T)
            return self.logits(x if all_logits else x[-1:])
        outs = []
        for c0 in range(0, T, PREFILL_CHUNK):
            chunk = ids[c0:c0 + PREFILL_CHUNK]
            x = self.embed(chunk)  # [t, D]
            if not (T == 1 and self._decode_step_all(x, pos0, cancel)):  # else every layer ran
                self._run_layers(x, pos0 + c0, 0, cancel)
            if sink is not None:
                sink(pos0 + c0, chunk, x, 1 if all_logits else len(chunk))
            if all_logits:
                outs.append(self.logits(x))
            elif c0 + PREFILL_CHUNK >= T:
                outs.append(self.logits(x[-1:]))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _streams(self) -> bool:
        """Whether the expert provider holds fewer slots than the model has experts
        (ExpertCache.slots): a prompt's chunks may then read again an expert an earlier chunk
        read. False for a family with its own layer loop (the layer-by-layer prefill is the
        shared loop's)."""
        slots = getattr(self.experts, "slots", None)
        return (isinstance(slots, int) and slots < self.num_moe_layers * self.args.num_experts
                and getattr(type(self), "_run_layers") is getattr(MoEModel, "_run_layers"))  # Gemma 4's own loop is kept

    def _prefill_by_layer(self, ids: np.ndarray, pos0: int, cancel: threading.Event | None) -> np.ndarray:
        """Every layer over the whole prompt ``ids`` (int [T]) at pos0.., layer after layer: its
        attention chunk by chunk (PREFILL_CHUNK: the KV rows of a layer's earlier chunks are
        written first), its feed-forward over waves of PREFILL_WAVE tokens (each expert the
        wave routes to acquired once for all its rows). Every row is computed as in the chunk
        by chunk order (the kernels compute rows independently). Returns the final residual
        float32 [T, D]. Observers get each layer's hooks once, with all T rows."""
        obs = self.observers
        T = len(ids)
        x = self.embed(ids)  # [T, D]
        for i in range(self.args.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            j = self.moe_index[i]
            if j >= 0:
                obs.publish("on_layer_start", j)
            for c0 in range(0, T, PREFILL_CHUNK):
                xc = x[c0:c0 + PREFILL_CHUNK]  # a view: updated in place
                xc += self.attention(i, xc, pos0 + c0)
            if j >= 0:
                obs.publish("on_after_attention", j, x)
            for w0 in range(0, T, PREFILL_WAVE):
                xw = x[w0:w0 + PREFILL_WAVE]
                xw += self.mlp(i, xw)
            if j >= 0:
                obs.publish("on_after_moe", j, x)
        return x

    def _run_layers(self, x: np.ndarray, pos0: int, first: int, cancel: threading.Event | None) -> None:
        """Decoder layers first.. on x float32 [T, D] (rows at positions pos0..), in place, one
        by one with the observers' per-layer hooks; Cancelled when ``cancel`` is set before a
        layer."""
        obs = self.observers
        for i in range(first, self.args.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            j = self.moe_index[i]
            if j >= 0:
                obs.publish("on_layer_start", j)
            x += self.attention(i, x, pos0)
            if j >= 0:
                obs.publish("on_after_attention", j, x)
            x += self.mlp(i, x)
            if j >= 0:
                obs.publish("on_after_moe", j, x)

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = np.empty_like(x)
        K.rmsnorm(x, self.norm, self.args.rms_norm_eps, h)
        return self.lm_head(h, np.empty((x.shape[0], self.args.vocab_size), np.float32))  # [T, V]

