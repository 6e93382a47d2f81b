#!/usr/bin/env python3
"""Engine-side numbers for the default model's card, all computed by colibri's engine:

- held-out NLL (teacher forced over heldout_sample.jsonl) of the int8 store, in
  nats/token, and in nats/character over a text set (``--texts``; by default the model's own
  held-out sample), which compares models with different tokenizers on the same text;
- expert-usage entropy per layer and PILOT=1 recall per layer on held-out text;
- answer quality on the 50 held-out questions (heldout_questions.json, written by
  tools/train_default_model.py; about modules the model never saw): ROUGE-L F1 of the answer
  against the docstring summary, and the share of answers naming the right function or module,
  greedy (temperature 0) and sampled (temperature 0.7, seed = question number), int8 store
  (the app's default), max 96 new tokens. With the app's documentation lookup (the model ships
  docs_index.jsonl: the entries matching each question are given with it, engine.docs_lookup)
  and, greedy, without it (``score_t0.0_nodocs``: the model alone).

Writes MODEL/engine_eval.json (or ``--out``) and prints a summary.
Reproduce:  python tools/model_card_samples.py [MODEL_DIR] [--questions Q.json] [--texts S.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import (ChatMessage, Engine, EngineConfig, Finished, GenerateRequest,  # noqa: E402
                    SamplingParams, convert_checkpoint)
from engine.library import default_model_dir  # noqa: E402
from engine.bench.evaluate import teacher_forced_nll, usage_entropy  # noqa: E402

TEMPERATURES = (0.0, 0.7)
MAX_NEW = 96
# Every expert resident and a fixed budget: the numbers do not depend on placement, and the
# run does not slow down when the machine is busy (auto sizing follows the RAM free right now;
# several kernel threads wait for each other when other programs hold the cores).
PLACEMENT = dict(ram_budget_gb=4.0, pinning=False, history=False, threads=1)


def heldout(model_dir: Path) -> list[list[int]]:
    return [json.loads(x)["ids"] for x in (model_dir / "heldout_sample.jsonl").read_text().splitlines() if x.strip()]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1) over lower-cased word tokens (``\\w+``): the longest common
    subsequence of the two token lists, precision LCS/len(candidate), recall LCS/len(reference)
    (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries", section 3.1).
    0.0 when either side has no words."""
    c, r = words(candidate), words(reference)
    if not c or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for a in c:
        cur = [0] * (len(r) + 1)
        for j, b in enumerate(r, 1):
            cur[j] = prev[j - 1] + 1 if a == b else max(prev[j], cur[j - 1])
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def names_right(answer: str, names: list[str]) -> bool:
    """The answer mentions the object's own name (last dotted part) or its top-level module,
    as a whole identifier (``tan`` counts in ``cmath.tan(z)``, not in ``tangent``)."""
    ids = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", answer))
    return any(n in ids for n in names)


