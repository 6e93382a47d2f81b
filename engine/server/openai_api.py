"""The OpenAI-compatible HTTP API (Starlette; SSE through sse-starlette).

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /metrics`` (Prometheus text).
Request and response bodies follow the OpenAI API reference (chat completions, completions,
models; streamed as ``chat.completion.chunk`` / ``text_completion`` server-sent events ending
in ``data: [DONE]``). Every refusal is an OpenAI-shaped error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status; a failure inside the
engine is a 500 with the same shape, never a traceback.

Parameter ranges are the settings table's (engine/settings.py): ``temperature``, ``top_p``,
``seed``, ``max_tokens`` (max_new_tokens) and the extensions ``top_k`` and
``repetition_penalty`` are checked by the same ``Setting.check`` as ``colibri run``'s flags.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat_template import THINK_OPEN
from ..docs_lookup import DOCS_PER_QUESTION, last_user_text, with_docs_each
from ..errors import ConfigError, EngineError
from ..events import SamplingParams
from ..harmony import is_harmony
from ..sampling import fresh_seed
from ..settings import setting
from .gate import RequestGate
from .grammar import GrammarError, call_grammar, compile_checked, json_grammar, schema_of
from .jobs import Job, JobQueue, QueueFull
from .tools import (HarmonyFormat, ToolsError, arguments_as, check_tool_calls, check_tool_choice, check_tools,
                    tool_format)
from .stats import ServerStats, exposition

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4  # the OpenAI API's limit
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/v1/messages/count_tokens", "/v1/messages")
ANTHROPIC_PATH = "/v1/messages"   # errors there, and below it, in Anthropic's shape
ANTHROPIC_VERSION_HEADER = "anthropic-version"   # Anthropic's SDKs send it on every request

#: the request fields each endpoint reads; any other is refused (400 naming it), as OpenAI's own
#: API does, because a field ignored silently may have been meant to change the answer. The
#: bookkeeping fields ``store``, ``metadata``, ``service_tier``, ``user``, ``prompt_cache_key``
#: and ``safety_identifier`` change no answer and are accepted without effect.
BOOKKEEPING_FIELDS = ("store", "metadata", "service_tier", "user", "prompt_cache_key", "safety_identifier")
SAMPLING_FIELDS = ("model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "max_tokens",
                   "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
                   "top_k", "min_p", "repetition_penalty", "docs_lookup", "docs_copy") + BOOKKEEPING_FIELDS
CHAT_FIELDS = frozenset(SAMPLING_FIELDS + (
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "chat_template_kwargs", "continue_final_message", "reasoning_effort", "modalities"))
COMPLETION_FIELDS = frozenset(SAMPLING_FIELDS + ("prompt", "echo", "suffix", "best_of"))
MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal",
                            "annotations"))   # an answer's url citations: output metadata, not prompt text
#: fields with a known meaning this server does not implement: the refusal says what to do instead
UNSUPPORTED_FIELDS = {
    "functions": "the legacy 'functions' field is not supported: give the functions in 'tools' "
                 "([{\"type\": \"function\", \"function\": {...}}])",
    "function_call": "the legacy 'function_call' field is not supported: use 'tool_choice' (\"auto\", \"none\", "
                     "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}) with 'tools'",
    "web_search_options": "'web_search_options' is not supported: this server has no web search",
    "verbosity": "'verbosity' is not supported: ask for a shorter or longer answer in the messages",
    "prediction": "'prediction' (predicted outputs) is not supported by this server",
    "audio": "'audio' output is not supported: this server answers with text",
}


def check_fields(body: dict, known: frozenset, where: str = "") -> None:
    """Refuse a field of ``body`` that is not in ``known`` (400 naming it: ``where`` prefixes its
    path, e.g. ``messages[2].``). Raises ApiError."""
    for k, v in body.items():
        # null is "not given": clients that send back a whole answer message (audio, function_call)
        # or spell out every parameter send the OpenAI fields this server does not take as null
        if k in known or (v is None and k in UNSUPPORTED_FIELDS):
            continue
        if k == "function_call" and where:
            raise ApiError(400, f"'{where}{k}' (the legacy form of a call) is not supported: give the call in the "
                                f"message's 'tool_calls'", param=f"{where}{k}", code="unsupported_parameter")
        if k in UNSUPPORTED_FIELDS:
            raise ApiError(400, UNSUPPORTED_FIELDS[k], param=f"{where}{k}", code="unsupported_parameter")
        raise ApiError(400, f"unknown field '{where}{k}': this server does not know it, and ignoring it could change "
                            f"what you asked for; remove it (docs/server.md lists the fields)", param=f"{where}{k}",
                       code="unknown_parameter")
SEED_HEADER = "x-colibri-seed"    # the sampling seed an answer used (a fresh one when the request gave none)


@dataclass(frozen=True)
class ServedModel:
    """The model a server answers with (one at a time).

    model_id: the name clients pass as ``model`` (and /v1/models lists); aliases: other
    accepted names (the store folder name); tokenizer: engine.tokenizer.Tokenizer;
    context_length: tokens; vocab_size: the model's token ids are in [0, vocab_size);
    created: Unix seconds; key: identity of the engine (the runner checks a job was made for
    the engine it runs on).
    """

    model_id: str
    tokenizer: Any
    context_length: int
    vocab_size: int
    created: int
    key: object
    aliases: tuple[str, ...] = ()
    docs: Any = None  #: the engine's documentation index (engine.docs_lookup.DocsIndex) or None

    @classmethod
    def from_engine(cls, engine) -> "ServedModel":
        """What ``engine`` (an open Engine) serves."""
        from pathlib import Path
        folder = Path(engine.loaded.store_path).name
        name = engine.loaded.model_name or folder
        return cls(model_id=name, tokenizer=engine.tokenizer, context_length=engine.context_length,
                   vocab_size=engine.args.vocab_size, created=int(time.time()), key=engine,
                   aliases=(folder,) if folder != name else (), docs=getattr(engine, "docs", None))


@dataclass(frozen=True)
class ChatPlan:
    """A chat request ready to run: prompt ids, SamplingParams, stop strings, whether the prompt
    opened a reasoning block, documentation entries, (ToolFormat, tools) to parse calls or
    None, and the TokenConstraint or None."""

    ids: list
    sampling: SamplingParams
    stops: tuple
    opened: bool
    docs: tuple
    calls: Any
    constraint: Any


class ApiError(Exception):
    """A refusal with an HTTP status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type, self.headers)


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote a client's string, and one that
    cannot be encoded as UTF-8 (a lone surrogate) must not turn the refusal into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    if status >= 500 and type_ == "invalid_request_error":
        type_ = "server_error"
    return _AsciiJSONResponse(error_body(message, param, code, type_), status_code=status, headers=headers)


