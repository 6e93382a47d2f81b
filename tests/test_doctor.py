"""``colibri --version`` and ``colibri doctor``: every fact a bug report needs, on a
fresh data folder, with models, on a read-only data folder, and where the data folder cannot
be created; the disk test is bounded and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import __version__
from engine.cli import main
from engine.cli import doctor as D

from ro_helpers import make_read_only, read_only_prefix, restore_writable

ROOT = Path(__file__).resolve().parent.parent
LABELS = frozenset(("colibri", "python", "os", "packages", "cpu", "cpu features", "cpu target", "threads", "numba cache",
          "pre-built", "memory", "cgroup", "data folder", "config", "disk read", "default", "models"))


def _doctor(capsys, *args) -> str:
    assert main(["doctor", "--disk-test-mb", "4", *args]) == 0
    return capsys.readouterr().out


def _labels(out: str) -> set[str]:
    return {line[:13].strip() for line in out.splitlines() if line[:13].strip()}


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"colibri-desktop {__version__} (python; Python ")
    assert len(out.splitlines()) == 1


def test_version_matches_the_package_metadata():
    """pyproject.toml reads the version from engine.__version__ (one place)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in text and 'attr = "engine.__version__"' in text


def test_doctor_on_a_fresh_data_folder(capsys, tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(data))
    out = _doctor(capsys)
    assert LABELS <= _labels(out), out
    line = {ln[:13].strip(): ln[13:] for ln in out.splitlines() if ln[:13].strip()}
    assert __version__ in line["colibri"]
    for pkg in ("numpy", "numba", "llvmlite", "PySide6", "tokenizers", "safetensors"):
        assert f"{pkg} " in line["packages"] and f"{pkg} not installed" not in line["packages"], line["packages"]
    assert "avx2" in line["cpu features"] or "neon" in line["cpu features"] or "unknown" in line["cpu features"]
    assert "threading layer" in line["threads"]
    assert str(data) in line["data folder"] and "(writable" in line["data folder"]
    assert "MB/s" in line["disk read"] and str(data) in line["disk read"], line["disk read"]
    assert "none converted" in line["models"]
    assert "bundled at" in line["default"]
    assert not list(data.iterdir()), "the doctor left files in the data folder"


def test_doctor_json_facts(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path))
    f = json.loads(_doctor(capsys, "--json"))
    assert f["colibri"]["version"] == __version__ and f["colibri"]["install"] == "python"
    assert f["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert f["threads"]["default"] >= 1 and f["threads"]["in_use"] == f["threads"]["default"]
    assert f["memory"]["total_bytes"] > 0 and 0 < f["memory"]["available_bytes"] <= f["memory"]["total_bytes"]
    assert f["cpu"]["usable_cpus"] >= 1 and f["cpu"]["int_kernels"] in ("vnni", "bw", "avx2", "portable")
    d = f["disk_read"]
    assert 0 < d["bytes_read"] <= 4 << 20 and d["mb_per_s"] > 0 and d["path"] == str(tmp_path)
    assert f["models"]["converted"] == [] and f["models"]["default_model"]["bundled"]
    assert "error" not in json.dumps(f)


def test_doctor_lists_models_and_settings_threads(capsys, tmp_path, monkeypatch, tiny_store):
    data, cfg = tmp_path / "data", tmp_path / "cfg"
    (data / "models").mkdir(parents=True)
    cfg.mkdir()
    shutil.copytree(tiny_store, data / "models" / "tiny-int8")
    (cfg / "settings.json").write_text(json.dumps({"engine": {"threads": 1}}), encoding="utf-8")
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(data))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(cfg))
    out = _doctor(capsys)
    assert str(data / "models" / "tiny-int8") in out
    assert "settings file says 1" in out and "\nthreads      1 for the kernels" in out


def test_doctor_reports_the_cgroup_limit(capsys, tmp_path, monkeypatch):
    import engine.sysinfo as S
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(S, "cgroup_memory", lambda *a, **k: S.CgroupMemory(3 << 30, 1 << 30, 0, 2,
                                                                            "/sys/fs/cgroup/x/memory.max"))
    out = _doctor(capsys, "--no-disk-test")
    assert "limit 3.22 GB (v2, /sys/fs/cgroup/x/memory.max), 2.15 GB left" in out, out
    assert "disk read" not in _labels(out)


