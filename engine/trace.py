"""Routing traces (``colibri run --trace FILE``) and offline replay against Belady's bound.

Trace: JSON lines. The first line is a header {"format": "colibri-route-trace", "version": 1,
num_layers, num_experts, top_k, cap, policy, pins (initial pinned ids per layer),
heat (initial routing counts [L][E])}. Then one record per MoE call:
{"f": forward, "l": layer, "idx": [[K ids] per row], "pred": [ids predicted by PILOT],
"p": [E mean router probabilities, float32 values]} (``p`` feeds the "ema" policy on replay)
and {"pin": [[ids] per layer]} whenever the engine changes its pin set.

Replay drives the engine's own ExpertCache class (with a store that reads nothing) through
the same call sequence, so "our policy" reproduces the engine's hit/miss counts exactly
(with PILOT off; speculation timing is not replayable). Belady's optimal policy (MIN,
Belady 1966) evicts the resident expert whose next request is farthest in the future.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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

    def __init__(self, engine):
        self.engine = engine
        c = engine.cache
        self.header = {"format": TRACE_FORMAT, "version": 1, "num_layers": c.L, "num_experts": c.E,
                       "top_k": engine.args.num_experts_per_tok, "cap": c.cap, "policy": c.policy,
                       "pins": [np.nonzero(r)[0].tolist() for r in c.pinned],
                       "heat": c.heat.tolist(), "pin_per_layer": engine.config.pin_per_layer}
        self.records: list[dict] = []
        self._forward = 0  # counts prefill chunks and decode steps (layer 0 starts)
        self._pred: dict[int, set[int]] = {}  # this forward's PILOT predictions per layer
        engine.subscribe(self)

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        self._pred.clear()

    def on_layer_start(self, layer: int) -> None:
        if layer == 0:
            self._forward += 1

    def on_prediction(self, layer: int, experts: np.ndarray, distance: int) -> None:
        self._pred.setdefault(layer, set()).update(int(e) for e in experts)

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        self.records.append({"f": self._forward, "l": layer, "idx": idx.tolist(),
                             "pred": sorted(self._pred.get(layer, ())),
                             "p": mean_router_probs(router_logits).tolist()})

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


class _NullStore:
    slot_bytes = 4096

    def read(self, layer, expert, buf, verify=False):
        return 4096

    def views(self, buf):
        return {}


def _initial_pins(head: dict, cap: int) -> list[list[int]]:
    """The recorded pre-warm pins as the engine caps them at ``cap`` (``Engine._cap_pins``)."""
    L, E = head["num_layers"], head["num_experts"]
    pinned = np.zeros((L, E), bool)
    for layer, ids in enumerate(head["pins"]):
        pinned[layer, ids] = True
    n = pins_per_layer(cap, int(head.get("pin_per_layer") or 0))
    capped = cap_pins(pinned, np.asarray(head["heat"], dtype=np.int64), n)
    return [np.nonzero(r)[0].tolist() for r in capped]


def replay_policy(head: dict, records: list[dict], cap: int, policy: str, pinning: bool) -> dict:
    """Hit/miss counts of the engine's cache (same class, same call order) on a trace.

    With ``pinning``, each recorded pin event re-chooses the pins the engine would choose at
    this ``cap`` from the routing heat accumulated up to that point (at the recording cap that is
    exactly the recorded pin set), so one trace serves every cap. Initial (pre-warmed) pins
    are the header's, capped as the engine caps them at this ``cap``.
    """
    from .expert_cache import ExpertCache
    L, E = head["num_layers"], head["num_experts"]
    heat = np.asarray(head["heat"], dtype=np.int64).copy()
    cache = ExpertCache(_NullStore(), L, E, cap, policy, heat=heat, io_threads=1)
    try:
        pins0 = _initial_pins(head, cap) if pinning else []
        if any(pins0):
            p = np.zeros((L, E), bool)
            for layer, ids in enumerate(pins0):
                p[layer, ids] = True
            cache.set_pinned(p)
            for layer, ids in enumerate(pins0):
                cache.load_experts(layer, ids)
        for r in records:
            if "pin" in r:
                if pinning:
                    cache.set_pinned(choose_pins(heat, pins_per_layer(cap, int(head.get("pin_per_layer") or 0))))
                continue
            layer = r["l"]
            idx = np.asarray(r["idx"], dtype=np.int64)
            np.add.at(heat[layer], idx.reshape(-1), 1)
            if "p" in r:
                cache.observe_probs(layer, np.asarray(r["p"], np.float32))
            for e in cache.prepare(layer, np.unique(idx)):  # the engine's compute order
                cache.acquire(layer, int(e))
                cache.release(layer, int(e))
        s = cache.stats
        return {"hits": s.hits, "misses": s.misses, "pinned_hits": s.pinned_hits,
                "hit_rate": s.hits / max(s.hits + s.misses, 1)}
    finally:
        cache.close()


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
    """Hit rates of LRU, LFRU, EMA (router-probability EMA), our policy (the recorded engine's
    policy with its pinning, re-derived per cap) and Belady per cap."""
    head, recs = load_trace(path)
    rows = []
    for cap in caps:
        rows.append({
            "cap": cap,
            "lru": replay_policy(head, recs, cap, "lru", False)["hit_rate"],
            "lfru": replay_policy(head, recs, cap, "lfru", False)["hit_rate"],
            "ema": replay_policy(head, recs, cap, "ema", False)["hit_rate"],
            "ours": replay_policy(head, recs, cap, head.get("policy", "lru"), True)["hit_rate"],
            "belady": replay_belady(head, recs, cap)["hit_rate"],
        })
    return rows
