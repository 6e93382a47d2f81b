"""Routing traces (``colibri run --trace FILE``) and offline replay against Belady's bound.

Trace: JSON lines. The first line is a header {"format": "colibri-route-trace", "version": 1,
num_layers, num_experts, top_k, cap, policy, pins (initial pinned ids per layer),
heat (initial routing counts [L][E])}. Then one record per MoE call:
{"f": forward, "l": layer, "idx": [[K ids] per row], "pred": [ids predicted by PILOT],
"p": [E mean router probabilities, float32 values]} (``p`` feeds the "ema" policy on replay)
and {"pin": [[ids] per layer]} whenever the engine changes its pin set.

With ``logits=True`` (``colibri run --trace FILE --trace-logits``, ``colibri bench
trace-heldout --logits``) the header says ``"logits": true`` and each MoE-call record also
carries ``"lg"``: the router logits of every row ([T][E], rounded to 1e-3), and, for decode
steps (T <= 8), ``"pl"``: {"1"|"2"|"3": [E]}: PILOT's predictor logits for this layer's last
row, computed by the recorder exactly as PILOT computes them (target layer's
post_attention_layernorm + router on the residual of layer l-1 after attention for distance 1,
of layer l-d after its MoE for distances 2 and 3), whether PILOT is on or not. They drive
``RecordedRouting``: a bigger model's routing replayed from a trained model's real routing.

Replay drives the engine cache's own bookkeeping (engine/cache/slots.py: the slot table and
the eviction policy, no threads, no reads) through the engine's call sequence, so "our policy"
reproduces the engine's hit/miss counts exactly (with PILOT off; speculation timing is not
replayable). Belady's optimal policy (MIN,
Belady 1966) evicts the resident expert whose next request is farthest in the future.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .cache.slots import SlotTable
from .errors import EngineError
from .heat import cap_pins, choose_pins, pins_per_layer
from .models.base import mean_router_probs
from .observers import Observer

TRACE_FORMAT = "colibri-route-trace"


class TraceRecorder(Observer):
    """An observer (engine/observers.py) that records every MoE call's routing, PILOT's
    predictions for that call and every pin change of an open Engine.

    ``TraceRecorder(engine)`` subscribes to the engine (``Engine.subscribe``); ``close()``
    unsubscribes. ``save(path)`` writes the trace (JSON lines, see the module docstring).
    """

    def __init__(self, engine, logits: bool = False):
        self.engine = engine
        self.logits = bool(logits)
        self._pl: dict[int, dict[str, list]] = {}  # this forward's predictor logits per target layer
        self._small = False
        c = engine.cache
        self.header = {"format": TRACE_FORMAT, "version": 1, "num_layers": c.L, "num_experts": c.E,
                       **({"logits": True} if self.logits else {}),
                       "top_k": engine.args.num_experts_per_tok, "cap": c.cap, "policy": c.policy,
                       "pins": [np.nonzero(r)[0].tolist() for r in c.pinned],
                       "heat": c.heat.tolist(), "pin_per_layer": engine.config.pin_per_layer}
        self.records: list[dict] = []
        self._forward = 0  # counts prefill chunks and decode steps (layer 0 starts)
        self._pred: dict[int, set[int]] = {}  # this forward's PILOT predictions per layer
        engine.subscribe(self)

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        self._pred.clear()
        self._pl.clear()

    def _predict(self, t: int, x: np.ndarray, dist: int) -> None:
        """PILOT's predictor logits for MoE layer t from the residual row x [1, D]."""
        from .models.base import K
        m = self.engine.model
        if not 0 <= t < m.num_moe_layers:
            return
        h = np.empty_like(x)
        K.rmsnorm(x, m.moe_norm(t), m.args.rms_norm_eps, h)
        self._pl.setdefault(t, {})[str(dist)] = _round(m.router_logits(t, h)[0])

    def on_after_attention(self, layer: int, x: np.ndarray) -> None:
        self._small = x.shape[0] <= 8
        if self.logits and self._small:
            self._predict(layer + 1, np.ascontiguousarray(x[-1:]), 1)

    def on_after_moe(self, layer: int, x: np.ndarray) -> None:
        if self.logits and self._small:
            for d in (2, 3):
                self._predict(layer + d, np.ascontiguousarray(x[-1:]), d)

    def on_layer_start(self, layer: int) -> None:
        if layer == 0:
            self._forward += 1

    def on_prediction(self, layer: int, experts: np.ndarray, distance: int) -> None:
        self._pred.setdefault(layer, set()).update(int(e) for e in experts)

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        rec = {"f": self._forward, "l": layer, "idx": idx.tolist(),
               "pred": sorted(self._pred.get(layer, ())),
               "p": mean_router_probs(router_logits).tolist()}
        if self.logits:
            rec["lg"] = [_round(r) for r in router_logits]
            if layer in self._pl:
                rec["pl"] = self._pl[layer]
        self.records.append(rec)

    def on_pins(self, pinned: np.ndarray) -> None:
        self.records.append({"pin": [np.nonzero(r)[0].tolist() for r in pinned]})

    def close(self) -> None:
        """Stop recording (unsubscribe). Idempotent."""
        self.engine.unsubscribe(self)

    def save(self, path: str | Path) -> Path:
        """Write the trace atomically to ``path``.

        Raises:
            EngineError: a hook of this recorder raised during the run (it was unsubscribed,
                so the trace would be incomplete); nothing is written.
        """
        from .fsutil import atomic_write_text
        failed = [f for f in self.engine.observer_failures() if f.observer is self]
        if failed:
            f = failed[0]
            raise EngineError(f"{path}: trace not written: the recorder failed in {f.hook} "
                              f"({type(f.error).__name__}: {f.error}), so it would be incomplete")
        lines = [json.dumps(self.header)] + [json.dumps(r) for r in self.records]
        atomic_write_text(path, "\n".join(lines) + "\n")
        return Path(path)


