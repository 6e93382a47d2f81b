"""Process-wide setup of the kernels, done before the first kernel compiles, and the thread
controls of the parallel kernels.

- numba's on-disk cache goes to the user cache folder (platformdirs), not next to the package:
  a read-only install with no writable home would otherwise fail at import with numba's "no
  locator available". ``NUMBA_CACHE_DIR`` set by the user wins; if no folder is writable the
  kernels compile uncached (``CACHE_DIR is None``).
- the CPU target: numba compiles for a fixed x86-64 level (engine.kernel_facts.kernel_target:
  x86-64-v3 = AVX2/FMA, v4 = AVX-512, v4 with VNNI) rather than this CPU's exact model, so that
  its cache is the same on every CPU of a level and the pre-built kernels shipped with colibri
  (engine.kernel_cache) are loaded instead of compiled; they are copied into the cache folder
  before the first kernel compiles.
- threading layer: OpenMP, then TBB, then numba's ``workqueue`` (unless the user set
  ``NUMBA_THREADING_LAYER``). ``workqueue`` aborts the process when two threads launch parallel
  kernels at once, so under it (``SERIALIZED``) every parallel kernel runs under one lock.
- OpenMP wait policy: spin a while, then sleep. Spinning threads fight any other busy program
  for its core, but ``OMP_WAIT_POLICY=PASSIVE`` pays a futex wake at each of the many small
  parallel regions of a token; instead the engine runs only as many threads as there are free
  cores (threads = 0: engine.sysinfo.FreeCores). The spin is shortened from libgomp's 300000
  to ``GOMP_SPINCOUNT=30000`` (unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY):
  libgomp's default kept a core spinning ~5-8 ms after every parallel region while a
  streaming decode waited for the disk, and ~0.5 ms still covers the gaps between a token's
  kernels (docs/decisions/0005-compute-threads-auto.md).
"""

from __future__ import annotations

import functools
import os
import sys
import threading


# the cache folder, the integer-kernel path and the CPU features are worked out without numba
# (engine.kernel_facts) so that `colibri doctor` can report them without starting it
from ..kernel_facts import (_cache_dir_problem, numba_cache_dir, _writable_dir,  # noqa: E402,F401
                           cpu_features, int_flavor as _int_flavor, kernel_target)


CACHE_DIR, CACHE_PROBLEM = numba_cache_dir()  # CACHE_PROBLEM: why CACHE_DIR is None ("" otherwise)
if CACHE_DIR is not None:
    os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
TARGET = kernel_target()  # ValueError: a bad COLIBRI_KERNEL_TARGET, before anything compiles
if TARGET.fixed:
    os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = TARGET.cpu_name, TARGET.features
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp tbb workqueue"
GOMP_SPINCOUNT_DEFAULT = "30000"  # see the module docstring; read by libgomp when it loads


def default_spin_env(environ) -> dict:
    """The environment the kernels' OpenMP threads get from the engine: GOMP_SPINCOUNT=30000
    unless ``environ`` (a mapping) sets GOMP_SPINCOUNT or OMP_WAIT_POLICY (the user's choice
    wins). Returns the variables to add ({} when none)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": GOMP_SPINCOUNT_DEFAULT}


os.environ.update(default_spin_env(os.environ))
_numba_was_loaded = "numba" in sys.modules

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

if _numba_was_loaded:  # numba read its config before us: apply the same choices directly
    if CACHE_DIR is not None:
        numba.config.CACHE_DIR = CACHE_DIR
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    if TARGET.fixed:  # read when numba's code generator starts, at the first compile
        numba.config.CPU_NAME, numba.config.CPU_FEATURES = TARGET.cpu_name, TARGET.features

from ..kernel_cache import install_shipped  # noqa: E402

# what the pre-built kernels gave (a line for reports), and the kinds of model they made ready
SHIPPED, SHIPPED_KINDS = install_shipped(CACHE_DIR, TARGET)


def _start_threading_layer() -> str:
    """Start numba's thread pool now (one call of a tiny parallel kernel: numba's public way)
    and return the layer it chose ("omp", "tbb", "workqueue"), or "unknown" if none started."""
    try:
        # cached like every kernel, i.e. only when a cache folder is writable: cache=True with
        # none would make numba raise "no locator available" and leave the layer unstarted
        @njit(parallel=True, cache=CACHE_DIR is not None)
        def _touch(n):
            acc = 0
            for i in prange(n):
                acc += i
            return acc

        _touch(2)
        return str(numba.threading_layer())
    except Exception:  # noqa: BLE001 - no layer at all: kernels then run serialized
        return "unknown"


THREADING_LAYER = _start_threading_layer()
SERIALIZED = THREADING_LAYER not in ("omp", "tbb")  # workqueue (or unknown): not thread-safe



INT_FLAVOR = _int_flavor(TARGET)


_FM = {"reassoc", "contract", "nsz", "arcp"}  # allow SIMD reductions; no inf/nan shortcuts
_KW = dict(nogil=True, fastmath=_FM,
           cache=CACHE_DIR is not None and not os.environ.get("COLIBRI_INT_KERNEL"))

F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# --- launch safety ------------------------------------------------------------------------

# Every parallel kernel: with a threading layer that is not thread-safe (SERIALIZED), each is
# launched under one lock (engine/kernels/__init__.py rebinds the names it exports).
PARALLEL_KERNELS = ("linear_f32", "linear_f16", "linear_q8", "linear_q4", "linears_q8", "linears_q4",
                    "linear_q4i", "linears_q4i",
                    "linear_mxfp4", "expert_f32",
                    "expert_f16", "expert_q8", "expert_q4", "expert_q4i", "experts_q4_t1", "experts_q8_t1",
                    "experts_q4_sorted", "combine_sorted",
                    "attention", "attention_sink", "gated_delta", "kv_put_f16", "attention_t1",
                    "decode_layers_t1", "linear_kq", "expert_kq", "experts_kq_t1",
                    "experts_kq_sorted")
_LAUNCH_LOCK = threading.Lock()


def _serialized(kernel):
    @functools.wraps(kernel)
    def run(*args):
        with _LAUNCH_LOCK:
            return kernel(*args)
    run.kernel = kernel
    return run




def set_threads(n: int) -> None:
    """Threads of the parallel kernels launched from the calling thread (numba's count is per
    thread), clamped to 1..NUMBA_NUM_THREADS."""
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def thread_limit() -> int:
    """The most threads a parallel kernel may use in this process (NUMBA_NUM_THREADS)."""
    return int(numba.config.NUMBA_NUM_THREADS)


def current_threads() -> int:
    """Threads of the parallel kernels launched from the calling thread now."""
    return int(numba.get_num_threads())
