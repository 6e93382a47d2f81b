"""Model families, one file each (mlx-lm's layout): ``ModelArgs`` parsed from config.json
with Hugging Face key names, the checkpoint-name mapping (``dense_tensors``,
``expert_names``) and the ``Model`` (the shared decoder of base.py, configured by the args).

Registry by config.json ``model_type``: :data:`FAMILIES`, :func:`family_for`,
:func:`build_model`. Layer indexing (MoE-layer rows vs transformer layers): see base.py.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import ConfigError
from . import mixtral, olmoe, qwen2_moe, qwen3_moe

FAMILIES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (olmoe, qwen3_moe, mixtral, qwen2_moe)}
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


def build_model(args, dense: dict, dense_quant: str, expert_quant: str, experts, context_length: int,
                group_size: int = 32):
    """The family's Model over resident ``dense`` tensors and an ExpertProvider (see base.MoEModel)."""
    return family_for(args.model_type).Model(args, dense, dense_quant, expert_quant, experts,
                                             context_length, group_size)
