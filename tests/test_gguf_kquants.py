"""The integer K-quant kernels (engine.kernels.kquants): Q4_K, Q5_K and Q6_K rows against
activations quantized per block of 256 (Q8_K) compute quantize(x) @ dequant(W)^T, do not depend
on how many tokens a call holds, stay close to the float32 dequantizing kernels, and are what a
GGUF-born slab's K-quant experts run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels as K  # noqa: E402
from engine import kernels_gguf as KG  # noqa: E402
from engine.gguf_blocks import TYPE_IDS, gguf_slab_layout, row_bytes  # noqa: E402
from engine.kernels.kquants import q8k_reference  # noqa: E402
from engine.quant import slab_views  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_import import _random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not K.KQ_SIMD, reason="the K-quant integer kernels need AVX2")

KQ = ("Q4_K", "Q5_K", "Q6_K")
# Largest |integer kernel - float32 dequantizing kernel| over the largest |output|, measured on
# these random rows (N 512 to 1024, T 1 to 9): 0.0086; the Q8_K activations' rounding (relative
# 1/254 of each block's largest activation) is all of it.
F32_BOUND = 0.015


def _f32_linear(x, w, t, O):
    out = np.empty((x.shape[0], O), np.float32)
    KG.linear_gguf(x, w, t, out, K.F16_TABLE, KG.IQ4_VALUES, KG.MXFP4_VALUES)
    return out


@pytest.mark.parametrize("name", KQ)
def test_integer_rows_compute_the_quantized_activations_times_the_decoded_weights(name):
    t = TYPE_IDS[name]
    rng = np.random.default_rng(t)
    N, O = 1024, 40
    w = _random_blocks(t, O, N, rng)
    W = KG.dequantize(t, w, N).astype(np.float64)
    for T in (1, 3, 4, 9):
        x = rng.standard_normal((T, N)).astype(np.float32)
        x[:, :256] *= 20.0  # blocks of other scales
        out = np.full((T, O), np.nan, np.float32)
        assert KG.linear(x, w, t, out) is out
        want = q8k_reference(x) @ W.T
        # float32 sums of int32 block products: ~1e-7 of the largest output measured
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * np.abs(want).max())
        f32 = _f32_linear(x, w, t, O)
        assert np.abs(out - f32).max() <= F32_BOUND * np.abs(f32).max()
        assert np.abs(out - f32).max() > 0  # the integer path ran, not the float one


@pytest.mark.parametrize("name", KQ)
def test_a_token_gives_the_same_bits_whatever_the_call_holds(name):
    t = TYPE_IDS[name]
    rng = np.random.default_rng(10 + t)
    N, O, T = 512, 33, 11
    w = _random_blocks(t, O, N, rng)
    x = rng.standard_normal((T, N)).astype(np.float32)
    whole = KG.linear(x, w, t, np.empty((T, O), np.float32))
    for k in range(T):
        one = KG.linear(x[k:k + 1], w, t, np.empty((1, O), np.float32))
        assert np.array_equal(one[0], whole[k])


def test_non_finite_activations_reach_the_output():
    t = TYPE_IDS["Q4_K"]
    rng = np.random.default_rng(3)
    w = _random_blocks(t, 8, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    x[1, 300] = np.nan
    out = KG.linear(x, w, t, np.empty((2, 8), np.float32))
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"), ("Q6_K", "Q6_K", "Q6_K")])
def test_kquant_slabs_run_the_integer_expert(types):
    """A slab of Q4_K_M's (Q5_K_M's, Q6_K's) expert types: run_expert equals the SwiGLU of the
    decoded matrices on Q8_K activations (x, then the down projection's input), and stays
    within the measured bound of the float32 expert kernel."""
    from engine.models.base import run_expert
    rng = np.random.default_rng(5)
    D, I = 512, 768
    ids = {p: TYPE_IDS[n] for p, n in zip(("gate_proj", "up_proj", "down_proj"), types)}
    shapes = {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}
    lay = gguf_slab_layout(D, I, {p: row_bytes(TYPE_IDS["Q6_K"], shapes[p][1]) for p in ids})
    v = slab_views(np.zeros(lay["slot_bytes"], np.uint8), lay)
    dense = {}
    for k, p in enumerate(ids):
        v["types"][k] = ids[p]
        v[p + ".q"][:, :row_bytes(ids[p], shapes[p][1])] = _random_blocks(ids[p], shapes[p][0], shapes[p][1], rng)
        dense[p] = KG.dequantize(ids[p], v[p + ".q"], shapes[p][1]).astype(np.float64)
    for T in (1, 6):
        x = rng.standard_normal((T, D)).astype(np.float32)
        out = np.empty((T, D), np.float32)
        run_expert("gguf", v, x, np.empty((T, I), np.float32), out, 32)
        xq = q8k_reference(x)
        g, u = xq @ dense["gate_proj"].T, xq @ dense["up_proj"].T
        with np.errstate(over="ignore"):  # exp(-g) of a large negative g: inf, h = 0 as intended
            h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        want = q8k_reference(h) @ dense["down_proj"].T
        # h's float32 rounding can move an activation across a rounding boundary: 1e-4 of the
        # largest output bounds it (measured ~1e-6)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-4 * np.abs(want).max())
        f32 = np.empty((T, D), np.float32)
        KG.expert_gguf(x, v["types"], v["gate_proj.q"], v["up_proj.q"], v["down_proj.q"],
                       np.empty((T, I), np.float32), f32, K.F16_TABLE, KG.IQ4_VALUES, KG.MXFP4_VALUES)
        assert 0 < np.abs(out - f32).max() <= 2 * F32_BOUND * np.abs(f32).max()


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q8_0", "Q6_K")])
def test_a_decode_steps_experts_in_the_arena_equal_one_call_each(types):
    """kernels_gguf.run_experts_t1 (a decode step's resident experts, read in the cache's arena)
    gives each expert the bits run_expert gives it alone (the misses' path), so which experts
    were resident never changes a value; a layer with a type the integer kernels do not take
    runs expert by expert."""
    from engine.kernels_gguf import run_experts_t1, t1_fields
    from engine.models.base import run_expert
    rng = np.random.default_rng(8)
    D, I, n = 512, 256, 5
    ids = [TYPE_IDS[t] for t in types]
    lay = gguf_slab_layout(D, I, {"gate_proj": row_bytes(TYPE_IDS["Q8_0"], D), "up_proj": row_bytes(TYPE_IDS["Q8_0"], D),
                                  "down_proj": row_bytes(TYPE_IDS["Q6_K"], I)})
    slot = lay["slot_bytes"]
    arena = np.zeros(slot * (n + 2), np.uint8)
    slots = np.array([3, 0, 6, 1, 4])[:n]  # slabs anywhere in the arena, in any order
    views = []
    for s in slots:
        v = slab_views(arena[s * slot:(s + 1) * slot], lay)
        for k, (p, rows, cols) in enumerate((("gate_proj", I, D), ("up_proj", I, D), ("down_proj", D, I))):
            v["types"][k] = ids[k]
            v[p + ".q"][:, :row_bytes(ids[k], cols)] = _random_blocks(ids[k], rows, cols, rng)
        views.append(v)
    x = rng.standard_normal((1, D)).astype(np.float32)
    offs = slots[:, None].astype(np.int64) * slot + t1_fields(lay)[None, :]
    out = np.full((n, D), np.nan, np.float32)
    run_experts_t1(x, arena, offs, lay, np.empty((n, I), np.float32), out)
    for k, v in enumerate(views):
        one = np.empty((1, D), np.float32)
        run_expert("gguf", v, x, np.empty((1, I), np.float32), one, 32)
        assert np.array_equal(one[0], out[k])


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q8_0", "Q6_K")])
def test_a_prefill_chunks_experts_in_the_arena_equal_one_call_each(types):
    """kernels_gguf.run_experts_sorted (a prefill chunk's resident experts in one call, entries
    grouped by expert, slabs read in the arena) gives each expert's rows the bits run_expert
    gives them alone (the misses' path); experts with 0 to 6 entries, shares of the rows per
    thread whatever their count."""
    from engine.kernels_gguf import run_experts_sorted, t1_fields
    from engine.models.base import run_expert
    rng = np.random.default_rng(9)
    D, I, n, T = 512, 256, 4, 7
    ids = [TYPE_IDS[t] for t in types]
    lay = gguf_slab_layout(D, I, {"gate_proj": row_bytes(TYPE_IDS["Q8_0"], D), "up_proj": row_bytes(TYPE_IDS["Q8_0"], D),
                                  "down_proj": row_bytes(TYPE_IDS["Q6_K"], I)})
    slot = lay["slot_bytes"]
    arena = np.zeros(slot * 5, np.uint8)
    slots = np.array([2, 0, 4, 1])
    views = []
    for s in slots:
        v = slab_views(arena[s * slot:(s + 1) * slot], lay)
        for k, (p, rows, cols) in enumerate((("gate_proj", I, D), ("up_proj", I, D), ("down_proj", D, I))):
            v["types"][k] = ids[k]
            v[p + ".q"][:, :row_bytes(ids[k], cols)] = _random_blocks(ids[k], rows, cols, rng)
        views.append(v)
    x = rng.standard_normal((T, D)).astype(np.float32)
    counts = [5, 0, 6, 2]
    tok = np.concatenate([np.sort(rng.choice(T, c, replace=False)) for c in counts]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    offs = slots[:, None].astype(np.int64) * slot + t1_fields(lay)[None, :]
    M = len(tok)
    for nch in (1, 3):
        out = np.full((M, D), np.nan, np.float32)
        run_experts_sorted(x, tok, starts, arena, offs, lay, nch, np.empty((M, I), np.float32), out)
        for e, v in enumerate(views):
            lo, hi = starts[e], starts[e + 1]
            if hi == lo:
                continue
            want = np.empty((hi - lo, D), np.float32)
            run_expert("gguf", v, x[tok[lo:hi]], np.empty((hi - lo, I), np.float32), want, 32)
            assert np.array_equal(want, out[lo:hi])
