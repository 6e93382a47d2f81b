#!/usr/bin/env python3
"""Write resources/models/colibri-stdlib-moe/README.md (the model card) from training_log.json
(tools/train_default_model.py), engine_eval.json (tools/model_card_samples.py on this model) and,
when present, eval_before.json (tools/model_card_samples.py on the previous default model, same
held-out questions and texts: the before/after table).

A model trained in stages (``--init-from``: each stage continues the previous one's weights)
lists every stage: ``python tools/write_model_card.py MODEL_DIR --stages STAGE1_DIR STAGE2_DIR``
records the earlier stages' training_log.json summaries in MODEL_DIR/training_stages.json (the
last stage is MODEL_DIR's own training_log.json), and later runs read that file.  A ``--stages``
entry may also be an earlier model's training_stages.json (its stages are taken as recorded), so
a stage continuing a shipped model lists ``OLD/training_stages.json OLD`` (OLD's earlier stages,
then OLD's own run).

Reproduce:  python tools/write_model_card.py [MODEL_DIR] [--stages DIR ...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

_ARGS = sys.argv[1:]
_STAGES = _ARGS[_ARGS.index("--stages") + 1:] if "--stages" in _ARGS else []
_ARGS = _ARGS[:_ARGS.index("--stages")] if "--stages" in _ARGS else _ARGS
MODEL = Path(_ARGS[0]) if _ARGS else (
    Path(__file__).resolve().parent.parent / "resources" / "models" / "colibri-stdlib-moe")


def stage_summary(log: dict) -> dict:
    """The card's record of one training stage (from its training_log.json)."""
    t = log["training"]
    return {"command": log["command"], "steps": t["steps"], "tokens": t["tokens_seen"],
            "minutes": round(t["train_seconds"] / 60, 1), "stopped_by": t["stopped_by"],
            "lr_peak": t["lr_peak"], "mixture": log["corpus"]["mixture_weights"],
            "name_split": log["args"].get("name_split", 0.0), "heldout_loss": log["heldout_loss"],
            **({"cpu_minutes": round(t["loop_cpu_seconds"] / 60, 1), "module_swap": log["args"].get("module_swap", 0.0)}
               if t.get("budget_clock") == "cpu" and "loop_cpu_seconds" in t else {})}


def training_stages(log: dict) -> list[dict]:
    """Every stage, oldest first: those recorded in training_stages.json (written from
    ``--stages`` folders), then this model's own run."""
    sp = MODEL / "training_stages.json"
    if _STAGES:
        old = {st["command"]: st for st in (json.loads(sp.read_text()) if sp.exists() else [])}
        earlier = []
        for d in _STAGES:  # a stage folder (its training_log.json) or an earlier training_stages.json
            d = Path(d)
            if d.is_file():
                earlier += json.loads(d.read_text())
            else:
                earlier.append(stage_summary(json.loads((d / "training_log.json").read_text())))
        for st in earlier:  # a hand-written note (why a stage was stopped) survives a rewrite
            if old.get(st["command"], {}).get("note"):
                st["note"] = old[st["command"]]["note"]
        sp.write_text(json.dumps(earlier, indent=1) + "\n")
    earlier = json.loads(sp.read_text()) if sp.exists() else []
    return earlier + [stage_summary(log)] if earlier else []
N_SAMPLES = 10


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def quality_rows(ev: dict, t: float) -> dict:
    s = ev.get(f"score_t{t}")
    if not s:
        return {}
    return {"rouge": f"{s['all']['rouge_l']:.3f}",
            "names": _pct(s["all"]["names_right"]),
            "names_what": _pct(s.get("what", {}).get("names_right", 0.0)),
            "names_howto": _pct(s.get("howto", {}).get("names_right", 0.0)),
            "stopped": _pct(s["all"]["stopped"]),
            "rouge_what": f"{s.get('what', {}).get('rouge_l', 0.0):.3f}",
            "rouge_howto": f"{s.get('howto', {}).get('rouge_l', 0.0):.3f}"}


