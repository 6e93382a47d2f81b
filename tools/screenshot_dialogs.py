#!/usr/bin/env python3
"""Render a dialog offscreen and save it: the model wizard's "Recommended for this computer"
(docs/wizard-recommended.png; sized for this machine's memory, or --ram-gb), its source page
(radio buttons), or the Settings dialog (docs/settings-dark.png), in either colour scheme.

    QT_QPA_PLATFORM=offscreen python tools/screenshot_dialogs.py [--out docs/wizard-recommended.png]
        [--page recommended|source|settings] [--theme light|dark] [--ram-gb 16]
        [--select Qwen/Qwen3-30B-A3B] [--size 1040x660]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="screenshot_dialogs.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "wizard-recommended.png"))
    ap.add_argument("--page", choices=("recommended", "source", "settings"), default="recommended")
    ap.add_argument("--theme", choices=("light", "dark"), default="light")
    ap.add_argument("--ram-gb", type=float, default=0, help="size for a machine with this much RAM (0: this one)")
    ap.add_argument("--select", default="", help="repository id of the row to select")
    ap.add_argument("--size", default="1040x660")
    a = ap.parse_args(argv)
    import os
    tmp = tempfile.mkdtemp(prefix="colibri-shot-")
    os.environ.setdefault("COLIBRI_DATA_DIR", os.path.join(tmp, "data"))
    os.environ.setdefault("COLIBRI_CONFIG_DIR", os.path.join(tmp, "config"))
    from PySide6.QtWidgets import QApplication

    import engine.library as lib
    from colibri_app import wizard as wz
    from colibri_app.resources import apply_theme
    app = QApplication.instance() or QApplication([sys.argv[0]])
    apply_theme(app, a.theme)
    if a.ram_gb:
        total = int(a.ram_gb * 1e9)
        lib.machine_ram = lambda: (total, int(total * 0.8))
    if a.page == "settings":
        from colibri_app.settings_dialog import SettingsDialog
        from colibri_app.settings_store import Settings
        w = SettingsDialog(Settings(), None, save=None)
    else:
        w = wz.ModelWizard(None, context_length=0, recommendations=a.page == "recommended")
    width, height = (int(v) for v in a.size.split("x"))
    w.resize(width, height)
    w.show()
    app.processEvents()
    if a.page == "recommended" and a.select:
        p = w.recommended_page
        p.table.selectRow(next(i for i, r in enumerate(p.rows) if r.model.repo_id == a.select))
    for _ in range(5):
        app.processEvents()
    if not w.grab().save(a.out):
        print(f"screenshot_dialogs.py: error: cannot write {a.out}", file=sys.stderr)
        return 1
    print(a.out)
    w.reject()
    from colibri_app import workers
    workers.shutdown_all(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
