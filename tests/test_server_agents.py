"""Agents against a running server: the official `openai` client doing tool conversations on tiny
random Qwen3-MoE, DeepSeek-V3, GLM-4.5 and gpt-oss models whose chat templates are written like
the published ones; the calls are forced through the grammar (tool_choice), so they are real
model output, parsed, and rendered back by the template exactly as the model wrote them.
Structured output: 50 json_schema answers of a random model all parse and validate."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
httpx2 = pytest.importorskip("httpx2")

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.server import LocalServer, ServerOptions  # noqa: E402

from server_helpers import ENGINE_KW  # noqa: E402
from tool_models import family_store  # noqa: E402

FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["query"],
                       "properties": {"query": {"type": "string", "maxLength": 16}}}}},
]
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: family_store(d, f) for f in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, stores):
    with Engine.open(EngineConfig(store=str(stores[request.param]), **ENGINE_KW)) as eng:
        srv = LocalServer.for_engine(eng, ServerOptions(port=0), SamplingParams(max_new_tokens=96))
        srv.start()
        try:
            yield request.param, eng, srv
        finally:
            srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)


def _schema(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_two_turn_tool_conversation(family):
    name, eng, srv = family
    c = _client(srv)
    model = srv.api.served().model_id
    first = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", seed=1)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", (name, choice)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "search")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, _schema(call.function.name))
    # what the model wrote is exactly what the template renders for the call sent back
    generated = eng.tokenizer.decode(list(eng._kv_ids[first.usage.prompt_tokens:]), skip_special_tokens=False)
    back = ASK + [{"role": "assistant", "content": choice.message.content,
                   "tool_calls": [call.model_dump(exclude_none=True)]}]
    from engine.server.openai_api import chat_messages, string_arguments
    msgs = chat_messages({"messages": back})
    head = eng.tokenizer.apply_chat_template(ASK, tools=TOOLS)
    try:
        again = eng.tokenizer.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=False)
    except Exception:
        again = eng.tokenizer.apply_chat_template(string_arguments(msgs), tools=TOOLS, add_generation_prompt=False)
    assert again.startswith(head + generated), (name, again[len(head):], generated)
    # turn 2: the tool's result, then an answer in words
    second = c.chat.completions.create(
        model=model, tools=TOOLS, tool_choice="none", max_tokens=8, seed=2,
        messages=back + [{"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}])
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)


def test_streamed_tool_call_and_named_function(family):
    name, eng, srv = family
    c = _client(srv)
    model = srv.api.served().model_id
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
              seed=3)
    whole = c.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "search"
    jsonschema.validate(json.loads(call.function.arguments), _schema("search"))
    parts, ids, names, reason, content = [], set(), set(), None, ""
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or ():
                assert tc.index == 0
                ids.add(tc.id)
                names.add(tc.function.name)
                parts.append(tc.function.arguments or "")
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert reason == "tool_calls" and names == {"search"} and len(ids) == 1
    assert "".join(parts) == call.function.arguments    # the same seed, the same call
    assert content == (whole.choices[0].message.content or "")


def test_tool_choice_none_puts_no_tools_in_the_prompt(family):
    name, eng, srv = family
    c = _client(srv)
    model = srv.api.served().model_id
    none = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    plain = c.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    auto = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="sometimes")


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


def test_json_schema_answers_all_validate(family):
    name, eng, srv = family
    if name != "qwen3_moe":
        pytest.skip("one family is enough for the 50 answers")
    c = _client(srv)
    model = srv.api.served().model_id
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(50):
        r = c.chat.completions.create(model=model, messages=ASK, response_format=rf, temperature=1.0, seed=seed,
                                      max_tokens=96)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = c.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"}, seed=0,
                                    max_tokens=96, temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=model, messages=ASK, response_format=bad, max_tokens=2)


# --- Anthropic's Messages API ------------------------------------------------------------------

anthropic = pytest.importorskip("anthropic")
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
A_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _anthropic(srv):
    return anthropic.Anthropic(base_url=srv.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)


def test_anthropic_two_turn_tool_conversation(family):
    name, eng, srv = family
    c = _anthropic(srv)
    model = srv.api.served().model_id
    first = c.messages.create(model=model, max_tokens=96, system="You are a helpful assistant.", messages=A_ASK,
                              tools=A_TOOLS, tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use", (name, first)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, _schema(uses[0].name))
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    generated = eng.tokenizer.decode(list(eng._kv_ids[first.usage.input_tokens:]), skip_special_tokens=False)
    # what the model wrote is what the template renders for the tool_use block sent back
    from engine.server.anthropic_api import to_chat
    from engine.server.openai_api import chat_messages, string_arguments
    sent = {"system": "You are a helpful assistant.", "max_tokens": 1, "tools": A_TOOLS,
            "messages": A_ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id}]}]}
    raw, fields = to_chat(sent)
    msgs = chat_messages({"messages": raw})[:-1]   # up to the assistant's call
    head = eng.tokenizer.apply_chat_template(msgs[:-1], tools=fields["tools"])
    try:
        again = eng.tokenizer.apply_chat_template(msgs, tools=fields["tools"], add_generation_prompt=False)
    except Exception:
        again = eng.tokenizer.apply_chat_template(string_arguments(msgs), tools=fields["tools"],
                                                  add_generation_prompt=False)
    assert again.startswith(head + generated), (name, again[len(head):], generated)
    second = c.messages.create(
        model=model, max_tokens=8, system="You are a helpful assistant.", tools=A_TOOLS,
        tool_choice={"type": "none"},
        messages=A_ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                        "content": '{"sky": "sunny"}'}]}])
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content if b.type != "thinking"] == ["text"]


def test_anthropic_streamed_tool_use_and_errors(family):
    name, eng, srv = family
    c = _anthropic(srv)
    model = srv.api.served().model_id
    kw = dict(model=model, max_tokens=96, messages=A_ASK, tools=A_TOOLS, tool_choice={"type": "tool", "name": "search"})
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.stop_reason == whole.stop_reason == "tool_use"
    got = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert got == [(b.name, b.input) for b in whole.content if b.type == "tool_use"] and got[0][0] == "search"
    assert final.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=model, max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx2.post(srv.url + "/messages", content=b'{"model": 1', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_anthropic_text_stop_sequences_and_streamed_text(family):
    name, eng, srv = family
    if name != "qwen3_moe":
        pytest.skip("plain text on one family")
    c = _anthropic(srv)
    model = srv.api.served().model_id
    kw = dict(model=model, max_tokens=24, messages=A_ASK, extra_body={"temperature": 0})
    full = c.messages.create(**kw)
    text = "".join(b.text for b in full.content if b.type == "text")
    with c.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
    assert streamed == text
    stop = text[len(text) // 2:][:2]
    assert len(stop) == 2
    cut = c.messages.create(stop_sequences=[stop], **kw)
    got = "".join(b.text for b in cut.content if b.type == "text")
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and got == text[:text.index(stop)]


def test_anthropic_client_lists_the_model(family):
    name, eng, srv = family
    if name != "qwen3_moe":
        pytest.skip("one family is enough")
    c = _anthropic(srv)
    page = c.models.list()
    (info,) = page.data
    assert info.id == srv.api.served().model_id and info.type == "model" and info.display_name == info.id
    assert info.created_at.year >= 2024 and page.has_more is False
    assert c.models.retrieve(info.id).id == info.id
    assert _client(srv).models.list().data[0].id == info.id   # the openai client reads the same list


def test_anthropic_prefill_and_count_tokens(family):
    """The anthropic client's prefill (a last assistant message) is continued through the
    family's template, and messages.count_tokens counts what messages.create gets."""
    name, eng, srv = family
    if name != "qwen3_moe":
        pytest.skip("one family: its template adds an empty think block before the last answer")
    c = _anthropic(srv)
    model = srv.api.served().model_id
    kw = dict(model=model, system="You are a helpful assistant.", tools=A_TOOLS,
              messages=A_ASK + [{"role": "assistant", "content": "It is sunny in"}])
    counted = c.messages.count_tokens(**kw)
    r = c.messages.create(max_tokens=4, extra_body={"temperature": 0}, **kw)
    assert r.usage.input_tokens == counted.input_tokens
    prompt = eng.tokenizer.decode(list(eng._kv_ids[:r.usage.input_tokens]), skip_special_tokens=False)
    head = eng.tokenizer.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}] + A_ASK,
                                             tools=[{"type": "function", "function": {
                                                 "name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in A_TOOLS])
    assert prompt == head + "<think>\n\n</think>\n\nIt is sunny in", prompt[len(head):]
    with c.messages.stream(max_tokens=4, extra_body={"temperature": 0}, **kw) as s:
        streamed = "".join(s.text_stream)
    assert streamed == "".join(b.text for b in r.content if b.type == "text")
    assert c.messages.count_tokens(model=model, messages=A_ASK).input_tokens < counted.input_tokens
    # thinking off: the template's enable_thinking=false closes the think block before the answer
    on = c.messages.count_tokens(model=model, messages=A_ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    off = c.messages.count_tokens(model=model, messages=A_ASK, thinking={"type": "disabled"})
    want = eng.tokenizer.encode_chat(A_ASK, enable_thinking=False)
    assert off.input_tokens == len(want) > on.input_tokens
    # the seed an answer reports reproduces it
    hot = {"temperature": 1.5}
    raw = c.messages.with_raw_response.create(model=model, max_tokens=6, messages=A_ASK, extra_body=hot)
    seed = int(raw.headers["x-colibri-seed"])
    again = c.messages.create(model=model, max_tokens=6, messages=A_ASK, extra_body={**hot, "seed": seed})
    assert again.content == raw.parse().content


def test_reasoning_settings_reach_the_template_or_are_refused(family):
    """OpenAI's reasoning_effort and Anthropic's thinking go to the template variable that
    holds them (gpt-oss: reasoning_effort; Qwen3 / GLM: enable_thinking), and are refused where
    the template has none (DeepSeek-V3's test template), never ignored."""
    name, eng, srv = family
    c, a = _client(srv), _anthropic(srv)
    model = srv.api.served().model_id
    if name == "gpt_oss":
        r = c.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="high")
        prompt = eng.tokenizer.decode(list(eng._kv_ids[:r.usage.prompt_tokens]), skip_special_tokens=False)
        assert "Reasoning: high" in prompt, prompt
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="minimal")
        assert e.value.body["param"] == "reasoning_effort"
        with pytest.raises(anthropic.BadRequestError) as e:   # gpt-oss always reasons
            a.messages.count_tokens(model=model, messages=A_ASK, thinking={"type": "disabled"})
        assert "always reasons" in e.value.body["error"]["message"]
        a.messages.count_tokens(model=model, messages=A_ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    elif name == "qwen3_moe":
        r = c.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="none")
        assert r.usage.prompt_tokens == len(eng.tokenizer.encode_chat(ASK, enable_thinking=False))
        r = c.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="low")
        assert r.usage.prompt_tokens == len(eng.tokenizer.encode_chat(ASK, enable_thinking=True))
    elif name == "deepseek_v3":
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=ASK, max_tokens=1, reasoning_effort="high")
        assert e.value.body["param"] == "reasoning_effort"
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model=model, max_tokens=2048, messages=A_ASK,
                              thinking={"type": "enabled", "budget_tokens": 1024})
        assert "no thinking switch" in e.value.body["error"]["message"]
    else:
        pytest.skip("three families cover the three kinds of template")


