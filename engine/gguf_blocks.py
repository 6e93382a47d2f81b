"""GGUF's quantized block types as a store holds them, and the slab layout of a GGUF-born store.

A GGUF-born store ("quant": "gguf") keeps each routed expert's gate/up/down rows exactly as the
GGUF file published them (ggml blocks: ``block_size`` values in ``type_size`` bytes, one row of
N values = N / block_size blocks, back to back), one 4096-aligned slab per expert as every
store does. Types may differ per layer and per projection (the "mixed" quants: Q4_K_M keeps
some ffn_down at Q6_K), so every slab starts with a 4-byte header naming its three types
(ggml type ids: gate, up, down, 0), and each projection's field is as wide as the widest row
that projection has in any layer (a narrower type leaves the rest of its row zero). The kernels
(engine.kernels_gguf) read the header, so one layout and one slot size serve every layer.

Block sizes and type ids are ggml's (ggml/include/ggml.h ``enum ggml_type``,
ggml/src/ggml-common.h block structs; gguf-py constants.GGML_QUANT_SIZES lists the same).
"""

from __future__ import annotations

import numpy as np

from .quant import ALIGN

_FIELD_ALIGN = 64

# ggml type id -> (name, values per block, bytes per block); the types the kernels compute on
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}
TYPE_IDS = {name: t for t, (name, _b, _s) in BLOCK_TYPES.items()}
PROJS = ("gate_proj", "up_proj", "down_proj")


def type_name(t: int) -> str:
    """ggml's name of type id ``t`` (``"type 17"`` for one this engine does not compute on)."""
    return BLOCK_TYPES[t][0] if t in BLOCK_TYPES else f"type {t}"


def row_bytes(t: int, n: int) -> int:
    """Bytes of one row of ``n`` values of ggml type ``t``.

    Raises:
        ValueError: an unknown type, or ``n`` not a multiple of the type's block size.
    """
    if t not in BLOCK_TYPES:
        raise ValueError(f"ggml type {t} is not one this engine computes on")
    name, bs, ts = BLOCK_TYPES[t]
    if n % bs:
        raise ValueError(f"{name} rows hold multiples of {bs} values, not {n}")
    return n // bs * ts


def gguf_slab_layout(hidden_size: int, intermediate_size: int, widths: dict, bias: bool = False) -> dict:
    """The slab layout of a GGUF-born store: "types" uint8 [4] at 0, then "{proj}.q" uint8
    [O, widths[proj]] (the rows' block bytes) for gate_proj [I rows], up_proj [I], down_proj
    [D], each with a float32 bias "{proj}.b" [O] when ``bias`` (gpt-oss). ``widths``: bytes
    per row of each projection (the widest over the layers). Same dict shape as
    engine.quant.slab_layout: {"fields": [(name, offset, dtype str, shape)], "data_bytes",
    "slot_bytes"}."""
    D, I = hidden_size, intermediate_size
    fields = [("types", 0, "|u1", (4,))]
    off = 4
    for proj, O in (("gate_proj", I), ("up_proj", I), ("down_proj", D)):
        specs = [("q", np.dtype(np.uint8), (O, int(widths[proj])))]
        if bias:
            specs.append(("b", np.dtype(np.float32), (O,)))
        for name, dt, shape in specs:
            off = -(-off // _FIELD_ALIGN) * _FIELD_ALIGN
            fields.append((f"{proj}.{name}", off, dt.str, tuple(shape)))
            off += int(np.prod(shape)) * dt.itemsize
    return {"fields": fields, "data_bytes": off, "slot_bytes": -(-off // ALIGN) * ALIGN}
