"""A digest of greedy ids and logits per model family, to compare the decoder before and after a
change that must not move a bit.

For every family of engine.bench.synthetic.CONFIGS (the default tiny shape of each), a random
checkpoint (seed 11) is converted to int4 and int8 stores; each store is opened twice (every
expert cached: the one-call decode step where the family has it; a cap of 2 experts per layer
with PILOT: streaming), and runs a 20-token prefill (logits of every position), 6 greedy decode
steps (T = 1) and a 12-token second prefill, then 12 greedy tokens of a repeating prompt through
Engine.generate with speculation off and prompt lookup. Prints one line per family: sha256 of the ids and logits bytes.

Usage: python tools/decoder_digest.py [OUT.txt] [--only FAMILY,...] (the engine of this checkout)
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, not an installed one

from engine import convert_checkpoint  # noqa: E402
from engine.bench.synthetic import CONFIGS, write_checkpoint  # noqa: E402
from engine.config import EngineConfig, ModelArgs  # noqa: E402
from engine.events import Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine.generate import Engine  # noqa: E402


def _run(store: Path, **kw) -> list[bytes]:
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, **kw)
    out = []
    with Engine.open(cfg) as eng:
        m = eng.model
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
    for spec in ("off", "prompt_lookup"):
        with Engine.open(EngineConfig(store=str(store), history=False, o_direct=False, speculation=spec, **kw)) as eng:
            req = GenerateRequest(prompt_ids=tuple(range(5, 15)) * 2,
                                  sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
            fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
            out.append(repr((fin.error, tuple(fin.token_ids))).encode())
    return out


def main(argv: list[str]) -> None:
    only = None
    if "--only" in argv:
        i = argv.index("--only")
        only = set(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2:]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CONFIGS.items():
            if only and name not in only:
                continue
            d = Path(tmp) / name
            ck = write_checkpoint(d / "ck", make(), seed=11, std=0.1)
            h = hashlib.sha256()
            for quant in ("int4", "int8"):
                store = convert_checkpoint(ck, d / quant, quant=quant)
                E = ModelArgs.from_hf_config(store).num_experts
                for kw in (dict(cap=E, pilot=0), dict(cap=2, policy="lfru", pilot=1)):
                    for b in _run(store, **kw):
                        h.update(b)
            line = f"{name:20s} {h.hexdigest()}"
            print(line, flush=True)
            lines.append(line)
    if argv:
        Path(argv[0]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
