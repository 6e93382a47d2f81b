"""Teacher-forced evaluation: held-out NLL and routing statistics, computed by our engine."""

from __future__ import annotations

import numpy as np


def teacher_forced_nll(model, ids) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods (nats) over positions 1..n-1 of ``ids``
    (one sequence, from an empty KV cache), and the number of predicted tokens.

    model: a family Model (engine.models); ids: int sequence of length n >= 2.
    """
    ids = np.asarray(ids, dtype=np.int64)
    logits = model.forward(ids, 0, all_logits=True).astype(np.float64)  # [n, V]
    z = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return float(nll.sum()), len(ids) - 1


def usage_entropy(counts: np.ndarray) -> np.ndarray:
    """Per-layer entropy (nats) of the expert-usage distribution; counts int [L, E]."""
    p = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -(np.where(p > 0, p * np.log(p), 0.0)).sum(axis=1)