def _round(v: np.ndarray) -> list[float]:
    return [round(float(x), 3) for x in v]


def load_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records).

    Raises:
        ValueError: the file is missing, unreadable, empty, not a colibri route trace (record
            one with ``colibri run --trace FILE``) or truncated; the message names the file.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the trace ({e.__class__.__name__}: {e})") from None
    if not lines:
        raise ValueError(f"{path}: empty trace")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a colibri route trace (record one with `colibri run --trace FILE`)")
    recs = []
    for i, x in enumerate(lines[1:], start=2):
        if not x.strip():
            continue
        try:
            r = json.loads(x)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {i} is not valid JSON (truncated trace?)") from None
        if not isinstance(r, dict) or not ("pin" in r or ("l" in r and "idx" in r)):
            raise ValueError(f"{path}: line {i} is not a trace record")
        recs.append(r)
    return head, recs


def _initial_pins(head: dict, cap: int) -> list[list[int]]:
    """The recorded pre-warm pins as the engine caps them at ``cap`` (``Engine._cap_pins``)."""
    L, E = head["num_layers"], head["num_experts"]
    pinned = np.zeros((L, E), bool)
    for layer, ids in enumerate(head["pins"]):
        pinned[layer, ids] = True
    n = pins_per_layer(cap, int(head.get("pin_per_layer") or 0))
    capped = cap_pins(pinned, np.asarray(head["heat"], dtype=np.int64), n)
    return [np.nonzero(r)[0].tolist() for r in capped]


def _replay_call(table, layer: int, experts) -> None:
    """One MoE call of ``experts`` (distinct ints) on the slot table as the engine makes it
    (``ExpertCache.prepare``, then ``acquire`` + ``release`` of each expert in compute order),
    each read done as soon as it is queued."""
    hits, _, misses, absent, _ = table.lookup(layer, experts)
    for e, s in zip(absent, table.reserve_absent(layer, absent, hold=experts)):
        table.publish(layer, e, s, None)
    for e in hits + misses:
        s = int(table.where[layer, e])
        if s < 0:  # no slot at lookup time: the take reserves one (every other slot is idle)
            s = table.reserve_for_take(layer, e)
            table.publish(layer, e, s, None)
        table.take(layer, e, s)
        table.give_back(layer, e)


