"""A chat that keeps going: the context limit of the model is enforced, the
oldest turns are dropped when a conversation no longer fits (never the system prompt), the
answer is capped by the room left, and a trimmed chat still reuses its prefill."""

from __future__ import annotations

import pytest

from engine import ChatMessage, ConfigError, ContextOverflowError, Engine, EngineConfig, Finished, GenerateRequest
from engine.events import SamplingParams


def _cfg(store, **kw):
    return EngineConfig(store=str(store), pilot=0, pinning=False, history=False, o_direct=False, **kw)


def _finish(eng, req) -> Finished:
    return [e for e in eng.generate(req) if isinstance(e, Finished)][-1]


def _chat(n_turns: int, words: int = 40, system: str = "You are terse.") -> list[ChatMessage]:
    msgs = [ChatMessage("system", system)]
    for i in range(n_turns):
        msgs.append(ChatMessage("user", f"question {i} " + "abc " * words))
        msgs.append(ChatMessage("assistant", f"answer {i} " + "xyz " * words))
    return msgs


def test_context_above_the_model_limit_is_refused(tiny_store):
    """max_position_embeddings is 2048 for the tiny model: 4096 is refused with both numbers."""
    with pytest.raises(ConfigError) as e:
        Engine.open(_cfg(tiny_store, context_length=4096))
    msg = str(e.value)
    assert "4096" in msg and "2048" in msg and "trained" in msg
    with Engine.open(_cfg(tiny_store, context_length=2048)) as eng:   # the limit itself is fine
        assert eng.context_length == 2048 and eng.loaded.max_context == 2048


def test_cli_run_refuses_a_context_above_the_limit(tiny_store, capsys):
    from engine.cli.main import main
    rc = main(["run", "--model", str(tiny_store), "--prompt", "hi", "--context-length", "9000",
               "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and "2048" in err and "Traceback" not in err


def test_long_chat_drops_the_oldest_turns_keeps_the_system_prompt(tiny_store):
    with Engine.open(_cfg(tiny_store, context_length=256)) as eng:
        msgs = _chat(6) + [ChatMessage("user", "the last question")]
        full = eng.tokenizer.encode_chat(tuple(msgs))
        assert len(full) > 256        # the whole chat does not fit
        sp = SamplingParams(max_new_tokens=256)   # as long as the context: the setting
        fin = _finish(eng, GenerateRequest(messages=tuple(msgs), sampling=sp))
        assert fin.finish_reason != "error", fin.error
        assert fin.dropped_messages >= 2 and fin.dropped_messages % 2 == 0   # whole exchanges
        kept = tuple(msgs[:1]) + tuple(msgs[1 + fin.dropped_messages:])
        assert fin.prompt_tokens == len(eng.tokenizer.encode_chat(kept))
        # the answer was allowed the room the context has left, no more
        assert fin.answer_room == min(256, 256 - fin.prompt_tokens)
        assert fin.prompt_tokens + fin.generated_tokens <= 256
        # room for the answer: at least min(max_new_tokens, context / 4)
        assert 256 - fin.prompt_tokens >= 64


def test_chat_goes_on_after_a_long_answer(tiny_store):
    """max_new_tokens = context: after a long answer the next message still gets an answer."""
    with Engine.open(_cfg(tiny_store, context_length=192)) as eng:
        sp = SamplingParams(max_new_tokens=192)
        msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "tell me a long story")]
        first = _finish(eng, GenerateRequest(messages=tuple(msgs), sampling=sp,
                                             forced_ids=tuple([40] * 150)))
        assert first.generated_tokens >= 140
        msgs += [ChatMessage("assistant", first.text), ChatMessage("user", "and then?")]
        for _ in range(3):   # and the one after, and the one after that
            fin = _finish(eng, GenerateRequest(messages=tuple(msgs), sampling=SamplingParams(max_new_tokens=192)))
            assert fin.finish_reason != "error", fin.error
            assert fin.dropped_messages >= 2
            msgs += [ChatMessage("assistant", fin.text or "ok"), ChatMessage("user", "more")]


def test_trimmed_chat_still_reuses_the_prefill(tiny_store):
    """The next turn of a trimmed chat drops the same turns, so the KV rows are reused."""
    with Engine.open(_cfg(tiny_store, context_length=256)) as eng:
        starts = []
        fwd = eng.model.forward

        def spy(ids, start, **kw):
            starts.append((start, len(ids)))
            return fwd(ids, start, **kw)
        eng.model.forward = spy
        msgs = _chat(6, words=30) + [ChatMessage("user", "next")]
        sp = SamplingParams(max_new_tokens=8)
        fin1 = _finish(eng, GenerateRequest(messages=tuple(msgs), sampling=sp))
        assert fin1.dropped_messages > 0
        msgs += [ChatMessage("assistant", fin1.text or "ok"), ChatMessage("user", "one more")]
        starts.clear()
        fin2 = _finish(eng, GenerateRequest(messages=tuple(msgs), sampling=sp))
        assert fin2.dropped_messages == fin1.dropped_messages
        start, n = starts[0]   # the prefill of the second turn starts after the reused rows
        assert start > fin1.prompt_tokens // 2 and start + n == fin2.prompt_tokens


def test_one_message_too_long_is_refused_without_pointing_past_the_limit(tiny_store):
    with Engine.open(_cfg(tiny_store, context_length=2048)) as eng:   # already the model's limit
        huge = (ChatMessage("user", "abc " * 3000),)
        with pytest.raises(ContextOverflowError) as e:
            eng.generate(GenerateRequest(messages=huge))
        msg = str(e.value)
        assert "raise the context" not in msg and "2048" in msg
    with Engine.open(_cfg(tiny_store, context_length=128)) as eng:   # below the limit: say how far
        with pytest.raises(ContextOverflowError) as e:
            eng.generate(GenerateRequest(messages=(ChatMessage("user", "abc " * 200),)))
        assert "raise the context length" in str(e.value) and "2048" in str(e.value)


@pytest.mark.parametrize("paste_chars", [2000, 200_000])
def test_a_too_long_last_message_is_encoded_once(tiny_store, monkeypatch, paste_chars):
    """Encoding a long paste is the expensive part of refusing it. One that surely cannot fit
    (more characters than the context times the longest vocabulary entry) is encoded once,
    alone; a shorter one that does not fit: the whole chat, then the last question alone (what
    the refusal counts), never a third time. Either way the refusal counts the same tokens."""
    with Engine.open(_cfg(tiny_store, context_length=256)) as eng:
        calls = []
        encode = eng.tokenizer.encode
        monkeypatch.setattr(eng.tokenizer, "encode", lambda text, *a, **k: (calls.append(len(text)), encode(text, *a, **k))[1])
        paste = ("abc " * paste_chars)[:paste_chars]
        msgs = tuple(_chat(2, words=5)) + (ChatMessage("user", paste),)
        with pytest.raises(ContextOverflowError) as e:
            eng.generate(GenerateRequest(messages=msgs))
        big = len([n for n in calls if n >= paste_chars])
        alone = len(eng.tokenizer.encode_chat((msgs[0], msgs[-1])))
        assert f"has {alone} tokens" in str(e.value)
        surely = paste_chars > 256 * eng.tokenizer.max_token_chars
        assert big == (1 if surely else 2)
        assert surely == (paste_chars == 200_000)
