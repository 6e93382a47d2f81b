"""Anthropic's Messages API, ``POST /v1/messages``, on the same job queue as the OpenAI endpoints.

A request is turned into the template messages and OpenAI-style fields the chat endpoint reads
(:func:`to_chat`), prepared by :meth:`engine.server.openai_api.Api.prepare_chat` (prompt,
sampling, call parsing, grammar) and answered in Anthropic's shapes: a ``message`` with
``thinking`` / ``text`` / ``tool_use`` content blocks, ``stop_reason`` ``end_turn`` /
``max_tokens`` / ``stop_sequence`` / ``tool_use``, ``usage`` ``input_tokens`` /
``output_tokens``; streamed as the events ``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop`` (and ``error``). Refusals use
Anthropic's error body ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .request_checks import SEED_HEADER, ApiError, chat_messages, read_json, reasoning_kwargs, template_reads
from ..harmony import is_harmony

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 421: "permission_error", 429: "rate_limit_error",
               431: "request_too_large", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _text_of(content: Any, where: str) -> str:
    """A tool_result's or system's content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for k, b in enumerate(content):
            w = f"{where}[{k}]"
            if isinstance(b, dict) and b.get("type") == "text":
                if not isinstance(b.get("text"), str):
                    raise _bad(f"{w}.text must be a string", f"{w}.text")
                parts.append(b["text"])
                continue
            kind = b.get("type") if isinstance(b, dict) and isinstance(b.get("type"), str) else None
            if kind is None:
                raise _bad(f"{w} must be a text block {{\"type\": \"text\", \"text\": ...}}", w)
            raise _bad(f"{w}: {kind} blocks are not supported here (this server reads text blocks)", w)
        return "\n".join(parts)
    raise _bad(f"{where} must be a string or a list of text blocks", where)


UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload", "server_tool_use",
                      "web_search_tool_result")


#: the request fields read here (``seed`` is an extension); any other is refused, naming it.
#: ``metadata``, ``service_tier`` and ``cache_control`` (a prompt-caching hint: the engine reuses a
#: chat's prefix on its own) change no answer and are accepted without effect.
FIELDS = frozenset(("model", "messages", "system", "max_tokens", "metadata", "stop_sequences", "stream",
                    "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier", "seed",
                    "output_format", "output_config", "cache_control"))
OUTPUT_CONFIG_FIELDS = frozenset(("format", "effort"))
EFFORTS = ("low", "medium", "high")   # output_config.effort values a template's reasoning setting can take
MIN_THINKING_BUDGET = 1024   # the Messages API's smallest budget_tokens


def _check_fields(d: dict, known: frozenset, where: str = "") -> None:
    for k, v in d.items():
        # null is "not given" (SDKs that spell out every parameter send the unset ones as null)
        if k not in known and v is not None:
            raise _bad(f"{where}{k}: Extra inputs are not permitted (this server does not know the field, and "
                       f"ignoring it could change what you asked for; remove it)", f"{where}{k}")


def _effort_kwargs(model, effort: Any) -> dict:
    """``output_config.effort`` as template variables: OpenAI's ``reasoning_effort`` rule
    (request_checks.reasoning_kwargs), refused with the Messages API's field name. Raises ApiError (400)."""
    if effort not in EFFORTS:
        raise _bad(f"'output_config.effort' = {effort!r}: this server takes low, medium or high", "output_config.effort")
    if model is None:  # no template to read (a body checked without a model)
        raise _bad("'output_config.effort': no model to read a reasoning setting from; leave it out",
                   "output_config.effort")
    try:
        return reasoning_kwargs(model, effort)
    except ApiError as e:
        raise _bad(e.message.replace("'reasoning_effort'", "'output_config.effort'"), "output_config.effort") from None


def _empty(content: Any) -> bool:
    return content == "" or content == []


