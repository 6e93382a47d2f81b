"""The feed-forward half of the shared decoder layer: the router, the routed experts taken from
the ExpertProvider (the expert cache) grouped by expert, in one arena kernel call where the
experts are resident (a decode step: K.experts_q4_t1 / _q8_t1; a prefill chunk:
K.experts_q4_sorted), the shared expert and the dense MLP of dense layers. ``MoEModel``
(engine/models/base.py) composes it; a family with another expert MLP overrides
:meth:`MoEBlock.expert_forward`, another router :meth:`MoEBlock.route`.

Key: T tokens, D hidden, E experts, K experts per token, I expert width; j is a MoE-layer
index, i a transformer layer (base.py's module docstring).
"""

from __future__ import annotations

import numpy as np

from ..kernel_choice import K
from .ops import route, run_expert
from .routing import route_tokens

_T1_FIELDS = ("gate_proj.w", "gate_proj.s", "up_proj.w", "up_proj.s", "down_proj.w", "down_proj.s")
_ARENA_DTYPES = {"int4": (np.dtype(np.uint8), np.dtype(np.uint16)), "int8": (np.dtype(np.int8), np.dtype(np.float32))}


class MoEBlock:
    """Mixin of MoEModel: reads ``args``, ``layers``, ``moe_index``, ``moe_layer_ids``,
    ``experts`` (the ExpertProvider), ``expert_quant``, ``dense_quant``, ``gs``, ``observers``
    and its memo fields (set in MoEModel.__init__)."""

    def moe_norm(self, j: int) -> np.ndarray:
        """post_attention_layernorm weight float32 [D] of MoE layer j (PILOT's predictor input)."""
        return self.layers[self.moe_layer_ids[j]]["post_attention_layernorm"]

    def router_logits(self, j: int, h: np.ndarray) -> np.ndarray:
        """Router logits float32 [T, E] of MoE layer j for normed rows h [T, D]."""
        out = np.empty((h.shape[0], self.args.num_experts), np.float32)  # [T, E]
        K.linear_f32(h, self.layers[self.moe_layer_ids[j]]["router"], out)
        return out

    def dense_mlp(self, views: dict, h: np.ndarray, width: int) -> np.ndarray:
        """A resident SwiGLU MLP (dense layer or shared expert) of width ``width`` on h [T, D]."""
        out = np.empty_like(h)
        run_expert(self.dense_quant, views, h, np.empty((h.shape[0], width), np.float32), out, self.gs)
        return out

    def mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        """The feed-forward half of transformer layer i on x [T, D]: routed experts (plus the
        shared expert, if any) on MoE layers, the resident MLP on dense layers."""
        j = self.moe_index[i]
        if j >= 0:
            return self.moe(j, x)
        a = self.args
        h = np.empty_like(x)
        K.rmsnorm(x, self.layers[i]["post_attention_layernorm"], a.rms_norm_eps, h)
        return self.dense_mlp(self.layers[i]["mlp"], h, a.intermediate_size)

    def moe(self, j: int, x: np.ndarray) -> np.ndarray:
        """Routed experts of MoE layer j for the rows of x [T, D]; returns [T, D].

        Rows are grouped by expert so each routed expert is acquired once per call (never once
        per (token, rank): the prefill "reload storm"); outputs are combined in rank order.
        A shared expert (Qwen2-MoE) is resident and added as sigmoid(gate(h)) * shared(h).
        """
        a = self.args
        ly = self.layers[self.moe_layer_ids[j]]
        T, D = x.shape
        h = np.empty_like(x)
        K.rmsnorm(x, ly["post_attention_layernorm"], a.rms_norm_eps, h)
        logits = self.router_logits(j, h)  # [T, E]
        idx, w = self.route(j, logits)  # [T, K]
        self.observers.publish("on_route", j, idx, logits)
        fields = self._t1_plan() if T == 1 else None
        if fields is not None:
            moe = self._moe_t1(j, h, idx, w, fields, x)
        else:
            moe = self._moe_grouped(j, h, idx, w)
        if "shared_expert" in ly:
            s = self.dense_mlp(ly["shared_expert"], h, a.shared_expert_intermediate_size)
            if ly["shared_expert_gate"] is not None:
                g = np.empty((T, 1), np.float32)
                K.linear_f32(h, ly["shared_expert_gate"], g)
                s *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            moe += s
        return moe

    def _t1_plan(self) -> np.ndarray | None:
        """The byte offsets int64 [6] inside an expert's slab of its six weight arrays
        (_T1_FIELDS) when a decode step's resident experts can run in one K.experts_q4_t1 /
        _q8_t1 call reading the cache arena in place: int4 or int8 experts whose slab layout
        has the dtypes those kernels read, the SwiGLU expert, a provider with the arena and
        ``take_split`` (ExpertCache), and for interleaved slabs a CPU that runs the interleaved
        kernels (K.q4_interleaved_ok); else None (the grouped path). Memoised."""
        memo = self._t1_memo
        if memo is None:
            ex = self.experts
            fields = None
            layout = getattr(getattr(ex, "store", None), "layout", None)
            want = _ARENA_DTYPES.get(self.expert_quant)
            gguf = self.expert_quant == "gguf"  # kernels_gguf.run_experts_t1 on its four fields
            if ((want is not None or gguf) and layout is not None and hasattr(ex, "take_split")
                    and isinstance(getattr(ex, "arena", None), np.ndarray)
                    and type(self).expert_forward is MoEBlock.expert_forward
                    and (not self._slabs_interleaved() or K.q4_interleaved_ok(self.gs))):
                at = {name: (int(off), np.dtype(dt)) for name, off, dt, shape in layout["fields"]}
                if gguf:
                    from .. import kernels_gguf
                    fields = kernels_gguf.t1_fields(layout)
                elif all(f in at and at[f][1] == want[k % 2] for k, f in enumerate(_T1_FIELDS)):
                    fields = np.array([at[f][0] for f in _T1_FIELDS], np.int64)
            memo = self._t1_memo = (fields,)
        return memo[0]

    def _moe_t1(self, j: int, h: np.ndarray, idx: np.ndarray, w: np.ndarray, fields: np.ndarray,
                x: np.ndarray | None = None) -> np.ndarray:
        """The routed experts of a decode step (h [1, D] normed, idx/w [1, K] by rank): the
        experts resident at lookup time in one kernel call reading their slabs in the cache
        arena (K.experts_q4_t1 / _q8_t1; fields: _t1_plan's offsets inside a slab), then each
        miss as its read completes, by :func:`run_expert`. Every expert's row is bit-identical
        to :meth:`_moe_grouped`'s and the rows are combined in the same rank order, so the
        values do not depend on which experts were hits.

        With misses, before waiting for the first: ``on_moe_wait(j, x + the hits' weighted
        outputs, wait_s)`` to subscribers (x float32 [1, D], the residual the MoE block adds to;
        wait_s the cache's estimate of the seconds until the misses are in), the draft residual
        PILOT predicts the next layer from while the disk reads. It is a separate array; the
        layer's output is computed as without it."""
        D = h.shape[1]
        Kk = idx.shape[1]
        ranked = idx[0]
        order = np.argsort(ranked, kind="stable")  # rank positions of the experts, ascending ids
        cache = self.experts
        hits, slots, misses = cache.take_split(j, ranked[order])
        y = np.empty((1, Kk, D), np.float32)  # [1, K, D] by rank
        try:
            if hits:
                # rank position of each hit: the ascending ids that hit, in order
                pos = order if not misses else order[np.isin(ranked[order], hits)]
                offs = cache.slot_offsets(j, slots)[:, None] + fields[None, :]  # [n, 6]
                I = self.args.moe_intermediate_size
                scratch = np.empty((len(hits), I), np.float32)
                out = np.empty((len(hits), D), np.float32)
                if self.expert_quant == "int4":
                    K.experts_q4_t1(h, cache.arena, offs, I, self.gs, scratch, out, self._slabs_interleaved())
                elif self.expert_quant == "gguf":
                    from .. import kernels_gguf
                    kernels_gguf.run_experts_t1(h, cache.arena, offs, cache.store.layout, scratch, out)
                else:
                    K.experts_q8_t1(h, cache.arena, offs, I, scratch, out)
                y[0, pos] = out
        finally:
            cache.release_slots(j, slots)
        if misses:
            rank_of = {int(e): k for k, e in enumerate(ranked.tolist())}
            if x is not None and self.observers.has("on_moe_wait"):
                for e in misses:  # the draft: the missing experts' rows count as zero
                    y[0, rank_of[e]] = 0.0
                draft = np.empty((1, D), np.float32)
                K.combine_ranked(y, w, draft)
                draft += x
                est = getattr(cache, "wait_estimate", None)
                self.observers.publish("on_moe_wait", j, draft, est(j, misses) if est is not None else 0.0)
            scratch = np.empty((1, self.args.moe_intermediate_size), np.float32)
            for e in misses:
                views = cache.acquire(j, e)
                try:
                    k = rank_of[e]
                    self.expert_forward(views, h, scratch, y[0, k:k + 1])
                finally:
                    cache.release(j, e)
        moe = np.empty((1, D), np.float32)
        K.combine_ranked(y, w, moe)
        return moe

    def _moe_grouped(self, j: int, h: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The routed experts for rows h [T, D] (normed), idx/w [T, K] by rank: rows grouped
        by expert, each expert acquired once and run on all its rows, combined by rank."""
        a = self.args
        T, D = h.shape
        Kk = idx.shape[1]
        # Group the T*K (token, rank) entries by expert with one stable sort: entry n = t*K + k,
        # so each expert's entries come out in ascending token order, contiguous; its tokens'
        # rows are gathered once into xs and its outputs land in one slice of outs.
        flat = idx.reshape(-1)
        by_e = np.argsort(flat, kind="stable")  # [T*K]
        sorted_e = flat[by_e]
        uniq, first = np.unique(sorted_e, return_index=True)  # ascending expert ids
        bounds = dict(zip(uniq.tolist(), zip(first.tolist(), first[1:].tolist() + [len(flat)])))
        if T > 1 and self._sorted_ok():
            return self._moe_sorted(j, h, w, by_e, uniq, bounds)
        order = self.experts.prepare(j, uniq)
        xs = h if T == 1 else h[by_e // Kk]  # [T*K, D] (T = 1: each expert sees the one row)
        outs = np.empty((T * Kk, D), np.float32)  # [T*K, D] in expert-sorted order
        scratch = np.empty((T, a.moe_intermediate_size), np.float32)  # [T, I]
        # A provider that computes experts elsewhere (engine/cluster.py) sends their rows now,
        # computes nothing of them here (its prepare returned only the local ones) and fills
        # their rows of outs in collect, while the local experts run below: the same rows,
        # the same kernel, so the sum below is the same.
        dispatch = getattr(self.experts, "dispatch", None)
        call = dispatch(j, xs, bounds, T == 1) if dispatch is not None else None
        for e in (uniq.tolist() if order is None else order):  # order never changes values
            lo, hi = bounds[int(e)]
            n = hi - lo
            views = self.experts.acquire(j, int(e))
            try:
                self.expert_forward(views, xs if T == 1 else xs[lo:hi], scratch[:n], outs[lo:hi])
            finally:
                self.experts.release(j, int(e))
        if call is not None:
            call.collect(outs, xs, scratch)
        y = np.empty((T * Kk, D), np.float32)
        y[by_e] = outs
        y = y.reshape(T, Kk, D)  # [T, K, D] by rank
        moe = np.empty((T, D), np.float32)
        K.combine_ranked(y, np.ascontiguousarray(w, dtype=np.float32), moe)
        return moe

    def _sorted_ok(self) -> bool:
        """Whether a prefill chunk's resident experts can run in one K.experts_q4_sorted call:
        int4 experts with half-precision scales (store format 3) or GGUF-born ones
        (kernels_gguf.run_experts_sorted), the SwiGLU expert, a
        provider that keeps the slabs in one arena (ExpertCache) and computes nothing
        elsewhere (no cluster dispatch), and for interleaved slabs a CPU that runs the
        interleaved kernels (K.q4_interleaved_ok)."""
        ok = self._sorted_memo
        if ok is None:
            ex = self.experts
            ok = (self.expert_quant in ("int4", "gguf") and type(self).expert_forward is MoEBlock.expert_forward
                  and isinstance(getattr(ex, "arena", None), np.ndarray)
                  and hasattr(ex, "prepare_split") and hasattr(ex, "acquire_many")
                  and getattr(ex, "dispatch", None) is None and self.args.hidden_size % 2 == 0
                  and (self.expert_quant == "gguf"  # kernels_gguf.run_experts_sorted
                       or ((not self._slabs_interleaved() or K.q4_interleaved_ok(self.gs))
                           and self.args.moe_intermediate_size % self.gs == 0
                           and self.args.hidden_size % self.gs == 0)))
            self._sorted_memo = ok
        return ok

    def _slabs_interleaved(self) -> bool:
        """Whether the store's int4 expert slabs hold interleaved weights (store format 4: the
        layout's w fields are 3-D, engine.quant.interleave_q4); the arena kernels then read them
        with il=True. Memoised."""
        il = self._il_memo
        if il is None:
            layout = getattr(getattr(self.experts, "store", None), "layout", None)
            il = self._il_memo = bool(layout) and any(len(f[3]) == 3 for f in layout["fields"])
        return il

    def _arena_offsets(self, j: int, e: int, views: dict) -> np.ndarray | None:
        """Byte offsets int64 [6] in the cache arena of expert e's six weight arrays
        (_T1_FIELDS), for the kernels that read slabs in place (experts_q4_t1 / _q8_t1 /
        experts_q4_sorted), or None when a view does not have the dtype they read (int4: uint8
        nibbles and uint16 half scales; int8: int8 and float32), is not contiguous, or its
        weights' layout (3-D: interleaved) is not the store's; memoised per (layer, expert)
        while the cache hands out the same views dict (a reload makes a new one)."""
        memo = self._offs_memo.get((j, e))
        if memo is not None and memo[0] is views:
            return memo[1]
        want = _ARENA_DTYPES.get(self.expert_quant)
        base = self.experts.arena.ctypes.data
        if self.expert_quant == "gguf":  # kernels_gguf.T1_FIELDS: the slab's header and its three row fields
            from ..kernels_gguf import T1_FIELDS
            offs = np.array([views[f].ctypes.data - base for f in T1_FIELDS], np.int64)
            self._offs_memo[(j, e)] = (views, offs)
            return offs
        offs = np.empty(6, np.int64)
        for f, name in enumerate(_T1_FIELDS):
            v = views[name]
            if (want is None or v.dtype != want[f % 2] or not v.flags.c_contiguous
                    or (f % 2 == 0 and (v.ndim == 3) != self._slabs_interleaved())):
                return None
            offs[f] = v.ctypes.data - base
        self._offs_memo[(j, e)] = (views, offs)
        return offs

    def _moe_sorted(self, j: int, h: np.ndarray, w: np.ndarray, by_e: np.ndarray, uniq: np.ndarray,
                    bounds: dict) -> np.ndarray:
        """_moe_grouped's experts for a prefill chunk (h [T, D] normed, w [T, K]; by_e, uniq,
        bounds: the entries grouped by expert): the experts resident at prepare time in one
        K.experts_q4_sorted call reading their slabs in the arena, then each miss as its read
        completes (run_expert on its gathered rows); the outputs combined in rank order by
        K.combine_sorted. Every row is bit-identical to one expert_q4 call per expert, so the
        values do not depend on which experts were resident."""
        a = self.args
        T, D = h.shape
        Kk = w.shape[1]
        M = by_e.shape[0]
        tok = by_e // Kk  # [M] the row of h of each expert-ordered entry
        outs = np.empty((M, D), np.float32)  # [M, D] in expert-sorted order
        hits, misses = self.experts.prepare_split(j, uniq.tolist())
        if hits:
            views = self.experts.acquire_many(j, hits)
            try:
                offs = [self._arena_offsets(j, e, v) for e, v in zip(hits, views)]
                if any(o is None for o in offs):  # not in the arena: one expert at a time
                    run, misses = [], sorted(hits + misses)
                else:
                    run = hits
                if run:
                    spans = [bounds[e] for e in run]
                    starts = np.zeros(len(run) + 1, np.int64)
                    starts[1:] = np.cumsum([hi - lo for lo, hi in spans])
                    every = len(run) == len(uniq)  # all resident: straight into outs
                    # else the hits' entries, contiguous per expert, into a buffer of their
                    # own, then copied into their rows of outs
                    sel = None if every else np.concatenate([np.arange(lo, hi) for lo, hi in spans])
                    n = M if every else len(sel)
                    part = outs if every else np.empty((n, D), np.float32)
                    if self.expert_quant == "gguf":
                        from .. import kernels_gguf
                        kernels_gguf.run_experts_sorted(h, tok if every else tok[sel], starts, self.experts.arena,
                                                        np.stack(offs), self.experts.store.layout, K.current_threads(),
                                                        np.empty((n, a.moe_intermediate_size), np.float32), part)
                    else:
                        K.experts_q4_sorted(h, tok if every else tok[sel], starts, self.experts.arena, np.stack(offs),
                                            a.moe_intermediate_size, self.gs, K.current_threads(),
                                            np.empty((n, a.moe_intermediate_size), np.float32), part,
                                            self._slabs_interleaved())
                    if not every:
                        outs[sel] = part
            finally:
                self.experts.release_many(j, hits)
        if misses:
            scratch = np.empty((T, a.moe_intermediate_size), np.float32)  # [T, I]
            for e in misses:
                lo, hi = bounds[int(e)]
                views = self.experts.acquire(j, int(e))
                try:
                    self.expert_forward(views, h[tok[lo:hi]], scratch[:hi - lo], outs[lo:hi])
                finally:
                    self.experts.release(j, int(e))
        pos = np.empty(M, np.int64)
        pos[by_e] = np.arange(M)
        moe = np.empty((T, D), np.float32)
        K.combine_sorted(outs, pos.reshape(T, Kk), np.ascontiguousarray(w, dtype=np.float32), moe)
        return moe

    def expert_forward(self, views: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
        """One routed expert on rows x [T, D] into out [T, D] (h [T, I] scratch): SwiGLU
        (:func:`run_expert`); a family with another expert MLP (gpt-oss) overrides it, reading
        only ``args``, ``expert_quant`` and ``gs`` (engine/cluster.py runs it on workers that
        hold no dense weights: ``cluster.expert_function``)."""
        run_expert(self.expert_quant, views, x, h, out, self.gs)

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Experts and weights of MoE layer j for router logits float32 [T, E]: (idx int64
        [T, K] in rank order, w float32 [T, K]). Softmax top-K (:func:`route`) unless the
        args name another router (engine/models/routing.py: sigmoid, groups, bias)."""
        a = self.args
        if a.scoring_func == "softmax" and a.topk_method == "greedy" and a.routed_scaling_factor == 1.0:
            return route(logits, a.num_experts_per_tok, a.norm_topk_prob)
        return route_tokens(logits, a.num_experts_per_tok, norm_topk_prob=a.norm_topk_prob,
                            scoring_func=a.scoring_func, topk_method=a.topk_method, n_group=a.n_group,
                            topk_group=a.topk_group, routed_scaling_factor=a.routed_scaling_factor,
                            bias=self.layers[self.moe_layer_ids[j]]["router_bias"])
