"""engine.platform_io: uncached reads per operating system.

Linux runs for real; macOS (fcntl F_NOCACHE) and Windows (CreateFileW FILE_FLAG_NO_BUFFERING,
ReadFile with an OVERLAPPED offset) run here with sys.platform patched and the OS calls
replaced by stand-ins that record what they were asked and serve the bytes from a real file,
so the code paths, the flags and the fallbacks are checked on this machine. The store reader
(ExpertStore) is checked through the same stand-ins: one read mode for the whole store, and
the same bytes whatever the mode.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import types

import numpy as np
import pytest

from engine import platform_io as P
from engine.expert_store import ExpertStore
from engine.quant import ALIGN, aligned_empty


@pytest.fixture
def data_file(tmp_path):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, 4 * ALIGN, dtype=np.uint8).tobytes()
    p = tmp_path / "slabs.bin"
    p.write_bytes(raw)
    return p, raw


def _read(fd, offset, n=ALIGN, reader=None):
    buf = aligned_empty(n)
    got = (reader or P.positional_reader())(fd, [buf], offset)
    return got, buf.tobytes()[:got]


# --- Linux (real) -------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_linux_uncached_read_gives_the_file_bytes(data_file):
    p, raw = data_file
    f = P.open_for_reads(p)
    try:
        assert f.how in (P.O_DIRECT, P.BUFFERED) and f.uncached == (f.how == P.O_DIRECT)
        if f.uncached:
            import fcntl
            assert fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        assert _read(f.fd, ALIGN) == (ALIGN, raw[ALIGN:2 * ALIGN])
        assert _read(f.fd, 3 * ALIGN, 2 * ALIGN) == (ALIGN, raw[3 * ALIGN:])  # short at the end
    finally:
        os.close(f.fd)


def test_buffered_when_not_asked(data_file):
    p, raw = data_file
    f = P.open_for_reads(p, uncached=False)
    try:
        assert (f.uncached, f.how, f.reason) == (False, P.BUFFERED, "")
        assert _read(f.fd, 0) == (ALIGN, raw[:ALIGN])
    finally:
        os.close(f.fd)


@pytest.mark.parametrize("uncached", [True, False])
def test_missing_file_raises_the_os_error(tmp_path, uncached):
    with pytest.raises(FileNotFoundError):
        P.open_for_reads(tmp_path / "nope.bin", uncached=uncached)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_o_direct_refused_at_open_falls_back(data_file, monkeypatch):
    p, raw = data_file
    real = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how) == (False, P.BUFFERED)
        assert "O_DIRECT refused at open" in f.reason and "Invalid argument" in f.reason
        assert _read(f.fd, 2 * ALIGN) == (ALIGN, raw[2 * ALIGN:3 * ALIGN])
    finally:
        os.close(f.fd)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_o_direct_failing_first_read_falls_back_and_closes(data_file, monkeypatch):
    """tmpfs-like: the open succeeds, the first read fails with EINVAL."""
    p, raw = data_file
    opened, closed = [], []
    real_open, real_close = os.open, os.close

    def rec_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        opened.append((fd, bool(flags & os.O_DIRECT)))
        return fd

    def rec_close(fd):
        closed.append(fd)
        real_close(fd)

    def bad_probe(fd):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "open", rec_open)
    monkeypatch.setattr(os, "close", rec_close)
    monkeypatch.setattr(P, "_probe", bad_probe)
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how) == (False, P.BUFFERED) and "O_DIRECT read failed" in f.reason
        direct_fds = [fd for fd, d in opened if d]
        assert len(direct_fds) == 1 and direct_fds[0] in closed  # no descriptor leaked
        assert _read(f.fd, 0) == (ALIGN, raw[:ALIGN])
    finally:
        real_close(f.fd)


def test_no_flag_at_all_is_buffered(data_file, monkeypatch):
    p, raw = data_file
    monkeypatch.setattr(sys, "platform", "sunos5")
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    assert P.platform_kind() == "buffered" and P.uncached_method() == P.BUFFERED
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how) == (False, P.BUFFERED) and "no uncached-read flag" in f.reason
        assert _read(f.fd, 0) == (ALIGN, raw[:ALIGN])
    finally:
        os.close(f.fd)


def test_pread_loop_without_preadv(data_file, monkeypatch):
    p, raw = data_file
    monkeypatch.delattr(os, "preadv", raising=False)
    reader = P.positional_reader()
    assert reader is P._pread_loop
    fd = os.open(p, os.O_RDONLY)
    try:
        a, b = aligned_empty(ALIGN), aligned_empty(ALIGN)
        assert reader(fd, [a, b], 2 * ALIGN + 8) == 2 * ALIGN - 8
        assert a.tobytes() + b.tobytes()[:ALIGN - 8] == raw[2 * ALIGN + 8:]
    finally:
        os.close(fd)


# --- macOS (fcntl F_NOCACHE, stand-in) ----------------------------------------------------------

class FakeFcntl:
    def __init__(self, fail=False, has_name=True):
        self.calls, self.fail = [], fail
        if has_name:
            self.F_NOCACHE = 48

    def fcntl(self, fd, cmd, arg=0):
        self.calls.append((fd, cmd, arg))
        if self.fail:
            raise OSError(errno.ENOTSUP, "Operation not supported")
        return 0


@pytest.fixture
def darwin(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    fake = FakeFcntl()
    monkeypatch.setattr(P, "_fcntl", lambda: fake)
    return fake


def test_macos_uses_f_nocache(data_file, darwin, monkeypatch):
    p, raw = data_file
    direct_asked = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: direct_asked.append(flags & getattr(os, "O_DIRECT", 0))
                        or real(path, flags, *a))
    assert P.platform_kind() == "darwin" and P.uncached_method() == P.F_NOCACHE
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how, f.reason) == (True, P.F_NOCACHE, "")
        assert darwin.calls == [(f.fd, 48, 1)]
        assert direct_asked == [0]  # macOS has no O_DIRECT: never asked for
        assert _read(f.fd, ALIGN) == (ALIGN, raw[ALIGN:2 * ALIGN])
    finally:
        os.close(f.fd)


def test_macos_f_nocache_number_when_fcntl_lacks_the_name(data_file, monkeypatch):
    p, _ = data_file
    monkeypatch.setattr(sys, "platform", "darwin")
    fake = FakeFcntl(has_name=False)
    monkeypatch.setattr(P, "_fcntl", lambda: fake)
    f = P.open_for_reads(p)
    os.close(f.fd)
    assert f.uncached and fake.calls[0][1:] == (P.F_NOCACHE_DARWIN, 1)


def test_macos_f_nocache_failure_keeps_a_buffered_descriptor(data_file, monkeypatch):
    p, raw = data_file
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(P, "_fcntl", lambda: FakeFcntl(fail=True))
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how) == (False, P.BUFFERED) and "F_NOCACHE failed" in f.reason
        assert _read(f.fd, 0) == (ALIGN, raw[:ALIGN])
    finally:
        os.close(f.fd)


# --- Windows (CreateFileW FILE_FLAG_NO_BUFFERING + ReadFile, stand-in) ---------------------------

class FakeKernel32:
    """CreateFileW / ReadFile / CloseHandle over real files (handles are ints >= 1000)."""

    def __init__(self, fail_create=False):
        self.created, self.reads, self.closed = [], [], []
        self.paths: dict[int, str] = {}
        self.fail_create = fail_create

    def CreateFileW(self, path, access, share, sec, disposition, flags, template):
        self.created.append((path, access, share, disposition, flags))
        if self.fail_create:
            return P.INVALID_HANDLE_VALUE
        h = 1000 + len(self.created)
        self.paths[h] = path
        return h

    def ReadFile(self, h, addr, n, got_ref, ov_ref):
        ov = ov_ref._obj
        off = ov.Offset | (ov.OffsetHigh << 32)
        self.reads.append((h, n, ov.Offset, ov.OffsetHigh, addr % ALIGN))
        with open(self.paths.get(h, os.devnull), "rb") as f:
            f.seek(off)
            data = f.read(n)
        ctypes.memmove(addr, data, len(data))
        got_ref._obj.value = len(data)
        return 1

    def CloseHandle(self, h):
        self.closed.append(h)
        return 1


class FakeMsvcrt:
    def __init__(self, k: FakeKernel32):
        self.k, self.fd_to_h = k, {}

    def open_osfhandle(self, h, flags):
        fd = os.open(self.k.paths[h], os.O_RDONLY)
        self.fd_to_h[fd] = h
        return fd

    def get_osfhandle(self, fd):
        if fd not in self.fd_to_h:  # a descriptor from os.open (buffered): Windows has a handle for it too
            h = 5000 + fd
            self.k.paths[h] = os.readlink(f"/proc/self/fd/{fd}")
            self.fd_to_h[fd] = h
        return self.fd_to_h[fd]


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    k = FakeKernel32()
    m = FakeMsvcrt(k)
    monkeypatch.setattr(P, "_win32", lambda: (k, m))
    return k, m


def test_windows_opens_with_no_buffering_and_reads_at_overlapped_offsets(data_file, windows):
    p, raw = data_file
    k, m = windows
    assert P.platform_kind() == "windows" and P.uncached_method() == P.NO_BUFFERING
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how, f.reason) == (True, P.NO_BUFFERING, "")
        (path, access, share, disp, flags), = k.created
        assert path == str(p) and access == P.GENERIC_READ and share & P.FILE_SHARE_READ
        assert disp == P.OPEN_EXISTING and flags & P.FILE_FLAG_NO_BUFFERING
        assert P.positional_reader() is P._preadv_windows
        assert _read(f.fd, 2 * ALIGN) == (ALIGN, raw[2 * ALIGN:3 * ALIGN])
        # every read: aligned buffer address, sector-multiple length, offset in the OVERLAPPED
        assert all(a == 0 and n % ALIGN == 0 for _h, n, _lo, _hi, a in k.reads)
        assert k.reads[-1][2:4] == (2 * ALIGN, 0)
    finally:
        os.close(f.fd)


def test_windows_offsets_above_4_gib_split_into_high_and_low(windows, data_file):
    p, _ = data_file
    k, m = windows
    f = P.open_for_reads(p)
    try:
        got, _ = _read(f.fd, (5 << 32) + ALIGN)   # past the end of the small file: 0 bytes
        assert got == 0 and k.reads[-1][2:4] == (ALIGN, 5)
    finally:
        os.close(f.fd)


def test_windows_read_error_and_eof(windows, data_file, monkeypatch):
    p, _ = data_file
    k, m = windows
    f = P.open_for_reads(p)
    try:
        monkeypatch.setattr(k, "ReadFile", lambda *a: 0)
        monkeypatch.setattr(P, "_win_error", lambda: P.ERROR_HANDLE_EOF)
        assert _read(f.fd, 0)[0] == 0                  # end of file: a short (empty) read
        monkeypatch.setattr(P, "_win_error", lambda: 23)  # ERROR_CRC
        with pytest.raises(OSError, match="Windows error 23"):
            _read(f.fd, 0)
    finally:
        os.close(f.fd)


def test_windows_create_failure_falls_back_to_buffered(data_file, monkeypatch):
    p, raw = data_file
    monkeypatch.setattr(sys, "platform", "win32")
    k = FakeKernel32(fail_create=True)
    monkeypatch.setattr(P, "_win32", lambda: (k, FakeMsvcrt(k)))
    f = P.open_for_reads(p)
    try:
        assert (f.uncached, f.how) == (False, P.BUFFERED) and "CreateFileW" in f.reason
        os.lseek(f.fd, ALIGN, 0)
        assert os.read(f.fd, 16) == raw[ALIGN:ALIGN + 16]
    finally:
        os.close(f.fd)
    with pytest.raises(FileNotFoundError):   # the real error of a missing file, not a fallback
        P.open_for_reads(p.parent / "missing.bin")


def test_windows_without_kernel32_is_buffered(data_file, monkeypatch):
    p, _ = data_file
    monkeypatch.setattr(sys, "platform", "win32")

    def no_dll():
        raise OSError("kernel32 not found")
    monkeypatch.setattr(P, "_win32", no_dll)
    f = P.open_for_reads(p)
    os.close(f.fd)
    assert (f.uncached, f.how) == (False, P.BUFFERED) and "kernel32 unavailable" in f.reason


# --- the store reader uses it -------------------------------------------------------------------

def _all_slabs(st: ExpertStore) -> list[bytes]:
    out = []
    buf = st.new_buffer()
    for layer in range(st.args.num_moe_layers):
        for e in range(st.args.num_experts):
            st.read(layer, e, buf, verify=True)
            out.append(buf.tobytes())
    return out


def test_store_on_macos_path_reads_the_same_bytes(tiny_store, darwin):
    with ExpertStore(tiny_store, o_direct=False) as st:
        ref = _all_slabs(st)
    n_before = len(darwin.calls)
    with ExpertStore(tiny_store, o_direct=True) as st:
        assert st.o_direct
        assert len(darwin.calls) - n_before == st.open_files  # F_NOCACHE on every expert file
        assert _all_slabs(st) == ref


def test_store_on_windows_path_reads_the_same_bytes(tiny_store, windows):
    k, _ = windows
    with ExpertStore(tiny_store, o_direct=False) as st:
        ref = _all_slabs(st)
    with ExpertStore(tiny_store, o_direct=True) as st:
        assert st.o_direct and len(k.created) == st.open_files
        assert _all_slabs(st) == ref
        assert k.reads and all(a == 0 and n % ALIGN == 0 for _h, n, _lo, _hi, a in k.reads)


def test_store_goes_buffered_for_every_file_when_one_refuses(tiny_store, monkeypatch):
    """One mode per store: a file that refuses uncached reads reopens the earlier ones buffered."""
    with ExpertStore(tiny_store, o_direct=False) as st:
        ref = _all_slabs(st)
        files = sorted(st._fds)
    assert len(files) >= 2
    monkeypatch.setattr(sys, "platform", "darwin")
    calls = []

    class Flaky(FakeFcntl):
        def fcntl(self, fd, cmd, arg=0):
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(errno.ENOTSUP, "not here")
            return 0
    monkeypatch.setattr(P, "_fcntl", lambda: Flaky())
    opened = []
    real = P.open_for_reads
    monkeypatch.setattr("engine.expert_store.open_for_reads",
                        lambda p, uncached=True: opened.append((os.path.basename(p), uncached)) or real(p, uncached))
    with ExpertStore(tiny_store, o_direct=True) as st:
        assert not st.o_direct
        assert opened[:2] == [(os.path.basename(files[0]), True), (os.path.basename(files[1]), True)]
        assert (os.path.basename(files[0]), False) in opened  # the first file, reopened buffered
        assert all(not u for _n, u in opened[2:])
        assert _all_slabs(st) == ref
