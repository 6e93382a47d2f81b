"""The ``colibri`` command line (top floor of the engine: it may import the core, the library
and the benchmarks; nothing imports it except colibri_app.launcher)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
