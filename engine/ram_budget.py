"""RAM budget: how many expert slots per layer fit, and the measured-RSS guard.

Automatic cap (after colibri's cap_for_ram, PR #1445):
    cap = (budget - resident dense - KV cache at the configured context - reserve)
          / sum over layers of each layer's real slot size, clamped to [1, num_experts].
The automatic budget is RSS after the dense weights are loaded + 0.88 x available memory
(psutil); an unmeasurable or implausible probe (0, or < 2% of physical RAM) falls back to
half of physical RAM (8 GB if that is unknown) with one warning (colibri #1500 / #1601).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from .errors import BudgetError

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


@dataclass(frozen=True)
class BudgetPlan:
    """Outcome of sizing; all sizes in bytes."""

    budget: int
    dense: int
    kv: int
    reserve: int
    slot_bytes_sum: int  # one slot in every layer
    cap: int
    auto_budget: bool
    auto_cap: bool

    def describe(self) -> str:
        return (f"{self.cap} slots/layer: {self.budget / GB:.2f} GB budget "
                f"({'auto' if self.auto_budget else 'set'}), {self.dense / GB:.2f} GB dense, "
                f"{self.kv / GB:.2f} GB KV, {self.reserve / GB:.2f} GB reserve, "
                f"{self.slot_bytes_sum / 1e6:.1f} MB per slot across layers")


def plan_cap(num_experts: int, slot_bytes: list[int], dense_bytes: int, kv_bytes: int,
             ram_budget_gb: float | None, cap: int | None, rss_now: int | None = None,
             available: int | None = None, reserve: int = RESERVE_BYTES) -> BudgetPlan:
    """Size the expert cache.

    Args:
        slot_bytes: per-layer slot size (bytes). dense_bytes, kv_bytes: resident bytes.
        ram_budget_gb: explicit budget (GB) or None for automatic.
        cap: explicit slots/layer (overrides the automatic cap; still refused if its minimum,
            one slot per layer, does not fit the budget).
    Raises:
        BudgetError: not even one slot per layer fits; the message gives the numbers.
    """
    per = int(sum(slot_bytes))
    if ram_budget_gb is None:
        if available is None:
            available, _ = probe_available()
        base = rss_now if rss_now is not None else dense_bytes
        budget = int(base + AVAILABLE_SHARE * available)
    else:
        budget = int(ram_budget_gb * GB)
    room = budget - dense_bytes - kv_bytes - reserve
    fit = room // per if per > 0 else num_experts
    if fit < 1:
        raise BudgetError(
            f"RAM budget {budget / GB:.2f} GB cannot hold the dense weights ({dense_bytes / GB:.2f} GB) + "
            f"KV cache ({kv_bytes / GB:.2f} GB) + reserve ({reserve / GB:.2f} GB) + one expert slot per "
            f"layer ({per / GB:.3f} GB): {(dense_bytes + kv_bytes + reserve + per) / GB:.2f} GB needed. "
            f"Raise ram_budget_gb, lower the context length, or use a smaller quantization.")
    auto_cap = cap is None
    c = int(min(max(fit, 1), num_experts)) if auto_cap else int(min(cap, num_experts))
    return BudgetPlan(budget, dense_bytes, kv_bytes, reserve, per, c, ram_budget_gb is None, auto_cap)


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
