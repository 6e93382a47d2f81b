"""The kernel module the engine runs: ``engine.kernels`` (numba), or ``engine.kernels_ref``
(numpy, slow but the same values) when numba is missing or ``COLIBRI_NO_NUMBA`` is set.
Every engine module that calls kernels imports ``K`` from here, so they all run the same one."""

import os

if os.environ.get("COLIBRI_NO_NUMBA"):
    from . import kernels_ref as K
else:
    try:
        from . import kernels as K
    except ImportError:  # numba missing: slow but correct
        from . import kernels_ref as K

__all__ = ["K"]
