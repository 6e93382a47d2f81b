"""The local server: options, and uvicorn running the API on a thread of this process.

:class:`LocalServer` ties the pieces together: a :class:`~engine.server.jobs.JobQueue` over a
runner (one engine, many clients), the Starlette app (engine/server/openai_api.py) and a uvicorn
server listening on a socket bound here (so a port in use is a clear error before anything
runs, and port 0 picks a free one). ``colibri serve`` runs one with its own engine
(:meth:`LocalServer.for_engine`); the app runs one over the engine its window has open, on the
app's engine thread.
"""

from __future__ import annotations

import http
import logging
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..events import SamplingParams
from .gate import _is_loopback_name, check_origin_syntax
from .jobs import DirectRunner, JobQueue
from .openai_api import Api, PendingModel, ServedModel, build_app, endpoint_of, path_error
from .stats import ServerStats

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 4 << 20   # 4 MiB of JSON: far more than any context this engine holds
DEFAULT_MAX_WAITING = 16


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8 with its shorthands such as
    127.1, ::1)."""
    return _is_loopback_name(host)


@dataclass(frozen=True)
class ServerOptions:
    """Where and how the server listens.

    host: address to bind (default 127.0.0.1: this computer only); port: TCP port (0 = a free
    one); api_key: required as ``Authorization: Bearer <key>`` on every endpoint but /health
    ("" = none; required for a host other than loopback); cors_origins: origins allowed by CORS
    (none = CORS off); max_body_bytes: request body limit (bytes); max_waiting: requests that
    may wait for the engine before 503.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str = ""
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting: int = DEFAULT_MAX_WAITING

    def validated(self) -> "ServerOptions":
        """Return self if usable.

        Raises:
            ConfigError: a port out of 0-65535, a limit below 1, or a host other than loopback
                without an API key (the server would answer anyone on the network).
        """
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port!r}: must be 0-65535 (0 = any free port)")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes {self.max_body_bytes}: must be at least 1024")
        if self.max_waiting < 1:
            raise ConfigError(f"--max-waiting {self.max_waiting}: must be at least 1")
        if not self.host.strip():
            raise ConfigError("--host is empty: give an address such as 127.0.0.1")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"--host {self.host}: serving beyond this computer needs an API key; pass "
                              f"--api-key KEY (clients send 'Authorization: Bearer KEY'), or keep the "
                              f"default --host 127.0.0.1")
        for o in self.cors_origins:
            try:
                check_origin_syntax(o)
            except ValueError as e:
                raise ConfigError(f"--cors-origin: {e}") from None
        if self.api_key and (self.api_key != self.api_key.strip() or len(self.api_key) < 8):
            raise ConfigError("the API key (--api-key) must have at least 8 characters, without surrounding "
                              "spaces")
        return self


_REQUEST_LINE = re.compile(rb"\s*[A-Za-z]+ +(/[^ ?#\r\n]*)")


def _http_protocol(stats: ServerStats):
    """uvicorn's HTTP/1.1 protocol, refusing a request that is not valid HTTP (no ``Host``, a
    malformed request line or header) with a JSON error in the API's shape instead of uvicorn's
    plain-text 400: such a request never reaches the application, so its refusal is written
    here. The path of the request line, when it has one, chooses the shape (Anthropic's on
    /v1/messages); the refusal is counted in /metrics."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrorsProtocol(H11Protocol):
        _path = ""

        def data_received(self, data: bytes) -> None:
            m = _REQUEST_LINE.match(data[:4096])
            if m is not None:
                self._path = m.group(1).decode("latin-1")
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            import h11
            # called from inside uvicorn's ``except h11.RemoteProtocolError``: the error says why
            exc = sys.exc_info()[1]
            status = getattr(exc, "error_status_hint", 400) if isinstance(exc, h11.RemoteProtocolError) else 400
            why = str(exc) if exc is not None else msg
            if "host" in why.lower() and "missing" in why.lower():
                message = ("the request has no Host header, which HTTP/1.1 requires; HTTP clients send it "
                           "themselves, a request written by hand needs e.g. 'Host: 127.0.0.1'")
                status = 400
            else:
                # h11's reason without the bytes it quotes ("illegal header line: bytearray(...)")
                message = f"the request is not valid HTTP/1.1 ({why.split(':')[0]}); send it with an HTTP client"
            resp = path_error(self._path, status, message, code="invalid_http")
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()]
            headers.append((b"connection", b"close"))
            reason = http.HTTPStatus(status).phrase.encode("ascii")
            for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=resp.body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            stats.on_request(endpoint_of(self._path), status)

    return JsonErrorsProtocol


class LocalServer:
    """The OpenAI-compatible server on a background thread.

    Args:
        served: () -> ServedModel | None, the model requests are answered with.
        runner: ``runner(fn, job)`` runs ``fn(engine)`` on the engine's thread (see jobs.py).
        options: ServerOptions (validated here).
        defaults: SamplingParams for what a request leaves out (max_new_tokens, temperature ...).
        loading: () -> PendingModel | None, the model being opened while ``served`` gives None:
            GET /v1/models lists it as soon as the server listens; its requests get 503 with
            Retry-After until it is open.

    ``start()`` binds and serves (raises ConfigError, or OSError naming the address when the
    port cannot be bound); ``stop()`` ends the HTTP server and the queue. ``url``, ``port``,
    ``stats`` (ServerStats) and ``queue`` (JobQueue) are public.
    """

    def __init__(self, served: Callable[[], ServedModel | None], runner, options: ServerOptions,
                 defaults: SamplingParams | None = None, loading: Callable[[], PendingModel | None] | None = None):
        self.options = options.validated()
        self.stats = ServerStats()
        self.queue = JobQueue(runner, self.options.max_waiting, self.stats)
        self.api = Api(served, self.queue, self.stats, defaults or SamplingParams(), self.options.max_body_bytes,
                       loading)
        self.app = build_app(self.api, self.options.api_key, self.options.cors_origins, self.options.host)
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = 0

    @classmethod
    def for_engine(cls, engine, options: ServerOptions, defaults: SamplingParams | None = None) -> "LocalServer":
        """A server over one open Engine, computing on the queue's own thread."""
        served = ServedModel.from_engine(engine)
        return cls(lambda: served, DirectRunner(engine), options, defaults)

    @property
    def url(self) -> str:
        """The base URL clients use (``http://127.0.0.1:PORT/v1``)."""
        host = self.options.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind the socket, start uvicorn on a thread, wait until it accepts; returns the URL."""
        import uvicorn
        host, port = self.options.host, self.options.port
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: a response's head and body are two writes, and with
        # Nagle's algorithm the second waited for the client's delayed ACK (40 ms a request)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            sock.close()
            self.queue.close()
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}; choose another port "
                                   f"or stop the program using it") from None
        sock.listen(128)
        self._sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=5, timeout_graceful_shutdown=5,
                                http=_http_protocol(self.stats))
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="colibri-server-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the server on {host}:{self.port} did not start")
            time.sleep(0.01)
        log.info("serving on %s", self.url)
        return self.url

    def _serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._sock])
        except BaseException:  # noqa: BLE001 - uvicorn exits through SystemExit on fatal errors
            log.exception("the HTTP server stopped")

    def wait(self, poll_s: float = 0.5) -> None:
        """Block until the server stops (``colibri serve``'s main thread; Ctrl+C raises here)."""
        while self.running:
            self._thread.join(poll_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, cancel the waiting and running generations, join the threads.
        Idempotent."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        self.queue.close(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
