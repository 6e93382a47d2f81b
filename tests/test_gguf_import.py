"""GGUF import: the block kernels decode exactly as gguf-py does, a GGUF becomes a store that
computes what the same weights compute in an ordinary store, and a bad file is one clear line
that leaves nothing behind.

The GGUFs here are written by engine.bench.gguf (llama.cpp's olmoe / qwen3moe layouts, through
gguf-py's writer) and by gguf.GGUFWriter directly; tests/test_gguf_oracle.py compares with
llama.cpp itself on files made by its own converter.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.bench.gguf import write_gguf  # noqa: E402
from engine.convert import convert_checkpoint  # noqa: E402
from engine.errors import CheckpointError, ConfigError  # noqa: E402
from engine.gguf_blocks import BLOCK_TYPES, gguf_slab_layout  # noqa: E402
from engine.gguf_import import convert_gguf, gguf_files  # noqa: E402
from engine.bench.synthetic import olmoe_config, qwen3_moe_config, write_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import open_model  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512,
           max_position_embeddings=512)


def _random_blocks(t: int, rows: int, n: int, rng) -> np.ndarray:
    """Random rows of ggml type ``t`` whose f16 scale fields hold finite halves (random bytes
    elsewhere: every code, every scale nibble)."""
    name, bs, ts = BLOCK_TYPES[t]
    raw = rng.integers(0, 256, (rows, n // bs, ts), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
    for off in halves.get(name, []):
        raw[:, :, off:off + 2] = rng.uniform(-0.1, 0.1, (rows, n // bs)).astype(np.float16).view(np.uint8).reshape(
            rows, n // bs, 2)
    if name == "MXFP4":  # e8m0 exponents around 2^0 (255 is NaN, large ones overflow float32)
        raw[:, :, 0] = rng.integers(100, 140, (rows, n // bs))
    if name == "F16":
        raw = rng.standard_normal((rows, n)).astype(np.float16).view(np.uint8).reshape(rows, n // bs, ts)
    if name == "F32":
        raw = rng.standard_normal((rows, n)).astype(np.float32).view(np.uint8).reshape(rows, n // bs, ts)
    if name == "BF16":
        raw = (rng.standard_normal((rows, n)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = raw.view(np.uint8).reshape(rows, n // bs, ts)
    return raw.reshape(rows, -1)


def _f32_logits(folder, ids):
    """Every position's logits of the store at ``folder`` (f32 KV cache), its cache and store
    closed after (their reader threads end with them)."""
    model, store, cache = open_model(folder, kv_dtype="f32")
    try:
        return model.forward(ids, 0, all_logits=True)
    finally:
        cache.close()
        store.close()


@pytest.mark.parametrize("t", sorted(BLOCK_TYPES), ids=[BLOCK_TYPES[t][0] for t in sorted(BLOCK_TYPES)])
def test_block_decoding_equals_gguf_bit_for_bit(t):
    """Every block type the kernels compute on decodes to gguf.quants' float32 values, bit for
    bit (random codes and scales: every nibble, every scale byte), and the matmul kernel on the
    blocks equals the decoded matrix times x at T = 1 and T = 3."""
    from engine import kernels_gguf as KG
    from engine.kernels.kquants import q8k_reference
    rng = np.random.default_rng(t)
    n = 512
    raw = _random_blocks(t, 24, n, rng)
    qt = gguf.GGMLQuantizationType(t)
    assert qt.name == BLOCK_TYPES[t][0] and gguf.GGML_QUANT_SIZES[qt] == BLOCK_TYPES[t][1:]
    ref = np.asarray(gguf.quants.dequantize(raw, qt), np.float32).reshape(24, n)
    got = KG.dequantize(t, raw, n)
    assert np.isfinite(ref).all()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    for T in (1, 3):
        x = rng.standard_normal((T, n)).astype(np.float32)
        out = KG.linear(x, raw, t, np.empty((T, 24), np.float32))
        # K-quant rows meet the activations quantized to 8 bits (engine.kernels.kquants)
        xin = q8k_reference(x) if KG.integer_ok(t) else x.astype(np.float64)
        want = xin @ ref.astype(np.float64).T
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))


def test_slab_layout_holds_the_widest_rows():
    lay = gguf_slab_layout(256, 128, {"gate_proj": 144, "up_proj": 144, "down_proj": 105})
    f = {n: (o, s) for n, o, _d, s in lay["fields"]}
    assert f["types"] == (0, (4,)) and f["gate_proj.q"][1] == (128, 144) and f["down_proj.q"][1] == (256, 105)
    assert lay["slot_bytes"] % 4096 == 0 and lay["data_bytes"] <= lay["slot_bytes"]


@pytest.fixture(scope="module")
def olmoe_ck(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gg") / "ck", olmoe_config(**CFG), seed=11, tokenizer=False,
                            std=0.08)


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_f16_gguf_computes_what_the_f16_store_computes(family, olmoe_ck, tmp_path):
    """A F16 GGUF (llama.cpp's olmoe / qwen3moe layout) imported keeps the very f16 weights an
    f16 store of the same checkpoint holds: names, expert order and slab layout right, the
    logits equal to float rounding at every position."""
    if family == "olmoe":
        ck = olmoe_ck
    else:
        ck = write_checkpoint(tmp_path / "ck", qwen3_moe_config(hidden_size=128, moe_intermediate_size=64,
                                                                 num_experts=8, vocab_size=512), seed=12,
                              tokenizer=False, std=0.08)
    write_gguf(ck, tmp_path / "m.gguf", matrix_type="f16", log=lambda *_: None)
    st = convert_gguf(tmp_path / "m.gguf", tmp_path / "st", dense_quant="f16")
    ref = convert_checkpoint(ck, tmp_path / "ref", quant="f16", dense_quant="f16")
    m = json.loads((st / "manifest.json").read_text())
    assert m["quant"] == "gguf" and m["gguf"]["expert_types"][0] == ["F16", "F16", "F16"]
    ids = np.random.default_rng(7).integers(1, 512, 24)
    got, want = _f32_logits(st, ids), _f32_logits(ref, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_q8_0_gguf_experts_are_the_published_blocks(olmoe_ck, tmp_path):
    """The slab of expert e holds row for row the bytes of GGUF's stacked tensor at index e."""
    write_gguf(olmoe_ck, tmp_path / "m.gguf", matrix_type="q8_0", log=lambda *_: None)
    st = convert_gguf(tmp_path / "m.gguf", tmp_path / "st")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    t = {x.name: x for x in r.tensors}["blk.1.ffn_down_exps.weight"]
    from engine.expert_store import ExpertStore
    with ExpertStore(st, o_direct=False) as s:
        buf = s.new_buffer()
        s.read(1, 5, buf, verify=True)
        v = s.views(buf)
        assert list(v["types"][:3]) == [8, 8, 8]
        assert np.array_equal(v["down_proj.q"], np.asarray(t.data[5]))


# --- bad files: one line, nothing left -----------------------------------------------------------

def _leftovers(dst: Path) -> list[str]:
    return [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}") or p.name == dst.name]


def _writer(path: Path, arch: str, skip: str = ""):
    w = gguf.GGUFWriter(str(path), arch)
    for key, fn, val in [("block_count", w.add_block_count, 1), ("embedding_length", w.add_embedding_length, 64),
                         ("head_count", w.add_head_count, 4), ("expert_count", w.add_expert_count, 4),
                         ("expert_used_count", w.add_expert_used_count, 2),
                         ("rms_eps", w.add_layer_norm_rms_eps, 1e-6), ("ff", w.add_feed_forward_length, 32),
                         ("eff", w.add_expert_feed_forward_length, 32)]:
        if key != skip:
            fn(val)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ["not_gguf", "empty", "fixed_header", "truncated_header", "short_data", "old_version",
                                  "new_version", "bad_value_type", "arch", "missing_key", "split_part_missing",
                                  "several_models"])
