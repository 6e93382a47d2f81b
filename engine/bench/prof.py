"""``colibri run --prof``: a closing profile in the spirit of colibri's PROF=1."""

from __future__ import annotations

from ..events import Finished, StepMetrics


class Profile:
    """Accumulates StepMetrics of one generation and prints the verdict."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[StepMetrics] = []

    def add(self, m: StepMetrics) -> None:
        self.steps.append(m)

    def summary(self, fin: Finished) -> dict:
        """Per-token figures over the decode steps (the first StepMetrics covers the prompt's
        prefill and the first token, and is reported separately as ``prefill_*``)."""
        s = self.steps
        dec = s[1:]
        hits = sum(m.hits for m in dec)
        miss = sum(m.misses for m in dec)
        pin = sum(m.pinned_hits for m in dec)
        look = hits + miss
        n = max(len(dec), 1)
        demand = sum(m.demand_bytes for m in dec)
        spec = sum(m.speculative_bytes for m in dec)
        felt = sum(m.felt_wait_s for m in dec)
        service = sum(m.read_service_s for m in dec)
        wall = len(dec) / fin.decode_tok_per_s if dec and fin.decode_tok_per_s > 0 else 0.0
        first = s[0] if s else None
        return {
            "tokens": fin.generated_tokens, "hit_rate": hits / look if look else 1.0,
            "pinned_hit_rate": pin / look if look else 0.0, "lru_hit_rate": (hits - pin) / look if look else 0.0,
            "mb_per_token": (demand + spec) / 1e6 / n, "demand_mb_per_token": demand / 1e6 / n,
            "speculative_mb_per_token": spec / 1e6 / n, "loads_per_token": sum(m.loads for m in dec) / n,
            "felt_wait_s": felt, "read_service_s": service, "decode_tok_per_s": fin.decode_tok_per_s,
            "ttft_s": fin.ttft_s, "peak_rss_bytes": max((m.rss_bytes for m in s), default=0),
            "cap_per_layer": self.engine.cache.cap, "io_share": min(felt / wall, 1.0) if wall > 0 else 0.0,
            "prefill_loads": first.loads if first else 0,
            "prefill_mb": (first.demand_bytes + first.speculative_bytes) / 1e6 if first else 0.0,
            "prefill_felt_wait_s": first.felt_wait_s if first else 0.0,
            "policy": self.engine.cache.policy,
            # since open, not this generation: the background work of reserve_cache / idle_fill
            "fill_loads": self.engine.cache.stats.fill_loads, "fill_pending": self.engine.cache.fill_pending(),
            "reserve_pending_mb": self.engine.cache.populate_pending() / 1e6,
            "fill_on": self.engine.config.idle_fill, "reserve_on": self.engine.config.reserve_cache,
        }

    def report(self, fin: Finished) -> str:
        d = self.summary(fin)
        bound = "I/O-bound" if d["io_share"] >= 0.30 else "compute-bound"
        advice = ""
        if bound == "I/O-bound" and d["hit_rate"] < 0.9:
            advice = (" (raise the RAM budget to cache more experts: the RSS guard lowered the cap to fit it)"
                      if self.engine.guard.fired else " (raise the RAM budget or the cap to cache more experts)")
        return "\n".join([
            "[prof] ---- closing profile ----",
            f"[prof] prefill + first token: {d['prefill_loads']} expert loads, {d['prefill_mb']:.1f} MB, "
            f"felt wait {d['prefill_felt_wait_s']:.3f} s, TTFT {d['ttft_s']:.3f} s",
            f"[prof] decode: expert hit rate {100 * d['hit_rate']:.1f}% (pinned {100 * d['pinned_hit_rate']:.1f}% + "
            f"{d['policy']} {100 * d['lru_hit_rate']:.1f}%), loads/token {d['loads_per_token']:.2f}",
            f"[prof] SSD {d['mb_per_token']:.2f} MB/token (demand {d['demand_mb_per_token']:.2f}, "
            f"speculative {d['speculative_mb_per_token']:.2f})",
            f"[prof] felt wait {d['felt_wait_s']:.3f} s vs read service {d['read_service_s']:.3f} s",
            f"[prof] decode {d['decode_tok_per_s']:.2f} tok/s, "
            f"peak RSS {d['peak_rss_bytes'] / 1e9:.2f} GB, cap {d['cap_per_layer']}/layer",
            f"[prof] verdict: {bound}, expert wait {100 * d['io_share']:.0f}% of decode time{advice}",
        ] + ([f"[prof] since open: idle fill loaded {d['fill_loads']} experts ({d['fill_pending']} more have room)"]
             if d["fill_on"] else [])
          + ([f"[prof] reserved cache memory: {d['reserve_pending_mb']:.1f} MB still to fault in"]
             if d["reserve_on"] else []))
