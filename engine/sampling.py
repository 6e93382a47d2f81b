"""Next-token selection: greedy or sampled with repetition penalty, temperature, top-k, top-p.

The order follows transformers' logits processors: repetition penalty (CTRL), temperature,
top-k, top-p, then one draw from the sampler's own ``numpy.random.Generator(PCG64(seed))``,
so a sampler built with the same params replays the same tokens for the same logits.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import numpy as np

from .events import SamplingParams
from .settings import SAMPLING, validate

log = logging.getLogger(__name__)

# Top-p first looks at this many most likely tokens (growing x8 until the nucleus fits),
# so a 50k vocabulary is never fully sorted.
_TOP_P_FIRST_WINDOW = 64


def fresh_seed() -> int:
    """A new sampling seed, 0 <= seed < 2**63 (the Seed setting's range), from the OS entropy
    source (``secrets``), for answers whose Seed setting is "auto" and for Regenerate."""
    return secrets.randbits(63)


def validate_sampling_params(params: SamplingParams) -> None:
    """Check SamplingParams against the settings table (engine.settings: the one range of each).

    Raises:
        ConfigError (a ValueError): naming the setting, its value and the valid range.
    """
    validate(params, SAMPLING)


class Sampler:
    """Chooses the next token from a logits vector.

    ``Sampler(params)`` validates ``params`` (ValueError naming the setting) and owns a
    ``numpy.random.Generator(PCG64(seed))``; ``seed`` (int, 0 <= seed < 2**63) is
    ``params.seed``, or when that is None ("auto") a fresh one from the OS entropy source
    (``secrets.randbits(63)``), kept in ``self.seed`` so the caller can store it and replay the
    same tokens later with ``SamplingParams(seed=that)``.

    ``sampler(logits, context_ids) -> int``:
      logits: np.ndarray, shape (V,), float (float32 from the engine); never modified.
      context_ids: the prompt and generated ids so far (for the repetition penalty).
      allowed: optional bool array (V,): only these tokens may be drawn (constrained
        decoding, applied after the repetition penalty and the copy prior).
    Greedy when temperature <= 0 (argmax, lowest id on ties); the repetition penalty still
    applies when != 1. NaN logits count as -inf; +inf logits win (sampled among themselves);
    if no logit is finite the result is argmax(nan_to_num(logits)) and a warning is logged
    once per sampler. Raises ValueError for logits that are not 1-D or empty.
    """

    def __init__(self, params: SamplingParams) -> None:
        validate_sampling_params(params)
        self.params = params
        self.greedy = params.temperature <= 0
        self.seed = fresh_seed() if params.seed is None else int(params.seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._warned_nonfinite = False

    def _warn_once(self, what: str) -> None:
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("sampler: %s in the logits; the model output is numerically broken "
                        "(this warning is shown once)", what)

    def __call__(self, logits: np.ndarray, context_ids: Sequence[int] = (),
                 copy: tuple[float, dict] | None = None, allowed: np.ndarray | None = None) -> int:
        raw = np.asarray(logits)
        if raw.ndim != 1 or raw.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array (V,), got shape {raw.shape}")
        x = raw.astype(np.float64)  # always a copy: the caller's array is left alone
        finite = np.isfinite(x)
        if not finite.all():
            if not finite.any():
                self._warn_once("no finite value")
                return int(np.argmax(np.nan_to_num(raw.astype(np.float64))))
            nan = np.isnan(x)
            if nan.any():
                self._warn_once("NaN")
                x[nan] = -np.inf
            posinf = np.isposinf(x)
            if posinf.any():
                self._warn_once("+inf")
                x = np.where(posinf, 0.0, -np.inf)

        p = self.params
        if p.repetition_penalty != 1.0 and len(context_ids):
            ids = np.unique(np.asarray(context_ids, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.shape[0])]
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)

        if copy is not None:  # (lambda, {id: p}): the documentation copy prior (docs_lookup.CopyPrior)
            lam, prop = copy
            m = x.max()
            q = np.exp(x - m)
            q *= (1.0 - lam) / q.sum()
            for t, pc in prop.items():
                if 0 <= t < q.shape[0]:
                    q[t] += lam * pc
            with np.errstate(divide="ignore"):
                x = np.log(q)

        if allowed is not None:  # constrained decoding: only the tokens a grammar allows
            ok_mask = np.zeros(x.shape[0], dtype=bool)
            n = min(x.shape[0], allowed.shape[0])
            ok_mask[:n] = allowed[:n]
            x = np.where(ok_mask, x, -np.inf)
            if not np.isfinite(x).any():
                ok = np.flatnonzero(ok_mask)
                if ok.size == 0:
                    raise ValueError("the grammar allows no token")
                return int(ok[0])

        if self.greedy or p.top_k == 1:
            return int(np.argmax(x))

        # Candidates: every token with a finite logit (-inf ones can never be drawn).
        cand = np.flatnonzero(x > -np.inf)
        if cand.size == 1:
            return int(cand[0])
        z = x[cand] / p.temperature

        # top-k: keep the k largest (ties with the k-th are kept, as in transformers).
        if 0 < p.top_k < cand.size:
            kth = np.partition(z, cand.size - p.top_k)[cand.size - p.top_k]
            keep = z >= kth
            cand, z = cand[keep], z[keep]

        probs = np.exp(z - z.max())
        probs /= probs.sum()

        # top-p: smallest set of most likely tokens whose probability mass reaches top_p.
        if p.top_p < 1.0 and cand.size > 1:
            n = cand.size
            m = min(n, _TOP_P_FIRST_WINDOW)
            while True:
                idx = np.argpartition(-probs, m - 1)[:m] if m < n else np.arange(n)
                if m == n or probs[idx].sum() >= p.top_p:
                    break
                m = n if m * 8 > n else m * 8
            # most likely first; lower token id first among equal probabilities
            idx = np.sort(idx)
            idx = idx[np.argsort(-probs[idx], kind="stable")]
            cum = np.cumsum(probs[idx])
            n_keep = min(int(np.searchsorted(cum, p.top_p, side="left")) + 1, idx.size)
            idx = idx[:n_keep]
            cand, probs = cand[idx], probs[idx]
            if cand.size == 1:
                return int(cand[0])

        cum = np.cumsum(probs)
        u = self._rng.random() * cum[-1]
        j = min(int(np.searchsorted(cum, u, side="right")), cand.size - 1)
        return int(cand[j])
