"""engine.library against a local fake hub served to the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import hubserver  # noqa: E402

from engine import CheckpointError, ConfigError, EngineConfig, StoreError  # noqa: E402
from engine import library as hub  # noqa: E402
from engine import library as paths  # noqa: E402
from engine.library.check import _part_path  # noqa: E402

REPO = "allenai/tiny-olmoe"
WEIGHTS = "model.safetensors"


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny):
    h = hubserver.FakeHub()
    url = h.start()
    hubserver.hub_env(monkeypatch, tmp_path, url)
    # files a conversion does not need: they must never be requested
    h.add_folder(REPO, tiny, extra={"pytorch_model.bin": b"\0" * 5000, "README.md": b"# tiny\n"})
    yield h
    h.stop()


def _weights(h) -> bytes:
    return h.repos[REPO].files[WEIGHTS]


def test_full_download_convert_selftest_and_library(fake, tiny):
    chk = hub.check_repo(REPO)
    assert chk.ok and chk.source == "hub" and chk.commit == fake.repos[REPO].sha
    names = {f.name for f in chk.files}
    assert names == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS}
    assert set(chk.ignored_files) == {"pytorch_model.bin", "README.md"}
    w = next(f for f in chk.files if f.name == WEIGHTS)
    assert w.sha256 == hashlib.sha256(_weights(fake)).hexdigest() and w.size == len(_weights(fake))
    assert chk.download_bytes == chk.download_missing == sum(len(fake.repos[REPO].files[n]) for n in names)
    assert "model.safetensors" in chk.table() and "RAM" in chk.table()

    events = []
    dest = hub.download(REPO, None, None, events.append, check=chk)
    for n in names:
        assert (dest / n).read_bytes() == fake.repos[REPO].files[n]
    assert all(e.stage == "download" and e.unit == "B" for e in events)
    assert events[-1].done == events[-1].total == chk.download_bytes
    assert fake.gets("pytorch_model.bin") == [] and fake.gets("README.md") == []
    assert fake.bytes_served[WEIGHTS] == len(_weights(fake))

    # a second download fetches nothing
    before = list(fake.requests)
    hub.download(REPO, None, None, None, check=hub.check_repo(REPO))
    new = fake.requests[len(before):]
    assert not [r for r in new if r[0] == "GET" and r[1] in names - {"config.json"}]

    conv = []
    store = hub.convert_downloaded(dest, "int8", conv.append)
    assert store == paths.models_dir() / "tiny-olmoe-int8"
    assert conv and conv[-1].stage == "convert"
    text = hub.self_test(store)
    assert isinstance(text, str)
    [entry] = hub.list_models()
    assert entry.name == "tiny-olmoe" and entry.quantization == "int8"
    assert entry.source == f"hf://{REPO}@{fake.repos[REPO].sha}" and entry.size_bytes > 100_000
    with pytest.raises(FileExistsError):
        hub.convert_downloaded(dest, "int8")
    hub.delete_model(store)
    assert hub.list_models() == [] and not store.exists()


def test_resume_after_lost_connection(fake):
    """The server drops the connection after 100 kB of the weights: the same call resumes
    with a Range request from exactly the bytes on disk; nothing is fetched twice."""
    fake.drop_after[WEIGHTS] = 100_000
    dest = hub.download(REPO)
    assert fake.gets(WEIGHTS) == [None, 100_000]
    assert fake.bytes_served[WEIGHTS] == len(_weights(fake))
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)


def test_transient_server_error_is_retried(fake):
    fake.fail_next[WEIGHTS] = [503]
    dest = hub.download(REPO)
    assert fake.gets(WEIGHTS) == [None, None]
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)
    fake.fail_next[WEIGHTS] = [404]
    (dest / WEIGHTS).unlink()
    with pytest.raises(hub.HubError, match="model.safetensors was not found"):
        hub.download(REPO)


def test_resume_after_cancel_and_after_crash(fake):
    size = len(_weights(fake))
    fake.slow[WEIGHTS] = (120_000, 0.01)  # 120 kB at once, then 4 kB every 10 ms
    cancel = threading.Event()
    chk = hub.check_repo(REPO)
    others = chk.download_bytes - size

    def progress(ev):
        if ev.done >= others + 120_000:
            cancel.set()
    with pytest.raises(hub.DownloadCancelled, match="resume"):
        hub.download(REPO, None, None, progress, cancel, check=chk)
    dest = hub.download_dir_for(REPO)
    [part] = list((dest / hub.PARTIAL_DIR).glob("*.part"))
    on_disk = part.stat().st_size
    assert 120_000 <= on_disk < size and not (dest / WEIGHTS).exists()
    assert part.read_bytes() == _weights(fake)[:on_disk]
    # the check sees the partial bytes
    assert hub.check_repo(REPO).download_missing == size - on_disk

    fake.slow.clear()
    hub.download(REPO)
    assert fake.gets(WEIGHTS)[-1] == on_disk  # resumed exactly where the file on disk ends
    resumed = [n for f, start, n in fake.served_log if f == WEIGHTS and start == on_disk]
    assert resumed == [size - on_disk]  # only the missing bytes were sent
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)
    assert not list((dest / hub.PARTIAL_DIR).glob("*.part"))

    # crash: a process died leaving half of the file; the next run resumes from it
    (dest / WEIGHTS).unlink()
    f = next(x for x in chk.files if x.name == WEIGHTS)
    _part_path(dest, f).write_bytes(_weights(fake)[:size // 2])
    hub.download(REPO)
    assert fake.gets(WEIGHTS)[-1] == size // 2
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)


def test_sha256_mismatch_is_refused_and_removed(fake):
    bad = bytearray(_weights(fake))
    bad[-1] ^= 0xFF  # same size, other content
    fake.served_override[WEIGHTS] = bytes(bad)
    with pytest.raises(hub.VerificationError, match=r"model\.safetensors.*sha256.*removed"):
        hub.download(REPO)
    dest = hub.download_dir_for(REPO)
    assert not (dest / WEIGHTS).exists() and not list((dest / hub.PARTIAL_DIR).glob("*.part"))
    # the good file arrives on the next run
    fake.served_override.clear()
    hub.download(REPO)
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)


def test_a_verified_download_that_cannot_be_read_now_is_kept(fake, monkeypatch):
    """The weights arrive and match the hub's hash, but the safetensors check cannot read the
    file (permissions, an I/O error): the download stops saying so, the file is not deleted,
    and the next run finds it without fetching it again."""
    import safetensors
    real = safetensors.safe_open

    def unreadable(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(safetensors, "safe_open", unreadable)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: could not be read \(Permission denied\)"):
        hub.download(REPO)
    dest = hub.download_dir_for(REPO)
    assert (dest / WEIGHTS).read_bytes() == _weights(fake)
    monkeypatch.setattr(safetensors, "safe_open", real)
    fetched = len(fake.gets(WEIGHTS))
    hub.download(REPO)
    assert len(fake.gets(WEIGHTS)) == fetched and (dest / WEIGHTS).read_bytes() == _weights(fake)


@pytest.mark.parametrize("listed_as_pointer", [True, False])
def test_lfs_pointer_instead_of_weights(fake, listed_as_pointer):
    ptr = hubserver.lfs_pointer(_weights(fake))
    fake.served_override[WEIGHTS] = ptr
    if listed_as_pointer:  # a mirror that lists the pointer as a plain file
        fake.listing_override[WEIGHTS] = {"size": len(ptr), "blobId": hubserver.git_blob_sha1(ptr), "lfs": None}
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*Git LFS pointer.*removed"):
        hub.download(REPO)
    dest = hub.download_dir_for(REPO)
    assert not (dest / WEIGHTS).exists() and not list((dest / hub.PARTIAL_DIR).glob("*.part"))


def test_truncated_safetensors_and_local_folder(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    local = tmp_path / "local"
    shutil.copytree(tiny, local)
    chk = hub.check_local(local)
    assert chk.ok and chk.source == "local" and chk.download_missing == 0
    data = (local / WEIGHTS).read_bytes()
    (local / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        hub.check_weight_file(local / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        hub.check_local(local)
    (local / WEIGHTS).write_bytes(hubserver.lfs_pointer(data))
    with pytest.raises(CheckpointError, match="Git LFS pointer"):
        hub.check_local(local)


def test_unsupported_model_type_refused_before_weights(fake, tmp_path, tiny):
    other = tmp_path / "llama"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(cfg))
    fake.add_folder("meta/llama-tiny", other)
    with pytest.raises(ConfigError, match=r"'llama' is not supported.*olmoe"):
        hub.check_repo("meta/llama-tiny")
    assert fake.weight_requests() == []
    assert not hub.download_dir_for("meta/llama-tiny").exists()


def test_repo_and_revision_errors(fake):
    with pytest.raises(hub.HubError, match="not found"):
        hub.check_repo("nobody/missing")
    with pytest.raises(hub.HubError, match="revision 'v9'"):
        hub.check_repo(REPO, revision="v9")
    with pytest.raises(ValueError, match="owner/name"):
        hub.check_repo("no-slash")


def test_hub_unreachable(fake, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(hub.HubError, match="cannot reach the hub"):
        hub.check_repo(REPO)


def test_disk_space_shortfall(fake, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr("engine.library.paths.shutil.disk_usage", lambda p: Usage(10**9, 10**9 - 200_000, 200_000))
    chk = hub.check_repo(REPO)
    assert not chk.disk_ok and not chk.ok
    assert "Not enough disk space" in chk.disk_message and "200.0 kB free" in chk.disk_message
    with pytest.raises(hub.DiskSpaceError, match="200.0 kB free"):
        hub.download(REPO, check=chk)
    assert fake.weight_requests() == []


def test_ram_verdicts():
    from engine import ModelArgs
    from engine.bench import synthetic
    args = ModelArgs.from_dict(synthetic.olmoe_config())
    est = hub.estimate(args, "int8", 512)
    assert hub.ram_verdict(est, 2, est.ram_needed - 1, est.ram_needed)[0] == "refuse"
    v, msg = hub.ram_verdict(est, 2, 10 * est.ram_needed, est.ram_needed)
    assert v == "warn" and "Tight" in msg
    v, msg = hub.ram_verdict(est, 2, 10 * est.ram_needed, 2 * est.ram_needed)
    assert v == "ok" and "whole model fits" in msg
    # room for only 1 slot per layer while 2 experts are routed per token -> slow warning
    avail = int((est.ram_needed + est.slots_bytes // 2) / 0.88) + 1
    v, msg = hub.ram_verdict(est, 2, 10 * est.ram_needed, avail)
    assert v == "warn" and "slowly" in msg


@pytest.mark.parametrize("quant,ctx,cfg", [
    ("int8", 0, {}),
    ("int4", 300, {"num_key_value_heads": 2}),
    ("f16", 128, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
])
def test_ram_estimate_matches_engine(fake, tmp_path_factory, quant, ctx, cfg):
    """The RAM shown before the download vs what the engine then accounts for.

    Method: for a tiny model the process RSS is dominated by Python + numba (~200 MB), and
    the KV cache is allocated lazily (untouched pages are not resident), so RSS cannot resolve
    these few hundred kB. We compare the estimate's parts with the Engine's own accounting
    after Engine.open on the converted store: dense bytes (sum of the loaded arrays' nbytes),
    KV bytes and one slot per layer from its BudgetPlan, and the minimum (dense + KV + slots +
    reserve). They must agree within 15% (in practice they are equal), for plain, GQA and
    tied-embedding models at int8 / int4 / f16.
    """
    from engine import Engine
    repo = "allenai/tiny-variant"
    fake.add_folder(repo, hubserver.tiny_checkpoint(tmp_path_factory.getbasetemp() / "variants", **cfg))
    chk = hub.check_repo(repo, quant=quant, context_length=ctx)
    store = hub.convert_downloaded(hub.download(repo, check=chk), quant)
    with Engine.open(EngineConfig(store=str(store), context_length=ctx, pinning=False, history=False,
                                  pilot=0)) as eng:
        measured = {"dense": eng.loaded.dense_bytes, "kv": eng.plan.kv, "slots": eng.plan.slot_bytes_sum,
                    "min": eng.loaded.dense_bytes + eng.plan.kv + eng.plan.slot_bytes_sum + eng.plan.reserve,
                    "ctx": eng.loaded.context_length}
    e = chk.estimate
    est = {"dense": e.dense_bytes, "kv": e.kv_bytes, "slots": e.slots_bytes, "min": e.ram_needed,
           "ctx": e.context_length}
    for k in measured:
        assert abs(est[k] - measured[k]) <= 0.15 * measured[k], (k, est[k], measured[k])
    on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert chk.store_bytes == pytest.approx(on_disk, rel=0.15)


def test_delete_model_refuses_outside_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="refusing"):
        hub.delete_model(outside)
    with pytest.raises(ValueError, match="refusing"):
        hub.delete_model(paths.models_dir())
    notstore = paths.models_dir() / "x"
    notstore.mkdir()
    with pytest.raises(ValueError, match="not a converted store"):
        hub.delete_model(notstore)
    assert outside.exists() and notstore.exists()


def test_cli_download_and_models(fake, capsys):
    from engine.cli import main
    assert main(["download", REPO, "--quant", "int4", "--yes"]) == 0
    out, err = capsys.readouterr()
    store = Path(out.strip().splitlines()[-1])
    assert store == paths.models_dir() / "tiny-olmoe-int4" and (store / "manifest.json").exists()
    assert "model.safetensors" in out and "self-test" in err
    assert not hub.download_dir_for(REPO).exists()  # removed after converting (no --keep-download)
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "tiny-olmoe" in listing and "OLMoE" in listing and "family" in listing
    assert main(["download", "meta/none"]) == 2


def test_cli_self_test_that_cannot_run_keeps_the_store(fake, capsys, monkeypatch):
    """Too little free RAM for the self-test says nothing about the store: it is kept (the
    wizard's rule), and the message says how to try it again."""
    from engine import BudgetError
    import engine.library
    from engine.cli import main

    def short(store, max_new_tokens=8):
        raise BudgetError("the RAM budget 0.1 GB cannot hold the dense weights (0.2 GB)")
    monkeypatch.setattr(engine.library, "self_test", short)  # `colibri download` imports it at use
    assert main(["download", REPO, "--quant", "int8", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "could not run" in err and "kept" in err and "colibri run --model" in err
    assert len(hub.list_models()) == 1 and (paths.models_dir() / "tiny-olmoe-int8").exists()


@pytest.mark.parametrize("fails", ["opening", "reading"])
def test_cli_self_test_that_cannot_read_the_store_keeps_it(fake, capsys, monkeypatch, fails):
    """An I/O error opening or reading the new store's files (a failing or busy disk, a
    permission) says nothing about the store: the real self-test fails, the store is kept."""
    import errno
    import engine.expert_store as es
    from engine.cli import main

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")
    if fails == "opening":
        monkeypatch.setattr(es, "open_for_reads", eio)
    else:
        monkeypatch.setattr(es, "positional_reader", lambda: eio)
    assert main(["download", REPO, "--quant", "int8", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "could not run" in err and "kept" in err and "Input/output error" in err and "Traceback" not in err
    assert len(hub.list_models()) == 1 and (paths.models_dir() / "tiny-olmoe-int8").exists()


def test_cli_self_test_whose_first_failed_read_is_an_embedding_row_keeps_the_store(fake, capsys, monkeypatch):
    """A read error of a token's embedding row during the self-test's generation (which may
    come before any expert read fails) says nothing about the store either: the self-test
    reports it unreadable, the store is kept. Once told apart by the cache's read-error count
    alone, which such a run leaves at 0."""
    import errno
    from engine.cli import main
    from engine.generate import Engine

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")
    real_open = Engine.open.__func__

    def open_then_fail_rows(cls, *a, **k):
        eng = real_open(cls, *a, **k)
        assert eng.model.embed_rows is not None  # the rows are read per token
        eng.model.embed_rows._read = eio  # from the generation on, as a disk failing after open
        return eng
    monkeypatch.setattr(Engine, "open", classmethod(open_then_fail_rows))
    assert main(["download", REPO, "--quant", "int8", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "could not run" in err and "kept" in err and "Input/output error" in err and "Traceback" not in err
    assert len(hub.list_models()) == 1 and (paths.models_dir() / "tiny-olmoe-int8").exists()


def test_cli_download_pasted_address_and_failed_self_test(fake, capsys, monkeypatch):
    """The wizard's checks in the CLI too: a pasted hub address is the repo id; a store whose
    self-test fails is removed (not left in the library)."""
    import engine.library
    from engine.cli import main

    def broken(store, max_new_tokens=8):
        raise StoreError(f"{store}: self-test generation failed (bad weights)")
    monkeypatch.setattr(engine.library, "self_test", broken)  # `colibri download` imports it at use
    assert main(["download", f"https://huggingface.co/{REPO}/tree/main", "--quant", "int8", "--yes",
                 "--keep-download"]) == 1
    err = capsys.readouterr().err
    assert "self-test" in err and "removed" in err and "Traceback" not in err
    assert hub.list_models() == [] and not (paths.models_dir() / "tiny-olmoe-int8").exists()
    assert (hub.download_dir_for(REPO) / WEIGHTS).exists()       # the download is kept for a retry
