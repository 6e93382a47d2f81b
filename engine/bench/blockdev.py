"""The disk as a benchmark arm sees it: the block device holding a file, its read-ahead, and a
cgroup v1 blkio group that throttles reads from it.

Why it matters: a reader that maps its file (llama.cpp's mmap, with ``FADV_SEQUENTIAL``) reads
up to twice the device's read-ahead around every page fault, so a VM disk with 8 MB of
read-ahead makes it read ~40x the bytes it would on a desktop (128 KB, the distributions'
default). O_DIRECT readers (our expert store) are unaffected. And a disk that serves recently
written files from the host's cache reads far faster than a user's SSD, so streaming arms are
also run throttled to NVMe-class (2 GB/s) and SATA-class (0.5 GB/s) bandwidth.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

BLKIO_ROOT = "/sys/fs/cgroup/blkio"


def device_of(path: str | os.PathLike) -> tuple[str, Path]:
    """("MAJOR:MINOR", sysfs folder of the whole disk) of the block device holding ``path``.
    A partition resolves to its disk (read-ahead and throttling are the disk's).

    Raises:
        OSError: ``path`` is missing, or its file system has no block device (tmpfs, overlay).
    """
    st = os.stat(path)
    mm = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dir = Path("/sys/dev/block") / mm
    if not sys_dir.exists():
        raise OSError(f"{path}: its file system ({mm}) is not on a block device")
    sys_dir = sys_dir.resolve()
    if (sys_dir / "partition").exists():
        sys_dir = sys_dir.parent
        mm = (sys_dir / "dev").read_text().strip()
    return mm, sys_dir


def read_ahead_kb(path: str | os.PathLike) -> int | None:
    """The read-ahead (KB) of the device holding ``path``, or None if it has no block device."""
    try:
        _, d = device_of(path)
        return int((d / "queue" / "read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def read_ahead(paths, kb: int | None):
    """Set the read-ahead of every device holding ``paths`` to ``kb`` KB for the block, then
    restore it. ``kb`` None changes nothing.

    Raises:
        OSError: a device's read-ahead cannot be written (not root, no block device).
    """
    if kb is None:
        yield
        return
    saved: dict[Path, str] = {}
    try:
        for p in paths:
            _, d = device_of(p)
            f = d / "queue" / "read_ahead_kb"
            if f not in saved:
                saved[f] = f.read_text().strip()
                f.write_text(str(int(kb)))
        yield
    finally:
        for f, v in saved.items():
            try:
                f.write_text(v)
            except OSError as e:
                print(f"warning: could not restore {f} to {v} KB ({e})", file=sys.stderr)


class BlkioCgroup:
    """A cgroup v1 blkio group ``<root>/colibri_bench_<pid>_<n>`` whose reads from device
    ``dev`` ("MAJOR:MINOR") are throttled to ``read_bps`` bytes per second.

    Raises:
        OSError: the group cannot be created or configured (no blkio hierarchy, not root).
    """

    _n = 0

    def __init__(self, dev: str, read_bps: int, root: str = BLKIO_ROOT):
        BlkioCgroup._n += 1
        self.path = Path(root) / f"colibri_bench_{os.getpid()}_{BlkioCgroup._n}"
        self.path.mkdir()
        try:
            (self.path / "blkio.throttle.read_bps_device").write_text(f"{dev} {int(read_bps)}")
        except BaseException:
            self.remove()
            raise

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started through sh, which joins the group before exec'ing it."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def remove(self) -> None:
        remove_group(self.path)


def remove_group(path: Path) -> None:
    """rmdir a cgroup folder, retried briefly while the kernel tears its last task down."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove cgroup {path}", file=sys.stderr)


def blkio_available(root: str = BLKIO_ROOT) -> tuple[bool, str]:
    """(True, "") when a throttling blkio group can be made under ``root``, else (False, why)."""
    if not Path(root, "blkio.throttle.read_bps_device").exists():
        return False, f"{root} is not a cgroup v1 blkio hierarchy with throttling"
    try:
        Path(root, f"colibri_bench_probe_{os.getpid()}").mkdir()
        Path(root, f"colibri_bench_probe_{os.getpid()}").rmdir()
    except OSError as e:
        return False, f"cannot create a blkio cgroup under {root} ({e})"
    return True, ""


def bps_label(read_bps: int) -> str:
    """"2GB/s" for 2e9, "0.5GB/s" for 5e8; "" for 0 (unthrottled)."""
    return f"{read_bps / 1e9:g}GB/s" if read_bps else ""
