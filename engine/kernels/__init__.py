"""Numba kernels: the engine's whole arithmetic. The only package that imports numba.

Key: T tokens (rows), N input width, O output rows, D hidden, I expert width, H query heads,
Hkv key/value heads, S head size, C context capacity, E experts, G = N // group_size.

Every kernel is ``nogil=True`` so expert-loader threads run while it computes, writes into a
preallocated ``out``, and has a same-signature numpy twin in engine/kernels_ref.py (the test
oracle and the fallback when numba is missing; tests/test_kernels.py compares every pair),
except the kernels of interleaved int4 weights (linear_q4i, linears_q4i, expert_q4i), which the
fallback never calls (it runs interleaved store slabs de-interleaved) and which tests compare
bit for bit with the row-major kernels instead. Each output element is one dot product computed
by the same inlined code whatever T is, so results do not depend on T, on thread count, or on
where an expert's bytes came from.

Weight kinds: f32 (w float32 [O, N]), f16 (w uint16 IEEE-half bits [O, N], decoded through a
65536-entry table), q8 (w int8 [O, N], s float32 [O]), q4 (w uint8 [O, N // 2], two values
per byte, low nibble = even column, value = nibble - 8; s [O, G] uint16 half bits, or float32
in stores before format 3; or w interleaved by 4 rows, uint8 [O / 4, N / 64, 128]:
engine.quant.interleave_q4), mxfp4 (w uint8 [O, N // 2] e2m1 codes, low nibble = even column;
s uint8 [O, N // 32] e8m0 exponents).

The modules, by concern: ``setup`` (numba's cache folder, threading layer, OpenMP: imported
first, before numba loads), ``tiles`` (dot products, the integer intrinsics, activation
quantization, register tiles, exp), ``linears``, ``experts``, ``routing``, ``attention``,
``decode_step`` (the fused decode step), ``recurrent`` (the gated delta rule), ``kquants``
(integer dot products on GGUF's K-quant blocks),
``cache_take`` (the expert cache's bookkeeping of a resident decode step) and ``lists``
(typed lists built by cached kernels). Callers use the
names re-exported here (``from engine import kernels; kernels.linear_q4``).
"""

from __future__ import annotations

# setup first: it points numba at its cache folder and threading layer before numba loads
from .setup import (CACHE_DIR, CACHE_PROBLEM, F16_TABLE, GOMP_SPINCOUNT_DEFAULT,  # noqa: F401
                    INT_FLAVOR, PARALLEL_KERNELS, SERIALIZED, SHIPPED, SHIPPED_KINDS, TARGET,
                    THREADING_LAYER, _FM,
                    _KW, _cache_dir_problem, _writable_dir, cpu_features,
                    current_threads, default_spin_env, numba_cache_dir, set_threads,
                    thread_limit)
from .setup import _serialized
from .tiles import PREFETCH_BYTES, PREFETCH_TT, QB, RB, TB, _Q4_SIMD, _exp32  # noqa: F401
from .linears import (IL, deinterleave_q4, embed_q4, embed_q8, interleave_q4,  # noqa: F401
                      linear_f16, linear_f32, linear_mxfp4, linear_q4, linear_q4i,
                      linear_q8, linears_q4, linears_q4i, linears_q8,
                      q4_interleavable, q4_interleaved_ok)
from .experts import (UB, combine_sorted, expert_f16, expert_f32, expert_q4,  # noqa: F401
                      expert_q4i, expert_q8, experts_q4_sorted, experts_q4_t1,
                      experts_q8_t1)
from .cache_take import cache_take_resident  # noqa: F401
from .routing import combine_ranked, route_softmax  # noqa: F401
from .attention import (ATT_QB, F16_MAX, attention, attention_sink, kv_put_f16,  # noqa: F401
                        rmsnorm, rope)
from .decode_step import attention_t1, decode_layers_t1  # noqa: F401
from .recurrent import DELTA_EXP_FLOOR, DELTA_TINY, gated_delta  # noqa: F401
from .kquants import KQ_SIMD, KQ_TYPES, expert_kq, experts_kq_sorted, experts_kq_t1, linear_kq  # noqa: F401
from .lists import typed_list  # noqa: F401


if SERIALIZED:  # no njit function calls these names (decode_step binds its own), so rebinding them is safe
    for _name in PARALLEL_KERNELS:
        globals()[_name] = _serialized(globals()[_name])
