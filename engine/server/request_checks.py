"""The request side of the HTTP API, shared by the OpenAI endpoints (openai_api.py) and
Anthropic's Messages API (anthropic_api.py): the known fields of each body, bodies read and
parsed with limits, sampling parameters and stop strings checked by the settings table, chat
messages and tool results checked, the chat template's variables (reasoning effort), and the
OpenAI-shaped error (``ApiError``). Every refusal names the field and what to do.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import ConfigError, EngineError
from ..events import SamplingParams
from ..sampling import fresh_seed
from ..settings import setting
from .tools import ToolsError, arguments_as, check_tool_calls

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
class PendingModel:
    """The model a server is opening: the id and aliases it will answer to once it is open
    (what ServedModel.from_engine will say), listed at GET /v1/models while it loads."""

    model_id: str
    aliases: tuple[str, ...] = ()
    created: int = 0

    @classmethod
    def from_store(cls, store) -> "PendingModel | None":
        """Of the store folder ``store``, from its manifest.json alone (``model_name``, else the
        folder's name, as the engine names it); None when the folder holds no readable manifest."""
        from pathlib import Path
        folder = Path(store).name
        try:
            manifest = json.loads((Path(store) / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict):
            return None
        name = manifest.get("model_name", folder) or folder
        return cls(model_id=name, aliases=(folder,) if folder != name else (), created=int(time.time()))


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
