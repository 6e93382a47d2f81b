"""Resident weight matrices the decode step streams every token sit on transparent huge pages
(engine.quant.huge_empty): the dense tensors load_dense reads and the q / k / v / o matrices
Linear.interleave re-lays. The values are those of np.empty + a copy."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.expert_store import _pread_safetensors
from engine.models.base import Linear
from engine.quant import HUGE_PAGE, huge_empty

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="transparent huge pages are Linux's")


def _advised(a: np.ndarray) -> bool:
    """Whether the mapping holding a's first byte is advised MADV_HUGEPAGE ("hg" in VmFlags)."""
    addr, inside = a.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


def test_huge_empty_is_aligned_and_advised_above_one_huge_page():
    a = huge_empty((3, HUGE_PAGE // 4), np.float32)
    assert a.shape == (3, HUGE_PAGE // 4) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % HUGE_PAGE == 0 and _advised(a)
    # under one huge page: plain np.empty, owning its memory (malloc's heap: whether that region is
    # advised depends on what numpy allocated before, so the mapping's flags say nothing here)
    small = huge_empty((1000,), np.float32)
    assert small.shape == (1000,) and small.flags.owndata and small.base is None
    assert not a.flags.owndata  # the big one is a view of its own mapping


def test_loaded_dense_tensors_and_interleaved_matrices_are_on_huge_pages(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.integers(0, 255, (2048, 1024), dtype=np.uint8)  # int4 [2048, 2048]: 2 MB
    s = rng.integers(0, 2**15, (2048, 64), dtype=np.uint16)
    save_file({"q_proj.w": w, "q_proj.s": s}, str(tmp_path / "dense.safetensors"))
    dense = _pread_safetensors(tmp_path / "dense.safetensors", ["q_proj.w", "q_proj.s"])
    assert np.array_equal(dense["q_proj.w"], w) and np.array_equal(dense["q_proj.s"], s)
    assert dense["q_proj.w"].ctypes.data % HUGE_PAGE == 0 and _advised(dense["q_proj.w"])
    lin = Linear({"q_proj.w": w, "q_proj.s": s.astype(np.uint16)}, "q_proj", "int4").interleave()
    assert lin.il and lin.w.ctypes.data % HUGE_PAGE == 0 and _advised(lin.w)
