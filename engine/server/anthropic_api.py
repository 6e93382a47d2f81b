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

from .openai_api import ApiError, chat_messages, read_json

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 421: "permission_error", 429: "rate_limit_error",
               503: "overloaded_error"}
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
        for b in content:
            if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise _bad(f"{where}: only text blocks are supported here (got {kind!r})", where)
            parts.append(b["text"])
        return "\n".join(parts)
    raise _bad(f"{where} must be a string or a list of text blocks", where)


def to_chat(body: dict) -> tuple[list[dict], dict]:
    """An Anthropic request -> (messages in the OpenAI form chat_messages reads, the OpenAI
    fields: max_tokens, temperature, top_p, top_k, stop, tools, tool_choice, stream).
    Raises ApiError (400) naming the field."""
    msgs: list[dict] = []
    if body.get("system") is not None:
        msgs.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of {\"role\", \"content\"}", "messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must have 'role' \"user\" or \"assistant\"", f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        text, calls, thinking = [], [], []
        for j, b in enumerate(content):
            w = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_result" and m["role"] == "user" and isinstance(b.get("tool_use_id"), str):
                msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                             "content": _text_of(b.get("content"), f"{w}.content")})
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str) \
                    and isinstance(b.get("id"), str) and isinstance(b.get("input", {}), dict):
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            else:
                raise _bad(f"{w}: unsupported content block {kind!r} for role {m['role']!r} (text, tool_use, "
                           f"tool_result and thinking are)", w)
        if text or calls or thinking or m["role"] == "assistant":
            d: dict[str, Any] = {"role": m["role"], "content": "".join(text) if m["role"] == "assistant"
                                 else "\n".join(text)}
            if calls:
                d["tool_calls"] = calls
            if thinking:
                d["reasoning_content"] = "\n".join(thinking)
            msgs.append(d)
    fields: dict[str, Any] = {}
    if body.get("max_tokens") is None:  # absent or null: the Messages API requires it
        raise _bad("'max_tokens' is required", "max_tokens")
    for k in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if k in body:
            fields[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        fields["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        conv = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise _bad(f"tools[{k}] must have a 'name' and an 'input_schema'", f"tools[{k}]")
            conv.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("input_schema") if t.get("input_schema") is not None else {"type": "object"}}})
        fields["tools"] = conv
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind == "auto":
            fields["tool_choice"] = "auto"
        elif kind == "any":
            fields["tool_choice"] = "required"
        elif kind == "none":
            fields["tool_choice"] = "none"
        elif kind == "tool" and isinstance(tc.get("name"), str):
            fields["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        else:
            raise _bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                       "\"name\": ...}", "tool_choice")
    return msgs, fields


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


async def messages(api, request: Request) -> Response:
    """``POST /v1/messages``."""
    body = await read_json(request, api.max_body_bytes)
    m = api.model_for(body)
    raw, fields = to_chat(body)
    msgs = chat_messages({"messages": raw})
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    plan = await api.prepare_chat(m, fields, msgs)
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
                                                             "output_tokens": res.completion_tokens}})
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
                    yield {"event": "error", "data": json.dumps(error_body(500, msg))}
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

    return EventSourceResponse(events(), sep="\n", ping=15)
