"""PySide6 6.12 on Python 3.11 drops references to None/True; colibri_app guards against it."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import os
os.environ["QT_QPA_PLATFORM"] = "offscreen"
import colibri_app
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QApplication, QLabel
app = QApplication([])
class S(QObject):
    sig = Signal(object)
s, label = S(), QLabel()
for i in range(200_000):      # without the guard: "Fatal Python error: none_dealloc" long before this
    label.setText("x")
    s.sig.emit(i)
print("ok")
"""


def test_many_void_calls_and_emits_do_not_abort():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
