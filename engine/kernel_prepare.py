"""Compile the compute kernels in a child process the first time, so the compiler's memory is
not the engine's.

numba compiles a kernel through LLVM the first time a process calls it with new argument types,
then writes the machine code to its cache (engine.kernels.CACHE_DIR); later processes load that
code in ~1-3 s. The compile itself is what costs memory: on a fresh install (or after an update
of engine/kernels/, which invalidates numba's cache) the engine process kept ~500 MB more
resident after compiling than after loading (the LLVM modules numba keeps with each compiled
function; ``malloc_trim`` and MADV_PAGEOUT give back almost none of it). The RSS guard counts
that memory as the process's own and took it from the expert cache: the first session after an
install ran a 7B-shaped model at a 4 GB budget with ~140 fewer expert slots than the next one.

So Engine.open, when the kernels a store needs were not yet prepared on this machine (a marker
file per kind of model in numba's cache folder, named by a digest of the kernel source, numba's
version, the CPU and the kind of model: :func:`marker_path`), first opens the same store in a
child process (the same Python running the child entry Engine.open passes,
engine.generate.compile_child, or multiprocessing's spawn in the frozen
bundle), with a small budget, runs a two-token answer there and exits; the child's compile
fills numba's cache, its memory goes with it, and the engine then loads the kernels from the
cache. A child that fails (a crash, no way to start a process) changes nothing: the engine
compiles in process as before, and does not try a child again for that kind of model until it
restarts. The child ends with its parent (a kill -9 of the app leaves no compile running:
:func:`exit_with_parent`). Two processes that start at once (the app and ``colibri serve``) compile once: the
second waits on a lock beside the marker (fsutil.FileLock) and then finds it. The environment
variable ``COLIBRI_COMPILE_IN_PROCESS=1`` skips the child (the test suite sets it: a pytest
process compiles hundreds of kernels anyway, and its RSS is nobody's budget).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from .fsutil import FileLock, atomic_write_text

log = logging.getLogger(__name__)

IN_PROCESS_ENV = "COLIBRI_COMPILE_IN_PROCESS"
_FAILED: set[tuple] = set()  # kinds whose child failed in this process: not tried again
CHILD_TIMEOUT_S = 1800.0  # a fresh compile of every kernel takes 1-3 min of one core here
MARKER_DIR = "colibri-prepared"
FIRST_COMPILE = "compiling the compute kernels for this kind of model (first start only: a minute or two)"


def kernel_kind(args, store, config) -> tuple:
    """What decides the argument types of the kernels a model calls: the family, the expert and
    dense weight formats, the expert layout, the KV cache's element type and whether PILOT runs
    (its lookahead kernels). Two stores of one kind share every compiled kernel."""
    return (str(args.model_type), str(store.quant), str(store.dense_quant), int(store.group_size),
            str(getattr(store, "expert_layout", "row_major")), str(config.kv_dtype), bool(config.pilot > 0))


def marker_path(cache_dir: str, kind: tuple) -> Path:
    """The marker file saying ``kind``'s kernels are in numba's cache at ``cache_dir``: named by
    a digest of ``kind``, the kernel source files' paths, sizes and modification times (numba's
    own cache key for a source file), numba's and Python's versions and the CPU target the
    kernels compile for (numba's cache is per CPU name and features: engine.kernel_facts)."""
    import numba
    from .kernel_facts import kernel_target
    sources = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in _kernel_sources()]
    try:
        t = kernel_target()
        cpu = t.cpu_name + t.features
    except ValueError:  # a bad COLIBRI_KERNEL_TARGET: a marker per machine is still right
        cpu = platform.machine()
    h = hashlib.sha256(repr((kind, sources, numba.__version__,
                             sys.version_info[:2], cpu)).encode()).hexdigest()[:24]
    return Path(cache_dir) / MARKER_DIR / h


def _kernel_sources() -> list[Path]:
    """The kernel package's source files (engine/kernels/*.py), sorted."""
    from . import kernels
    return sorted(Path(kernels.__file__).resolve().parent.glob("*.py"))


