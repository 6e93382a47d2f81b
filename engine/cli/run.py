"""``colibri run``, ``colibri convert`` and ``colibri info``."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from ..chat_template import raw_mode_warning
from ..events import ChatMessage, Finished, FinishReason, GenerateRequest, StepMetrics, TokenEvent
from ..settings import ENGINE, SAMPLING
from .flags import add_setting_flags, engine_config, sampling_params


def _progress_printer(label: str):
    from .models import cli_progress  # one progress line format for every command
    return cli_progress(label)


def resolve_store(model: str | None) -> str:
    """The store to open: ``model``, else the bundled default model (converted on first use)."""
    if model:
        return model
    from ..library import default_store
    return str(default_store(progress=_progress_printer("converting the default model (first run)")))


def cmd_run(a) -> int:
    """``colibri run``: generate from a prompt, streaming the text to stdout."""
    from ..generate import Engine
    from ..prof import Profile
    if a.trace:  # refuse a trace path that cannot be written before any compute
        t = Path(a.trace)
        if t.is_dir():
            raise ValueError(f"--trace {t}: is a folder; give a file name, e.g. {t / 'trace.jsonl'}")
        if not t.parent.is_dir():
            raise ValueError(f"--trace {t}: folder {t.parent} does not exist")
    store = resolve_store(a.model)
    cfg = engine_config(a, store)
    with Engine.open(cfg) as eng:
        if a.prof:
            print(f"[prof] {eng.loaded.message}", file=sys.stderr)
        if (not a.raw and not eng.has_chat_template) or (a.raw and a.system):  # never silently raw (18.5)
            print(raw_mode_warning(eng.loaded.store_path, eng.has_chat_template, bool(a.system)), file=sys.stderr)
        if a.raw or not eng.has_chat_template:
            req = GenerateRequest(prompt=a.prompt, sampling=sampling_params(a))
        else:
            msgs = ((ChatMessage("system", a.system),) if a.system else ()) + (ChatMessage("user", a.prompt),)
            req = GenerateRequest(messages=msgs, sampling=sampling_params(a))
        prof = Profile(eng) if a.prof else None
        trace = None
        if a.trace:
            from ..trace import TraceRecorder
            trace = TraceRecorder(eng)
        cancel = threading.Event()
        fin = None
        try:
            for ev in eng.generate(req, cancel):
                if isinstance(ev, TokenEvent):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, StepMetrics) and prof:
                    prof.add(ev)
                elif isinstance(ev, Finished):
                    fin = ev
        except KeyboardInterrupt:
            cancel.set()
        print()
        if trace:
            trace.save(a.trace)
        if fin is not None and fin.finish_reason == FinishReason.ERROR:
            print(f"error: {fin.error}", file=sys.stderr)
            return 1
        if prof and fin:
            print(prof.report(fin), file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    """``colibri convert SRC DST``: convert a Hugging Face checkpoint folder into a store."""
    from ..convert import convert_checkpoint
    t0 = time.perf_counter()
    dst = convert_checkpoint(a.src, a.dst, quant=a.quant, overwrite=a.overwrite, group_size=a.group_size,
                             progress=_progress_printer(f"converting ({a.quant})"))
    print(f"store written to {dst} in {time.perf_counter() - t0:.1f} s")
    return 0


def describe_store(path: str) -> str:
    """A few lines describing a converted store (``colibri info``). Raises StoreError."""
    from ..expert_store import ExpertStore
    with ExpertStore(path, o_direct=False) as st:
        m, a = st.manifest, st.args
        n_exp = a.num_hidden_layers * a.num_experts
        expert_gb = n_exp * st.slot_bytes / 1e9
        lines = [
            f"store       {st.path}",
            f"model       {m.get('model_name')} ({a.model_type}), converted {m.get('created')} from {m.get('source')}",
            f"layers      {a.num_hidden_layers}, hidden {a.hidden_size}, heads {a.num_attention_heads} "
            f"(KV heads {a.num_key_value_heads}, head size {a.head_dim})",
            f"experts     {a.num_experts} per layer, {a.num_experts_per_tok} routed per token, width "
            f"{a.intermediate_size}, norm_topk_prob {a.norm_topk_prob}",
            f"vocab       {a.vocab_size}, context {a.max_position_embeddings}",
            f"quant       experts {m['quant']}" + (f" (group {m['group_size']})" if m.get("group_size") else "")
            + f", dense {m['dense_quant']}",
            f"expert slab {st.slot_bytes / 1e6:.2f} MB each (one {m['alignment']}-byte-aligned read), "
            f"{n_exp} experts = {expert_gb:.2f} GB on disk",
            f"dense       {m['dense_bytes'] / 1e9:.3f} GB resident",
        ]
        return "\n".join(lines)


def cmd_info(a) -> int:
    """``colibri info STORE``."""
    print(describe_store(a.store))
    return 0


def add_parsers(sub) -> None:
    """Add ``run``, ``convert`` and ``info`` to the ``colibri`` argparse subparsers ``sub``."""
    r = sub.add_parser("run", help="generate from a prompt, streaming to stdout")
    r.add_argument("--model", help="converted store (default: the bundled model)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--system", default="", help="system prompt (chat models)")
    r.add_argument("--raw", action="store_true", help="raw mode: no chat template, the prompt is plain text for the "
                   "model to continue (special tokens in it are recognised; --system is not used)")
    r.add_argument("--prof", action="store_true", help="print a closing profile (hit rate, MB/token, felt wait)")
    r.add_argument("--trace", help="record routing and PILOT predictions to this file")
    add_setting_flags(r, SAMPLING)
    add_setting_flags(r, ENGINE)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("convert", help="convert a Hugging Face OLMoE folder into a store")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--quant", choices=("int8", "int4", "f16", "f32"), default="int8")
    c.add_argument("--group-size", type=int, default=32, help="int4 group size")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(fn=cmd_convert)

    i = sub.add_parser("info", help="describe a converted store")
    i.add_argument("store")
    i.set_defaults(fn=cmd_info)
