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
import secrets
import time
from typing import Callable

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
from ..errors import EngineError
from ..events import SamplingParams
from ..harmony import is_harmony
from .gate import RequestGate
from .grammar import GrammarError, call_grammar, compile_checked, json_grammar, schema_of
from .jobs import Job, JobQueue, QueueFull
from .request_checks import (ANTHROPIC_PATH, ANTHROPIC_VERSION_HEADER, CHAT_FIELDS, COMPLETION_FIELDS,  # noqa: F401
                             ENDPOINTS, RESERVED_TEMPLATE_VARIABLES, SEED_HEADER, ApiError, ChatPlan, ServedModel,
                             PendingModel, _AsciiJSONResponse, _named, _tools_unwritten, _ToolsNotRendered,
                             chat_messages, check_fields, check_tool_results, error_body, error_response, read_json,
                             reasoning_kwargs, sampling_from, stops_from, stream_flags, string_arguments,
                             tool_calls_json)
from .tools import HarmonyFormat, ToolsError, check_tool_choice, check_tools, tool_format
from .stats import ServerStats, exposition

log = logging.getLogger(__name__)

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


class Api:
    """The endpoints over a model provider and a job queue.

    Args:
        served: () -> ServedModel | None (None while no model is open: 503).
        loading: () -> PendingModel | None, the model being opened while ``served`` gives None
            (listed at /v1/models; its requests get 503 model_not_ready with Retry-After).
        queue: the JobQueue that runs generations one at a time.
        stats: ServerStats.
        defaults: SamplingParams used where a request gives no value (the server's flags).
        max_body_bytes: request body limit (413 above it).
    """

    def __init__(self, served: Callable[[], ServedModel | None], queue: JobQueue, stats: ServerStats,
                 defaults: SamplingParams, max_body_bytes: int,
                 loading: Callable[[], PendingModel | None] | None = None):
        self.served, self.queue, self.stats = served, queue, stats
        self.loading = loading or (lambda: None)
        self.defaults, self.max_body_bytes = defaults, int(max_body_bytes)

    # --- helpers -----------------------------------------------------------------------------

    def model_for(self, body: dict | None = None) -> ServedModel:
        m = self.served()
        named = m or self.loading()
        if body is not None:
            want = body.get("model")
            if want is not None and not isinstance(want, str):
                raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
            if named is not None and want and want != named.model_id and want not in named.aliases:
                raise ApiError(404, f"the model {want!r} does not exist here; this server serves "
                                    f"{named.model_id!r} (GET /v1/models)", param="model", code="model_not_found")
        if m is None:
            what = (f"the model {named.model_id!r} is still loading" if named else
                    "no model is open yet (the app is loading or switching models)")
            raise ApiError(503, f"{what}; retry shortly",
                           code="model_not_ready", type_="server_error", headers={"Retry-After": "2"})
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
        named = m or self.loading()
        body = {"status": "ok" if m else "loading", "model": named.model_id if named else None,
                "queue_depth": self.queue.depth, "busy": self.queue.busy}
        return JSONResponse(body, status_code=200 if m else 503, headers=None if m else {"Retry-After": "2"})

    async def metrics(self, request: Request) -> Response:
        data = await run_in_threadpool(exposition, self.stats, self.queue,
                                       lambda: (self.served() or ServedModel("", None, 0, 0, 0, None)).model_id)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_obj(self, m: ServedModel | PendingModel) -> dict:
        # OpenAI's model object and Anthropic's (type, display_name, created_at) in one: both SDKs
        # list models at GET /v1/models; a model still loading has no context length yet
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created))
        obj = {"id": m.model_id, "object": "model", "created": m.created, "owned_by": "colibri", "type": "model",
               "display_name": m.model_id, "created_at": created_at}
        if isinstance(m, ServedModel):
            obj.update(context_length=m.context_length, max_input_tokens=m.context_length)
        else:
            obj["status"] = "loading"
        return obj

    async def models(self, request: Request) -> Response:
        m = self.served() or self.loading()
        ids = [m.model_id] if m else []
        return JSONResponse({"object": "list", "data": [self._model_obj(m)] if m else [], "has_more": False,
                             "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        m = self.served() or self.loading()
        if m is None:
            self.model_for()  # 503 model_not_ready
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