def replay_policy(head: dict, records: list[dict], cap: int, policy: str, pinning: bool) -> dict:
    """Hit/miss counts of the engine's cache on a trace: its slot bookkeeping and eviction
    policy (engine/cache/slots.py, no threads, no reads) driven in the engine's call order.

    With ``pinning``, each recorded pin event re-chooses the pins the engine would choose at
    this ``cap`` from the routing heat accumulated up to that point (at the recording cap that is
    exactly the recorded pin set), so one trace serves every cap. Initial (pre-warmed) pins
    are the header's, capped as the engine caps them at this ``cap``.
    """
    L, E = head["num_layers"], head["num_experts"]
    heat = np.asarray(head["heat"], dtype=np.int64).copy()
    table = SlotTable(L, E, cap, policy, heat)
    pins0 = _initial_pins(head, cap) if pinning else []
    if any(pins0):
        p = np.zeros((L, E), bool)
        for layer, ids in enumerate(pins0):
            p[layer, ids] = True
        table.set_pinned(p)
        st = table.stats
        for layer, ids in enumerate(pins0):  # the pre-warm (ExpertCache.load_experts): not counted
            kept = st.hits, st.misses, st.pinned_hits
            _replay_call(table, layer, ids)
            st.hits, st.misses, st.pinned_hits = kept
    for r in records:
        if "pin" in r:
            if pinning:
                table.set_pinned(choose_pins(heat, pins_per_layer(cap, int(head.get("pin_per_layer") or 0))))
            continue
        layer = r["l"]
        idx = np.asarray(r["idx"], dtype=np.int64)
        np.add.at(heat[layer], idx.reshape(-1), 1)
        if "p" in r:
            table.observe_probs(layer, np.asarray(r["p"], np.float32)[None])
        _replay_call(table, layer, np.unique(idx).tolist())
    s = table.stats
    return {"hits": s.hits, "misses": s.misses, "pinned_hits": s.pinned_hits,
            "hit_rate": s.hits / max(s.hits + s.misses, 1)}


def replay_belady(head: dict, records: list[dict], cap: int, warm: bool = True) -> dict:
    """Belady's MIN per layer on the same request stream (the set of distinct experts per call).

    Within a call the order is free, so, like the engine, the call's resident experts are used
    first (hits), then each miss evicts the resident expert whose next call is farthest in the
    future (Belady 1966); an expert this call has already used counts by its next call.
    With ``warm``, it starts from the pre-warmed pins the engine would hold at this cap (a
    warm start never hurts MIN, so it bounds both the cold policies and "ours").
    """
    pins0 = _initial_pins(head, cap) if warm else [[] for _ in head["pins"]]
    L = head["num_layers"]
    calls: list[list[list[int]]] = [[] for _ in range(L)]
    for r in records:
        if "l" in r:
            calls[r["l"]].append(np.unique(np.asarray(r["idx"])).tolist())
    hits = misses = 0
    for layer, seq in enumerate(calls):
        n = len(seq)
        nxt_of: list[dict[int, int]] = [{} for _ in range(n)]  # call c -> {expert: next call using it}
        upcoming: dict[int, int] = {}
        for c in range(n - 1, -1, -1):
            for e in seq[c]:
                nxt_of[c][e] = upcoming.get(e, n + 1)
            for e in seq[c]:
                upcoming[e] = c
        resident: dict[int, int] = {}  # expert -> index of its next use
        for e in pins0[layer] if layer < len(pins0) else []:
            first = next((c for c, need in enumerate(seq) if e in need), n + 1)
            resident[e] = first
        for c, need in enumerate(seq):
            missing = [e for e in need if e not in resident]
            hits += len(need) - len(missing)
            for e in need:
                if e in resident:
                    resident[e] = nxt_of[c][e]
            for e in missing:
                misses += 1
                if len(resident) >= cap:
                    # this call's residents have been used already (hits first, each miss
                    # right after its load): their key is already their next call
                    del resident[max(resident, key=resident.get)]
                resident[e] = nxt_of[c][e]
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


def replay_all(path: str | Path, caps: list[int]) -> list[dict]:
    """Hit rates of every registered policy without pinning (engine.cache.registry.POLICY_CLASSES:
    LRU, LFRU, EMA...), our policy (the recorded engine's policy with its pinning, re-derived per
    cap) and Belady per cap."""
    from .cache.registry import POLICY_CLASSES
    head, recs = load_trace(path)
    rows = []
    for cap in caps:
        row = {"cap": cap}
        for name in POLICY_CLASSES:
            row[name] = replay_policy(head, recs, cap, name, False)["hit_rate"]
        row["ours"] = replay_policy(head, recs, cap, head.get("policy", "lru"), True)["hit_rate"]
        row["belady"] = replay_belady(head, recs, cap)["hit_rate"]
        rows.append(row)
    return rows


