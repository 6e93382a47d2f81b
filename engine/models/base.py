"""The decoder every model family shares, ``MoEModel``, and the names the family files use
(re-exported here from models/args.py, tensors.py and ops.py, so a family file reads
``base.num``, ``base.Tensor``, ``base.run_expert``...).

``MoEModel`` composes its concerns from one module each: attention (attention.py: GQA over a
positional KV cache), the MoE block (moe_block.py: router, routed experts through the
``ExpertProvider``, shared expert, dense MLP) and the fused decode step (fused_decode.py: runs
of resident layers in one K.decode_layers_t1 call). This file keeps the model's state (weights,
KV cache, RoPE tables), speculation's rollback (rewind / verify / accept), the layer loops
(forward, prefill by layer) and the one place that chooses between the two decoders:
:meth:`MoEModel._decode_plan` (with ``_attention_t1_args`` and ``_OVERRIDABLE``), which gives the
fused step only to a model whose every step is the shared one. A family that overrides a step
in its own file keeps the per-layer forward, with the same values.

Key: T tokens in this call, D hidden, V vocab, E experts, K experts per token, I expert width,
H query heads, Hkv KV heads, S head size, C context capacity, L transformer layers,
M MoE layers (layers with routed experts; M <= L).

Layer indices. The model has L transformer layers; only M of them ("MoE layers") route to
experts. Everything about experts (the store's expert table, the cache, heat, pins, traces,
PILOT, the residency snapshot) is indexed by the MoE-layer index j in 0..M-1, where
``args.moe_layers[j]`` is the transformer layer it sits in. Dense layers (Qwen's
``mlp_only_layers`` / ``decoder_sparse_step``) have a resident MLP and no row anywhere in the
expert machinery. For OLMoE, Mixtral and the published Qwen MoE checkpoints M == L and the two
indices coincide.

Sources: transformers' models/{olmoe,qwen3_moe,mixtral,qwen2_moe}/modeling_*.py (the
arithmetic), mlx-lm's models/*.py (the one-file-per-family contract: args from config.json with
Hugging Face names, the checkpoint-name mapping, the forward).
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from ..errors import Cancelled
from ..quant import huge_empty, kind_of
from ..observers import ObserverList
from .args import (ModelArgs, check_not_gguf, common_args, expert_groups, flag, int_list, num,  # noqa: F401
                   register_family_lookup, rope_theta, rope_type, sparse_layers, yarn_params)
from .ops import (kv_zeros, linear_views, mean_router_probs, mlp_views, route, rope_tables,  # noqa: F401
                  run_expert, softmax_rows, yarn_mscale)
from .attention import Attention
from .fused_decode import FusedDecode
from .moe_block import _ARENA_DTYPES, _T1_FIELDS, MoEBlock  # noqa: F401
from .tensors import (DEEPSEEK_MTP_HEAD, EXPERT_PROJS, ExpertNames, HeadLayout, Tensor,  # noqa: F401
                      attention_tensors, decoder_tensors, expert_shapes, global_tensors, hf_names,
                      layers_of_type, mlp_tensors, tensor_params)

from ..kernel_choice import K

PREFILL_CHUNK = 128
# int4 attention matrices stored row-interleaved (Linear.interleave, K.linear_q4i): a decode step
# reads each group of 4 rows in one pass. Values are bit-identical; tests turn it off to compare.
INTERLEAVE_Q4 = True
# A decode step's attention block in one kernel call (K.attention_t1) where the layer is the plain
# kind it runs; the same values either way. Tests turn it off to compare.
ATTENTION_T1 = True
DECODE_T1 = True  # a decode step's layers in one K.decode_layers_t1 call where it applies (_decode_step_all)
# A prompt longer than a chunk on a cache that cannot hold every expert runs layer by layer over
# the whole prompt (attention in chunks, the experts over waves of PREFILL_WAVE tokens), so each
# expert a layer needs is read once per wave, not once per chunk; the same values either way.
# A wave's expert rows take ~3 x wave x top-k x hidden x 4 bytes while it runs (Qwen3-30B-A3B:
# ~400 MB at 2048 tokens). Tests turn it off to compare.
PREFILL_BY_LAYER = True
PREFILL_WAVE = 2048
KV_DTYPES = {"f16": np.uint16, "f32": np.float32}  # KV cache element: IEEE half bits or float32


# --- arithmetic -----------------------------------------------------------------------------


class ExpertProvider(Protocol):
    """Where expert weights come from. ``prepare`` announces the experts a layer is about to
    use (so misses can be read concurrently) and may return the order to compute them in
    (resident ones first); ``acquire`` returns the slab's views and pins it until ``release``.
    ``layer`` is the MoE-layer index j (see the module docstring).

    Optional: ``prepare_split(layer, experts) -> (hits, misses)`` (engine/expert_cache.py):
    ``prepare`` with the experts resident now apart, so a prefill chunk runs them in one call,
    taken with ``acquire_many(layer, experts) -> [views]`` and given back with
    ``release_many(layer, experts)`` (one lock round-trip each). ``take_split(layer, experts)
    -> (hits, slots, misses)`` with ``release_slots`` and ``slot_offsets``, and an ``arena``
    and ``store.layout``: a decode step's lookup and its hits taken at once, run in one kernel
    call reading the arena in place.

    Optional: ``dispatch(layer, xs, bounds, single)`` (engine/cluster.py). A provider that has
    it computes some experts elsewhere: its ``prepare`` returns only the experts to compute
    here, ``dispatch`` gets every expert's rows (``xs[lo:hi]`` for ``bounds[e] = (lo, hi)``,
    or the one row xs [1, D] when ``single``) and returns None or an object whose
    ``collect(outs, xs, scratch)`` fills rows lo:hi of outs [T*K, D] for the others."""

    def prepare(self, layer: int, experts: np.ndarray) -> list[int] | None: ...
    def acquire(self, layer: int, expert: int) -> dict: ...
    def release(self, layer: int, expert: int) -> None: ...


class Linear:
    """A resident dense matrix [O, N] in one of the kinds of engine/kernels, optional float32 bias [O].

    ``il``: the int4 rows are interleaved by groups of K.IL (:meth:`interleave`; w is then
    uint8 [O / IL, N / 64, IL * 32] and runs K.linear_q4i, bit-identical to K.linear_q4)."""

    il = False

    def __init__(self, dense: dict, name: str, kind: str, group_size: int = 32):
        self.w = dense[name + ".w"]
        self.s = dense.get(name + ".s")
        # the arrays say what they are: a store may mix kinds (int4 attention, int8 lm_head)
        self.kind = kind_of(self.w, self.s)
        self.bias = dense.get(name + ".bias")
        self.gs = group_size
        self.out_features = self.w.shape[0]

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.kind == "int8":
            K.linear_q8(x, self.w, self.s, out)
        elif self.kind == "f32":
            K.linear_f32(x, self.w, out)
        elif self.kind == "f16":
            K.linear_f16(x, self.w, K.F16_TABLE, out)
        elif self.kind == "mxfp4":
            K.linear_mxfp4(x, self.w, self.s, out)
        elif self.il:
            K.linear_q4i(x, self.w, self.s, self.gs, out)
        else:
            K.linear_q4(x, self.w, self.s, self.gs, out)
        if self.bias is not None:
            out += self.bias
        return out

    def interleave(self) -> "Linear":
        """Store int4 weights row-interleaved (K.interleave_q4) where K.q4_interleavable holds and
        INTERLEAVE_Q4 is on; a no-op otherwise. The values it computes do not change."""
        if INTERLEAVE_Q4 and self.kind == "int4" and not self.il and K.q4_interleavable(self.w, self.s, self.gs):
            w = K.interleave_q4(self.w)
            self.w = huge_empty(w.shape, w.dtype)  # streamed every token: huge pages (the loaded w's)
            self.w[...] = w
            self.il = True
        return self


class LinearGroup:
    """Resident matrices applied to the same input x [T, N] (the attention's q / k / v): one
    kernel call for all of them (K.linears_q4 / linears_q8: x quantized once, one parallel
    launch) when they are all int4 with the same scale dtype or all int8, with identical array
    types (one compiled specialization); otherwise each Linear on its own. Values are
    bit-identical either way (tests/test_kernels.py, tests/test_families.py)."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        first = parts[0]

        def sig(p):
            return (p.kind, p.il, p.gs, p.w.dtype, p.w.ndim, p.w.flags.c_contiguous, p.w.flags.writeable,
                    p.s.dtype, p.s.ndim, p.s.flags.c_contiguous, p.s.flags.writeable)
        same = (len(parts) > 1 and first.kind in ("int4", "int8")
                and all(p.kind == first.kind for p in parts) and all(sig(p) == sig(first) for p in parts))
        self.kind = first.kind if same else None
        self.il = same and first.il  # every part row-interleaved: K.linears_q4i
        self.w = tuple(p.w for p in parts)
        self.s = tuple(p.s for p in parts)
        self.gs = first.gs

    def __call__(self, x: np.ndarray, outs: tuple) -> tuple:
        """outs: float32 [T, O_m] per part, filled with x @ W_m^T (+ bias); returns outs."""
        if self.il:
            K.linears_q4i(x, self.w, self.s, self.gs, outs)
        elif self.kind == "int4":
            K.linears_q4(x, self.w, self.s, self.gs, outs)
        elif self.kind == "int8":
            K.linears_q8(x, self.w, self.s, outs)
        else:
            for p, o in zip(self.parts, outs):
                p(x, o)
            return outs
        for p, o in zip(self.parts, outs):
            if p.bias is not None:
                o += p.bias
        return outs


class MoEModel(Attention, MoEBlock, FusedDecode):
    """Resident dense weights + KV cache + an ExpertProvider: the decoder every family shares
    (pre-norm blocks: x += attn(norm(x)); x += mlp(norm(x))).

    Args:
        args: a family's ModelArgs. dense: canonical dense tensors (store names, see the
            family files). dense_quant / expert_quant: weight kinds. experts: the
            ExpertProvider (indexed by MoE layer). context_length: KV capacity C in tokens.
            kv_dtype: "f16" (the cache holds K and V as IEEE half, rounded to nearest even
            from the float32 projections, clipped to +-65504; half the RAM of "f32") or "f32".
            embed_rows: the token-embedding table read from the store row by row
            (engine.expert_store.EmbeddingRows; Engine.open passes it, so the table takes no
            RAM), or None to use ``dense["embed_tokens.w"]`` / ``.s``.

    The KV cache holds C positions for every layer, also for sliding-window layers (the window
    only masks attention; it does not shrink the cache).

    Raises:
        ValueError: unknown kv_dtype.
    """

    def __init__(self, args: ModelArgs, dense: dict, dense_quant: str, expert_quant: str,
                 experts: ExpertProvider, context_length: int, group_size: int = 32,
                 kv_dtype: str = "f16", embed_rows=None):
        self.args = a = args
        self.C = context_length
        self.experts = experts
        self.expert_quant = expert_quant
        self.dense_quant = dq = dense_quant
        self.gs = group_size
        self.embed_rows = embed_rows  # the table read row by row (engine.expert_store.EmbeddingRows), or None
        self.embed_w = embed_rows.w if embed_rows is not None else dense["embed_tokens.w"]
        self.embed_s = embed_rows.s if embed_rows is not None else dense.get("embed_tokens.s")
        self.embed_kind = kind_of(self.embed_w, self.embed_s)
        self.lm_head = Linear(dense, "lm_head", dq, group_size)
        self.norm = dense["norm"]
        self.moe_index = a.moe_index
        self.num_moe_layers = a.num_moe_layers - a.mtp_layers  # the MTP layers' rows follow (engine/mtp.py)
        self.windows = a.layer_windows or (0,) * a.num_hidden_layers
        self.layers = []
        for i in range(a.num_hidden_layers):
            p = f"layers.{i}."
            ly = {"input_layernorm": dense[p + "input_layernorm"],
                  "post_attention_layernorm": dense[p + "post_attention_layernorm"]}
            ly.update(self.attention_weights(dense, p))
            if self.moe_index[i] >= 0:
                ly["router"] = dense[p + "router"]
                ly["router_bias"] = dense.get(p + "router_bias")
                if a.shared_expert_intermediate_size:
                    ly["shared_expert"] = mlp_views(dense, p + "shared_expert.")
                    ly["shared_expert_gate"] = dense.get(p + "shared_expert_gate")
            else:
                ly["mlp"] = mlp_views(dense, p + "mlp.")
            self.layers.append(ly)
        self.moe_layer_ids = list(a.moe_layers)[:self.num_moe_layers]
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self.kv_dtype = kv_dtype
        self.alloc_kv()
        self._offs_memo: dict[tuple[int, int], tuple] = {}  # _arena_offsets
        self._sorted_memo: bool | None = None  # _sorted_ok
        self._t1_memo: tuple | None = None  # _t1_plan
        self._il_memo: bool | None = None  # _slabs_interleaved
        self._att1_memo: dict[int, tuple | None] = {}  # _attention_t1_args
        self._dec_memo: tuple | None = None  # _decode_plan
        self.routing_replay = None  # a replayed routing's step_logits for the one-call step (engine/trace.py)
        self.run_lookahead = None  # PILOT's predictions inside one-call runs (engine.prefetch.Pilot.run_plan)
        self._no_look = np.zeros(a.num_hidden_layers, np.bool_)  # the kernel's look_want without PILOT
        self._decode_ready = threading.Event()  # K.decode_layers_t1 compiled for this model (start_decode_warm)
        self.one_call_steps = 0  # decode steps run by _decode_step_all (the rest ran layer by layer)
        # (pos0, ids, x, kept) after each forward's chunk: its final residual rows x float32 [T, D]
        # (the MTP drafter's input, engine/mtp.py); kept: the fed tokens that are final (a verify's
        # first only)
        self.hidden_sink = None
        # Observers (engine/observers.py): forward start, and per MoE layer (MoE-layer indices)
        # layer start, post-attention residual, routing, post-MoE residual. Dense layers
        # publish nothing.
        self.observers = ObserverList()

    def attention_weights(self, dense: dict, p: str) -> dict:
        """Layer ``p``'s attention weights (GQA: q/k/v/o Linear, optional q/k norms); a family
        with another attention (MLA) overrides this, :meth:`alloc_kv` and :meth:`attention`."""
        ly = {"q_norm": dense.get(p + "q_norm"), "k_norm": dense.get(p + "k_norm")}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ly[n] = Linear(dense, p + n, self.dense_quant, self.gs).interleave()
        ly["qkv"] = LinearGroup([ly["q_proj"], ly["k_proj"], ly["v_proj"]])
        return ly

    def alloc_kv(self) -> None:
        """The KV cache k_cache, v_cache [L, Hkv, C, S] (KV_DTYPES[kv_dtype]; :func:`kv_zeros`:
        its memory grows with the positions written) and the RoPE tables."""
        a = self.args
        L, Hkv, S = a.num_hidden_layers, a.num_key_value_heads, a.head_dim
        self.k_cache = kv_zeros((L, Hkv, self.C, S), KV_DTYPES[self.kv_dtype])  # [L, Hkv, C, S]
        self.v_cache = kv_zeros((L, Hkv, self.C, S), KV_DTYPES[self.kv_dtype])
        self.rotary_dim = a.rotary_dim or S
        self.cos, self.sin = rope_tables(self.rotary_dim, a.rope_theta, self.C, a.rope_scaling)  # [C, R/2]
        self.scale = np.float32(S ** -0.5)

    def rewind(self, p: int) -> int:
        """Prepare to continue at a position s <= p whose cached state is valid, given that the
        KV rows of positions < p are; returns s (here p: the KV cache is positional). A family
        with recurrent state (Qwen3-Next) returns an earlier position it holds the state of."""
        return p

    def verify(self, ids: np.ndarray, pos0: int, cancel: threading.Event | None = None) -> np.ndarray:
        """A speculative draft's check (engine/speculative.py): logits float32 [T, V] of tokens
        ``ids`` (int [T]) at positions pos0..pos0+T-1, row t bit-identical to the logits a
        one-token forward at pos0 + t would give after the rows before it (the T > 1 kernels
        compute every row as the one-token ones do). Call :meth:`accept` next. Raises as
        :meth:`forward`."""
        return self.forward(ids, pos0, all_logits=True, cancel=cancel)

    def accept(self, n: int) -> None:
        """Keep the first ``n`` (1..T) positions of the last :meth:`verify`. The KV cache is
        positional: the rows past them are never read (attention reads only positions before
        its own) and the next forward overwrites them. A family with recurrent state rolls it
        back to pos0 + n (qwen3_next.py)."""

    def subscribe(self, observer) -> None:
        """Publish this model's forward, layer and routing events to ``observer`` (any object
        with some of the hooks of ``engine.observers.Observer``), after earlier subscribers."""
        self.observers.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        """Stop publishing to ``observer`` (no-op if it is not subscribed)."""
        self.observers.unsubscribe(observer)

    @property
    def kv_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    # --- blocks -----------------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Rows float32 [T, D] of tokens ``ids`` (int [T]) of the embedding table, held in RAM
        or read row by row from the store (``embed_rows``: the same values)."""
        D = self.args.hidden_size
        x = np.empty((len(ids), D), dtype=np.float32)  # [T, D]
        w, s = self.embed_w, self.embed_s
        if self.embed_rows is not None:
            ids, w, s = self.embed_rows.rows(ids)
        if self.embed_kind == "int8":
            K.embed_q8(ids, w, s, x)
        elif self.embed_kind == "int4":
            K.embed_q4(ids, w, s, self.gs, x)
        elif self.embed_kind == "f16":
            x[:] = K.F16_TABLE[w[ids]]
        else:
            x[:] = w[ids]
        return x

    # --- which decoder runs: the fused path's guard ----------------------------------------------
    # The per-layer forward (attention.py, moe_block.py, the loops below) is the reference; the
    # fused kernels (K.attention_t1, K.decode_layers_t1) compute the same values for the plain
    # layer. A model takes them only when nothing here says otherwise: a family that overrides a
    # step in _OVERRIDABLE, or whose arrays are not the kinds the kernels read, keeps the
    # per-layer path. Tests turn the fused path off (ATTENTION_T1, DECODE_T1) to compare.

    _OVERRIDABLE = ("forward", "attention", "mlp", "moe", "route", "router_logits", "moe_norm", "_moe_t1",
                    "expert_forward", "qk_norm", "_attend", "_kv_append", "_kv_write", "embed")

    def _attention_t1_args(self, i: int) -> tuple | None:
        """The fixed arguments of K.attention_t1 for transformer layer i, or None when the layer
        is not the plain kind it runs: q / k / v / o all int4 row-interleaved or all int8, no biases, no
        q / k clipping, RoPE on every head dimension, no sliding window or sinks, a KV cache of
        this class's kinds, and a family that does not override the attention's steps.
        Memoised per layer."""
        memo = self._att1_memo
        if i in memo:
            return memo[i]
        a, ly = self.args, self.layers[i]
        qkv, o = ly.get("qkv"), ly.get("o_proj")
        cls = type(self)
        ok = (ATTENTION_T1 and hasattr(K, "attention_t1") and isinstance(qkv, LinearGroup)
              and len(qkv.parts) == 3 and isinstance(o, Linear)
              and ((qkv.il and o.il and o.gs == qkv.gs) or (qkv.kind == "int8" and o.kind == "int8"))
              and all(p.bias is None for p in qkv.parts) and o.bias is None
              and a.clip_qkv is None and self.rotary_dim == a.head_dim and not self.windows[i]
              and ly.get("sinks") is None and a.qk_norm in ("none", "proj", "head")
              and all(getattr(cls, f) is getattr(MoEModel, f)
                      for f in ("attention", "qk_norm", "_attend", "_kv_append", "_kv_write")))
        args = None
        if ok:
            qkn = {"none": 0, "proj": 1, "head": 2}[a.qk_norm]
            none = np.zeros(1, np.float32)
            args = (ly["input_layernorm"], a.rms_norm_eps, qkv.w, qkv.s, qkv.gs, qkn,
                    ly["q_norm"] if qkn else none, ly["k_norm"] if qkn else none, o.w, o.s)
        memo[i] = args
        return args

    def _decode_plan(self) -> tuple | None:
        """The fixed arguments of K.decode_layers_t1, or None when this model's decode steps
        cannot run in it: every layer a MoE layer whose attention runs in K.attention_t1
        (:meth:`_attention_t1_args`) with the same group size, q / k norm kind and array types,
        plain softmax top-k routing (no scaling, no bias, no shared expert), int4 or int8
        experts read in place from the cache arena (:meth:`_t1_plan`), and a family that
        overrides none of the steps. Memoised."""
        memo = self._dec_memo
        if memo is not None:
            return memo[0]
        plan = None
        a, cls = self.args, type(self)
        L = a.num_hidden_layers
        if (DECODE_T1 and hasattr(K, "decode_layers_t1") and L > 0
                and tuple(self.moe_index) == tuple(range(L)) and a.scoring_func == "softmax"
                and a.topk_method == "greedy" and a.routed_scaling_factor == 1.0
                and not a.shared_expert_intermediate_size and self.expert_quant in ("int4", "int8")
                and all(getattr(cls, f) is getattr(MoEModel, f) for f in self._OVERRIDABLE)
                and hasattr(self.experts, "take_resident_layers") and self._t1_plan() is not None):
            att = [self._attention_t1_args(i) for i in range(L)]
            lys = self.layers
            if (all(f is not None for f in att) and len({(f[4], f[5]) for f in att}) == 1
                    and all(ly.get("router_bias") is None and "shared_expert" not in ly
                            and isinstance(ly["router"], np.ndarray) and ly["router"].dtype == np.float32
                            for ly in lys)):
                from numba import typeof  # the kernel is numba's (hasattr above)

                cols = {"ln": [f[0] for f in att], "w": [tuple(f[2]) for f in att], "s": [tuple(f[3]) for f in att],
                        "qn": [f[6] for f in att], "kn": [f[7] for f in att], "ow": [f[8] for f in att],
                        "os": [f[9] for f in att], "post": [ly["post_attention_layernorm"] for ly in lys],
                        "router": [ly["router"] for ly in lys]}
                if all(len({typeof(v) for v in col}) == 1 for col in cols.values()):
                    lists = {k: K.typed_list(col) for k, col in cols.items()}
                    plan = (lists, att[0][4], att[0][5], self._t1_plan(), self.expert_quant == "int4",
                            self._slabs_interleaved())
        self._dec_memo = (plan,)
        return plan

    # --- forward ----------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool = False,
                cancel: threading.Event | None = None) -> np.ndarray:
        """Run tokens ``ids`` (int [T]) at positions pos0..pos0+T-1, writing the KV cache.

        Returns float32 logits [T, V] if all_logits else [1, V] (last position).
        Raises:
            Cancelled: ``cancel`` was set (polled between chunks and layers).
            ValueError: the positions are negative or exceed the context capacity.
        """
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if pos0 < 0:  # numpy's slices would wrap (the KV row of a negative position is the cache's end)
            raise ValueError(f"position {pos0} is negative: positions start at 0")
        if pos0 + T > self.C:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.C} tokens")
        obs = self.observers
        obs.publish("on_forward_start", pos0, T)
        sink = self.hidden_sink
        if T > PREFILL_CHUNK and PREFILL_BY_LAYER and self._streams():
            x = self._prefill_by_layer(ids, pos0, cancel)
            if sink is not None:
                sink(pos0, ids, x, 1 if all_logits else T)
            return self.logits(x if all_logits else x[-1:])
        outs = []
        for c0 in range(0, T, PREFILL_CHUNK):
            chunk = ids[c0:c0 + PREFILL_CHUNK]
            x = self.embed(chunk)  # [t, D]
            if not (T == 1 and self._decode_step_all(x, pos0, cancel)):  # else every layer ran
                self._run_layers(x, pos0 + c0, 0, cancel)
            if sink is not None:
                sink(pos0 + c0, chunk, x, 1 if all_logits else len(chunk))
            if all_logits:
                outs.append(self.logits(x))
            elif c0 + PREFILL_CHUNK >= T:
                outs.append(self.logits(x[-1:]))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def forward_scratch_bytes(self, T: int) -> int:
        """Bytes a :meth:`forward` of ``T`` tokens allocates for its activations at its peak
        (an estimate from the shapes, float32): the residual of the rows it holds at once, one
        attention chunk's projections, and the feed-forward of the rows it routes together (the
        router's rows, the expert inputs and outputs of every (row, rank) gathered, ordered and
        scattered back, a shared expert's rows). The KV cache's growth is not in it
        (Engine._kv_room). The layer-by-layer prefill holds every row and routes PREFILL_WAVE
        at once: 0.5 GB for 2,048 tokens of Qwen3-30B-A3B, more than the runtime reserve of the
        plan, which inside an 8 GB memory limit was killed by the kernel."""
        a = self.args
        by_layer = T > PREFILL_CHUNK and PREFILL_BY_LAYER and self._streams()
        rows = T if by_layer else min(T, PREFILL_CHUNK)  # residual rows held at once
        wave = min(T, PREFILL_WAVE) if by_layer else min(T, PREFILL_CHUNK)  # rows routed together
        chunk = min(T, PREFILL_CHUNK)
        D, K, E = a.hidden_size, a.num_experts_per_tok, a.num_experts
        hs, kvs = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        dense = a.intermediate_size if self.num_moe_layers < a.num_hidden_layers else 0  # dense MLP layers
        I = max(a.moe_intermediate_size, a.shared_expert_intermediate_size, dense)
        floats = (2 * rows * D                                 # the residual and its embedding
                  + chunk * (3 * hs + 2 * kvs + 2 * D)         # q, attention out, k, v, o_proj, norm
                  + wave * (3 * D + 2 * E + 3 * I)             # normed rows, router, scratch, sum
                  + 3 * wave * K * D)                          # gathered inputs, outputs, scattered
        return 4 * floats

    def _streams(self) -> bool:
        """Whether the expert provider holds fewer slots than the model has experts
        (ExpertCache.slots): a prompt's chunks may then read again an expert an earlier chunk
        read. False for a family with its own layer loop (the layer-by-layer prefill is the
        shared loop's)."""
        slots = getattr(self.experts, "slots", None)
        return (isinstance(slots, int) and slots < self.num_moe_layers * self.args.num_experts
                and getattr(type(self), "_run_layers") is getattr(MoEModel, "_run_layers"))  # Gemma 4's own loop is kept

    def _prefill_by_layer(self, ids: np.ndarray, pos0: int, cancel: threading.Event | None) -> np.ndarray:
        """Every layer over the whole prompt ``ids`` (int [T]) at pos0.., layer after layer: its
        attention chunk by chunk (PREFILL_CHUNK: the KV rows of a layer's earlier chunks are
        written first), its feed-forward over waves of PREFILL_WAVE tokens (each expert the
        wave routes to acquired once for all its rows). Every row is computed as in the chunk
        by chunk order (the kernels compute rows independently). Returns the final residual
        float32 [T, D]. Observers get each layer's hooks once, with all T rows."""
        obs = self.observers
        T = len(ids)
        x = self.embed(ids)  # [T, D]
        for i in range(self.args.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            j = self.moe_index[i]
            if j >= 0:
                obs.publish("on_layer_start", j)
            for c0 in range(0, T, PREFILL_CHUNK):
                xc = x[c0:c0 + PREFILL_CHUNK]  # a view: updated in place
                xc += self.attention(i, xc, pos0 + c0)
            if j >= 0:
                obs.publish("on_after_attention", j, x)
            for w0 in range(0, T, PREFILL_WAVE):
                xw = x[w0:w0 + PREFILL_WAVE]
                xw += self.mlp(i, xw)
            if j >= 0:
                obs.publish("on_after_moe", j, x)
        return x

    def _run_layers(self, x: np.ndarray, pos0: int, first: int, cancel: threading.Event | None) -> None:
        """Decoder layers first.. on x float32 [T, D] (rows at positions pos0..), in place, one
        by one with the observers' per-layer hooks; Cancelled when ``cancel`` is set before a
        layer."""
        obs = self.observers
        for i in range(first, self.args.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            j = self.moe_index[i]
            if j >= 0:
                obs.publish("on_layer_start", j)
            x += self.attention(i, x, pos0)
            if j >= 0:
                obs.publish("on_after_attention", j, x)
            x += self.mlp(i, x)
            if j >= 0:
                obs.publish("on_after_moe", j, x)

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = np.empty_like(x)
        K.rmsnorm(x, self.norm, self.args.rms_norm_eps, h)
        return self.lm_head(h, np.empty((x.shape[0], self.args.vocab_size), np.float32))  # [T, V]

