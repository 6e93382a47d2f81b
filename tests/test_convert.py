"""Converter and store: layout, atomic publish, and every bad input named before compute."""

from __future__ import annotations

import json
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
from engine.synthetic import olmoe_config, write_checkpoint


def copy_ck(src, tmp_path, name="ck"):
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def test_store_layout_one_aligned_slab_per_expert(tiny_store):
    m = json.loads((tiny_store / "manifest.json").read_text())
    assert m["format"] == "colibri-expert-store" and m["version"] == FORMAT_VERSION == 3
    assert m["quant"] == "int8" and m["alignment"] == ALIGN
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
