"""Function calls in answers: each family's format (tests/chat_templates/ and the published
formats) parsed into calls, streamed in pieces of any size, equal to what the template renders
back; malformed calls come back as text; tool_choice checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.chat_template import render
from engine.server.openai_api import ApiError, chat_messages, string_arguments, tool_calls_json
from engine.server.textstream import AnswerFilter
from engine.server.call_formats import Gemma4Format, HunyuanFormat, MiniMaxFormat, PythonicFormat
from engine.server.tools import (Call, CallSplitter, DeepSeekFormat, DsmlFormat, GlmFormat, HarmonyFormat, HermesFormat,
                                 KimiFormat, Llama4Format, MistralFormat, QwenCoderFormat, ToolsError, check_tool_choice,
                                 check_tools, tool_format)

TEMPLATES = Path(__file__).parent / "chat_templates"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "object"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
CALLS = [Call("get_weather", {"city": "Paris «x»", "days": 3, "units": {"t": "C"}}),
         Call("search", {"query": "7 > 5 and \"quotes\"\nnew line"})]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _assistant(calls, as_string=False):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False) if as_string
                      else c.arguments}} for i, c in enumerate(calls)]}


def _generated(src, msgs, eot, as_string=False):
    """What the model writes for its turn with ``CALLS``, as the template renders that turn."""
    prefix = render(src, "t", msgs, tools=TOOLS, add_generation_prompt=True, special_tokens=SPECIAL)
    full = render(src, "t", msgs + [_assistant(CALLS, as_string)], tools=TOOLS, special_tokens=SPECIAL)
    common = 0
    while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
        common += 1
    start = full.rfind("<", 0, common)
    if common < len(prefix) and start >= 0 and ">" not in full[start:common]:
        common = start   # Gemma 4's prompt ends in an empty thought channel the turn leaves out
    text = full[common:]
    return text[:text.index(eot)] if eot and eot in text else text


def _through_filter(fmt, text, size, chat=True):
    f = AnswerFilter((), chat=chat, calls=CallSplitter(fmt, TOOLS))
    parts = [f.push(text[i:i + size]) for i in range(0, len(text), size)]
    tail = f.flush()
    return "".join(p[0] for p in parts) + tail[0], "".join(p[1] for p in parts) + tail[1], f.calls


FAMILIES = [  # template, expected format, end of the model's turn, arguments given as strings
    ("qwen3_moe.jinja", HermesFormat, "<|im_end|>", False),
    ("deepseek_v3.jinja", DeepSeekFormat, "<｜end▁of▁sentence｜>", True),
    ("glm4_moe.jinja", GlmFormat, None, False),
    ("mixtral.jinja", MistralFormat, "</s>", False),
    ("llama4.jinja", Llama4Format, "<|eot|>", False),
    ("deepseek_v4.jinja", DsmlFormat, "<｜end▁of▁sentence｜>", False),
    ("gemma4.jinja", Gemma4Format, "<|tool_response>", False),
    ("minimax_m2.jinja", MiniMaxFormat, "[e~[", False),
    ("hunyuan_v1_moe.jinja", HunyuanFormat, "<|eos|>", False),
    ("granitemoehybrid.jinja", HermesFormat, "<|end_of_text|>", False),
]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("name,cls,eot,as_string", FAMILIES)
def test_calls_written_as_the_template_writes_them_are_parsed(name, cls, eot, as_string, size):
    src = (TEMPLATES / name).read_text()
    text = _generated(src, USER, eot, as_string)
    reasoning, content, calls = _through_filter(cls(), text, size)
    assert calls == CALLS, (text, calls)
    assert content.strip() == "" and reasoning == ""
    # the parsed calls, as a client sends them back, render the same turn again
    back = chat_messages({"messages": USER + [{"role": "assistant", "content": None,
                                               "tool_calls": tool_calls_json(calls)}]})
    try:
        again = render(src, "t", back, tools=TOOLS, special_tokens=SPECIAL)
    except Exception:
        again = render(src, "t", string_arguments(back), tools=TOOLS, special_tokens=SPECIAL)
    assert again == render(src, "t", USER + [_assistant(CALLS, as_string)], tools=TOOLS, special_tokens=SPECIAL)


def test_the_format_is_read_from_the_template():
    class Tok:
        def __init__(self, name):
            self.chat_templates = {"default": (TEMPLATES / name).read_text()}
            self._added = {}
    assert [type(tool_format(Tok(n))) for n, *_ in FAMILIES] == [c for _, c, *_ in FAMILIES]
    assert tool_format(Tok("olmoe.jinja")) is None and tool_format(Tok("ernie4_5_moe.jinja")) is None
    assert isinstance(tool_format(Tok("lfm2_moe.jinja")), PythonicFormat)


def test_harmony_calls_through_the_decoder(tmp_path):
    from test_gpt_oss import _harmony_folder
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(_harmony_folder(tmp_path))
    fmt = tool_format(tok)
    assert isinstance(fmt, HarmonyFormat)
    src = (TEMPLATES / "gpt_oss.jinja").read_text()
    msgs = USER + [{"role": "assistant", "content": "", "thinking": "I should look it up.",
                    "tool_calls": _assistant(CALLS[:1])["tool_calls"]}]
    prefix = render(src, "t", USER, tools=TOOLS, add_generation_prompt=True)
    full = render(src, "t", msgs, tools=TOOLS)
    text = full[len(prefix):]   # the analysis message, then the call ending in <|call|>
    assert text.startswith("<|channel|>analysis")
    ids = tok.encode(text)
    assert ids[-1] == tok.token_to_id("<|call|>")   # the end-of-turn token: not given to the decoder
    dec = fmt.decoder(tok)
    shown = "".join(dec.push(i) for i in ids[:-1]) + dec.flush()
    reasoning, content, calls = _through_filter(fmt, shown, 2)
    assert (reasoning, content, calls) == ("I should look it up.", "", CALLS[:1])


def test_a_prefilled_harmony_message_is_continued(tmp_path):
    """gpt-oss: a prefill leaves the prompt inside the final message, so the answer's first ids
    are its content (a fresh decoder would take them for a header and show nothing)."""
    from test_gpt_oss import _harmony_folder
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(_harmony_folder(tmp_path))
    ids = tok.encode_chat(USER + [{"role": "assistant", "content": "It is"}], continue_final_message=True)
    start, message = tok.token_to_id("<|start|>"), tok.token_to_id("<|message|>")
    header = ids[len(ids) - ids[::-1].index(start):len(ids) - 1 - ids[::-1].index(message)]
    assert tok.decode(header, skip_special_tokens=False) == "assistant<|channel|>final"
    answer = tok.encode(" sunny in Paris.") + [tok.token_to_id("<|return|>")]
    for fmt in (HarmonyFormat(header, show_calls=False), HarmonyFormat(header)):
        dec = fmt.decoder(tok)
        assert "".join(dec.push(i) for i in answer) + dec.flush() == " sunny in Paris."
    dec = HarmonyFormat(show_calls=False).decoder(tok)
    assert "".join(dec.push(i) for i in answer) + dec.flush() == ""   # what a fresh decoder shows


PUBLISHED = [  # the formats of families whose templates are not among the test templates
    (QwenCoderFormat(), "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis «x»\n</parameter>\n"
                        "<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n"
                        "</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n"
                        "7 > 5 and \"quotes\"\nnew line\n</parameter>\n</function>\n</tool_call>"),
    (DeepSeekFormat(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                       + json.dumps(CALLS[0].arguments, ensure_ascii=False) + "\n```<｜tool▁call▁end｜>\n"
                       "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
                       + json.dumps(CALLS[1].arguments) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    (KimiFormat(), "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                   "<|tool_call_argument_begin|>" + json.dumps(CALLS[0].arguments) + "<|tool_call_end|>"
                   "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
                   + json.dumps(CALLS[1].arguments) + "<|tool_call_end|><|tool_calls_section_end|>"),
    (MistralFormat(), "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(CALLS[0].arguments)
                      + "[TOOL_CALLS]search[ARGS]" + json.dumps(CALLS[1].arguments)),
    (Llama4Format(), "\n".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in CALLS)),
    (DsmlFormat(), "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"  # V3.2's encoding
                   "<｜DSML｜parameter name=\"city\" string=\"true\">Paris «x»</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"units\" string=\"false\">{\"t\": \"C\"}</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" "
                   "string=\"true\">7 > 5 and \"quotes\"\nnew line</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                   "</｜DSML｜function_calls>"),
    (PythonicFormat(), "<|tool_call_start|>[get_weather(city=\"Paris «x»\", days=3, units={\"t\": \"C\"}), "  # LFM2's
                       "search(query='7 > 5 and \"quotes\"\\nnew line')]<|tool_call_end|>"),
    (Gemma4Format(), '<|tool_call>call:get_weather{city:<|"|>Paris «x»<|"|>, days: 3,units:{t:<|"|>C<|"|>}}<tool_call|>'
                     '<|tool_call>call:search{query:<|"|>7 > 5 and "quotes"\nnew line<|"|>}<tool_call|><|tool_response>'),
]


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("case", range(len(PUBLISHED)))
def test_published_formats(case, size):
    fmt, text = PUBLISHED[case]
    _, content, calls = _through_filter(fmt, "Let me check.\n" + text, size, chat=False)
    assert calls == CALLS and content.strip() == "Let me check."


@pytest.mark.parametrize("fmt,text", [
    (HermesFormat(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    (HermesFormat(), "<tool_call>\nnot json\n</tool_call>"),
    (HermesFormat(), '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    (GlmFormat(), "<tool_call>get weather now\n<arg_key>city</arg_key>"),
    (DeepSeekFormat(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{}<｜tool▁call▁end｜>"),
    (MistralFormat(), "[TOOL_CALLS] [{\"name\": 3}]"),
    (KimiFormat(), "<|tool_calls_section_begin|><|tool_call_begin|>functions.x:0 {}"),
    (Llama4Format(), '{"name": "get_weather", "parameters": "Paris"}'),
    (DsmlFormat(), '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                   '<｜DSML｜parameter name="days" string="false">three</｜DSML｜parameter>\n</｜DSML｜invoke>'),
    (Llama4Format(), '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Par'),
    (Gemma4Format(), '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'),
    (Gemma4Format(), '<|tool_call>call:get_weather{city:Paris}<tool_call|>'),
    (Gemma4Format(), '<|tool_call>get_weather{days:3}<tool_call|>'),
    (MiniMaxFormat(), '<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">x</parameter>oops</invoke>'),
    (MiniMaxFormat(), '<minimax:tool_call>\nnot a call\n</minimax:tool_call>'),
    (HunyuanFormat(), '<tool_calls>[{"name": "search", "arguments": "x"}]</tool_calls>'),
    (HunyuanFormat(), '<tool_calls>{"name": "search"'),
    (PythonicFormat(), '<|tool_call_start|>[search(__import__("os").system("x"))]<|tool_call_end|>'),
    (PythonicFormat(), '<|tool_call_start|>[search(query=open("f").read())]<|tool_call_end|>'),
])
def test_a_malformed_call_is_returned_as_text(fmt, text):
    _, content, calls = _through_filter(fmt, "Sure. " + text, 3, chat=False)
    assert calls == [] and content == "Sure. " + text


def test_text_that_only_looks_like_a_start_is_content():
    _, content, calls = _through_filter(HermesFormat(), "a <tool and <tool_ca more", 2, chat=False)
    assert (content, calls) == ("a <tool and <tool_ca more", [])


def test_tool_choice_and_tools_checks():
    assert check_tool_choice(None, TOOLS).mode == "auto"
    assert check_tool_choice(None, None).mode == "none"
    assert check_tool_choice("none", TOOLS).mode == "none"
    assert check_tool_choice({"type": "function", "function": {"name": "search"}}, TOOLS).name == "search"
    for bad in ("sometimes", 3, {"type": "function"}, {"type": "function", "function": {"name": "nope"}}, []):
        with pytest.raises(ToolsError):
            check_tool_choice(bad, TOOLS)
    with pytest.raises(ToolsError):
        check_tool_choice("required", None)
    for bad in ("x", [3], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
                [TOOLS[0], TOOLS[0]], [{"type": "function", "function": {"name": "f", "parameters": []}}]):
        with pytest.raises(ToolsError):
            check_tools(bad)
    with pytest.raises(ApiError):
        chat_messages({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]})


def test_a_stop_string_in_the_analysis_channel_leaves_the_reasoning_whole(tmp_path):
    """gpt-oss: the analysis channel streams as reasoning; a stop string written there does not
    end the answer, one in the final channel does."""
    from test_gpt_oss import _harmony_folder
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(_harmony_folder(tmp_path))
    ids = tok.encode("<|channel|>analysis<|message|>Is 7 prime? It has no divisor.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>Yes, 7 is prime. No divisor.")
    dec = tok.incremental_decoder()
    f = AnswerFilter(("divisor",), chat=True)
    parts = [f.push(dec.push(i)) for i in ids]
    tail = f.flush()
    assert "".join(p[0] for p in parts) + tail[0] == "Is 7 prime? It has no divisor."
    assert "".join(p[1] for p in parts) + tail[1] == "Yes, 7 is prime. No "
    assert f.stopped
    # a stop string only in the reasoning leaves reasoning and answer whole
    dec, f = tok.incremental_decoder(), AnswerFilter(("Is 7",), chat=True)
    parts = [f.push(dec.push(i)) for i in ids]
    tail = f.flush()
    assert "".join(p[0] for p in parts) + tail[0] == "Is 7 prime? It has no divisor."
    assert "".join(p[1] for p in parts) + tail[1] == "Yes, 7 is prime. No divisor." and not f.stopped


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_tool_turns_render_as_transformers_renders_them(family, tmp_path):
    """A tool conversation as the server gives it to the template (arguments as objects, or as
    JSON strings for templates that concatenate them) renders as transformers renders it."""
    transformers = pytest.importorskip("transformers")
    from tool_models import write_family_tokenizer
    from engine.tokenizer import Tokenizer
    write_family_tokenizer(tmp_path, family)
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    body = {"messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": tool_calls_json(CALLS[:1])},
        {"role": "tool", "tool_call_id": "x", "content": '{"sky": "sunny"}'},
        {"role": "user", "content": "And tomorrow?"}]}
    msgs = chat_messages(body)
    try:
        text = ours.apply_chat_template(msgs, tools=TOOLS)
    except Exception:
        msgs = string_arguments(msgs)
        text = ours.apply_chat_template(msgs, tools=TOOLS)
    want = theirs.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == want
    assert json.dumps(CALLS[0].arguments, ensure_ascii=False) in text or "<arg_key>city</arg_key>" in text


def test_bench_grammar_writes_its_results(tmp_path, capsys):
    from engine.cli import main
    assert main(["bench", "grammar", "--runs", "1", "--max-tokens", "12", "--big-vocab", "0", "--no-xgrammar",
                 "--out-dir", str(tmp_path), "--name", "g"]) == 0
    d = json.loads((tmp_path / "g.json").read_text())
    libs = {r["library"] for r in d["rows"]}
    assert libs == {"llguidance", "llguidance as used"} and all(r["tokens"] > 0 for r in d["rows"])
    assert "mask µs median" in (tmp_path / "g.md").read_text()


def test_template_errors_name_the_model_not_the_store_folder(tmp_path):
    """A chat template that refuses a conversation: the client is told the model's name and
    the template's reason, never where the server keeps the model on disk."""
    import asyncio

    from engine import SamplingParams
    from engine.server.openai_api import Api, ServedModel
    from engine.tokenizer import Tokenizer
    from tool_models import write_family_tokenizer
    folder = tmp_path / "models" / "store-folder-7"
    folder.mkdir(parents=True)
    write_family_tokenizer(folder, "qwen3_moe")
    (folder / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ messages[0].content }}")
    tok = Tokenizer.from_dir(folder)
    m = ServedModel("pretty-model", tok, 4096, 384, 0, None)
    api = Api(lambda: m, None, None, SamplingParams(), 1 << 20)
    with pytest.raises(ApiError) as e:
        asyncio.run(api.prepare_chat(m, {}, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert e.value.param == "messages" and "roles must alternate" in e.value.message
    assert "'pretty-model'" in e.value.message and str(tmp_path) not in e.value.message, e.value.message
