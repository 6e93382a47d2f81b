#!/usr/bin/env python3
"""Render the main window offscreen during a real generation and save docs/screenshot.png
(the first answer complete, its "Documentation looked up" section open; the second mid-stream).

Uses the bundled default model (engine.library.default_store()); if it is not there yet (it is trained
by tools/train_default_model.py), a synthetic random OLMoE is used instead and the script says
so. History, settings and the converted model live in a temporary folder, so the user's own
data is never touched.

    QT_QPA_PLATFORM=offscreen python tools/screenshot.py [--out docs/screenshot.png] [--theme dark]
        [--size 780x900] [--prompt "How do I read a CSV file?"] [--first-start]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from app_harness import check_store_arg, isolated_user_dirs, number, pick_model  # noqa: E402


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")  # formats Qt's QImage.save always writes
MAX_SIDE = 8000


def _size(text: str) -> tuple[int, int]:
    """``--size WxH`` -> (W, H) in pixels; ArgumentTypeError naming the value otherwise."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give WIDTHxHEIGHT in pixels, e.g. 1400x900") from None
    if not (1 <= w <= MAX_SIDE and 1 <= h <= MAX_SIDE):
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be 1 to {MAX_SIDE} pixels")
    return w, h


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything starts: a bad value ends with one
    ``screenshot.py: error: ...`` line naming the option and what to give (exit code 2), never a
    traceback and never a silent fallback (a --store that is not a healthy store, an --out that
    cannot be written or is not an image name, an empty --prompt are refused)."""
    ap = argparse.ArgumentParser(prog="screenshot.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshot.png"),
                    help=f"image file to write ({', '.join(IMAGE_SUFFIXES)})")
    ap.add_argument("--size", default="1400x900", type=_size, help="window size WIDTHxHEIGHT (pixels)")
    ap.add_argument("--cap", type=number(int, 1, "a whole number of expert slots per layer, 1 or more"),
                    default=24, help="expert slots per layer (fewer = more streaming from the SSD)")
    ap.add_argument("--store", help="an already converted store to use instead of the default model")
    ap.add_argument("--budget-gb", type=number(float, 0.1, "a RAM budget in GB, at least 0.1 (0 = automatic)",
                                               zero_ok=True), default=0.6,
                    help="RAM budget (GB) so the RAM panel shows a binding budget; 0 = automatic")
    ap.add_argument("--timeout", type=number(float, 1.0, "a timeout in seconds, at least 1"), default=300.0)
    ap.add_argument("--theme", default="light", choices=("system", "light", "dark"),
                    help="colour scheme (Settings › Appearance)")
    ap.add_argument("--prompt", help="the second question (the one captured mid-answer)")
    ap.add_argument("--first-start", action="store_true",
                    help="capture the empty chat once the model is ready (what a first start shows), no answers")
    a = ap.parse_args(argv)
    out = Path(a.out).expanduser()
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        ap.error(f"--out {a.out}: give an image file name ending in {', '.join(IMAGE_SUFFIXES)}")
    if out.is_dir():
        ap.error(f"--out {a.out}: is a folder; give a file name, e.g. {out / 'screenshot.png'}")
    from engine.library import folder_problem
    why = folder_problem(out.parent, None, "the screenshot")
    if why:
        ap.error(f"--out {a.out}: {why}")
    if a.prompt is not None and not a.prompt.strip():
        ap.error("--prompt is empty: give the question to capture, or leave --prompt out for the default one")
    check_store_arg(ap, a.store)
    a.out = str(out)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
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
    w, h = a.size
    low = win.minimumSizeHint().expandedTo(win.minimumSize())
    if w < low.width() or h < low.height():
        win.close()
        print(f"screenshot.py: error: --size {w}x{h}: the window cannot be smaller than "
              f"{low.width()}x{low.height()} (its minimum size); give at least that", file=sys.stderr)
        return 2
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
    if a.first_start:
        app.processEvents()
        return _save(a, win.grab())
    # one complete answer (rendered Markdown + statistics line), then capture the second mid-stream
    win.send(prompts[0])
    pump(lambda: win.answer is None, "the first answer")
    first = [m for m in win.history.messages(win.conv_id) if m.role == "assistant"][-1]
    v = win.chat.view(first.id)
    if v is not None and v.docs_btn.isVisible():  # show the documentation the first answer was given
        v.docs_btn.setChecked(True)
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
    _save(a, img)
    print(f"{len(tokens)} tokens streamed, {len(p.hit_ring)} metric points, generating={win.answer is not None}")
    return 0


def _save(a, img) -> int:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not img.save(str(out)):
        raise SystemExit(f"screenshot.py: error: could not write {out} (check the folder's permissions and "
                         f"free space)")
    print(f"saved {out} ({img.width()}x{img.height()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
