"""The ``colibri`` console script: no arguments start the desktop app, any arguments go to the
engine's command line (``colibri run ...``, ``colibri bench ...``; engine.cli.main).

It lives in the app (the top floor) so that the engine never imports the app.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        from .__main__ import main as app_main  # the only entry that needs Qt
        return app_main([])
    from engine.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
