"""The expert cache's arena (engine/cache/arena.py) on its own: slot addressing, page release,
populate ahead."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cache.arena import Arena, _populate_call

PAGE = 4096


def test_slots_are_disjoint_views_at_their_offsets():
    a = Arena(2, 3, 2 * PAGE)
    for layer in range(2):
        for s in range(3):
            a.buf(layer, s)[:] = layer * 3 + s + 1
    assert [int(a.array[a.offset(layer, s)]) for layer in range(2) for s in range(3)] == [1, 2, 3, 4, 5, 6]
    assert a.offset(np.int32(1), np.int32(2)) == 5 * 2 * PAGE and a.base % PAGE == 0


def test_release_gives_the_pages_back_and_forgets_them():
    a = Arena(1, 2, PAGE)
    a.buf(0, 0)[:] = 7
    a.buf(0, 1)[:] = 9
    a.faulted[0] = True
    a.release(0, 0)
    assert not a.faulted[0, 0] and a.faulted[0, 1]
    assert not a.buf(0, 0).any() and (a.buf(0, 1) == 9).all()  # private anonymous: zeros again


def test_populate_leaves_the_contents_and_the_bookkeeping_to_the_caller():
    madvise = _populate_call()
    if madvise is None:
        pytest.skip("no libc madvise")
    a = Arena(1, 2, PAGE, madvise=madvise)
    a.buf(0, 1)[:] = 5
    ok, again = a.populate(0, 1)
    if not ok and not again:
        pytest.skip("kernel without MADV_POPULATE_WRITE")
    assert (a.buf(0, 1) == 5).all() and not a.faulted.any()