# --- request parsing ---------------------------------------------------------------------------


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object, at most ``max_bytes`` bytes.

    Raises ApiError: 413 too large, 400 not JSON or not an object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise ApiError(413, f"the request body has {int(declared)} bytes; the limit is {max_bytes} "
                                    f"(colibri serve --max-body-bytes)", code="request_too_large")
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body is larger than the limit of {max_bytes} bytes "
                                f"(colibri serve --max-body-bytes)", code="request_too_large")
    if len(body) > 1 << 16:   # a big body is parsed and checked off the event loop
        return await run_in_threadpool(parse_json, bytes(body))
    return parse_json(bytes(body))


def parse_json(body: bytes) -> dict:
    """A request body -> a JSON object whose strings are valid Unicode, nested at most
    MAX_JSON_DEPTH deep.

    Raises ApiError (400 ``invalid_json``): bad UTF-8, not JSON, not an object, too deep,
    a lone surrogate (``"\\ud800"``) or a number out of the float range."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, an integer of more than 4300 digits, NaN/Infinity
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    _check_tree(data)
    return data


MAX_JSON_DEPTH = 64  # a tool's JSON schema nests a few levels; nothing legitimate needs more


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(data) -> None:
    """Depth, strings (lone surrogates cannot be encoded, tokenized or answered) and floats
    (1e999 parses as infinity) of a decoded body, walked without recursion."""
    stack = [(data, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_str(k, where)
                stack.append((x, depth + 1, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, str):
            _check_str(v, where)
        elif isinstance(v, float) and not math.isfinite(v):
            raise ApiError(400, f"'{where}': the number is out of range", param=where or None,
                           code="invalid_value")


def _check_str(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{where or 'body'}' holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            f"which is not text", param=where or None, code="invalid_json") from None


def _check_setting(name: str, param: str, value: Any) -> Any:
    try:
        return setting(name).check(value)
    except ConfigError as e:
        msg = str(e).replace(f"setting '{name}'", f"'{param}'", 1)
        raise ApiError(400, msg[:500], param=param, code="invalid_value") from None
    except OverflowError:  # an integer too large for a float
        raise ApiError(400, f"'{param}' is out of range", param=param, code="invalid_value") from None


def sampling_from(body: dict, defaults: SamplingParams, chat: bool = False) -> SamplingParams:
    """SamplingParams of a request: the server's defaults (its sampling flags) overridden by
    ``temperature``, ``top_p``, ``seed``, ``max_completion_tokens`` / ``max_tokens``, and the
    extensions ``top_k``, ``repetition_penalty``, ``docs_lookup`` (false: no documentation
    lookup for this request), ``docs_copy`` (0-1: how strongly the answer follows the entries). Unsupported features that would change the
    answer (``n`` > 1, penalties, logprobs, structured output) are refused, not ignored.
    Raises ApiError (400) naming the parameter."""
    kw = {}
    for param, name in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                        ("top_k", "top_k"), ("repetition_penalty", "repetition_penalty"),
                        ("docs_lookup", "docs_lookup"), ("docs_copy", "docs_copy")):
        if body.get(param) is not None:
            kw[name] = _check_setting(name, param, body[param])
    for param in ("max_tokens", "max_completion_tokens"):
        if body.get(param) is not None:
            kw["max_new_tokens"] = _check_setting("max_new_tokens", param, body[param])
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, f"'n' = {n!r}: only n = 1 is supported (one engine, one answer)", param="n",
                       code="invalid_value")
    for param in ("presence_penalty", "frequency_penalty"):
        v = body.get(param)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0):
            raise ApiError(400, f"'{param}' = {v!r} is not supported; use 'repetition_penalty' (1 = off)",
                           param=param, code="unsupported_parameter")
    for param in ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias"):
        v = body.get(param)
        if v not in (None, False, 0, {}):
            raise ApiError(400, f"'{param}' is not supported by this server", param=param,
                           code="unsupported_parameter")
    min_p = body.get("min_p")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or min_p != 0):
        raise ApiError(400, f"'min_p' = {min_p!r} is not supported by this server's sampler; use 'top_p' or 'top_k' "
                            f"(or leave 'min_p' out, or 0)", param="min_p", code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise ApiError(400, "'best_of' other than 1 is not supported", param="best_of", code="unsupported_parameter")
    rf = body.get("response_format")
    if not chat and rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                       param="response_format", code="unsupported_parameter")
    sp = replace(defaults, **kw)
    # "auto": the server picks the seed, so that the answer can report it (SEED_HEADER)
    return sp if sp.seed is not None else replace(sp, seed=fresh_seed())


def stops_from(body: dict, param: str = "stop", limit: int | None = MAX_STOPS) -> tuple[str, ...]:
    """The ``stop`` parameter: a string or a list of at most ``limit`` strings (None: any
    number, as Anthropic's ``stop_sequences``); ``param`` is the name errors give it."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"'{param}' must be a string or a list of strings", param=param, code="invalid_type")
    if limit is not None and len(stop) > limit:
        raise ApiError(400, f"'{param}' has {len(stop)} strings; at most {limit} are allowed", param=param,
                       code="invalid_value")
    # an empty stop string would match everywhere (the Messages API also refuses whitespace-only ones)
    blank = str.strip if limit is None else (lambda x: x)
    for i, s in enumerate(stop):
        if not blank(s):
            where = param if body.get("stop") == s else f"{param}[{i}]"
            raise ApiError(400, f"'{where}' is {'empty' if not s else 'only whitespace'}: give the text that ends "
                                f"the answer, or leave the stop string out", param=where, code="invalid_value")
    return tuple(stop)


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream", code="invalid_type")
    opts = body.get("stream_options")
    include = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        if not stream:   # as OpenAI's API: the options of a stream need one
            raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options",
                           code="invalid_value")
        include = opts.get("include_usage", False)
        if not isinstance(include, bool):
            raise ApiError(400, "'stream_options.include_usage' must be true or false",
                           param="stream_options", code="invalid_type")
    return stream, include and stream


