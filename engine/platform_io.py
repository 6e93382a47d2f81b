"""Uncached ("direct") positional reads of store files, one code path per operating system.

The expert store reads each expert slab with one positional read into a 4096-aligned buffer
(engine.quant.ALIGN; slab offsets and lengths are multiples of it). Bypassing the OS page cache
keeps the RAM budget real: experts read once are not kept a second time by the kernel.

    Linux (and any system with ``os.O_DIRECT``)
        ``open(O_RDONLY | O_DIRECT)``, then one aligned probe read: some filesystems (tmpfs,
        some FUSE/overlay mounts) accept the flag at open and fail the first read with EINVAL.
    macOS (``sys.platform == "darwin"``), UNTESTED on a Mac
        ``open(O_RDONLY)`` then ``fcntl(fd, F_NOCACHE, 1)`` (macOS has no O_DIRECT; F_NOCACHE
        turns data caching off for that descriptor; alignment is not required but helps).
    Windows (``sys.platform == "win32"``), UNTESTED on Windows
        ``CreateFileW(GENERIC_READ, FILE_SHARE_READ, OPEN_EXISTING, FILE_FLAG_NO_BUFFERING)``
        through ctypes, wrapped into a C runtime descriptor with ``msvcrt.open_osfhandle``.
        Unbuffered handles need sector-aligned offsets, lengths and buffer addresses (the
        store's 4096 alignment covers sectors up to 4096 bytes). Windows has no ``os.preadv``:
        :func:`preadv` reads with ``ReadFile`` and an OVERLAPPED offset instead.
    anything else: buffered reads.

Every failure to get uncached reads falls back to a buffered descriptor of the same file with
the reason recorded; errors opening the file at all (missing, permission) are raised as the
OSError the OS gave. Sources: Linux open(2) "O_DIRECT"; Apple fcntl(2) "F_NOCACHE"; Microsoft
"File Buffering" (CreateFileW, FILE_FLAG_NO_BUFFERING alignment rules) and ReadFile/OVERLAPPED.
The OS calls go through module attributes (``os``, ``_fcntl()``, ``_win32()``) so the tests can
stand in for macOS and Windows on Linux.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .quant import ALIGN, aligned_empty

O_DIRECT, F_NOCACHE, NO_BUFFERING, BUFFERED = "O_DIRECT", "F_NOCACHE", "FILE_FLAG_NO_BUFFERING", "buffered"
F_NOCACHE_DARWIN = 48  # <sys/fcntl.h> on macOS, for Pythons whose fcntl lacks the name

# Windows constants (winnt.h / fileapi.h)
GENERIC_READ = 0x80000000
FILE_SHARE_READ = 0x00000001
OPEN_EXISTING = 3
FILE_ATTRIBUTE_NORMAL = 0x80
FILE_FLAG_NO_BUFFERING = 0x20000000
INVALID_HANDLE_VALUE = (1 << (8 * 8)) - 1  # (HANDLE)-1 as an unsigned 64-bit value
ERROR_HANDLE_EOF = 38


@dataclass(frozen=True)
class OpenedFile:
    """A descriptor opened by :func:`open_for_reads`.

    fd: OS file descriptor (on Windows a C runtime descriptor over the handle); close it with
        ``os.close``. uncached: True when reads bypass the OS page cache. how: O_DIRECT,
        F_NOCACHE, FILE_FLAG_NO_BUFFERING or "buffered". reason: why uncached reads were not
        used ("" when they are, or when they were not asked for).
    """

    fd: int
    uncached: bool
    how: str
    reason: str = ""


def platform_kind() -> str:
    """"windows", "darwin", "o_direct" (Linux and other systems with O_DIRECT) or "buffered"."""
    if sys.platform == "win32":
        return "windows"
    if sys.platform == "darwin":
        return "darwin"
    return "o_direct" if hasattr(os, "O_DIRECT") else "buffered"


def uncached_method() -> str:
    """The uncached-read method of this platform (O_DIRECT, F_NOCACHE, FILE_FLAG_NO_BUFFERING),
    or "buffered" when it has none."""
    return {"windows": NO_BUFFERING, "darwin": F_NOCACHE, "o_direct": O_DIRECT}.get(platform_kind(), BUFFERED)


def _binary() -> int:
    return getattr(os, "O_BINARY", 0)  # Windows: no newline translation


def open_buffered(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path`` through the page cache. Raises OSError."""
    return os.open(path, os.O_RDONLY | _binary())


