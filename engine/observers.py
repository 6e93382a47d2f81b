"""Observers: the one public way to watch the engine work (routing, loads, evictions, pins,
PILOT predictions) without replacing anything on the objects that do it.

Publishers (``Model`` in engine/models/base.py, ``ExpertCache``, ``prefetch.Pilot``; ``Engine``
subscribes to all three at once) keep an :class:`ObserverList` and offer
``subscribe(observer)`` / ``unsubscribe(observer)``. An observer is any object; the hooks it
defines (by name, see :class:`Observer`) are called, in subscription order, on the thread doing
the work. Subclass :class:`Observer` and override only what you need (the rest are no-ops, and
no-ops are skipped entirely, so an unused hook costs nothing).

Layers are MoE-layer indices (0..M-1, one row per layer with routed experts; dense layers
publish nothing). Arrays passed to hooks belong to the publisher: read them during the call,
copy what you keep, never write to them.

Failures: observers only watch; they never change values. An exception (``Exception``; not
``BaseException`` such as KeyboardInterrupt) raised by a hook is caught by the publisher, logged
once with the observer and hook names, the observer is unsubscribed from that publisher, and the
failure is kept in ``ObserverList.failures``; the computation goes on unchanged (same token ids),
so a broken trace recorder or benchmark spy can never corrupt or end a generation. An observer
whose output must be complete checks it: ``TraceRecorder.save`` raises when the recorder failed.

Cache hooks (``on_load``, ``on_evict``, ``on_pins``) run with the cache's lock held, on the
thread that caused them (``on_load`` on I/O threads): record and return; never call back into
the cache from them (that would deadlock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

HOOKS = ("on_forward_start", "on_layer_start", "on_run_start", "on_after_attention", "on_route", "on_moe_wait",
         "on_after_moe", "on_load", "on_evict", "on_pins", "on_prediction")


class Observer:
    """Base class of engine observers: every hook is a no-op. Shapes and units:

    Model (compute thread, in this order for each MoE layer of a forward):
        on_forward_start(pos0, num_tokens): a forward over ``num_tokens`` tokens at positions
            pos0.. starts (a prefill is one forward, however many chunks it runs in).
        on_layer_start(layer): MoE layer ``layer`` starts (per prefill chunk).
        on_run_start(layer): a one-call run of a decode step's layers from ``layer`` is about
            to start (token-batched path only, after its on_layer_start group): it holds the
            cache's lock until it stops, so no read can be reserved or published meanwhile;
            what should be read during it is reserved now (ExpertCache.speculate_now).
        on_after_attention(layer, x): x float32 [T, D], the residual after attention.
        on_route(layer, idx, router_logits): idx int64 [T, K] (top-k expert ids per row),
            router_logits float32 [T, E]; called before the layer's experts are requested.
        on_moe_wait(layer, x, wait_s): a one-row MoE call (a decode step, or a prefill's last
            chunk of one token) of an int4 / int8 store is about to wait for experts of ``layer`` that were not resident; its resident experts have
            run and x float32 [1, D] is the draft residual: the residual after attention plus
            those experts' weighted outputs (the missing ones' share left out); wait_s (float,
            seconds) the cache's estimate of the wait (ExpertCache.wait_estimate; 0 when it
            cannot tell). Called at most once per layer and token, only when something is
            missing; the disk is busy meanwhile.
        on_after_moe(layer, x): x float32 [T, D], the residual after the MoE block.
    ExpertCache (cache lock held):
        on_load(layer, expert, nbytes, seconds, speculative): an expert became resident
            (bytes read, seconds inside the read, True for a PILOT load).
        on_evict(layer, expert): a resident expert left the cache.
        on_pins(pinned): the pin set was replaced; pinned bool [M, E].
    Pilot (compute thread):
        on_prediction(layer, experts, distance): PILOT predicted ``experts`` (int64 [n], in
            rank order) for MoE layer ``layer`` from ``distance`` (1..3) layers before, or
            from the previous layer's draft residual (``on_moe_wait``): distance 0.

    ``token_batched``: set it True when the observer may get a decode step's per-layer calls
    grouped: every layer's ``on_layer_start`` before the step, every layer's ``on_route`` after
    its layers ran (each group in layer order, on the compute thread, before the step's
    logits), instead of interleaved with the layers, and ``on_after_attention`` /
    ``on_after_moe`` only for the layers a decode step runs the per-layer way (the layer that
    stops a run: an expert missing). The model then runs each run of a decode step's layers
    whose experts are resident in one kernel call (MoEModel._decode_step_all: the groups then
    cover the layers from where a run starts; a layer that waits for a miss gets its
    ``on_route`` on its own); with any subscriber of ``on_layer_start``, ``on_route``,
    ``on_after_attention`` or ``on_after_moe`` without this flag it keeps the per-layer calls.
    When a run stops at a layer with an expert not resident, the next run's ``on_layer_start``
    group repeats the layers after it; when nothing could run (the cache closed), the per-layer
    path follows and calls ``on_layer_start`` again for each layer.

    ``on_route_layers(l0, idx, router_logits)`` (optional, token-batched observers only): a
    group of one-row routings at once, layers l0..l0+n-1, idx int64 [n, K], router_logits
    float32 [n, E] (row i is layer l0 + i); it must leave the observer as n ``on_route`` calls
    in layer order would. An observer without it gets those n calls.
    """

    token_batched: bool = False

    def on_forward_start(self, pos0: int, num_tokens: int) -> None: ...

    def on_layer_start(self, layer: int) -> None: ...

    def on_run_start(self, layer: int) -> None: ...

    def on_after_attention(self, layer: int, x: np.ndarray) -> None: ...

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None: ...

    def on_moe_wait(self, layer: int, x: np.ndarray, wait_s: float) -> None: ...

    def on_after_moe(self, layer: int, x: np.ndarray) -> None: ...

    def on_load(self, layer: int, expert: int, nbytes: int, seconds: float, speculative: bool) -> None: ...

    def on_evict(self, layer: int, expert: int) -> None: ...

    def on_pins(self, pinned: np.ndarray) -> None: ...

    def on_prediction(self, layer: int, experts: np.ndarray, distance: int) -> None: ...


@dataclass(frozen=True)
class ObserverFailure:
    """An observer hook that raised: the observer (now unsubscribed), the hook's name and the
    exception."""

    observer: object
    hook: str
    error: Exception


class ObserverList:
    """The subscribers of one publisher, and the publishing.

    ``subscribe`` / ``unsubscribe`` may be called from any thread; a publish in progress sees
    the list as it was when it started (the per-hook tuples are replaced, never mutated).
    ``has(hook)`` is False when no subscriber defines ``hook`` (publishers skip building its
    arguments). ``publish(hook, *args)`` calls each subscriber's hook in subscription order;
    see the module docstring for what happens when one raises.
    """

    def __init__(self, hooks: tuple[str, ...] = HOOKS):
        self._names = hooks
        self._observers: tuple = ()
        self._hooks: dict[str, tuple] = {h: () for h in hooks}
        self._batched = True
        self._route_groups: tuple = ()
        self.failures: list[ObserverFailure] = []

    def _rebuild(self) -> None:
        hooks: dict[str, tuple] = {}
        for name in self._names:
            base = getattr(Observer, name)
            fs = []
            for o in self._observers:
                f = getattr(o, name, None)
                if not callable(f) or getattr(f, "__func__", None) is base:
                    continue  # not defined, or the base class's no-op
                fs.append((o, f))
            hooks[name] = tuple(fs)
        self._route_groups = tuple((o, f, getattr(o, "on_route_layers", None)) for o, f in hooks.get("on_route", ()))
        self._batched = all(getattr(o, "token_batched", False) is True
                            for h in ("on_layer_start", "on_route", "on_after_attention", "on_after_moe")
                            for o, _f in hooks.get(h, ()))
        self._hooks = hooks

    def subscribe(self, observer: object) -> None:
        """Add ``observer`` (after the current ones). Subscribing it twice is a no-op.

        Raises:
            TypeError: ``observer`` defines none of the hooks (a typo such as ``on_routes``).
        """
        if any(o is observer for o in self._observers):
            return
        if not any(callable(getattr(observer, h, None)) for h in self._names):
            raise TypeError(f"{type(observer).__name__} defines none of the observer hooks "
                            f"({', '.join(self._names)})")
        self._observers = self._observers + (observer,)
        self._rebuild()

    def unsubscribe(self, observer: object) -> None:
        """Remove ``observer``; a no-op if it is not subscribed."""
        self._observers = tuple(o for o in self._observers if o is not observer)
        self._rebuild()

    def __contains__(self, observer: object) -> bool:
        return any(o is observer for o in self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def has(self, hook: str) -> bool:
        return bool(self._hooks[hook])

    def token_batched(self) -> bool:
        """True when every subscriber of a decode step's per-layer hooks (``on_layer_start``,
        ``on_route``, ``on_after_attention``, ``on_after_moe``) may get them grouped
        (``Observer.token_batched``)."""
        return self._batched

    def publish(self, hook: str, *args) -> None:
        for obs, f in self._hooks[hook]:
            try:
                f(*args)
            except Exception as e:  # noqa: BLE001 - observers never break the computation
                self._fail(obs, hook, e)

    def publish_route_layers(self, l0: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        """``on_route`` of layers l0..l0+n-1, one row each (idx int64 [n, K], router_logits
        float32 [n, E]): one ``on_route_layers`` call to a subscriber that defines it, else n
        ``on_route`` calls in layer order (a decode step's grouped routing, Observer.token_batched)."""
        for obs, f, group in self._route_groups:
            try:
                if group is not None:
                    group(l0, idx, router_logits)
                else:
                    for i in range(idx.shape[0]):
                        f(l0 + i, idx[i:i + 1], router_logits[i:i + 1])
            except Exception as e:  # noqa: BLE001 - observers never break the computation
                self._fail(obs, "on_route", e)

    def _fail(self, obs: object, hook: str, e: Exception) -> None:
        self.failures.append(ObserverFailure(obs, hook, e))
        log.error("observer %s failed in %s and was unsubscribed: %s: %s",
                  type(obs).__name__, hook, type(e).__name__, e)
        self.unsubscribe(obs)