# --- realistic routing at full scale: a trained model's recorded routing on a bigger model ------


class RecordedRouting(Observer):
    """Replays a trained model's recorded routing (a ``logits`` trace) on a bigger model, so
    the cache, pinning and PILOT meet real locality at the bigger model's slab sizes.

    The trace's MoE calls are laid out as rows: every row of every call, in recording order
    (one row per token position of the recorded text). The big model's position p uses row
    ``p mod rows`` for its real routing (``router_logits`` of the layer being computed) and
    the same row's recorded predictor logits for PILOT's predictions (``router_logits`` of a
    later layer, called from PILOT's hooks).

    Mapping rule (deterministic, a function of the trace, the two shapes and ``seed`` only):
      - layer: big MoE layer t uses source layer s(t) = t * L_src // L_dst;
      - experts: E_dst must be a multiple r of E_src; for each big layer t a fixed permutation
        P_t of E_dst ids (``numpy.random.default_rng([seed, t]).permutation``) splits the ids
        into blocks of r: source expert e becomes big experts P_t[e*r .. e*r + r-1], each with
        source logit e's value (so top-(r*K_src) of the big logits is the r-blocks of the
        source's top-K_src, ties broken by lowest id as ``route`` does);
      - predictions: PILOT predicting big layer t at distance d (from big layer c = t - d) gets
        the source predictor of layer s(t) at distance clamp(s(t) - s(c), 1, 3), the lookahead
        the source really had between those layers (never less than one source layer:
        conservative when two big layers share a source layer). Where the source has none
        (s(t) = 0, or a prefill row) it gets the previous row's real logits of s(t): "the
        experts of the last token", information the engine had anyway.

    ``install(model)`` subscribes to the model (forward / layer starts) and shadows its
    ``router_logits`` method on that instance; ``uninstall()`` restores it. The replayed
    logits replace the model's own router output, so two runs with the same trace, start row
    and token stream route identically whatever the cache, PILOT or worker settings.

    Args:
        path: a trace recorded with logits (header ``"logits": true``).
        num_layers, num_experts: the big model's MoE layers L_dst and experts E_dst.
        seed: the permutation seed. start_row: the row of position 0.

    Raises:
        ValueError: the trace has no logits, or E_dst is not a multiple of E_src, or fewer
            MoE layers than the source; the message names the file.
    """

    def __init__(self, path: str | Path, num_layers: int, num_experts: int, seed: int = 0,
                 start_row: int = 0):
        head, recs = load_trace(path)
        if not head.get("logits"):
            raise ValueError(f"{path}: the trace has no router logits; record it with "
                             f"`colibri bench trace-heldout --logits` (or `colibri run --trace F --trace-logits`)")
        Ls, Es = int(head["num_layers"]), int(head["num_experts"])
        if num_experts % Es or num_layers < Ls:
            raise ValueError(f"{path}: a trace of {Ls} layers x {Es} experts cannot drive {num_layers} x "
                             f"{num_experts} (the expert count must be a multiple, the layers at least as many)")
        self.path, self.Ls, self.Es, self.L, self.E = Path(path), Ls, Es, int(num_layers), int(num_experts)
        self.r = num_experts // Es
        # rows: each forward's calls give T rows; row order = recording order
        by_f: dict[int, dict[int, dict]] = {}
        for rec in recs:
            if "lg" in rec:
                by_f.setdefault(rec["f"], {})[rec["l"]] = rec
        real, pred = [], []
        for f in sorted(by_f):
            calls = by_f[f]
            if len(calls) != Ls:
                continue  # an interrupted forward
            T = len(calls[0]["lg"])
            for row in range(T):
                real.append([calls[s]["lg"][row] for s in range(Ls)])
                pl = np.full((4, Ls, Es), np.nan, np.float32)
                if row == T - 1:
                    for s in range(Ls):
                        for d, v in calls[s].get("pl", {}).items():
                            pl[int(d), s] = v
                pred.append(pl)
        if not real:
            raise ValueError(f"{path}: no complete forward with logits in the trace")
        self.real = np.asarray(real, np.float32)  # [N, Ls, Es]
        self.pred = np.asarray(pred, np.float32)  # [N, 4, Ls, Es]; NaN = not recorded
        self.rows = len(self.real)
        self.start_row = int(start_row)
        self.src_layer = np.array([t * Ls // num_layers for t in range(num_layers)], np.int64)
        # dst id of (source expert e, copy j) = perm[t][e * r + j]; gather index: dst id -> e
        self.src_of = np.empty((num_layers, num_experts), np.int64)
        for t in range(num_layers):
            perm = np.random.default_rng([int(seed), t]).permutation(num_experts)
            self.src_of[t, perm] = np.arange(num_experts) // self.r
        self.model = None
        self._orig = None
        self.pos0, self.T, self.cur = 0, 0, -1
        self._chunk_pos: dict[int, int] = {}  # rows of this forward already routed, per layer
        self.fallbacks = 0  # predictions served from the previous row (no recorded predictor)

    def row(self, pos: int) -> int:
        """The trace row of big-model position ``pos``."""
        return (self.start_row + int(pos)) % self.rows

    def real_logits(self, layer: int, pos: np.ndarray) -> np.ndarray:
        """Big layer ``layer``'s router logits float32 [len(pos), E] at positions ``pos``."""
        rows = [(self.start_row + int(p)) % self.rows for p in np.atleast_1d(pos)]
        src = self.real[rows, self.src_layer[layer]]  # [n, Es]
        return np.ascontiguousarray(src[:, self.src_of[layer]])

    def pred_logits(self, layer: int, from_layer: int, pos: int) -> np.ndarray:
        """PILOT's predictor logits float32 [1, E] for big layer ``layer`` from big layer
        ``from_layer`` at position ``pos`` (the mapping rule of the class docstring)."""
        st, sc = int(self.src_layer[layer]), int(self.src_layer[max(from_layer, 0)])
        d = min(3, max(1, st - sc))
        v = self.pred[self.row(pos), d, st] if st - d >= 0 else None
        if v is None or np.isnan(v).any():
            self.fallbacks += 1
            v = self.real[self.row(pos - 1), st]
        return np.ascontiguousarray(v[self.src_of[layer]][None, :])

    # --- the model side --------------------------------------------------------------------

    def install(self, model) -> "RecordedRouting":
        """Replace ``model``'s routing by the recorded one (see the class docstring)."""
        if model.num_moe_layers != self.L or model.args.num_experts != self.E:
            raise ValueError(f"{self.path}: routing prepared for {self.L} x {self.E}, the model has "
                             f"{model.num_moe_layers} MoE layers x {model.args.num_experts} experts")
        self.model = model
        self._orig = model.router_logits
        model.router_logits = self._router_logits  # instance attribute shadows the method
        model.routing_replay = self  # the one-call decode step takes step_logits instead
        model.subscribe(self)
        return self

    def uninstall(self) -> None:
        """Give the model its own router back. Idempotent."""
        if self.model is not None:
            self.model.unsubscribe(self)
            del self.model.router_logits
            self.model.routing_replay = None
            self.model = None

    # Grouped layer starts (a decode step run in one kernel call) leave cur at the last layer:
    # a layer computed after them gets its real routing, as it should.
    token_batched = True

    def step_logits(self, pos: int) -> np.ndarray:
        """Every big MoE layer's real router logits float32 [L, E] at position ``pos``: the
        decode step's routing for the one-call path (K.decode_layers_t1), the values the
        per-layer path's ``router_logits`` calls return."""
        return np.ascontiguousarray(np.concatenate([self.real_logits(j, [pos]) for j in range(self.L)]),
                                    dtype=np.float32)

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        self.pos0, self.T, self.cur = int(pos0), int(num_tokens), -1
        self._chunk_pos = {}

    def on_layer_start(self, layer: int) -> None:
        self.cur = layer

    def _router_logits(self, j: int, h: np.ndarray) -> np.ndarray:
        n = h.shape[0]
        if j <= self.cur:  # the layer being computed: its real routing, one row per position
            # a forward's rows are pos0 .. pos0+T-1 (prefill chunks call with their own rows:
            # the chunk being computed is the last n rows seen so far at this layer)
            p0 = self._chunk_pos.get(j, self.pos0)
            self._chunk_pos[j] = p0 + n
            return self.real_logits(j, np.arange(p0, p0 + n))
        return self.pred_logits(j, self.cur, self.pos0 + self.T - 1)
