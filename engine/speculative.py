"""Lossless speculative decoding: a drafter proposes the next tokens, one forward verifies them.

A decode forward over T tokens reads each needed expert once for all T positions, so checking a
draft of k tokens costs one forward over k + 1 positions (the last sampled token and the draft),
not k + 1 forwards. The engine (engine/generate.py) samples every verified row exactly as plain
decoding would (the same sampler, context, constraint and random draw per emitted token) and
keeps the draft only up to the first token the sampler did not pick:

- greedy: the argmax of each row, so the ids are those of plain decoding;
- sampling: for a deterministic drafter (prompt lookup proposes one token, probability 1) the
  standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023) accepts draft
  token t with probability p(t) and on rejection draws from p with t removed, renormalised.
  Drawing x ~ p with the sampler's own draw and accepting t iff x == t is that rule: P(accept)
  = p(t), and a rejected x is distributed as p conditioned on x != t. Coupled to the sampler's
  seeded generator this way, a seeded answer is also the same token stream with speculation
  on or off.

Rejected positions leave KV rows past the accepted length, which the next forward overwrites
(attention reads only positions before its own); a family with recurrent state rolls it back
with ``MoEModel.accept`` (engine/models/qwen3_next.py).

Drafter: :class:`PromptLookup` (n-gram match in the context: prompt-lookup decoding as in
transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram`` method and llama.cpp's lookup).
Draft length: :class:`DraftLength`, adapted to the measured acceptance and to the measured
cost of a verify forward against a one-token forward (I/O-bound forwards cost little more
per extra position; compute-bound ones cost more).
"""

from __future__ import annotations

SPECULATION_MODES = ("prompt_lookup", "mtp", "off")  # mtp: engine/mtp.py
NGRAM_MAX = 4  # longest context suffix matched (vLLM's prompt_lookup_max; transformers matches up to 2)
NGRAM_MIN = 2  # shortest: a single token repeats too often in code to predict what follows
# Adapt the draft length to what is measured; off (tests), every draft is as long as allowed, so
# which drafts are made does not depend on timing
ADAPT = True
EXPLORE_EVERY = 32  # with k = 0 chosen, still draft this often so acceptance and cost stay measured


class PromptLookup:
    """Proposes the tokens that followed the latest earlier occurrence of the context's suffix.

    ``propose(context, k) -> list[int]``: for n from NGRAM_MAX down to NGRAM_MIN, the last n
    tokens of ``context`` (ints, the prompt and the answer so far) are looked up among the
    context's earlier n-grams; the first n that matches gives up to ``k`` tokens that followed
    its latest occurrence, repeated with period L - end where they reach the context's end (a
    text that repeats keeps repeating), [] when none matches. The index grows with the context (each call
    adds the n-grams ending before the current suffix): O(new tokens) per call. ``context``
    must only grow between calls (a generation's context does: rejected drafts never enter it).
    """

    def __init__(self, n_max: int | None = None, n_min: int | None = None):
        self.n_max = NGRAM_MAX if n_max is None else n_max
        self.n_min = NGRAM_MIN if n_min is None else n_min
        self._last: dict[tuple, int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0  # n-grams ending at positions <= this are in _last

    def propose(self, context: list[int], k: int) -> list[int]:
        L = len(context)
        if k <= 0 or L < self.n_min + 1:
            return []
        # index the n-grams ending before L (the suffix ending at L is what is looked up)
        for end in range(max(self._indexed, self.n_min), L):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._last[tuple(context[end - n:end])] = end
        self._indexed = max(self._indexed, L)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = self._last.get(tuple(context[L - n:]))
            if end is not None:
                # a continuation that runs into the context's end repeats with period L - end
                # (the suffix recurs every L - end tokens: "#\n#\n..." drafts more than 2)
                return [int(context[end + i % (L - end)]) for i in range(k)]
        return []


class DraftLength:
    """How many draft tokens to verify next, from what speculation has measured so far.

    Model: each draft token is kept with probability ``a`` until the first rejection, so k
    draft tokens yield (1 - a^(k+1)) / (1 - a) tokens per forward. ``a`` is kept / (kept +
    rejections), decayed moving counts. A forward's cost is measured per number of positions T
    (moving averages of its seconds); an unmeasured T > 1 is estimated from the measured ones
    (a line through the two nearest, or a measured one plus a quarter per further position):
    a one-token step may run on another path than a verify (the one-call decode step), so its
    cost is no guide to a verify's. The k in 0..k_max with the most tokens per second wins
    (0: a plain forward); every EXPLORE_EVERY plain forwards in a row the best k > 0 is tried
    anyway, so a change in acceptance or cost is seen. Starts with a = 0.7.
    """

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.accepted, self.rejected = 0.7, 0.3  # pseudo-counts of the prior, decayed with use
        self.cost: dict[int, float] = {}  # positions T -> seconds of a forward (moving average)
        self._since_draft = 0

    @property
    def t1(self) -> float | None:
        """Seconds of a one-token forward (moving average), None before one is measured."""
        return self.cost.get(1)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def estimate(self, T: int) -> float:
        """Estimated seconds of a forward over T positions (T >= 1; a one-token one measured)."""
        if T in self.cost:
            return self.cost[T]
        seen = sorted(t for t in self.cost if t > 1)
        if len(seen) >= 2:
            lo, hi = (seen[0], seen[1]) if T < seen[0] else (seen[-2], seen[-1]) if T > seen[-1] else \
                (max(t for t in seen if t < T), min(t for t in seen if t > T))
            slope = max(0.0, (self.cost[hi] - self.cost[lo]) / (hi - lo))
            return max(self.cost[lo] + slope * (T - lo), self.cost[1])
        if seen:
            t = seen[0]
            return self.cost[t] * (1.0 + 0.25 * (T - t) / t)
        return self.cost[1] * (1.0 + 0.25 * (T - 1))

    def choose(self, available: int) -> int:
        """Draft tokens to verify next (0 = a plain one-token forward); ``available``: the most
        the drafter and the answer's room allow."""
        n = min(self.k_max, available)
        if not ADAPT:
            return max(n, 0)
        if n <= 0 or self.t1 is None:  # the first decode forward is a plain one: it measures t1
            return 0
        a = min(self.acceptance, 0.999)
        t1 = self.t1
        best, best_k, alt, alt_k = 1.0 / t1, 0, 0.0, 0
        for k in range(1, n + 1):
            rate = (1.0 - a ** (k + 1)) / (1.0 - a) / self.estimate(k + 1)
            if rate > alt:
                alt, alt_k = rate, k
            if rate > best * 1.02:  # a longer draft must clearly pay for its positions
                best, best_k = rate, k
        if best_k == 0:
            self._since_draft += 1
            if self._since_draft >= EXPLORE_EVERY:
                best_k = alt_k
        if best_k:
            self._since_draft = 0
        return best_k

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """A forward over 1 + ``drafted`` positions took ``seconds`` and ``accepted`` of its
        draft tokens were kept."""
        w = 0.9  # moving averages over ~10 forwards
        if drafted:
            self.accepted = w * self.accepted + accepted
            self.rejected = w * self.rejected + (1 if accepted < drafted else 0)
        if seconds > 0:
            T = drafted + 1
            old = self.cost.get(T)
            self.cost[T] = seconds if old is None else w * old + (1 - w) * seconds
