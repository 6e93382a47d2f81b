"""Model arguments read from a Hugging Face config.json, and the engine's runtime settings.

ModelArgs follows mlx-lm's ``ModelArgs.from_dict`` and transformers' ``OlmoeConfig``:
the Hugging Face key names are kept (num_experts, num_experts_per_tok, norm_topk_prob, ...).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .settings import CHECKSUM_MODES, POLICIES, EngineConfig  # noqa: F401  (declared in the settings table)

SUPPORTED_MODEL_TYPES = ("olmoe",)

# key: (type, min, max). Every one of these must be present in config.json.
_REQUIRED_INT = {
    "hidden_size": (1, 1 << 20),
    "num_hidden_layers": (1, 4096),
    "num_attention_heads": (1, 1 << 16),
    "num_experts": (1, 1 << 20),
    "num_experts_per_tok": (1, 1 << 20),
    "intermediate_size": (1, 1 << 24),
    "vocab_size": (1, 1 << 24),
}


def _num(cfg: dict, key: str, path: str, lo: float, hi: float, *, integer: bool, default=None):
    if key not in cfg or cfg[key] is None:
        if default is not None:
            return default
        raise ConfigError(f"{path}: required key '{key}' is missing; this is not a complete "
                          f"OLMoE config.json (re-download the model's config.json)")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}: key '{key}' must be a number, got {type(v).__name__} {v!r}")
    if integer and (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{path}: key '{key}' must be an integer, got {v!r}")
    if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
        raise ConfigError(f"{path}: key '{key}' = {v!r} is out of range [{lo}, {hi}]")
    return int(v) if integer else float(v)


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of an OLMoE-family checkpoint (Hugging Face names).

    Derived: head_dim = hidden_size // num_attention_heads unless config.json gives it.
    Grouped-query attention: num_key_value_heads may be smaller than num_attention_heads
    (it must divide it); each KV head serves num_attention_heads // num_key_value_heads heads.
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
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    norm_topk_prob: bool
    tie_word_embeddings: bool
    clip_qkv: float | None = None

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Validate a parsed config.json.

        Raises:
            ConfigError: naming ``path`` and the key, when a required key is missing, not
                numeric, out of range, or the model_type is not supported.
        """
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{path}: model_type {mt!r} is not supported; supported "
                              f"architectures: {', '.join(SUPPORTED_MODEL_TYPES)} (OLMoE)")
        v = {k: _num(cfg, k, path, lo, hi, integer=True) for k, (lo, hi) in _REQUIRED_INT.items()}
        heads = v["num_attention_heads"]
        kv = _num(cfg, "num_key_value_heads", path, 1, heads, integer=True, default=heads)
        if heads % kv:
            raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv})")
        if v["num_experts_per_tok"] > v["num_experts"]:
            raise ConfigError(f"{path}: num_experts_per_tok ({v['num_experts_per_tok']}) exceeds "
                              f"num_experts ({v['num_experts']})")
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if v["hidden_size"] % heads:
                raise ConfigError(f"{path}: hidden_size ({v['hidden_size']}) is not divisible by "
                                  f"num_attention_heads ({heads}) and no head_dim is given")
            head_dim = v["hidden_size"] // heads
        else:
            head_dim = _num(cfg, "head_dim", path, 2, 1 << 16, integer=True)
        if head_dim % 2:
            raise ConfigError(f"{path}: head_dim ({head_dim}) must be even for rotary embeddings")
        if head_dim * heads != v["hidden_size"]:
            # OLMoE's q_norm is hidden-sized, which requires heads * head_dim == hidden_size.
            raise ConfigError(f"{path}: num_attention_heads x head_dim = {heads * head_dim} must equal "
                              f"hidden_size ({v['hidden_size']}) for OLMoE")
        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{path}: key 'rope_parameters' must be an object")
        rtype = rope.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
        if rtype not in (None, "default"):
            raise ConfigError(f"{path}: rope_type {rtype!r} is not supported (only 'default')")
        if "rope_theta" in rope:
            theta = _num(rope, "rope_theta", path + " rope_parameters", 1.0, 1e12, integer=False)
        else:
            theta = _num(cfg, "rope_theta", path, 1.0, 1e12, integer=False, default=10000.0)
        eps = _num(cfg, "rms_norm_eps", path, 1e-12, 1.0, integer=False, default=1e-5)
        ctx = _num(cfg, "max_position_embeddings", path, 1, 1 << 24, integer=True, default=4096)
        for key in ("norm_topk_prob", "tie_word_embeddings"):
            if key in cfg and not isinstance(cfg[key], bool):
                raise ConfigError(f"{path}: key '{key}' must be true or false, got {cfg[key]!r}")
        if cfg.get("attention_bias"):
            raise ConfigError(f"{path}: attention_bias=true is not supported for OLMoE")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
        clip = cfg.get("clip_qkv")
        if clip is not None:
            clip = _num(cfg, "clip_qkv", path, 0.0, 1e9, integer=False)
        return cls(
            model_type=mt, hidden_size=v["hidden_size"], num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            num_experts=v["num_experts"], num_experts_per_tok=v["num_experts_per_tok"],
            intermediate_size=v["intermediate_size"], vocab_size=v["vocab_size"],
            max_position_embeddings=ctx, rms_norm_eps=eps, rope_theta=theta,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), clip_qkv=clip,
        )

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike) -> "ModelArgs":
        """Read and validate ``path`` (a config.json file or a folder holding one).

        Raises:
            ConfigError: the file is missing, not JSON, or a key is invalid (file and key named).
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{p}: not found; a model folder needs its config.json") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read ({e})") from None
        if len(text) > 64 << 20:
            raise ConfigError(f"{p}: implausibly large for a config.json ({len(text)} bytes)")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, str(p))

    def dense_param_count(self) -> int:
        D, V = self.hidden_size, self.vocab_size
        attn = D * self.q_dim + 2 * D * self.kv_dim + self.q_dim * D + self.q_dim + self.kv_dim
        per_layer = attn + 2 * D + self.num_experts * D
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + D
