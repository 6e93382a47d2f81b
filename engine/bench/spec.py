"""``colibri bench spec``: speculative decoding (prompt lookup) against plain decoding on the
bundled model, all experts resident, greedy, on a committed set of edit-this-code prompts.

Both arms are engines open in this process on the same store (speculation on / off), every
expert resident (``wait_filled``) before the first request; for each prompt the two arms run
back to back, their order alternating from prompt to prompt, each from a full prefill
(``forget_prefix``). Per answer: tokens per decode forward, draft acceptance, decode tok/s;
the greedy ids of the two arms must be equal (the run fails otherwise). The summary gives the
medians over prompts and the median of the per-prompt speed-ups, with the load average.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .common import check_results_target, machine_info, md_table, write_results

PROMPTS = Path("bench/prompts/edit_code.json")


def _answer(eng, messages, max_new: int):
    from ..events import ChatMessage, Finished, GenerateRequest, SamplingParams
    eng.forget_prefix()
    req = GenerateRequest(messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages),
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new, docs_lookup=False))
    fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
    if fin.error:
        raise RuntimeError(fin.error)
    return fin


def cmd_spec(a) -> int:
    check_results_target(a.out_dir, a.name)
    from ..config import EngineConfig
    from ..generate import Engine
    from ..library import default_store

    prompts = json.loads(Path(a.prompts).read_text(encoding="utf-8"))
    if a.limit:
        prompts = prompts[:a.limit]
    store = a.store or str(default_store())
    arms = {"off": "off", "prompt_lookup": "prompt_lookup"}
    engines = {}
    try:
        for name, mode in arms.items():
            engines[name] = Engine.open(EngineConfig(store=store, speculation=mode, draft_max=a.draft_max,
                                                     history=False, threads=a.threads, ram_budget_gb=a.ram_budget_gb))
        for eng in engines.values():
            if eng.cache.slots < eng.args.num_moe_layers * eng.args.num_experts:
                raise ValueError(f"--ram-budget-gb {a.ram_budget_gb}: the expert cache holds {eng.cache.slots} of "
                                 f"{eng.args.num_moe_layers * eng.args.num_experts} experts; give a budget that "
                                 f"holds them all")
            eng.cache.wait_filled()
            eng.model.wait_decode_ready(600)
        # one answer each before timing: the kernels of every T a verify uses are compiled
        for eng in engines.values():
            _answer(eng, prompts[0]["messages"], 32)
        load0 = os.getloadavg()
        rows = []
        for i, p in enumerate(prompts):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            fins = {name: _answer(engines[name], p["messages"], a.max_new_tokens) for name in order}
            off, on = fins["off"], fins["prompt_lookup"]
            if on.token_ids != off.token_ids:
                raise RuntimeError(f"prompt {i} ({p['about']}): the ids with speculation differ from plain decoding")
            rows.append({"prompt": p["about"], "tokens": off.generated_tokens,
                         "tok_s_off": off.decode_tok_per_s, "tok_s_spec": on.decode_tok_per_s,
                         "tokens_per_forward": on.tokens_per_forward, "acceptance": on.draft_acceptance,
                         "speedup": on.decode_tok_per_s / off.decode_tok_per_s if off.decode_tok_per_s else 0.0})
            print(f"{i + 1}/{len(prompts)} {p['about']}: {rows[-1]['tokens']} tokens, "
                  f"{rows[-1]['tokens_per_forward']:.2f} tokens/forward, x{rows[-1]['speedup']:.2f}", flush=True)
        load1 = os.getloadavg()
    finally:
        for eng in engines.values():
            eng.close()

    def med(k):
        return float(np.median([r[k] for r in rows]))
    summary = {"prompts": len(rows), "median_tok_s_off": med("tok_s_off"), "median_tok_s_spec": med("tok_s_spec"),
               "median_tokens_per_forward": med("tokens_per_forward"), "median_acceptance": med("acceptance"),
               "median_speedup": med("speedup"),
               "speedup_of_medians": med("tok_s_spec") / med("tok_s_off") if med("tok_s_off") else 0.0,
               "load_average_start": load0, "load_average_end": load1}
    table = md_table(rows, [("prompt", "prompt", ""), ("tokens", "tokens", "d"), ("tok/s off", "tok_s_off", ".1f"),
                            ("tok/s spec", "tok_s_spec", ".1f"), ("tokens/forward", "tokens_per_forward", ".2f"),
                            ("acceptance", "acceptance", ".2f"), ("speed-up", "speedup", ".2f")])
    table += (f"\n\nMedians over {len(rows)} prompts: decode {summary['median_tok_s_off']:.1f} -> "
              f"{summary['median_tok_s_spec']:.1f} tok/s (median speed-up x{summary['median_speedup']:.2f}), "
              f"{summary['median_tokens_per_forward']:.2f} tokens per forward, acceptance "
              f"{summary['median_acceptance']:.2f}. Greedy ids identical in both arms. Load average "
              f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end.\n\nCommand: `colibri bench spec "
              f"--max-new-tokens {a.max_new_tokens} --draft-max {a.draft_max} --threads {a.threads} "
              f"--ram-budget-gb {a.ram_budget_gb}`")
    write_results(a.name, {"machine": machine_info(), "store": store, "prompts_file": str(a.prompts),
                           "max_new_tokens": a.max_new_tokens, "draft_max": a.draft_max, "threads": a.threads,
                           "summary": summary, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
                  table, out_dir=a.out_dir)
    return 0


def add_parser(bs) -> None:
    """Register ``spec`` under ``colibri bench``."""
    p = bs.add_parser("spec", help="speculative decoding (prompt lookup) vs plain decoding, bundled model, "
                                   "edit-this-code prompts, all experts resident")
    p.add_argument("--store", default=None, help="a store (default: the bundled model)")
    p.add_argument("--prompts", default=str(PROMPTS), help="JSON list of {about, messages}")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="compute threads (0 = auto)")
    p.add_argument("--ram-budget-gb", type=float, default=2.0, help="RAM budget of each arm's engine (every "
                   "expert must fit)")
    p.add_argument("--name", default="spec_prompt_lookup")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(fn=cmd_spec)
