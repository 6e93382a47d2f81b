"""Compatibility names for the model code, which lives in engine/models/ (one file per family).

``OlmoeModel`` is the OLMoE family's Model; the shared blocks (route, rope_tables, Linear,
run_expert, mean_router_probs, Cancelled, ExpertProvider, PREFILL_CHUNK and the kernel module
``K``) come from engine/models/base.py.
"""

from __future__ import annotations

from .models.base import (PREFILL_CHUNK, Cancelled, ExpertProvider, K, Linear, MoEModel,  # noqa: F401
                          mean_router_probs, rope_tables, route, run_expert)
from .models.olmoe import Model as OlmoeModel  # noqa: F401