def to_chat(body: dict, count_only: bool = False, model=None) -> tuple[list[dict], dict]:
    """An Anthropic request -> (messages in the OpenAI form chat_messages reads, the OpenAI
    fields: max_tokens, temperature, top_p, top_k, stop, tools, tool_choice, stream). A last
    message of role ``assistant`` with text is a prefill: the answer continues it (the messages
    then end with it and ``fields["prefill"]`` is True). ``count_only``: the request of
    /v1/messages/count_tokens (no ``max_tokens``). ``model``: the ServedModel (its template decides
    whether ``thinking`` can be honoured). Raises ApiError (400) naming the field with the
    Messages API's names."""
    _check_fields(body, FIELDS)   # count_tokens takes the same body (its extra fields count nothing)
    msgs: list[dict] = []
    use_ids: set[str] = set()
    if body.get("system") is not None:
        msgs.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of {\"role\", \"content\"}", "messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must have 'role' \"user\" or \"assistant\" (a system prompt goes in the "
                       f"request's 'system')", f"{where}.role")
        _check_fields(m, frozenset(("role", "content")), f"{where}.")
        role, content = m["role"], m.get("content")
        if content is None:
            raise _bad(f"{where}.content is missing: give the message's text or a list of content blocks",
                       f"{where}.content")
        last = i == len(raw) - 1
        if _empty(content) and not (last and role == "assistant"):
            raise _bad(f"{where}.content is empty: give the message's text or at least one content block "
                       f"(only a final assistant message may be empty)", f"{where}.content")
        if isinstance(content, str):
            if content or role == "user":
                msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        text, calls, thinking = [], [], []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise _bad(f"{w} must be a content block: an object with a 'type' (text, tool_use, tool_result, "
                           f"thinking)", w)
            kind = b["type"]
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise _bad(f"{w}.text must be a string", f"{w}.text")
                text.append(b["text"])
            elif kind == "tool_result":
                if role != "user":
                    raise _bad(f"{w}: a tool_result block belongs in a user message (it answers the assistant's "
                               f"tool_use)", w)
                if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                    raise _bad(f"{w}.tool_use_id must be the id of the tool_use block it answers", f"{w}.tool_use_id")
                if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                    raise _bad(f"{w}.is_error must be true or false", f"{w}.is_error")
                result = _text_of(b.get("content"), f"{w}.content")
                if b["tool_use_id"] not in use_ids:
                    raise _bad(f"{w}.tool_use_id {b['tool_use_id']!r}: no earlier assistant message has a tool_use "
                               f"block with this id; a tool_result answers one (or send the tool's output as a "
                               f"text block)", f"{w}.tool_use_id")
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind == "tool_use":
                if role != "assistant":
                    raise _bad(f"{w}: a tool_use block belongs in an assistant message (the model's call); a "
                               f"tool's answer goes back in a tool_result block of a user message", w)
                if not isinstance(b.get("id"), str) or not b["id"]:
                    raise _bad(f"{w}.id must be a non-empty string (the id tool_result blocks refer to)", f"{w}.id")
                if not isinstance(b.get("name"), str) or not b["name"]:
                    raise _bad(f"{w}.name must be the tool's name", f"{w}.name")
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise _bad(f"{w}.input must be an object (the tool's arguments), got "
                               f"{_json_type(args)}", f"{w}.input")
                calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
                use_ids.add(b["id"])
            elif kind in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    raise _bad(f"{w}: a {kind} block belongs in an assistant message", w)
                if kind == "thinking":
                    if not isinstance(b.get("thinking"), str):
                        raise _bad(f"{w}.thinking must be a string", f"{w}.thinking")
                    thinking.append(b["thinking"])
            elif kind in UNSUPPORTED_BLOCKS:
                raise _bad(f"{w}: {kind} blocks are not supported by this server (it reads text: text, tool_use, "
                           f"tool_result and thinking blocks)", w)
            else:
                raise _bad(f"{w}: unknown content block type {kind!r} (text, tool_use, tool_result and thinking "
                           f"are supported)", w)
        if text or calls or thinking:
            d: dict[str, Any] = {"role": role, "content": "".join(text) if role == "assistant" else "\n".join(text)}
            if calls:
                d["tool_calls"] = calls
            if thinking:
                d["reasoning_content"] = "\n".join(thinking)
            msgs.append(d)
    fields: dict[str, Any] = {}
    final = raw[-1]
    if final["role"] == "assistant" and msgs and msgs[-1]["role"] == "assistant":
        if msgs[-1].get("tool_calls"):
            raise _bad(f"messages[{len(raw) - 1}] is an assistant message with tool_use blocks at the end of the "
                       f"conversation: send each tool's answer in a tool_result block of a following user message",
                       f"messages[{len(raw) - 1}]")
        if msgs[-1]["content"]:
            fields["prefill"] = True   # the answer continues this text
        else:                          # only thinking: nothing to continue, a fresh answer
            msgs.pop()
    if not count_only and body.get("max_tokens") is None:  # absent or null: the Messages API requires it
        raise _bad("'max_tokens' is required", "max_tokens")
    # seed: an extension (Anthropic's API has none), so that the seed an answer reports
    # (x-colibri-seed) can reproduce it
    for k in ("temperature", "top_p", "top_k", "seed", "stream") + (() if count_only else ("max_tokens",)):
        if k in body:
            fields[k] = body[k]
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise _bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": "
                       "\"disabled\"}", "thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int):
                raise _bad("thinking.budget_tokens: an integer is required with \"type\": \"enabled\"",
                           "thinking.budget_tokens")
            if budget < MIN_THINKING_BUDGET:
                raise _bad(f"thinking.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
                           "thinking.budget_tokens")
            mt = body.get("max_tokens")
            if not count_only and isinstance(mt, int) and budget >= mt:
                raise _bad(f"`max_tokens` must be greater than `thinking.budget_tokens` ({budget}); the budget is "
                           f"part of max_tokens", "thinking.budget_tokens")
        if model is None or template_reads(model, "enable_thinking"):
            # the templates of reasoning models that can answer without it read enable_thinking
            fields["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
        elif is_harmony(model.tokenizer):
            if kind == "disabled":   # gpt-oss always reasons (its analysis channel)
                raise _bad(f"'thinking' {{\"type\": \"disabled\"}}: the model {model.model_id!r} always reasons before "
                           f"it answers (its template has no switch to turn it off); leave 'thinking' out",
                           "thinking")
        elif kind == "enabled":
            raise _bad(f"'thinking' {{\"type\": \"enabled\"}}: the chat template of the model {model.model_id!r} has no "
                       f"thinking switch (enable_thinking), so the model cannot be asked to think; leave 'thinking' "
                       f"out (a model that reasons on its own still returns a thinking block)", "thinking")
    of, of_name = body.get("output_format"), "output_format"
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise _bad("'output_config' must be an object with 'format' and/or 'effort'", "output_config")
        _check_fields(oc, OUTPUT_CONFIG_FIELDS, "output_config.")
        if oc.get("format") is not None:
            if of is not None:
                raise _bad("give the output format once: in 'output_config.format' or in 'output_format'",
                           "output_config.format")
            of, of_name = oc["format"], "output_config.format"
        effort = oc.get("effort")
        if effort is not None:
            # an explicit 'thinking' setting wins over the effort's switch
            fields["chat_template_kwargs"] = {**_effort_kwargs(model, effort),
                                              **fields.get("chat_template_kwargs", {})}
    if of is not None:
        # structured output: the same constrained decoding as OpenAI's json_schema
        if not isinstance(of, dict) or of.get("type") != "json_schema" or not isinstance(of.get("schema"), dict):
            raise _bad(f"'{of_name}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", of_name)
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": of["schema"],
                                                                            "strict": True}}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        fields["stop"] = stops
    names: list[str] = []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")
        conv = []
        for k, t in enumerate(tools):
            w = f"tools[{k}]"
            if not isinstance(t, dict):
                raise _bad(f"{w} must be an object with 'name', 'description' and 'input_schema'", w)
            if t.get("type") not in (None, "custom"):
                raise _bad(f"{w}: the tool type {t['type']!r} (a tool run by Anthropic's servers) is not available "
                           f"here; give your own tools as {{\"name\", \"description\", \"input_schema\"}}", f"{w}.type")
            name = t.get("name")
            if not isinstance(name, str) or not name or len(name) > 128:
                raise _bad(f"{w}.name must be a non-empty string (at most 128 characters)", f"{w}.name")
            if name in names:
                raise _bad(f"{w}: the tool name {name!r} is given twice", f"{w}.name")
            names.append(name)
            if t.get("description") is not None and not isinstance(t["description"], str):
                raise _bad(f"{w}.description must be a string", f"{w}.description")
            schema = t.get("input_schema")
            if schema is not None and not isinstance(schema, dict):
                raise _bad(f"{w}.input_schema must be a JSON schema object, e.g. {{\"type\": \"object\", "
                           f"\"properties\": {{...}}}}", f"{w}.input_schema")
            conv.append({"type": "function", "function": {
                "name": name, "description": t.get("description") or "",
                "parameters": schema if schema is not None else {"type": "object"}}})
        fields["tools"] = conv
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is not None \
                and not isinstance(tc["disable_parallel_tool_use"], bool):
            raise _bad("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice")
        if kind in ("any", "tool") and not names:
            shown = "{\"type\": \"any\"}" if kind == "any" else "{\"type\": \"tool\", ...}"
            raise _bad(f"'tool_choice' {shown} asks for a tool call, but the request has no 'tools': list the tools "
                       f"the model may call in 'tools' (name, description, input_schema), or leave 'tool_choice' "
                       f"out for a plain answer", "tool_choice")
        if kind == "auto":
            fields["tool_choice"] = "auto"
        elif kind == "any":
            fields["tool_choice"] = "required"
        elif kind == "none":
            fields["tool_choice"] = "none"
        elif kind == "tool" and isinstance(tc.get("name"), str):
            if tc["name"] not in names:
                raise _bad(f"'tool_choice' names the tool {tc['name']!r}, which is not among the 'tools' "
                           f"({', '.join(map(repr, names))}): name one of them or add it to 'tools'", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        else:
            raise _bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                       "\"name\": ...}", "tool_choice")
    return msgs, fields


