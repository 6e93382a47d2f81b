"""Render a command's terminal output as a PNG for the docs (a terminal-like picture: the
prompt line, then stdout and stderr as printed, wrapped at --columns).

    QT_QPA_PLATFORM=offscreen python tools/terminal_capture.py --out docs/missing-libraries.png \
        --title '$ colibri' --text-file captured.txt
    QT_QPA_PLATFORM=offscreen python tools/terminal_capture.py --out x.png -- colibri --version

With a command after ``--`` it is run (its environment as given) and its output captured; the
exit code is added as the last line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap


def render(lines: list[str], out: str, columns: int = 100) -> None:
    """Draw ``lines`` (wrapped at ``columns``) in a monospace font on a dark background; saves ``out``."""
    from PySide6.QtGui import QColor, QFont, QFontMetrics, QGuiApplication, QImage, QPainter
    app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841 - fonts need it
    font = QFont("DejaVu Sans Mono")
    font.setStyleHint(QFont.Monospace)
    font.setPixelSize(14)
    fm = QFontMetrics(font)
    wrapped = []
    for ln in lines:
        wrapped += textwrap.wrap(ln, columns, replace_whitespace=False, drop_whitespace=False) or [""]
    pad = 16
    w = fm.horizontalAdvance("M" * columns) + 2 * pad
    h = fm.lineSpacing() * len(wrapped) + 2 * pad
    img = QImage(w, h, QImage.Format_RGB32)
    img.fill(QColor("#1e1f22"))
    p = QPainter(img)
    p.setFont(font)
    y = pad + fm.ascent()
    for ln in wrapped:
        p.setPen(QColor("#8fd18f") if ln.startswith("$ ") else QColor("#e6e6e6"))
        p.drawText(pad, y, ln)
        y += fm.lineSpacing()
    p.end()
    if not img.save(out):
        raise SystemExit(f"cannot write {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="", help="the prompt line shown first, e.g. '$ colibri'")
    ap.add_argument("--text-file", default="", help="captured output to draw (instead of running a command)")
    ap.add_argument("--columns", type=int, default=100)
    ap.add_argument("cmd", nargs="*")
    a = ap.parse_args(argv)
    lines = [a.title] if a.title else []
    if a.text_file:
        with open(a.text_file, encoding="utf-8") as f:
            lines += f.read().rstrip("\n").splitlines()
    elif a.cmd:
        p = subprocess.run(a.cmd, capture_output=True, text=True, env=dict(os.environ))
        lines += (p.stdout + p.stderr).rstrip("\n").splitlines() + [f"$ echo $?", str(p.returncode)]
    render(lines, a.out, a.columns)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
