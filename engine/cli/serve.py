"""``colibri serve``: the OpenAI-compatible server over one engine (engine/server)."""

from __future__ import annotations

import os
import sys

from ..settings import ENGINE, SAMPLING
from .flags import add_setting_flags, engine_config, sampling_params
from .run import resolve_store

API_KEY_ENV = "COLIBRI_API_KEY"


def server_options(a):
    """The validated ServerOptions of the parsed flags. Raises ConfigError naming the flag."""
    from ..server import ServerOptions
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV, "")
    return ServerOptions(host=a.host, port=a.port, api_key=key, cors_origins=tuple(a.cors_origin or ()),
                         max_body_bytes=a.max_body_bytes, max_waiting=a.max_waiting).validated()


def cmd_serve(a) -> int:
    """Listen first, then open the model, serve it until Ctrl+C. While the model opens (the
    first start compiles the kernels: minutes) the port is open, /v1/models lists the model being
    opened (the id it will answer to) and requests get 503 with Retry-After, so clients and
    health checks see "loading", not a refused connection or an empty list."""
    from ..generate import Engine
    from .models import open_notices
    from ..server import LocalServer
    from ..server.openai_api import PendingModel, ServedModel
    opts = server_options(a)          # refuse a bad host / key before loading anything
    sp = sampling_params(a)
    opened: dict = {}
    # jobs reach the runner only once a model is served (503 before), so the engine exists then;
    # clients that discover the model first find it in /v1/models while it loads
    srv = LocalServer(lambda: opened.get("served"), lambda fn, job: fn(opened["engine"]), opts, sp,
                      loading=lambda: opened.get("pending"))
    url = srv.start()  # a busy port is refused before the default model's first conversion
    try:
        store = resolve_store(a.model)
        cfg = engine_config(a, store)
        opened["pending"] = PendingModel.from_store(store)
        print(f"colibri: listening on {url}; opening the model (requests get 503 until it is ready)",
              file=sys.stderr, flush=True)
        with Engine.open(cfg, progress=open_notices) as eng:
            opened["engine"] = eng
            opened["served"] = ServedModel.from_engine(eng)
            model = opened["served"].model_id
            print(f"colibri: serving {model} on {url} (OpenAI-compatible; Ctrl+C stops)"
                  + ("; API key required" if opts.api_key else ""), file=sys.stderr, flush=True)
            try:
                srv.wait()
            except KeyboardInterrupt:
                print("\ncolibri: stopping the server", file=sys.stderr)
            finally:
                srv.stop()
                opened.clear()
    finally:
        srv.stop()
    return 0


def add_parsers(sub) -> None:
    """Add ``serve`` to the ``colibri`` argparse subparsers ``sub``."""
    from ..server.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, DEFAULT_PORT
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API on this computer",
                       description="Serve a converted model on an OpenAI-compatible HTTP API "
                                   "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) "
                                   "and Anthropic's Messages API (/v1/messages). "
                                   "One engine answers every client, one request at a time, in order.")
    s.add_argument("--model", help="converted store (default: the bundled model)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this computer only; any other needs --api-key)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")
    s.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="allow web pages from ORIGIN (scheme://host[:port], repeatable) to use the server; "
                        "pages from any other origin are refused (default: none)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES})")
    s.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help=f"requests that may wait for the engine; more get 503 + Retry-After "
                        f"(default {DEFAULT_MAX_WAITING})")
    add_setting_flags(s, SAMPLING)
    add_setting_flags(s, ENGINE)
    s.set_defaults(fn=cmd_serve)
