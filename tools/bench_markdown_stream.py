#!/usr/bin/env python3
"""Cost of showing a streaming answer as Markdown: per-update time vs answer length.

Streams a long synthetic answer (prose paragraphs and fenced Python code, 16 k characters by default)
into an answer card of the chat's transcript (a ChatView, 700 x 700, so only what is on screen
is painted) a few characters at a time, as the chat's 40 ms flush does, and times each update
plus the event processing (layout, paint) that follows it, on the GUI thread. Two arms,
interleaved update by update in one run:

- ``blocks``: the app (colibri_app.markdown_view): only the block being written re-renders.
- ``whole``: re-rendering the whole answer with ``QTextDocument.setMarkdown`` each update
  (what "Markdown while streaming" costs without blocks).

Reports the median and p95 update time in the first and last tenth of the answer, and the CPU
time (rusage) of each arm. Offscreen:

    QT_QPA_PLATFORM=offscreen python tools/bench_markdown_stream.py [--chars 16000]
Writes bench/results/markdown_stream.json and .md (``--arms blocks --name markdown_stream_blocks``:
the app's arm alone, no other window to lay out).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def answer(chars: int) -> str:
    para = "This paragraph explains one more thing about the *csv* module, with `inline code`. " * 4 + "\n\n"
    code = "```python\n" + "".join(f"value_{i} = compute({i}, 'x')  # step {i}\n" for i in range(30)) + "```\n\n"
    text = ""
    while len(text) < chars:
        text += para * 5 + code
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=16000)
    ap.add_argument("--step", type=int, default=16, help="characters per update (~4 tokens)")
    ap.add_argument("--arms", default="blocks,whole", help="comma-separated: blocks, whole")
    ap.add_argument("--name", default="markdown_stream", help="results file name (without suffix)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import qInstallMessageHandler
    from PySide6.QtWidgets import QApplication
    qInstallMessageHandler(lambda *_a: None)   # offscreen "propagateSizeHints" noise
    app = QApplication.instance() or QApplication([])
    from PySide6.QtWidgets import QScrollArea
    from colibri_app.chat_view import ChatView
    from colibri_app.history import STREAMING, Message
    from colibri_app.markdown_view import MessageText
    from colibri_app.resources import apply_theme
    from engine.bench.common import md_table, write_results
    apply_theme(app, "light")

    text = answer(a.chars)
    chat = ChatView()
    chat.resize(700, 700)
    chat.show()
    card = chat.add_message(Message(1, 1, "assistant", "", STREAMING))
    scroll = QScrollArea()
    scroll.setWidgetResizable(True)
    whole = MessageText()
    scroll.setWidget(whole)
    scroll.resize(700, 700)
    scroll.show()
    arms = [x for x in a.arms.split(",") if x in ("blocks", "whole")]
    if "whole" not in arms:
        scroll.hide()
    times = {"blocks": [], "whole": []}
    cpu = {"blocks": 0.0, "whole": 0.0}
    pos = []
    for i in range(0, len(text), a.step):
        piece = text[i:i + a.step]
        for arm in arms:   # interleaved: the same load for both arms
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            if arm == "blocks":
                card.append_stream(piece)
            else:
                whole.set_markdown(text[:i + a.step])
            app.processEvents()
            times[arm].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[arm] += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        pos.append(i + a.step)
    n = len(pos)
    tenth = max(1, n // 10)
    rows = []
    for arm in arms:
        t = np.array(times[arm]) * 1000
        rows.append({"arm": arm, "updates": n,
                     "first_med": float(np.median(t[:tenth])), "first_p95": float(np.percentile(t[:tenth], 95)),
                     "last_med": float(np.median(t[-tenth:])), "last_p95": float(np.percentile(t[-tenth:], 95)),
                     "growth": float(np.median(t[-tenth:]) / max(1e-9, np.median(t[:tenth]))),
                     "cpu_s": cpu[arm]})
    load = os.getloadavg()[0]
    table = (f"Markdown while streaming: {len(text)} characters in {n} updates of {a.step} characters "
             f"(load average {load:.2f}); update time in ms\n\n"
             + md_table(rows, [("arm", "arm", "s"), ("updates", "updates", "d"),
                               ("first 10% median", "first_med", ".2f"), ("first 10% p95", "first_p95", ".2f"),
                               ("last 10% median", "last_med", ".2f"), ("last 10% p95", "last_p95", ".2f"),
                               ("last/first", "growth", ".1f"), ("CPU s", "cpu_s", ".2f")]))
    write_results(a.name, {"chars": len(text), "step": a.step, "load_avg": load, "rows": rows,
                                      "blocks_rendered_chars": card.text.rendered_chars}, table, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
