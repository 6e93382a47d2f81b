"""Every numba kernel of engine/kernels/ against its numpy twin in engine/kernels_ref.py.

Random shapes (odd sizes wherever the weight kind allows them), several T including 1, every
weight kind. Plus the invariants the engine relies on: a row's result does not depend on T
(the other rows of the call) nor on the number of threads, bit for bit; and the process-wide
setup of engine/kernels/setup.py in subprocesses.

Tolerance (why it is not a guess): both sides compute the same real-valued expression in
float32 with a different summation order. For a dot product of n terms, any order gives
|fl(sum) - sum| <= gamma_n * sum|terms| with gamma_n = n*u / (1 - n*u), u = 2^-24 (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5). Each side is within that
bound of the exact value, so the two differ by at most twice it. The bound is computed per
element from |x| @ |W|^T in float64 (n counts the extra roundings of scales and dequantization
as 4 more terms); for the expert FFN it is propagated through silu (|silu'| < 1.1) and the
down projection. A wrong nibble, scale or index moves results by O(|terms|), orders of
magnitude above the bound, so the test cannot pass on a broken kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

K = pytest.importorskip("engine.kernels")
from engine import kernels_ref as R  # noqa: E402
from engine.quant import dequantize, quantize  # noqa: E402

U = 2.0 ** -24
TS = (1, 2, 5, 17)
KINDS = ("f32", "f16", "int8", "int4")
ROOT = Path(__file__).resolve().parents[1]


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by ``key``, the same in every process: Python's str hash() is salted
    per process (PYTHONHASHSEED), so seeding from it gave each run other data, and a rare
    draw failed a tolerance check in CI that no local run could reproduce."""
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def weight(rng, O, N, kind, gs=32):
    """(kernel args for the weight, dequantized float64 [O, N])."""
    w = rng.standard_normal((O, N)).astype(np.float32) * 0.3
    p = quantize(w, kind, gs)
    deq = dequantize(p, kind, gs).astype(np.float64)
    return p, deq


def effective_x(kind, x, gs=32):
    """The activations the kernel multiplies (float64): x itself, or for int4 / int8 x quantized
    per block to int8 (kernels_ref.quantize_activations; both sides quantize identically)."""
    if kind == "int4":
        return R.quantize_activations(x, gs).astype(np.float64)
    if kind == "int8":
        return R.quantize_activations(x, R.QB).astype(np.float64)
    return x.astype(np.float64)


def linear_args(kind, p, gs):
    if kind == "f32":
        return (p["w"],)
    if kind == "f16":
        return (p["w"], K.F16_TABLE)
    if kind == "int8":
        return (p["w"], p["s"])
    return (p["w"], p["s"], gs)


def run_linear(mod, kind, x, p, gs, O):
    out = np.full((x.shape[0], O), np.nan, np.float32)
    getattr(mod, {"f32": "linear_f32", "f16": "linear_f16", "int8": "linear_q8", "int4": "linear_q4"}[kind])(
        x, *linear_args(kind, p, gs), out)
    return out


def widths(kind, gs=32):
    """Input widths N to try: odd and tiny ones where the kind allows them."""
    if kind == "int4":
        return (gs, 3 * gs, 8 * gs)
    return (1, 7, 33, 250)


