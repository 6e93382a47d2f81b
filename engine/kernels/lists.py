"""numba typed lists built by cached kernels. numba compiles typed.List's own methods (its
constructor and append, per item type) in every process and caches none of them: ~3 CPU s
for the fused decode step's lists at each open of a model. Built here, they load from the
kernel cache (and the pre-built kernels) like every kernel."""

from __future__ import annotations

from numba import njit
from numba.typed import List

from .setup import _KW


@njit(nogil=True, cache=_KW["cache"])
def list_of(item):
    """A new typed List holding ``item``; its item type is ``item``'s numba type."""
    out = List()
    out.append(item)
    return out


@njit(nogil=True, cache=_KW["cache"])
def list_append(lst, item):
    """Append ``item`` to the typed List ``lst`` (``item`` of its item type)."""
    lst.append(item)


def typed_list(items):
    """A typed List of ``items`` (a non-empty sequence of values of one numba type), built
    by the two cached kernels above. Raises IndexError for an empty sequence."""
    out = list_of(items[0])
    for v in items[1:]:
        list_append(out, v)
    return out
