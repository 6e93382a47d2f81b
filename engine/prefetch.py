"""PILOT prefetch: router lookahead plus asynchronous loader workers.

Modes (colibri's olmoe.c PILOT, reference notes 1.9):
  1: from layer i's post-attention residual, predict layer i+1 with layer i+1's own
     post_attention_layernorm and router;
  2: also, from layer i's post-MoE residual, predict layer i+2;
  3: also predict layer i+3 from the post-MoE residual.
Draft lookahead (``pilot_draft``, any mode >= 1; this project's addition): when a decode step
must wait for experts of layer i that were not resident, the model publishes the draft
residual (layer i's output with the missing experts' share left out, ``on_moe_wait``) and
layer i+1 is predicted from it, with fresh logits; its non-resident candidates replace any
queued guesses for layer i+1 at the head of the queue, so they are read right behind the miss.
The next layer's attention runs on the draft first (its KV rows put back after), so only the
missing experts' share separates the prediction's input from the next layer's real one (mode
1's residual also lacks layer i's MoE output and layer i+1's attention): the prediction uses
time the compute thread would spend waiting, and runs only when the cache expects the wait to
last at least as long as a draft takes (ExpertCache.wait_estimate against the measured draft
time): a read that is nearly in is waited for, not delayed.
Hooks run only for small batches (T <= 8: decode), never during a long prefill.
A layer whose every expert is already in the cache (live slots = num_experts) is not predicted
unless something subscribed to the predictions (``on_prediction``): nothing could be loaded for
it, and on the bundled model, where every expert fits, predicting anyway cost 12-25% of decode.

Prediction: h' = RMSNorm(x; target post_attention_layernorm); logits = h' W_router^T;
with smooth s > 0 the predictor uses blended = (1-s) logits + s EMA (the EMA is also fed by
the real routing logits); real routing always uses fresh logits, so values never change.
Candidates: at least K, at most K x wide, stop when the cumulative probability reaches
conf_limit (wide > 1); queued in expert-id order.

Precision gate (this project's addition, measured on the default model and the 1B benchmark
model): the predictor's precision differs sharply by target layer and by the candidate's
rank (on the trained default model, rank 1 of layers 2-7 is routed 89-99% of the time, rank 4
of layer 1 32%). Every token the real routing scores each (source distance, target layer,
rank among the prediction's non-resident candidates) cell; a candidate is loaded only while
that cell's precision, (hits + 3) / (predictions + 4), is at least ``spec_precision``. Speculating on a coin flip costs SSD bytes
and evicts useful experts; gated speculation keeps MB/token near pilot 0's.

Demand first: a worker starts a speculative read only when no demand read is in flight
(this machine's disk gives 1.8-2.0 GB/s at queue depth 1 and no more at depth 4, so a
speculation beside a demand read only delays the read the compute is waiting for).

Queue: bounded, de-duplicated, pruned when a new token starts (stale), and requests for a
layer the compute has already reached (its attention ran) are dropped. Workers claim each item
exactly once.

The one-call decode step (MoEModel._decode_step_all; this observer is token-batched): a run of
resident layers holds the cache's lock from start to stop, so neither a worker nor a reader
could reserve a slot or start a read during it, and PILOT's hooks fire only at the layer that
stops a run (its attention ran in the kernel; its misses are read). There PILOT predicts as on
the per-layer path (mode 1 from the post-attention residual, the draft while it waits, modes
2 / 3 from the post-MoE residual), and right before the next run starts (``on_run_start``)
the compute thread reserves the slots of everything queued (ExpertCache.speculate_now), whose
reads the speculation reader then runs during the run. Inside a run the kernel predicts each
next layer itself (mode 1: layer t from layer t - 1's post-attention residual with layer t's
norm and router; the layers :meth:`Pilot.run_plan` wants), and when a prediction holds an
expert not in the cache it stops the run after layer t - 1: :meth:`Pilot.on_run_prediction`
queues the prediction, the next run reserves it, and its read runs while layer t's attention
and router compute instead of starting after them.
Eviction guard (colibri #497 final form): a speculation may take a free slot; it may evict a
resident expert unless the victim is genuinely warm (session heat >= 2) and clearly hotter
(score(victim) + score(victim)/4 + 4*256 > score(candidate); score = heat << 8 | recency).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from enum import Enum

import numpy as np

from .expert_cache import SpecDrop, SpecRefused
from .models.base import K
from .observers import Observer, ObserverList

MAX_QUEUE = 4096
SMALL_BATCH = 8
HEAT_HALVING_TOKENS = 8  # the guard's session heat is halved this often (colibri's tier_decay)


def lfru_score(heat: int, age: int) -> int:
    """colibri's tier_pick_lfru score: heat << 8 | recency, recency = 255 - age (0 if older)."""
    rec = 255 - age if 0 <= age < 255 else 0
    return (int(heat) << 8) | rec


