"""Gemma 4's thought channel shown as reasoning: the decoder (engine/thought_channel.py), the
engine's streamed text, the server's reasoning_content (its AnswerFilter, with and without a call
format; the app's collapsed view in tests/app/test_chat_view.py), on a tokenizer with Gemma 4's markers and its
published template (tests/chat_templates/gemma4.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import convert_checkpoint
from engine.bench.synthetic import gemma4_text_config, write_checkpoint
from engine.chat_template import split_reasoning
from engine.config import EngineConfig
from engine.events import ChatMessage, Finished, GenerateRequest, SamplingParams, TokenEvent
from engine.generate import Engine
from engine.server.call_formats import Gemma4Format
from engine.server.textstream import AnswerFilter
from engine.server.tools import Call, CallSplitter, tool_format
from engine.thought_channel import ThoughtChannelDecoder
from engine.tokenizer import Tokenizer

TEMPLATE = Path(__file__).parent / "chat_templates" / "gemma4.jinja"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
           "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
REASONING = "7 has no divisor between 2 and 6."
ANSWER = "Yes, 7 is prime."
# what Gemma 4 writes with thinking on: the thought channel, then the answer, then the turn's end
THOUGHT = f"<|channel>thought\n{REASONING}\n<channel|>{ANSWER}<turn|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def gemma_folder(d: Path) -> Path:
    """A tokenizer folder with Gemma 4's markers as special tokens (byte-level BPE of under 300
    ids, the tiny config's vocabulary) and its published template; eos <turn|> and <eos>."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    d.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"thought {REASONING} {ANSWER} Is 7 prime? call get_weather city Paris"] * 5, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    assert tok.get_vocab_size() <= 300
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(TEMPLATE.read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in ("<eos>", "<turn|>")]}))
    return d


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(gemma_folder(tmp_path_factory.mktemp("gemma-tok")))


def _stream(dec, ids) -> str:
    return "".join(dec.push(i) for i in ids) + dec.flush()


def test_thought_channel_becomes_a_think_block(tok):
    ids = tok.encode(THOUGHT)
    assert tok.token_to_id("<|channel>") in ids and ids[-1] == tok.token_to_id("<turn|>")
    dec = tok.incremental_decoder()
    assert isinstance(dec, ThoughtChannelDecoder)
    text = _stream(dec, ids[:-1])   # the engine stops at the eos <turn|> before decoding it
    assert text == f"<think>{REASONING}\n</think>{ANSWER}"
    assert split_reasoning(text) == (REASONING, ANSWER)
    # the plain decode runs the channel's name and the reasoning into the answer
    assert tok.decode(ids[:-1]) == f"thought\n{REASONING}\n{ANSWER}"
    # cut while thinking: all reasoning, no answer; the name alone shows nothing yet
    assert split_reasoning(_stream(tok.incremental_decoder(), ids[:6])) [1] == ""
    assert _stream(tok.incremental_decoder(), tok.encode("<|channel>thought")) == "<think>"
    # thinking off: the prompt ends in an empty channel and the answer is all content
    assert _stream(tok.incremental_decoder(), tok.encode(ANSWER)) == ANSWER
    # an empty channel the model writes itself, and the special tokens shown (a call format)
    assert _stream(tok.incremental_decoder(), tok.encode(f"<|channel>thought<channel|>{ANSWER}")) \
        == f"<think></think>{ANSWER}"
    raw = tok.incremental_decoder(skip_special_tokens=False)
    assert _stream(raw, ids) == f"<think>{REASONING}\n</think>{ANSWER}<turn|>"
    # a <channel|> with no channel open (a model's stray marker) is a plain special token, not a
    # "</think>" in the answer; shown as itself with the special tokens
    assert _stream(tok.incremental_decoder(), tok.encode(f"{ANSWER}<channel|>{ANSWER}")) == ANSWER + ANSWER
    assert _stream(tok.incremental_decoder(skip_special_tokens=False), tok.encode(f"{ANSWER}<channel|>")) \
        == f"{ANSWER}<channel|>"


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_server_gives_the_thought_channel_as_reasoning_content(tok, size):
    """The server's answer filter (reasoning_content and content, as the OpenAI and Anthropic
    endpoints send them) on the engine's streamed text, and on the call format's raw decode."""
    ids = tok.encode(THOUGHT)[:-1]
    dec = tok.incremental_decoder()
    text = "".join(dec.push(i) for i in ids) + dec.flush()
    f = AnswerFilter((), chat=True)
    parts = [f.push(text[i:i + size]) for i in range(0, len(text), size)]
    tail = f.flush()
    assert "".join(p[0] for p in parts) + tail[0] == REASONING
    assert "".join(p[1] for p in parts) + tail[1] == ANSWER
    # with tools: Gemma 4's call after its thought, decoded with the markers shown
    fmt = tool_format(tok)
    assert isinstance(fmt, Gemma4Format)
    call = tok.encode(f'<|channel>thought\n{REASONING}\n<channel|><|tool_call>call:get_weather{{city:<|"|>Paris<|"|>}}'
                      "<tool_call|>")
    shown = _stream(fmt.decoder(tok), call)
    f = AnswerFilter((), chat=True, calls=CallSplitter(fmt, TOOLS))
    parts = [f.push(shown[i:i + size]) for i in range(0, len(shown), size)]
    tail = f.flush()
    assert "".join(p[0] for p in parts) + tail[0] == REASONING
    assert ("".join(p[1] for p in parts) + tail[1]).strip() == ""
    assert f.calls == [Call("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def gemma_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma-store")
    ck = write_checkpoint(d / "ck", gemma4_text_config(num_hidden_layers=2, vocab_size=300), seed=5, tokenizer=False)
    gemma_folder(ck)
    return convert_checkpoint(ck, d / "st", quant="int8")


def test_engine_streams_the_thought_channel_as_reasoning(gemma_store):
    """A Gemma 4 store chatting with thinking on: the prompt ends at the model's turn, the
    forced answer streams as a <think> block then the answer, and the next turn renders the
    answer without its reasoning (the template drops old thoughts)."""
    with Engine.open(EngineConfig(store=str(gemma_store), history=False, o_direct=False, cap=2, pilot=0)) as eng:
        msgs = (ChatMessage("user", "Is 7 prime?"),)
        prompt = eng.tokenizer.encode_chat(msgs, enable_thinking=True)   # as the server renders it
        assert eng.tokenizer.decode(prompt, skip_special_tokens=False).endswith("<|turn>model\n")
        forced = tuple(eng.tokenizer.encode(THOUGHT))
        req = GenerateRequest(prompt_ids=tuple(prompt), forced_ids=forced,
                              sampling=SamplingParams(max_new_tokens=len(forced)))
        events = list(eng.generate(req))
        fin = events[-1]
        assert isinstance(fin, Finished) and fin.error == "", fin
        assert fin.text == "".join(e.text for e in events if isinstance(e, TokenEvent))
        assert split_reasoning(fin.text) == (REASONING, ANSWER)
        nxt = eng.tokenizer.apply_chat_template(msgs + (ChatMessage("assistant", fin.text), ChatMessage("user", "9?")))
        assert f"<|turn>model\n{ANSWER}<turn|>\n<|turn>user\n9?" in nxt and "divisor" not in nxt

