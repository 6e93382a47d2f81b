"""Chaos test of expert streaming: read errors (EIO), short reads and slow reads injected in
the store reader (``ExpertStore._preadv``) while generating with PILOT workers on, at caps
down to 1.

Every run must either finish with the ids of an undisturbed run or end with an error event
naming the expert (and its file); no acquire of an expert may wait longer than the read
timeout (the cache's STALL_TIMEOUT_S, lowered here) plus scheduling slack; after ``close`` no
engine thread and no file descriptor may be left. After a failed request, a second request
on the same engine must run again.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from engine.cache import lookups as ec
from engine.config import EngineConfig
from engine.events import Finished, GenerateRequest, SamplingParams
from engine.generate import Engine, engine_threads_alive

READ_TIMEOUT_S = 2.0  # the cache's stall timeout during this test
TOKENS = 10
SLACK_S = 20.0  # scheduling delay on a loaded 2-core machine: only a missed timeout trips it
HANG_S = 120.0  # a stalled read: until the disk recovers (release), far past the timeout


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Chaos:
    """A preadv that fails with EIO, returns short, or stalls, at the given rates (seeded)."""

    def __init__(self, real, seed: int, eio: float, short: float, slow: float, slow_s: float):
        self.real, self.rng, self.lock = real, random.Random(seed), threading.Lock()
        self.eio, self.short, self.slow, self.slow_s = eio, short, slow, slow_s
        self.injected = 0
        self.release = threading.Event()  # the disk recovers: stalled reads return

    def __call__(self, fd, bufs, offset):
        with self.lock:
            r = self.rng.random()
            pause = self.rng.uniform(0, self.slow_s)
        if r < self.eio:
            self.injected += 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        if r < self.eio + self.short:
            self.injected += 1
            b = bufs[0]
            return self.real(fd, [b[:max(0, len(b) // 2 - 4096)]], offset)
        if r < self.eio + self.short + self.slow:
            self.injected += 1
            self.release.wait(pause)
        return self.real(fd, bufs, offset)


def _req():
    return GenerateRequest(prompt_ids=tuple(range(20, 44)), sampling=SamplingParams(max_new_tokens=TOKENS))


@pytest.fixture(scope="module")
def reference(medium_store):
    cfg = EngineConfig(store=str(medium_store), cap=16, pilot=0, history=False, pinning=False)
    with Engine.open(cfg) as eng:
        fin = [e for e in eng.generate(_req()) if isinstance(e, Finished)][0]
    assert fin.finish_reason == "length" and len(fin.token_ids) == TOKENS
    return fin.token_ids


CASES = [  # (cap, pilot, workers, eio, short, slow, slow_s, seed)
    (1, 1, 2, 0.05, 0.05, 0.10, 0.01, 1),
    (2, 2, 2, 0.08, 0.04, 0.10, 0.01, 2),
    (4, 3, 2, 0.10, 0.10, 0.05, 0.02, 3),
    (8, 1, 1, 0.02, 0.02, 0.20, 0.01, 4),
    (1, 2, 2, 0.30, 0.20, 0.00, 0.00, 5),  # so many failures that a double failure is likely
    (3, 1, 2, 0.00, 0.00, 0.05, HANG_S, 6),  # some reads stall past the read timeout
]


@pytest.mark.parametrize("cap,pilot,workers,eio,short,slow,slow_s,seed", CASES)
def test_chaos_streaming(medium_store, reference, monkeypatch, cap, pilot, workers, eio, short, slow, slow_s, seed):
    monkeypatch.setattr(ec, "STALL_TIMEOUT_S", READ_TIMEOUT_S)
    fds0 = _fds()
    cfg = EngineConfig(store=str(medium_store), cap=cap, pilot=pilot, pilot_workers=workers,
                       spec_precision=0.0, history=False, pinning=True, checksum="always")
    eng = Engine.open(cfg)
    waits: list[float] = []
    real_acquire = eng.cache.acquire

    def timed_acquire(layer, expert):
        t0 = time.perf_counter()
        try:
            return real_acquire(layer, expert)
        finally:
            waits.append(time.perf_counter() - t0)

    eng.cache.acquire = timed_acquire
    chaos = Chaos(eng.store._preadv, seed, eio, short, slow, slow_s)
    try:
        eng.store._preadv = chaos
        for attempt in range(2):
            fin = [e for e in eng.generate(_req()) if isinstance(e, Finished)][0]
            assert max(waits) < READ_TIMEOUT_S + SLACK_S, max(waits)
            if fin.finish_reason == "error":
                assert "of layer" in fin.error and "expert" in fin.error, fin.error
                assert str(medium_store) in fin.error, fin.error
                assert "Traceback" not in fin.error
                chaos.eio = chaos.short = chaos.slow = 0.0  # the disk recovers: the next request runs
                chaos.release.set()
            else:
                assert fin.finish_reason == "length", fin
                assert fin.token_ids == reference
                break
        else:
            raise AssertionError(f"a request after the disk recovered failed: {fin.error}")
        assert chaos.injected > 0
    finally:
        chaos.release.set()
        eng.close()
    assert engine_threads_alive() == []
    assert _fds() <= fds0, (fds0, _fds())


@pytest.mark.parametrize("mode", ["eio", "stall"])
def test_failing_file_is_named(medium_store, monkeypatch, mode):
    """Every read of layer 1's expert file fails (EIO) or stalls past the read timeout: the
    request ends within the timeout with an error naming the file and the expert."""
    monkeypatch.setattr(ec, "STALL_TIMEOUT_S", READ_TIMEOUT_S)
    cfg = EngineConfig(store=str(medium_store), cap=2, pilot=1, pilot_workers=2, history=False)
    with Engine.open(cfg) as eng:
        real, bad_fd = eng.store._preadv, eng.store._fds["experts/layer_001.bin"]
        recovered = threading.Event()

        def faulty(fd, bufs, offset):
            if fd == bad_fd:
                if mode == "eio":
                    raise OSError(errno.EIO, "Input/output error (injected)")
                recovered.wait(HANG_S)  # stalled until the request has ended
            return real(fd, bufs, offset)

        eng.store._preadv = faulty
        t0 = time.perf_counter()
        fin = [e for e in eng.generate(_req()) if isinstance(e, Finished)][0]
        took = time.perf_counter() - t0
        recovered.set()
    assert fin.finish_reason == "error"
    assert str(medium_store / "experts" / "layer_001.bin") in fin.error and "of layer 1" in fin.error, fin.error
    assert ("failed twice" if mode == "eio" else "did not finish") in fin.error
    assert took < 2 * READ_TIMEOUT_S + 2 * SLACK_S + 30, took
    assert engine_threads_alive() == []