def guard_allows(victim_heat: int, victim_age: int, cand_heat: int, cand_age: int,
                 victim_free: bool = False) -> bool:
    """May a speculative load evict this victim? (True = go ahead.)

    Free slots are always allowed; a victim with session heat < 2 is not genuinely warm and
    may go; otherwise the victim is protected when it is clearly hotter than the candidate.
    """
    if victim_free or victim_heat < 2:
        return True
    sv = lfru_score(victim_heat, victim_age)
    sc = lfru_score(cand_heat, cand_age)
    return not (sv + sv // 4 + 4 * 256 > sc)


class QueuePut(Enum):
    """Result of ``PrefetchQueue.put``."""

    OK = "ok"        # queued
    DUP = "dup"      # the same (layer, expert) is queued already
    FULL = "full"    # the queue holds ``maxsize`` items


class PrefetchQueue:
    """Bounded, de-duplicated multi-consumer queue of (layer, expert, generation) items.

    ``put`` returns a QueuePut; ``get`` hands each item to exactly one caller; ``clear`` drops
    everything (returns how many).
    """

    def __init__(self, maxsize: int = MAX_QUEUE):
        self.maxsize = maxsize
        self._q: deque = deque()
        self._keys: set = set()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, layer: int, expert: int, gen: int) -> QueuePut:
        """Queue (layer, expert) for token generation ``gen``: OK, DUP or FULL."""
        with self._cv:
            key = (layer, expert)
            if key in self._keys:
                return QueuePut.DUP
            if len(self._q) >= self.maxsize:
                return QueuePut.FULL
            self._keys.add(key)
            self._q.append((layer, expert, gen))
            self._cv.notify()
            return QueuePut.OK

    def put_layer_first(self, layer: int, experts: list[int], gen: int) -> tuple[int, int]:
        """Replace every queued item of ``layer`` by ``experts`` (in that order) at the head of
        the queue, for token generation ``gen``: a better prediction of the next layer goes
        before anything else queued. Returns (dropped, queued): the old items of ``layer`` not
        in ``experts``, and the items of ``experts`` queued (the queue's bound still holds)."""
        with self._cv:
            keep = set(experts)
            old = [it for it in self._q if it[0] == layer]
            dropped = sum(1 for it in old if it[1] not in keep)
            rest = [it for it in self._q if it[0] != layer]
            room = max(0, self.maxsize - len(rest))
            new = [(layer, int(e), gen) for e in experts][:room]
            self._q = deque(new + rest)
            self._keys = {(it[0], it[1]) for it in self._q}
            if new:
                self._cv.notify(len(new))
            return dropped, len(new)

    def get_nowait(self):
        """The next item, or None when the queue is empty."""
        with self._cv:
            if not self._q:
                return None
            item = self._q.popleft()
            self._keys.discard((item[0], item[1]))
            return item

    def get(self, timeout: float = 0.1):
        """Next item or None on timeout/close."""
        with self._cv:
            while not self._q:
                if self._closed:
                    return None
                if not self._cv.wait(timeout):
                    return None
            item = self._q.popleft()
            self._keys.discard((item[0], item[1]))
            return item

    def clear(self) -> int:
        with self._cv:
            n = len(self._q)
            self._q.clear()
            self._keys.clear()
            return n

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        return len(self._q)


