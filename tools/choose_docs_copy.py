#!/usr/bin/env python3
"""Choose the default of ``docs_copy`` (engine.docs_lookup.CopyPrior's weight) for the bundled
model on questions about its TRAINING modules, never the held-out ones the model card scores.

20 "What does `X` do?" and 20 "How do I <task>?" questions (task from X's docstring, seed 99)
about training-module objects, answered greedily as the app does (documentation lookup on) at
each weight; prints ROUGE-L and names right per kind (the metrics of tools/model_card_samples.py).
The default is the weight with the best mean ROUGE-L of the two kinds.

    python tools/choose_docs_copy.py [MODEL_DIR] [--cache-dir DIR] [--weights 0,0.3,0.5,0.7,0.9]

No torch; the standard-library extraction is the trainer's (``--cache-dir`` reuses
it). Tool-time only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import train_default_model as T  # noqa: E402
from model_card_samples import names_right, rouge_l  # noqa: E402

from engine import (ChatMessage, Engine, EngineConfig, Finished, GenerateRequest,  # noqa: E402
                    SamplingParams, convert_checkpoint)
from engine.library import default_model_dir  # noqa: E402


def training_questions(model: Path, cache_dir: Path | None, n: int = 20, seed: int = 99) -> list[dict]:
    """n what + n how-to questions about objects of the model's training modules."""
    log = json.loads((model / "training_log.json").read_text())
    held = set(log["corpus"]["heldout_top_level_modules"])
    with tempfile.TemporaryDirectory() as tmp:
        data = T.extract_stdlib(Path(tmp), cache_dir)
    train, _ = T.build_items(data, held)
    pool = [s for s in train if s["summary"] and len(s["summary"]) <= 300 and s["kind"] != "module"]
    rng = random.Random(seed)
    qs: list[dict] = []
    for s in rng.sample(pool, min(len(pool), 20 * n)):
        names = [s["name"].rsplit(".", 1)[-1], s["name"].split(".")[0]]
        if sum(q["kind"] == "what" for q in qs) < n:
            qs.append({"kind": "what", "question": f"What does `{s['name']}` do?", "reference": s["summary"],
                       "names": names})
        elif sum(q["kind"] == "howto" for q in qs) < n and (t := T.howto_question(s)):
            qs.append({"kind": "howto", "question": f"How do I {t}?", "reference": s["summary"], "names": names})
    return qs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, default=None, help="model folder (default: the bundled one)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="the trainer's extraction cache, if any")
    ap.add_argument("--weights", default="0,0.3,0.5,0.7,0.9", help="docs_copy values to try")
    a = ap.parse_args(argv)
    src = a.model or default_model_dir()
    weights = [float(w) for w in a.weights.split(",")]
    qs = training_questions(src, a.cache_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        st = convert_checkpoint(src, Path(tmp) / "int8", quant="int8")
        with Engine.open(EngineConfig(store=str(st), history=False, threads=1, ram_budget_gb=4.0)) as eng:
            if eng.docs is None:
                raise SystemExit(f"{src}: no docs_index.jsonl: the copy prior has nothing to copy")
            for w in weights:
                res = {}
                for kind in ("what", "howto"):
                    sub = [q for q in qs if q["kind"] == kind]
                    named = rouge = 0.0
                    for q in sub:
                        sp = SamplingParams(temperature=0.0, max_new_tokens=64, docs_copy=w)
                        fin = [e for e in eng.generate(GenerateRequest(messages=(ChatMessage("user", q["question"]),),
                                                                       sampling=sp)) if isinstance(e, Finished)][0]
                        named += names_right(fin.text, q["names"])
                        rouge += rouge_l(fin.text, q["reference"]) / len(sub)
                    res[kind] = (int(named), len(sub), rouge)
                rows.append((w, res))
                print(f"docs_copy {w}: what {res['what'][0]}/{res['what'][1]} named, ROUGE-L {res['what'][2]:.3f}; "
                      f"how-to {res['howto'][0]}/{res['howto'][1]} named, ROUGE-L {res['howto'][2]:.3f}", flush=True)
    best = max(rows, key=lambda r: (r[1]["what"][2] + r[1]["howto"][2]) / 2)
    print(f"best mean ROUGE-L: docs_copy {best[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