def nll_per_char(store: Path, model_dir: Path, texts: list[str]) -> dict:
    """Teacher-forced NLL of ``texts`` encoded with this model's own tokenizer, summed, over
    tokens and over characters (the first token of each text is not predicted; its characters
    are not counted)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = EngineConfig(store=str(store), pilot=0, **PLACEMENT)
    tot = n_tok = n_chr = 0
    with Engine.open(cfg) as eng:
        for t in texts:
            enc = tok.encode(t)
            ids = enc.ids[: eng.context_length]
            if len(ids) < 2:
                continue
            a, b = teacher_forced_nll(eng.model, ids)
            tot, n_tok = tot + a, n_tok + b
            end = enc.offsets[len(ids) - 1][1]
            n_chr += end - enc.offsets[0][1]
    return {"nats_per_token": tot / n_tok, "nats_per_char": tot / n_chr, "tokens": n_tok, "chars": n_chr,
            "texts": len(texts)}


def store_eval(store: Path, seqs) -> dict:
    cfg = EngineConfig(store=str(store), pilot=1, **PLACEMENT)
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
        for s in seqs[:8]:  # each forward starts a new PILOT token (on_forward_start)
            eng.model.forward(np.asarray(s[:1]), 0)
            for i, t in enumerate(s[1:96], start=1):
                eng.model.forward(np.asarray([t]), i)
        ent = usage_entropy(eng.heat.session)
        out["usage_entropy"] = ent.tolist()
        out["log_num_experts"] = float(np.log(eng.args.num_experts))
        out["pilot1_recall"] = pilot.recall()
    return out


def answer_all(store: Path, questions: list[dict], temperature: float, docs_lookup: bool = True,
               docs_copy: float | None = None) -> list[dict]:
    """One answer per question; at temperature > 0 question i (from 1) is sampled with seed i.
    docs_lookup: the app's documentation lookup (on by default; no effect without an index);
    docs_copy: the copy prior's weight (None: the app's default)."""
    cfg = EngineConfig(store=str(store), **PLACEMENT)
    res = []
    with Engine.open(cfg) as eng:
        for i, q in enumerate(questions, start=1):
            msgs = (ChatMessage("user", q["question"]),)
            sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=i, docs_lookup=docs_lookup)
            if docs_copy is not None:
                sp = replace(sp, docs_copy=docs_copy)
            fin = [e for e in eng.generate(GenerateRequest(messages=msgs, sampling=sp))
                   if isinstance(e, Finished)][0]
            res.append({"kind": q["kind"], "about": q["about"], "question": q["question"],
                        "answer": fin.text, "finish": str(getattr(fin.finish_reason, "value", fin.finish_reason)),
                        "rouge_l": rouge_l(fin.text, q["reference"]),
                        "names_right": names_right(fin.text, q["names"]), "seed": i if temperature > 0 else None,
                        "looked_up": list(fin.sources)})
            if i % 10 == 0:
                print(f"  temperature {temperature}: {i}/{len(questions)} answered", file=sys.stderr, flush=True)
    return res


def score(answers: list[dict]) -> dict:
    def agg(rows):
        return {"n": len(rows), "rouge_l": float(np.mean([r["rouge_l"] for r in rows])) if rows else 0.0,
                "names_right": float(np.mean([r["names_right"] for r in rows])) if rows else 0.0,
                "stopped": float(np.mean([r["finish"] == "stop" for r in rows])) if rows else 0.0,
                # the documentation lookup gave the asked object among its entries (0 without lookup)
                "looked_up_right": float(np.mean([r["about"] in r.get("looked_up", []) for r in rows])) if rows else 0.0}
    out = {"all": agg(answers)}
    for k in sorted({r["kind"] for r in answers}):
        out[k] = agg([r for r in answers if r["kind"] == k])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, default=None, help="model folder (default: the bundled one)")
    ap.add_argument("--questions", type=Path, default=None,
                    help="held-out questions JSON (default: MODEL/heldout_questions.json)")
    ap.add_argument("--texts", type=Path, default=None,
                    help="a heldout_sample.jsonl whose texts give the nats/character (default: MODEL's)")
    ap.add_argument("--out", type=Path, default=None, help="default: MODEL/engine_eval.json")
    ap.add_argument("--no-answers", action="store_true", help="only the losses")
    args = ap.parse_args(argv)
    src = args.model or default_model_dir()
    qpath = args.questions or src / "heldout_questions.json"
    texts_path = args.texts or src / "heldout_sample.jsonl"
    texts = [json.loads(x)["text"] for x in texts_path.read_text().splitlines() if x.strip()]
    seqs = heldout(src)
    ev = {"model": src.name, "texts": str(texts_path.name), "max_new_tokens": MAX_NEW}
    with tempfile.TemporaryDirectory() as tmp:
        # int8 only (the app's default store; int8 and f32 agree within 1 %, tests/test_default_model.py)
        st = convert_checkpoint(src, Path(tmp) / "int8", quant="int8")
        print("converted; teacher-forced NLL and routing", file=sys.stderr, flush=True)
        ev["int8"] = store_eval(st, seqs)
        ev["heldout_text"] = nll_per_char(st, src, texts)
        print("losses done", file=sys.stderr, flush=True)
        if not args.no_answers:
            questions = json.loads(qpath.read_text())
            ev["questions"] = str(qpath.name)
            ev["docs_lookup"] = (st / "docs_index.jsonl").exists()
            for t in TEMPERATURES:
                ans = answer_all(Path(tmp) / "int8", questions, t)
                ev[f"answers_t{t}"] = ans
                ev[f"score_t{t}"] = score(ans)
            if ev["docs_lookup"]:  # the model alone, and the lookup without the copy prior
                ev["docs_copy"] = SamplingParams().docs_copy
                ans = answer_all(Path(tmp) / "int8", questions, 0.0, docs_lookup=False)
                ev["answers_t0.0_nodocs"] = ans
                ev["score_t0.0_nodocs"] = score(ans)
                ans = answer_all(Path(tmp) / "int8", questions, 0.0, docs_copy=0.0)
                ev["answers_t0.0_nocopy"] = ans
                ev["score_t0.0_nocopy"] = score(ans)
    log_path = src / "training_log.json"
    if log_path.exists():
        log = json.loads(log_path.read_text())
        ev["transformers_heldout_loss"] = log.get("heldout_loss_reloaded", log.get("heldout_loss"))
    out = args.out or src / "engine_eval.json"
    out.write_text(json.dumps(ev, indent=1, ensure_ascii=False) + "\n")
    print(f"held-out NLL (nats/token, own sample): colibri int8 {ev['int8']['nll']:.4f}")
    h = ev["heldout_text"]
    print(f"held-out text {texts_path}: {h['nats_per_char']:.4f} nats/char, {h['nats_per_token']:.4f} nats/token")
    print("usage entropy / log(E):", [round(e / ev["int8"]["log_num_experts"], 3) for e in ev["int8"]["usage_entropy"]])
    print("PILOT=1 recall per layer:", [round(r, 3) for r in ev["int8"]["pilot1_recall"]])
    for key in [f"score_t{t}" for t in TEMPERATURES] + ["score_t0.0_nodocs", "score_t0.0_nocopy"]:
        if key in ev:
            print(f"{key}: {json.dumps(ev[key])}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