class Pilot(Observer):
    """An observer of a model (engine/observers.py) that prefetches into an ExpertCache.

    The constructor subscribes it to ``model`` (forward start, run start, post-attention and
    post-MoE residuals, the draft, routing) and starts the loader workers; ``close`` unsubscribes and joins
    them. It uses only public members of the model (``args``, ``num_moe_layers``, ``moe_norm``,
    ``router_logits``; ``routing_replay`` when a recorded routing drives it) and the cache
    (``is_present``, ``wait_demand_idle``, ``try_speculate``, ``load_speculative``,
    ``speculate_now``, ``hand_off_speculations``, ``cancel_speculations``, ``count_dropped``, ``clock``,
    ``last_use``). It publishes
    ``on_prediction(layer, experts, distance)`` to its own subscribers (``subscribe``).

    Layers are MoE-layer indices (engine/models/base.py): "layer j + 1" is the next layer with
    routed experts, so dense layers in between are skipped (the prediction then crosses them).

    Args:
        model: a family's Model (engine/models); cache: ExpertCache; config: EngineConfig (pilot, pilot_workers, wide,
        conf_limit, smooth, evict_guard).
    """

    token_batched = True  # the one-call decode step keeps running with PILOT on (module docstring)

    def __init__(self, model, cache, config):
        a = model.args
        self.model, self.cache = model, cache
        self.mode = config.pilot
        self.draft = bool(config.pilot_draft)
        self.draft_s = 0.0  # seconds a draft takes (EMA of the measured ones)
        self.drafts = self.drafts_skipped = 0
        self.wide, self.conf_limit, self.smooth = config.wide, config.conf_limit, config.smooth
        self.min_precision = config.spec_precision
        self.use_guard = config.evict_guard
        self.L, self.E, self.K = model.num_moe_layers, a.num_experts, a.num_experts_per_tok
        # The guard's heat: routing counts of this session, halved every HEAT_HALVING_TOKENS
        # tokens (colibri halves eheat after each REPIN pass), so "genuinely warm" means warm
        # recently; never-decaying counts make every resident look warm and the guard drops
        # nearly every correct speculation on a small cache (colibri #490 / #497).
        self.session_heat = np.zeros((self.L, self.E), np.int64)
        self._tokens = 0
        self.ema = np.zeros((self.L, self.E), np.float32)
        self.ema_set = np.zeros(self.L, bool)
        self.queue = PrefetchQueue()
        self.gen = 0
        self.cur_layer = -1
        self.pos_last = 0
        self._small = False
        self.predicted = np.zeros((self.L, self.E), bool)  # this token's predictions
        self.pred_made = np.zeros(self.L, bool)  # layers predicted this token (recall counts only these)
        self.recall_hits = np.zeros(self.L, np.int64)
        self.recall_total = np.zeros(self.L, np.int64)
        # precision gate: [source distance 0..3 (0: the draft), target layer, rank] counts; this token's ranks
        nr = min(self.E, self.K * self.wide)
        self.prec_hits = np.zeros((4, self.L, nr), np.int64)
        self.prec_total = np.zeros((4, self.L, nr), np.int64)
        self.pred_rank = np.full((4, self.L, self.E), -1, np.int64)
        self.claimed = 0  # speculations reserved before one-call runs (on_run_start; some later given back)
        self.run_stops = 0  # one-call runs stopped for a prediction (on_run_prediction)
        self._look_want = np.zeros(self.L, bool)
        self._look_forced = np.zeros((self.L, self.E), np.float32)  # a replayed routing's predictor rows
        self._look_row_gen = np.full(self.L, -1, np.int64)  # the token each of those rows is for
        self._closed = False
        self.observers = ObserverList(("on_prediction",))
        model.subscribe(self)
        if self.mode >= 1 and hasattr(model, "run_lookahead"):
            model.run_lookahead = self  # predictions inside one-call runs (run_plan)
        self.workers = [threading.Thread(target=self._work, name=f"colibri-pilot-{i}", daemon=True)
                        for i in range(config.pilot_workers)]
        for w in self.workers:
            w.start()

    # --- compute-thread side ------------------------------------------------------------------------

    def subscribe(self, observer) -> None:
        """Publish this Pilot's predictions (``on_prediction``) to ``observer``."""
        self.observers.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        self.observers.unsubscribe(observer)

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        """A new forward starts: prune stale requests (the seeds' stale pruning)."""
        self.gen += 1
        self.pos_last = pos0 + num_tokens - 1  # a one-row MoE call's position (decode, a prefill's last chunk)
        self._tokens += 1
        if self._tokens % HEAT_HALVING_TOKENS == 0:
            self.session_heat >>= 1
        n = self.queue.clear()
        if n:
            self.cache.count_dropped(SpecDrop.STALE, n)
        self.predicted[:] = False
        self.pred_made[:] = False
        self.pred_rank[:] = -1
        self.cur_layer = -1
        self.cache.cancel_speculations()  # reserved for the last token's runs, never started

    def on_run_start(self, layer: int) -> None:
        """A one-call decode run from ``layer`` starts and will hold the cache's lock until it
        stops: reserve every queued speculation of a later layer now (the precision gate
        already passed them; ExpertCache.speculate_now), so its read runs during the run; the
        reserved ones of layers before ``layer`` whose reads have not started are given back
        (those layers ran)."""
        self.cache.cancel_speculations(below=layer)
        claimed = 0
        while True:
            item = self.queue.get_nowait()
            if item is None:
                break
            t, e, gen = item
            if gen != self.gen or t < layer:
                self.cache.count_dropped(SpecDrop.STALE)
                continue
            if self._reserved(self.cache.speculate_now(t, e, self._guard if self.use_guard else None)):
                claimed += 1
        self.claimed += claimed
        if claimed:  # the run takes both cores: the read must be on the disk before it starts
            self.cache.hand_off_speculations()

    def run_plan(self, l0: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """What a one-call decode run from layer ``l0`` predicts inside the kernel
        (K.decode_layers_t1's ``look``): want bool [L], the layers t > l0 worth predicting
        (:meth:`wanted`, and the precision gate open for the top candidate at distance 1), and
        under a replayed routing its recorded predictor's logits float32 [L, E] (row t: layer t
        from layer t - 1, as :meth:`predict` gets them), else None (the kernel runs layer t's
        own norm and router on layer t - 1's post-attention residual: mode 1). None when no
        layer is wanted. A run stops after a layer whose next layer's predicted top-k holds an
        expert not in the cache; :meth:`on_run_prediction` then queues it before the next run
        starts, so its read runs while that layer computes, not after its router."""
        want = self._look_want
        want[:l0 + 1] = False
        if self.observers.has("on_prediction"):
            want[l0 + 1:] = True
        else:
            want[l0 + 1:] = [self.cache.live_slots(t) < self.E for t in range(l0 + 1, self.L)]
        if self.min_precision > 0:  # the gate's estimate of the top candidate at distance 1 (precision)
            want &= (self.prec_hits[1, :, 0] + 3) / (self.prec_total[1, :, 0] + 4) >= self.min_precision
        if not want.any():
            return None
        replay = getattr(self.model, "routing_replay", None)
        if replay is None:
            return want, None
        for t in np.flatnonzero(want & (self._look_row_gen != self.gen)):
            self._look_forced[t] = replay.pred_logits(int(t), int(t) - 1, self.pos_last)[0]
            self._look_row_gen[t] = self.gen
        return want, self._look_forced

    def on_run_prediction(self, t: int, logits: np.ndarray) -> None:
        """A one-call run stopped before layer ``t`` because the kernel's prediction of it
        (logits float32 [E], :meth:`run_plan`) holds an expert not in the cache: predict from
        those logits as mode 1 does (distance 1, from layer t - 1; precision gate, queue)."""
        self.run_stops += 1
        self._small = True
        self.cur_layer = max(self.cur_layer, t - 1)
        self.predict(t, None, 1, t - 1, logits=logits)

    def wanted(self, t: int) -> bool:
        """Whether MoE layer ``t`` is worth predicting now: some of its experts are not in the
        cache (fewer live slots than num_experts), or a subscriber wants every prediction."""
        return self.cache.live_slots(t) < self.E or self.observers.has("on_prediction")

    def on_after_attention(self, layer: int, x: np.ndarray) -> None:
        self.cur_layer = layer  # its experts are requested next: queued guesses for it are stale
        self._small = x.shape[0] <= SMALL_BATCH
        if self._small and self.mode >= 1 and layer + 1 < self.L and self.wanted(layer + 1):
            self.predict(layer + 1, x[-1:], 1, layer)

    def on_moe_wait(self, layer: int, x: np.ndarray, wait_s: float) -> None:
        """Layer ``layer`` waits for experts being read; x float32 [1, D] is its draft residual
        (the hits' outputs added, the misses' left out: MoEModel._moe_t1). With the draft
        lookahead on, run the next layer's attention on it (MoEModel.draft_attention, which
        leaves the KV cache as it was) and predict the next layer from draft + attention
        (distance 0 in the precision gate and in ``on_prediction``) with fresh logits (no
        smoothing: that is nearly the next layer's input), queuing its misses behind the read
        in flight. Only when the cache expects the wait (``wait_s``) to last at least as long
        as a draft takes (``draft_s``, measured; lowered by a tenth at each skip, so one slow
        draft does not switch them off): else the read is in first and the draft would only
        delay the layer. The next layer's attention is what makes the draft close: recall of
        its top-8 0.96 with it, 0.74 without (tools/draft_recall.py)."""
        if not (self.draft and self.mode >= 1 and layer + 1 < self.L and self.wanted(layer + 1)):
            return
        if wait_s < self.draft_s:  # the read would be in before the draft: it would only delay
            self.drafts_skipped += 1
            self.draft_s *= 0.9  # one slow draft must not switch drafts off for good
            return
        t0 = time.perf_counter()
        att = self.model.draft_attention(layer + 1, x, self.pos_last)
        self.predict(layer + 1, x + att if att is not None else x, 0, layer)
        dt = time.perf_counter() - t0
        self.draft_s = dt if self.drafts == 0 else 0.8 * self.draft_s + 0.2 * dt
        self.drafts += 1

    def on_after_moe(self, layer: int, x: np.ndarray) -> None:
        if not self._small:
            return
        if self.mode >= 2 and layer + 2 < self.L and self.wanted(layer + 2):
            self.predict(layer + 2, x[-1:], 2, layer)
        if self.mode >= 3 and layer + 3 < self.L and self.wanted(layer + 3):
            self.predict(layer + 3, x[-1:], 3, layer)

    def precision(self, dist: int, layer: int, rank: int) -> float:
        """The gate's estimate: (hits + 3) / (predictions + 4) of the (dist, layer, rank) cell."""
        return (self.prec_hits[dist, layer, rank] + 3) / (self.prec_total[dist, layer, rank] + 4)

    def predict(self, t: int, x: np.ndarray | None, dist: int = 1, src: int | None = None,
                logits: np.ndarray | None = None) -> None:
        """Predict MoE layer ``t``'s experts from the residual x float32 [1, D] taken ``dist``
        layers before (0: the draft of layer t - 1, :meth:`on_moe_wait`) at MoE layer ``src``
        (default t - max(dist, 1)), publish them (``on_prediction``) and queue the
        non-resident ones the precision gate lets through (``request``; a draft's at the head
        of the queue, :meth:`PrefetchQueue.put_layer_first`). A model driven by a replayed
        routing (``routing_replay``: engine.trace.RecordedRouting) gets the recorded
        predictor's logits of layer t from layer ``src`` instead of its router's; given
        ``logits`` float32 [E], those (a prediction the one-call kernel made)."""
        m = self.model
        replay = getattr(m, "routing_replay", None)
        if logits is None and replay is not None:
            logits = replay.pred_logits(t, t - max(dist, 1) if src is None else src, self.pos_last)[0]
        elif logits is None:
            h = np.empty_like(x)
            K.rmsnorm(x, m.moe_norm(t), m.args.rms_norm_eps, h)
            logits = m.router_logits(t, h)[0]  # [E]
        if self.smooth > 0 and dist > 0:
            if not self.ema_set[t]:
                self.ema[t] = logits
                self.ema_set[t] = True
            blended = (1 - self.smooth) * logits + self.smooth * self.ema[t]
            self.ema[t] = blended
        else:
            blended = logits
        p = np.exp(blended - blended.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        k = self.K
        if self.wide > 1:
            cum = np.cumsum(p[order])
            n = int(np.searchsorted(cum, self.conf_limit) + 1)
            n = max(k, min(n, k * self.wide, self.E))
        else:
            n = k
        ranked = order[:n]
        self.predicted[t, ranked] = True
        self.pred_made[t] = True
        self.observers.publish("on_prediction", t, ranked, dist)
        # Only candidates that are not resident would be loaded, and they are the hard ones
        # (residents are mostly experts the routing keeps returning to), so the gate scores
        # exactly those: the rank among this prediction's non-resident candidates.
        missing = [int(e) for e in ranked if not self.cache.is_present(t, int(e))]
        self.pred_rank[dist, t, missing] = np.arange(len(missing))
        if self.min_precision > 0:
            missing = [e for r, e in enumerate(missing) if self.precision(dist, t, r) >= self.min_precision]
        if dist == 0:  # the draft: its misses go first, replacing older guesses for layer t
            dropped, queued = self.queue.put_layer_first(t, missing, self.gen)
            if dropped:
                self.cache.count_dropped(SpecDrop.STALE, dropped)
            if queued < len(missing):
                self.cache.count_dropped(SpecDrop.FULL, len(missing) - queued)
            return
        for e in sorted(missing):
            self.request(t, e)

    def request(self, layer: int, expert: int) -> QueuePut:
        """Queue a speculative load of ``expert`` of MoE layer ``layer`` for the current token
        (a full queue counts as a FULL drop). Returns the queue's answer."""
        r = self.queue.put(layer, expert, self.gen)
        if r is QueuePut.FULL:
            self.cache.count_dropped(SpecDrop.FULL)
        return r

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        """Real routing of ``layer``: the guard's heat, and for a layer predicted this token
        the recall and precision bookkeeping; the EMA (predictor only)."""
        logits = router_logits
        self.cur_layer = max(self.cur_layer, layer)
        self.session_heat[layer] += np.bincount(idx.reshape(-1), minlength=self.E)
        if idx.shape[0] > SMALL_BATCH:
            return
        if self.pred_made[layer]:
            routed = np.unique(idx)
            self.recall_total[layer] += len(routed)
            self.recall_hits[layer] += int(self.predicted[layer, routed].sum())
            hit = np.zeros(self.E, bool)
            hit[routed] = True
            for d in (0, 1, 2, 3):
                ranks = self.pred_rank[d, layer]
                m = ranks >= 0
                if m.any():
                    np.add.at(self.prec_total[d, layer], ranks[m], 1)
                    np.add.at(self.prec_hits[d, layer], ranks[m & hit], 1)
        if self.smooth > 0:
            real = logits[-1]
            if not self.ema_set[layer]:
                self.ema[layer] = real
                self.ema_set[layer] = True
            else:
                self.ema[layer] = (1 - self.smooth) * real + self.smooth * self.ema[layer]

    def recall(self) -> list[float]:
        """Per-layer share of routed experts that had been predicted, over the tokens the
        layer was predicted (layer 0: never predicted; a layer whose experts were all
        resident is not predicted, see ``wanted``)."""
        return [float(h / t) if t else 0.0 for h, t in zip(self.recall_hits, self.recall_total)]

    # --- worker side --------------------------------------------------------------------------------

    def _guard(self, layer: int, victim: int, cand: int) -> bool:
        c = self.cache
        return guard_allows(int(self.session_heat[layer, victim]), c.clock - int(c.last_use[layer, victim]),
                            int(self.session_heat[layer, cand]), c.clock - int(c.last_use[layer, cand]))

    def _work(self) -> None:
        while not self._closed:
            item = self.queue.get(0.1)
            if item is None:
                continue
            layer, e, gen = item
            # demand reads first: wait (briefly, re-checking staleness) until none is in flight
            while not self._closed and gen == self.gen and layer > self.cur_layer:
                if self.cache.wait_demand_idle(0.005):
                    break
            if gen != self.gen or layer <= self.cur_layer:
                self.cache.count_dropped(SpecDrop.STALE)
                continue
            slot = self.cache.try_speculate(layer, e, self._guard if self.use_guard else None)
            if self._reserved(slot):
                self.cache.load_speculative(layer, e, slot)

    def _reserved(self, slot: int) -> bool:
        """Whether a reservation (ExpertCache.try_speculate / speculate_now) got a slot; a
        refusal by the guard or for want of a slot is counted as that drop."""
        if slot == SpecRefused.GUARD:
            self.cache.count_dropped(SpecDrop.GUARD)
        elif slot == SpecRefused.PASSED:  # the run reached its layer while the worker waited
            self.cache.count_dropped(SpecDrop.STALE)
        elif slot == SpecRefused.FULL:
            self.cache.count_dropped(SpecDrop.FULL)
        return slot >= 0

    def close(self) -> None:
        """Unsubscribe from the model, stop and join every worker. Idempotent."""
        self.model.unsubscribe(self)
        if getattr(self.model, "run_lookahead", None) is self:
            self.model.run_lookahead = None
        self._closed = True
        self.queue.close()
        for w in self.workers:
            w.join()
