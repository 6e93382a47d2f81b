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


def int_flavor() -> str:
    """How the q4 / q8 dot products run on this CPU: "vnni" (AVX-512 VNNI vpdpbusd: q4 and q8),
    "bw" (AVX-512BW vpmaddubsw + vpmaddwd: q4; q8 portable), "avx2" (the same two instructions
    on 256-bit halves, for q8 with vpsignb: q4 and q8) or "portable" (plain numba loops, any
    CPU). All paths compute the same real-valued expression. ``COLIBRI_INT_KERNEL`` forces one
    (tests use it to check every path here); a forced choice compiles uncached, so the on-disk
    cache only ever holds this machine's own choice."""
    forced = os.environ.get("COLIBRI_INT_KERNEL")
    if forced:
        if forced not in ("vnni", "bw", "avx2", "portable"):
            raise ValueError(f"COLIBRI_INT_KERNEL={forced!r}: choose vnni, bw, avx2 or portable")
        return forced
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    try:
        import llvmlite.binding as llb
        feats = llb.get_host_cpu_features()
    except Exception:
        return "portable"
    if feats.get("avx512bw") and feats.get("avx512f"):  # vnni also runs vpdpbusd on 256 bits (VL)
        return "vnni" if feats.get("avx512vnni") and feats.get("avx512vl") else "bw"
    if feats.get("avx2") and feats.get("fma"):
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
