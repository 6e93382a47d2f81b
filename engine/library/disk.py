"""How fast the disk under a folder reads: a short test of uncached reads (the way the engine
reads experts), bounded in bytes and seconds; the temp file is always removed. ``colibri
doctor`` reports it; the wizard's recommendations use it for the expected speed."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DISK_TEST_BYTES = 32 << 20
DISK_TEST_SECONDS = 1.0
BLOCK = 1 << 20  # one 1 MiB aligned read at a time, in shuffled order (experts are read at random)


@dataclass
class DiskSpeed:
    """Result of :func:`disk_read_speed`: bytes read in seconds (0 when not measured), the
    read method (O_DIRECT, F_NOCACHE, FILE_FLAG_NO_BUFFERING or "buffered"), the file read and
    a note (why buffered, why not measured, or that a store file was read instead)."""

    bytes_read: int
    seconds: float
    method: str
    path: str
    note: str = ""

    @property
    def mb_per_s(self) -> float | None:
        return self.bytes_read / self.seconds / 1e6 if self.bytes_read and self.seconds > 0 else None


def _timed_reads(path: Path, budget_bytes: int, budget_s: float) -> DiskSpeed:
    """Uncached reads of ``path`` in shuffled 1 MiB blocks until ``budget_bytes`` or
    ``budget_s`` is reached (whichever first). Raises OSError."""
    import random

    from ..platform_io import open_for_reads, positional_reader
    from ..quant import aligned_empty
    f = open_for_reads(path, uncached=True)
    read = positional_reader()
    try:
        size = os.fstat(f.fd).st_size
        n_blocks = max(1, min(size, budget_bytes) // BLOCK)
        order = list(range(n_blocks))
        random.Random(0).shuffle(order)
        buf = aligned_empty(BLOCK)
        done, t0 = 0, time.perf_counter()
        for i in order:
            done += read(f.fd, [buf], i * BLOCK)
            if time.perf_counter() - t0 >= budget_s:
                break
        dt = time.perf_counter() - t0
    finally:
        os.close(f.fd)
    note = f.reason + ("; the page cache may inflate the figure" if not f.uncached else "")
    return DiskSpeed(done, dt, f.how, str(path), note.strip("; "))


def disk_read_speed(folder: Path, fallback_files: list[Path] = (), budget_bytes: int = DISK_TEST_BYTES,
                    budget_s: float = DISK_TEST_SECONDS) -> DiskSpeed:
    """Read speed of the disk under ``folder``: write a temp file of ``budget_bytes`` there
    (random bytes, fsync), read it back uncached (engine.platform_io) for at most ``budget_s``
    seconds, delete it. When ``folder`` is not writable, read the largest of ``fallback_files``
    (a converted store's expert file) instead; else report why nothing was measured. Never
    raises for I/O errors."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".colibri-doctor-", suffix=".tmp", dir=folder)
        try:
            chunk = os.urandom(BLOCK)
            left = budget_bytes
            t0 = time.perf_counter()
            while left > 0:
                left -= os.write(fd, chunk[:min(BLOCK, left)])
                if time.perf_counter() - t0 > 10 * budget_s:  # a very slow disk: test what we have
                    break
            os.fsync(fd)
        finally:
            os.close(fd)
        r = _timed_reads(Path(tmp), budget_bytes, budget_s)
        r.path = str(folder)
        r.note = "; ".join(x for x in ("a temp file, removed", r.note) if x)
        return r
    except OSError as e:
        why = f"{folder} is not writable ({e.strerror or e})"
        files = [p for p in fallback_files if p.is_file()]
        if files:
            big = max(files, key=lambda p: p.stat().st_size)
            try:
                r = _timed_reads(big, budget_bytes, budget_s)
                r.note = "; ".join(x for x in (f"{why}: read a store file instead", r.note) if x)
                return r
            except OSError as e2:
                why += f"; reading {big} failed too ({e2.strerror or e2})"
        from ..platform_io import BUFFERED
        return DiskSpeed(0, 0.0, BUFFERED, str(folder), f"not measured: {why}")
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