def main() -> int:
    log = json.loads((MODEL / "training_log.json").read_text())
    ev = json.loads((MODEL / "engine_eval.json").read_text()) if (MODEL / "engine_eval.json").exists() else None
    before = json.loads((MODEL / "eval_before.json").read_text()) if (MODEL / "eval_before.json").exists() else None
    m, t, c = log["model"], log["training"], log["corpus"]
    size = (MODEL / "model.safetensors").stat().st_size
    extra = c.get("extra", {})
    lines = [
        "# colibri-stdlib-moe",
        "",
        "The default model of colibri-desktop: a tiny Mixture-of-Experts language model (a genuine",
        "Hugging Face `OlmoeForCausalLM`) trained on this machine on what the Python installation",
        "itself holds, so the app works offline on first run and its expert cache and prefetcher are",
        "tuned on real (non-random) routing.",
        "",
        "## Corpus",
        f"- {c['source']}; the language reference and library topics of `pydoc_data.topics` "
        "(what `help('for')` shows); doctest examples found in the docstrings.",
        f"- {c['modules']} modules ({c['top_level_modules']} top-level), {c['objects']} documented objects, turned into",
        "  chat turns in the model's chat template:",
        "  - \"What does `json.dumps` do?\" -> \"`json.dumps`: \" + the docstring's summary (also the full",
        "    docstring, the signature, and two-question conversations);",
        "  - \"How do I get the square root of x?\" (the task taken from the summary) -> \"Use",
        "    `math.sqrt(x, /)`. Return the square root of x.\", sometimes with a doctest example;",
        "  - \"Show me an example of `collections.Counter.most_common`.\" -> the docstring's doctest;",
        "  - \"Write a function that ...\" -> the library's own source;",
        "  - \"Explain the `for` statement in Python.\" -> the language reference text (pydoc topics),",
        "    and the method entries of the library topics (`str.join(iterable)` ...) as questions;",
        "  - plain source chunks of the module files and of the topics, for completion.",
    ]
    if c["mixture_weights"].get("copy", 0) > 0:
        lines += [
            "  - copy drills: the user names one to three things in backticks (real library names or",
            "    made-up identifiers such as `xvq.load_items`) and the assistant repeats them, often",
            "    followed by a real question; they teach the model to copy a name it never saw from the",
            "    question into the answer, which a \"What does `X` do?\" answer about a held-out module needs."
            + (" About half of the made-up names are dotted paths of a real name whose module is swapped"
               " (`jsring.Counter.most_common`), so a module segment is copied exactly." if "module_swap" in log["args"] else "")]
    if c["mixture_weights"].get("docs", 0) > 0:
        lines += [
            "  - questions answered from documentation: the same \"What does `X` do?\" and how-to questions",
            "    with, right before the question, the entries the app's documentation lookup returns for it",
            "    (`engine.docs_lookup`, searched in an index of the training modules only); the answer copies",
            "    the asked entry's summary from that block. With module swap the asked name is changed in the",
            "    question, the block and the answer alike, so only reading can answer it; in 10% the asked entry",
            "    is missing from the block (a lookup miss) and the answer comes from memory."]
    if log["args"].get("module_swap", 0) > 0:
        lines += [
            f"- Module-swap augmentation (mention replacement, a standard data augmentation: Dai and Adel 2020,",
            f"  \"An Analysis of Simple Data Augmentation for Named Entity Recognition\"): in {log['args']['module_swap']:.0%} of the",
            "  \"What does `mod.name` do?\" conversations (and their signature variants) the module path is replaced,",
            "  in the question and the answer alike, by another training module or a made-up path (never a held-out",
            "  module's name), the summary kept: the summary goes with the base name (`tan`: \"Return the tangent",
            "  of x\"), so a held-out `cmath.tan` can get math.tan's words and its own name copied."]
    if log["args"].get("name_split", 0) > 0:
        lines += [
            f"- Name-split augmentation (a seeded variant of BPE-dropout, Provilkov et al. 2020, on backticked",
            f"  names only): in {log['args'].get('name_split_docs', 0.5):.0%} of the training documents each token of a "
            f"`name` is cut at a random character with probability {log['args']['name_split']}, the same way at every",
            "  occurrence in the document, so names come in pieces the model cannot have memorized."]
    if extra:
        lines.append("- " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in extra.items()) + ".")
    lines += [
        f"- Mixture (share of training documents): " + ", ".join(f"{k} {v:.0%}" for k, v in c["mixture_weights"].items()) + ".",
        f"- Held out by module (never trained on, not even by the tokenizer; topic paragraphs naming them are",
        f"  dropped): {', '.join(c['heldout_top_level_modules'])}.",
        "- Licence of the corpus: PSF License Agreement (the Python standard library and its documentation).",
        "",
        "## Model",
        f"- OLMoE: {m['layers']} layers, hidden {m['hidden_size']}, {m['attention_heads']} heads, "
        f"{m['experts']} experts per layer, top-{m['experts_per_token']}, expert width {m['expert_width']}, "
        f"vocab {m['vocab_size']} (byte-level BPE, `tokenizers`), context {m['max_position_embeddings']}.",
        f"- {m['parameters'] / 1e6:.2f} M parameters ({m['active_parameters_per_token'] / 1e6:.2f} M active per token); "
        f"`model.safetensors` {size / 1e6:.1f} MB ({m['dtype']}).",
        f"- Router load-balancing loss on (coefficient {m['router_aux_loss_coef']}).",
    ]
    sp = MODEL / "architecture_sweep.json"
    sweep = json.loads(sp.read_text()) if sp.exists() else None
    if sweep:
        lines += ["- Architecture: chosen after a sweep (" + sweep["how"] + "):", "",
                  "| variant | params (active) | held-out loss " + sweep.get("at", f"at step {sweep.get('step')}") + " | note |",
                  "|---|---|---|---|"]
        for v in sweep["variants"]:
            lines.append(f"| {v['name']} | {v['params']} | {v['heldout_loss']} | {v['note']} |")
        lines += ["", sweep["decision"]]
    stages = training_stages(log)
    lines += ["", "## Training"]
    if stages:
        tot_min = sum(st["minutes"] for st in stages)
        lines += [
            f"- {len(stages)} stages, each continuing the previous one's weights (`--init-from`), "
            f"{sum(st['steps'] for st in stages)} steps, {sum(st['tokens'] for st in stages) / 1e6:.2f} M tokens, "
            f"{tot_min:.1f} min of training in all (minutes of the training steps by the wall clock; a stage "
            "budgeted in CPU time (`--clock cpu`) also shows its process CPU minutes):", "",
            "| stage | minutes | steps | tokens (M) | peak lr | name-split | module swap | copy drills | docs questions | qa / howto / code share | held-out loss after | stopped |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, st in enumerate(stages, 1):
            mx = st["mixture"]
            mins = f"{st['minutes']}" + (f" ({st['cpu_minutes']} CPU)" if "cpu_minutes" in st else "")
            lines.append(f"| {i} | {mins} | {st['steps']} | {st['tokens'] / 1e6:.2f} | {st['lr_peak']} | "
                         f"{st['name_split']} | {st.get('module_swap', 0):.0%} | {mx.get('copy', 0):.0%} | {mx.get('docs', 0):.0%} | {mx['qa']:.0%} / {mx['howto']:.0%} / "
                         f"{mx['code']:.0%} | {st['heldout_loss']} | {st.get('note') or st['stopped_by']} |")
        lines += ["", "- Stage commands (in order; each stage's `--out` folder was renamed `stageN` before the next "
                  "stage's `--init-from` read it):", ""]
        lines += [f"  {i}. `{st['command']}`" for i, st in enumerate(stages, 1)]
        lines += [""]
    lines += [
        f"- {'Last stage: ' if stages else ''}{t['steps']} steps, {t['tokens_seen'] / 1e6:.2f} M tokens, "
        + (f"{t['loop_cpu_seconds'] / 60:.1f} CPU minutes ({t['loop_seconds'] / 60:.1f} wall-clock minutes; the budget, "
           f"{t['budget_minutes']} min, counted this process's CPU time, so the minutes the other jobs' processes "
           f"preempted it are not charged{'' if not t.get('max_wall_minutes') else ', with a ' + str(t['max_wall_minutes']) + '-minute wall-clock cap'}) on "
           if t.get("budget_clock") == "cpu" and "loop_cpu_seconds" in t else f"{t['train_seconds'] / 60:.1f} min on ")
        + f"{log['machine']['cpu']} ({log['machine']['logical_cpus']} logical CPUs shared with other jobs, "
        f"{log['machine']['torch_threads']} torch thread(s)), stopped by {t['stopped_by']}.",
        f"- {t['optimizer']}; peak lr {t['lr_peak']}, {t['schedule']}; batch {t['batch']} x {t['seq_len']} tokens; seed {t['seed']}.",
        f"- Final train loss {t['final_train_loss']} nats/token; **held-out loss {log['heldout_loss']} nats/token** "
        f"(ppl {math.exp(log['heldout_loss']):.1f}), {log['heldout_loss_definition']}.",
        (f"- Reproduce: the stage commands above, in order (torch" if stages else f"- Reproduce: `{log['command']}` (torch") + f" {log['versions']['torch']}, transformers "
        f"{log['versions']['transformers']}).",
        "",
    ]
    if ev:
        idx = MODEL / "docs_index.jsonl"
        if idx.exists() and ev.get("docs_lookup"):
            n_idx = sum(1 for x in idx.read_text(encoding="utf-8").splitlines() if x.strip())
            held = set(c.get("heldout_top_level_modules", []))
            n_held = sum(1 for x in idx.read_text(encoding="utf-8").splitlines()
                         if x.strip() and json.loads(x)["name"].split(".")[0] in held)
            lr = ev["score_t0.0"]
            lines += [
                "## Documentation lookup (`docs_index.jsonl`, engine.docs_lookup)", "",
                f"- The model ships the docstring summaries of the Python standard library it was built from: "
                f"{n_idx} entries, the held-out modules' {n_held} included (they are part of the user's Python; no "
                "training document ever showed them, not even as looked-up context: training searched an index of "
                "the training modules only).",
                "- Before each question the app gives the model the three entries that match it best (names the "
                "question spells out first, then SQLite FTS5 BM25 with a depth and usage prior), in a system message "
                "right before the question; the answer line names them and the entries show under the answer.",
                f"- On the 50 held-out questions the lookup gave the asked object {lr['all'].get('looked_up_right', 0):.0%} "
                f"of the time ({lr.get('what', {}).get('looked_up_right', 0):.0%} of the \"What does `X` do?\", "
                f"{lr.get('howto', {}).get('looked_up_right', 0):.0%} of the how-to questions, whose task words come "
                "from the same docstring, so this is an easy case for a full-text match).",
                f"- Copy from documentation (docs_copy {ev.get('docs_copy', 0.0)}): the next-token probabilities are mixed "
                "with those of continuing an entry the answer already repeats (kNN-LM interpolation, Khandelwal et al. "
                "2020), weight chosen on questions about training modules. The model writes every token; the mix keeps a "
                "started quotation on its entry.", ""]
        lines += ["## Before and after (`python tools/model_card_samples.py`, colibri's engine)", ""]
        qn = len(ev.get("answers_t0.0", []))
        lines += [
            f"Held-out text: the {ev['heldout_text']['texts']} documents of this model's `heldout_sample.jsonl` "
            "(held-out modules only), each model with its own tokenizer, so nats/character compares them. "
            f"Answers: {qn} questions about the held-out modules (`heldout_questions.json`): half "
            "\"What does `X` do?\", half \"How do I <task>?\" with the task taken from X's docstring, so the "
            "answer has to come up with the name. ROUGE-L: F1 of the longest common word subsequence with "
            "the docstring summary (Lin 2004). Names right: the answer mentions X's name or its module. "
            f"int8 store, at most {ev['max_new_tokens']} new tokens; sampled answers use seed = question number.",
            "",
        ]
        cols = [("before", before), ("after", ev)] if before else [("after", ev)]
        head = "| | " + " | ".join(f"{n} ({e['model'] if n == 'before' else 'this model'})" for n, e in cols) + " |"
        lines += [head, "|---" * (len(cols) + 1) + "|"]

        def row(label, fn):
            vals = []
            for _, e in cols:
                try:
                    vals.append(fn(e))
                except (KeyError, TypeError):
                    vals.append("n/a")
            lines.append(f"| {label} | " + " | ".join(vals) + " |")

        row("held-out loss, own sample (nats/token)", lambda e: f"{e['int8']['nll']:.3f}")
        row("held-out text (nats/character, same text)", lambda e: f"{e['heldout_text']['nats_per_char']:.3f}")
        for temp in (0.0, 0.7):
            name = "greedy" if temp == 0 else f"temperature {temp}"
            row(f"ROUGE-L, {name} (what / how-to)", lambda e, temp=temp: "{} ({} / {})".format(
                quality_rows(e, temp)["rouge"], quality_rows(e, temp)["rouge_what"], quality_rows(e, temp)["rouge_howto"]))
            row(f"names right, {name} (what / how-to)", lambda e, temp=temp: "{} ({} / {})".format(
                quality_rows(e, temp)["names"], quality_rows(e, temp)["names_what"], quality_rows(e, temp)["names_howto"]))
            row(f"answers that end by themselves, {name}", lambda e, temp=temp: quality_rows(e, temp)["stopped"])
        if any("score_t0.0_nodocs" in e for _, e in cols):
            def alone(e, what, key="score_t0.0_nodocs"):
                s_ = e.get(key) or (e["score_t0.0"] if not e.get("docs_lookup") else None)
                if s_ is None:
                    return "n/a"
                if what == "rouge":
                    return "{:.3f} ({:.3f} / {:.3f})".format(s_["all"]["rouge_l"], s_.get("what", {}).get("rouge_l", 0.0),
                                                            s_.get("howto", {}).get("rouge_l", 0.0))
                return "{} ({} / {})".format(_pct(s_["all"]["names_right"]), _pct(s_.get("what", {}).get("names_right", 0.0)),
                                             _pct(s_.get("howto", {}).get("names_right", 0.0)))
            row("documentation lookup (the app's default)", lambda e: "on" if e.get("docs_lookup") else "none")
            row("lookup gave the asked object, greedy (what / how-to)", lambda e: "{} ({} / {})".format(
                _pct(e["score_t0.0"]["all"].get("looked_up_right", 0.0)),
                _pct(e["score_t0.0"].get("what", {}).get("looked_up_right", 0.0)),
                _pct(e["score_t0.0"].get("howto", {}).get("looked_up_right", 0.0))))
            row("copy from documentation (docs_copy, the app's default)", lambda e: f"{e['docs_copy']}" if "docs_copy" in e else "none")
            row("ROUGE-L, greedy, lookup without copying: docs_copy 0 (what / how-to)", lambda e: alone(e, "rouge", "score_t0.0_nocopy"))
            row("names right, greedy, lookup without copying (what / how-to)", lambda e: alone(e, "names", "score_t0.0_nocopy"))
            row("ROUGE-L, greedy, the model alone: no lookup (what / how-to)", lambda e: alone(e, "rouge"))
            row("names right, greedy, the model alone (what / how-to)", lambda e: alone(e, "names"))
        lines.append("")
        if before:
            g, gb = ev["score_t0.0"]["all"], before["score_t0.0"]["all"]
            train_minutes = (sum(st["minutes"] for st in stages) if stages
                             else t["train_seconds"] / 60)
            better_lm = ev['heldout_text']['nats_per_char'] < before['heldout_text']['nats_per_char']
            lookup = bool(ev.get("docs_lookup")) and "score_t0.0_nodocs" in ev
            if lookup:
                a0 = ev["score_t0.0_nodocs"]["all"]
                gw = ev["score_t0.0"].get("what", {})
                lines += [
                    f"Verdict: the language model {'improved' if better_lm else 'did not improve'} (held-out text "
                    f"{before['heldout_text']['nats_per_char']:.3f} -> {ev['heldout_text']['nats_per_char']:.3f} "
                    "nats/character). With the documentation lookup the app gives it and the copy prior "
                    f"(docs_copy {ev.get('docs_copy')}; both on by default), the answers improved: ROUGE-L {gb['rouge_l']:.3f} -> {g['rouge_l']:.3f}, names right {gb['names_right']:.0%} -> "
                    f"{g['names_right']:.0%} ({gw.get('rouge_l', 0):.3f} and {gw.get('names_right', 0):.0%} on the "
                    "\"What does `X` do?\" questions, whose X the lookup finds by name). The model picks the entry "
                    "and the copy prior keeps it on that entry's words; with the lookup but no copying it scores "
                    f"ROUGE-L {ev['score_t0.0_nocopy']['all']['rouge_l']:.3f}, and alone it still writes wrong "
                    f"summaries (ROUGE-L {a0['rouge_l']:.3f}, names right {a0['names_right']:.0%}). A how-to answer is "
                    "only as good as the lookup's full-text match.",
                    ""]
            else:
                lines += [
                f"Verdict: the language model {'improved' if better_lm else 'did not improve'} (held-out text "
                f"{before['heldout_text']['nats_per_char']:.3f} -> "
                f"{ev['heldout_text']['nats_per_char']:.3f} nats/character), the answers did "
                + ("not: " if g["rouge_l"] <= gb["rouge_l"] or g["names_right"] == 0 else
                   ("too: " if better_lm else "improve: "))
                + f"ROUGE-L {gb['rouge_l']:.3f} -> {g['rouge_l']:.3f}, names right {gb['names_right']:.0%} -> "
                f"{g['names_right']:.0%}. "
                + ("The model has not learnt to copy the name it is asked about from the question into its "
                   "answer (it writes the answer's format, `name`: summary, with a name of its own); its "
                   "answers are not useful yet." if g["names_right"] == 0 else
                   f"It has begun to copy the asked name into its answer ({ev['score_t0.0'].get('what', {}).get('names_right', 0):.0%} "
                   "of the \"What does `X` do?\" answers name X or its module), but the summaries it writes are "
                   f"mostly wrong: a tiny model trained for {train_minutes:.0f} minutes on one CPU core."),
                ""]
        dec = ev.get("temperature_decision")
        if not dec and "score_t0.7" in ev:
            g0, g7 = ev["score_t0.0"]["all"], ev["score_t0.7"]["all"]
            greedy_better = (g0["rouge_l"], g0["names_right"]) >= (g7["rouge_l"], g7["names_right"])
            dec = (f"Greedy against temperature 0.7 on the same {len(ev['answers_t0.0'])} questions: ROUGE-L "
                   f"{g0['rouge_l']:.3f} against {g7['rouge_l']:.3f}, names right {g0['names_right']:.0%} against "
                   f"{g7['names_right']:.0%}: " + (
                       "greedy answers score better, so temperature 0 stays the default; Regenerate still draws a "
                       "fresh seed, which changes the answer once the temperature is raised." if greedy_better else
                       "sampled answers score better on this measure, an argument for a temperature above 0 as the "
                       "default."))
        if dec:
            lines += [dec, ""]
        E = m["experts"]
        ent = ev["int8"]["usage_entropy"]
        rec = ev["int8"]["pilot1_recall"]
        lines += [
            "## Routing (colibri's engine, int8 store, held-out text)",
            f"- Held-out NLL (same sample): transformers f32 {ev.get('transformers_heldout_loss', float('nan')):.4f}, "
            f"colibri int8 store {ev['int8']['nll']:.4f} nats/token.",
            "- Expert-usage entropy per layer, as a share of log(num_experts) = "
            f"{math.log(E):.3f}: " + ", ".join(f"{e / math.log(E):.3f}" for e in ent) + ".",
            "- PILOT=1 recall per layer (share of the experts a layer routes to that were predicted from",
            "  the previous layer's post-attention state with this layer's own norm and router; layer 0",
            "  is never predicted): " + ", ".join(f"{x:.2f}" for x in rec) + ".",
            "",
        ]
        ans = ev.get("answers_t0.0", [])
        if ans:
            picks = [a for a in ans if a["kind"] == "what"][:N_SAMPLES // 2]
            picks += [a for a in ans if a["kind"] == "howto"][:N_SAMPLES - len(picks)]
            old = {a["question"]: a for a in (before or {}).get("answers_t0.0", [])}
            lines += [f"## {len(picks)} sample answers (held-out questions, greedy, verbatim)", ""]
            for a in picks:
                lines += [f"**Q: {a['question']}**", "", "This model:", "", "```text", a["answer"].strip(), "```", ""]
                if a["question"] in old:
                    lines += ["Before:", "", "```text", old[a["question"]]["answer"].strip(), "```", ""]
    lines += [
        "## Intended use and limits",
        "- Intended use: the offline default model of colibri-desktop, a demo of SSD-streamed MoE",
        "  inference, and a realistic routing workload for tuning the expert cache and PILOT.",
        "- Limits: tiny and briefly trained on a shared CPU; it imitates the style of Python",
        "  documentation and, on its own, often names a plausible but wrong function. With the",
        "  documentation lookup it repeats what the looked-up entry says, which is only right when the",
        "  lookup found the object asked about (the answer line names the entries). Not for real use;",
        "  check what it says.",
        "",
    ]
    (MODEL / "README.md").write_text("\n".join(lines))
    print(f"wrote {MODEL / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
