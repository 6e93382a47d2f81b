"""A digest of greedy ids and logits per model family, to compare the decoder before and after a
change that must not move a bit.

For every family of the synthetic configs (the default tiny shape of each), a random checkpoint
(seed 11) is converted to each store quantization (int4, int8, f32 by default); each store is
opened twice (every expert cached: the one-call decode step where the family has it, waited
for; a cap of 2 experts per layer with PILOT: streaming), and runs a 20-token prefill (logits of
every position), 6 greedy decode steps (T = 1) and a 12-token second prefill, then 12 greedy
tokens of a repeating prompt through Engine.generate with each mode of --speculation (default
off and prompt_lookup; an engine without the setting runs "off" as its plain decoding). Prints
one line per family: the sha256 of the checkpoint's bytes (the same input in both checkouts), a
short digest per quantization and placement, the sha256 of them all, and how many decode steps
ran in the one-call step (not hashed: the per-layer path gives the same bits).

Usage: python tools/decoder_digest.py [OUT.txt] [--only FAMILY,...] [--quants int4,int8,f32]
       [--speculation off,prompt_lookup]
       [--engine CHECKOUT]   (the engine of CHECKOUT, default this one; an older checkout keeps
                              the synthetic configs in engine/synthetic.py, a newer one in
                              engine/bench/synthetic.py)
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np


def _option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    i = argv.index(name)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


_ARGV = sys.argv[1:]
_ENGINE = Path(_option(_ARGV, "--engine") or Path(__file__).resolve().parents[1]).resolve()
sys.path.insert(0, str(_ENGINE))  # that checkout's engine, not the venv's installed one

from engine import convert_checkpoint  # noqa: E402
from engine.config import EngineConfig, ModelArgs  # noqa: E402
from engine.events import Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine.generate import Engine  # noqa: E402

try:
    from engine.bench.synthetic import CONFIGS, write_checkpoint  # noqa: E402
except ImportError:
    from engine.synthetic import CONFIGS, write_checkpoint  # noqa: E402

PLACEMENTS = {"all": lambda E: dict(cap=E, pilot=0), "cap2": lambda E: dict(cap=2, policy="lfru", pilot=1)}


def _wait_decode_step(model) -> None:
    """The one-call decode step compiles beside the first answer: wait for it, so that the
    decode steps of a family that has it run in it, not in the per-layer path meanwhile."""
    wait = getattr(model, "wait_decode_ready", None)
    if wait is not None:
        wait(1800)


def _run(store: Path, speculation: list[str], steps: list[int], **kw) -> list[bytes]:
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, **kw)
    out = []
    with Engine.open(cfg) as eng:
        m = eng.model
        _wait_decode_step(m)
        lg = m.forward(np.arange(5, 25), 0, all_logits=True)
        out.append(lg.tobytes())
        ids = []
        for s in range(6):
            t = int(np.argmax(lg[-1]))
            ids.append(t)
            lg = m.forward(np.array([t]), 20 + s)
            out.append(lg.tobytes())
        out.append(m.forward(np.arange(40, 52), 26, all_logits=True).tobytes())
        out.append(np.array(ids, np.int64).tobytes())
        steps.append(getattr(m, "one_call_steps", 0))
    for spec in speculation:
        if "speculation" in EngineConfig.__dataclass_fields__:
            kw["speculation"] = spec
        elif spec != "off":
            raise SystemExit(f"--speculation {spec}: this engine has no speculative decoding")
        with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, **kw)) as eng:
            _wait_decode_step(eng.model)
            req = GenerateRequest(prompt_ids=tuple(range(5, 15)) * 2,
                                  sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
            fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
            out.append(repr((fin.error, tuple(fin.token_ids))).encode())
            steps.append(getattr(eng.model, "one_call_steps", 0))
    return out


def _checkpoint_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(folder).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def main(argv: list[str]) -> None:
    only = _option(argv, "--only")
    only = set(only.split(",")) if only else None
    quants = (_option(argv, "--quants") or "int4,int8,f32").split(",")
    speculation = (_option(argv, "--speculation") or "off,prompt_lookup").split(",")
    lines = [f"# engine: {_ENGINE}; speculation: {','.join(speculation)}", "# family            checkpoint    "
             + " ".join(f"{q}/{p:4s}      " for q in quants for p in PLACEMENTS) + " all               one-call steps"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CONFIGS.items():
            if only and name not in only:
                continue
            d = Path(tmp) / name
            ck = write_checkpoint(d / "ck", make(), seed=11, std=0.1)
            total = hashlib.sha256()
            cells, steps = [], []
            for quant in quants:
                store = convert_checkpoint(ck, d / quant, quant=quant)
                E = ModelArgs.from_hf_config(store).num_experts
                for place in PLACEMENTS.values():
                    h = hashlib.sha256()
                    for b in _run(store, speculation, steps, **place(E)):
                        h.update(b)
                    cells.append(h.hexdigest()[:12])
                    total.update(h.digest())
            line = (f"{name:20s} {_checkpoint_digest(ck)[:12]}  {' '.join(cells)}  {total.hexdigest()[:16]}"
                    f"  {sum(steps):5d}")
            print(line, flush=True)
            lines.append(line)
    if argv:
        Path(argv[0]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(_ARGV)
