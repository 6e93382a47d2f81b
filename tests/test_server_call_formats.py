"""Function calls of Gemma 4, MiniMax-M2 and Hunyuan-A13B through the official `openai` client:
tiny random models with the families' published chat templates (tests/chat_templates/), calls
forced through the grammar (tool_choice), so they are real model output in each family's own
syntax (Gemma 4's call:N{k:<|"|>v<|"|>}, MiniMax-M2's <invoke> blocks after an empty <think>
block, Hunyuan's JSON list), parsed into OpenAI tool_calls, whole and streamed, and written back
by the template exactly as the model wrote them."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("httpx2")

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.server import LocalServer, ServerOptions  # noqa: E402
from engine.server.call_formats import Gemma4Format, HunyuanFormat, MiniMaxFormat  # noqa: E402
from engine.server.grammar import _turn_text  # noqa: E402
from engine.server.tools import tool_format  # noqa: E402

from server_helpers import ENGINE_KW  # noqa: E402
from test_server_agents import ASK, TOOLS, _schema  # noqa: E402
from tool_models import family_store  # noqa: E402

FAMILIES = {"gemma4": Gemma4Format, "minimax_m2": MiniMaxFormat, "hunyuan_v1_moe": HunyuanFormat}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    return {f: family_store(d, f) for f in FAMILIES}


@pytest.fixture(scope="module", params=list(FAMILIES))
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


def test_forced_call_in_the_family_syntax_round_trips(family):
    name, eng, srv = family
    tok = eng.tokenizer
    assert isinstance(tool_format(tok), FAMILIES[name])
    c = _client(srv)
    model = srv.api.served().model_id
    r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                   max_tokens=400)   # MiniMax-M2's markup is long in a 300-token vocabulary
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (name, choice)
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, _schema(call.function.name))
    generated = tok.decode(list(eng._kv_ids[r.usage.prompt_tokens:]), skip_special_tokens=False)
    # the parsed call, as the template writes it for the turn, is what the model wrote
    eos = [tok.id_to_token(i) for i in tok.eos_ids]
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token") if getattr(tok, k, None)}
    again = _turn_text(tok.chat_template_source(tools=TOOLS), ASK,
                       {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}},
                       TOOLS, special, {}, eos, tuple(tok.added_tokens))
    assert generated.startswith(again) and generated[len(again):] in ["", *eos], (name, generated, again)
    marker = {"gemma4": "<|tool_call>call:", "minimax_m2": "<invoke name=", "hunyuan_v1_moe": "<tool_calls>["}[name]
    assert marker in generated


def test_streamed_named_call_equals_the_whole_one(family):
    name, eng, srv = family
    c = _client(srv)
    model = srv.api.served().model_id
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              seed=3, max_tokens=400)
    whole = c.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _schema("get_weather"))
    parts, names, reason, content = [], set(), None, ""
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or ():
                names.add(tc.function.name)
                parts.append(tc.function.arguments or "")
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert reason == "tool_calls" and names == {"get_weather"}
    assert "".join(parts) == call.function.arguments
    assert content == (whole.choices[0].message.content or "")
