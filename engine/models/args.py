"""A family's architecture from its config.json: the validation helpers every family's
``ModelArgs.from_dict`` uses (each error names the file and the key), the shared ``ModelArgs``
fields the decoder reads, and the keys every family has (:func:`common_args`).

Re-exported by engine/models/base.py, where the family files find them as ``base.num``,
``base.ModelArgs`` and so on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

# The family registry (engine/models/__init__.py, which imports every family and so this module)
# registers its lookup here: ModelArgs.from_dict dispatches to a family without importing it.
_FAMILY_FOR: list = []


def register_family_lookup(family_for) -> None:
    """Make ``family_for(model_type, path) -> family module`` the lookup of ModelArgs.from_dict."""
    _FAMILY_FOR[:] = [family_for]

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