def test_bad_gguf_is_one_line_and_leaves_nothing(case, olmoe_ck, tmp_path, capsys):
    from engine.cli.main import main
    src = tmp_path / "in" / "model.gguf"
    src.parent.mkdir()
    if case == "not_gguf":
        src.write_text("<html>Not found</html>")
        want = "not a GGUF file"
    elif case == "empty":
        src.write_bytes(b"")
        want = "the file is empty (0 bytes): an interrupted or damaged download; download it again"
    elif case in ("fixed_header", "truncated_header", "short_data"):
        write_gguf(olmoe_ck, src, matrix_type="q8_0", log=lambda *_: None)
        data = src.read_bytes()
        end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(src).tensors)  # the file may pad beyond
        src.write_bytes(data[:{"fixed_header": 10, "truncated_header": 300, "short_data": -1000}[case]])
        want = {"fixed_header": "truncated GGUF file: 10 bytes, shorter than the 24 bytes of its fixed header",
                "truncated_header": "truncated GGUF file: it ends at 300 bytes, inside its header",
                "short_data": f"truncated GGUF file: {len(data) - 1000} bytes, but its tensor data ends at "
                              f"{end} bytes: an interrupted or damaged download; download it again"}[case]
    elif case in ("old_version", "new_version"):
        data = bytearray(_writer(src, "olmoe").read_bytes())
        data[4:8] = (1 if case == "old_version" else 4).to_bytes(4, "little")
        src.write_bytes(data)
        want = ("GGUF version 1, which cannot be read (versions 2 and 3 can); download a conversion made by a "
                "recent llama.cpp" if case == "old_version" else "GGUF version 4, which cannot be read (versions 2 "
                "and 3 can); update the gguf package")
    elif case == "bad_value_type":
        data = bytearray(_writer(src, "olmoe").read_bytes())
        key_len = int.from_bytes(data[24:32], "little")  # the first metadata key, then its value type
        data[32 + key_len:36 + key_len] = (99).to_bytes(4, "little")
        src.write_bytes(data)
        want = "damaged GGUF header (an unknown metadata value type)"
    elif case == "arch":
        _writer(src, "bert")
        want = "GGUF architecture 'bert' is not supported"
    elif case == "missing_key":
        _writer(src, "qwen3moe", skip="embedding_length")
        want = "has no qwen3moe.embedding_length"
    elif case == "split_part_missing":
        src = src.with_name("model-00001-of-00002.gguf")
        write_gguf(olmoe_ck, src, matrix_type="q8_0", log=lambda *_: None)
        want = "model-00002-of-00002.gguf is missing"
    else:
        write_gguf(olmoe_ck, src, matrix_type="q8_0", log=lambda *_: None)
        write_gguf(olmoe_ck, src.with_name("other.gguf"), matrix_type="q8_0", log=lambda *_: None)
        src = src.parent
        want = "holds 2 GGUF models"
    dst = tmp_path / "store"
    with pytest.raises((CheckpointError, ConfigError), match=re.escape(want)) as e:
        convert_gguf(src, dst)
    # numpy's or the gguf reader's own wording means nothing to the user
    assert not re.search(r"buffer|reshape|dtype|out of bounds|unpack|Sorry|Error", str(e.value)), e.value
    assert _leftovers(dst) == []
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0] and "Traceback" not in err[0]
    assert _leftovers(dst) == []