def _index_files(cache_dir: str) -> list[str]:
    """numba's index files (``<module>.<function>-<line>.py<version>.nbi``, one per cached
    kernel of a module of engine/kernels/, in numba's folder ``kernels_<digest of the path>``)
    under ``cache_dir``, relative to it."""
    stems = {p.stem for p in _kernel_sources()}
    try:
        return sorted(str(p.relative_to(cache_dir)) for p in Path(cache_dir).rglob("*.nbi")
                      if p.parent.name.split("_", 1)[0] == "kernels" and p.name.split(".", 1)[0] in stems)
    except OSError:
        return []


def _marker_holds(marker: Path, cache_dir: str) -> bool:
    """Whether ``marker`` (JSON: the kind and numba's index files after the child ran) still
    vouches for numba's cache: it reads and every index file it lists is there. A cache the
    user emptied (or a marker of another format) makes the child run again, rather than a
    silent compile in this process."""
    try:
        files = json.loads(marker.read_text())["index_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((Path(cache_dir) / f).is_file() for f in files)


def compile_needed(store: str, config) -> tuple[bool, float | None]:
    """Whether opening ``store`` with EngineConfig ``config`` must first compile kernels (its
    kind, :func:`kernel_kind`: the family, formats, KV type, PILOT on or off, has no marker
    that holds, or there is no writable cache), and the seconds that is expected to take: the
    longest compile a marker on this machine recorded, None when none did. The settings dialog
    says so before a change (PILOT on, another KV type) is applied.
    Raises StoreError / ConfigError: the store cannot be read."""
    from .expert_store import ExpertStore
    from .kernels import CACHE_DIR, SHIPPED_KINDS
    with ExpertStore(store, o_direct=False) as st:
        kind = kernel_kind(st.args, st, config)
    if CACHE_DIR is not None and (kind in SHIPPED_KINDS or _marker_holds(marker_path(CACHE_DIR, kind), CACHE_DIR)):
        return False, None
    seconds = []
    for m in (Path(CACHE_DIR) / MARKER_DIR).glob("*") if CACHE_DIR is not None else ():
        if m.suffix:  # the .lock files beside the markers
            continue
        try:
            seconds.append(float(json.loads(m.read_text())["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    seconds = [x for x in seconds if x > 0]  # 0: pre-built kernels (engine.kernel_cache), no compile
    return True, (max(seconds) if seconds else None)


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as process ``parent_pid`` is no longer its parent: a kill -9
    of the app during its first compile must not leave the compile running (minutes of a core
    and hundreds of MB). On Linux the kernel sends SIGKILL when the parent dies
    (PR_SET_PDEATHSIG); everywhere a daemon thread checks the parent pid twice a second (it
    also catches a parent that died before the prctl)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the thread below does it
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    if os.getppid() != parent_pid:
        os._exit(3)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_config(config) -> dict:
    """The child's settings: the engine's own, as small as the store allows (cap 1, a 64-token
    context, no reservation, idle fill, pinning, history or cluster: nothing of the user's is
    read or written but the store's files), one compute thread."""
    d = config.to_dict()
    d.update(cap=1, ram_budget_gb=None, context_length=min(64, int(d.get("context_length") or 64)),
             reserve_cache=False, idle_fill=False, pinning=False, history=False, cluster="", threads=1)
    return d


def _run_child(config: dict, child, niceness: int = 0, stop: threading.Event | None = None) -> int | None:
    """Run ``child(config, parent_pid, niceness)`` in a new process; its exit code (None: killed
    after CHILD_TIMEOUT_S, or because ``stop`` was set). From a Python interpreter: ``python -c``
    calling it with the settings as JSON on stdin (the parent's ``__main__`` is not imported
    again, as multiprocessing's spawn would). From the frozen bundle (PyInstaller, whose
    executable runs the app, not ``-c``): multiprocessing's spawn, which the bundle's entry point
    supports (``freeze_support``)."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    if getattr(sys, "frozen", False):
        import multiprocessing
        p = multiprocessing.get_context("spawn").Process(target=child, args=(config, os.getpid(), niceness),
                                                         daemon=True)
        p.start()
        while p.is_alive() and not stop.is_set() and time.monotonic() < deadline:
            p.join(0.5)
        if p.is_alive():
            p.kill()
            p.join()
            return None
        return p.exitcode
    import subprocess
    import tempfile
    root = str(Path(__file__).resolve().parents[1])  # the folder holding the engine package
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    # -c, not -m: the engine package imports the child's module, and runpy then warns on every
    # child's stderr (which a failed child's log line would quote as its cause)
    code = (f"import json, sys; from {child.__module__} import {child.__name__}; "
            f"{child.__name__}(json.loads(sys.stdin.read()), {os.getpid()}, {int(niceness)})")
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: nobody need drain it while we wait
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=err, env=env)
        try:
            p.stdin.write(json.dumps(config).encode())
            p.stdin.close()
        except OSError:  # it died at start: its exit code and stderr say why
            pass
        while p.poll() is None and not stop.is_set() and time.monotonic() < deadline:
            try:
                p.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
            return None
        err.seek(0)
        text = err.read().decode(errors="replace")
    if p.returncode != 0:  # its last line (the error), not a traceback; the whole of it at debug level
        lines = text.strip().splitlines()
        log.warning("the kernel compile's child process said: %s", lines[-1] if lines else "nothing")
        log.debug("the kernel compile's child process's stderr:\n%s", text)
    return p.returncode


def prepare_in_child(config, kind: tuple, report=None, *, child, niceness: int = 0,
                     stop: threading.Event | None = None) -> float:
    """Compile ``kind``'s kernels in a child process when this machine has not yet (see the
    module docstring). ``child(config: dict, parent_pid: int, niceness: int)``: what the child
    process runs, a module-level function (named in ``python -c``, pickled by spawn) that opens
    the store with ``config`` and generates (Engine.open passes engine.generate.compile_child; the
    engine is not imported here, which would be a circle). ``report(done, message)``: called with
    0 before the child starts and 1 when it succeeded (Engine.open turns them into LoadProgress
    stage "compile"). ``niceness``: the child's lower priority; ``stop``: set, it ends the child
    (nothing is marked). Returns the seconds it took (0.0 when the marker says they are ready, or when there is no writable
    numba cache to fill). Never raises: a failed child is logged and the engine compiles in
    process."""
    from .kernels import CACHE_DIR, CACHE_PROBLEM, SHIPPED_KINDS
    if kind in _FAILED or os.environ.get(IN_PROCESS_ENV) == "1":
        return 0.0
    if not CACHE_DIR:  # nothing would persist: say why every start compiles (here, in process)
        if report is not None:
            report(0, f"compiling the compute kernels in this process, at every start: {CACHE_PROBLEM}")
        return 0.0
    marker = marker_path(CACHE_DIR, kind)
    if _marker_holds(marker, CACHE_DIR):
        return 0.0
    if kind in SHIPPED_KINDS:  # pre-built kernels, already in numba's cache (engine.kernel_cache)
        write_marker(CACHE_DIR, kind, 0.0)
        return 0.0
    if report is not None:
        report(0, FIRST_COMPILE)
    t0 = time.perf_counter()
    with ExitStack() as held:  # a second first start (the app and `colibri serve`) waits for this one
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(FileLock(marker.with_suffix(".lock")))
        except OSError:  # no lock where the folder cannot be written (the marker's write then warns)
            pass
        if _marker_holds(marker, CACHE_DIR):
            dt = time.perf_counter() - t0
            if report is not None:
                report(1, f"compute kernels compiled by another colibri process ({dt:.0f} s)")
            return dt
        return _prepare(config, kind, marker, CACHE_DIR, report, t0, child, niceness, stop)


def _prepare(config, kind: tuple, marker: Path, cache_dir: str, report, t0: float, child, niceness: int = 0,
             stop: threading.Event | None = None) -> float:
    """prepare_in_child's compile, the lock held: the child, then the marker."""
    try:
        code = _run_child(child_config(config), child, niceness, stop)
    except Exception as e:  # noqa: BLE001 - the engine compiles in process instead
        log.warning("could not compile the kernels in a child process (%s: %s); compiling them here",
                    type(e).__name__, e)
        _FAILED.add(kind)
        return time.perf_counter() - t0
    if stop is not None and stop.is_set():  # ended on purpose: the next one to need it compiles it
        return time.perf_counter() - t0
    if code != 0:
        log.warning("compiling the kernels in a child process failed (exit code %s); compiling them here", code)
        _FAILED.add(kind)
        return time.perf_counter() - t0
    write_marker(cache_dir, kind, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if report is not None:
        report(1, f"compute kernels compiled in {dt:.0f} s")
    return dt



def write_marker(cache_dir: str, kind: tuple, seconds: float) -> None:
    """Mark ``kind``'s kernels as in numba's cache at ``cache_dir`` (compiled in ``seconds``; 0
    for pre-built ones): :func:`marker_path`, listing numba's index files now there. Logs, never
    raises: without the marker the next start only prepares them again."""
    marker = marker_path(cache_dir, kind)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker, json.dumps({"kind": repr(kind), "index_files": _index_files(cache_dir),
                                              "seconds": round(seconds, 1)}) + "\n")
    except OSError as e:  # the next start prepares them again: slower, never wrong
        log.warning("could not write %s (%s); every start will run the compile's child process again "
                    "until it can: make %s a writable folder (or delete it)", marker, e, marker.parent)


BACKGROUND_NICENESS = 10  # a compile nobody waits for yet gives the cores to the answers


def kernel_variants(config) -> list:
    """The settings (EngineConfig) besides ``config`` that open its store with other kernels:
    PILOT switched (off <-> on) first, then each other KV cache type with PILOT off and on. The
    other settings change no kernel (:func:`kernel_kind`)."""
    from dataclasses import replace
    from .settings import KV_DTYPES
    pilot_other = 1 if config.pilot == 0 else 0
    out = [replace(config, pilot=pilot_other)]
    for kv in KV_DTYPES:
        if kv != config.kv_dtype:
            out += [replace(config, kv_dtype=kv, pilot=config.pilot), replace(config, kv_dtype=kv, pilot=pilot_other)]
    return out


class KernelVariants:
    """Compiles, one after the other in a background thread, the kernels of the
    :func:`kernel_variants` of a store's settings that this machine has not prepared, each in a
    child process at a lower priority (``BACKGROUND_NICENESS``). A setting changed later (PILOT
    on, the other KV type) then reopens the model on cached kernels in seconds instead of
    compiling for minutes; a reopen while one of them still compiles waits for that child (the
    marker's lock), not for a second compile. Never raises."""

    def __init__(self, config, child):
        self.config, self.child = config, child
        self._stop = threading.Event()
        self.done: list[tuple] = []  # kinds prepared by this object (compiled or found ready)
        self.finished = threading.Event()  # set when every variant was tried or stop() was called
        self._thread = threading.Thread(target=self._run, name="kernel-variants", daemon=True)

    def start(self) -> "KernelVariants":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            from .kernels import CACHE_DIR
            if os.environ.get(IN_PROCESS_ENV) == "1" or not CACHE_DIR:  # every process compiles its own
                return
            from .expert_store import ExpertStore
            with ExpertStore(self.config.store, o_direct=False) as st:
                kinds = [(kernel_kind(st.args, st, c), c) for c in kernel_variants(self.config)]
            for kind, cfg in kinds:
                if self._stop.is_set():
                    return
                prepare_in_child(cfg, kind, child=self.child, niceness=BACKGROUND_NICENESS, stop=self._stop)
                if not self._stop.is_set() and kind not in _FAILED:
                    self.done.append(kind)
        except Exception:  # noqa: BLE001 - a missed head start only means a compile later
            log.debug("preparing the other settings' kernels failed", exc_info=True)
        finally:
            self.finished.set()

    def stop(self, timeout: float | None = None) -> None:
        """End the compile under way (its child is killed) and start no other; waits for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def prepare_kernel_variants(config, child) -> KernelVariants:
    """Start compiling, in the background, the kernels that the other values of the settings that
    choose kernels (PILOT on or off, the KV cache type) need for ``config``'s store (an
    EngineConfig with ``store`` set); see :class:`KernelVariants`; ``child`` as for
    :func:`prepare_in_child`. Call it once the model is open, so its own kernels come first."""
    return KernelVariants(config, child).start()
