"""llama.cpp (through llama-cpp-python, tests only) against a reference's logits: shared by the
GGUF tests (tests/test_bench_peers.py, tests/test_bench_gguf_seed.py)."""

from __future__ import annotations

import numpy as np


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per row for logits float [N, V] (softmax of each)."""
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return (p * (np.log(p) - lq)).sum(-1)


def llama_logits(llama_cpp, model_path, ids, threads: int):
    """(float32 [len(ids), V]: llama.cpp's logits at every position of one batched eval, the Llama)."""
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=threads,
                          logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32), llm


def agreement(ref: np.ndarray, got: np.ndarray):
    """(top-1 agree bool [N], the reference's top-2 margin [N], max |got - ref|, max |ref|, KL [N])."""
    assert got.shape == ref.shape
    top2 = np.sort(ref, -1)[:, -2:]
    return (got.argmax(-1) == ref.argmax(-1), top2[:, 1] - top2[:, 0], float(np.abs(got - ref).max()),
            float(np.abs(ref).max()), kl(ref, got))
