"""Closing the app while a wizard task (download, conversion) runs must end the
process cleanly (exit code 0), not abort it (SIGABRT, -6) in a running thread's destructor.

Each case runs the real app objects in a child process (an abort would kill the test runner),
on the local fake hub, and closes the window mid-task the way a user does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent

SCRIPT = textwrap.dedent(r'''
    import os, sys, threading, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import hubserver
    mode, tmp = sys.argv[1], Path(sys.argv[2])
    hub_server = hubserver.FakeHub()
    url = hub_server.start()
    os.environ.update(HF_ENDPOINT=url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
                      HF_HUB_ETAG_TIMEOUT="5", HF_HOME=str(tmp / "hf_home"),
                      COLIBRI_DATA_DIR=str(tmp / "data"), COLIBRI_CONFIG_DIR=str(tmp / "config"),
                      QT_QPA_PLATFORM="offscreen")
    ck = hubserver.tiny_checkpoint(tmp / "ck")
    hub_server.add_folder("allenai/tiny-olmoe", ck)
    hub_server.slow["model.safetensors"] = (1000, 0.05)        # a download that takes minutes

    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    from engine import EngineConfig, SamplingParams
    from engine import library as hub
    app = QApplication([])
    started = threading.Event()
    real_convert = hub.convert_downloaded

    def slow_convert(src, quant, progress, cancel, **kw):       # a conversion that takes minutes
        def p(ev):
            started.set()
            time.sleep(0.5)       # not watching the cancel flag: stops only at the next tensor
            progress(ev)
        return real_convert(src, quant, p, cancel, **kw)
    hub.convert_downloaded = slow_convert

    from colibri_app import wizard as wz
    win = None
    if mode.startswith("window"):
        from colibri_app.main_window import MainWindow
        from colibri_app.settings_store import Settings
        win = MainWindow(Settings(engine=EngineConfig(), sampling=SamplingParams(), current_model=""))
        win.show()
        win.open_wizard()
        w = win._dialogs[-1]
        if w.currentId() == wz.PAGE_RECOMMENDED:  # Next without choosing: any repository or folder
            w.next()
    else:
        w = wz.ModelWizard(None, context_length=256)
        w.show()
    if mode.endswith("convert"):
        w.source_page.local_radio.setChecked(True)
        w.source_page.folder_edit.setText(str(ck))
    else:
        w.source_page.repo_edit.setText("allenai/tiny-olmoe")
    w.next()
    t0 = time.monotonic()

    def close():
        print("closing", flush=True)
        if win is not None:
            win.close()
        else:
            w.close()
        app.quit()

    def poll():
        if time.monotonic() - t0 > 600:  # only a hang trips it
            print("timeout waiting for the task", flush=True)
            os._exit(3)
        if w.currentId() == wz.PAGE_CHECK and w.check is not None:
            w.next()
        elif w.currentId() == wz.PAGE_DOWNLOAD and w.download_page.bar.value() > 0:
            return close()
        elif w.currentId() == wz.PAGE_CONVERT:
            if w.convert_page.task is None:
                w.convert_page.convert_button.click()
            elif started.is_set():
                return close()
        QTimer.singleShot(20, poll)
    QTimer.singleShot(0, poll)
    app.exec()
    print("event loop ended", flush=True)
''').format(tests=str(TESTS))


@pytest.mark.parametrize("mode", ["wizard-download", "window-download", "window-convert"])
def test_closing_during_a_wizard_task_exits_cleanly(tmp_path, mode):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=str(ROOT))
    out = r.stdout + r.stderr[-3000:]
    assert "closing" in r.stdout, out
    assert r.returncode == 0, f"exit code {r.returncode} (-6 = SIGABRT)\n{out}"
    assert "event loop ended" in r.stdout, out
    if mode.endswith("convert"):
        # the cancelled conversion published nothing and left no half-written store behind
        models = tmp_path / "data" / "models"
        assert not models.exists() or not [p for p in models.iterdir()], sorted(models.iterdir())
