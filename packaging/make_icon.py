"""Render resources/icons/colibri-desktop.svg to the PNG sizes the bundles use (Qt's SVG
renderer, offscreen). Run after editing the SVG: ``python packaging/make_icon.py``; the PNGs
are committed, so a build never needs this."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ICONS = Path(__file__).resolve().parent.parent / "resources" / "icons"
SIZES = (256, 48)


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 - needed by QPainter
    svg = ICONS / "colibri-desktop.svg"
    r = QSvgRenderer(str(svg))
    if not r.isValid():
        print(f"{svg}: not a valid SVG", file=sys.stderr)
        return 1
    for n in SIZES:
        img = QImage(n, n, QImage.Format.Format_ARGB32)
        img.fill(Qt.GlobalColor.transparent)
        p = QPainter(img)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r.render(p)
        p.end()
        out = ICONS / ("colibri-desktop.png" if n == 256 else f"colibri-desktop-{n}.png")
        if not img.save(str(out), "PNG"):
            print(f"{out}: could not be written", file=sys.stderr)
            return 1
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