def _fcntl():
    import fcntl
    return fcntl


def _win32():
    """(kernel32, msvcrt) for the Windows path (ctypes); tests replace this function."""
    import ctypes
    import msvcrt
    from ctypes import wintypes
    k = ctypes.WinDLL("kernel32", use_last_error=True)
    k.CreateFileW.argtypes = [wintypes.LPCWSTR, wintypes.DWORD, wintypes.DWORD, ctypes.c_void_p,
                              wintypes.DWORD, wintypes.DWORD, wintypes.HANDLE]
    k.CreateFileW.restype = ctypes.c_void_p
    k.ReadFile.argtypes = [wintypes.HANDLE, ctypes.c_void_p, wintypes.DWORD, ctypes.POINTER(wintypes.DWORD),
                           ctypes.c_void_p]
    k.ReadFile.restype = wintypes.BOOL
    k.CloseHandle.argtypes = [wintypes.HANDLE]
    k.CloseHandle.restype = wintypes.BOOL
    return k, msvcrt


def _win_error() -> int:
    try:
        import ctypes
        return ctypes.get_last_error()
    except (ImportError, AttributeError):
        return 0


def _probe(fd: int) -> None:
    """One aligned read at offset 0 (raises the OSError a filesystem without direct I/O gives)."""
    preadv(fd, [aligned_empty(ALIGN)], 0)


def _open_o_direct(path) -> OpenedFile:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except OSError as e:  # EINVAL: the filesystem refuses O_DIRECT
        return OpenedFile(open_buffered(path), False, BUFFERED, f"O_DIRECT refused at open ({e})")
    try:
        _probe(fd)
    except OSError as e:
        os.close(fd)
        return OpenedFile(open_buffered(path), False, BUFFERED, f"O_DIRECT read failed ({e})")
    return OpenedFile(fd, True, O_DIRECT)


def _open_f_nocache(path) -> OpenedFile:
    fd = open_buffered(path)
    try:
        f = _fcntl()
        f.fcntl(fd, getattr(f, "F_NOCACHE", F_NOCACHE_DARWIN), 1)
    except (ImportError, OSError) as e:
        return OpenedFile(fd, False, BUFFERED, f"fcntl F_NOCACHE failed ({e})")
    return OpenedFile(fd, True, F_NOCACHE)


def _open_no_buffering(path) -> OpenedFile:
    try:
        k, msvcrt = _win32()
    except (ImportError, OSError, AttributeError) as e:
        return OpenedFile(open_buffered(path), False, BUFFERED, f"kernel32 unavailable ({e})")
    h = k.CreateFileW(str(path), GENERIC_READ, FILE_SHARE_READ, None, OPEN_EXISTING,
                      FILE_ATTRIBUTE_NORMAL | FILE_FLAG_NO_BUFFERING, None)
    if h is None or h == 0 or (h & INVALID_HANDLE_VALUE) == INVALID_HANDLE_VALUE:
        err = _win_error()
        fd = open_buffered(path)  # raises FileNotFoundError / PermissionError with the real errno
        return OpenedFile(fd, False, BUFFERED, f"CreateFileW(FILE_FLAG_NO_BUFFERING) failed (error {err})")
    try:
        fd = msvcrt.open_osfhandle(h, os.O_RDONLY | _binary())
    except OSError as e:
        k.CloseHandle(h)
        return OpenedFile(open_buffered(path), False, BUFFERED, f"open_osfhandle failed ({e})")
    try:
        _probe(fd)
    except OSError as e:
        os.close(fd)
        return OpenedFile(open_buffered(path), False, BUFFERED, f"unbuffered read failed ({e})")
    return OpenedFile(fd, True, NO_BUFFERING)


