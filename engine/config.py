"""Model arguments read from a Hugging Face config.json, and the engine's runtime settings.

ModelArgs (engine/models/base.py) follows mlx-lm's ``ModelArgs.from_dict``: the Hugging Face
key names are kept (num_experts, num_experts_per_tok, norm_topk_prob, ...);
``ModelArgs.from_dict`` / ``from_hf_config`` dispatch to the family of config.json's
``model_type`` (engine/models/).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .errors import ConfigError
from .models import SUPPORTED_MODEL_TYPES as _SUPPORTED
from .models.base import ModelArgs

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "EngineConfig", "POLICIES", "CHECKSUM_MODES"]

SUPPORTED_MODEL_TYPES = _SUPPORTED  # config.json model_type values with a family file


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
        numba_threads: threads for numba kernels (0 = all cores).
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
