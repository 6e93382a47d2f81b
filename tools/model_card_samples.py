#!/usr/bin/env python3
"""Engine-side numbers for the default model's card, all computed by colibri's engine:

- held-out NLL (teacher forced over heldout_sample.jsonl) of the f32 and int8 stores;
- expert-usage entropy per layer and PILOT=1 recall per layer on held-out text;
- greedy answers to the five questions in questions.json (int8 store, the app's default).

Writes resources/models/colibri-stdlib-moe/engine_eval.json and prints markdown for the card.
Reproduce:  python tools/model_card_samples.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import (ChatMessage, Engine, EngineConfig, Finished, GenerateRequest,  # noqa: E402
                    SamplingParams, convert_checkpoint, default_model_dir)
from engine.evaluate import teacher_forced_nll, usage_entropy  # noqa: E402


def heldout(model_dir: Path) -> list[list[int]]:
    return [json.loads(x)["ids"] for x in (model_dir / "heldout_sample.jsonl").read_text().splitlines() if x.strip()]


def store_eval(store: Path, seqs) -> dict:
    cfg = EngineConfig(store=str(store), pilot=1, pinning=False, history=False, cap=None)
    with Engine.open(cfg) as eng:
        tot = n = 0
        for s in seqs:
            a, b = teacher_forced_nll(eng.model, s)
            tot, n = tot + a, n + b
        out = {"nll": tot / n, "tokens": n}
        # routing statistics: decode the held-out text token by token (PILOT hooks run in decode)
        eng.heat.reset()
        pilot = eng.pilot
        pilot.recall_hits[:] = 0
        pilot.recall_total[:] = 0
        for s in seqs[:16]:  # each forward starts a new PILOT token (on_forward_start)
            eng.model.forward(np.asarray(s[:1]), 0)
            for i, t in enumerate(s[1:128], start=1):
                eng.model.forward(np.asarray([t]), i)
        ent = usage_entropy(eng.heat.session)
        out["usage_entropy"] = ent.tolist()
        out["log_num_experts"] = float(np.log(eng.args.num_experts))
        out["pilot1_recall"] = pilot.recall()
    return out


def answers(store: Path, questions) -> list[dict]:
    cfg = EngineConfig(store=str(store), history=False)
    res = []
    with Engine.open(cfg) as eng:
        for q in questions:
            msgs = tuple(ChatMessage(m["role"], m["content"]) for m in q["messages"])
            fin = [e for e in eng.generate(GenerateRequest(messages=msgs, sampling=SamplingParams(max_new_tokens=96)))
                   if isinstance(e, Finished)][0]
            res.append({"question": msgs[-1].content, "answer": fin.text, "finish": fin.finish_reason,
                        "ids": list(fin.token_ids)})
    return res


def main() -> int:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir()
    seqs = heldout(src)
    questions = json.loads((src / "questions.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        ev = {}
        for q in ("f32", "int8"):
            st = convert_checkpoint(src, Path(tmp) / q, quant=q)
            ev[q] = store_eval(st, seqs)
        ev["answers_int8"] = answers(Path(tmp) / "int8", questions)
    log = json.loads((src / "training_log.json").read_text())
    ev["transformers_heldout_loss"] = log.get("heldout_loss_reloaded", log.get("heldout_loss"))
    (src / "engine_eval.json").write_text(json.dumps(ev, indent=1) + "\n")
    print(f"held-out NLL (nats/token): transformers {ev['transformers_heldout_loss']:.4f}, "
          f"colibri f32 {ev['f32']['nll']:.4f}, colibri int8 {ev['int8']['nll']:.4f}")
    print("usage entropy / log(E):", [round(e / ev["int8"]["log_num_experts"], 3) for e in ev["int8"]["usage_entropy"]])
    print("PILOT=1 recall per layer:", [round(r, 3) for r in ev["int8"]["pilot1_recall"]])
    for a in ev["answers_int8"]:
        print(f"\n**Q: {a['question']}**\n\n{a['answer']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