def open_for_reads(path: str | os.PathLike, uncached: bool = True) -> OpenedFile:
    """Open ``path`` read-only for positional reads, bypassing the OS page cache when
    ``uncached`` and the platform and filesystem allow it (see the module doc), else buffered.

    Reads of an uncached descriptor must use ALIGN-aligned offsets, lengths and buffers
    (engine.quant.aligned_empty). Returns an :class:`OpenedFile`. Raises OSError
    (FileNotFoundError, PermissionError, ...) when the file cannot be opened at all.
    """
    if not uncached:
        return OpenedFile(open_buffered(path), False, BUFFERED)
    kind = platform_kind()
    if kind == "o_direct":
        return _open_o_direct(path)
    if kind == "darwin":
        return _open_f_nocache(path)
    if kind == "windows":
        return _open_no_buffering(path)
    return OpenedFile(open_buffered(path), False, BUFFERED, "this system has no uncached-read flag")


def _preadv_windows(fd: int, buffers, offset: int) -> int:
    """``os.preadv`` for Windows: ReadFile into each buffer at an OVERLAPPED offset (the
    descriptor's file position is not used). Returns the bytes read; raises OSError."""
    import ctypes
    k, msvcrt = _win32()
    h = msvcrt.get_osfhandle(fd)

    class OVERLAPPED(ctypes.Structure):
        _fields_ = [("Internal", ctypes.c_size_t), ("InternalHigh", ctypes.c_size_t),
                    ("Offset", ctypes.c_uint32), ("OffsetHigh", ctypes.c_uint32), ("hEvent", ctypes.c_void_p)]

    total = 0
    pos = int(offset)
    for b in buffers:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n == 0:
            continue
        addr = ctypes.addressof((ctypes.c_char * n).from_buffer(mv))
        ov = OVERLAPPED(0, 0, pos & 0xFFFFFFFF, pos >> 32, None)
        got = ctypes.c_uint32(0)
        if not k.ReadFile(h, addr, n, ctypes.byref(got), ctypes.byref(ov)):
            err = _win_error()
            if err == ERROR_HANDLE_EOF:
                break
            raise OSError(f"ReadFile failed at offset {pos} (Windows error {err})")
        total += got.value
        pos += got.value
        if got.value < n:
            break
    return total


def _pread_loop(fd: int, buffers, offset: int) -> int:
    """``os.preadv`` from ``os.pread`` (POSIX systems whose Python lacks preadv)."""
    total, pos = 0, int(offset)
    for b in buffers:
        mv = memoryview(b).cast("B")
        data = os.pread(fd, mv.nbytes, pos)
        mv[:len(data)] = data
        total += len(data)
        pos += len(data)
        if len(data) < mv.nbytes:
            break
    return total


def positional_reader():
    """The ``preadv(fd, buffers, offset) -> bytes read`` of this platform: ``os.preadv``
    itself where it exists (the hot path adds no Python frame), ReadFile with an OVERLAPPED
    offset on Windows, ``os.pread`` per buffer elsewhere. None of them moves the file position."""
    if sys.platform == "win32":
        return _preadv_windows
    return getattr(os, "preadv", None) or _pread_loop


def preadv(fd: int, buffers, offset: int) -> int:
    """Read into ``buffers`` (writable buffers, e.g. uint8 numpy arrays) from byte ``offset``
    of ``fd`` with :func:`positional_reader`. Returns bytes read (short at end of file).
    Raises OSError."""
    return positional_reader()(fd, buffers, offset)
