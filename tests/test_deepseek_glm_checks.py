"""DeepSeek / GLM checkpoints: FP8 scale checks (dtype, zero / negative / NaN, the
assumed 128x128 block), unused checkpoint tensors named as notes and in the manifest (MTP
layers only when present, q/k norms under use_qk_norm false), Ctrl+C in `colibri convert`,
`colibri run --model NAME` from `colibri models`, and the lines `colibri info` adds (rope /
YaRN, q/k norm and biases, no tokenizer, index_topk covering the context).

Tiny checkpoints are written with numpy (engine.bench.synthetic.write_checkpoint); FP8 ones get
float8_e4m3fn weights and float32 ``weight_scale_inv`` block scales as the published ones.
"""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from colibri_app.launcher import main as colibri
from engine import CheckpointError, convert_checkpoint
from engine.bench.synthetic import deepseek_v3_config, glm4_moe_config, glm_moe_dsa_config, write_checkpoint

KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


_DT = {"F32": np.float32, "I32": np.int32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _load(p) -> dict:
    """A safetensors file as numpy arrays, float8 included (safetensors.numpy cannot load it)."""
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             dtype=_DT[v["dtype"]]).reshape(v["shape"]).copy() for k, v in head.items()}


def _edit(folder, fn):
    p = folder / "model.safetensors"
    sd = _load(p)
    fn(sd)
    save_file(sd, str(p), metadata={"format": "pt"})


def _cfg_edit(folder, **kw):
    p = folder / "config.json"
    c = json.loads(p.read_text())
    for k, v in kw.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    p.write_text(json.dumps(c))


def fp8_checkpoint(folder, bo=16, bi=32, qconfig=True):
    """A tiny DeepSeek-V3 checkpoint whose 2-D projections are block-scaled float8."""
    write_checkpoint(folder, deepseek_v3_config(num_nextn_predict_layers=0), dtype="f32")

    def fp8(sd):
        for k in [k for k in sd if sd[k].ndim == 2 and k.endswith(("_proj.weight", "_mqa.weight"))]:
            w = sd[k]
            O, N = w.shape
            so, si = -(-O // bo), -(-N // bi)
            s = np.empty((so, si), np.float32)
            q = np.empty((O, N), np.float32)
            for a in range(so):
                for b in range(si):
                    blk = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi]
                    s[a, b] = max(np.abs(blk).max(), 1e-12) / 448
                    q[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = blk / s[a, b]
            sd[k], sd[k + "_scale_inv"] = q.astype(ml_dtypes.float8_e4m3fn), s
    _edit(folder, fp8)
    if qconfig:
        _cfg_edit(folder, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                               "activation_scheme": "dynamic", "weight_block_size": [bo, bi]})
    return folder


@pytest.fixture(scope="module")
def fp8_ck(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "ck")


def _bad(fp8_ck, tmp_path, fn):
    d = tmp_path / "bad"
    shutil.copytree(fp8_ck, d)
    _edit(d, fn)
    return d


def test_fp8_checkpoint_converts(fp8_ck, tmp_path):
    store = convert_checkpoint(fp8_ck, tmp_path / "st", quant="int8")
    assert "skipped" not in json.loads((store / "manifest.json").read_text())


def test_fp8_scale_of_integer_dtype_names_the_dtype(fp8_ck, tmp_path):
    d = _bad(fp8_ck, tmp_path, lambda sd: sd.__setitem__(KV_B + "_scale_inv", sd[KV_B + "_scale_inv"].astype(np.int32)))
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(d, tmp_path / "st")
    msg = str(e.value)
    assert f"'{KV_B}_scale_inv' has dtype I32" in msg and "float32" in msg and "download" in msg
    assert "implies" not in msg and not (tmp_path / "st").exists()


@pytest.mark.parametrize("value,said", [(0.0, "= 0.0"), (-1.0, "= -"), (np.nan, "= nan"), (np.inf, "= inf")])
def test_fp8_scale_zero_negative_nan_names_the_scale_tensor(fp8_ck, tmp_path, value, said):
    def f(sd):
        s = sd[KV_B + "_scale_inv"]
        s[0, 0] = -s[0, 0] if value < 0 else value
    d = _bad(fp8_ck, tmp_path, f)
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(d, tmp_path / "st")
    msg = str(e.value)
    assert f"tensor '{KV_B}_scale_inv' element [0, 0] {said}" in msg and "positive and finite" in msg
    assert not (tmp_path / "st").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_fp8_without_quantization_config_says_128_was_assumed(tmp_path):
    d = fp8_checkpoint(tmp_path / "ck", qconfig=False)
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(d, tmp_path / "st")
    msg = str(e.value)
    assert "config.json has no quantization_config, so 128x128 blocks were assumed" in msg
    assert '"weight_block_size"' in msg and "_scale_inv" in msg


def test_fp8_wrong_block_size_names_the_configured_one(fp8_ck, tmp_path):
    d = tmp_path / "bs"
    shutil.copytree(fp8_ck, d)
    _cfg_edit(d, quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]})
    with pytest.raises(CheckpointError, match=r"weight_block_size \[32, 32\] implies"):
        convert_checkpoint(d, tmp_path / "st")


