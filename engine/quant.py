"""Weight quantization schemes of the expert store, and the expert slab layout.

Key: O output rows, N input columns, G = N // group_size.

- int8: symmetric per output row: scale[o] = max|w[o]| / 127, q = rint(w / scale) in [-127, 127],
  w ~= q * scale (as colibri's convert_olmoe_merged.py, and llama.cpp's Q8 family).
- int4: symmetric group-wise along the input: scale[o, g] = max|w[o, g*gs:(g+1)*gs]| / 7
  rounded to IEEE half precision (stored as its uint16 bits, as llama.cpp's Q4_0 stores its
  block scale in f16: 2 bytes per 32 weights instead of 4, an int4 slab 10% smaller), q =
  rint(w / scale) in [-7, 7] with that rounded scale, stored as the nibble q + 8, two per
  byte: low nibble = even column, high nibble = odd column (the nibble order of the C
  engine colibrì's int4 expert files, its "format 2/4"). Stores written before format 3 hold float32 scales; both are read.
- mxfp4: the OCP Microscaling FP4 format gpt-oss checkpoints are published in: blocks of 32
  input columns share one e8m0 scale byte X (value 2^(X - 127)); each value is an e2m1 code
  (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte: low nibble = even column,
  high nibble = odd column (transformers' integrations/mxfp4.py convert_moe_packed_tensors).
  w uint8 [O, N // 2], s uint8 [O, N // 32]. Stored as published (no re-rounding), so an MXFP4
  checkpoint converts to an mxfp4 store byte for byte; a float checkpoint is rounded to it by
  :func:`quantize_mxfp4`. A store quantization of the routed experts only (dense stays int8).
- f16 / f32: exact modes for tests (f16 stored as raw IEEE half bits, read as uint16).

int4 expert weights may be stored row-interleaved by IL = 4 (:func:`interleave_q4`, store
format 4; the slab layout's w field then has the shape [O / 4, N / 64, 128]): the same bytes
reordered so that a decode step's 4-row register tile reads one stream (llama.cpp's repacked
Q4_0 is the same idea). The values a kernel computes from either layout are bit-identical.
"""

from __future__ import annotations

import mmap

import numpy as np

from .errors import CheckpointError

QUANTS = ("int8", "int4", "f16", "f32", "mxfp4")
EXPERT_ONLY_QUANTS = ("mxfp4",)  # store quantizations of the routed experts only (not --dense-quant)
MXFP4_BLOCK = 32  # columns per e8m0 scale
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)  # e2m1 code -> value
# e8m0 scale byte X -> 2^(X - 127); 255 (NaN in OCP MX) -> inf, as transformers' ldexp gives
E8M0_VALUES = np.append(np.ldexp(1.0, np.arange(255) - 127), np.inf).astype(np.float32)
_FP4_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
IL = 4  # rows per group of the interleaved int4 layout
LM_HEAD_QUANT = {"int4": "int8"}  # lm_head / embedding quantization per dense one (engine.convert)
ALIGN = 4096  # slab alignment on disk and in RAM: one O_DIRECT read per expert
_FIELD_ALIGN = 64


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w: float32 [O, N] -> (q int8 [O, N], scale float32 [O])."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.max(np.abs(w), axis=1)
    scale = (np.maximum(amax, 1e-12) / 127.0).astype(np.float32)  # [O]
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)  # [O, N]
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]


