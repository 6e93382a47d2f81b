""""Serve on this computer": the OpenAI-compatible server (engine.server) over the model the
window has open.

The chat and the server share the one engine: a server request waits in the server's FIFO
queue, then runs as a task of the app's engine lane (colibri_app/engine_bridge.py), in order
with the chat's answers, on the same thread. :class:`ServeController` owns the server and its
status; :class:`ServeDialog` asks for the port, the optional API key and the web pages allowed
to use it, and copies the client settings. The server listens on 127.0.0.1 only (this computer). A request reaches the lane through the GUI thread's event loop
(the lane is driven from there), so a client must not block that thread: clients are other
programs, or, in tests, other threads.
"""

from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPushButton,
                               QVBoxLayout, QWidget)

from engine.server import (DEFAULT_PORT, LocalServer, NoModel, PendingModel, ServedModel, ServerOptions,
                           check_origin_syntax)

from .numbers import WholeBox

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STATUS_INTERVAL_MS = 1000


class ServeController(QObject):
    """The app's local server.

    Args:
        controller: the window's EngineController (its lane runs the server's generations,
            its worker holds the open Engine).

    Signals: ``status_changed(str)`` (the status bar text, "" when not serving),
    ``failed(str)`` (the server could not start).
    """

    status_changed = Signal(str)
    failed = Signal(str)
    _post = Signal(object)   # (fn, job, done, box) from the server's queue thread to the GUI thread

    def __init__(self, controller, parent: QObject | None = None):
        super().__init__(parent)
        self.controller = controller
        self.server: LocalServer | None = None
        self._served: ServedModel | None = None
        self._loading: PendingModel | None = None   # the model being opened, listed while it loads
        self._post.connect(self._submit)   # queued: emitted on the server's thread
        self.timer = QTimer(self)
        self.timer.setInterval(STATUS_INTERVAL_MS)
        self.timer.timeout.connect(self.refresh)

    # --- the model being served (GUI thread) --------------------------------------------------

    def model_loaded(self) -> None:
        """The window opened a model: serve it."""
        eng = self.controller.worker.engine
        self._served = ServedModel.from_engine(eng) if eng is not None else None
        self._loading = None
        self.refresh()

    def model_closed(self, store: str | None = None) -> None:
        """The window is (re)opening a model (the store folder ``store`` when known): /v1/models
        lists it, requests get 503 until it is ready."""
        self._served = None
        self._loading = PendingModel.from_store(store) if store else None
        self.refresh()

    # --- start / stop -------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self.server is not None

    def start(self, port: int = DEFAULT_PORT, api_key: str = "", defaults=None,
              origins: tuple[str, ...] = ()) -> str:
        """Listen on 127.0.0.1:``port`` (0 = a free port), web pages of ``origins`` allowed
        (CORS); returns the URL.

        Raises:
            ConfigError: a bad port, key or origin; OSError: the port is in use.
        """
        self.stop()
        srv = LocalServer(lambda: self._served, self._run,
                          ServerOptions(host=HOST, port=port, api_key=api_key, cors_origins=tuple(origins)), defaults,
                          loading=lambda: self._loading)
        srv.start()
        self.server = srv
        self.timer.start()
        self.refresh()
        return srv.url

    def set_defaults(self, sampling) -> None:
        """The SamplingParams used for what a request leaves out (the app's sampling settings)."""
        if self.server is not None:
            self.server.api.defaults = sampling

    def stop(self) -> None:
        """Stop serving (running and waiting requests are cancelled). Idempotent."""
        srv, self.server = self.server, None
        self.timer.stop()
        if srv is not None:
            srv.stop()
        self.status_changed.emit("")

    def status_text(self) -> str:
        """"Serving http://127.0.0.1:8000/v1 · 3 requests" (or "" when not serving)."""
        if self.server is None:
            return ""
        n = self.server.stats.request_count("/v1/")
        waiting = self.server.queue.depth
        text = f"Serving {self.server.url} · {n} request{'s' if n != 1 else ''}"
        if waiting:
            text += f" · {waiting} waiting"
        if self._served is None:
            text += " · no model open"
        return text

    @Slot()
    def refresh(self) -> None:
        self.status_changed.emit(self.status_text())

    # --- running jobs on the app's engine lane ------------------------------------------------

    def _run(self, fn, job) -> None:
        """The server's runner (its queue thread): run ``fn(engine)`` as a task of the engine
        lane and wait for it. Raises NoModel when no model (or another model) is open."""
        done = threading.Event()
        box: dict = {}
        self._post.emit((fn, job, done, box))
        while not done.wait(0.25):
            if self.server is None and job.cancel.is_set():   # stopping: the lane may be gone too
                return
        if "error" in box:
            raise box["error"]

    @Slot(object)
    def _submit(self, item) -> None:
        fn, job, done, box = item
        worker = self.controller.worker
        if job.cancel.is_set():   # its client left (or the server stopped) before it got here
            done.set()
            return

        def task(ctx) -> None:
            try:
                eng = worker.engine
                if eng is None or eng is not job.model_key:
                    raise NoModel("the model changed while the request waited; send it again")
                fn(eng)
            except BaseException as e:  # noqa: BLE001 - handed to the server's queue thread
                box["error"] = e
            finally:
                done.set()

        try:
            self.controller.lane.submit(task, "server-generate", cancel=job.cancel, skip_if_cancelled=False)
        except RuntimeError as e:   # the lane is shut down (the window is closing)
            box["error"] = NoModel(str(e))
            done.set()


