"""Per-token StepMetrics and rate-limited ResidencySnapshots from the cache counters.

Definitions follow colibri's PROF=1: hit rate = hits / (hits + misses) over demand lookups
(one lookup per layer per distinct routed expert per forward); MB/token = bytes read / 1e6
per generated token; felt wait = seconds the compute thread was blocked on expert loads;
read service = seconds spent inside reads (overlaps compute).
"""

from __future__ import annotations

import time

import numpy as np

from .events import ABSENT, REMOTE, ResidencySnapshot, StepMetrics


def _rate(a: int, b: int) -> float:
    return a / b if b else 1.0


def answer_rates(totals: dict, generated_tokens: int) -> tuple[float, float]:
    """(hit rate, MB per token) of a whole answer so far, from cumulative cache counters
    (``MetricsTracker.totals()``): hits / (hits + misses) over every demand lookup of the
    prefill and the decode (1.0 with no lookups), and (demand + speculative bytes) / 1e6 per
    generated token (at least 1). The one definition behind Finished, StepMetrics.total_* and
    so the app's panels and per-answer line."""
    look = totals["hits"] + totals["misses"]
    return (_rate(totals["hits"], look),
            (totals["demand_bytes"] + totals["spec_bytes"]) / 1e6 / max(int(generated_tokens), 1))


class MetricsTracker:
    """Turns cumulative cache counters into per-token StepMetrics.

    Args:
        cache: ExpertCache (stats, cap, resident_bytes); budget: bytes; read_rss: () -> bytes.
    """

    def __init__(self, cache, budget: int, read_rss, pilot=None, remote=None):
        self.cache, self.budget, self.read_rss, self.pilot = cache, budget, read_rss, pilot
        self.remote = remote  # () -> bool [M, E]: experts a cluster worker that is up holds, or None
        self.start = cache.stats.snapshot()
        self.prev = dict(self.start)
        self.t_start = time.perf_counter()
        self.ttft = 0.0
        self.t_first = None
        self.peak_rss = 0
        self._last_res = 0.0

    def step(self, token_index: int, threads: int = 0, rss: int | None = None) -> StepMetrics:
        """Counters of the step that produced token ``token_index`` (tokens generated so far);
        ``rss``: the process's RSS in bytes measured after the step (RssGuard.last_rss), or
        None to read it here."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.ttft = now - self.t_start
        cur = self.cache.stats.snapshot()
        d = {k: cur[k] - self.prev[k] for k in cur}
        self.prev = cur
        hits, misses, pin = d["hits"], d["misses"], d["pinned_hits"]
        look = hits + misses
        if rss is None:
            rss = self.read_rss()
        self.peak_rss = max(self.peak_rss, rss)
        decode_tokens = token_index  # tokens after the first
        el = now - self.t_first
        tps = decode_tokens / el if el > 0 and decode_tokens else 0.0
        recall = self.pilot.recall() if self.pilot is not None else ()
        total_hit, total_mb = answer_rates({k: cur[k] - self.start[k] for k in cur}, token_index)
        return StepMetrics(
            token_index=token_index, hits=hits, misses=misses, pinned_hits=pin,
            hit_rate=_rate(hits, look), pinned_hit_rate=pin / look if look else 0.0,
            lru_hit_rate=(hits - pin) / look if look else 0.0, loads=d["loads"],
            demand_bytes=d["demand_bytes"], speculative_bytes=d["spec_bytes"],
            mb_per_token=(d["demand_bytes"] + d["spec_bytes"]) / 1e6,
            felt_wait_s=d["felt_wait_s"], read_service_s=d["read_service_s"], rss_bytes=rss,
            budget_bytes=self.budget, cache_bytes=self.cache.resident_bytes(),
            cap_per_layer=self.cache.cap, expert_slots=self.cache.slots, tok_per_s=tps, ttft_s=self.ttft,
            spec_issued=d["spec_issued"], spec_completed=d["spec_completed"],
            spec_dropped_stale=d["spec_dropped_stale"], spec_dropped_guard=d["spec_dropped_guard"],
            spec_dropped_full=d["spec_dropped_full"], spec_used=d["spec_used"],
            spec_wasted_bytes=d["spec_wasted_bytes"], pilot_recall=tuple(recall), threads=threads,
            total_hit_rate=total_hit, total_mb_per_token=total_mb)

    def totals(self) -> dict:
        """Counters accumulated since this tracker started."""
        cur = self.cache.stats.snapshot()
        return {k: cur[k] - self.start[k] for k in cur}

    def residency(self, token_index: int, heat: np.ndarray, force: bool = False) -> ResidencySnapshot | None:
        """A snapshot at most every 0.1 s (or when forced)."""
        now = time.perf_counter()
        if not force and now - self._last_res < 0.1:
            return None
        self._last_res = now
        return residency_snapshot(self.cache, heat, token_index, self.remote)


def residency_snapshot(cache, heat: np.ndarray, token_index: int, remote=None) -> ResidencySnapshot:
    """The cache's residency now as a ResidencySnapshot (heat int64 [L, E] routing counts;
    ``remote``: () -> bool [L, E] experts a cluster worker that is up holds, or None)."""
    st = cache.residency()
    if remote is not None:
        st = np.where((st == ABSENT) & remote(), REMOTE, st)
    return ResidencySnapshot(num_layers=cache.L, num_experts=cache.E, state=tuple(st.reshape(-1).tolist()),
                             heat=tuple(heat.reshape(-1).tolist()),
                             routed=tuple(cache.routed_now.reshape(-1).astype(np.int8).tolist()),
                             token_index=token_index)
