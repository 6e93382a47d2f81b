"""What the compute kernels (engine.kernels) will use on this machine, worked out without
importing numba: the kernel cache folder, the CPU's features as LLVM sees them, the integer
dot-product path, numba's threading layer and thread limit. engine.kernels takes the first
three from here; ``colibri doctor`` reports all of them without starting numba (its import
and thread pool cost seconds on a small machine)."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import tempfile
from dataclasses import dataclass


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=path)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def _cache_dir_problem(path: str, env: str | None) -> str:
    """Why ``path`` cannot be the kernel cache: a file in the way (and what to do), else unwritable."""
    q = os.path.abspath(os.path.expanduser(path))
    a = q
    while not os.path.isdir(a) and os.path.dirname(a) != a:
        if os.path.lexists(a):
            head = (f"{path} is a file, not a folder" if a == q else
                    f"{path} cannot be created: {a} is a file, not a folder")
            todo = (f"point {env} at a folder or unset it" if env else "move or rename that file")
            return f"{head}; {todo} (kernels compile at every start until then)"
        a = os.path.dirname(a)
    via = f"{env}=" if env else ""
    return f"{via}{path} is not writable; kernels compile at every start (make it writable" + (
        f" or point {env} at a folder you can write)" if env else ")")


def numba_cache_dir() -> tuple[str | None, str]:
    """(the folder numba caches compiled kernels in, or None when no folder is writable;
    why not, "" when there is one).

    ``NUMBA_CACHE_DIR`` if the user set it (and it is writable), else
    ``<platformdirs user cache>/colibri-desktop/numba``."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        return (user, "") if _writable_dir(user) else (None, _cache_dir_problem(user, "NUMBA_CACHE_DIR"))
    try:
        import platformdirs
        d = os.path.join(platformdirs.user_cache_dir("colibri-desktop", appauthor=False), "numba")
    except Exception:  # platformdirs cannot name a folder (no HOME at all)
        return None, "no user cache folder (no home folder); kernels compile at every start"
    return (d, "") if _writable_dir(d) else (None, _cache_dir_problem(d, None))