def _mtp_layer(sd, nhl=3):
    for k in [k for k in sd if k.startswith(f"model.layers.{nhl - 1}.")]:
        sd[k.replace(f"layers.{nhl - 1}.", f"layers.{nhl}.")] = sd[k].copy()
    sd[f"model.layers.{nhl}.eh_proj.weight"] = np.zeros((64, 128), np.float32)


@pytest.mark.parametrize("mtp", [0, 1])
def test_mtp_tensors_named_only_when_present(tmp_path, mtp):
    d = write_checkpoint(tmp_path / "ck", deepseek_v3_config(num_nextn_predict_layers=mtp))
    notes = []
    store = convert_checkpoint(d, tmp_path / "st", progress=lambda p: notes.append(p.message))
    assert "skipped" not in json.loads((store / "manifest.json").read_text())
    assert not [n for n in notes if n.startswith("skipping")]
    _edit(d, _mtp_layer)
    notes.clear()
    store = convert_checkpoint(d, tmp_path / "st2", progress=lambda p: notes.append(p.message))
    sk = json.loads((store / "manifest.json").read_text())["skipped"]
    assert len(sk) == 1 and sk[0].startswith("model.layers.3.* (")
    assert ("multi-token-prediction layer, not used" in sk[0]) if mtp else \
        ("num_nextn_predict_layers 0 does not describe" in sk[0])
    assert f"skipping {sk[0]}" in notes


def test_qk_norm_tensors_with_use_qk_norm_false_are_named(tmp_path):
    d = write_checkpoint(tmp_path / "ck", glm4_moe_config(num_nextn_predict_layers=0))
    _cfg_edit(d, use_qk_norm=False)
    notes = []
    store = convert_checkpoint(d, tmp_path / "st", progress=lambda p: notes.append(p.message))
    sk = json.loads((store / "manifest.json").read_text())["skipped"]
    assert [s.split(" (")[0] for s in sk] == ["model.layers.*.self_attn.k_norm.weight",
                                              "model.layers.*.self_attn.q_norm.weight"]
    assert all("3 tensors" in s and "use_qk_norm is false" in s for s in sk)
    assert all(f"skipping {s}" in notes for s in sk)


def test_ctrl_c_during_convert_one_line_exit_130_nothing_left(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from engine.cli import run

    def printer(label):
        def progress(p):
            if p.message.startswith("model.layers"):
                raise KeyboardInterrupt
        return progress
    monkeypatch.setattr(run, "_progress_printer", printer)
    assert colibri(["convert", str(tiny_checkpoint), str(tmp_path / "st")]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [
        f"colibri: interrupted; no store was written to {tmp_path / 'st'}"]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_in_any_other_command_is_one_line(tiny_store, monkeypatch, capsys):
    from engine.cli import run

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "describe_store", boom)
    assert colibri(["info", str(tiny_store)]) == 130
    assert capsys.readouterr().err.strip() == "colibri: interrupted"


def test_run_model_by_name_from_colibri_models(tiny_store, capsys):
    from engine.library import models_dir
    shutil.copytree(tiny_store, models_dir() / "tiny-int8")
    m = json.loads((models_dir() / "tiny-int8" / "manifest.json").read_text())
    assert colibri(["models"]) == 0
    assert m["model_name"] in capsys.readouterr().out
    for name in (m["model_name"], "tiny-int8"):
        assert colibri(["run", "--model", name, "--prompt", "hello", "--raw", "--max-new-tokens", "2",
                        "--no-history", "--threads", "1"]) == 0, capsys.readouterr().err
        assert colibri(["info", name]) == 0
        assert f"store       {models_dir() / 'tiny-int8'}" in capsys.readouterr().out
    shutil.copytree(tiny_store, models_dir() / "tiny-f16")  # same model name twice: ask for the folder
    assert colibri(["info", m["model_name"]]) == 2
    err = capsys.readouterr().err
    assert "2 converted models have that name" in err and "tiny-int8" in err and "tiny-f16" in err
    assert colibri(["info", "no-such-model"]) == 2  # neither a path nor a name: the store error as before


def test_info_rope_yarn_qk_norm_bias_tokenizer_and_dense_dsa(tmp_path, capsys):
    from engine.bench.synthetic import write_store_from_seed
    glm = write_store_from_seed(tmp_path / "glm", glm4_moe_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "partial_rotary_factor": 0.5}))
    assert colibri(["info", str(glm)]) == 0
    out = capsys.readouterr().out
    assert "rope        theta 10000, YaRN scaling factor 4 (original context 512" in out
    assert "q/k RMSNorm per head, q/k/v biases)" in out
    plain = write_store_from_seed(tmp_path / "ds", deepseek_v3_config())
    assert colibri(["info", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "rope        theta 10000, no scaling (plain RoPE)" in out and "warning" not in out
    (plain / "tokenizer.json").unlink()
    assert colibri(["info", str(plain)]) == 0
    assert "warning     the store has no tokenizer.json: it cannot take a text prompt" in capsys.readouterr().out
    dsa = write_store_from_seed(tmp_path / "dsa", glm_moe_dsa_config(index_topk=512))
    assert colibri(["info", str(dsa), "--context-length", "256"]) == 0
    assert "index_topk 512 >= the context 256 tokens" in capsys.readouterr().out
    assert colibri(["info", str(dsa), "--context-length", "1024"]) == 0
    assert "index_topk 512 >=" not in capsys.readouterr().out