def test_anthropic_output_format_is_constrained_like_json_schema(family):
    name, eng, srv = family
    if name != "qwen3_moe":
        pytest.skip("one family is enough")
    a = _anthropic(srv)
    model = srv.api.served().model_id
    for seed in range(3):
        r = a.messages.create(model=model, max_tokens=96, messages=A_ASK, extra_body={
            "output_format": {"type": "json_schema", "schema": SCHEMA}, "seed": seed, "temperature": 1.0})
        text = "".join(b.text for b in r.content if b.type == "text")
        assert r.stop_reason == "end_turn", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=model, max_tokens=8, messages=A_ASK,
                          extra_body={"output_format": {"type": "json_schema", "schema": {"type": "nonsense"}}})
    assert "'output_format'" in e.value.body["error"]["message"], e.value.body
    # the SDK's own structured output (messages.parse with a pydantic model) sends output_config.format,
    # and its top-level cache_control hint is accepted without effect
    import typing

    import pydantic

    class Answer(pydantic.BaseModel):
        # fields whose type bounds them (the SDK moves string lengths into descriptions, and the
        # tiny random model would write one string to max_tokens)
        colour: typing.Literal["red", "green", "blue"]
        ok: bool

    r = a.messages.create(model=model, max_tokens=96, messages=A_ASK, cache_control={"type": "ephemeral"},
                          output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    text = "".join(b.text for b in r.content if b.type == "text")
    jsonschema.validate(json.loads(text), SCHEMA)
    parsed = a.messages.parse(model=model, max_tokens=96, messages=A_ASK, output_format=Answer)
    assert isinstance(parsed.parsed_output, Answer), parsed
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=model, max_tokens=8, messages=A_ASK, output_config={"task_budget": {"total": 9}})
    assert e.value.body["error"]["message"].startswith("output_config.task_budget"), e.value.body