def test_doctor_when_the_data_folder_cannot_be_created(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(blocker / "data"))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(blocker / "cfg"))
    out = _doctor(capsys)
    assert "not created yet" not in out and "none converted" in out   # it can never be created
    assert f"{blocker / 'data'} cannot be created: {blocker} is a file, not a folder" in out
    assert "Point COLIBRI_DATA_DIR at a folder" in out and "Point COLIBRI_CONFIG_DIR at a folder" in out
    assert "MB/s" in out and str(tmp_path) in out  # measured on the disk the folder would be on
    assert not blocker.read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_disk_test_is_bounded_and_cleans_up(tmp_path):
    r = D.disk_read_speed(tmp_path, budget_bytes=8 << 20, budget_s=0.0)
    assert r.bytes_read == D.BLOCK  # time budget spent after the first read
    assert r.mb_per_s and r.method in ("O_DIRECT", "F_NOCACHE", "FILE_FLAG_NO_BUFFERING", "buffered")
    assert list(tmp_path.iterdir()) == []


def test_disk_test_falls_back_to_a_store_file(tmp_path):
    ro = tmp_path / "missing"  # mkstemp fails there like in a read-only folder
    big = tmp_path / "experts.bin"
    big.write_bytes(os.urandom(3 * D.BLOCK))
    r = D.disk_read_speed(ro, [big], budget_bytes=8 << 20, budget_s=5.0)
    assert r.bytes_read == 3 * D.BLOCK and r.path == str(big) and "read a store file instead" in r.note
    r = D.disk_read_speed(ro, [], budget_bytes=8 << 20)
    assert r.bytes_read == 0 and r.mb_per_s is None and r.note.startswith("not measured:")


# --- read-only data folder, in a subprocess -----------------------------------------------------

@pytest.mark.parametrize("with_model", [True, False])
def test_doctor_on_a_read_only_data_folder(tmp_path, tiny_store, with_model):
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    if with_model:
        shutil.copytree(tiny_store, data / "models" / "tiny-int8")
    pre = read_only_prefix(data)
    if pre is None:
        pytest.skip("cannot make a folder read-only here (root without mount namespaces)")
    if not pre:
        make_read_only(data)
    env = dict(os.environ, COLIBRI_DATA_DIR=str(data), COLIBRI_CONFIG_DIR=str(tmp_path / "cfg"),
               PYTHONPATH=str(ROOT))
    try:
        p = subprocess.run(pre + [sys.executable, "-m", "engine.cli", "doctor", "--disk-test-mb", "4"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    finally:
        restore_writable(data)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    out = p.stdout
    assert "NOT writable" in out and str(data) in out
    if with_model:
        assert str(data / "models" / "tiny-int8") in out
        assert "MB/s" in out and "read a store file instead" in out, out
    else:
        assert "none converted" in out
        assert "not measured:" in out and "not writable" in out, out


@pytest.mark.parametrize("bad", ["0", "2000", "lots"])
def test_doctor_refuses_a_bad_disk_test_size(capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--disk-test-mb", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--disk-test-mb" in err and "from 1 to 1024" in err and len(err) < 400


def test_benchmark_results_name_the_cpu_and_the_integer_kernel_path():
    """Machines change between runs and an int4 kernel's speed depends on the instruction sets
    (AVX-512 VNNI vs AVX2 vs portable), so every result records the CPU's model name and the
    integer path the kernels took; `colibri doctor` reports the same name."""
    from engine import kernels
    from engine.bench.common import machine_info
    from engine.sysinfo import cpu_name

    m = machine_info()
    assert m["int_kernels"] == kernels.INT_FLAVOR in ("vnni", "bw", "avx2", "portable")
    assert m["cpu_model"] == cpu_name() and m["cpu_model"].strip() not in ("", "unknown")
    # the OpenMP wait the kernels' threads run with (the engine's GOMP_SPINCOUNT unless the
    # user chose; the test run's conftest sets OMP_WAIT_POLICY=PASSIVE)
    import os
    assert m["gomp_spincount"] == os.environ.get("GOMP_SPINCOUNT")
    assert m["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY")
