"""The ``.NAME.lock`` file of a conversion: removed after a
successful conversion and after a failed one; a stale one left by a killed process never
blocks the next conversion (it is taken and removed); removing the file never lets two
holders in at once (engine.fsutil.FileLock)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine import convert_checkpoint
from engine.fsutil import FileLock

fcntl = pytest.importorskip("fcntl")


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_no_lock_file_after_a_conversion(tiny_checkpoint, tmp_path):
    dst = convert_checkpoint(tiny_checkpoint, tmp_path / "m" / "tiny-int8", quant="int8")
    assert _leftovers(dst.parent) == []
    convert_checkpoint(tiny_checkpoint, dst, quant="int8", overwrite=True)   # replacing a store too
    assert _leftovers(dst.parent) == [] and [p.name for p in dst.parent.iterdir()] == ["tiny-int8"]


def test_no_lock_file_after_a_failed_publish(tiny_checkpoint, tmp_path):
    """Another program puts a folder at the destination while the conversion runs: the publish
    step refuses it (FileExistsError) and leaves neither the lock file nor the temp folder."""
    dst = tmp_path / "m" / "tiny-int8"

    def intruder(ev):
        if not dst.exists():
            dst.mkdir(parents=True)
            (dst / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="another process"):
        convert_checkpoint(tiny_checkpoint, dst, quant="int8", progress=intruder)
    assert _leftovers(dst.parent) == [] and (dst / "mine.txt").read_text() == "user data"


def test_a_stale_lock_of_a_killed_process_does_not_block(tiny_checkpoint, tmp_path):
    dst = tmp_path / "m" / "tiny-int8"
    dst.parent.mkdir(parents=True)
    lock = dst.with_name(f".{dst.name}.lock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: take the publish lock, say so, and die holding it
        try:
            os.close(r)
            FileLock(lock).__enter__()
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert lock.exists()                      # the killed process left its file behind ...
    t0 = time.monotonic()
    convert_checkpoint(tiny_checkpoint, dst, quant="int8")
    assert time.monotonic() - t0 < 30         # ... which does not block the next conversion
    assert not lock.exists() and _leftovers(dst.parent) == []


def test_file_lock_excludes_while_the_file_is_removed(tmp_path):
    """Holders remove the lock file on release while others wait on it: still never two
    holders at once (each re-checks that the path names the inode it locked)."""
    path = tmp_path / ".x.lock"
    inside, overlaps, rounds = [0], [], 60

    def worker():
        for _ in range(rounds):
            with FileLock(path):
                inside[0] += 1
                if inside[0] != 1:
                    overlaps.append(inside[0])
                time.sleep(0.0005)
                inside[0] -= 1
    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert not overlaps and not path.exists()


def test_file_lock_removes_its_file_after_an_error(tmp_path):
    path = tmp_path / ".y.lock"
    with pytest.raises(RuntimeError):
        with FileLock(path):
            assert path.exists()
            raise RuntimeError("boom")
    assert not path.exists()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_leftovers_of_killed_processes_are_removed(tiny_checkpoint, tiny_store, tmp_path, monkeypatch):
    """Siblings of the stale lock: the old store a killed publish was replacing
    (``.NAME.old-PID``) goes at the next conversion to NAME; a store a killed delete was
    removing (``NAME.deleting-PID``) goes at the next listing. A live process's are kept."""
    import shutil
    from engine import library as lib
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    models = lib.models_dir()
    dead = _dead_pid()
    dst = models / "tiny-int8"
    shutil.copytree(tiny_store, models / f".tiny-int8.old-{dead}")
    shutil.copytree(tiny_store, models / f".tiny-int8.old-{os.getppid()}")     # alive: kept
    convert_checkpoint(tiny_checkpoint, dst, quant="int8")
    assert _leftovers(models) == [f".tiny-int8.old-{os.getppid()}"]
    shutil.copytree(tiny_store, models / f"gone-int8.deleting-{dead}")
    shutil.copytree(tiny_store, models / f"busy-int8.deleting-{os.getppid()}")
    assert [e.path for e in lib.list_models()] == [str(dst)]
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == [
        f"busy-int8.deleting-{os.getppid()}", "tiny-int8"]
