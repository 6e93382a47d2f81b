"""Fuzz the checkpoint reader and the store reader with seeded mutations of their inputs.

2,000 cases (``CASES`` below): safetensors files (header and body), the sharded index
``model.safetensors.index.json``, ``config.json`` and the store's ``manifest.json`` and
``dense.safetensors``; mutations: truncation, bit flips, inserted/deleted bytes, digit runs
replaced by huge numbers, and JSON-level edits (a key deleted, a value replaced by a wrong
type, a huge/negative/non-finite number, a path outside the folder). Every case must either
read cleanly or raise the engine's own error class (EngineError) with a message naming
the folder it read (the file or the store); any other exception, a hang (> HANG_S), or a
crash (pyo3 panics are BaseExceptions) fails the test.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import pytest

from engine.checkpoint import Checkpoint
from engine.errors import EngineError
from engine.expert_store import ExpertStore

CASES = {"safetensors": 500, "index": 350, "config": 400, "manifest": 550, "dense": 200}
HANG_S = 10.0
WRONG = [None, True, "x", "", [], {}, [1, 2], {"a": 1}, -1, 0, 1, 2**31, 2**63, 2**64 + 7, -(2**63),
         1e308, -1e308, 0.5, float("nan"), float("inf"), "../../etc/passwd", "/etc/passwd",
         "experts/layer_000.bin", "config.json", 10**40]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def _walk(obj, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            yield from _walk(v, path + (i,))


def _json_mutation(rng: random.Random, obj):
    obj = json.loads(json.dumps(obj))
    paths = [p for p, _ in _walk(obj) if p]
    if not paths:
        return rng.choice(WRONG)
    p = rng.choice(paths)
    parent = obj
    for k in p[:-1]:
        parent = parent[k]
    op = rng.random()
    if op < 0.3:
        del parent[p[-1]]
    elif op < 0.85:
        parent[p[-1]] = rng.choice(WRONG)
    else:  # off by a little: plausible but wrong numbers
        v = parent[p[-1]]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            parent[p[-1]] = v + rng.choice([-4096, -1, 1, 64, 4096])
        else:
            parent[p[-1]] = rng.choice(WRONG)
    return obj


def _byte_mutation(rng: random.Random, data: bytes, span: int | None = None) -> bytes:
    b = bytearray(data)
    span = min(span or len(b), len(b))
    op = rng.random()
    if op < 0.25 or span == 0:
        return bytes(b[:rng.randrange(0, max(1, len(b)))])  # truncation
    if op < 0.6:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(span)
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op < 0.75:
        i = rng.randrange(span)
        return bytes(b[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + b[i:])
    if op < 0.85:
        i = rng.randrange(span)
        return bytes(b[:i] + b[i + rng.randint(1, 64):])
    digits = [i for i in range(span) if 48 <= b[i] <= 57]
    if not digits:
        return bytes(b[:span // 2])
    i = rng.choice(digits)
    return bytes(b[:i] + b"99999999999999999999999" + b[i + 1:])


def _safetensors_mutation(rng: random.Random, data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    if rng.random() < 0.4:  # a JSON-level edit of the header, length fixed up (or not)
        header = json.loads(data[8:8 + n])
        new = json.dumps(_json_mutation(rng, header)).encode()
        ln = len(new) if rng.random() < 0.8 else n
        if rng.random() < 0.2:
            ln = rng.choice([0, 1, 2**32, 2**63, 2**64 - 1])
        return ln.to_bytes(8, "little") + new + data[8 + n:]
    if rng.random() < 0.8:  # bytes of the length prefix and the header
        return _byte_mutation(rng, data, span=8 + n)
    return _byte_mutation(rng, data)  # anywhere (body truncation, flips in the weights)


def _check(folder: Path, fn, failures: list, label: str) -> None:
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        fn()
    except Hang:
        failures.append(f"{label}: hang > {HANG_S} s")
    except EngineError as e:
        if str(folder) not in str(e):
            failures.append(f"{label}: {type(e).__name__} does not name the file: {e}")
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - anything else is a finding (pyo3 panics included)
        failures.append(f"{label}: {type(e).__name__}: {e}"[:400])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _read_checkpoint(folder: Path):
    def go():
        with Checkpoint(folder) as ck:
            for name in list(ck._where)[:40]:
                ck.get(name)
    return go


def _read_store(folder: Path):
    def go():
        with ExpertStore(folder, o_direct=False) as st:
            st.load_dense()
            buf = st.new_buffer()
            a = st.args
            for layer, e in ((0, 0), (a.num_hidden_layers - 1, a.num_experts - 1)):
                st.read(layer, e, buf, verify=True)
    return go


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    from engine.bench.synthetic import olmoe_config, write_checkpoint
    d = tmp_path_factory.mktemp("fuzzck") / "sharded"
    return write_checkpoint(d, olmoe_config(num_key_value_heads=2), seed=9, shard_bytes=60_000, tokenizer=False)


def _run(kind: str, src: Path, rel: str, mutate, reader, tmp_path: Path, seed: int) -> int:
    work = tmp_path / kind
    shutil.copytree(src, work)
    target = work / rel
    original = target.read_bytes()
    rng = random.Random(seed)
    failures: list[str] = []
    handler = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(CASES[kind]):
            target.write_bytes(mutate(rng, original))
            _check(work, reader(work), failures, f"{kind} case {i}")
    finally:
        signal.signal(signal.SIGALRM, handler)
        target.write_bytes(original)
    assert not failures, f"{len(failures)} of {CASES[kind]} {kind} mutations escaped:\n" + "\n".join(failures[:15])
    return CASES[kind]


def _json_file_mutation(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.55:
        return json.dumps(_json_mutation(rng, json.loads(data))).encode()
    return _byte_mutation(rng, data)


def test_fuzz_checkpoint_safetensors(tiny_checkpoint, tmp_path):
    _run("safetensors", tiny_checkpoint, "model.safetensors", _safetensors_mutation, _read_checkpoint, tmp_path, 1)


def test_fuzz_checkpoint_index(sharded_checkpoint, tmp_path):
    assert (sharded_checkpoint / "model.safetensors.index.json").exists()
    _run("index", sharded_checkpoint, "model.safetensors.index.json", _json_file_mutation, _read_checkpoint,
         tmp_path, 2)


def test_fuzz_config(tiny_checkpoint, tmp_path):
    _run("config", tiny_checkpoint, "config.json", _json_file_mutation, _read_checkpoint, tmp_path, 3)


def test_fuzz_store_manifest(tiny_store, tmp_path):
    _run("manifest", tiny_store, "manifest.json", _json_file_mutation, _read_store, tmp_path, 4)


def test_fuzz_store_dense(tiny_store, tmp_path):
    _run("dense", tiny_store, "dense.safetensors", _safetensors_mutation, _read_store, tmp_path, 5)