@pytest.mark.parametrize("group_size", [48, 33])
def test_dense_int4_width_or_odd_group_is_one_line_before_any_compute(group_size, olmoe_ck, tmp_path, monkeypatch,
                                                                      capsys):
    """--dense-quant int4 at a group size that does not divide a matrix's input width names the
    GGUF tensor, its shape, the group size and the way out; an odd group size is refused as
    convert's is; both before any tensor is decoded, the CLI's one line and exit 2."""
    from engine.cli.main import main
    from engine.gguf_import import GGUFSource
    src = tmp_path / "m.gguf"
    write_gguf(olmoe_ck, src, matrix_type="q8_0", log=lambda *_: None)
    if group_size == 48:
        want = ("--dense-quant int4 needs the input width of every dense matrix to be a multiple of the group size "
                "48, but blk.0.attn_q.weight is 128 x 128 (128 columns) (and 7 more); use --dense-quant int8, or "
                "--group-size 128")
    else:
        want = "--group-size 33: int4 needs an even group size (32 is the default)"

    def no_reads(self, hf, shape):
        raise AssertionError(f"{hf} decoded before the group size was checked")
    monkeypatch.setattr(GGUFSource, "get", no_reads)
    with pytest.raises((CheckpointError, ValueError), match=re.escape(want)):
        convert_gguf(src, tmp_path / "st", dense_quant="int4", group_size=group_size)
    assert _leftovers(tmp_path / "st") == []
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "st"), "--dense-quant", "int4", "--group-size",
                 str(group_size)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0]
    assert _leftovers(tmp_path / "st") == []


