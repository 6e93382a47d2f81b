"""Model arguments read from a Hugging Face config.json, and the engine's runtime settings.

ModelArgs follows mlx-lm's ``ModelArgs.from_dict`` and transformers' ``OlmoeConfig``:
the Hugging Face key names are kept (num_experts, num_experts_per_tok, norm_topk_prob, ...).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .errors import ConfigError

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
        scaling = cfg.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"{path}: key 'rope_scaling' must be an object or null")
        rtype = rope.get("rope_type", scaling.get("rope_type", "default"))
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
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e}); the file is corrupt - re-download it") from None
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


# --- runtime settings -------------------------------------------------------------------

POLICIES = ("lru", "lfru", "ema")
CHECKSUM_MODES = ("off", "first", "always")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings of an engine (never changes the numbers, only speed and memory).

    Attributes:
        store: path of a converted store (``colibri convert`` output).
        context_length: KV cache length in tokens (0 = the model's max_position_embeddings,
            capped at 4096).
        ram_budget_gb: total RAM the process may use, GB (1e9 bytes); None = automatic.
        cap: expert slots per layer; None = automatic from the budget.
        policy: "lru", "lfru" (score = heat << 8 | recency, as in the colibri seeds) or "ema"
            (evict the expert with the lowest EMA of router probability; see expert_cache).
        pinning: pin the hottest experts per layer after warm-up and pre-warm them at start.
        pin_per_layer: how many experts per layer hot pinning may pin (0 = auto: cap // 4).
        pilot: PILOT prefetch mode 0-3. pilot_workers: loader threads (1-8).
        wide: prefetch candidates = top-k x wide (1-4). conf_limit: stop adding candidates at
            this cumulative probability (when wide > 1). smooth: router-logit EMA used by the
            predictor only (0-0.95).
        spec_precision: load a PILOT prediction only while its (source, layer, rank) precision,
            measured online against the real routing, is at least this (0 = load every
            prediction, 0-1).
        evict_guard: speculative loads may not evict genuinely warm experts.
        o_direct: read experts with O_DIRECT (bypass the page cache) where supported.
        checksum: verify expert slab checksums "off" / "first" (first load) / "always".
        numba_threads: threads for numba kernels (0 = every CPU this process may use: CPU
            affinity and the cgroup CPU quota, see sysinfo.usable_cpus).
        history: persist routing heat next to the store.
    """

    store: str = ""
    context_length: int = 0
    ram_budget_gb: float | None = None
    cap: int | None = None
    policy: str = "ema"
    pinning: bool = True
    pin_per_layer: int = 0
    pilot: int = 0
    pilot_workers: int = 1
    wide: int = 1
    conf_limit: float = 0.92
    smooth: float = 0.3
    spec_precision: float = 0.7
    evict_guard: bool = True
    o_direct: bool = True
    checksum: str = "first"
    numba_threads: int = 0
    history: bool = True

    def validated(self) -> "EngineConfig":
        """Return self after checking every field's range.

        Raises:
            ConfigError: naming the setting, its value and the valid range.
        """
        def bad(name, why):
            raise ConfigError(f"setting '{name}' = {getattr(self, name)!r}: {why}")

        if self.context_length < 0:
            bad("context_length", "must be >= 0 (0 = model default)")
        if self.ram_budget_gb is not None and not (0.1 <= self.ram_budget_gb <= 1 << 16):
            bad("ram_budget_gb", "must be between 0.1 and 65536 GB, or auto")
        if self.cap is not None and self.cap < 1:
            bad("cap", "must be >= 1 expert per layer, or auto")
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}")
        if self.pilot not in (0, 1, 2, 3):
            bad("pilot", "must be 0, 1, 2 or 3")
        if not 1 <= self.pilot_workers <= 8:
            bad("pilot_workers", "must be 1-8")
        if not 1 <= self.wide <= 4:
            bad("wide", "must be 1-4")
        if not 0.1 <= self.conf_limit <= 1.0:
            bad("conf_limit", "must be 0.1-1.0")
        if not 0.0 <= self.smooth <= 0.95:
            bad("smooth", "must be 0-0.95")
        if not 0.0 <= self.spec_precision <= 1.0:
            bad("spec_precision", "must be 0-1 (0 = load every prediction)")
        if self.checksum not in CHECKSUM_MODES:
            bad("checksum", f"must be one of {CHECKSUM_MODES}")
        if self.numba_threads < 0:
            bad("numba_threads", "must be >= 0 (0 = all cores)")
        if self.pin_per_layer < 0:
            bad("pin_per_layer", "must be >= 0")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}).validated()

    def with_(self, **kw) -> "EngineConfig":
        return replace(self, **kw)
