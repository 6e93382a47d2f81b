"""Routers: which K experts a token goes to and with what weights.

Three families of rules, all from router logits float32 [T, E] (E experts, K per token):

- ``softmax`` + ``greedy`` (OLMoE, Qwen, Mixtral, DeepSeek-V2 "greedy"): softmax over all E,
  the K largest probabilities; renormalised when ``norm_topk_prob``.
- ``softmax`` + ``group_limited_greedy`` (DeepSeek-V2 / V2-Lite): the E experts form
  ``n_group`` groups of E / n_group; a group scores its largest probability; only the
  ``topk_group`` best groups may be chosen (the others' probabilities become 0), then the K
  largest; weights times ``routed_scaling_factor``.
- ``sigmoid`` + ``noaux_tc`` (DeepSeek-V3, Kimi-K2, GLM-4.5): scores = sigmoid(logits); the
  choice uses scores + ``e_score_correction_bias`` (the bias never enters a weight); a group
  scores the sum of its two largest biased scores; the ``topk_group`` best groups stay, the
  other experts get -inf; the K largest biased scores are chosen; weights are the unbiased
  scores, renormalised (plus 1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.

Source: transformers' models/deepseek_v2 (DeepseekV2TopkRouter), models/deepseek_v3
(DeepseekV3TopkRouter) and models/glm4_moe (Glm4MoeTopkRouter).

Ties. transformers selects with ``torch.topk`` (the topk_group best of n_group groups, then
the K best of E experts). On the CPU torch.topk runs the C++ standard library's
``std::nth_element`` (or ``std::partial_sort`` when 64 K <= n) over (value, index) pairs
compared by value only, so which of several exactly equal values it keeps at the boundary is
whatever that library's introselect leaves: top-2 of [1, 1, 0.5, 1] -> {1, 3}, top-4 of 16
equal values -> {9, 10, 11, 12} (torch 2.13 with libstdc++); libc++ (macOS) and the CUDA
kernel are free to differ. That is not a rule one can follow portably, so we do not imitate it.
Our rule, at every selection step: the larger value first, and among equal values the lower
index first (a stable sort). The two choose the same experts with the same weights whenever
the values at the boundary do not tie (ties above or below it do not change the chosen set):
``tests/test_deepseek_glm_parity.py`` builds routers with duplicated experts (equal router
rows and correction biases, so whole groups tie on every token) and checks that ours equals
transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter on every token where the tie is
inside the choice, and keeps the lower group where it straddles the boundary. A tie at the
boundary needs equal router rows (and biases) or sigmoid scores saturated to exactly 1.0
(logits above about 17 in float32); masked experts (0 or -inf) never reach the boundary
because the kept groups hold at least K experts (checked when the config is read).
"""

from __future__ import annotations

import numpy as np

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices int64 [T, k] of the k largest values per row (larger first, lower index on ties)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return p


def route_tokens(router_logits: np.ndarray, k: int, *, norm_topk_prob: bool, scoring_func: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, bias: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Choose K experts per token.

    Args:
        router_logits: float32 [T, E]. k: experts per token (num_experts_per_tok).
        bias: float32 [E] ``e_score_correction_bias`` (``noaux_tc`` only), or None.

    Returns:
        (indices int64 [T, K] in rank order, weights float32 [T, K]).

    Raises:
        ValueError: an unknown scoring_func / topk_method, or E not divisible by n_group.
    """
    if scoring_func not in SCORING:
        raise ValueError(f"scoring_func {scoring_func!r}: choose one of {', '.join(SCORING)}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method {topk_method!r}: choose one of {', '.join(TOPK_METHODS)}")
    T, E = router_logits.shape
    x = router_logits.astype(np.float32, copy=False)
    scores = _softmax(x) if scoring_func == "softmax" else (np.float32(1.0) / (np.float32(1.0) + np.exp(-x)))
    scores = scores.astype(np.float32, copy=False)
    choice = scores if bias is None else scores + bias[None, :].astype(np.float32)
    if topk_method != "greedy" and n_group > 1:
        if E % n_group:
            raise ValueError(f"{E} experts cannot form {n_group} groups")
        g = choice.reshape(T, n_group, E // n_group)
        if topk_method == "group_limited_greedy":
            gscore = g.max(axis=2)  # [T, G]
            fill = np.float32(0.0)
        else:
            top2 = -np.sort(-g, axis=2)[:, :, :2]  # the two largest of each group
            gscore = top2.sum(axis=2)
            fill = np.float32(-np.inf)
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, _top(gscore, topk_group), True, axis=1)
        choice = np.where(np.repeat(keep, E // n_group, axis=1), choice, fill).astype(np.float32)
    idx = _top(choice, k)  # [T, K]
    if topk_method == "group_limited_greedy":
        w = np.take_along_axis(choice, idx, axis=1)  # masked probabilities (0 outside the groups)
    else:
        w = np.take_along_axis(scores, idx, axis=1)
    w = w.astype(np.float32)
    if norm_topk_prob:
        w /= w.sum(axis=1, keepdims=True) + (np.float32(1e-20) if scoring_func == "sigmoid" else 0)
    if routed_scaling_factor != 1.0:
        w *= np.float32(routed_scaling_factor)
    return idx.astype(np.int64), w