def _json_type(v: Any) -> str:
    return {str: "a string", list: "an array", bool: "a boolean", type(None): "null", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _blocks(reasoning: str, text: str, calls) -> list[dict]:
    out = []
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        out.append({"type": "text", "text": text})
    out += [{"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": c.name, "input": c.arguments}
            for c in calls]
    return out


def _stop(res) -> tuple[str, str | None]:
    if res.stop_sequence:
        return "stop_sequence", res.stop_sequence
    return STOP_REASONS.get(res.finish_reason, "end_turn"), None


async def _prepare(api, m, fields: dict, msgs: list[dict], count_only: bool = False):
    """api.prepare_chat with a refusal of the structured output named ``output_format``."""
    try:
        return await api.prepare_chat(m, fields, msgs, anthropic=True, count_only=count_only)
    except ApiError as e:
        if e.param == "response_format":
            e.param = "output_format"
            e.message = e.message.replace("'response_format'", "'output_format'")
        raise


async def messages(api, request: Request) -> Response:
    """``POST /v1/messages``."""
    body = await read_json(request, api.max_body_bytes)
    m = api.model_for(body)
    raw, fields = to_chat(body, model=m)
    msgs = chat_messages({"messages": raw})
    stream = fields.pop("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    plan = await _prepare(api, m, fields, msgs)
    headers = {SEED_HEADER: str(plan.sampling.seed)}
    mid = "msg_" + secrets.token_hex(12)
    if not stream:
        got = await api.collect(request, m, plan.ids, plan.sampling, plan.stops, True, plan.opened, plan.docs,
                                plan.calls, plan.constraint)
        if got is None:
            return Response(status_code=499)
        job, reasoning, text = got
        res = job.result
        reason, seq = _stop(res)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": m.model_id,
                             "content": _blocks(reasoning, text, res.tool_calls), "stop_reason": reason,
                             "stop_sequence": seq, "usage": {"input_tokens": res.prompt_tokens,
                                                             "output_tokens": res.completion_tokens}},
                            headers=headers)
    job, q = api.stream_queue(m, plan.ids, plan.sampling, plan.stops, True, plan.opened, plan.docs, plan.calls,
                              plan.constraint)

    def ev(name: str, data: dict) -> dict:
        return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}

    async def events():
        index, open_kind = -1, None
        try:
            yield ev("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": m.model_id, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(plan.ids), "output_tokens": 0}}})
            while True:
                item = await q.get()
                if item[0] == "delta":
                    for kind, piece in (("thinking", item[1]), ("text", item[2])):
                        if not piece:
                            continue
                        if open_kind != kind:
                            if open_kind is not None:
                                yield ev("content_block_stop", {"index": index})
                            index, open_kind = index + 1, kind
                            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                                else {"type": "text", "text": ""}
                            yield ev("content_block_start", {"index": index, "content_block": start})
                        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" \
                            else {"type": "text_delta", "text": piece}
                        yield ev("content_block_delta", {"index": index, "delta": delta})
                    continue
                res = item[1]
                if open_kind is not None:
                    yield ev("content_block_stop", {"index": index})
                if res.finish_reason in ("error", "cancelled"):
                    msg = res.error or "the generation was cancelled (the server is stopping)"
                    status = res.status if res.status >= 400 else 503 if res.finish_reason == "cancelled" else 500
                    yield {"event": "error", "data": json.dumps(error_body(status, msg))}
                    return
                for c in res.tool_calls:
                    index += 1
                    yield ev("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": c.name, "input": {}}})
                    yield ev("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}})
                    yield ev("content_block_stop", {"index": index})
                if index < 0:   # an empty answer still has one (empty) text block
                    yield ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    yield ev("content_block_stop", {"index": 0})
                reason, seq = _stop(res)
                yield ev("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                           "usage": {"output_tokens": res.completion_tokens}})
                yield ev("message_stop", {})
                return
        finally:
            if job.state != "done":
                job.client_gone()
                api.queue.withdraw(job)

    return EventSourceResponse(events(), sep="\n", ping=15, headers=headers)


async def count_tokens(api, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the tokens the request's prompt has ({"input_tokens":
    N}), rendered as /v1/messages renders it (system, messages, tools) and counted with the
    model's tokenizer; nothing is generated."""
    body = await read_json(request, api.max_body_bytes)
    m = api.model_for(body)
    raw, fields = to_chat(body, count_only=True, model=m)
    msgs = chat_messages({"messages": raw})
    plan = await _prepare(api, m, fields, msgs, count_only=True)
    return JSONResponse({"input_tokens": len(plan.ids)})
