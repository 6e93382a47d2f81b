"""RAM measurements and the measured-RSS guard (the sizing rule itself is engine/sizing.py).

The automatic budget is RSS after the dense weights are loaded + 0.88 x available memory
(psutil); an unmeasurable or implausible probe (0, or < 2% of physical RAM) falls back to
half of physical RAM (8 GB if that is unknown) with one warning (colibri #1500 / #1601).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

log = logging.getLogger(__name__)

GB = 1_000_000_000
RESERVE_BYTES = 200_000_000  # Python + numpy + numba runtime, activations, logits (measured ~180 MB)
AVAILABLE_SHARE = 0.88
FALLBACK_BYTES = 8 * GB


_PROC = None


def current_rss() -> int:
    """Resident set size of this process in bytes (psutil)."""
    global _PROC
    if _PROC is None:
        import psutil
        _PROC = psutil.Process()
    return int(_PROC.memory_info().rss)


def probe_available() -> tuple[int, bool]:
    """(bytes the OS can still give us, whether the probe was trusted)."""
    try:
        import psutil
        vm = psutil.virtual_memory()
        avail, total = int(vm.available), int(vm.total)
    except Exception as e:  # noqa: BLE001
        log.warning("cannot measure available memory (%s); assuming %.1f GB", e, FALLBACK_BYTES / GB)
        return FALLBACK_BYTES, False
    if total <= 0:
        log.warning("physical memory unknown; assuming %.1f GB available", FALLBACK_BYTES / GB)
        return FALLBACK_BYTES, False
    if avail <= 0 or avail < 0.02 * total:
        log.warning("available-memory probe returned %d bytes of %d; assuming half of physical RAM",
                    avail, total)
        return total // 2, False
    return avail, True


class RssGuard:
    """Every ``every`` tokens, compare measured RSS with the budget; above it, evict and lower
    the cap so the excess is freed. The lowered cap holds (colibri #1034: no regrowth).

    Args:
        cache: the ExpertCache. budget: bytes. read_rss: injectable for tests.
    """

    def __init__(self, cache, budget: int, every: int = 16,
                 read_rss: Callable[[], int] = current_rss):
        self.cache, self.budget, self.every, self.read_rss = cache, budget, every, read_rss
        self.fired = 0
        self.last_message = ""

    def step(self, token_index: int) -> str | None:
        """Call at a safe point after each token. Returns a log line when it fired."""
        if token_index % self.every:
            return None
        rss = self.read_rss()
        if rss <= self.budget:
            return None
        c = self.cache
        excess = rss - self.budget
        drop = max(1, math.ceil(excess / (c.slot_bytes * c.L)))
        old = c.cap
        new = max(1, old - drop)
        if new == old:
            return None
        n = c.set_cap(new)
        self.fired += 1
        self.last_message = (f"RSS {rss / GB:.2f} GB over the {self.budget / GB:.2f} GB budget: dropped {n} "
                             f"cached experts, cap {old} -> {new}")
        log.warning(self.last_message)
        return self.last_message


def __getattr__(name: str):
    """Old names: the sizing rule (plan_cap, BudgetPlan) lives in engine/sizing.py now."""
    if name in ("plan_cap", "BudgetPlan"):
        from . import sizing
        return getattr(sizing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