F16_MIN_NORMAL = 2.0 ** -14  # smallest positive normal IEEE half: the floor of an int4 scale
F16_MAX = 65504.0


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """w: float32 [O, N] -> (packed uint8 [O, N//2], scale uint16 [O, N//group_size]: the
    IEEE half bits of each group's scale, see the module docstring).

    The scale is max|w_g| / 7 rounded to half precision and kept within [2^-14, 65504] (an
    all-zero group gets 2^-14 and zero codes); the codes are rounded with that stored scale,
    so dequantization reproduces exactly what the codes were chosen for.

    Raises:
        ValueError: N is not a multiple of group_size or group_size is odd.
    """
    w = np.asarray(w, dtype=np.float32)
    O, N = w.shape
    if N % group_size or group_size % 2:
        raise ValueError(f"int4: input width {N} is not a multiple of the group size {group_size}")
    g = w.reshape(O, N // group_size, group_size)  # [O, G, gs]
    amax = np.max(np.abs(g), axis=2)  # [O, G]
    s16 = np.clip(amax / np.float32(7.0), F16_MIN_NORMAL, F16_MAX).astype(np.float16)
    q = np.clip(np.rint(g / s16.astype(np.float32)[:, :, None]), -7, 7).astype(np.int16).reshape(O, N) + 8
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # [O, N//2]
    return packed, s16.view(np.uint16)


def int4_scales(scale: np.ndarray) -> np.ndarray:
    """Group scales as float32: uint16 half bits (format 3) decoded, float32 (older stores) as is."""
    if scale.dtype == np.uint16:
        return scale.view(np.float16).astype(np.float32)
    return np.asarray(scale, dtype=np.float32)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """packed uint8 [O, N//2] (or the interleaved [O/4, N/64, 128] of store format 4, read as
    its row-major bytes), scale uint16 half bits or float32 [O, G] -> float32 [O, N]."""
    if packed.ndim == 3:
        packed = deinterleave_q4(packed)
    O, half = packed.shape
    q = np.empty((O, half * 2), dtype=np.float32)
    q[:, 0::2] = (packed & 0x0F).astype(np.float32) - 8.0
    q[:, 1::2] = (packed >> 4).astype(np.float32) - 8.0
    return (q.reshape(O, -1, group_size) * int4_scales(scale)[:, :, None]).reshape(O, half * 2)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w: float32 [O, N] -> (codes uint8 [O, N // 2], scale bytes uint8 [O, N // 32]).

    Per block of 32 columns (OCP MX v1.0, section 6.3): X = floor(log2(max|w|)) - 2 (2 = the
    largest e2m1 exponent), clamped to [-127, 127]; each w / 2^X rounded to the nearest e2m1
    magnitude (saturating at 6), sign in bit 3. An all-zero block gets X = -127 and zero codes.

    Raises:
        ValueError: N is not a multiple of 32.
    """
    w = np.asarray(w, dtype=np.float32)
    O, N = w.shape
    if N % MXFP4_BLOCK:
        raise ValueError(f"mxfp4: input width {N} is not a multiple of {MXFP4_BLOCK}")
    g = w.reshape(O, N // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.max(np.abs(g), axis=2)  # [O, G]
    with np.errstate(divide="ignore"):
        x = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    x = np.clip(x, -127, 127).astype(np.int32)
    v = g / np.ldexp(np.float32(1.0), x)[:, :, None].astype(np.float32)
    mag = np.searchsorted(_FP4_MIDPOINTS, np.abs(v), side="left").astype(np.uint8)  # 0..7
    code = (mag | np.where(np.signbit(v) & (mag > 0), 8, 0).astype(np.uint8)).reshape(O, N)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, (x + 127).astype(np.uint8)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes uint8 [O, N // 2] + scale bytes uint8 [O, N // 32] -> float32 [O, N] (exact)."""
    O, half = packed.shape
    v = np.empty((O, half * 2), dtype=np.float32)
    v[:, 0::2] = FP4_VALUES[packed & 0x0F]
    v[:, 1::2] = FP4_VALUES[packed >> 4]
    with np.errstate(over="ignore"):  # 6 x 2^127 (scale byte 254) is beyond float32: inf, as transformers'
        return (v.reshape(O, -1, MXFP4_BLOCK) * E8M0_VALUES[scale][:, :, None]).reshape(O, half * 2)


def mxfp4_nonfinite_block(blocks: np.ndarray, scales: np.ndarray) -> tuple[int, int, int] | None:
    """The first MXFP4 block that decodes to NaN or inf, as (row, block, scale byte), else None.

    blocks: uint8 [O, G, 16] (two E2M1 codes a byte), scales: uint8 [O, G] (e8m0). A block is
    non-finite when its scale byte is 255 (NaN in the OCP Microscaling spec v1.0) or 254
    (2^127) under a code of magnitude >= 2 (2 x 2^127 overflows float32), the values
    :func:`dequantize_mxfp4` would give. Cost: one pass over the scales, and over the blocks of
    the (rare) rows scaled by 254."""
    scales = np.asarray(scales)
    bad = scales == 255
    hi = scales == 254
    if hi.any():
        b = np.asarray(blocks)
        big = (((b & 0x07) >= 4) | (((b >> 4) & 0x07) >= 4)).any(axis=-1)  # |code| >= 2.0 in the block
        bad |= hi & big
    if not bad.any():
        return None
    r, g = (int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), bad.shape))
    return r, g, int(scales[r, g])


F16_MAX = float(np.finfo(np.float16).max)  # 65504: larger magnitudes become inf in f16


def check_finite(name: str, w: np.ndarray, quant: str, source: str = "") -> None:
    """Refuse a weight a store must not hold: NaN or inf anywhere, or (``quant`` "f16") a
    magnitude above the f16 range, which would be stored as inf. Cost: one pass over w.

    Raises:
        CheckpointError: naming ``source`` (the file), the tensor, the first bad index and
            its value, and what to do.
    """
    w = np.asarray(w)
    ok = np.isfinite(w)
    fix = "the checkpoint is broken: download it again or fix the run that wrote it"
    if ok.all() and quant == "f16":
        ok = np.abs(w) <= F16_MAX
        fix = f"f16 holds |w| <= {F16_MAX:g}: convert with --quant int8 or f32 instead"
    if ok.all():
        return
    flat = int(np.argmin(ok.reshape(-1)))
    idx = [int(i) for i in np.unravel_index(flat, w.shape)] if w.ndim else []
    n_bad = int(ok.size - np.count_nonzero(ok))
    where = f"{source}: " if source else ""
    raise CheckpointError(
        f"{where}tensor '{name}' element {idx} = {float(w.reshape(-1)[flat])!r} "
        f"({n_bad} bad element{'s' if n_bad != 1 else ''} in it); {fix}. Nothing was converted.")


def quantize(w: np.ndarray, quant: str, group_size: int = 32) -> dict[str, np.ndarray]:
    """Quantize one [O, N] matrix; returns {"w": data, "s": scales} ("s" absent for f16/f32)."""
    if quant == "int8":
        q, s = quantize_int8(w)
        return {"w": q, "s": s}
    if quant == "int4":
        q, s = quantize_int4(w, group_size)
        return {"w": q, "s": s}
    if quant == "f16":
        return {"w": np.asarray(w, dtype=np.float16).view(np.uint16)}
    if quant == "f32":
        return {"w": np.ascontiguousarray(w, dtype=np.float32)}
    if quant == "mxfp4":
        q, s = quantize_mxfp4(w)
        return {"w": q, "s": s}
    raise ValueError(f"unknown quantization {quant!r}; choose one of {QUANTS}")


def dequantize(parts: dict[str, np.ndarray], quant: str, group_size: int = 32) -> np.ndarray:
    """Inverse of :func:`quantize` (float32 [O, N])."""
    if quant == "int8":
        return dequantize_int8(parts["w"], parts["s"])
    if quant == "int4":
        return dequantize_int4(parts["w"], parts["s"], group_size)
    if quant == "f16":
        return parts["w"].view(np.float16).astype(np.float32)
    if quant == "mxfp4":
        return dequantize_mxfp4(parts["w"], parts["s"])
    return np.asarray(parts["w"], dtype=np.float32)


def kind_of(w: np.ndarray, s: np.ndarray | None) -> str:
    """The quantization of a stored matrix from its arrays alone: int8 (int8 w, scale per row),
    int4 (uint8 w, 2-D group scales: uint16 half bits or float32), mxfp4 (uint8 w, 2-D uint8 e8m0 scales), f16
    (uint16 w), f32 (float32 w).

    Raises:
        ValueError: the dtypes match no scheme of this module.
    """
    if w.dtype == np.int8 and s is not None and s.ndim == 1:
        return "int8"
    if w.dtype == np.uint8 and s is not None and s.ndim == 2:
        return "mxfp4" if s.dtype == np.uint8 else "int4"
    if w.dtype == np.uint16 and s is None:
        return "f16"
    if w.dtype == np.float32 and s is None:
        return "f32"
    raise ValueError(f"weight dtype {w.dtype} with scales {None if s is None else s.shape} is no known quantization")


def field_specs(quant: str, O: int, N: int, gs: int, f32_int4_scales: bool = False
                 ) -> list[tuple[str, np.dtype, tuple]]:
    if quant == "int8":
        return [("w", np.dtype(np.int8), (O, N)), ("s", np.dtype(np.float32), (O,))]
    if quant == "int4":
        sdt = np.float32 if f32_int4_scales else np.uint16  # float32 in stores before format 3
        return [("w", np.dtype(np.uint8), (O, N // 2)), ("s", np.dtype(sdt), (O, N // gs))]
    if quant == "f16":
        return [("w", np.dtype(np.uint16), (O, N))]
    if quant == "f32":
        return [("w", np.dtype(np.float32), (O, N))]
    if quant == "mxfp4":
        return [("w", np.dtype(np.uint8), (O, N // 2)), ("s", np.dtype(np.uint8), (O, N // MXFP4_BLOCK))]
    raise ValueError(f"unknown quantization {quant!r}")


def interleave_q4(w: np.ndarray, il: int = IL) -> np.ndarray:
    """Row-major int4 weights uint8 [O, N / 2] -> the interleaved layout uint8 [O / il, N / 64,
    il * 32]: group g, pair i holds the 32 bytes (64 columns) of pair i of rows g * il ..
    g * il + il - 1, in row order.

    Raises:
        ValueError: O not a multiple of il, or N / 2 not a multiple of 32 (pairs of groups of 32).
    """
    O, nb = w.shape
    if O % il or nb % 32:
        raise ValueError(f"int4 weights [{O}, {nb}] bytes: cannot interleave by {il} rows of 32-byte pairs")
    return np.ascontiguousarray(w.reshape(O // il, il, nb // 32, 32).transpose(0, 2, 1, 3)).reshape(O // il, nb // 32, il * 32)


def deinterleave_q4(w: np.ndarray) -> np.ndarray:
    """The inverse of :func:`interleave_q4`: uint8 [O / il, N / 64, il * 32] -> row-major uint8
    [O, N / 2] (a copy)."""
    g, npairs, width = w.shape
    il = width // 32
    return np.ascontiguousarray(w.reshape(g, npairs, il, 32).transpose(0, 2, 1, 3)).reshape(g * il, npairs * 32)


def int4_interleavable(hidden_size: int, intermediate_size: int, group_size: int) -> bool:
    """Whether an int4 expert slab of these widths can be stored interleaved (and run by the
    interleaved kernels): group size 32, both widths multiples of 64 (pairs of groups, so every
    matrix has an even number of groups and a whole number of 32-byte pairs; rows then come in
    multiples of IL too)."""
    return group_size == 32 and hidden_size % 64 == 0 and intermediate_size % 64 == 0


def slab_layout(quant: str, hidden_size: int, intermediate_size: int, group_size: int = 32,
                bias: bool = False, f32_int4_scales: bool = False, interleaved: bool = False) -> dict:
    """Byte layout of one expert slab: gate_proj [I, D], up_proj [I, D], down_proj [D, I].
    ``bias`` (gpt-oss): each projection also holds its float32 bias "{proj}.b" ([I], [I], [D])
    after its weights, in the same slab (still one read per expert). ``f32_int4_scales``: the
    layout of stores before format 3 (float32 int4 group scales). ``interleaved`` (int4, store
    format 4, :func:`int4_interleavable` must hold): each w field holds :func:`interleave_q4`'s
    layout, shape [O / IL, N / 64, IL * 32] (same bytes, same offsets).

    Raises:
        ValueError: ``interleaved`` for another quantization or widths it does not fit.

    Returns {"fields": [(name, offset, dtype str, shape), ...], "data_bytes": int,
    "slot_bytes": int (data rounded up to ALIGN)}. Names are "gate_proj.w", "gate_proj.s", ...
    """
    D, I = hidden_size, intermediate_size
    if interleaved and (quant != "int4" or f32_int4_scales or not int4_interleavable(D, I, group_size)):
        raise ValueError(f"an interleaved slab needs int4 with half scales, group size 32 and widths "
                         f"that are multiples of 64 (not {quant}, {D} x {I}, group size {group_size})")
    fields = []
    off = 0
    for proj, (O, N) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
        specs = (field_specs(quant, O, N, group_size, f32_int4_scales)
                 + ([("b", np.dtype(np.float32), (O,))] if bias else []))
        if interleaved:
            specs = [(n, dt, (O // IL, N // 64, IL * 32) if n == "w" else sh) for n, dt, sh in specs]
        for name, dt, shape in specs:
            off = -(-off // _FIELD_ALIGN) * _FIELD_ALIGN
            fields.append((f"{proj}.{name}", off, dt.str, tuple(shape)))
            off += int(np.prod(shape)) * dt.itemsize
    return {"fields": fields, "data_bytes": off, "slot_bytes": -(-off // ALIGN) * ALIGN}


def slab_views(buf: np.ndarray, layout: dict) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of one slab held in ``buf`` (uint8, at least data_bytes long)."""
    out = {}
    for name, off, dt, shape in layout["fields"]:
        dt = np.dtype(dt)
        n = int(np.prod(shape)) * dt.itemsize
        out[name] = buf[off:off + n].view(dt).reshape(shape)
    return out


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is a multiple of ``align`` (for O_DIRECT)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


HUGE_PAGE = 2 << 20  # bytes: the transparent huge page of x86-64 and arm64 (4 KB granule)


def huge_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array (as np.empty) whose whole 2 MB blocks sit on
    transparent huge pages where the platform allows it: a private anonymous mapping with the
    array at a HUGE_PAGE-aligned address and MADV_HUGEPAGE on its whole blocks (the tail stays
    on 4 KB pages, so the resident bytes stay the array's). Arrays under HUGE_PAGE bytes, and
    platforms without MAP_ANONYMOUS or MADV_HUGEPAGE, get np.empty.

    Why: the decode step streams every resident weight matrix once per token; on 4 KB pages a
    2.4 MB matrix is ~600 TLB misses, each a page walk (two-level in a VM). Measured (K.linears_q4i
    on 16 layers of OLMoE-1B-7B's int4 q / k / v, 2 threads, this VM): 26-29 GB/s on 4 KB
    pages, 34-39 GB/s on huge pages. The values do not change."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if (n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS")
            or not hasattr(mmap, "MAP_PRIVATE")):
        return np.empty(shape, dt)
    mm = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive as long as the array
    start = (-raw.ctypes.data) % HUGE_PAGE  # the bytes before it are never touched: never resident
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, n // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP compiled out or refused: 4 KB pages, the same values
        pass
    return raw[start:start + n].view(dt).reshape(shape)
