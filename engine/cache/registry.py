"""The expert cache's eviction policies by name: the whole list.

``engine.settings.POLICIES`` (the setting's choices, the ``--policy`` flag and the dialog) is
read from :data:`POLICY_CLASSES`, ``ExpertCache`` builds its policy by name here, and
``colibri bench replay`` (``engine.trace.replay_all``) compares every policy registered here
with Belady on recorded traces. Adding a policy: its class in a file of its own beside
policy.py (deriving from ``EvictionPolicy``), then one import and one entry below.
"""

from __future__ import annotations

import numpy as np

from .policy import EMA, LFRU, LRU, EvictionPolicy

POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, LFRU, EMA)}


def make_policy(name: str, heat: np.ndarray, prob_ema: np.ndarray, max_cap: int) -> EvictionPolicy:
    """The policy registered as ``name``; ValueError naming the choices for any other name."""
    cls = POLICY_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}: choose one of {', '.join(POLICY_CLASSES)}")
    return cls(heat, prob_ema, max_cap)