def test_split_and_folder_sources(tmp_path, olmoe_ck):
    """A split model is found from any of its parts and from its folder, in part order; a
    projector file beside a model is not a second model."""
    for k in (1, 2, 3):
        (tmp_path / f"m-{k:05d}-of-00003.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-m-f16.gguf").write_bytes(b"GGUF")
    want = [tmp_path / f"m-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    assert gguf_files(tmp_path / "m-00002-of-00003.gguf") == want
    assert gguf_files(tmp_path) == want


def _split_copy(src: Path, folder: Path, max_tensors: int) -> list[Path]:
    """``src`` re-written by gguf's writer as a split model ``m-0000K-of-0000N.gguf`` in ``folder``
    (the metadata in the first part, ``max_tensors`` tensors per part), as llama.cpp's
    gguf-split lays one out."""
    r = gguf.GGUFReader(src)
    folder.mkdir()
    w = gguf.GGUFWriter(str(folder / "m.gguf"), r.fields["general.architecture"].contents(),
                        split_max_tensors=max_tensors)
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(folder.glob("m-*-of-*.gguf"))


def test_split_model_imports_as_the_single_file(olmoe_ck, tmp_path, capsys):
    """A model split in parts (-00001-of-0000N.gguf, any part given, or the folder holding them)
    gives the single file's store: byte-identical expert slabs and the same logits; `colibri
    convert FOLDER STORE` takes the folder."""
    from engine.cli.main import main
    one = tmp_path / "one.gguf"
    write_gguf(olmoe_ck, one, matrix_type="q8_0", log=lambda *_: None)
    parts = _split_copy(one, tmp_path / "split", 8)
    assert len(parts) >= 3 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    a = convert_gguf(one, tmp_path / "a", dense_quant="f32")
    b = convert_gguf(parts[1], tmp_path / "b", dense_quant="f32")
    assert main(["convert", str(tmp_path / "split"), str(tmp_path / "c"), "--dense-quant", "f32"]) == 0
    for st in (b, tmp_path / "c"):
        for j in range(2):
            assert (a / f"experts/layer_{j:03d}.bin").read_bytes() == (st / f"experts/layer_{j:03d}.bin").read_bytes()
        assert json.loads((st / "manifest.json").read_text())["gguf"]["expert_types"] == \
            json.loads((a / "manifest.json").read_text())["gguf"]["expert_types"]
    ids = np.random.default_rng(3).integers(1, 512, 12)
    assert np.array_equal(_f32_logits(a, ids), _f32_logits(b, ids))


def test_cli_convert_refuses_quant_for_gguf(olmoe_ck, tmp_path, capsys):
    from engine.cli.main import main
    write_gguf(olmoe_ck, tmp_path / "m.gguf", matrix_type="q8_0", log=lambda *_: None)
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "st"), "--quant", "int4"]) == 2
    assert "--quant does not apply" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "st")]) == 0
    assert main(["info", str(tmp_path / "st")]) == 0


