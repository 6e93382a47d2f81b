"""A kill -9 of the app mid-answer: the text the window showed is in the history after the
restart, marked interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from colibri_app.history import INTERRUPTED, History

# The app in a process of its own: it opens the tiny model, sends a question and, once the
# answer's first text is on screen, prints it and stops its GUI thread (the engine goes on
# streaming), so that the test kills it at a known point. The checkpoint interval is set far
# beyond the test: what is saved is saved because it was shown.
_APP = r"""
import json, os, sys, time
from PySide6.QtWidgets import QApplication
from PySide6.QtCore import QTimer, Qt
from engine import EngineConfig, SamplingParams
from colibri_app import answer
answer.SAVE_EVERY_S = 1e9
from colibri_app.main_window import MainWindow
from colibri_app.settings_store import Settings

app = QApplication([])
flush = answer.AnswerStream.flush
def shown_then_hang(self):
    flush(self)
    if self.text:
        print("SHOWN " + json.dumps(self.text), flush=True)
        while True:
            time.sleep(60)
answer.AnswerStream.flush = shown_then_hang
win = MainWindow(Settings(engine=EngineConfig(cap=4, pinning=False),
                          sampling=SamplingParams(max_new_tokens=1500), current_model=sys.argv[1]))
win.show()
win.controller.worker.loaded.connect(lambda *a: QTimer.singleShot(0, lambda: win.send("tell me a long story")),
                                     Qt.QueuedConnection)
win.start()
app.exec()
"""


def test_the_text_shown_before_a_kill_is_in_the_history(app_dirs, app_store):
    data, _cfg = app_dirs
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.Popen([sys.executable, "-c", _APP, app_store], stdout=subprocess.PIPE, text=True, env=env)
    try:
        shown = None
        for line in proc.stdout:        # ends only when the app does
            if line.startswith("SHOWN "):
                shown = json.loads(line[6:])
                break
        assert shown, f"the app ended (exit code {proc.poll()}) before showing an answer"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(600) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    h, msg = History.open(data / "history.sqlite3")
    try:
        assert msg is None
        [conv] = h.conversations()
        question, ans = h.messages(conv.id)
        assert question.content == "tell me a long story"
        assert ans.status == INTERRUPTED and ans.content.startswith(shown) and shown
    finally:
        h.close()
