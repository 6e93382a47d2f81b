"""Shared set-up of the offscreen app tools (screenshot.py, bench_gui_stall.py).

Each tool runs the real MainWindow with its user data in a temporary folder, on the bundled
default model, or on a synthetic random OLMoE when the default model is not there yet.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def number(kind, lo: float, what: str, zero_ok: bool = False):
    """An argparse ``type``: ``kind(text)`` (int or float) of at least ``lo`` (or 0 when
    ``zero_ok``); ArgumentTypeError "'TEXT': give WHAT" otherwise (NaN included)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}") from None
        if v != v or not (v >= lo or (zero_ok and v == 0)):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
        return v
    return parse


def check_store_arg(ap: argparse.ArgumentParser, store: str | None) -> None:
    """Refuse a ``--store`` that is not a healthy converted store (the engine's one store
    validation) with ``ap.error`` naming the broken file, instead of the app silently opening
    the default model."""
    if store is None:
        return
    from engine.library import store_problem
    why = store_problem(Path(store).expanduser())
    if why:
        ap.error(f"--store {store}: {why}")


def isolated_user_dirs(prefix: str) -> Path:
    """Point COLIBRI_DATA_DIR / COLIBRI_CONFIG_DIR at a new temporary folder (returned), so the
    user's own chats, settings and models are never touched; default to the offscreen Qt
    platform. Call before importing colibri_app."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["COLIBRI_DATA_DIR"] = str(tmp / "data")
    os.environ["COLIBRI_CONFIG_DIR"] = str(tmp / "config")
    return tmp


def synthetic_store(root: Path) -> str:
    """A random OLMoE shaped like the default model (8 layers x 32 experts, top-4), converted
    to int8 under ``root``; returns the store path."""
    from engine import convert_checkpoint
    from engine.bench.synthetic import olmoe_config, write_checkpoint
    cfg = olmoe_config(hidden_size=128, intermediate_size=64, num_hidden_layers=8, num_experts=32,
                       num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
    ck = write_checkpoint(root / "synthetic-olmoe", cfg, seed=7)
    return str(convert_checkpoint(ck, root / "models" / "synthetic-olmoe-int8", quant="int8"))


def pick_model(store: str | None, tmp: Path) -> tuple[str | None, str]:
    """(store for Settings.current_model, kind): the given store ("store"), else the bundled
    default model (None, "default"), else a synthetic one ("synthetic"); says which on stdout."""
    from engine.library import default_model_dir
    if store:
        print(f"model: {store}")
        return store, "store"
    if (default_model_dir() / "config.json").exists():
        print(f"model: bundled default model ({default_model_dir()})")
        return None, "default"
    print(f"model: the bundled default model is not in {default_model_dir()} yet; using a SYNTHETIC "
          f"random OLMoE (8 layers x 32 experts, top-4; its answers are noise)")
    return synthetic_store(tmp), "synthetic"
