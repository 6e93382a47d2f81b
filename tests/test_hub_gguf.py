"""A -GGUF repository on the hub (served by tests/hubserver.py to the real huggingface_hub client):
its models grouped by quant, one chosen, checked from its header alone before any weights move,
downloaded (that file only) and imported by `colibri download`; a bad choice or file is one line
and nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).parent))
import hubserver  # noqa: E402
from gguf_helpers import bert_gguf  # noqa: E402

from engine.bench.gguf import write_gguf  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.library import check_repo, downloads_dir, models_dir  # noqa: E402
from engine.library import hub_gguf  # noqa: E402
from engine.library.check import RepoFile  # noqa: E402

REPO = "colibri/tiny-olmoe-GGUF"


def _files(*names):
    return [RepoFile(n, 100 + i) for i, n in enumerate(names)]


def test_models_are_grouped_by_quant_split_and_folder():
    listing = _files("README.md", "Model-Q8_0.gguf", "model-q4_k_m.gguf", "mmproj-Model-F16.gguf",
                     "UD-Q4_K_XL/Model-UD-Q4_K_XL-00002-of-00002.gguf", "UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00002.gguf",
                     "BF16/Model-BF16-00001-of-00003.gguf", "gpt-oss-20b-MXFP4.gguf", "weights.gguf")
    ms = {m.label: [f.name for f in m.files] for m in hub_gguf.gguf_models(listing)}
    assert ms == {"Q8_0": ["Model-Q8_0.gguf"], "Q4_K_M": ["model-q4_k_m.gguf"], "MXFP4": ["gpt-oss-20b-MXFP4.gguf"],
                  "UD-Q4_K_XL": ["UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00002.gguf",
                                 "UD-Q4_K_XL/Model-UD-Q4_K_XL-00002-of-00002.gguf"],
                  "weights.gguf": ["weights.gguf"]}  # the BF16 split misses two parts; mmproj is no model
    models = hub_gguf.gguf_models(listing)
    assert hub_gguf.choose_gguf(REPO, models, None).quant == "Q4_K_M"
    assert hub_gguf.choose_gguf(REPO, models, "ud-q4_k_xl").files[0].name.startswith("UD-Q4_K_XL/")
    assert hub_gguf.choose_gguf(REPO, models, "Model-Q8_0.gguf").quant == "Q8_0"
    with pytest.raises(ConfigError, match=r"no GGUF file of 'Q3_K_S'; it holds .*Q8_0.*Q4_K_M"):
        hub_gguf.choose_gguf(REPO, models, "Q3_K_S")
    assert hub_gguf.is_gguf_repo(listing) and not hub_gguf.is_gguf_repo(listing + _files("config.json"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny OLMoE (with its tokenizer and chat template) as Q8_0 and Q4_0 GGUFs."""
    root = tmp_path_factory.mktemp("hubgguf")
    ck = hubserver.tiny_checkpoint(root / "ck")
    out = {}
    for q in ("Q8_0", "Q4_0"):
        out[q] = root / f"tiny-olmoe-{q}.gguf"
        write_gguf(ck, out[q], matrix_type=q.lower(), log=lambda *_: None)
    return out


@pytest.fixture
def hub(tmp_path, monkeypatch, files):
    d = tmp_path / "repo"
    d.mkdir()
    for p in files.values():
        shutil.copy(p, d / p.name)
    (d / "README.md").write_text("GGUF quants of tiny-olmoe")
    (d / "mmproj-tiny-olmoe-f16.gguf").write_bytes(b"GGUF" + bytes(60))
    h = hubserver.FakeHub()
    url = h.start()
    hubserver.hub_env(monkeypatch, tmp_path, url)
    h.add_folder(REPO, d)
    yield h
    h.stop()