def _text_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not content:
            raise ApiError(400, f"messages[{i}].content is an empty list: give the text as a string or at least "
                                f"one {{\"type\": \"text\", \"text\": ...}} part", param=f"messages[{i}].content",
                           code="invalid_value")
        parts = []
        for j, p in enumerate(content):
            w = f"messages[{i}].content[{j}]"
            if isinstance(p, dict) and p.get("type") == "text":
                if not isinstance(p.get("text"), str):
                    raise ApiError(400, f"{w}.text must be a string", param=f"{w}.text", code="invalid_type")
                parts.append(p["text"])
                continue
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise ApiError(400, f"{w} must be a content part {{\"type\": \"text\", \"text\": ...}}", param=w,
                               code="invalid_type")
            raise ApiError(400, f"{w}: {p['type']!r} parts are not supported by this server (it reads text: "
                                f"{{\"type\": \"text\", \"text\": ...}})", param=w, code="unsupported_content")
        return "\n".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def chat_messages(body: dict) -> list[dict]:
    """The ``messages`` of a chat request as the dicts the chat template reads: roles system
    (``developer`` too), user, assistant (``tool_calls`` with their JSON ``arguments`` parsed, as
    most Hugging Face templates expect; :func:`string_arguments` gives them back as strings for
    the templates that concatenate them; ``reasoning_content``), tool (``tool_call_id``,
    ``name``)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'",
                           param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role = {role!r}: must be one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role", code="invalid_value")
        check_fields(m, MESSAGE_FIELDS, f"messages[{i}].")
        if m.get("content") is None and role != "assistant":
            raise ApiError(400, f"messages[{i}] (role {role!r}) has no content: give its text in 'content'",
                           param=f"messages[{i}].content", code="invalid_value")
        if m.get("refusal") is not None and not isinstance(m["refusal"], str):
            raise ApiError(400, f"messages[{i}].refusal must be a string", param=f"messages[{i}].refusal",
                           code="invalid_type")
        d: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _text_content(m.get("content"), i)}
        for k in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(k), str):
                d[k] = m[k]
        calls = m.get("tool_calls")
        if calls is not None and role == "assistant":
            try:
                d["tool_calls"] = arguments_as(check_tool_calls(calls, f"messages[{i}].tool_calls"), True)
            except ToolsError as e:
                raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
        out.append(d)
    return out


def check_tool_results(msgs: list[dict]) -> None:
    """Every tool message of ``msgs`` (template messages) must answer a call of an earlier
    assistant message: its ``tool_call_id`` names that call's id (or, for calls sent without
    ids, a tool message follows a message with calls). Raises ApiError (400) naming
    ``messages[i].tool_call_id``."""
    ids: set[str] = set()
    called = False
    for i, m in enumerate(msgs):
        if m.get("role") == "assistant" and m.get("tool_calls"):
            called = True
            ids.update(c["id"] for c in m["tool_calls"] if c.get("id"))
        if m.get("role") != "tool":
            continue
        cid = m.get("tool_call_id")
        if cid is None or not (cid in ids or (called and not ids)):
            shown = f"{cid!r}" if cid is not None else "missing"
            raise ApiError(400, f"messages[{i}].tool_call_id is {shown}: a tool message answers an earlier call in an "
                                f"assistant message's 'tool_calls' and names its id; there is no such call before "
                                f"it (give the assistant message with the call first, or send the tool's output as "
                                f"text in a user message)", param=f"messages[{i}].tool_call_id", code="invalid_value")


def tool_calls_json(calls) -> list[dict]:
    """Parsed calls (engine.server.tools.Call) -> OpenAI ``tool_calls``: the id the model wrote
    (templates such as Mistral's render it back) or a fresh one, ``arguments`` as a JSON string."""
    return [{"id": c.id or "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]


def string_arguments(msgs: list[dict]) -> list[dict]:
    """``msgs`` with every tool call's ``arguments`` as a JSON string (DeepSeek's templates add
    them to the text with ``+``, which an object cannot be)."""
    return [{**m, "tool_calls": arguments_as(m["tool_calls"], False)} if m.get("tool_calls") else m for m in msgs]


# --- the app -----------------------------------------------------------------------------------


def endpoint_of(path: str) -> str:
    """The endpoint label of a request path in /metrics ("other" for unknown paths)."""
    return next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")


class _Guard:
    """Pure ASGI middleware: the API key (``Authorization: Bearer KEY``, constant-time
    comparison, every path but /health) and the request counts by endpoint and status."""

    def __init__(self, app, api_key: str, stats: ServerStats):
        self.app, self.stats = app, stats
        self.key = api_key.encode("utf-8") if api_key else b""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = endpoint_of(path)
        status = [0]

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.key and path != "/health" and scope.get("method") != "OPTIONS":
                token = b""
                for k, v in scope.get("headers", ()):
                    if k == b"authorization" and v[:7].lower() == b"bearer ":
                        token = v[7:].strip()
                        break
                    if k == b"x-api-key":   # Anthropic's clients
                        token = v.strip()
                        break
                if not hmac.compare_digest(token, self.key):
                    resp = path_error(path, 401, "a valid API key is required: send 'Authorization: Bearer "
                                      "<key>' or 'x-api-key: <key>' (the key given to colibri serve --api-key)",
                                      code="invalid_api_key", anthropic=anthropic_client(scope.get("headers", ())))
                    return await resp(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            self.stats.on_request(endpoint, status[0] or 499)


#: template variables a request sets through its own fields, not through chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = {
    "messages": "the conversation is the request's 'messages'",
    "tools": "give the functions in the request's 'tools'",
    "documents": "documents are not taken by this server",
    "add_generation_prompt": "the server always ends the prompt where the answer starts (see "
                             "'continue_final_message' to continue a last assistant message)",
    "continue_final_message": "it is a field of the request, not a template variable",
    "chat_template": "the model's own chat template is used",
}


class _ToolsNotRendered(Exception):
    pass


def template_reads(m: ServedModel, variable: str) -> bool:
    """Whether one of the model's chat templates reads the variable ``variable``."""
    return any(variable in (t or "") for t in getattr(m.tokenizer, "chat_templates", {}).values())


def _tools_unwritten(m: ServedModel, tools) -> bool:
    """True when the model's chat template renders the same prompt with and without ``tools``."""
    probe = [{"role": "user", "content": "x"}]
    try:
        return m.tokenizer.encode_chat(probe, tools=tools) == m.tokenizer.encode_chat(probe)
    except (EngineError, TypeError, ValueError):
        return False


REASONING_EFFORTS = ("low", "medium", "high")


def reasoning_kwargs(m: ServedModel, effort: Any) -> dict:
    """OpenAI's ``reasoning_effort`` as template variables: ``reasoning_effort`` itself for a
    template that reads it (gpt-oss: low / medium / high); for a template with a thinking switch
    (``enable_thinking``: Qwen3, GLM-4.5), "none" / "minimal" turn it off and low / medium / high
    on. Raises ApiError (400 ``reasoning_effort``) for a template with neither."""
    if effort is None:
        return {}
    if effort not in ("none", "minimal") + REASONING_EFFORTS:
        raise ApiError(400, f"'reasoning_effort' = {effort!r}: must be one of none, minimal, low, medium, high",
                       param="reasoning_effort", code="invalid_value")
    if template_reads(m, "reasoning_effort"):
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' = {effort!r}: the chat template of the model {m.model_id!r} "
                                f"takes low, medium or high", param="reasoning_effort", code="invalid_value")
        return {"reasoning_effort": effort}
    if template_reads(m, "enable_thinking"):
        return {"enable_thinking": effort in REASONING_EFFORTS}
    raise ApiError(400, f"'reasoning_effort': the chat template of the model {m.model_id!r} has no reasoning "
                        f"setting (neither reasoning_effort nor enable_thinking), so the field would be ignored; "
                        f"leave it out", param="reasoning_effort", code="unsupported_parameter")


def _named(m: ServedModel, e: Exception) -> str:
    """An engine error's text with the store's folder path replaced by the model's name (the
    client knows the model, not where the server keeps it)."""
    text = str(e)
    where = str(getattr(m.tokenizer, "name", "") or "")
    return text.replace(where, f"the model {m.model_id!r}") if where else text


class Api:
    """The endpoints over a model provider and a job queue.

    Args:
        served: () -> ServedModel | None (None while no model is open: 503).
        queue: the JobQueue that runs generations one at a time.
        stats: ServerStats.
        defaults: SamplingParams used where a request gives no value (the server's flags).
        max_body_bytes: request body limit (413 above it).
    """

    def __init__(self, served: Callable[[], ServedModel | None], queue: JobQueue, stats: ServerStats,
                 defaults: SamplingParams, max_body_bytes: int):
        self.served, self.queue, self.stats = served, queue, stats
        self.defaults, self.max_body_bytes = defaults, int(max_body_bytes)

    # --- helpers -----------------------------------------------------------------------------

    def model_for(self, body: dict | None = None) -> ServedModel:
        m = self.served()
        if m is None:
            raise ApiError(503, "no model is open yet (the app is loading or switching models); retry shortly",
                           code="model_not_ready", type_="server_error", headers={"Retry-After": "2"})
        if body is not None:
            want = body.get("model")
            if want is not None and not isinstance(want, str):
                raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
            if want and want != m.model_id and want not in m.aliases:
                raise ApiError(404, f"the model {want!r} does not exist here; this server serves {m.model_id!r} "
                                    f"(GET /v1/models)", param="model", code="model_not_found")
        return m

    def _check_prompt(self, m: ServedModel, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"'{param}' is empty", param=param, code="invalid_value")
        if len(ids) >= m.context_length:
            raise ApiError(400, f"this model's context holds {m.context_length} tokens, but the prompt has "
                                f"{len(ids)} (one more is needed to answer); shorten the {param}",
                           param=param, code="context_length_exceeded")

    def _submit(self, m: ServedModel, ids, sp, stops, chat, opened, emit, docs=(), calls=None,
                constraint=None) -> Job:
        fmt, tools = calls or (None, None)
        job = Job(ids=list(ids), sampling=sp, emit=emit, stops=stops, chat=chat, prompt_opened=opened,
                  model_key=m.key, docs=tuple(docs), tool_format=fmt, tools=tools, constraint=constraint)
        try:
            self.queue.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry after {e.retry_after_s} s", code="queue_full", type_="server_error",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), code="shutting_down", type_="server_error") from None
        return job

    @staticmethod
    def _usage(res) -> dict:
        return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                "total_tokens": res.prompt_tokens + res.completion_tokens}

    # --- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        m = self.served()
        body = {"status": "ok" if m else "loading", "model": m.model_id if m else None,
                "queue_depth": self.queue.depth, "busy": self.queue.busy}
        return JSONResponse(body, status_code=200 if m else 503, headers=None if m else {"Retry-After": "2"})

    async def metrics(self, request: Request) -> Response:
        data = await run_in_threadpool(exposition, self.stats, self.queue,
                                       lambda: (self.served() or ServedModel("", None, 0, 0, 0, None)).model_id)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_obj(self, m: ServedModel) -> dict:
        # OpenAI's model object and Anthropic's (type, display_name, created_at) in one: both SDKs
        # list models at GET /v1/models
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created))
        return {"id": m.model_id, "object": "model", "created": m.created, "owned_by": "colibri",
                "context_length": m.context_length, "type": "model", "display_name": m.model_id,
                "created_at": created_at, "max_input_tokens": m.context_length}

    async def models(self, request: Request) -> Response:
        m = self.served()
        ids = [m.model_id] if m else []
        return JSONResponse({"object": "list", "data": [self._model_obj(m)] if m else [], "has_more": False,
                             "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None})

    async def model(self, request: Request) -> Response:
        m = self.model_for()
        name = request.path_params["model"]
        if name != m.model_id and name not in m.aliases:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves {m.model_id!r}",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_obj(m))

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        check_fields(body, CHAT_FIELDS)
        m = self.model_for(body)
        msgs = chat_messages(body)
        check_tool_results(msgs)
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise ApiError(400, f"'modalities' = {json.dumps(modalities)}: this server answers with text only "
                                f"([\"text\"])", param="modalities", code="unsupported_parameter")
        stream, include_usage = stream_flags(body)
        plan = await self.prepare_chat(m, body, msgs)
        return await self._generate(request, m, plan.ids, plan.sampling, plan.stops, stream, include_usage, chat=True,
                                    opened=plan.opened, docs=plan.docs, calls=plan.calls, constraint=plan.constraint)

    async def prepare_chat(self, m: ServedModel, body: dict, msgs: list[dict], anthropic: bool = False,
                           count_only: bool = False) -> "ChatPlan":
        """A chat request's prompt ids, sampling, stop strings, call parsing and constraint, from
        ``body``'s OpenAI fields (``tools``, ``tool_choice``, ``response_format``, sampling,
        ``prefill`` / ``continue_final_message``: the answer continues the last assistant
        message) and the template messages ``msgs``. ``anthropic``: errors speak the Messages
        API's parameter names (and its stop_sequences have no count limit); ``count_only``: only
        the prompt ids are wanted (no constraint is built, a prompt beyond the context is
        counted). Raises ApiError (400) naming what is wrong."""
        sp = sampling_from(body, self.defaults, chat=True)
        try:
            constrained, schema = schema_of(body.get("response_format"))
        except ValueError as e:
            raise ApiError(400, str(e), param="response_format", code="invalid_value") from None
        stops = stops_from(body, "stop_sequences", None) if anthropic else stops_from(body)
        try:
            tools = check_tools(body.get("tools"))
            choice = check_tool_choice(body.get("tool_choice"), tools)
        except ToolsError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
        if choice.mode == "none":
            tools = None
        forced = choice.mode in ("required", "function")
        shown_choice = json.dumps(body.get("tool_choice"))
        if anthropic:
            shown_choice = json.dumps({"type": "any"} if choice.mode == "required" else {"type": "tool", "name": choice.name})
        fmt = tool_format(m.tokenizer) if tools else None
        calls = (fmt, tools) if fmt is not None else None
        if forced and fmt is None and await run_in_threadpool(_tools_unwritten, m, tools):
            raise ApiError(400, f"the model {m.model_id!r} cannot call tools: its chat template does not write "
                                f"'tools' into the prompt; drop 'tools' and 'tool_choice', or open a model with a "
                                f"tool-call format (docs/server.md lists them)", param="tools",
                           code="tools_not_supported")
        if forced and fmt is None:
            raise ApiError(400, f"'tool_choice' {shown_choice} needs a model whose chat template writes tool calls "
                                f"in a known format; {m.model_id!r} has none (docs/server.md lists the formats): "
                                f"leave 'tool_choice' out", param="tool_choice", code="unsupported_parameter")
        prefill = body.get("prefill" if anthropic else "continue_final_message") or False
        if not isinstance(prefill, bool):
            raise ApiError(400, "'continue_final_message' must be true or false", param="continue_final_message",
                           code="invalid_type")
        if prefill and (msgs[-1].get("role") != "assistant" or not msgs[-1].get("content")):
            raise ApiError(400, "'continue_final_message' continues the last message, which must be an assistant "
                                "message with text", param="continue_final_message", code="invalid_value")
        if prefill and (forced or constrained):
            what = f"'tool_choice' {shown_choice}" if forced else "'response_format'"
            raise ApiError(400, f"an assistant prefill (a last assistant message the answer continues) cannot be "
                                f"combined with {what}, which constrains the answer from its first token: leave one "
                                f"of them out", param="tool_choice" if forced else "response_format",
                           code="invalid_value")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object of template variables, e.g. "
                                "{\"enable_thinking\": false}", param="chat_template_kwargs", code="invalid_type")
        for k in kwargs:
            if k in RESERVED_TEMPLATE_VARIABLES:
                raise ApiError(400, f"'chat_template_kwargs' cannot set {k!r}: {RESERVED_TEMPLATE_VARIABLES[k]}",
                               param=f"chat_template_kwargs.{k}", code="invalid_value")
        kwargs = {**reasoning_kwargs(m, body.get("reasoning_effort")), **kwargs}
        if not m.tokenizer.has_chat_template:
            raise ApiError(400, f"the model {m.model_id!r} has no chat template, so it cannot take chat "
                                f"messages; use POST /v1/completions with a raw prompt", param="messages",
                           code="no_chat_template")

        def encode(ms, with_tools=True):
            t = (tools or None) if with_tools else None
            try:
                return m.tokenizer.encode_chat(ms, tools=t, continue_final_message=prefill, **kwargs)
            except EngineError:
                if not any(x.get("tool_calls") for x in ms):
                    raise
                return m.tokenizer.encode_chat(string_arguments(ms), tools=t, continue_final_message=prefill, **kwargs)

        def prompt() -> tuple[list[int], tuple]:
            called = [i for i, x in enumerate(msgs) if x.get("tool_calls")]
            if called and encode(msgs) == encode([{k: v for k, v in x.items() if k != "tool_calls"} for x in msgs]):
                # the template never writes an assistant's calls: the model would not see them
                raise _ToolsNotRendered(called[0])
            if m.docs is not None and sp.docs_lookup and not tools:
                # the documentation lookup, as in the app (engine.Engine._encode_chat; not with
                # tools), unless the looked-up entries would make the prompt too long
                looked = encode(list(with_docs_each(msgs, lambda text: m.docs.search(text, DOCS_PER_QUESTION))))
                if len(looked) < m.context_length:
                    text = last_user_text(msgs)
                    return looked, tuple(m.docs.search(text, DOCS_PER_QUESTION)) if text else ()
            ids = encode(msgs)
            if tools and ids == encode(msgs, with_tools=False):
                # the template never writes the tools: the model could not know them
                raise _ToolsNotRendered()
            return ids, ()
        try:
            ids, docs = await run_in_threadpool(prompt)
        except _ToolsNotRendered as e:
            if e.args:   # an assistant message's calls
                what, where = (("tool_use blocks", "messages") if anthropic else
                               ("'tool_calls'", f"messages[{e.args[0]}].tool_calls"))
                raise ApiError(400, f"the chat template of the model {m.model_id!r} does not write the {what} of "
                                    f"assistant messages into the prompt, so the model would not see its own calls; "
                                    f"give them as text in the message's content", param=where,
                               code="tools_not_supported") from None
            raise ApiError(400, f"the chat template of the model {m.model_id!r} does not write 'tools' into the "
                                f"prompt, so the model could not learn of them or call them; send the request "
                                f"without 'tools', or open a model with a tool-call format (docs/server.md lists "
                                f"them)", param="tools", code="tools_not_supported") from None
        except (EngineError, TypeError, ValueError) as e:
            why = _named(m, e).removeprefix(f"the chat template of the model {m.model_id!r} failed: ")
            raise ApiError(400, f"the messages cannot be rendered with the chat template of the model "
                                f"{m.model_id!r}: {why}", param="messages", code="invalid_messages") from None
        if count_only:
            self._check_prompt(m, ids[:1], "messages")
            return ChatPlan(ids, sp, stops, False, docs, calls, None)
        self._check_prompt(m, ids, "messages")
        if prefill and is_harmony(m.tokenizer):
            # the prompt ends inside a harmony message: the answer's first ids are its content
            start, message = (m.tokenizer.token_to_id(t) for t in ("<|start|>", "<|message|>"))
            i, j = (max((k for k, t in enumerate(ids) if t == x), default=-1) for x in (start, message))
            if 0 <= i < j:
                calls = (HarmonyFormat(ids[i + 1:j], show_calls=calls is not None), tools)
        tail = m.tokenizer.decode(ids[-8:], skip_special_tokens=False)
        opened = tail.rstrip().endswith(THINK_OPEN)
        constraint = None
        if forced or constrained:
            def build():
                if forced:
                    return compile_checked(m.tokenizer, call_grammar(m.tokenizer, msgs, tools, choice.name, kwargs))
                return compile_checked(m.tokenizer, json_grammar(m.tokenizer, schema, opened))
            try:
                constraint = await run_in_threadpool(build)
            except (GrammarError, EngineError) as e:
                param = "tool_choice" if forced else "response_format"
                raise ApiError(400, f"'{param}': the output cannot be constrained as asked: {_named(m, e)}",
                               param=param,
                               code="invalid_value") from None
        return ChatPlan(ids, sp, stops, opened, docs, calls, constraint)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (engine/server/anthropic_api.py)."""
        from .anthropic_api import messages
        return await messages(self, request)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token counting (engine/server/anthropic_api.py)."""
        from .anthropic_api import count_tokens
        return await count_tokens(self, request)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        check_fields(body, COMPLETION_FIELDS)
        m = self.model_for(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        sp = sampling_from(body, self.defaults)
        stops = stops_from(body)
        stream, include_usage = stream_flags(body)
        if isinstance(prompt, str):
            ids = await run_in_threadpool(m.tokenizer.encode, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            bad = [t for t in prompt if not 0 <= t < m.vocab_size]
            if bad:
                raise ApiError(400, f"'prompt': token id {bad[0]} is outside the vocabulary [0, {m.vocab_size})",
                               param="prompt", code="invalid_value")
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string, a list of one string or a list of token ids "
                                "(one prompt per request)", param="prompt", code="invalid_value")
        self._check_prompt(m, ids, "prompt")
        return await self._generate(request, m, ids, sp, stops, stream, include_usage, chat=False, opened=False)

    # --- generation --------------------------------------------------------------------------

    async def _generate(self, request, m, ids, sp, stops, stream, include_usage, chat, opened, docs=(),
                        calls=None, constraint=None) -> Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            return await self._whole(request, m, ids, sp, stops, chat, opened, rid, created, obj, docs, calls,
                                     constraint)
        job, q = self.stream_queue(m, ids, sp, stops, chat, opened, docs, calls, constraint)
        chunk_obj = obj + ".chunk" if chat else obj

        def chunk(choice: dict | None, usage=None) -> str:
            d = {"id": rid, "object": chunk_obj, "created": created, "model": m.model_id,
                 "choices": [choice] if choice is not None else []}
            if include_usage:
                d["usage"] = usage
            return json.dumps(d, ensure_ascii=False)

        async def events():
            try:
                if chat:
                    yield {"data": chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None})}
                while True:
                    item = await q.get()
                    if item[0] == "delta":
                        _, r, c = item
                        if chat:
                            delta = {}
                            if r:
                                delta["reasoning_content"] = r
                            if c:
                                delta["content"] = c
                            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                        else:
                            choice = {"index": 0, "text": c, "logprobs": None, "finish_reason": None}
                        yield {"data": chunk(choice)}
                        continue
                    res = item[1]
                    if res.finish_reason in ("error", "cancelled"):
                        msg = res.error or "the generation was cancelled (the server is stopping)"
                        kind = "invalid_request_error" if 400 <= res.status < 500 else "server_error"
                        yield {"data": json.dumps(error_body(msg, type_=kind))}
                    else:
                        for i, c in enumerate(tool_calls_json(res.tool_calls)):
                            yield {"data": chunk({"index": 0, "delta": {"tool_calls": [{"index": i, **c}]},
                                                  "logprobs": None, "finish_reason": None})}
                        end = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": res.finish_reason}
                               if chat else
                               {"index": 0, "text": "", "logprobs": None, "finish_reason": res.finish_reason})
                        yield {"data": chunk(end)}
                        if include_usage:
                            yield {"data": chunk(None, self._usage(res))}
                    yield {"data": "[DONE]"}
                    return
            finally:
                if job.state != "done":   # the client left (the stream task was cancelled)
                    job.client_gone()
                    self.queue.withdraw(job)

        return EventSourceResponse(events(), sep="\n", ping=15, headers={SEED_HEADER: str(sp.seed)})

    async def collect(self, request, m, ids, sp, stops, chat, opened, docs=(), calls=None, constraint=None):
        """Run a job to its end -> (job, reasoning, content), or None when the client left first.
        Raises ApiError for a job that failed or was cancelled."""
        loop = asyncio.get_running_loop()
        reasoning: list[str] = []
        content: list[str] = []
        done = asyncio.Event()

        def emit(item):  # engine thread: the lists are read only after "done"
            if item[0] == "delta":
                if item[1]:
                    reasoning.append(item[1])
                if item[2]:
                    content.append(item[2])
            else:
                try:
                    loop.call_soon_threadsafe(done.set)
                except RuntimeError:
                    pass

        job = self._submit(m, ids, sp, stops, chat, opened, emit, docs, calls, constraint)

        async def client_left():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watch = asyncio.ensure_future(client_left())
        waiter = asyncio.ensure_future(done.wait())
        try:
            await asyncio.wait({watch, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not waiter.done():
                waiter.cancel()
                job.client_gone()
                self.queue.withdraw(job)
        if job.state != "done":
            return None
        res = job.result
        if res.finish_reason == "error":
            raise ApiError(res.status, res.error, code="engine_error" if res.status >= 500 else "invalid_request",
                           type_="server_error" if res.status >= 500 else "invalid_request_error")
        if res.finish_reason == "cancelled":
            raise ApiError(503, "the generation was cancelled (the server is stopping)", code="cancelled",
                           type_="server_error")
        return job, "".join(reasoning), "".join(content)

    def stream_queue(self, m, ids, sp, stops, chat, opened, docs=(), calls=None, constraint=None):
        """Submit a streamed job -> (job, asyncio.Queue of its ("delta", r, c) / ("done", result))."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server stopped)
                pass
        return self._submit(m, ids, sp, stops, chat, opened, emit, docs, calls, constraint), q

    async def _whole(self, request, m, ids, sp, stops, chat, opened, rid, created, obj, docs=(),
                     calls=None, constraint=None) -> Response:
        got = await self.collect(request, m, ids, sp, stops, chat, opened, docs, calls, constraint)
        if got is None:
            return Response(status_code=499)
        job, reasoning, content = got
        res = job.result
        text = content
        if chat:
            msg = {"role": "assistant", "content": text}
            if res.tool_calls:
                msg["tool_calls"] = tool_calls_json(res.tool_calls)
                msg["content"] = text or None
            if reasoning or (job.prompt_opened and not text):
                msg["reasoning_content"] = reasoning
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": res.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": res.finish_reason}
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": m.model_id,
                             "system_fingerprint": None, "choices": [choice], "usage": self._usage(res)},
                            headers={SEED_HEADER: str(sp.seed)})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    path = request.url.path
    see = ("POST /v1/messages, POST /v1/messages/count_tokens" if path.startswith(ANTHROPIC_PATH + "/")
           else "GET /v1/models, POST /v1/chat/completions, POST /v1/messages")
    msg = {404: f"there is no endpoint {path} (see {see})",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return path_error(request.url.path, exc.status_code, msg, code=code, headers=getattr(exc, "headers", None),
                      anthropic=anthropic_client(request.headers))


def anthropic_client(headers) -> bool:
    """Whether request headers (a mapping, or ASGI's list of byte pairs) come from an Anthropic
    client: it sends ``anthropic-version`` on every request (and authenticates with
    ``x-api-key``, never ``Authorization``), so its errors on the shared endpoints
    (/v1/models) get Anthropic's shape."""
    if isinstance(headers, (list, tuple)):
        names = {k.decode("latin-1").lower() for k, _ in headers}
    else:
        names = {k.lower() for k in headers.keys()}
    return ANTHROPIC_VERSION_HEADER in names or ("x-api-key" in names and "authorization" not in names)


def path_error(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error", headers: dict | None = None,
               anthropic: bool = False) -> Response:
    """An error in the shape of the API ``path`` belongs to: Anthropic's for /v1/messages (and
    for an Anthropic client anywhere: ``anthropic``), OpenAI's elsewhere."""
    if anthropic or path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        from .anthropic_api import error_body as anthropic_error
        return _AsciiJSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    return error_response(status, message, param, code, type_, headers)


def _gate_error(path: str, status: int, message: str, code: str, anthropic: bool = False) -> Response:
    return path_error(path, status, message, code=code, anthropic=anthropic)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return path_error(request.url.path, exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers,
                      anthropic=anthropic_client(request.headers))


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client closed the connection while sending its body: nobody reads an answer, and it
    is not the server's fault (no traceback); /metrics counts it as 499, as nginx names it."""
    log.info("client closed the connection during %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("request failed: %s %s", request.method, request.url.path, exc_info=exc)
    return path_error(request.url.path, 500, f"internal server error ({type(exc).__name__}); see the server log",
                      code="internal_error", type_="server_error")


def build_app(api: Api, api_key: str = "", cors_origins: tuple[str, ...] = (), host: str = "127.0.0.1") -> Starlette:
    """The Starlette application of ``api``: routes, OpenAI-shaped error handlers, the request
    gate (engine/server/gate.py: Host, Origin, Content-Type), the API-key guard and, only when
    ``cors_origins`` are given, CORS for those origins."""
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
    ]
    middleware = [Middleware(RequestGate, host=host, cors_origins=cors_origins, error=_gate_error,
                             counted=lambda path, status: api.stats.on_request(endpoint_of(path), status))]
    if cors_origins:
        # the listed origins are the user's own pages: any request header (the official JS SDKs
        # send x-stainless-* and anthropic-dangerous-direct-browser-access on every request) and
        # Chrome's private-network preflight from a public page to this computer
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                                     expose_headers=[SEED_HEADER, "Retry-After"], allow_private_network=True))
    middleware.append(Middleware(_Guard, api_key=api_key, stats=api.stats))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone, Exception: _internal_error})
