""""Serve on this computer": the window serves its open model to the official openai client, the
chat and the server sharing the one engine; the status bar shows the URL and the request count."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

from colibri_app.history import COMPLETE  # noqa: E402
from colibri_app.serve import ServeDialog  # noqa: E402


def _in_background(fn):
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_serve_toggle_start_request_count_stop(qtbot, make_window):
    win = make_window(max_new_tokens=6)
    assert not win.st_server.isVisible() and not win.act_serve.isChecked()
    assert win.start_serving(0)            # a free port on 127.0.0.1
    url = win.serve.server.url
    assert url.startswith("http://127.0.0.1:") and win.act_serve.isChecked()
    assert win.st_server.isVisible() and url in win.st_server.text() and "0 requests" in win.st_server.text()
    model = win.loaded.model_name
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    t, box = _in_background(lambda: client.completions.create(model=model, prompt="hello", max_tokens=5))
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=1_800_000)   # the GUI thread keeps running meanwhile
    assert "error" not in box, box.get("error")
    r = box["result"]
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    qtbot.waitUntil(lambda: "1 request" in win.st_server.text(), timeout=1_800_000)
    assert [m.id for m in client.models.list().data] == [model]
    # what a request leaves out follows the app's sampling settings
    win.apply_settings(replace(win.settings, sampling=replace(win.settings.sampling, max_new_tokens=2)), False)
    t, box = _in_background(lambda: client.completions.create(model=model, prompt="hello"))
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=1_800_000)
    assert box["result"].usage.completion_tokens == 2
    win.stop_serving()
    assert not win.act_serve.isChecked() and not win.st_server.isVisible() and win.serve.server is None
    with pytest.raises(httpx2.TransportError):
        httpx2.get(url.removesuffix("/v1") + "/health", timeout=5)


def test_chat_and_server_share_the_engine(qtbot, make_window):
    win = make_window(max_new_tokens=8)
    assert win.start_serving(0)
    client = openai.OpenAI(base_url=win.serve.server.url, api_key="x", max_retries=0, timeout=600)
    # the client runs off the GUI thread (as another program would): the server's requests reach
    # the engine lane through the GUI thread's event loop
    t, box = _in_background(lambda: "".join(
        ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model=win.loaded.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
        if ch.choices))
    win.chat.input.setPlainText("a question in the window")
    qtbot.keyClick(win.chat.input, Qt.Key_Return)
    conv = win.conv_id
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=1_800_000)
    assert "error" not in box, box.get("error")
    text = box["result"]
    qtbot.waitUntil(lambda: win.answer is None, timeout=1_800_000)
    msgs = win.history.messages(conv)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].status == COMPLETE and msgs[1].content
    assert isinstance(text, str) and text
    win.stop_serving()


def test_serve_dialog_and_refusals(qtbot, make_window):
    win = make_window()
    dlg = ServeDialog(8123, "", parent=win)
    qtbot.addWidget(dlg)
    dlg.key.setText("  abc  ")
    assert dlg.values() == (8123, "abc", ())
    assert not win.start_serving(0, "short")   # a key under 8 characters is refused, with a banner
    assert win.banner.isVisible() and "API key" in win.banner.text.text()
    assert "--" not in win.banner.text.text()  # the dialog's words, not the command line's
    assert win.banner.title.text() == "The server could not start"
    assert not win.act_serve.isChecked() and win.serve.server is None
    assert win.start_serving(0, "long-enough-key")
    url = win.serve.server.url
    assert httpx2.get(url + "/models", timeout=600).status_code == 401
    assert httpx2.get(url + "/models", headers={"Authorization": "Bearer long-enough-key"},
                      timeout=600).status_code == 200
    port = win.serve.server.port
    other = make_window()
    assert not other.start_serving(port)       # the port is taken: a banner, no crash
    # the port is in use: said so, not "A setting is invalid ... (--port)"
    assert f"Port {port} on this computer is already in use" in other.banner.text.text()
    assert other.banner.title.text() == "The server could not start" and "--" not in other.banner.text.text()
    win.close()                                # closing the window stops the server
    with pytest.raises(httpx2.TransportError):
        httpx2.get(url.removesuffix("/v1") + "/health", timeout=5)


def test_serve_dialog_shows_the_url_origins_and_copies_client_settings(qtbot, make_window):
    from PySide6.QtGui import QGuiApplication
    win = make_window()
    dlg = ServeDialog(8123, "long-enough-key", ("http://localhost:3000",), win)
    qtbot.addWidget(dlg)
    assert dlg.url.text() == "http://127.0.0.1:8123/v1"
    dlg.port.setValue(8200)
    assert dlg.url.text() == "http://127.0.0.1:8200/v1"
    dlg.copy_openai.click()
    text = QGuiApplication.clipboard().text()
    assert "OPENAI_BASE_URL=http://127.0.0.1:8200/v1" in text and "long-enough-key" in text
    dlg.copy_anthropic.click()
    text = QGuiApplication.clipboard().text()
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8200\n" in text and "anthropic.Anthropic(" in text
    assert dlg.values() == (8200, "long-enough-key", ("http://localhost:3000",))
    dlg.origins.setText("http://localhost:3000, *")          # a wildcard is refused, the dialog stays
    dlg._accept()
    assert not dlg.error.isHidden() and "every web page" in dlg.error.text() and dlg.result() == 0
    # the origins reach the server: that page may call it, another is refused
    page = "http://localhost:3000"
    assert win.start_serving(0, "", (page,))
    url = win.serve.server.url
    body = {"model": win.loaded.model_name, "prompt": "hi", "max_tokens": 1}
    r = httpx2.post(url + "/completions", json=body, headers={"Origin": "http://evil.example"}, timeout=600)
    assert r.status_code == 403
    pre = httpx2.options(url + "/completions", headers={"Origin": page, "Access-Control-Request-Method": "POST"},
                         timeout=600)
    assert pre.headers.get("access-control-allow-origin") == page
    win.stop_serving()


def test_the_model_being_opened_is_listed_while_it_loads(qtbot, make_window, app_store):
    """While the window (re)opens a model, /v1/models already lists the id it will answer to (a
    client that discovers the model first finds it); its requests get 503 with Retry-After until
    the model is open, then the same id answers."""
    win = make_window(max_new_tokens=2)
    assert win.start_serving(0)
    client = openai.OpenAI(base_url=win.serve.server.url, api_key="x", max_retries=0, timeout=600)
    model = win.loaded.model_name
    win.open_model(str(app_store))   # the GUI thread answers no load event before the request below
    assert win.serve.server.api.served() is None
    assert [m.id for m in client.models.list().data] == [model]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="hello")
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "2"
    qtbot.waitUntil(lambda: win.loaded is not None and win.serve.server.api.served() is not None, timeout=1_800_000)
    assert [m.id for m in client.models.list().data] == [model]
