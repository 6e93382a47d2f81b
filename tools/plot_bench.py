#!/usr/bin/env python3
"""Render benchmark JSON (bench/results/*.json) to PNG plots with pyqtgraph, offscreen.

    python tools/plot_bench.py bench/results/replay_default.json   # hit rate vs cap (+ Belady)
    python tools/plot_bench.py bench/results/cache_1b.json         # streaming at several caps
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pyqtgraph as pg  # noqa: E402
import pyqtgraph.exporters  # noqa: E402,F401
from PySide6.QtWidgets import QApplication  # noqa: E402

COLORS = {"lru": "#1f77b4", "lfru": "#ff7f0e", "ema": "#9467bd", "ours": "#2ca02c", "belady": "#d62728"}


def _plot(title, xlabel, ylabel):
    w = pg.PlotWidget(background="w")
    w.resize(900, 560)
    w.setTitle(title, color="k", size="13pt")
    w.setLabel("bottom", xlabel, color="k")
    w.setLabel("left", ylabel, color="k")
    w.showGrid(x=True, y=True, alpha=0.25)
    w.addLegend(offset=(-10, -40), labelTextColor="k", brush=pg.mkBrush(255, 255, 255, 220))
    return w


def plot_replay(d, out):
    rows = d["rows"]
    caps = [r["cap"] for r in rows]
    w = _plot(f"Expert hit rate vs cache cap ({d['num_experts']} experts/layer, top-{d['top_k']})",
              "cap (expert slots per layer)", "hit rate (%)")
    names = {"lru": "LRU", "lfru": "LFRU", "ema": "EMA (router probability)",
             "ours": f"ours ({d.get('policy', 'lru')} + pinning)", "belady": "Belady (optimal)"}
    for k, label in names.items():
        if k not in rows[0]:
            continue
        style = dict(width=3, style=pg.QtCore.Qt.PenStyle.DashLine) if k == "belady" else dict(width=2)
        w.plot(caps, [100 * r[k] for r in rows], pen=pg.mkPen(COLORS[k], **style), name=label,
               symbol="o", symbolSize=5, symbolBrush=COLORS[k])
    w.setYRange(0, 100)
    return w


def plot_cache(d, out):
    rows = d["rows"]
    caps = [r["cap"] for r in rows]
    w = _plot("Streaming from the SSD (cold, O_DIRECT)", "cap (expert slots per layer)", "value")
    w.plot(caps, [100 * r["hit_rate"] for r in rows], pen=pg.mkPen(COLORS["ours"], width=2), name="hit rate (%)", symbol="o")
    w.plot(caps, [r["mb_per_token"] for r in rows], pen=pg.mkPen(COLORS["lru"], width=2), name="SSD MB/token", symbol="s")
    w.plot(caps, [10 * r["tok_per_s"] for r in rows], pen=pg.mkPen(COLORS["belady"], width=2), name="tok/s x 10", symbol="t")
    return w


def main(argv):
    app = QApplication.instance() or QApplication([])
    for p in argv:
        d = json.loads(Path(p).read_text())
        rows = d.get("rows", [])
        w = plot_replay(d, p) if rows and "belady" in rows[0] else plot_cache(d, p)
        w.show()
        app.processEvents()
        out = Path(p).with_suffix(".png")
        pg.exporters.ImageExporter(w.plotItem).export(str(out))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