@pytest.mark.parametrize("kind", KINDS)
def test_linear_matches_reference(kind):
    for N in widths(kind):
        for O in (1, 3, 65):
            rng = rng_for("linear", kind, N, O)
            p, deq = weight(rng, O, N, kind)
            for T in TS:
                x = rng.standard_normal((T, N)).astype(np.float32)
                got = run_linear(K, kind, x, p, 32, O)
                ref = run_linear(R, kind, x, p, 32, O)
                tol = 2 * gamma(N + 4) * (np.abs(effective_x(kind, x)) @ np.abs(deq).T) + 1e-30
                err = np.abs(got.astype(np.float64) - ref)
                assert np.all(err <= tol), (kind, N, O, T, float((err / tol).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_activations_stay_non_finite(kind):
    """A NaN or inf in a row reaches that row's outputs as in the float kernels (the integer
    paths quantize activations: a NaN must not vanish in the int8 cast), and other rows stay
    finite; the engine's non-finite-logits check (fault 18.3 at run time) relies on it."""
    N, O = 64, 5
    rng = rng_for("nonfinite", kind, N, O)
    p, _ = weight(rng, O, N, kind)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((3, N)).astype(np.float32)
        x[1, 17] = bad
        got = run_linear(K, kind, x, p, 32, O)
        assert not np.isfinite(got[1]).any() and np.isfinite(got[[0, 2]]).all(), (kind, bad, got)


@pytest.mark.parametrize("gs", [8, 6, 64])
def test_linear_q4_other_group_sizes(gs):
    """gs / 2 a power of two uses the single-loop path, other even sizes the per-group loop."""
    rng = rng_for("q4gs", gs)
    N, O = 4 * gs, 9
    p, deq = weight(rng, O, N, "int4", gs)
    for T in (1, 3):
        x = rng.standard_normal((T, N)).astype(np.float32)
        got = run_linear(K, "int4", x, p, gs, O)
        ref = run_linear(R, "int4", x, p, gs, O)
        tol = 2 * gamma(N + 4) * (np.abs(effective_x("int4", x, gs)) @ np.abs(deq).T)
        assert np.all(np.abs(got - ref) <= tol)


def expert_call(mod, kind, x, parts, gs, I, D):
    g, u, d = parts
    T = x.shape[0]
    h = np.full((T, I), np.nan, np.float32)
    out = np.full((T, D), np.nan, np.float32)
    if kind == "f32":
        mod.expert_f32(x, g["w"], u["w"], d["w"], h, out)
    elif kind == "f16":
        mod.expert_f16(x, g["w"], u["w"], d["w"], K.F16_TABLE, h, out)
    elif kind == "int8":
        mod.expert_q8(x, g["w"], g["s"], u["w"], u["s"], d["w"], d["s"], h, out)
    else:
        mod.expert_q4(x, g["w"], g["s"], u["w"], u["s"], d["w"], d["s"], gs, h, out)
    return h, out


def expert_shapes(kind):
    return ((64, 32), (96, 160)) if kind == "int4" else ((5, 3), (33, 17), (64, 48))


@pytest.mark.parametrize("kind", KINDS)
def test_expert_matches_reference(kind):
    for D, I in expert_shapes(kind):
        rng = rng_for("expert", kind, D, I)
        (pg, g64), (pu, u64), (pd, d64) = (weight(rng, I, D, kind), weight(rng, I, D, kind),
                                           weight(rng, D, I, kind))
        for T in TS:
            x = rng.standard_normal((T, D)).astype(np.float32)
            h1, o1 = expert_call(K, kind, x, (pg, pu, pd), 32, I, D)
            h2, o2 = expert_call(R, kind, x, (pg, pu, pd), 32, I, D)
            xe = effective_x(kind, x)
            ax = np.abs(xe)
            gv, uv = xe @ g64.T, xe @ u64.T
            eg = gamma(D + 4) * (ax @ np.abs(g64).T)
            eu = gamma(D + 4) * (ax @ np.abs(u64).T)
            silu = gv / (1 + np.exp(-gv))
            # h = silu(g) * u: |silu'| < 1.1, plus the roundings of exp, division and product
            eh = 1.1 * eg * (np.abs(uv) + eu) + np.abs(silu) * eu + gamma(6) * np.abs(silu * uv)
            assert np.all(np.abs(h1 - h2) <= 2 * eh), (kind, D, I, T, float((np.abs(h1 - h2) / eh).max()))
            # down projection checked on the kernel's own h, so that int4's re-quantization of h
            # sees identical inputs on both sides (a last-bit difference in h may flip a rint)
            he = effective_x(kind, h1)
            ref_o = he @ d64.T
            eo = gamma(I + 4) * (np.abs(he) @ np.abs(d64).T)
            assert np.all(np.abs(o1 - ref_o) <= 2 * eo), (kind, D, I, T, float((np.abs(o1 - ref_o) / eo).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_do_not_depend_on_T_or_threads(kind):
    """Row t of a T-row call equals a 1-row call on that row, bit for bit, with 1 or all threads:
    the prefill chunking, the routing of other tokens and numba_threads never change values."""
    import numba
    D, I = (64, 32) if kind == "int4" else (33, 17)
    rng = rng_for("rows", kind)
    parts = [weight(rng, I, D, kind)[0], weight(rng, I, D, kind)[0], weight(rng, D, I, kind)[0]]
    x = rng.standard_normal((9, D)).astype(np.float32)
    full_lin = run_linear(K, kind, x, parts[0], 32, I)
    full_exp = expert_call(K, kind, x, parts, 32, I, D)[1]
    n0 = numba.get_num_threads()
    try:
        for threads in sorted({1, n0}):
            numba.set_num_threads(threads)
            for t in range(x.shape[0]):
                assert np.array_equal(run_linear(K, kind, x[t:t + 1], parts[0], 32, I), full_lin[t:t + 1])
                assert np.array_equal(expert_call(K, kind, x[t:t + 1], parts, 32, I, D)[1], full_exp[t:t + 1])
    finally:
        numba.set_num_threads(n0)


def arena_of(experts, rng):
    """Expert slabs packed into one uint8 arena as the expert cache holds them: (arena, offs
    int64 [n, 6]) with the byte offsets of gate .w/.s, up .w/.s, down .w/.s of each expert
    (experts: [[gate, up, down] per expert], each a dict with "w" and "s"), 64-byte aligned, the
    arrays in a shuffled order so no kernel can assume one."""
    parts = [(e, m, key) for e in range(len(experts)) for m in range(3) for key in ("w", "s")]
    rng.shuffle(parts)
    arena = np.zeros(sum(-(-experts[e][m][k].nbytes // 64) * 64 for e, m, k in parts), np.uint8)
    offs = np.zeros((len(experts), 6), np.int64)
    at = 0
    for e, m, key in parts:
        a = np.ascontiguousarray(experts[e][m][key])
        arena[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
        offs[e, 2 * m + (key == "s")] = at
        at += -(-a.nbytes // 64) * 64
    return arena, offs


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_decode_experts_in_one_call_equal_one_call_each(kind):
    """experts_q4_t1 / experts_q8_t1 (a decode step's experts in one call, reading their slabs
    in an arena) give each expert's row bit for bit as expert_q4 / expert_q8 on that expert
    alone, with 1 or all threads, for odd group counts and widths that are not a multiple of
    the row block; and match kernels_ref. offs has more rows than n: rows past n are not read."""
    import numba
    shapes = ((96, 64, 3), (64, 32, 1), (160, 96, 4)) if kind == "int4" else ((33, 17, 3), (64, 48, 1), (70, 66, 4))
    n0 = numba.get_num_threads()
    try:
        for D, I, n in shapes:
            rng = rng_for("t1", kind, D, I, n)
            experts = [[weight(rng, I, D, kind)[0], weight(rng, I, D, kind)[0], weight(rng, D, I, kind)[0]]
                       for _ in range(n)]
            x = rng.standard_normal((1, D)).astype(np.float32)
            each = np.stack([expert_call(K, kind, x, parts, 32, I, D)[1][0] for parts in experts])
            arena, offs = arena_of(experts, rng)
            offs = np.concatenate([offs, np.full((2, 6), 1 << 40, np.int64)])  # past n: never read
            extra = (32,) if kind == "int4" else ()
            il = (False,) if kind == "int4" else ()  # passed as the engine passes it: one specialization
            name = "experts_q4_t1" if kind == "int4" else "experts_q8_t1"
            for threads in sorted({1, n0}):
                numba.set_num_threads(threads)
                out = np.full((n, D), np.nan, np.float32)
                getattr(K, name)(x, arena, offs, I, *extra, np.full((n, I), np.nan, np.float32), out, *il)
                assert np.array_equal(out, each), (kind, D, I, n, threads)
            ref = np.full((n, D), np.nan, np.float32)
            getattr(R, name)(x, arena, offs, I, *extra, np.full((n, I), np.nan, np.float32), ref)
            assert np.array_equal(ref, np.stack([expert_call(R, kind, x, parts, 32, I, D)[1][0] for parts in experts]))
            assert np.allclose(out, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
    finally:
        numba.set_num_threads(n0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_linears_in_one_call_equal_separate_calls(kind):
    """linears_q4 / linears_q8 (q / k / v in one call) give each matrix's output bit for bit as
    its own linear_q4 / linear_q8 call, at T = 1 (decode) and T = 9 (tokens past a token tile,
    prange quantization), with 1 or all threads, for row counts that are not a multiple of the
    row block; and match kernels_ref."""
    import numba
    N = 96 if kind == "int4" else 70
    rows = (64, 30, 13)
    rng = rng_for("linears", kind)
    parts = [weight(rng, O, N, kind)[0] for O in rows]
    w, s = tuple(p["w"] for p in parts), tuple(p["s"] for p in parts)
    extra = (32,) if kind == "int4" else ()
    name = "linears_q4" if kind == "int4" else "linears_q8"
    n0 = numba.get_num_threads()
    try:
        for T in (1, 9):
            x = rng.standard_normal((T, N)).astype(np.float32)
            each = [run_linear(K, kind, x, p, 32, O) for p, O in zip(parts, rows)]
            for threads in sorted({1, n0}):
                numba.set_num_threads(threads)
                outs = tuple(np.full((T, O), np.nan, np.float32) for O in rows)
                getattr(K, name)(x, w, s, *extra, outs)
                for o, e in zip(outs, each):
                    assert np.array_equal(o, e), (kind, T, threads)
            refs = tuple(np.full((T, O), np.nan, np.float32) for O in rows)
            getattr(R, name)(x, w, s, *extra, refs)
            for r, p, O in zip(refs, parts, rows):
                assert np.array_equal(r, run_linear(R, kind, x, p, 32, O))
    finally:
        numba.set_num_threads(n0)


_FLAVOR_NEEDS = {"vnni": ("avx512bw", "avx512vnni"), "bw": ("avx512bw",), "avx2": ("avx2", "fma"),
                 "portable": ()}
_OTHER_FLAVORS = sorted(set(_FLAVOR_NEEDS) - {K.INT_FLAVOR})


def _runnable(flavor: str) -> bool:
    import llvmlite.binding as llb
    feats = llb.get_host_cpu_features()
    return all(feats.get(f) for f in _FLAVOR_NEEDS[flavor])


@pytest.fixture(scope="module")
def forced_path_runs(request, tmp_path_factory):
    """One pytest subprocess per integer path that this module's selected forced-path tests
    ask for and this CPU can run, all started at once: each compiles every q4 / q8 kernel
    uncached (~5 min of one core), and compilation is single-threaded, so on 2 cores running
    them side by side takes about half the time of running them one after another."""
    wanted = sorted({item.callspec.params["flavor"] for item in request.session.items
                     if item.originalname == "test_other_integer_paths_match_reference"})
    procs = {}
    logs = tmp_path_factory.mktemp("forced-paths")
    for flavor in wanted if not os.environ.get("COLIBRI_INT_KERNEL") else ():
        if not _runnable(flavor):
            continue
        env = _clean_env(COLIBRI_INT_KERNEL=flavor, PYTHONPATH=str(ROOT))
        log = open(logs / f"{flavor}.log", "w+")  # a file, not a pipe: no process waits on a full pipe
        procs[flavor] = (subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
             "-k", "(int4 or int8 or q4_other_group) and not embed"],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
    yield procs
    for p, log in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()


@pytest.mark.slow  # every q4 / q8 kernel compiled uncached again: ~5 min of one core per path
@pytest.mark.parametrize("flavor", _OTHER_FLAVORS)
def test_other_integer_paths_match_reference(flavor, forced_path_runs):
    """The int4 / int8 tests again with each integer path this CPU does not pick by default
    (forced with COLIBRI_INT_KERNEL, compiled uncached), so every path of the q4 / q8 kernels
    is checked against kernels_ref where the CPU can run it."""
    if os.environ.get("COLIBRI_INT_KERNEL"):
        pytest.skip("already inside a forced-path run")
    if not _runnable(flavor):
        pytest.skip(f"this CPU cannot run the {flavor} path")
    p, log = forced_path_runs[flavor]
    p.wait(timeout=3600)
    log.seek(0)
    assert p.returncode == 0, log.read()[-3000:]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_embed_matches_reference(kind):
    rng = rng_for("embed", kind)
    V, D = 50, 96
    p, deq = weight(rng, V, D, kind)
    ids = rng.integers(0, V, 11)
    got = np.full((len(ids), D), np.nan, np.float32)
    ref = np.full((len(ids), D), np.nan, np.float32)
    if kind == "int8":
        K.embed_q8(ids, p["w"], p["s"], got)
        R.embed_q8(ids, p["w"], p["s"], ref)
    else:
        K.embed_q4(ids, p["w"], p["s"], 32, got)
        R.embed_q4(ids, p["w"], p["s"], 32, ref)
    # one rounding each (q * scale): both sides are the correctly rounded product
    assert np.array_equal(got, ref)
    assert np.allclose(got, deq[ids], rtol=2 * U, atol=0)


def test_rmsnorm_and_rope_match_reference():
    for T, N in ((1, 1), (3, 7), (17, 64)):
        rng = rng_for("norm", T, N)
        x = rng.standard_normal((T, N)).astype(np.float32)
        w = rng.standard_normal(N).astype(np.float32)
        a = np.empty_like(x)
        b = np.empty_like(x)
        K.rmsnorm(x, w, 1e-6, a)
        R.rmsnorm(x, w, 1e-6, b)
        # mean of squares (N terms), sqrt, reciprocal, two products: gamma(N + 5) relative
        assert np.allclose(a, b, rtol=2 * gamma(N + 5), atol=0)
    for T, H, S in ((1, 1, 2), (5, 3, 8), (17, 4, 64)):
        rng = rng_for("rope", T, H, S)
        x = rng.standard_normal((T, H, S)).astype(np.float32)
        ang = rng.uniform(-10, 10, (T, S // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x.copy(), x.copy()
        K.rope(a, cos, sin)
        R.rope(b, cos, sin)
        # a*c - b*s: two products and a difference; bound 2 * gamma(3) * (|a c| + |b s|)
        mag = np.abs(np.concatenate([x[..., S // 2:], x[..., :S // 2]], -1)) + np.abs(x)
        assert np.all(np.abs(a - b) <= 2 * gamma(3) * mag)


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_attention_matches_reference(kv):
    """float32 caches, and the 16-bit cache (uint16 IEEE half bits, widened exactly as read)
    against the reference on the same half values."""
    for T, H, Hkv, S, pos0 in ((1, 2, 1, 4, 0), (1, 4, 2, 8, 20), (5, 3, 3, 16, 7), (17, 8, 2, 32, 0)):
        rng = rng_for("att", T, H, Hkv, S, pos0)
        C = pos0 + T + 3
        q = rng.standard_normal((T, H, S)).astype(np.float32)
        kc = rng.standard_normal((Hkv, C, S)).astype(np.float32)
        vc = rng.standard_normal((Hkv, C, S)).astype(np.float32)
        scale = np.float32(S ** -0.5)
        a = np.full((T, H, S), np.nan, np.float32)
        b = np.full((T, H, S), np.nan, np.float32)
        if kv == "f16":
            kh, vh = kc.astype(np.float16).view(np.uint16), vc.astype(np.float16).view(np.uint16)
            K.attention(q, kh, vh, pos0, scale, a)
            R.attention(q, kh, vh, pos0, scale, b)
            kc, vc = R.kv_f32(kh), R.kv_f32(vh)
            c = np.full((T, H, S), np.nan, np.float32)
            R.attention(q, kc, vc, pos0, scale, c)  # the widening is exact: same as float32 caches
            assert np.array_equal(b, c)
        else:
            K.attention(q, kc, vc, pos0, scale, a)
            R.attention(q, kc, vc, pos0, scale, b)
        # scores: S-term dots (relative gamma(S + 1)) pass through exp (error in the exponent
        # becomes relative error of the weight: |score| * gamma); weights sum over n <= C
        # terms; output = convex combination of |v| <= max|v|.
        n = pos0 + T
        score_err = gamma(S + 2) * np.abs(q).max() * np.abs(kc).max() * S * float(scale)
        tol = 2 * (2 * score_err + gamma(n + 2)) * 2 * np.abs(vc).max()
        assert np.abs(a - b).max() <= tol, (T, H, Hkv, S, pos0, np.abs(a - b).max(), tol)


# --- process-wide setup -----------------------------------------------

def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_") and k != "XDG_CACHE_HOME"}
    env.update(extra)
    return env


CONCURRENT = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from engine import kernels as K
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    ref = np.empty((8, 512), np.float32)
    K.linear_f32(x, w, ref)
    bad = []
    def work():
        out = np.empty((8, 512), np.float32)
        q = np.empty((8, 4, 64), np.float32)
        for _ in range(60):
            K.linear_f32(x, w, out)
            K.attention(x.reshape(8, 4, 64), w[:256].reshape(4, 64, 256)[:, :, :64].copy(),
                        w[256:].reshape(4, 64, 256)[:, :, :64].copy(), 0, np.float32(0.125), q)
            if not np.array_equal(out, ref):
                bad.append(1)
    ts = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    print("LAYER", K.THREADING_LAYER, "SERIALIZED", K.SERIALIZED, "BAD", len(bad))
    sys.exit(1 if bad else 0)
""")


def test_concurrent_parallel_launches_survive_workqueue():
    """Fault 18.7: two threads launching parallel kernels at once under numba's workqueue layer
    aborted the process (SIGABRT). The launches must be serialized and the results right."""
    env = _clean_env(NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", CONCURRENT], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "LAYER workqueue SERIALIZED True BAD 0" in p.stdout


def test_default_threading_layer_is_thread_safe():
    """Without the user choosing, the layer is OpenMP or TBB where present (both thread-safe);
    only a machine with neither falls back to serialized workqueue."""
    if K.THREADING_LAYER in ("omp", "tbb"):
        assert not K.SERIALIZED
    else:
        assert K.SERIALIZED


def test_read_only_install_without_writable_home(tmp_path):
    """Fault 18.8: a read-only copy of the package and a HOME where nothing can be created.
    Importing the engine and running a kernel must work (uncached)."""
    pkg = tmp_path / "ro"
    shutil.copytree(ROOT / "engine", pkg / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    # Root ignores permission bits, so make every cache location impossible for everyone: a
    # *file* named __pycache__ in the package (numba's in-tree cache) and HOME pointing at a
    # file (numba's user-wide cache and ours live under it); then drop the write bits too.
    (pkg / "engine" / "__pycache__").write_text("")
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    for p in [pkg, *pkg.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    code = ("import numpy as np, engine, engine.kernels as K\n"
            "x = np.ones((2, 64), np.float32); w = np.ones((3, 64), np.float32); o = np.empty((2, 3), np.float32)\n"
            "K.linear_f32(x, w, o); assert (o == 64).all(), o\n"
            "print('CACHE', K.CACHE_DIR, 'LAYER', K.THREADING_LAYER)\n")
    env = _clean_env(HOME=str(home), PYTHONPATH=str(pkg), PYTHONDONTWRITEBYTECODE="1")
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=3600)
    finally:
        for q in [pkg, *pkg.rglob("*")]:
            q.chmod(0o755 if q.is_dir() else 0o644)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "CACHE None" in p.stdout
    # the threading layer still starts (its probe kernel compiles uncached too)
    assert "LAYER unknown" not in p.stdout, p.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_CACHE_HOME is the Linux convention")
def test_cache_goes_to_the_user_cache_folder(tmp_path):
    """With a writable XDG cache folder numba caches there, never next to the package."""
    cache_home = tmp_path / "xdg-cache"
    code = "import engine.kernels as K; print('CACHE', K.CACHE_DIR)"
    env = _clean_env(XDG_CACHE_HOME=str(cache_home), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("CACHE "))
    assert Path(line[6:]).resolve().is_relative_to(cache_home.resolve()), line


def test_prefill_int4_experts_in_one_call_equal_one_call_each():
    """experts_q4_sorted (a prefill chunk's resident experts in one call, reading their slabs
    in an arena) gives every entry's row bit for bit as expert_q4 on that expert's rows alone,
    with 1 or all threads, for experts chosen by 0, 1, 2, 5 and 9 rows (tiles and tails), odd
    group counts, widths not a multiple of the row block, and scattered token indices; and
    combine_sorted equals combine_ranked of the rows put back in rank order."""
    import numba
    n0 = numba.get_num_threads()
    try:
        for D, I, counts in ((96, 64, (2, 0, 5, 1)), (160, 96, (9, 3, 1)), (64, 32, (1,))):
            rng = rng_for("sorted", D, I, len(counts))
            experts = [[weight(rng, I, D, "int4")[0], weight(rng, I, D, "int4")[0], weight(rng, D, I, "int4")[0]]
                       for _ in counts]
            arena, offs = arena_of(experts, rng)
            T = 13
            x = rng.standard_normal((T, D)).astype(np.float32)
            tok = np.concatenate([np.sort(rng.choice(T, c, replace=False)) for c in counts]).astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            each = np.zeros((len(tok), D), np.float32)
            for e, parts_e in enumerate(experts):
                lo, hi = starts[e], starts[e + 1]
                if hi > lo:
                    each[lo:hi] = expert_call(K, "int4", x[tok[lo:hi]], parts_e, 32, I, D)[1]
            for threads in sorted({1, n0}):
                numba.set_num_threads(threads)
                out = np.full((len(tok), D), np.nan, np.float32)
                K.experts_q4_sorted(x, tok, starts, arena, offs, I, 32, K.current_threads(),
                                    np.full((len(tok), I), np.nan, np.float32), out, False)
                assert np.array_equal(out, each), (D, I, counts, threads)
            ref = np.full((len(tok), D), np.nan, np.float32)
            R.experts_q4_sorted(x, tok, starts, arena, offs, I, 32, 1, np.full((len(tok), I), np.nan, np.float32), ref)
            assert np.allclose(out, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
    finally:
        numba.set_num_threads(n0)
    rng = np.random.default_rng(8)
    for T, Kk, D in ((3, 2, 33), (16, 4, 96), (5, 8, 64)):
        y = (rng.standard_normal((T * Kk, D)) * 10).astype(np.float32)
        pos = rng.permutation(T * Kk).reshape(T, Kk).astype(np.int64)
        w = rng.random((T, Kk)).astype(np.float32)
        want = np.full((T, D), np.nan, np.float32)
        K.combine_ranked(np.ascontiguousarray(y[pos]), w, want)
        out = np.full((T, D), np.nan, np.float32)
        K.combine_sorted(y, pos, w, out)
        assert np.array_equal(out, want), (T, Kk, D)
        ref = np.empty_like(out)
        R.combine_sorted(y, pos, w, ref)
        assert np.array_equal(ref, want)


def test_combine_ranked_equals_numpy_rank_order_sum():
    """combine_ranked (the MoE layer's weighted sum of its experts' rows, one call) gives numpy's
    y[:, 0] * w[:, 0:1] + y[:, 1] * w[:, 1:2] + ... bit for bit, for T = 1 and T > 1, K = 1..8."""
    rng = np.random.default_rng(7)
    for T, Kk, D in ((1, 8, 2048), (1, 1, 5), (3, 2, 33), (16, 4, 96)):
        y = (rng.standard_normal((T, Kk, D)) * 10).astype(np.float32)
        w = rng.random((T, Kk)).astype(np.float32)
        want = y[:, 0] * w[:, 0:1]
        for k in range(1, Kk):
            want += y[:, k] * w[:, k:k + 1]
        out = np.full((T, D), np.nan, np.float32)
        K.combine_ranked(y, w, out)
        assert np.array_equal(out, want), (T, Kk, D)


_FRESH_VS_CACHED = """
import sys, numpy as np
from engine import kernels as K
run, path = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
H, S, C = 16, 128, 512
res = {}
for pos0 in (63, 200):
    q = rng.standard_normal((1, H, S)).astype(np.float32)
    kc = rng.standard_normal((H, C, S)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((H, C, S)).astype(np.float16).view(np.uint16)
    o = np.empty((1, H, S), np.float32)
    K.attention(q, kc, vc, pos0, np.float32(0.088), o)
    res[f"attention{pos0}"] = o
    o = np.empty((1, H, S), np.float32)
    K.attention_sink(q, kc, vc, pos0, np.float32(0.088), rng.standard_normal(H).astype(np.float32), o)
    res[f"attention_sink{pos0}"] = o
Hd, T, dk, dv = 4, 40, 32, 32  # the gated delta rule (exp of the decays) in chunks of 16
qd, kd = (rng.standard_normal((Hd, T, dk)).astype(np.float32) * 0.2 for _ in range(2))
vd = rng.standard_normal((Hd, T, dv)).astype(np.float32)
gd = -rng.random((Hd, T)).astype(np.float32) * 2
bd = rng.random((Hd, T)).astype(np.float32)
Sd = np.zeros((Hd, dk, dv), np.float32)
res["gated_delta"] = np.empty((Hd, T, dv), np.float32)
K.gated_delta(qd, kd, vd, gd, bd, Sd, 16, res["gated_delta"])
res["gated_delta_state"] = Sd
# int4 rows of 3 groups of 32 (the unpaired last group's scalar tail) and a decode step's experts
D, I, n, gs = 96, 64, 3, 32


def q4(O, N):
    return (rng.integers(0, 256, (O, N // 2), dtype=np.uint8),
            (rng.random((O, N // gs)) * 0.02 + 0.001).astype(np.float16).view(np.uint16))


experts = [[q4(I, D), q4(I, D), q4(D, I)] for _ in range(n)]
x = rng.standard_normal((1, D)).astype(np.float32)
res["linear_q4"] = np.empty((1, I), np.float32)
K.linear_q4(x, *experts[0][0], gs, res["linear_q4"])
res["expert_q4"] = np.empty((n, D), np.float32)
for k, (g, u, d) in enumerate(experts):
    K.expert_q4(x, *g, *u, *d, gs, np.empty((1, I), np.float32), res["expert_q4"][k:k + 1])
if run == "loads":  # the decode hits' kernel compiled here, the misses' (expert_q4) loaded
    parts = [a for e in experts for m in e for a in m]  # gate w, s, up w, s, down w, s per expert
    at = np.cumsum([0] + [a.nbytes for a in parts])
    arena = np.concatenate([a.reshape(-1).view(np.uint8) for a in parts])
    offs = at[:-1].reshape(n, 6).astype(np.int64)
    res["experts_q4_t1"] = np.empty((n, D), np.float32)
    K.experts_q4_t1(x, arena, offs, I, gs, np.empty((n, I), np.float32), res["experts_q4_t1"], False)
np.savez(path, **res)
"""


def test_kernel_compiled_fresh_and_loaded_from_cache_give_the_same_bits(tmp_path):
    """The first process after install compiles the kernels, later ones load them from numba's
    cache: both must compute the same bits. With the C library's exp (numba's math.exp) the
    attention kernel at 64+ keys differed in the last bit of ~400 of 32768 outputs between the
    two (the token stream of OLMoE-1B-7B int4 then changed from its 48th decode token on);
    kernels._exp32 calls no library. And with the int4 tail (an odd group count) under the
    kernels' fastmath flags, linear_q4 differed in 19 of 64 outputs fresh vs cached on a
    Sapphire Rapids CPU, and experts_q4_t1 compiled in a process that loaded expert_q4 from
    the cache disagreed with it (CI): a decode step's values then depended on which experts
    were cache hits. The tails are strict instructions now ("strict float operations")."""
    if os.environ.get("COLIBRI_INT_KERNEL"):
        pytest.skip("forced-path runs compile uncached")
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "fresh_vs_cached.py"
    script.write_text(_FRESH_VS_CACHED)
    # Without the pre-built kernels, so the first run compiles what the second loads.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(root), COLIBRI_SHIPPED_KERNELS="0")
    outs = {}
    for run in ("compiles", "loads"):
        subprocess.run([sys.executable, str(script), run, str(tmp_path / f"{run}.npz")], env=env, check=True,
                       cwd=tmp_path, timeout=3600)
        outs[run] = dict(np.load(tmp_path / f"{run}.npz"))
        if run == "compiles":
            assert any((tmp_path / "numba").rglob("*.nbi")), "the first run cached nothing"
    first, later = outs["compiles"], outs["loads"]
    for name, a in first.items():
        assert np.array_equal(a, later[name]), f"{name}: {int((a != later[name]).sum())} outputs differ"
    t1 = later["experts_q4_t1"]
    assert np.array_equal(t1, first["expert_q4"]), f"experts_q4_t1: {int((t1 != first['expert_q4']).sum())} differ"


@pytest.mark.parametrize("norm", [False, True])
def test_route_softmax_matches_reference_bit_for_bit(norm):
    """K.route_softmax (the softmax router's top-k in numba) gives the bits of its numpy twin:
    random logits, ties (the lowest id first), a -inf logit, huge spreads (e**z below the
    smallest float32), one row of NaN and one of +inf (every probability NaN, ids 0..k-1)."""
    rng = rng_for("route", norm)
    E, k = 64, 8
    x = rng.standard_normal((40, E)).astype(np.float32) * 3
    x[1, :] = 0.5  # all tied
    x[2, 10:20] = x[2].max() + 1  # a tied top block
    x[3, 5] = -np.inf
    x[4] *= 100  # exponents far below float32's range
    x[5, 7] = np.nan
    x[6, 9] = np.inf
    x[7, :] = -np.inf
    out = []
    for mod in (K, R):
        idx = np.empty((40, k), np.int64)
        w = np.empty((40, k), np.float32)
        p = np.empty((40, E), np.float32)
        mod.route_softmax(x, k, norm, idx, w, p)
        out.append((idx, w, p))
    (i1, w1, p1), (i2, w2, p2) = out
    assert np.array_equal(i1, i2)
    assert np.array_equal(w1.view(np.uint32), w2.view(np.uint32))
    assert np.array_equal(p1.view(np.uint32), p2.view(np.uint32))
    assert list(i1[1]) == list(range(k)) and set(i1[2]) <= set(range(10, 20)) and list(i1[2]) == list(range(10, 18))
    assert list(i1[5]) == list(range(k)) and np.isnan(w1[5]).all()
    assert np.allclose(p1[0].sum(), 1.0, atol=1e-6)
    assert all(len(set(r)) == k for r in i1)  # k distinct experts in every row


def test_exp32_is_correctly_rounded():
    """kernels._exp32 against float64 exp rounded to float32, over [-110, 90] and the specials."""
    from numba import njit

    @njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = K._exp32(x[i])

    x = np.concatenate([np.linspace(-110, 90, 400_001), [0.0, -0.0, 1.0, -1.0]]).astype(np.float32)
    got = np.empty_like(x)
    run(x, got)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    assert np.array_equal(got, want)
    sp = np.array([np.nan, np.inf, -np.inf], np.float32)
    out = np.empty_like(sp)
    run(sp, out)
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == 0.0


# --- every integer path compiles for the CPUs it targets (fault: int4 aborted on AVX2 CPUs) ----

TARGET_CHECK = textwrap.dedent("""
    import numpy as np
    from engine import kernels as K, kernels_ref as R
    rng = np.random.default_rng(0)
    for T in (1, 5):
        for N in (64 * 3, 64 * 3 + 32):   # paired and unpaired last group / block
            x = rng.standard_normal((T, N)).astype(np.float32)
            w4 = rng.integers(0, 256, (9, N // 2), dtype=np.uint8)
            s4 = (rng.random((9, N // 32)).astype(np.float16) + np.float16(0.5)).view(np.uint16)
            w8 = rng.integers(-128, 128, (9, N), dtype=np.int8)   # -128 too: the sign trick
            s8 = rng.random(9).astype(np.float32)
            for name, args in (("linear_q4", (w4, s4, 32)), ("linear_q8", (w8, s8))):
                got = np.full((T, 9), np.nan, np.float32)
                ref = np.full((T, 9), np.nan, np.float32)
                getattr(K, name)(x, *args, got)
                getattr(R, name)(x, *args, ref)
                assert np.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max())), (name, T, N)
    print("ok", K.INT_FLAVOR)
""")


@pytest.mark.parametrize("cpu,flavor,need", [
    ("x86-64", "portable", ()),                  # any x86-64 (and the code path of every non-x86 CPU)
    # ~40 s of compiling each; the first one catches the fault in the default run
    pytest.param("haswell", "avx2", ("avx2", "fma"), marks=pytest.mark.slow),  # AMD before Zen 4, Intel desktops since Alder Lake
    pytest.param("haswell", "portable", ("avx2", "fma"), marks=pytest.mark.slow),
    pytest.param("skylake-avx512", "bw", ("avx512bw",), marks=pytest.mark.slow),  # no VNNI: q8 must not emit vpdpbusd
])
def test_integer_kernels_compile_and_run_for_the_cpu_they_target(cpu, flavor, need):
    """Each integer path, compiled by numba for a CPU model without the instructions of the
    faster paths (NUMBA_CPU_NAME), compiles and matches kernels_ref. The tiles of every path are
    compiled even where the path does not call them, so an AVX-512 intrinsic left in them
    aborted the whole process ("LLVM ERROR: Do not know how to split the result of this
    operator", exit 134) at the first int4 linear on an AVX2-only CPU."""
    import llvmlite.binding as llb
    feats = llb.get_host_cpu_features()
    if platform_machine() not in ("x86_64", "amd64") or not all(feats.get(f) for f in need):
        pytest.skip(f"this CPU cannot run code built for {cpu}")
    env = _clean_env(COLIBRI_INT_KERNEL=flavor, NUMBA_CPU_NAME=cpu, PYTHONPATH=str(ROOT),
                     NUMBA_CACHE_DIR=str(Path(os.environ.get("TMPDIR", "/tmp")) / "colibri-target-check"))
    p = subprocess.run([sys.executable, "-c", TARGET_CHECK], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.split() == ["ok", flavor]


def platform_machine() -> str:
    import platform
    return platform.machine().lower()


def test_kv_put_f16_rounds_exactly_as_numpy():
    """K and V rows enter an f16 KV cache through K.kv_put_f16 (integer arithmetic): the bits
    must be numpy's clip + astype(float16) (kernels_ref) for every exponent, the rounding ties
    (to even, both parities), the subnormal halves and their boundary, signed zeros, values past
    the half range (clipped, never inf), NaN (stays NaN, numpy's payload) and inf; into a strided cache view, in
    both loop forms (serial below 65536 values, parallel above)."""
    rng = np.random.default_rng(7)
    bits = [rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64).astype(np.uint32)]
    for e in range(95, 145):  # every exponent from below the subnormal halves to past 65504
        m = np.concatenate([np.arange(0, 1 << 14, dtype=np.uint32),  # low bits: every tie pattern
                            rng.integers(0, 1 << 23, 4096, dtype=np.uint64).astype(np.uint32),
                            np.array([0x7FFFFF, 0x400000, 0x401000, 0x403000, 0x3FF000], np.uint32)])
        for sign in (0, 1):
            bits.append((np.uint32(sign << 31) | np.uint32(e << 23) | m).astype(np.uint32))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e9, -1e9,
                        2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 6.1e-5, 1.0, -1.0], np.float32)
    x = np.concatenate([b.view(np.float32) for b in bits] + [special])
    n = (len(x) // 64) * 64
    src = x[:n].reshape(-1, 4, 16)
    want = np.empty(src.shape, np.uint16)
    R.kv_put_f16(src, want)
    for rows in (8, src.shape[0]):  # 512 values (serial loop) and all of them (parallel loop)
        cache = np.zeros((4, rows + 3, 16), np.uint16)  # [H, C, S]: written through a transposed view
        K.kv_put_f16(src[:rows], cache[:, 2:2 + rows].transpose(1, 0, 2))
        got = cache[:, 2:2 + rows].transpose(1, 0, 2)
        assert np.array_equal(got, want[:rows])  # NaN payloads too
        assert np.isnan(got[np.isnan(src[:rows])].view(np.float16)).all()
        assert not np.isinf(got.view(np.float16)).any()
        assert (cache[:, :2] == 0).all() and (cache[:, 2 + rows:] == 0).all()


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("sink", [False, True])
def test_attention_of_a_prompt_equals_its_queries_one_at_a_time(kv, sink):
    """A prefill attends its queries in blocks of K.ATT_QB per head, each key / value row
    widened once for the block; a decode step attends one query on its own. The bits must not
    depend on which: T queries at once (blocks, a partial last block, GQA, balanced task order)
    equal the same queries attended one at a time at their own positions, as decoding them
    would. Also with gpt-oss's sink logit (attention_sink)."""
    for T, H, Hkv, S, pos0 in ((19, 4, 4, 32, 5), (8, 8, 2, 16, 0), (33, 6, 3, 64, 40)):
        rng = rng_for("att-blocks", kv, sink, T, H, Hkv, S, pos0)
        C = pos0 + T + 2
        q = rng.standard_normal((T, H, S)).astype(np.float32)
        kc = rng.standard_normal((Hkv, C, S)).astype(np.float32) * 3
        vc = rng.standard_normal((Hkv, C, S)).astype(np.float32)
        if kv == "f16":
            kc, vc = kc.astype(np.float16).view(np.uint16), vc.astype(np.float16).view(np.uint16)
        sinks = rng.standard_normal(H).astype(np.float32)
        scale = np.float32(S ** -0.5)

        def run(qq, p0, out):
            if sink:
                K.attention_sink(qq, kc, vc, p0, scale, sinks, out)
            else:
                K.attention(qq, kc, vc, p0, scale, out)
        whole = np.full((T, H, S), np.nan, np.float32)
        run(q, pos0, whole)
        one = np.full((T, H, S), np.nan, np.float32)
        for t in range(T):
            run(q[t:t + 1].copy(), pos0 + t, one[t:t + 1])
        assert np.array_equal(whole.view(np.uint32), one.view(np.uint32))


@pytest.mark.parametrize("user, want", [({}, {"GOMP_SPINCOUNT": "30000"}), ({"GOMP_SPINCOUNT": "5"}, {}),
                                        ({"OMP_WAIT_POLICY": "PASSIVE"}, {})])
def test_openmp_spin_is_shortened_unless_the_user_chose(user, want):
    """libgomp's default spin (300000: ~5-8 ms here) held a core while a streaming decode
    waited for the disk; the engine sets GOMP_SPINCOUNT=30000 unless the user set
    GOMP_SPINCOUNT or OMP_WAIT_POLICY."""
    assert K.default_spin_env({"PATH": "/bin", **user}) == want


def test_openmp_spin_is_set_before_libgomp_loads():
    """A fresh process without either variable: importing the engine sets it (libgomp reads it
    once, when numba starts its thread pool at that import)."""
    code = "import os, engine.kernels as K; print('SPIN', os.environ.get('GOMP_SPINCOUNT'), K.THREADING_LAYER)"
    env = {k: v for k, v in _clean_env(PYTHONPATH=str(ROOT)).items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SPIN 30000" in p.stdout


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("O,N", [(8, 64), (36, 128), (64, 2048)])
def test_interleaved_q4_is_bit_identical_to_row_major(T, O, N):
    """K.linear_q4i / linears_q4i on K.interleave_q4's layout: the same float32 bits as
    K.linear_q4 / linears_q4 on the row-major weights (every row's pair sums in the same order),
    for decode (T = 1: one 4-row tile) and prefill (token tiles and tails)."""
    rng = np.random.default_rng(T * 1000 + O)
    w = rng.integers(0, 256, (O, N // 2), dtype=np.uint8)
    s = (rng.random((O, N // 32)) * 0.02 + 0.001).astype(np.float16).view(np.uint16)
    x = rng.standard_normal((T, N)).astype(np.float32)
    if not K.q4_interleavable(w, s, 32):
        pytest.skip("no SIMD int4 path on this CPU")
    ref = np.empty((T, O), np.float32)
    K.linear_q4(x, w, s, 32, ref)
    got = np.empty((T, O), np.float32)
    K.linear_q4i(x, K.interleave_q4(w), s, 32, got)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    w2 = rng.integers(0, 256, (O // 2 + 4 - (O // 2) % 4, N // 2), dtype=np.uint8)
    s2 = (rng.random((w2.shape[0], N // 32)) * 0.02).astype(np.float16).view(np.uint16)
    refs = (np.empty((T, O), np.float32), np.empty((T, w2.shape[0]), np.float32))
    K.linears_q4(x, (w, w2), (s, s2), 32, refs)
    gots = (np.empty((T, O), np.float32), np.empty((T, w2.shape[0]), np.float32))
    K.linears_q4i(x, (K.interleave_q4(w), K.interleave_q4(w2)), (s, s2), 32, gots)
    for g, r in zip(gots, refs):
        assert np.array_equal(g.view(np.uint32), r.view(np.uint32))


def test_interleave_q4_layout_and_refusals():
    w = np.arange(8 * 64, dtype=np.uint8).reshape(8, 64)  # 8 rows, 2 pairs of 32 bytes
    il = K.interleave_q4(w)
    assert il.shape == (2, 2, 128)
    assert np.array_equal(il[1, 0, 32:64], w[5, :32])  # group 1, pair 0, row 1 of the group = row 5
    assert np.array_equal(il[0, 1, 96:128], w[3, 32:64])
    with pytest.raises(ValueError, match="cannot interleave"):
        K.interleave_q4(w[:6])
    assert not K.q4_interleavable(w[:6], np.zeros((6, 4), np.uint16), 32)  # 6 rows
    assert not K.q4_interleavable(w[:, :48], np.zeros((8, 3), np.uint16), 32)  # 3 groups: odd
    assert not K.q4_interleavable(w, np.zeros((8, 4), np.float32), 32)  # float32 scales


def test_interleaved_expert_kernels_are_bit_identical_to_row_major():
    """expert_q4i and experts_q4_t1 / experts_q4_sorted with il=True on slabs stored interleaved
    (engine.quant.interleave_q4, store format 4) give the same float32 bits as the row-major
    kernels, for decode (T = 1, several experts), prefill (experts chosen by 1, 3 and 6 rows:
    token tiles and tails) and 1 or all threads; kernels_ref's arena twins read both layouts;
    deinterleave_q4 inverts interleave_q4."""
    import numba
    from engine.quant import deinterleave_q4, int4_interleavable
    if not K.q4_interleaved_ok(32):
        pytest.skip("no SIMD int4 path on this CPU")
    n0 = numba.get_num_threads()
    try:
        for D, I in ((128, 64), (192, 320)):
            assert int4_interleavable(D, I, 32)
            rng = rng_for("il", D, I)
            experts = [[weight(rng, I, D, "int4")[0], weight(rng, I, D, "int4")[0], weight(rng, D, I, "int4")[0]]
                       for _ in range(3)]
            il = [[{"w": K.interleave_q4(p["w"]), "s": p["s"]} for p in parts] for parts in experts]
            for parts, ilp in zip(experts, il):
                for p, q in zip(parts, ilp):
                    assert np.array_equal(deinterleave_q4(q["w"]), p["w"])
                    assert np.array_equal(dequantize(q, "int4", 32), dequantize(p, "int4", 32))
            arena, offs = arena_of(experts, rng)
            arena_i = arena.copy()  # the same offsets, the weights interleaved in place
            for e, ilp in enumerate(il):
                for m, q in enumerate(ilp):
                    arena_i[offs[e, 2 * m]:offs[e, 2 * m] + q["w"].nbytes] = q["w"].reshape(-1)
            for threads in sorted({1, n0}):
                numba.set_num_threads(threads)
                for T in (1, 2, 5, 9):
                    x = rng.standard_normal((T, D)).astype(np.float32)
                    for parts, ilp in zip(experts, il):
                        _, want = expert_call(K, "int4", x, parts, 32, I, D)
                        got = np.full((T, D), np.nan, np.float32)
                        K.expert_q4i(x, ilp[0]["w"], ilp[0]["s"], ilp[1]["w"], ilp[1]["s"], ilp[2]["w"], ilp[2]["s"],
                                     32, np.full((T, I), np.nan, np.float32), got)
                        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (D, I, T, threads)
                x = rng.standard_normal((1, D)).astype(np.float32)
                outs = []
                for a, flag in ((arena, False), (arena_i, True)):
                    out = np.full((3, D), np.nan, np.float32)
                    K.experts_q4_t1(x, a, offs, I, 32, np.full((3, I), np.nan, np.float32), out, flag)
                    outs.append(out)
                    ref = np.full((3, D), np.nan, np.float32)
                    R.experts_q4_t1(x, a, offs, I, 32, np.full((3, I), np.nan, np.float32), ref, flag)
                    assert np.allclose(out, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
                assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (D, I, threads)
                T = 11
                x = rng.standard_normal((T, D)).astype(np.float32)
                counts = (1, 3, 6)
                tok = np.concatenate([np.sort(rng.choice(T, c, replace=False)) for c in counts]).astype(np.int64)
                starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
                outs = []
                for a, flag in ((arena, False), (arena_i, True)):
                    out = np.full((len(tok), D), np.nan, np.float32)
                    K.experts_q4_sorted(x, tok, starts, a, offs, I, 32, K.current_threads(),
                                        np.full((len(tok), I), np.nan, np.float32), out, flag)
                    outs.append(out)
                    ref = np.full((len(tok), D), np.nan, np.float32)
                    R.experts_q4_sorted(x, tok, starts, a, offs, I, 32, 1, np.full((len(tok), I), np.nan, np.float32),
                                        ref, flag)
                    assert np.allclose(out, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
                assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (D, I, threads)
    finally:
        numba.set_num_threads(n0)


@pytest.mark.parametrize("impl", ["numba", "numpy"])
def test_cache_take_resident_updates_the_arrays_only_when_every_expert_is_resident(impl):
    """K.cache_take_resident (the array half of ExpertCache.take_split's all-resident path):
    with every expert resident it marks exactly those experts routed, takes their slots (busy
    + 1), stamps the use clock in lookup order and reports pins and speculations; with one
    expert absent or still loading it returns -1 and changes nothing. Both implementations."""
    mod = K if impl == "numba" else R
    rng = np.random.default_rng(0)
    E, S, resident = 16, 10, 2
    for trial in range(40):
        where = np.full(E, -1, np.int32)
        held = rng.choice(E, S, replace=False)
        where[held] = np.arange(S, dtype=np.int32)
        state = np.full(S, resident, np.int8)
        state[rng.integers(0, S)] = 1 if trial % 3 == 0 else resident  # sometimes a slot still loading
        busy = rng.integers(0, 3, S).astype(np.int32)
        last_use = rng.integers(0, 100, E).astype(np.int64)
        routed = rng.random(E) < 0.5
        pinned = rng.random(E) < 0.3
        spec = rng.random(S) < 0.3
        n = int(rng.integers(1, 6))
        pool = held if trial % 2 == 0 else np.arange(E)  # odd trials may ask for an absent expert
        ea = rng.choice(pool, n, replace=False).astype(np.int64)
        before = [a.copy() for a in (busy, last_use, routed)]
        ss, pm = np.full(n, -7, np.int64), np.zeros(n, bool)
        got = mod.cache_take_resident(where, state, busy, last_use, routed, pinned, spec, ea, 500, resident, ss, pm)
        slots = where[ea]
        if (slots < 0).any() or (state[np.maximum(slots, 0)] != resident).any():
            assert got == -1
            for a, b in zip((busy, last_use, routed), before):
                np.testing.assert_array_equal(a, b)
            continue
        assert got == int(spec[slots].sum())
        np.testing.assert_array_equal(ss, slots)
        np.testing.assert_array_equal(pm, pinned[ea])
        want_busy = before[0].copy()
        want_busy[slots] += 1
        np.testing.assert_array_equal(busy, want_busy)
        want_use = before[1].copy()
        want_use[ea] = 501 + np.arange(n)
        np.testing.assert_array_equal(last_use, want_use)
        np.testing.assert_array_equal(routed, np.isin(np.arange(E), ea))
    # an expert id out of range or repeated: -1 and nothing changed (numba has no bounds checks;
    # take_split's Python loop then raises or handles it as before)
    for bad in (np.array([1, E], np.int64), np.array([-1, 2], np.int64), np.array([3, 3], np.int64)):
        where = np.arange(E, dtype=np.int32) % S
        state = np.full(S, resident, np.int8)
        busy = np.zeros(S, np.int32)
        routed = np.zeros(E, bool)
        ss, pm = np.zeros(2, np.int64), np.zeros(2, bool)
        assert mod.cache_take_resident(where, state, busy, np.zeros(E, np.int64), routed, np.zeros(E, bool),
                                       np.zeros(S, bool), bad, 0, resident, ss, pm) == -1
        assert not busy.any() and not routed.any()
