"""``colibri`` command line: the GUI with no arguments; run, convert, info, bench, ... otherwise."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

from .config import POLICIES, EngineConfig
from .errors import EngineError
from .events import ChatMessage, Finished, GenerateRequest, SamplingParams, StepMetrics, TokenEvent

log = logging.getLogger("colibri")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings as flags (the same names as the settings file)."""
    g = p.add_argument_group("engine (speed and memory only; never changes the output)")
    g.add_argument("--cap", type=int, default=None, help="expert slots per layer (default: auto from the budget)")
    g.add_argument("--ram-budget-gb", type=float, default=None, help="RAM budget in GB (default: auto)")
    g.add_argument("--policy", choices=POLICIES, default=EngineConfig.policy, help="cache eviction policy")
    g.add_argument("--pilot", type=int, choices=(0, 1, 2, 3), default=EngineConfig.pilot, help="PILOT prefetch mode (default 0: it measured best on this machine, see bench/README.md)")
    g.add_argument("--pilot-workers", type=int, default=1, help="prefetch loader threads (1-8)")
    g.add_argument("--wide", type=int, default=1, help="prefetch top-k x WIDE candidates (1-4)")
    g.add_argument("--conf-limit", type=float, default=0.92, help="cumulative probability limit when wide > 1")
    g.add_argument("--smooth", type=float, default=0.3, help="predictor router-logit EMA (0-0.95)")
    g.add_argument("--spec-precision", type=float, default=EngineConfig.spec_precision,
                   help="load a PILOT prediction only while its measured precision is at least this (0 = all)")
    g.add_argument("--no-evict-guard", action="store_true", help="let speculation evict warm experts")
    g.add_argument("--no-o-direct", action="store_true", help="buffered reads (use the page cache)")
    g.add_argument("--no-pinning", action="store_true", help="no hot pinning / pre-warm")
    g.add_argument("--no-history", action="store_true", help="do not load or save routing heat")
    g.add_argument("--checksum", choices=("off", "first", "always"), default="first")
    g.add_argument("--context-length", type=int, default=0, help="KV capacity in tokens (0 = model default)")
    g.add_argument("--threads", type=int, default=0, help="numba threads (0 = all cores)")


def engine_config(a: argparse.Namespace, store: str) -> EngineConfig:
    return EngineConfig(
        store=store, context_length=a.context_length, ram_budget_gb=a.ram_budget_gb, cap=a.cap,
        policy=a.policy, pinning=not a.no_pinning, pilot=a.pilot, pilot_workers=a.pilot_workers,
        wide=a.wide, conf_limit=a.conf_limit, smooth=a.smooth, spec_precision=a.spec_precision, evict_guard=not a.no_evict_guard,
        o_direct=not a.no_o_direct, checksum=a.checksum, numba_threads=a.threads,
        history=not a.no_history).validated()


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=256)


def sampling_params(a) -> SamplingParams:
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          repetition_penalty=a.repetition_penalty, seed=a.seed,
                          max_new_tokens=a.max_new_tokens)


def _progress_printer(label: str):
    from .hub import cli_progress  # one progress line format for every command
    return cli_progress(label)


def resolve_store(model: str | None) -> str:
    if model:
        return model
    from .default_model import default_store
    return str(default_store(progress=_progress_printer("converting the default model (first run)")))


def cmd_run(a) -> int:
    from .generate import Engine
    from .prof import Profile
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
        if a.raw or not eng.has_chat_template:
            req = GenerateRequest(prompt=a.prompt, sampling=sampling_params(a))
        else:
            msgs = ((ChatMessage("system", a.system),) if a.system else ()) + (ChatMessage("user", a.prompt),)
            req = GenerateRequest(messages=msgs, sampling=sampling_params(a))
        prof = Profile(eng) if a.prof else None
        trace = None
        if a.trace:
            from .trace import TraceRecorder
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
        if fin is not None and fin.finish_reason == "error":
            print(f"error: {fin.error}", file=sys.stderr)
            return 1
        if prof and fin:
            print(prof.report(fin), file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    from .convert import convert_checkpoint
    t0 = time.perf_counter()
    dst = convert_checkpoint(a.src, a.dst, quant=a.quant, overwrite=a.overwrite, group_size=a.group_size,
                             dense_quant=a.dense_quant, progress=_progress_printer(f"converting ({a.quant})"))
    print(f"store written to {dst} in {time.perf_counter() - t0:.1f} s")
    return 0


def describe_store(path: str) -> str:
    from .expert_store import ExpertStore
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
    print(describe_store(a.store))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        from colibri_app.__main__ import main as gui_main  # the GUI (only entry that needs Qt)
        return gui_main()
    p = argparse.ArgumentParser(prog="colibri", description="Run MoE models larger than RAM.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="generate from a prompt, streaming to stdout")
    r.add_argument("--model", help="converted store (default: the bundled model)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--system", default="", help="system prompt (chat models)")
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument("--prof", action="store_true", help="print a closing profile (hit rate, MB/token, felt wait)")
    r.add_argument("--trace", help="record routing and PILOT predictions to this file")
    add_sampling_flags(r)
    add_engine_flags(r)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("convert", help="convert a Hugging Face OLMoE folder into a store")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--quant", choices=("int8", "int4", "f16", "f32"), default="int8")
    c.add_argument("--group-size", type=int, default=32, help="int4 group size")
    c.add_argument("--dense-quant", choices=("int8", "int4", "f16", "f32"), default=None,
                   help="resident dense weights; int4 = attention int4, embedding and lm_head int8 "
                        "(default: int8 for int8/int4 stores, else the --quant)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(fn=cmd_convert)

    i = sub.add_parser("info", help="describe a converted store")
    i.add_argument("store")
    i.set_defaults(fn=cmd_info)

    try:
        from .bench import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    try:
        from .hub import add_hub_parsers
        add_hub_parsers(sub)
    except ImportError:
        pass

    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.fn(a) or 0
    except (EngineError, FileExistsError, ValueError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

