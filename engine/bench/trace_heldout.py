"""``colibri bench trace-heldout``: a routing trace of the trained default model over its
held-out text."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_trace_heldout(a) -> int:
    """Record a routing trace of the trained default model over its held-out text.

    Each held-out sequence (``heldout_sample.jsonl`` next to the checkpoint) is a real chat or
    source excerpt: the part up to the first assistant marker (or its first 16 tokens) is the
    prompt, the rest is teacher forced, so the routing is the model's real routing on text it
    never trained on. All sequences run in one engine session, like a user's chats; pinning on,
    history off, PILOT 1 (its predictions go into the trace).

    With ``--logits`` the trace also holds router and predictor logits (``RecordedRouting``
    input) and each sequence's prompt is its first token only, so every later position is a
    decode step with PILOT's predictor logits recorded (the routing is the same either way:
    teacher forcing computes what a prefill computes, row by row).
    """
    from ..config import EngineConfig
    from ..library import default_model_dir, default_store
    from ..events import Finished, GenerateRequest, SamplingParams
    from ..generate import Engine
    from ..trace import TraceRecorder
    src = Path(a.model_dir) if a.model_dir else default_model_dir()
    store = a.store or str(default_store())
    seqs = [json.loads(x)["ids"] for x in (src / "heldout_sample.jsonl").read_text().splitlines() if x.strip()]
    seqs = seqs[:a.sequences]
    # one forward a token: drafting the teacher-forced text would record PILOT's predictions for
    # a few positions only
    cfg = EngineConfig(store=store, cap=a.cap or None, pilot=1, pinning=True, history=False,
                       ram_budget_gb=a.ram_budget_gb, speculation="off").validated()
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng, logits=a.logits)
        marker = eng.tokenizer.token_to_id("<|assistant|>")
        n_tok = 0
        for ids in seqs:
            ids = ids[:eng.args.max_position_embeddings - 1]
            cut = ids.index(marker) + 2 if marker is not None and marker in ids[:-3] else min(16, len(ids) - 1)
            if a.logits:
                cut = 1
            req = GenerateRequest(prompt_ids=tuple(ids[:cut]), forced_ids=tuple(ids[cut:]),
                                  sampling=SamplingParams(max_new_tokens=len(ids) - cut))
            for ev in eng.generate(req):
                if isinstance(ev, Finished):
                    if ev.finish_reason == "error":
                        raise RuntimeError(ev.error)
                    n_tok += ev.generated_tokens
        rec.save(a.out)
        recall = eng.pilot.recall() if eng.pilot is not None else []
    print(f"trace of {len(seqs)} held-out sequences ({n_tok} decoded tokens) -> {a.out}; "
          f"PILOT=1 recall per layer: {' '.join(f'{r:.2f}' for r in recall)}")
    return 0


def add_parser(bs) -> None:
    """Register `trace-heldout` under ``colibri bench``."""
    th = bs.add_parser("trace-heldout", help="routing trace of the default model over its held-out text")
    th.add_argument("--model-dir", default=None, help="checkpoint folder with heldout_sample.jsonl (default: bundled)")
    th.add_argument("--store", default=None, help="converted store of it (default: the bundled model's)")
    th.add_argument("--sequences", type=int, default=64)
    th.add_argument("--cap", type=int, default=0, help="cap while recording (0 = auto)")
    th.add_argument("--out", default="bench/work/trace_default.jsonl")
    th.add_argument("--ram-budget-gb", type=float, default=None, help="RAM budget of the engine (default: auto)")
    th.add_argument("--logits", action="store_true",
                    help="record router + PILOT predictor logits too (input of `bench overlap --routing realistic`)")
    th.set_defaults(fn=cmd_trace_heldout)
