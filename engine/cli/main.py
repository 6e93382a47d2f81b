"""``colibri`` command line: subcommand parsing and dispatch (the top floor of the engine).

The ``colibri`` console script is colibri_app.launcher: with no arguments it starts the app,
with arguments it calls :func:`main` here. ``python -m engine.cli ...`` runs this directly.
"""

from __future__ import annotations

import argparse
import logging
import sys

from importlib import import_module

from ..errors import EngineError, error_text

log = logging.getLogger("colibri")

# verb -> (the module of engine.cli whose add_parsers adds it, its line in `colibri --help`).
# Only the verb being run has its module imported and its parser built: `--help`, `--version`
# and the light verbs never import numpy, the converter, the server or the kernels.
# tests/test_cli_start.py checks these lines against the full parsers' own help.
VERBS = {
    "run": ("run", "generate from a prompt, streaming to stdout"),
    "convert": ("run", "convert a Hugging Face MoE folder or a GGUF model into a store"),
    "info": ("run", "describe a converted store"),
    "download": ("models", "download a model from the Hugging Face hub, check it and convert it"),
    "models": ("models", "list converted models"),
    "serve": ("serve", "serve a model over an OpenAI-compatible HTTP API on this computer"),
    "cluster": ("cluster", "serve experts from other computers' RAM (Ray)"),
    "doctor": ("doctor", "print what a bug report needs (versions, CPU, RAM, disk speed, models)"),
    "bench": ("..bench", "benchmarks (JSON + markdown in bench/results/)"),
}
VERBOSE_HELP = "log what the engine does (the plan line, timings); also accepted after the command"


class _SubParser(argparse.ArgumentParser):
    """A subcommand's parser: it takes ``-v`` too, so ``colibri run --prof -v`` works as
    ``colibri -v run --prof`` does (SUPPRESS: without it the top level's value stands). Its own
    subcommands are of this class as well (add_subparsers' default parser_class is the
    parser's type)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)


def verb_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), or None."""
    for a in argv:
        if not a.startswith("-"):
            return a
        if a == "--":
            return None
    return None


def build_parser(verb: str | None = "") -> argparse.ArgumentParser:
    """The ``colibri`` argument parser: run, convert, info, download, models, serve, cluster,
    doctor, bench. ``verb`` "" (the default) builds every subcommand in full; a verb name builds
    only that one's module (the others are listed by name and help line); None builds none."""
    from .doctor import version_line
    p = argparse.ArgumentParser(prog="colibri", description="Run MoE models larger than RAM. "
                                "Without a command, `colibri` starts the desktop app.")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("--version", action="version", version=version_line(),
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_SubParser)
    built: set[str] = set()
    for name, (mod, help_line) in VERBS.items():
        if mod in built:
            continue
        if verb == "" or VERBS.get(verb, ("",))[0] == mod:
            m = import_module(mod if mod.startswith("..") else "." + mod, __package__)
            (m.add_bench_parser if mod == "..bench" else m.add_parsers)(sub)
            built.add(mod)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the subcommand. Returns the exit code
    (2 with one ``colibri: error: ...`` line for bad input; never a traceback for it)."""
    argv = sys.argv[1:] if argv is None else argv
    verb = verb_of(argv)
    a = build_parser(verb if verb in VERBS else "" if verb else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(a, "bench_cmd", None) and hasattr(a, "name"):  # result files: refused before any run
            from ..bench.common import check_results_target
            check_results_target(getattr(a, "out_dir", "bench/results"), a.name)
        return a.fn(a) or 0
    except (EngineError, OSError, ValueError) as e:  # OSError: disk full, permissions, ...
        from .models import end_progress_line
        end_progress_line()
        print(f"colibri: error: {error_text(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C in a command without its own handling: one line, no traceback
        from .models import end_progress_line
        end_progress_line()
        print("colibri: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
