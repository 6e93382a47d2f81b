"""The kernel module the engine runs: ``engine.kernels`` (numba), or ``engine.kernels_ref``
(numpy, slow but the same values) when numba is missing or ``COLIBRI_NO_NUMBA`` is set.
Every engine module that calls kernels imports ``K`` from here, so they all run the same one.

``engine.kernels`` is imported lazily (importlib's LazyLoader): importing the engine, a model
family or the expert cache costs no numba start; the module runs at the first use of one of
its names (a forward, the kernel preparation), and from then on ``K`` is that module itself.
So ``colibri --help``, ``models``, ``info`` and ``doctor`` never load numba."""

import importlib.util
import os
import sys


def _lazy(name: str):
    """``name`` as a module that is executed at its first attribute access."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    loader.exec_module(mod)
    return mod


if os.environ.get("COLIBRI_NO_NUMBA") or importlib.util.find_spec("numba") is None:
    from . import kernels_ref as K  # numba missing: slow but correct
else:
    K = _lazy(__package__ + ".kernels")
    setattr(sys.modules[__package__], "kernels", K)

__all__ = ["K"]