def test_check_reads_the_chosen_header_only(hub, files, monkeypatch):
    """The check of a -GGUF repository fetches the chosen file's header (growing the range until
    it fits) and no other file; its numbers are those of the local file's check."""
    from engine.library import check_gguf
    monkeypatch.setattr(hub_gguf, "HEADER_BYTES", 4096)
    chk = check_repo(REPO)
    assert chk.source == "hub" and chk.quant == "gguf" and chk.gguf_file == "Q4_0"  # no Q4_K_M: Q4_0 preferred
    assert chk.gguf_choices == ("Q4_0", "Q8_0") and [f.name for f in chk.files] == ["tiny-olmoe-Q4_0.gguf"]
    assert chk.download_missing == files["Q4_0"].stat().st_size and chk.model_name == "tiny-olmoe-Q4_0"
    local = check_gguf(files["Q4_0"])
    assert chk.args == local.args and chk.store_bytes == local.store_bytes and chk.has_chat_template
    got = [(n, r) for m, n, r in hub.requests if m == "GET" and n.endswith(".gguf")]
    assert {n for n, _ in got} == {"tiny-olmoe-Q4_0.gguf"} and all(r == 0 for _, r in got) and len(got) >= 2
    sent = sum(b for n, _r, b in hub.served_log if n == "tiny-olmoe-Q4_0.gguf")
    assert sent < files["Q4_0"].stat().st_size / 2  # a header, not the file
    assert not Path(chk.download_dir).exists()


def test_a_gguf_choice_for_a_repository_without_gguf_files_is_refused(hub, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "README.md").write_text("no weights here")
    hub.add_folder("colibri/plain", tmp_path / "plain")
    with pytest.raises(ConfigError, match="colibri/plain: holds no GGUF model file, so there is none of 'Q4_K_M'"):
        check_repo("colibri/plain", gguf="Q4_K_M")


def test_colibri_download_imports_the_chosen_gguf(hub, files, capsys):
    from engine.cli.main import main
    assert main(["download", REPO, "--gguf", "q8_0"]) == 0
    out = capsys.readouterr()
    store = Path(out.out.strip().splitlines()[-1])
    assert store == models_dir() / "tiny-olmoe-Q8_0-gguf"
    assert "GGUF       Q8_0 of Q4_0, Q8_0" in out.out
    m = json.loads((store / "manifest.json").read_text())
    assert m["quant"] == "gguf" and m["gguf"]["expert_types"][0] == ["Q8_0", "Q8_0", "Q8_0"]
    full = [n for m_, n, r in hub.requests if m_ == "GET" and r is None and not n.startswith("/api")]
    assert full == ["tiny-olmoe-Q8_0.gguf"]  # the chosen file only, once
    # the store holds the published blocks: the same slabs as importing the file itself
    from engine.gguf_import import convert_gguf
    ref = convert_gguf(files["Q8_0"], store.parent / "ref")
    assert (store / "experts" / "layer_001.bin").read_bytes() == (ref / "experts" / "layer_001.bin").read_bytes()
    # the downloaded file is gone once imported: the store names the repository and the file, and a
    # broken store's advice downloads that same file again
    assert not (downloads_dir() / "colibri--tiny-olmoe-GGUF").exists()
    assert m["source"].startswith(f"hf://{REPO}@") and m["hub_repo"] == REPO
    from engine.store_format import reconvert_command
    assert reconvert_command(store, m) == f"`colibri download {REPO} --gguf tiny-olmoe-Q8_0.gguf --overwrite`"


@pytest.mark.parametrize("case", ["no_such_quant", "quant_flag", "not_gguf", "architecture"])
def test_bad_gguf_repository_is_one_line_and_downloads_nothing(case, hub, tmp_path, capsys):
    from engine.cli.main import main
    argv = ["download", REPO]
    if case == "no_such_quant":
        argv += ["--gguf", "Q5_K_M"]
        want = "no GGUF file of 'Q5_K_M'; it holds Q4_0, Q8_0"
    elif case == "quant_flag":
        argv += ["--quant", "int4"]
        want = "--quant does not apply"
    elif case == "not_gguf":
        hub.repos[REPO].files["tiny-olmoe-Q4_0.gguf"] = b"<html>Not Found</html>" + bytes(100)
        want = f"{REPO}: tiny-olmoe-Q4_0.gguf is not a GGUF file"
    else:
        hub.repos[REPO].files["tiny-olmoe-Q4_0.gguf"] = bert_gguf(tmp_path / "bert.gguf").read_bytes()
        want = "GGUF architecture 'bert' is not supported"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0] and "Traceback" not in err[0]
    assert [n for m, n, r in hub.requests if m == "GET" and r is None and n.endswith(".gguf")] == []
    assert not models_dir().exists() or list(models_dir().iterdir()) == []