def client_settings(base_url: str, api_key: str, kind: str) -> str:
    """What a client needs to use the server, to paste: environment variables and a few lines of
    Python for the official ``openai`` (kind "openai") or ``anthropic`` (kind "anthropic")
    package. ``base_url``: the server's ``http://HOST:PORT/v1``; ``api_key``: "" when none is
    required (clients still send one: any text works)."""
    key = api_key or "unused"
    if kind == "anthropic":
        root = base_url.removesuffix("/v1")
        return (f"ANTHROPIC_BASE_URL={root}\nANTHROPIC_API_KEY={key}\n\n"
                f"import anthropic\n"
                f"client = anthropic.Anthropic(base_url=\"{root}\", api_key=\"{key}\")\n")
    return (f"OPENAI_BASE_URL={base_url}\nOPENAI_API_KEY={key}\n\n"
            f"from openai import OpenAI\n"
            f"client = OpenAI(base_url=\"{base_url}\", api_key=\"{key}\")\n")


class ServeDialog(QDialog):
    """"Serve on this computer": the port, the optional API key and the web pages (origins)
    allowed to use the server; shows the base URL and copies the client settings for OpenAI and
    Anthropic clients. ``values() -> (port, api key, origins)``; an origin that is not
    ``scheme://host[:port]`` keeps the dialog open with the reason."""

    def __init__(self, port: int = DEFAULT_PORT, api_key: str = "", origins: tuple[str, ...] = (),
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Serve on this computer")
        self.setMinimumWidth(480)
        lay = QVBoxLayout(self)
        info = QLabel("Other programs on this computer (editors, agents, scripts) can use the open model through "
                      "an OpenAI-compatible API and Anthropic's Messages API. The chat and the server take turns "
                      "on the one engine. Web pages cannot use it unless you allow their origin below.")
        info.setWordWrap(True)
        lay.addWidget(info)
        form = QFormLayout()
        self.port = WholeBox()       # "8.000" is refused with a reason, not read as 8 or 8000
        self.port.setRange(1024, 65535)
        self.port.setValue(port if 1024 <= port <= 65535 else DEFAULT_PORT)
        self.port.setAccessibleName("Server port")
        form.addRow("Port", self.port)
        self.url = QLabel()
        self.url.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.url.setAccessibleName("Base URL")
        form.addRow("Base URL", self.url)
        self.key = QLineEdit(api_key)
        self.key.setEchoMode(QLineEdit.PasswordEchoOnEdit)
        self.key.setPlaceholderText("optional; at least 8 characters")
        self.key.setAccessibleName("API key")
        self.key.setToolTip("Clients must send 'Authorization: Bearer <key>' (or 'x-api-key: <key>'). "
                            "Leave empty for none.")
        form.addRow("API key", self.key)
        self.origins = QLineEdit(" ".join(origins))
        self.origins.setPlaceholderText("none (e.g. http://localhost:3000)")
        self.origins.setAccessibleName("Allowed web page origins")
        self.origins.setToolTip("Web pages from these origins (scheme://host:port, separated by spaces) may use "
                                "the server from a browser. Pages from anywhere else are refused, so a site "
                                "you visit cannot use the model.")
        form.addRow("Allowed web pages", self.origins)
        lay.addLayout(form)
        copy_row = QHBoxLayout()
        self.copy_openai = QPushButton("Copy settings for OpenAI clients")
        self.copy_anthropic = QPushButton("Copy settings for Anthropic clients")
        self.copy_openai.clicked.connect(lambda: self._copy("openai"))
        self.copy_anthropic.clicked.connect(lambda: self._copy("anthropic"))
        copy_row.addWidget(self.copy_openai)
        copy_row.addWidget(self.copy_anthropic)
        lay.addLayout(copy_row)
        self.error = QLabel()
        self.error.setObjectName("bannerText")
        self.error.setWordWrap(True)
        self.error.hide()
        lay.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.button(QDialogButtonBox.Ok).setText("Start serving")
        buttons.accepted.connect(self._accept)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.port.valueChanged.connect(self._update_url)
        self._update_url()
        self._ok = buttons.button(QDialogButtonBox.Ok)
        self.port.problem_changed.connect(self._port_problem)

    def _port_problem(self, why: str) -> None:
        self.error.setText(f"Port: {why}" if why else "")
        self.error.setVisible(bool(why))
        self._ok.setEnabled(not why)

    def accept(self) -> None:
        if self.port.problem:  # Enter in the port field with unreadable text
            return
        super().accept()

    def base_url(self) -> str:
        return f"http://{HOST}:{self.port.value()}/v1"

    def _update_url(self) -> None:
        self.url.setText(self.base_url())

    def _copy(self, kind: str) -> None:
        QGuiApplication.clipboard().setText(client_settings(self.base_url(), self.key.text().strip(), kind))

    def origin_list(self) -> tuple[str, ...]:
        """The allowed origins as written (split on spaces and commas). Raises ValueError."""
        out = []
        for o in self.origins.text().replace(",", " ").split():
            out.append(check_origin_syntax(o))
        return tuple(out)

    def _accept(self) -> None:
        try:
            self.origin_list()
        except ValueError as e:
            self.error.setText(f"Allowed web pages: {e}")
            self.error.show()
            return
        self.accept()

    def values(self) -> tuple[int, str, tuple[str, ...]]:
        """(port, api key, allowed origins)."""
        try:
            origins = self.origin_list()
        except ValueError:
            origins = ()
        return self.port.value(), self.key.text().strip(), origins
