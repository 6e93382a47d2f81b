"""engine.bench.blockdev: the device under a file, its read-ahead set and restored, and a real
blkio group's read throttle (where this machine has cgroup v1 blkio and root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import blockdev


def test_device_of_a_file_names_its_disk(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    try:
        mm, d = blockdev.device_of(f)
    except OSError:
        pytest.skip("the temporary folder is not on a block device")
    assert mm.count(":") == 1 and (d / "queue" / "read_ahead_kb").exists()
    assert blockdev.read_ahead_kb(f) == int((d / "queue" / "read_ahead_kb").read_text())


def test_read_ahead_is_set_for_the_block_and_restored(tmp_path, monkeypatch):
    """Every device under the paths gets the read-ahead for the block (once, however many files
    share it) and its old value back after, also when the block raises."""
    disk = tmp_path / "sys" / "vdx"
    (disk / "queue").mkdir(parents=True)
    ra = disk / "queue" / "read_ahead_kb"
    ra.write_text("8192\n")
    monkeypatch.setattr(blockdev, "device_of", lambda p: ("253:0", disk))
    with blockdev.read_ahead(["a", "b"], 128):
        assert ra.read_text() == "128"
    assert ra.read_text() == "8192"
    with pytest.raises(RuntimeError):
        with blockdev.read_ahead(["a"], 128):
            raise RuntimeError("arm failed")
    assert ra.read_text() == "8192"
    with blockdev.read_ahead(["a"], None):  # None: leave the devices as they are
        assert ra.read_text() == "8192"


def test_bps_label():
    assert blockdev.bps_label(2_000_000_000) == "2GB/s" and blockdev.bps_label(500_000_000) == "0.5GB/s"
    assert blockdev.bps_label(0) == ""


def test_blkio_group_throttles_the_reads_of_its_process(tmp_path):
    """A child in a BlkioCgroup reads a file with O_DIRECT; the group's throttle accounting saw
    those bytes on the file's device (so the limit applies to them)."""
    ok, why = blockdev.blkio_available()
    if not ok:
        pytest.skip(why)
    f = tmp_path / "data"
    f.write_bytes(os.urandom(4 << 20))
    try:
        dev, _ = blockdev.device_of(f)
    except OSError:
        pytest.skip("the temporary folder is not on a block device")
    g = blockdev.BlkioCgroup(dev, 1 << 30)
    try:
        code = ("import os, mmap, sys\n"
                "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
                "buf = mmap.mmap(-1, 1 << 20)\n"
                "n = 0\n"
                "while True:\n"
                "    k = os.preadv(fd, [buf], n)\n"
                "    n += k\n"
                "    if k < (1 << 20): break\n"
                "print(n)\n")
        p = subprocess.run(g.wrap([sys.executable, "-c", code, str(f)]), capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        assert int(p.stdout) == 4 << 20
        stats = (g.path / "blkio.throttle.io_service_bytes").read_text().split("\n")
        read = sum(int(line.split()[2]) for line in stats if line.startswith(dev + " Read"))
        assert read >= 4 << 20
    finally:
        g.remove()