TARGET_ENV = "COLIBRI_KERNEL_TARGET"
_V2 = ("cx16", "popcnt", "sahf", "sse3", "sse4.1", "sse4.2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# The fixed x86-64 targets the kernels compile for (lowest first): the psABI levels as LLVM
# names them, and v4 with VNNI (the int8 dot product of Ice Lake, Sapphire Rapids and Zen 4).
# A fixed target makes numba's cache the same on every CPU of a level, so pre-built kernels
# can ship (engine.kernel_cache); each level's features are spelled out because numba adds
# the host's own features to a bare CPU name.
KERNEL_TARGETS = {
    "x86-64-v2": ("x86-64-v2", _V2),
    "x86-64-v3": ("x86-64-v3", _V3),
    "x86-64-v4": ("x86-64-v4", _V4),
    "x86-64-v4-vnni": ("x86-64-v4", _V4 + ("avx512vnni",)),
}
# LLVM tunes its x86-64-v4 for Skylake-X, whose loops it then vectorizes 256 bits wide: the
# decode of a 100 MB int8 model took 30% more CPU per token than the same code built for Zen 4
# (512 bits wide), so the v4 levels lift that preference.
_TUNING = {"x86-64-v4": ("-prefer-256-bit",), "x86-64-v4-vnni": ("-prefer-256-bit",)}


@dataclass(frozen=True)
class KernelTarget:
    """The CPU the kernels compile for. ``level``: a KERNEL_TARGETS key, "host" (this CPU's
    own name and features: no x86-64 level fits, another architecture, or COLIBRI_KERNEL_TARGET=host)
    or "user" (the user set NUMBA_CPU_NAME / NUMBA_CPU_FEATURES). ``cpu_name`` and ``features``
    (an LLVM feature string, "+avx2,+fma,...") are what numba gets; ``flags`` the features the
    code may use (what the integer path is chosen from)."""
    level: str
    cpu_name: str
    features: str
    flags: frozenset

    @property
    def fixed(self) -> bool:
        """Whether this is one of KERNEL_TARGETS (portable between CPUs of that level)."""
        return self.level in KERNEL_TARGETS


def _host_features() -> dict[str, bool]:
    try:
        import llvmlite.binding as llb
        return {str(k): bool(v) for k, v in llb.get_host_cpu_features().items()}
    except Exception:  # noqa: BLE001 - llvmlite missing or without host feature support
        return {}


def _host_target(level: str = "host") -> KernelTarget:
    feats = _host_features()
    try:
        import llvmlite.binding as llb
        name = llb.get_host_cpu_name()
    except Exception:  # noqa: BLE001
        name = "generic"
    flat = ",".join(("+" if v else "-") + k for k, v in sorted(feats.items()))
    return KernelTarget(level, name, flat, frozenset(k for k, v in feats.items() if v))


def _level_target(level: str) -> KernelTarget:
    name, feats = KERNEL_TARGETS[level]
    return KernelTarget(level, name, ",".join(("+" + f for f in feats)) + "".join("," + t for t in _TUNING.get(level, ())),
                        frozenset(feats))


def kernel_target() -> KernelTarget:
    """The CPU target the kernels compile for on this machine (engine.kernels pins numba to it
    before numba loads): the highest of KERNEL_TARGETS whose features this CPU has, on x86-64.
    ``COLIBRI_KERNEL_TARGET`` chooses: "host" (this CPU's exact model: nothing pre-built fits it)
    or a level of KERNEL_TARGETS this CPU can run (the pre-built kernels' build uses it).
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set by the user win (level "user").
    Raises ValueError: COLIBRI_KERNEL_TARGET names no target, or a level this CPU lacks."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        for level in KERNEL_TARGETS:  # a level set by engine.kernels in a parent process
            t = _level_target(level)
            if (os.environ.get("NUMBA_CPU_NAME"), os.environ.get("NUMBA_CPU_FEATURES")) == (t.cpu_name, t.features):
                return t
        host = _host_target()
        feats = os.environ.get("NUMBA_CPU_FEATURES") or host.features
        flags = frozenset(f[1:] for f in feats.split(",") if f.startswith("+"))
        return KernelTarget("user", os.environ.get("NUMBA_CPU_NAME") or host.cpu_name, feats, flags)
    forced = os.environ.get(TARGET_ENV, "").strip()
    import platform
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if forced:
        if forced == "host":
            return _host_target()
        if forced not in KERNEL_TARGETS:
            raise ValueError(f"{TARGET_ENV}={forced!r}: choose host or one of {', '.join(KERNEL_TARGETS)}")
        lacking = [f for f in KERNEL_TARGETS[forced][1] if not _host_features().get(f)] if x86 else ["x86-64"]
        if lacking:
            raise ValueError(f"{TARGET_ENV}={forced}: this CPU lacks {', '.join(lacking)}; "
                             f"choose a lower level or host (or unset it)")
        return _level_target(forced)
    if not x86:
        return _host_target()
    have = _host_features()
    fits = [lv for lv, (_, feats) in KERNEL_TARGETS.items() if all(have.get(f) for f in feats)]
    return _level_target(fits[-1]) if fits else _host_target()


def int_flavor(target: KernelTarget | None = None) -> str:
    """How the q4 / q8 dot products run for the kernel target (``target``, default
    :func:`kernel_target`): "vnni" (AVX-512 VNNI vpdpbusd: q4 and q8),
    "bw" (AVX-512BW vpmaddubsw + vpmaddwd: q4; q8 portable), "avx2" (the same two instructions
    on 256-bit halves, for q8 with vpsignb: q4 and q8) or "portable" (plain numba loops, any
    CPU). All paths compute the same real-valued expression. ``COLIBRI_INT_KERNEL`` forces one
    (tests use it to check every path here); a forced choice compiles uncached, so the on-disk
    cache only ever holds the target's own choice."""
    forced = os.environ.get("COLIBRI_INT_KERNEL")
    if forced:
        if forced not in ("vnni", "bw", "avx2", "portable"):
            raise ValueError(f"COLIBRI_INT_KERNEL={forced!r}: choose vnni, bw, avx2 or portable")
        return forced
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    try:
        feats = (target or kernel_target()).flags
    except ValueError:  # a bad COLIBRI_KERNEL_TARGET: engine.kernels reports it
        feats = frozenset(k for k, v in _host_features().items() if v)
    if "avx512bw" in feats and "avx512f" in feats:  # vnni also runs vpdpbusd on 256 bits (VL)
        return "vnni" if "avx512vnni" in feats and "avx512vl" in feats else "bw"
    if "avx2" in feats and "fma" in feats:
        return "avx2"
    return "portable"


def cpu_features() -> dict[str, bool]:
    """The host CPU's instruction-set features as LLVM (llvmlite) reports them, e.g.
    {"avx2": True, "avx512f": True, "avx512vnni": False, ...}; {} when unknown. For reports
    (``colibri doctor``); the kernels choose their path with INT_FLAVOR."""
    try:
        import llvmlite.binding as llb
        return {str(k): bool(v) for k, v in llb.get_host_cpu_features().items()}
    except Exception:  # noqa: BLE001 - llvmlite without host feature support
        return {}


LAYER_LIBRARIES = {"omp": "omppool", "tbb": "tbbpool"}  # numba's thread-pool extension per layer
DEFAULT_LAYER_PRIORITY = "omp tbb workqueue"  # the order engine.kernels sets (numba's own starts with tbb)


def threading_layer() -> str:
    """The threading layer numba will start in engine.kernels ("omp", "tbb" or "workqueue"):
    ``NUMBA_THREADING_LAYER`` when it names one, else the first of
    ``NUMBA_THREADING_LAYER_PRIORITY`` (default "omp tbb workqueue") whose thread-pool
    library loads here (omppool needs libgomp, tbbpool libtbb), found from numba's files
    without importing numba. "unknown" when numba is not installed."""
    spec = importlib.util.find_spec("numba")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    forced = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if forced in ("omp", "tbb", "workqueue"):
        return forced
    base = list(spec.submodule_search_locations)[0]
    for layer in os.environ.get("NUMBA_THREADING_LAYER_PRIORITY", DEFAULT_LAYER_PRIORITY).split():
        if layer == "workqueue":
            return layer
        for lib in glob.glob(os.path.join(base, "np", "ufunc", LAYER_LIBRARIES.get(layer, "-") + "*.so")):
            try:
                ctypes.CDLL(lib, mode=getattr(os, "RTLD_LAZY", 1) | getattr(os, "RTLD_LOCAL", 0))
                return layer
            except OSError:
                continue
    return "workqueue"


def thread_limit() -> int:
    """NUMBA_NUM_THREADS as numba computes it: the variable, else the CPUs of this process's
    affinity mask (else os.cpu_count())."""
    env = os.environ.get("NUMBA_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
