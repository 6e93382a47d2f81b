"""``colibri run --prof``: a closing profile in the spirit of colibri's PROF=1."""

from __future__ import annotations

from .events import Finished, StepMetrics


class Profile:
    """Accumulates StepMetrics of one generation and prints the verdict."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[StepMetrics] = []

    def add(self, m: StepMetrics) -> None:
        self.steps.append(m)

    def summary(self, fin: Finished) -> dict:
        s = self.steps
        hits = sum(m.hits for m in s)
        miss = sum(m.misses for m in s)
        pin = sum(m.pinned_hits for m in s)
        look = hits + miss
        n = max(len(s), 1)
        demand = sum(m.demand_bytes for m in s)
        spec = sum(m.speculative_bytes for m in s)
        felt = sum(m.felt_wait_s for m in s)
        service = sum(m.read_service_s for m in s)
        wall = n / s[-1].tok_per_s if s and s[-1].tok_per_s > 0 else 0.0
        return {
            "tokens": fin.generated_tokens, "hit_rate": hits / look if look else 1.0,
            "pinned_hit_rate": pin / look if look else 0.0, "lru_hit_rate": (hits - pin) / look if look else 0.0,
            "mb_per_token": (demand + spec) / 1e6 / n, "demand_mb_per_token": demand / 1e6 / n,
            "speculative_mb_per_token": spec / 1e6 / n, "loads_per_token": sum(m.loads for m in s) / n,
            "felt_wait_s": felt, "read_service_s": service, "decode_tok_per_s": fin.decode_tok_per_s,
            "ttft_s": fin.ttft_s, "peak_rss_bytes": max((m.rss_bytes for m in s), default=0),
            "cap_per_layer": self.engine.cache.cap, "io_share": felt / wall if wall > 0 else 0.0,
        }

    def report(self, fin: Finished) -> str:
        d = self.summary(fin)
        bound = "I/O-bound" if d["io_share"] >= 0.30 else "compute-bound"
        advice = ""
        if bound == "I/O-bound" and d["hit_rate"] < 0.9:
            advice = " (raise the RAM budget or the cap to cache more experts)"
        return "\n".join([
            "[prof] ---- closing profile ----",
            f"[prof] expert hit rate {100 * d['hit_rate']:.1f}% (pinned {100 * d['pinned_hit_rate']:.1f}% + "
            f"lru {100 * d['lru_hit_rate']:.1f}%), loads/token {d['loads_per_token']:.2f}",
            f"[prof] SSD {d['mb_per_token']:.2f} MB/token (demand {d['demand_mb_per_token']:.2f}, "
            f"speculative {d['speculative_mb_per_token']:.2f})",
            f"[prof] felt wait {d['felt_wait_s']:.3f} s vs read service {d['read_service_s']:.3f} s",
            f"[prof] decode {d['decode_tok_per_s']:.2f} tok/s, TTFT {d['ttft_s']:.3f} s, "
            f"peak RSS {d['peak_rss_bytes'] / 1e9:.2f} GB, cap {d['cap_per_layer']}/layer",
            f"[prof] verdict: {bound}, expert wait {100 * d['io_share']:.0f}% of decode time{advice}",
        ])
