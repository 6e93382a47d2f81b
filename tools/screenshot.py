#!/usr/bin/env python3
"""Render the main window offscreen during a real generation and save docs/screenshot.png.

Uses the bundled default model (engine.library.default_store()); if it is not there yet (it is trained
by tools/train_default_model.py), a synthetic random OLMoE is used instead and the script says
so. History, settings and the converted model live in a temporary folder, so the user's own
data is never touched.

    QT_QPA_PLATFORM=offscreen python tools/screenshot.py [--out docs/screenshot.png] [--theme dark]
        [--size 780x900] [--prompt "How do I read a CSV file?"]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from app_harness import isolated_user_dirs, pick_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshot.png"))
    ap.add_argument("--size", default="1400x900")
    ap.add_argument("--cap", type=int, default=24,
                    help="expert slots per layer (fewer = more streaming from the SSD)")
    ap.add_argument("--store", help="an already converted store to use instead of the default model")
    ap.add_argument("--budget-gb", type=float, default=0.6,
                    help="RAM budget (GB) so the RAM panel shows a binding budget; 0 = automatic")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--theme", default="light", choices=("system", "light", "dark"),
                    help="colour scheme (Settings › Appearance)")
    ap.add_argument("--prompt", help="the second question (the one captured mid-answer)")
    a = ap.parse_args(argv)
    tmp = isolated_user_dirs("colibri-shot-")

    from PySide6.QtCore import QEventLoop, Qt
    from PySide6.QtWidgets import QApplication

    from colibri_app.main_window import MainWindow
    from colibri_app.resources import apply_theme
    from colibri_app.settings_store import Settings
    from engine import EngineConfig, SamplingParams

    store, kind = pick_model(a.store, tmp)
    prompts = ["What does `json.dumps` do?",
               "Write a function that reverses a list." if kind == "synthetic"
               else "Write a function that returns the number of items in a container."]

    app = QApplication.instance() or QApplication([sys.argv[0]])
    apply_theme(app, a.theme)
    if a.prompt:
        prompts[1] = a.prompt
    settings = Settings(engine=EngineConfig(cap=a.cap, ram_budget_gb=a.budget_gb or None),
                        sampling=SamplingParams(max_new_tokens=160),
                        current_model=store)
    win = MainWindow(settings)
    w, h = (int(v) for v in a.size.split("x"))
    win.resize(w, h)
    win.show()
    app.processEvents()
    win.resize(w, h)   # a narrow size applies once the panels have moved under the chat
    app.processEvents()
    if w >= 900:
        win.splitter.setSizes([230, w - 230])
        win.resizeDocks([win.dock], [470], Qt.Horizontal)
    deadline = time.monotonic() + a.timeout

    def pump(cond, what: str) -> None:
        while not cond():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            app.processEvents(QEventLoop.AllEvents, 50)
            time.sleep(0.01)

    try:
        return _run(a, app, win, prompts, pump)
    finally:
        win.close()   # stops the engine thread even when we give up


def _run(a, app, win, prompts, pump) -> int:
    win.start()
    pump(lambda: win.loaded is not None or win.banner.isVisible() and win.banner.kind == "store", "the model")
    if win.loaded is None:
        raise SystemExit(f"the model did not open: {win.banner.text.text()}")
    print(f"loaded {win.loaded.model_name}: {win.loaded.num_layers} layers x {win.loaded.num_experts} experts, "
          f"cap {win.loaded.cap_per_layer}")
    # one complete answer (rendered Markdown + statistics line), then capture the second mid-stream
    win.send(prompts[0])
    pump(lambda: win.answer is None, "the first answer")
    tokens = []
    win.controller.worker.token.connect(tokens.append)
    win.send(prompts[1])
    p = win.panels
    # capture mid-answer, once the panels hold real data
    pump(lambda: (len(tokens) >= 60 and len(p.hit_ring) >= 5 and p.heat_image is not None) or win.answer is None,
         "streamed tokens and panel data")
    if len(p.hit_ring) < 5 or p.heat_image is None:
        raise SystemExit("the answer ended before the panels had data; try again")
    if win.answer is not None:
        win.answer.flush()
    p.redraw()
    app.processEvents()
    img = win.grab()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not img.save(str(out)):
        raise SystemExit(f"could not write {out}")
    print(f"saved {out} ({img.width()}x{img.height()}); {len(tokens)} tokens streamed, "
          f"{len(p.hit_ring)} metric points, generating={win.answer is not None}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
