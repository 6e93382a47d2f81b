"""``colibri`` command line: subcommand parsing and dispatch (the top floor of the engine).

The ``colibri`` console script is colibri_app.launcher: with no arguments it starts the app,
with arguments it calls :func:`main` here. ``python -m engine.cli ...`` runs this directly.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import EngineError
from . import cluster, doctor, models, run, serve

log = logging.getLogger("colibri")


def build_parser() -> argparse.ArgumentParser:
    """The whole ``colibri`` argument parser: run, convert, info, download, models, serve, doctor, bench."""
    from ..bench import add_bench_parser
    p = argparse.ArgumentParser(prog="colibri", description="Run MoE models larger than RAM. "
                                "Without a command, `colibri` starts the desktop app.")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--version", action="version", version=doctor.version_line(),
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)
    run.add_parsers(sub)
    models.add_parsers(sub)
    serve.add_parsers(sub)
    cluster.add_parsers(sub)
    doctor.add_parsers(sub)
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the subcommand. Returns the exit code
    (2 with one ``colibri: error: ...`` line for bad input; never a traceback for it)."""
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
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
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C in a command without its own handling: one line, no traceback
        from .models import end_progress_line
        end_progress_line()
        print("colibri: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
