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
