"""`colibri bench layouts`: the same model's stores in one process, requests alternated."""

from __future__ import annotations

import json

import pytest

from engine import convert_checkpoint
from engine.bench.synthetic import olmoe_config, write_checkpoint


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    ck = write_checkpoint(d / "ck", olmoe_config(num_key_value_heads=2, intermediate_size=128), seed=2)
    other = write_checkpoint(d / "ck2", olmoe_config(num_key_value_heads=2, intermediate_size=128), seed=9)
    return {"rm": convert_checkpoint(ck, d / "rm", quant="int4", expert_layout="row_major"),
            "il": convert_checkpoint(ck, d / "il", quant="int4", expert_layout="interleaved_4"),
            "other": convert_checkpoint(other, d / "other", quant="int4", expert_layout="row_major")}


def test_bench_layouts_writes_paired_ratios(two_layouts, tmp_path):
    from engine.cli.main import main
    rc = main(["bench", "layouts", "--stores", f"rm={two_layouts['rm']}", f"il={two_layouts['il']}", "--reps", "3",
               "--prompt", "8", "--tokens", "4", "--threads", "1", "--name", "t", "--out-dir", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "t.json").read_text())
    assert [r["arm"] for r in res["runs"]] == ["rm", "il", "il", "rm", "rm", "il"]  # order reversed every other rep
    il = res["arms"]["il"]
    assert il["expert_layout"] == "interleaved_4" and res["arms"]["rm"]["expert_layout"] == "row_major"
    assert il["tg_paired_ratio"] > 0 and 0 <= il["tg_faster_in"] <= 3 and "tg_paired_ratio" not in res["arms"]["rm"]
    md = (tmp_path / "t.md").read_text()
    assert "| il | interleaved_4 |" in md and " / 3 |" in md and "1 thread;" in md and "tok/s" in md


def test_bench_layouts_refuses_different_models_and_one_arm(two_layouts, tmp_path):
    from engine.bench.layouts import run
    with pytest.raises(ValueError, match="different logits: not the same model"):
        run([("rm", str(two_layouts["rm"])), ("other", str(two_layouts["other"]))], 1, 1, 8, 2, 0)
    with pytest.raises(ValueError, match="at least two"):
        run([("rm", str(two_layouts["rm"]))], 1, 1, 8, 2, 0)
    with pytest.raises(ValueError, match="each arm needs its own label"):
        run([("rm", str(two_layouts["rm"])), ("rm", str(two_layouts["il"]))], 1, 1, 8, 2, 0)
    with pytest.raises(ValueError, match=r"--stores x=.*nothere.*config.json"):
        run([("rm", str(two_layouts["rm"])), ("x", str(tmp_path / "nothere"))], 1, 1, 8, 2, 0)


@pytest.mark.parametrize("argv, match", [
    (["--reps", "0"], "--reps '0': give a whole number of at least 1"),
    (["--tokens", "-1"], "--tokens '-1': give a whole number of at least 1"),
    (["--stores", "=x", "b=y"], "the label before '=' must be"),
    (["--stores", "a|b=x", "b=y"], "the label before '=' must be"),
    (["--stores", "a=", "b=y"], "give the store folder after '='"),
])
def test_bench_layouts_bad_arguments_are_one_line_errors(argv, match, capsys):
    from engine.cli.main import main
    args = ["bench", "layouts"] + (argv if "--stores" in argv else ["--stores", "a=x", "b=y", *argv])
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
