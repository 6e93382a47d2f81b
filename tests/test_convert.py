"""Converter and store: layout, atomic publish, and every bad input named before compute."""

from __future__ import annotations

import json
import re
import shutil
import threading

import numpy as np
import pytest

from engine import (CheckpointError, ConfigError, ContextOverflowError, Engine, EngineConfig,
                    ExpertReadError, GenerateRequest, StoreError, convert_checkpoint)
from engine.config import ModelArgs
from engine.convert import ConversionCancelled
from engine.store_format import FORMAT_VERSION
from engine.expert_store import ExpertStore
from engine.quant import ALIGN, dequantize_int4, quantize_int4
from engine.bench.synthetic import olmoe_config, write_checkpoint


def copy_ck(src, tmp_path, name="ck"):
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def test_store_layout_one_aligned_slab_per_expert(tiny_store):
    m = json.loads((tiny_store / "manifest.json").read_text())
    assert m["format"] == "colibri-expert-store" and m["version"] == FORMAT_VERSION == 4
    assert m["quant"] == "int8" and m["alignment"] == ALIGN and m["expert_layout"] == "row_major"
    offsets = set()
    for row in m["experts"]:
        for e in row:
            assert e["offset"] % ALIGN == 0 and e["length"] % ALIGN == 0
            assert e["length"] == m["slab_layout"]["slot_bytes"]
            offsets.add((e["file"], e["offset"]))
    assert len(offsets) == m["num_layers"] * m["num_experts"]
    for f in ("dense.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_store / f).exists()


def test_int4_packs_two_values_per_byte():
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    packed, scale = quantize_int4(w, 32)
    assert packed.shape == (8, 32) and packed.dtype == np.uint8 and scale.shape == (8, 2)
    err = np.abs(dequantize_int4(packed, scale, 32) - w).max()
    assert err <= np.abs(w).max() / 7 / 2 + 1e-6


def test_f16_and_int4_stores_are_smaller(tiny_checkpoint, tmp_path):
    sizes = {}
    for q in ("f32", "f16", "int8", "int4"):
        st = convert_checkpoint(tiny_checkpoint, tmp_path / q, quant=q)
        sizes[q] = json.loads((st / "manifest.json").read_text())["slab_layout"]["data_bytes"]
    assert sizes["f32"] > sizes["f16"] > sizes["int8"] > sizes["int4"]


def test_refuses_to_overwrite_unless_asked(tiny_checkpoint, tiny_store):
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_checkpoint(tiny_checkpoint, tiny_store)


def test_cancel_leaves_no_store(tiny_checkpoint, tmp_path):
    cancel = threading.Event()
    seen = []

    def progress(ev):
        seen.append(ev.done)
        cancel.set()

    dst = tmp_path / "cancelled"
    with pytest.raises(ConversionCancelled):
        convert_checkpoint(tiny_checkpoint, dst, progress=progress, cancel=cancel)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_partial_folder_is_never_taken_for_a_store(tiny_store, tmp_path):
    fake = tmp_path / "x.partial"
    shutil.copytree(tiny_store, fake)
    with pytest.raises(StoreError, match="unfinished"):
        ExpertStore(fake)
    (tmp_path / "nomanifest").mkdir()
    with pytest.raises(StoreError, match="not a converted store"):
        ExpertStore(tmp_path / "nomanifest")


def test_missing_config_key(tiny_checkpoint, tmp_path):
    d = copy_ck(tiny_checkpoint, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_experts"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json.*'num_experts' is missing"):
        convert_checkpoint(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_numeric_config_key(tmp_path):
    cfg = olmoe_config(hidden_size="sixty-four")
    with pytest.raises(ConfigError, match="'hidden_size' must be a number"):
        ModelArgs.from_dict(cfg, "x/config.json")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelArgs.from_dict(olmoe_config(num_experts_per_tok=99), "x/config.json")
    with pytest.raises(ConfigError, match="not supported"):
        ModelArgs.from_dict(olmoe_config(model_type="llama"), "x/config.json")


def test_header_claims_more_bytes_than_file(tiny_checkpoint, tmp_path):
    d = copy_ck(tiny_checkpoint, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors.*truncated"):
        convert_checkpoint(d, tmp_path / "out")


def test_lfs_pointer_instead_of_weights(tiny_checkpoint, tmp_path):
    d = copy_ck(tiny_checkpoint, tmp_path)
    (d / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    with pytest.raises(CheckpointError, match="Git LFS pointer"):
        convert_checkpoint(d, tmp_path / "out")


def test_missing_shard(tmp_path):
    cfg = olmoe_config(hidden_size=64, intermediate_size=32)
    d = write_checkpoint(tmp_path / "sharded", cfg, seed=0, shard_bytes=20_000, tokenizer=False)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 2
    (d / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"{shards[1]}.*missing"):
        convert_checkpoint(d, tmp_path / "out")


def test_sharded_checkpoint_converts_like_single(tmp_path):
    cfg = olmoe_config()
    a = write_checkpoint(tmp_path / "one", cfg, seed=9, tokenizer=False)
    b = write_checkpoint(tmp_path / "many", cfg, seed=9, shard_bytes=30_000, tokenizer=False)
    sa = convert_checkpoint(a, tmp_path / "sa", quant="int8")
    sb = convert_checkpoint(b, tmp_path / "sb", quant="int8")
    assert (sa / "experts" / "layer_001.bin").read_bytes() == (sb / "experts" / "layer_001.bin").read_bytes()


def test_shape_disagrees_with_config(tiny_checkpoint, tmp_path):
    d = copy_ck(tiny_checkpoint, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape \[32, 64\].*\[40, 64\]"):
        convert_checkpoint(d, tmp_path / "out")


def test_corrupt_expert_slab_fails_checksum(tiny_store, tmp_path):
    st = tmp_path / "corrupt"
    shutil.copytree(tiny_store, st)
    (st / "routing_heat.json").unlink(missing_ok=True)
    m = json.loads((st / "manifest.json").read_text())
    for meta in m["experts"][0]:  # every expert of layer 0: any token routes into one
        with open(st / meta["file"], "r+b") as f:
            f.seek(meta["offset"] + 10)
            f.write(b"\x55\x66\x77")
    store = ExpertStore(st, o_direct=False)
    buf = store.new_buffer()
    with pytest.raises(ExpertReadError, match="checksum"):
        store.read(0, 0, buf, verify=True)
    store.close()
    # Through the engine: the generation ends with a clear error, not garbage.
    with Engine.open(EngineConfig(store=str(st), pilot=0, pinning=False, history=False)) as eng:
        evs = list(eng.generate(GenerateRequest(prompt_ids=tuple(range(1, 40)))))
        fin = evs[-1]
        assert fin.finish_reason == "error" and "checksum" in fin.error and "layer 0" in fin.error


def test_prompt_longer_than_context(tiny_store):
    with Engine.open(EngineConfig(store=str(tiny_store), context_length=16, pilot=0)) as eng:
        with pytest.raises(ContextOverflowError, match="16"):
            eng.generate(GenerateRequest(prompt_ids=tuple(range(1, 17))))
        fin = list(eng.generate(GenerateRequest(prompt_ids=tuple(range(1, 10)))))[-1]
        assert fin.finish_reason in ("length", "stop")


def test_overwrite_never_deletes_a_folder_that_is_not_a_store(tiny_checkpoint, tmp_path):
    """`convert --overwrite` replaces a store, never a user's folder: a non-empty folder without
    manifest.json is refused (its files untouched), with or without overwrite; a file is refused;
    an empty folder is used; an existing store needs overwrite and is then replaced."""
    from engine import convert_checkpoint
    user = tmp_path / "Documents"
    user.mkdir()
    (user / "keep.txt").write_text("precious")
    for ow in (False, True):
        with pytest.raises(FileExistsError, match="not a colibri store"):
            convert_checkpoint(tiny_checkpoint, user, quant="f32", overwrite=ow)
    assert (user / "keep.txt").read_text() == "precious" and sorted(p.name for p in user.iterdir()) == ["keep.txt"]
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        convert_checkpoint(tiny_checkpoint, f, quant="f32", overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (convert_checkpoint(tiny_checkpoint, empty, quant="f32") / "manifest.json").is_file()
    with pytest.raises(FileExistsError, match="store already exists"):
        convert_checkpoint(tiny_checkpoint, empty, quant="f32")
    assert (convert_checkpoint(tiny_checkpoint, empty, quant="int8", overwrite=True) / "manifest.json").is_file()


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """An OLMoE checkpoint whose expert width (128) lets int4 slabs be stored interleaved."""
    return write_checkpoint(tmp_path_factory.mktemp("wide") / "ck",
                            olmoe_config(num_key_value_heads=2, intermediate_size=128), seed=5)


def _logits(store, **kw):
    with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, pilot=0, **kw)) as eng:
        return eng.model.forward(np.arange(3, 20), 0, all_logits=True)


def test_format_3_store_without_expert_layout_still_opens(wide_checkpoint, tmp_path):
    """Stores written before format 4 have no "expert_layout" (row-major slabs): they open as
    before and give the logits of a format-4 row-major store, bit for bit."""
    v4 = convert_checkpoint(wide_checkpoint, tmp_path / "v4", quant="int4", expert_layout="row_major")
    v3 = tmp_path / "v3"
    shutil.copytree(v4, v3)
    m = json.loads((v3 / "manifest.json").read_text())
    assert m["version"] == 4 and m.pop("expert_layout") == "row_major"
    m["version"] = 3
    (v3 / "manifest.json").write_text(json.dumps(m))
    assert ExpertStore(v3).expert_layout == "row_major"
    assert np.array_equal(_logits(v3), _logits(v4))


@pytest.mark.parametrize("edit", ["says_row_major", "unknown", "int8"])
def test_expert_layout_that_disagrees_with_the_slabs_is_a_damaged_store(wide_checkpoint, tiny_store, tmp_path, edit):
    """A manifest whose expert_layout does not match its slab layout (or is unknown, or claims
    interleaving for int8) is refused naming the manifest and the reconvert, before any read."""
    src = tiny_store if edit == "int8" else convert_checkpoint(wide_checkpoint, tmp_path / "il", quant="int4",
                                                             expert_layout="interleaved_4")
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    m = json.loads((d / "manifest.json").read_text())
    m["expert_layout"] = {"says_row_major": "row_major", "unknown": "diagonal", "int8": "interleaved_4"}[edit]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"manifest.json: damaged .*(expert_layout|slab_layout).*colibri convert --overwrite"):
        ExpertStore(d)


def test_version_and_layout_must_agree(wide_checkpoint, tmp_path):
    """An interleaved store claiming a version before 4, or a version that is not a whole
    number, is refused as damaged / unknown; a damaged row-major store's reconvert hint keeps
    --expert-layout row_major (a bare command would pick auto: interleaved on this CPU)."""
    from engine.store_format import check_store_files
    il = convert_checkpoint(wide_checkpoint, tmp_path / "il", quant="int4", expert_layout="interleaved_4")
    for version, match in ((3, r"expert_layout 'interleaved_4' in a store of version 3"), (4.0, "store version 4.0"),
                           (True, "store version True")):
        d = tmp_path / f"v{version}"
        shutil.copytree(il, d)
        m = json.loads((d / "manifest.json").read_text())
        m["version"] = version
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(StoreError, match=match):
            ExpertStore(d)
    rm = convert_checkpoint(wide_checkpoint, tmp_path / "rm", quant="int4", dense_quant="int4", expert_layout="row_major")
    m = json.loads((rm / "manifest.json").read_text())
    f = rm / m["experts"][0][0]["file"]
    f.write_bytes(f.read_bytes()[:4096])
    with pytest.raises(StoreError, match=r"colibri convert --overwrite --quant int4 --dense-quant int4 "
                                         r"--expert-layout row_major \S+ \S+rm`"):
        check_store_files(rm, m)


def test_convert_cli_expert_layout_and_info(wide_checkpoint, tiny_checkpoint, tmp_path, capsys):
    """`colibri convert --expert-layout interleaved_4` writes an interleaved store that `colibri
    info` describes; asking it of widths it cannot take is one clear line, no store, exit 2."""
    from engine.cli.main import main
    dst = tmp_path / "il"
    assert main(["convert", str(wide_checkpoint), str(dst), "--quant", "int4", "--expert-layout", "interleaved_4"]) == 0
    assert json.loads((dst / "manifest.json").read_text())["expert_layout"] == "interleaved_4"
    capsys.readouterr()
    assert main(["info", str(dst)]) == 0
    assert "experts stored row-interleaved by 4" in capsys.readouterr().out
    bad = tmp_path / "bad"
    rc = main(["convert", str(tiny_checkpoint), str(bad), "--quant", "int4", "--expert-layout", "interleaved_4"])
    err = capsys.readouterr().err
    assert rc != 0 and "interleaved_4 needs int4 experts" in err and "Traceback" not in err
    assert not bad.exists()


def test_numpy_fallback_runs_interleaved_and_row_major_stores(wide_checkpoint, tmp_path):
    """Without numba (COLIBRI_NO_NUMBA=1: engine/kernels_ref.py) the engine opens an int4 store
    with interleaved experts and int4 attention, warms up and answers: its logits stay within 2%
    of the numba run's largest logit (the twins sum in another order, and an activation that
    rounds to the next int8 step there moves later layers; a misread layout moves them by ~100%),
    for both expert layouts."""
    import os
    import subprocess
    import sys
    stores = {el: convert_checkpoint(wide_checkpoint, tmp_path / el, quant="int4", dense_quant="int4",
                                     expert_layout=el) for el in ("interleaved_4", "row_major")}
    code = ("import sys, numpy as np\n"
            "from engine import Engine, EngineConfig\n"
            "import engine.models.base as base\n"
            "assert base.K.__name__ == 'engine.kernels_ref', base.K.__name__\n"
            "for st in sys.argv[1:]:\n"
            "    with Engine.open(EngineConfig(store=st, history=False, o_direct=False, pilot=0, cap=3)) as eng:\n"
            "        np.save(st + '.ref.npy', eng.model.forward(np.arange(3, 20), 0, all_logits=True))\n"
            "        eng.model.forward(np.arange(3, 20), 0, all_logits=True)  # resident now: the sorted prefill path\n")
    env = {**os.environ, "COLIBRI_NO_NUMBA": "1"}
    p = subprocess.run([sys.executable, "-c", code, *map(str, stores.values())], env=env, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    for st in stores.values():
        ref = np.load(str(st) + ".ref.npy")
        got = _logits(st, cap=3)
        assert np.allclose(got[0], ref[0], rtol=1e-4, atol=1e-5)  # the first position: before any drift
        assert float(np.abs(got - ref).max()) < 0.02 * float(np.abs(ref).max())


def test_a_float32_checkpoint_converts_without_loading_ml_dtypes(tmp_path):
    """ml_dtypes (bfloat16, float8 for numpy) takes most of a CPU second to import; the bundled
    default model is float32, and its conversion is part of every first start."""
    import subprocess
    import sys
    from pathlib import Path
    ck = write_checkpoint(tmp_path / "f32", olmoe_config(num_key_value_heads=2), seed=3, dtype="f32")
    code = ("import sys; from engine import convert_checkpoint; convert_checkpoint(sys.argv[1], sys.argv[2]); "
            "print('ml_dtypes' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", code, str(ck), str(tmp_path / "st")], cwd=root, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "st" / "manifest.json").is_file()


@pytest.mark.parametrize("group_size", [48, 32])
def test_dense_int4_width_mismatch_names_the_tensor_before_any_compute(tmp_path, monkeypatch, group_size):
    """--dense-quant int4 with a dense matrix whose input width the group size does not divide
    (a hidden size of 64 at group size 48; MLA's k_absorb, kv_b_proj split to qk_nope_head_dim 16
    columns, at 32): one line naming the tensor, its shape, the group size and the way out, before
    any tensor is read; the CLI says it and exits 2."""
    from engine.bench.synthetic import deepseek_v3_config
    from engine.checkpoint import Checkpoint
    from engine.cli.main import main
    if group_size == 48:
        ck = write_checkpoint(tmp_path / "ck", olmoe_config(), seed=0, tokenizer=False)
        want = ("--dense-quant int4 needs the input width of every dense matrix to be a multiple of the group "
                "size 48, but model.layers.0.self_attn.q_proj.weight is 64 x 64 (64 columns) (and ")
        fit = "; use --dense-quant int8, or --group-size 64"
    else:
        ck = write_checkpoint(tmp_path / "ck", deepseek_v3_config(), seed=0, tokenizer=False)
        want = ("size 32, but model.layers.0.self_attn.kv_b_proj.weight (as k_absorb) is 128 x 16 (16 columns) "
                "(and 2 more)")
        fit = "; use --dense-quant int8, or --group-size 16"

    def no_reads(self, name):
        raise AssertionError(f"{name} read before the widths were checked")
    monkeypatch.setattr(Checkpoint, "get", no_reads)
    with pytest.raises(CheckpointError, match=re.escape(want) + ".*" + re.escape(fit) + "$"):
        convert_checkpoint(ck, tmp_path / "st", quant="int8", dense_quant="int4", group_size=group_size)
    assert not (tmp_path / "st").exists()
    assert main(["convert", str(ck), str(tmp_path / "st"), "--dense-quant", "int4",
                 "--group-size", str(group_size)]) == 2
    assert not (tmp_path / "st").exists()


def test_int4_width_mismatch_names_a_group_size_that_fits(tmp_path):
    """Widths that are not multiples of the default group size: the one line says int8, or the
    largest group size dividing both widths, and that size converts."""
    ck = write_checkpoint(tmp_path / "ck", olmoe_config(hidden_size=48, intermediate_size=24), seed=0)
    with pytest.raises(CheckpointError, match=r"group size 32, but each routed expert's gate_proj and up_proj are "
                                              r"24 x 48 \(48 columns\); use int8, or int4 with --group-size 24$"):
        convert_checkpoint(ck, tmp_path / "st", quant="int4")
    assert not (tmp_path / "st").exists()
    assert convert_checkpoint(ck, tmp_path / "st", quant="int4", group_size=24)
