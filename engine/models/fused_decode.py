"""The fused decode step: a decode step's runs of layers whose experts are resident, each in one
K.decode_layers_t1 call, with the observers' hooks and the cache's bookkeeping as the per-layer
path gives them. Whether a model may take it is decided in one place,
``MoEModel._decode_plan`` (engine/models/base.py: the fused path's guard); this module runs it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ..errors import Cancelled
from ..kernel_choice import K
from ..ram_budget import release_compiler_memory

log = logging.getLogger(__name__)


class FusedDecode:
    """Mixin of MoEModel: the one-call decode step over the plan of ``_decode_plan``; reads
    ``args``, ``experts`` (an ExpertCache: ``take_resident_layers``, arena, bookkeeping arrays),
    the KV cache, ``cos`` / ``sin``, ``observers``, ``routing_replay`` and ``run_lookahead``."""

    def _decode_call(self, plan: tuple, x: np.ndarray, pos: int, kc: np.ndarray, vc: np.ndarray, outs: tuple,
                     l0: int = 0, forced: np.ndarray | None = None, look: tuple | None = None):
        """The function that runs K.decode_layers_t1 from layer ``l0`` on ``x`` at ``pos`` with KV
        caches kc, vc and output arrays ``outs`` (idx, w, logits, ss, pm, nspec, look_logits,
        upto: :meth:`_decode_outs`) once given the cache's arrays
        (ExpertCache.take_resident_layers' ``run``, which gets the clock, the taken experts and
        ``upto``); ``forced`` float32 [L, E]: the router logits to use instead of the routers' (a
        replayed routing); ``look`` (want bool [L], forced predictor logits float32 [L, E] or
        None): PILOT's predictions inside the run (Pilot.run_plan; the kernel's ``look``)."""
        lists, gs, qkn, fields, q4, il = plan
        a, cache = self.args, self.experts
        idx, w, logits, ss, pm, nspec, look_logits, upto = outs
        want, look_forced = look if look is not None else (self._no_look, None)

        def run(where, state, busy, last_use, routed_now, pinned, spec, resident, clock):
            c = K.decode_layers_t1(
                x, pos, self.cos[pos:pos + 1], self.sin[pos:pos + 1], kc, vc, self.scale,
                a.rms_norm_eps, lists["ln"], lists["w"], lists["s"], gs, qkn, lists["qn"], lists["kn"], lists["ow"],
                lists["os"], lists["post"], lists["router"], a.num_experts_per_tok, bool(a.norm_topk_prob), where,
                state, busy, last_use, routed_now, pinned, spec, resident, clock, cache.arena, cache.max_cap,
                cache.slot_bytes, fields, a.moe_intermediate_size, self.gs, q4, il, idx, w, logits, ss, pm, nspec,
                l0, forced if forced is not None else logits, forced is not None,
                look is not None, want, look_forced if look_forced is not None else logits, look_forced is not None,
                look_logits, upto)
            return c, np.sort(idx, axis=1), ss, pm, nspec, int(upto[0])
        return run

    def _decode_outs(self) -> tuple:
        a = self.args
        L, k, E = a.num_hidden_layers, a.num_experts_per_tok, a.num_experts
        return (np.empty((L, k), np.int64), np.empty((L, k), np.float32), np.empty((L, E), np.float32),
                np.empty((L, k), np.int64), np.empty((L, k), np.bool_), np.zeros(L, np.int64),
                np.zeros((L, E), np.float32), np.zeros(1, np.int64))

    def warm_decode_step(self) -> bool:
        """Compile (or load from numba's cache) K.decode_layers_t1 for this model's argument
        types now, so the first all-resident decode step does not compile it while it holds the
        cache's lock (a fresh install: ~1 min). Runs it once on scratch state: every expert of
        every layer mapped to slot 0 of a copy of the cache's bookkeeping arrays, a one-position
        copy of the KV cache, a zero input; the cache, the KV cache and the model are untouched
        (the arena is only read). Returns whether the model has the one-call decode step."""
        plan = self._decode_plan()
        cache = self.experts
        if plan is None:
            return False
        a = self.args
        L, Hkv, S = self.k_cache.shape[0], self.k_cache.shape[1], self.k_cache.shape[3]
        kc = np.zeros((L, Hkv, 1, S), self.k_cache.dtype)
        vc = np.zeros((L, Hkv, 1, S), self.v_cache.dtype)
        x = np.zeros((1, a.hidden_size), np.float32)
        run = self._decode_call(plan, x, 0, kc, vc, self._decode_outs())
        resident = cache.RESIDENT_STATE
        run(np.zeros_like(cache.where), np.full_like(cache.slot_state, resident), np.zeros_like(cache.slot_busy),
            np.zeros_like(cache.last_use), np.zeros_like(cache.routed_now), np.zeros_like(cache.pinned),
            np.zeros_like(cache.slot_spec), resident, 0)
        return True

    def start_decode_warm(self) -> None:
        """Compile K.decode_layers_t1 for this model in a background thread (:meth:`warm_decode_step`;
        numba's cache makes it ~a token's compute after the first time); decode steps use the one
        call only once it is done (the values are the same either way). On a fresh install the
        compile takes ~1 min of one core: done before "ready" it kept the app from opening for
        as long, done at the first all-resident step it ran inside the cache's lock."""
        if self._decode_plan() is None:
            return

        def warm():
            try:
                self.warm_decode_step()
                self._decode_ready.set()
                release_compiler_memory()  # LLVM's pages: loading this kernel was their last use
            except Exception as e:  # noqa: BLE001 - the per-layer path stays: the same values, slower
                log.warning("the one-call decode step could not be prepared (%s: %s); decoding layer by layer",
                            type(e).__name__, e)
        threading.Thread(target=warm, name="colibri-warm-decode", daemon=True).start()

    def wait_decode_ready(self, timeout: float | None = None) -> bool:
        """Block until the one-call decode step is compiled (True) or ``timeout`` seconds pass;
        False at once for a model without it (:meth:`_decode_plan`)."""
        if self._decode_plan() is None:
            return False
        return self._decode_ready.wait(timeout)

    def _decode_step_all(self, x: np.ndarray, pos: int, cancel: threading.Event | None = None) -> bool:
        """Every layer of a decode step (x float32 [1, D], updated in place), its runs of
        layers whose experts are resident each in one K.decode_layers_t1 call, when
        :meth:`_decode_plan` allows it, no method of this object was replaced (but
        ``forward`` by a wrapper, which reaches this step only through the class's forward, and
        ``router_logits`` by a replayed routing that also offers ``routing_replay.step_logits(pos)``:
        engine.trace.RecordedRouting, whose logits the kernel then takes) and every per-layer
        observer is token-batched (Observer.token_batched). From layer l0 (0 first): token-batched
        observers get ``on_layer_start`` of layers l0.. (the RSS guard polls there, before any
        take) and ``on_run_start(l0)`` (PILOT reserves the reads it wants during the run), the
        kernel runs layers until one has an expert that is not resident
        (ExpertCache.take_resident_layers, the cache's lock held), then ``on_route`` of the
        layers it ran, before the cache's bookkeeping of their takes (a layer's LFRU placement
        reads that layer's routing heat, as in the per-layer path). The layer that stopped it
        (its attention already run) gets ``on_after_attention``, takes its experts the
        per-layer way (:meth:`mlp`: misses read, waited for) and gets ``on_after_moe``; the
        next run starts after it. With PILOT (``run_lookahead``: Pilot.run_plan) the kernel
        also predicts each next layer and may stop after a layer whose next one's prediction
        holds an expert not in the cache (``upto``): PILOT queues it (Pilot.on_run_prediction)
        and the next run starts at that layer. With every expert resident that is
        one call per step; streaming, one call per run of resident layers instead of ~10
        kernel launches per layer from Python. The values are bit-identical to the per-layer
        path, and the cache's state ends as it leaves it (tests/test_families.py). Returns False,
        having computed nothing, when it does not apply (the per-layer path then publishes
        on_layer_start again: a second poll finds nothing new). Raises Cancelled when
        ``cancel`` is set before a layer that waits for its experts (as the per-layer path
        polls between layers)."""
        plan = self._decode_plan()
        cache = self.experts
        replay = self.routing_replay
        # (an instance's own ``forward``, a wrapper such as bench.arm's logits hash, runs this
        # step only through the class's forward: it does not change what the step computes)
        replaced = [f for f in self._OVERRIDABLE if f in self.__dict__ and f != "forward"]
        if (plan is None or not self._decode_ready.is_set() or not self.observers.token_batched()
                or (replaced and not (replay is not None and replaced == ["router_logits"]))):
            return False
        obs = self.observers
        L = self.args.num_hidden_layers
        forced = replay.step_logits(pos) if replay is not None else None
        l0 = 0
        while l0 < L:
            for j in range(l0, L):
                obs.publish("on_layer_start", j)
            obs.publish("on_run_start", l0)
            outs = self._decode_outs()
            idx, logits = outs[0], outs[2]
            lookahead = self.run_lookahead
            look = lookahead.run_plan(l0) if lookahead is not None else None

            def after_step(stop, l0=l0, idx=idx, logits=logits):  # the hooks before each layer's take
                if stop > l0:
                    obs.publish_route_layers(l0, idx[l0:stop], logits[l0:stop])
            stop = cache.take_resident_layers(
                self._decode_call(plan, x, pos, self.k_cache, self.v_cache, outs, l0, forced, look), l0, after_step)
            if stop < 0:  # nothing ran (the cache was closed)
                if l0 == 0:
                    return False
                self._run_layers(x, pos, l0, cancel)  # the rest layer by layer: a closed cache's errors there
                return True
            if l0 == 0:
                self.one_call_steps += 1
            if stop < L and outs[7][0] == stop:  # stopped for PILOT: layers up to stop - 1 ran in full
                lookahead.on_run_prediction(stop, outs[6][stop])
                l0 = stop
                continue
            if stop < L:  # its attention ran in the kernel: its experts the per-layer way
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled")
                obs.publish("on_after_attention", stop, x)
                x += self.mlp(stop, x)
                obs.publish("on_after_moe", stop, x)
            l0 = stop + 1
        return True
