"""``colibri download`` and ``colibri models``: the model library from the command line."""

from __future__ import annotations

import shutil
import sys
import threading
import time

from ..errors import EngineError, error_kind
from ..events import LoadProgress
from ..units import format_bytes


_LINE_OPEN = [False]  # a progress line is on stderr without its newline yet


def end_progress_line() -> None:
    """End an unfinished progress line, so the next message (an error) starts on its own line."""
    if _LINE_OPEN[0]:
        print(file=sys.stderr, flush=True)
        _LINE_OPEN[0] = False


def cli_progress(label: str):
    """A LoadProgress callback printing one updating stderr line (at most twice a second);
    notices (messages starting with "skipping ") get a whole line of their own."""
    last = [0.0]

    def cb(ev: LoadProgress) -> None:
        if ev.message.startswith("skipping "):
            end_progress_line()
            print(f"{label}: {ev.message}", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        if now - last[0] < 0.5 and ev.done < ev.total:
            return
        last[0] = now
        pct = 100 * ev.done / ev.total if ev.total else 100.0
        print(f"\r{label}: {format_bytes(ev.done):>9} / {format_bytes(ev.total)} ({pct:5.1f}%) "
              f"{ev.message[:60]:<60}", end="", file=sys.stderr, flush=True)
        _LINE_OPEN[0] = True
        if ev.total and ev.done >= ev.total:
            end_progress_line()
    return cb


def open_notices(ev: LoadProgress) -> None:
    """Engine.open's progress for ``colibri run`` / ``serve``: only the long first compile of a
    kind of model's kernels (stage "compile", a minute or two) is worth a line on stderr."""
    if ev.stage == "compile":
        print(f"colibri: {ev.message}", file=sys.stderr, flush=True)


def cmd_download(a) -> int:
    """``colibri download REPO``: check, download, convert, self-test, print the store path."""
    from ..library import check_repo, convert_downloaded, delete_model, download, self_test, self_test_says_broken
    try:
        chk = check_repo(a.repo, a.revision, a.quant or "int8", a.context_length, gguf=a.gguf)
    except ValueError as e:  # ConfigError included (unsupported model type)
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    if chk.quant == "gguf" and a.quant:
        print(f"colibri: error: --quant does not apply to {chk.repo_id}: its GGUF blocks are imported as "
              f"published; choose the file with --gguf ({', '.join(chk.gguf_choices)})", file=sys.stderr)
        return 2
    quant = chk.quant
    print(chk.table())
    if chk.gguf_file:
        print(f"GGUF       {chk.gguf_file} of {', '.join(chk.gguf_choices)} (another: --gguf QUANT)")
    if not chk.disk_ok:
        print(f"colibri: refused: {chk.disk_message}", file=sys.stderr)
        return 2
    if chk.ram_verdict == "refuse":
        print(f"colibri: refused: {chk.ram_message}", file=sys.stderr)
        return 2
    if chk.ram_verdict == "warn" and not a.yes:
        if not sys.stdin.isatty():
            print("colibri: RAM warning; pass --yes to continue anyway", file=sys.stderr)
            return 2
        if input("Continue anyway? [y/N] ").strip().lower() not in ("y", "yes"):
            return 1
    if chk.store_exists and not a.overwrite:
        print(f"colibri: {chk.store_dir} already exists; pass --overwrite to convert again", file=sys.stderr)
        return 2
    cancel = threading.Event()
    try:
        # the checked repo id and commit: a pasted hub address names the same repository
        src = download(chk.repo_id, chk.commit or a.revision, None, cli_progress("downloading"), cancel, check=chk)
    except KeyboardInterrupt:
        cancel.set()
        print("\ninterrupted; the bytes fetched so far are kept - run the same command again to resume",
              file=sys.stderr)
        return 130
    print(file=sys.stderr)
    t0 = time.perf_counter()
    try:
        # a GGUF model is imported from its (first) file, under the name its file gives it
        store = convert_downloaded(src / chk.files[0].name if quant == "gguf" else src, quant,
                                   cli_progress(f"converting ({quant})"), overwrite=a.overwrite,
                                   name=chk.model_name if quant == "gguf" else None)
    except KeyboardInterrupt:
        print(f"\ninterrupted; no store was written (the download is kept in {src})", file=sys.stderr)
        return 130
    print(f"\nconverted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        text = self_test(store)
    except EngineError as e:
        if not self_test_says_broken(error_kind(e)):  # e.g. too little free RAM now: the store may be fine
            print(f"colibri: the self-test of {store} could not run ({e}); the store was kept: run "
                  f"`colibri run --model {store} --prompt hi` once that is solved", file=sys.stderr)
            return 1
        delete_model(store)  # the store does not run: it is not kept in the library
        print(f"colibri: the self-test of {store} failed ({e}); the store was removed (the download is "
              f"kept in {src})", file=sys.stderr)
        return 1
    print(f"self-test (8 greedy tokens): {text!r}", file=sys.stderr)
    if not a.keep_download:
        shutil.rmtree(src, ignore_errors=True)
    print(store)
    return 0


def cmd_models(a) -> int:
    """``colibri models``: table of converted stores; a broken store is listed as BROKEN with
    the reason (naming the file) and what to do. Exit code 1 when any store is broken.
    ``--found``: the GGUF models LM Studio, Ollama and the Hugging Face cache hold instead."""
    if getattr(a, "found", False):
        return _cmd_found()
    from ..library import list_models, models_dir
    ms = list_models()
    if not ms:
        print(f"no converted models in {models_dir()} (add one with `colibri download REPO`)")
        return 0
    print(f"{'name':<32} {'quant':<5} {'family':<10} {'size':>10}  {'created':<20} source / path")
    for m in ms:
        print(f"{m.name[:32]:<32} {m.quantization:<5} {m.family_label:<10} {format_bytes(m.size_bytes):>10}  "
              f"{m.created:<20} {m.source}\n{'':<82}{m.path}")
        if not m.ok:
            print(f"{'':<4}BROKEN: {m.problem}\n{'':<4}{m.advice}")
    broken = sum(not m.ok for m in ms)
    if broken:
        print(f"colibri: {broken} of {len(ms)} stores are broken (see BROKEN above)", file=sys.stderr)
        return 1
    return 0


def _cmd_found() -> int:
    from ..library import find_gguf_models
    found = find_gguf_models()
    if not found:
        print("no GGUF models found in LM Studio's or Ollama's folders or the Hugging Face cache")
        return 0
    print(f"{'name':<32} {'where':<18} {'size':>10}  {'quant':<8} {'architecture':<12} runs  path")
    for f in found:
        print(f"{f.name[:32]:<32} {f.where:<18} {format_bytes(f.size):>10}  {f.quant or '?':<8} "
              f"{f.architecture or '?':<12} {'yes' if f.runs else 'no ':<4}  {f.path}")
        if not f.runs:
            print(f"{'':<4}{f.message}")
    print("import one with `colibri convert PATH STORE` (the file is only read)")
    return 0


def add_parsers(sub) -> None:
    """Add ``download`` and ``models`` to the ``colibri`` argparse subparsers ``sub``."""
    from ..library import WIZARD_QUANTS
    d = sub.add_parser("download", help="download a model from the Hugging Face hub, check it and convert it",
                       description="Check (disk, RAM), download only the needed files (resumable), "
                                   "convert into a store in the user data folder, self-test, print the path.")
    d.add_argument("repo", help="hub repository id, e.g. allenai/OLMoE-1B-7B-0924")
    d.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    d.add_argument("--quant", choices=WIZARD_QUANTS + ("mxfp4", "f32"), default=None,
                   help="store quantization (default int8; mxfp4: gpt-oss's MXFP4 experts kept as published)")
    d.add_argument("--gguf", default=None, metavar="QUANT",
                   help="a repository of GGUF files (a -GGUF repository): the one to download and import, "
                        "by its quant (Q4_K_M, Q8_0, ...) or file name (default Q4_K_M when it has one)")
    d.add_argument("--context-length", type=int, default=0,
                   help="context the RAM estimate assumes (0 = model default, up to 4096)")
    d.add_argument("--yes", action="store_true", help="continue despite a RAM warning")
    d.add_argument("--overwrite", action="store_true", help="replace an existing store of this model and quant")
    d.add_argument("--keep-download", action="store_true",
                   help="keep the downloaded Hugging Face files after converting")
    d.set_defaults(fn=cmd_download)
    m = sub.add_parser("models", help="list converted models")
    m.add_argument("--found", action="store_true",
                   help="list the GGUF models LM Studio, Ollama and the Hugging Face cache hold instead")
    m.set_defaults(fn=cmd_models)
