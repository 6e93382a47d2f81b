"""Fixtures for the GUI tests: a tiny real model, private data/config dirs, a main window."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session")
def app_store(tmp_path_factory):
    """A converted int8 store of a tiny random OLMoE (2 layers, 8 experts, top-2)."""
    from engine import convert_checkpoint
    from engine.bench import synthetic
    root = tmp_path_factory.mktemp("tiny-model")
    ck = synthetic.write_checkpoint(root / "ck", synthetic.olmoe_config(), seed=0)
    store = str(convert_checkpoint(ck, root / "store", quant="int8"))
    # Compile (or load from numba's cache) the kernels once, here, with no deadline: a fresh
    # clone compiles them for minutes on a loaded machine, and the windows' load waits below
    # are for the app, not for the compiler.
    from engine import Engine, EngineConfig
    Engine.open(EngineConfig(store=store, cap=4, pinning=False, history=False)).close()
    return store


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny):
    """A fake hub (tests/hubserver.py) serving the tiny checkpoint as hubserver.TINY_REPO, with
    the user folders and the hub endpoint of this test."""
    import hubserver
    h = hubserver.FakeHub()
    url = h.start()
    hubserver.hub_env(monkeypatch, tmp_path, url)
    h.add_folder(hubserver.TINY_REPO, tiny)
    yield h
    h.stop()


@pytest.fixture
def wizard(fake, wizard_dialog):
    """The model wizard over the fake hub."""
    return wizard_dialog


@pytest.fixture
def app_dirs(tmp_path, monkeypatch):
    """Private user data / config directories (engine.library.paths honours these variables)."""
    data, cfg = tmp_path / "data", tmp_path / "config"
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(data))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(cfg))
    return data, cfg


@pytest.fixture
def make_window(qtbot, app_dirs, app_store):
    """Factory: a MainWindow on the tiny model (loaded), closed at teardown."""
    from dataclasses import replace

    from engine import EngineConfig, SamplingParams
    from colibri_app.main_window import MainWindow
    from colibri_app.settings_store import Settings

    windows = []

    def make(max_new_tokens=12, engine=None, store=None, wait_loaded=True, **kw):
        # cap 4 of 8 experts: the cache really evicts and streams. pinning=False: the engine's
        # pinning path can stall acquire() at cap 4 (reported to the engine owner)
        settings = Settings(engine=engine or EngineConfig(cap=4, pinning=False),
                            sampling=SamplingParams(max_new_tokens=max_new_tokens), current_model=store or app_store)
        settings = replace(settings, **kw)
        win = MainWindow(settings)
        qtbot.addWidget(win)
        windows.append(win)
        win.show()
        if wait_loaded:
            win.start()
            qtbot.waitUntil(lambda: bool(win.loaded is not None), timeout=1_800_000)  # only a hang: a cold compile at load ~20 took > 120 s
        return win

    yield make
    for w in windows:
        w.close()


@pytest.fixture
def wizard_dialog(qtbot):
    """A shown ModelWizard (context 256); rejected and its worker lanes shut down at teardown.
    List the fixtures that set up data dirs / a fake hub before this one."""
    from colibri_app import workers
    from colibri_app import wizard as wz
    w = wz.ModelWizard(None, context_length=256)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.reject()
    assert workers.shutdown_all(30)