def test_slab_views_compute_the_swiglu_expert_and_biased_projections():
    """A GGUF slab of mixed types (Q4_K gate, Q8_0 up, Q6_K down) with biases: run_expert's
    SwiGLU equals the decoded matrices' math, and linear_views (what gpt-oss's expert uses) adds
    each projection's bias to its block product."""
    from engine import kernels_gguf as KG
    from engine.gguf_blocks import TYPE_IDS, row_bytes
    from engine.models.base import linear_views, run_expert
    from engine.quant import slab_views
    rng = np.random.default_rng(1)
    D, I = 256, 512
    types = {"gate_proj": TYPE_IDS["Q4_K"], "up_proj": TYPE_IDS["Q8_0"], "down_proj": TYPE_IDS["Q6_K"]}
    shapes = {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}
    widths = {p: row_bytes(types[p], shapes[p][1]) for p in types}
    lay = gguf_slab_layout(D, I, widths, bias=True)
    buf = np.zeros(lay["slot_bytes"], np.uint8)
    v = slab_views(buf, lay)
    dense = {}
    for k, p in enumerate(("gate_proj", "up_proj", "down_proj")):
        v["types"][k] = types[p]
        v[p + ".q"][:] = _random_blocks(types[p], shapes[p][0], shapes[p][1], rng)
        v[p + ".b"][:] = rng.standard_normal(shapes[p][0]).astype(np.float32)
        dense[p] = KG.dequantize(types[p], v[p + ".q"], shapes[p][1]).astype(np.float64)
    x = rng.standard_normal((3, D)).astype(np.float32)
    out = np.empty((3, D), np.float32)
    run_expert("gguf", v, x, np.empty((3, I), np.float32), out, 32)
    g, u = x @ dense["gate_proj"].T, x @ dense["up_proj"].T
    want = (g / (1 + np.exp(-g)) * u) @ dense["down_proj"].T
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    got = linear_views("gguf", v, "up_proj", x, np.empty((3, I), np.float32), 32)
    np.testing.assert_allclose(got, u + v["up_proj.b"], rtol=1e-4, atol=1e-4 * np.abs(u).max())


def _llama_moe_gguf(path: Path, per_expert: bool, rng_seed: int = 4) -> Path:
    """A tiny llama-architecture MoE (Mixtral) GGUF written with gguf's writer: the experts as
    llama.cpp stacks them (blk.N.ffn_gate_exps) or, as files converted before that did, one tensor
    per expert (blk.N.ffn_gate.E.weight); Q8_0 expert rows, F32 elsewhere."""
    rng = np.random.default_rng(rng_seed)
    D, I, E, L, V, H, KV = 64, 64, 4, 2, 96, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)

    def f(*shape, s=0.1):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    w.add_tensor("token_embd.weight", f(V, D))
    w.add_tensor("output_norm.weight", 1 + f(D))
    w.add_tensor("output.weight", f(V, D))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + f(D))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + f(D))
        for n, o in (("attn_q", D), ("attn_k", D // H * KV), ("attn_v", D // H * KV), ("attn_output", D)):
            w.add_tensor(f"blk.{i}.{n}.weight", f(o, D))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", f(E, D, s=1.0))
        for n, (o, k) in (("ffn_gate", (I, D)), ("ffn_up", (I, D)), ("ffn_down", (D, I))):
            x = f(E, o, k)
            if per_expert:
                for e in range(E):
                    w.add_tensor(f"blk.{i}.{n}.{e}.weight", gguf.quants.quantize(x[e], q8), raw_dtype=q8)
            else:
                w.add_tensor(f"blk.{i}.{n}_exps.weight", gguf.quants.quantize(x, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_per_expert_mixtral_file_imports_as_the_stacked_one(tmp_path):
    """A Mixtral GGUF with one tensor per expert (files converted before llama.cpp stacked them)
    gives byte-identical expert slabs and the same logits as the stacked layout of the same weights."""
    a = convert_gguf(_llama_moe_gguf(tmp_path / "stacked.gguf", False), tmp_path / "a")
    b = convert_gguf(_llama_moe_gguf(tmp_path / "old.gguf", True), tmp_path / "b")
    for j in range(2):
        assert (a / f"experts/layer_{j:03d}.bin").read_bytes() == (b / f"experts/layer_{j:03d}.bin").read_bytes()
    assert json.loads((a / "config.json").read_text())["model_type"] == "mixtral"
    ids = np.arange(1, 17)
    la, lb = _f32_logits(a, ids), _f32_logits(b, ids)
    assert np.array_equal(la, lb) and np.isfinite(la).all()


def test_a_gguf_file_given_as_a_store_says_to_import_it(tmp_path, capsys):
    """`colibri info FILE.gguf` (and run / serve, which open the store the same way) names the
    import command, in one line."""
    from engine.cli.main import main
    f = tmp_path / "Model-Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    assert main(["info", str(f)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"import it first with `colibri convert {f} Model-Q4_K_M-gguf`" in err[0], err
