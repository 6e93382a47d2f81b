"""`colibri serve`: the real server on a free loopback port, spoken to with the official `openai`
client (and raw HTTP for what the client cannot send), on the bundled default model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

from engine import ConfigError, Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine.library import default_model_dir  # noqa: E402
from engine.server import LocalServer, ServerOptions  # noqa: E402
from engine.server.textstream import AnswerFilter, ReasoningSplitter, StopMatcher  # noqa: E402
from engine import split_reasoning  # noqa: E402

from server_helpers import (ENGINE_FLAGS, ENGINE_KW, LONG_PROMPT, SHORT_PROMPT, Background, HeldForward, SlowDown,  # noqa: E402
                            metrics, wait_until)

ROOT = Path(__file__).resolve().parent.parent
MODEL = default_model_dir()
pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="default model missing")
MAX = 16


@pytest.fixture(scope="session")
def default_store(tmp_path_factory):
    """The bundled default model converted (int8, as the app does) into a temp dir."""
    from engine import convert_checkpoint
    return str(convert_checkpoint(MODEL, tmp_path_factory.mktemp("default") / "stdlib-int8", quant="int8"))


@pytest.fixture(scope="module")
def engine(default_store):
    with Engine.open(EngineConfig(store=default_store, **ENGINE_KW)) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    srv = LocalServer.for_engine(engine, ServerOptions(port=0), SamplingParams(max_new_tokens=MAX))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(q: str) -> list[dict]:
    return [{"role": "system", "content": "You answer questions about Python."}, {"role": "user", "content": q}]


def chat_ids(engine, msgs) -> list[int]:
    """The prompt the server gives the model for ``msgs``: the chat template with the
    documentation lookup's block before each user message (the default model ships an index;
    engine.docs_lookup), as the app and ``colibri run`` do."""
    from engine.docs_lookup import with_docs_each
    return engine.tokenizer.encode_chat(with_docs_each(msgs, engine.docs.search) if engine.docs else msgs)


def direct(engine, **req) -> Finished:
    """The engine's own answer (no server) for the same request."""
    fin = None
    for ev in engine.generate(GenerateRequest(**req)):
        if isinstance(ev, Finished):
            fin = ev
    return fin


def streamed(stream) -> tuple[str, str | None, object]:
    text, reason, usage = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = getattr(c, "delta", None)
            piece = piece.content if piece is not None else c.text
            text.append(piece or "")
            reason = c.finish_reason or reason
    return "".join(text), reason, usage


# --- chat: streamed == whole, usage, stop, seed, length ----------------------------------------


def test_chat_streamed_equals_whole_and_usage_is_our_tokenizers(client, engine, server):
    msgs = chat(LONG_PROMPT)
    whole = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, temperature=0)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    s, reason, usage = streamed(client.chat.completions.create(
        model="colibri-stdlib-moe", messages=msgs, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert s == text and len(text) > 10
    assert reason == whole.choices[0].finish_reason == "length"     # the long answer runs to max_tokens
    ids = chat_ids(engine, msgs)
    ref = direct(engine, prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=MAX))
    for u in (whole.usage, usage):
        assert u.prompt_tokens == len(ids)
        assert u.completion_tokens == ref.generated_tokens == len(ref.token_ids) == MAX
        assert u.total_tokens == len(ids) + MAX
    assert ref.text == text
    short = client.chat.completions.create(model="colibri-stdlib-moe", messages=chat(SHORT_PROMPT), max_tokens=64)
    assert short.choices[0].finish_reason == "stop"   # the end-of-turn token
    assert short.usage.completion_tokens < 64


def test_documentation_lookup_as_in_the_app_and_off_on_request(client, engine):
    """The server gives the model the documentation lookup's entries as the app does (the same
    answer as the engine's own generate), and ``docs_lookup: false`` sends the plain chat."""
    from engine import ChatMessage
    msgs = [{"role": "user", "content": "What does `json.dumps` do?"}]
    r = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, temperature=0, max_tokens=12)
    ref = direct(engine, messages=(ChatMessage("user", msgs[0]["content"]),),
                 sampling=SamplingParams(max_new_tokens=12))
    assert ref.sources[0] == "json.dumps" and r.usage.prompt_tokens == ref.prompt_tokens == len(chat_ids(engine, msgs))
    assert r.choices[0].message.content == ref.text
    off = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, temperature=0, max_tokens=2,
                                         extra_body={"docs_lookup": False})
    assert off.usage.prompt_tokens == len(engine.tokenizer.encode_chat(msgs)) < r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="docs_lookup"):
        client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, max_tokens=2,
                                       extra_body={"docs_lookup": "yes"})
    # a question that fits only without the entries is answered without them, not refused
    text = "How do I copy a file with shutil?"
    while len(engine.tokenizer.encode_chat([{"role": "user", "content": text + " please"}])) < engine.context_length - 20:
        text += " please"
    long = [{"role": "user", "content": text}]
    assert len(chat_ids(engine, long)) >= engine.context_length
    r = client.chat.completions.create(model="colibri-stdlib-moe", messages=long, max_tokens=2)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode_chat(long))


def test_stop_strings_end_the_answer(client):
    msgs = chat(LONG_PROMPT)
    full = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs).choices[0].message.content
    words = re.findall(r"[A-Za-z_]{4,}", full)
    stop = words[1]
    want = full[:full.index(stop)]
    r = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, stop=[stop, "zzzz-never"])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < MAX
    s, reason, _ = streamed(client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, stop=stop,
                                                           stream=True))
    assert (s, reason) == (want, "stop")


def test_seed_reproduces_a_sampled_answer(client):
    kw = dict(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT), temperature=1.2, top_p=0.95)
    a = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (11, 11, 12, 13)]
    assert a[0] == a[1]
    assert len(set(a[1:])) > 1   # other seeds draw other answers (three at 1.2 never all agree)


def test_max_tokens_and_max_completion_tokens(client):
    for kw in ({"max_tokens": 3}, {"max_completion_tokens": 3}, {"max_tokens": 50, "max_completion_tokens": 3}):
        r = client.chat.completions.create(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT), **kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3, kw


def test_completions_raw_prompt(client, engine):
    prompt = "def read_csv(path):\n    "  # the bundled model continues it past 8 tokens
    r = client.completions.create(model="colibri-stdlib-moe", prompt=prompt, max_tokens=8)
    ref = direct(engine, prompt=prompt, sampling=SamplingParams(max_new_tokens=8))
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt)) and r.usage.completion_tokens == 8
    s, reason, _ = streamed(client.completions.create(model="colibri-stdlib-moe", prompt=prompt, max_tokens=8,
                                                      stream=True))
    assert (s, reason) == (ref.text, "length")
    ids = client.completions.create(model="colibri-stdlib-moe", prompt=engine.tokenizer.encode(prompt), max_tokens=8)
    assert ids.choices[0].text == ref.text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["colibri-stdlib-moe"]
    assert client.models.retrieve("colibri-stdlib-moe").id == "colibri-stdlib-moe"
    h = httpx2.get(server.url.removesuffix("/v1") + "/health").json()
    assert h["status"] == "ok" and h["model"] == "colibri-stdlib-moe"


def test_multi_turn_prefills_only_the_new_tokens(client, engine, server):
    msgs = chat("What does `os.path.join` do?")
    r1 = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs)
    ids1 = chat_ids(engine, msgs)
    rows1 = list(engine._kv_ids)  # the KV rows turn 1 left: its prompt and the answer's tokens
    assert rows1[:len(ids1)] == ids1 and len(rows1) >= len(ids1) + r1.usage.completion_tokens - 1
    msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "And `os.path.split`?"}]
    client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs2)
    ids2 = chat_ids(engine, msgs2)
    m = metrics(server.url)
    # the KV rows of turn 1 are reused as they are, up to where the answer's text, tokenized
    # again inside the new prompt, first differs from the ids the model generated (a model may
    # emit a name in pieces the tokenizer would merge: the default model's training splits
    # names on purpose); at least the whole of turn 1's prompt is reused
    same = next((i for i, (a, b) in enumerate(zip(rows1, ids2)) if a != b), min(len(rows1), len(ids2)))
    assert same >= len(ids1)
    assert m["colibri_last_prompt_tokens"] == len(ids2)
    assert m["colibri_last_prefill_tokens"] == len(ids2) - same


# --- one engine, many clients --------------------------------------------------------------------


def test_two_clients_queue_fifo_and_metrics_show_it(client, engine, server):
    slow = HeldForward()  # the first client's answer holds until the second one is queued
    engine.model.subscribe(slow)
    try:
        before = metrics(server.url)
        kw = dict(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT), max_tokens=12)
        a = Background(lambda: client.chat.completions.create(**kw))
        b = Background(lambda: client.chat.completions.create(**kw))
        seen = []
        a.start()
        assert wait_until(lambda: metrics(server.url)["colibri_requests_running"] == 1)
        b.start()
        assert wait_until(lambda: (seen.append(metrics(server.url)) or
                                   seen[-1]["colibri_queue_depth"] == 1 and seen[-1]["colibri_requests_running"] == 1))
        slow.go.set()
        a.join(600)
        b.join(600)
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.result.choices[0].message.content == b.result.choices[0].message.content
        after = metrics(server.url)
        assert after["colibri_queue_depth"] == 0
        key = "colibri_requests_total{endpoint=/v1/chat/completions,status=200}"
        assert after[key] - before.get(key, 0) == 2
    finally:
        slow.go.set()
        engine.model.unsubscribe(slow)


def test_queue_full_is_503_with_retry_after(engine):
    slow = HeldForward()  # the first client's answer holds until the third one was refused
    srv = LocalServer.for_engine(engine, ServerOptions(port=0, max_waiting=1), SamplingParams(max_new_tokens=10))
    srv.start()
    engine.model.subscribe(slow)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=600)
        kw = dict(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT))
        a = Background(lambda: c.chat.completions.create(**kw))
        a.start()
        assert wait_until(lambda: srv.queue.busy)
        b = Background(lambda: c.chat.completions.create(**kw))
        b.start()
        assert wait_until(lambda: srv.queue.depth == 1)
        r = httpx2.post(srv.url + "/chat/completions", json=kw, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        slow.go.set()
        a.join(600)
        b.join(600)
        assert a.error is None and b.error is None
        assert metrics(srv.url)["colibri_queue_rejected_total"] == 1
    finally:
        slow.go.set()
        engine.model.unsubscribe(slow)
        srv.stop()


def test_disconnect_mid_stream_frees_the_engine_within_one_token(engine, server):
    slow = SlowDown(0.05)
    engine.model.subscribe(slow)
    try:
        before = metrics(server.url).get("colibri_generations_total{reason=cancelled}", 0)
        body = {"model": "colibri-stdlib-moe", "messages": chat(LONG_PROMPT), "max_tokens": 400, "stream": True}
        with httpx2.Client(timeout=60) as h:
            with h.stream("POST", server.url + "/chat/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                lines = r.iter_lines()
                got = 0
                for line in lines:
                    if line.startswith("data: {") and '"content":' in line:
                        got += 1
                        if got == 3:
                            break
        # the client is gone: the engine is free again after at most one more token
        assert wait_until(lambda: not server.queue.busy, timeout_s=600)  # only a hang trips it
        m = metrics(server.url)
        assert m["colibri_generations_total{reason=cancelled}"] == before + 1
        assert m["colibri_cancel_overrun_tokens"] <= 1
    finally:
        engine.model.unsubscribe(slow)
    # and the next client is served at once
    r = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0).chat.completions.create(
        model="colibri-stdlib-moe", messages=chat(SHORT_PROMPT))
    assert r.choices[0].message.content


# --- bad input: 4xx with an OpenAI error body, never a 500 ---------------------------------------


def _bad(server, body, status=400, raw=None, headers=None):
    r = httpx2.post(server.url + "/chat/completions", json=body if raw is None else None,
                    content=raw, headers=headers or {"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert "Traceback" not in r.text
    return err


def test_each_bad_input_is_a_4xx_with_an_openai_error(server, client):
    ok = {"model": "colibri-stdlib-moe", "messages": [{"role": "user", "content": "hi"}]}
    assert _bad(server, None, raw=b"{not json")["code"] == "invalid_json"
    assert _bad(server, None, raw=b"[1, 2]")["code"] == "invalid_json"
    assert _bad(server, {**ok, "model": "gpt-17"}, 404)["code"] == "model_not_found"
    long = {**ok, "messages": [{"role": "user", "content": "word " * 3000}]}
    assert _bad(server, long)["code"] == "context_length_exceeded"
    for param, value in (("temperature", -1), ("temperature", 9), ("temperature", "hot"), ("top_p", 0),
                         ("top_p", 1.5), ("max_tokens", 0), ("max_tokens", 2.5), ("max_completion_tokens", -3),
                         ("seed", -1), ("n", 2), ("stop", ["a", "b", "c", "d", "e"]), ("stop", 7),
                         ("stream", "yes"), ("presence_penalty", 0.5), ("logprobs", True),
                         ("response_format", {"type": "xml"})):
        err = _bad(server, {**ok, param: value})
        assert err["param"] == param, (param, value, err)
    assert _bad(server, {**ok, "messages": []})["param"] == "messages"
    assert _bad(server, {**ok, "messages": [{"role": "robot", "content": "x"}]})["param"] == "messages[0].role"
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert _bad(server, {**ok, "messages": img})["code"] == "unsupported_content"
    assert _bad(server, None, 413, raw=b'{"x": "' + b"a" * (5 << 20) + b'"}')["code"] == "request_too_large"
    r = httpx2.post(server.url + "/completions", json={"model": "colibri-stdlib-moe", "prompt": [999999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx2.get(server.url + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx2.get(server.url + "/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # the official client sees them as its typed errors
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="colibri-stdlib-moe", messages=[{"role": "user", "content": "x"}],
                                       temperature=7)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_api_key_required_when_set(engine):
    srv = LocalServer.for_engine(engine, ServerOptions(port=0, api_key="s3cret-key"), SamplingParams(max_new_tokens=4))
    srv.start()
    try:
        msgs = [{"role": "user", "content": "hi"}]
        for key in ("wrong-key!", "s3cret-ke", "s3cret-key-longer"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=srv.url, api_key=key, max_retries=0).chat.completions.create(
                    model="colibri-stdlib-moe", messages=msgs)
        assert httpx2.get(srv.url + "/models").status_code == 401
        assert httpx2.get(srv.url.removesuffix("/v1") + "/metrics").status_code == 401
        assert httpx2.get(srv.url.removesuffix("/v1") + "/health").status_code == 200   # liveness stays open
        r = openai.OpenAI(base_url=srv.url, api_key="s3cret-key", max_retries=0).chat.completions.create(
            model="colibri-stdlib-moe", messages=msgs)
        assert r.choices[0].message.role == "assistant"
    finally:
        srv.stop()


def test_safe_defaults():
    assert ServerOptions().host == "127.0.0.1"
    for host in ("0.0.0.0", "192.168.1.5", "::", "example.org"):
        with pytest.raises(ConfigError, match="--api-key"):
            ServerOptions(host=host).validated()
    ServerOptions(host="0.0.0.0", api_key="long-enough-key").validated()
    ServerOptions(host="localhost").validated()
    ServerOptions(host="::1").validated()
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--host", "0.0.0.0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key" in r.stderr and "Traceback" not in r.stderr


def test_cors_off_unless_asked(engine):
    origin = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST"}
    for cors, allowed in (((), False), (("http://page.example",), True)):
        srv = LocalServer.for_engine(engine, ServerOptions(port=0, cors_origins=cors))
        srv.start()
        try:
            r = httpx2.options(srv.url + "/chat/completions", headers=origin)
            assert (r.headers.get("access-control-allow-origin") == "http://page.example") is allowed
        finally:
            srv.stop()


# --- the command line: `colibri serve` greedy == `colibri run` ---------------------------------


def test_colibri_serve_greedy_equals_colibri_run(default_store):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    flags = ["--model", default_store, "--max-new-tokens", "20", *ENGINE_FLAGS]
    run = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--prompt", LONG_PROMPT,
                          "--system", "You answer questions about Python.", *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    # Ctrl+C reaches the server even when the tests run in the background: a shell starts a
    # background job with SIGINT ignored, children inherit that, and Python then keeps it ignored
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", *flags], cwd=ROOT, env=env,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # the port opens before the model: a health check gets 503 "loading" (or 200 once it is
        # open), never a refused connection
        line = p.stderr.readline()
        while line and "listening on" not in line:
            line = p.stderr.readline()
        url = re.search(r"(http://\S+/v1)", line).group(1)
        health = httpx2.get(url.removesuffix("/v1") + "/health", timeout=60)
        assert health.status_code in (200, 503), health.text
        if health.status_code == 503:
            assert health.json()["status"] == "loading" and health.headers["retry-after"], health.text
        while line and "serving" not in line:
            line = p.stderr.readline()
        assert url in line, line
        r = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300).chat.completions.create(
            model="colibri-stdlib-moe", messages=chat(LONG_PROMPT))
        assert r.choices[0].message.content == run.stdout.removesuffix("\n")
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(600) == 0


# --- the stream filters --------------------------------------------------------------------------


def _pieces(text: str, size: int):
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_stop_matcher_across_pieces(size):
    text = "alpha beta<|x|>gamma STOP here"
    for stops, want in (((), text), (("STOP",), "alpha beta<|x|>gamma "), (("<|x|>", "beta"), "alpha "),
                        (("nope", "here"), "alpha beta<|x|>gamma STOP ")):
        m = StopMatcher(stops)
        out = "".join(m.push(p)[0] for p in _pieces(text, size)) + m.flush()
        assert out == want and m.stopped == bool(set(stops) - {"nope"}), (stops, out)


@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("text", ["<think>\nplan it\n</think>\n\nThe answer.", "<think>a</think>b",
                                  "  <think>x\n\ny\n</think>z", "<think>\nstill going\n", "plain answer",
                                  "\nplain <think> later", "<thi", "", "<think></think>\n\nonly answer"])
def test_reasoning_splitter_matches_split_reasoning(text, size):
    s = ReasoningSplitter()
    parts = [s.push(p) for p in _pieces(text, size)] + [s.flush()]
    got = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
    assert got == split_reasoning(text)


@pytest.mark.parametrize("size", [1, 3, 100])
def test_reasoning_splitter_prompt_opened(size):
    text = "\nthinking\n</think>\n\nanswer"
    s = ReasoningSplitter(prompt_opened=True)
    parts = [s.push(p) for p in _pieces(text, size)] + [s.flush()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == split_reasoning(text)


# --- roles, reasoning, a non-streamed disconnect -------------------------------------------------


def test_tool_and_developer_roles_render_through_the_template(client, engine):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"},
            {"role": "user", "content": [{"type": "text", "text": "Which one"}, {"type": "text", "text": "is first?"}]}]
    # the default model's template has no place for an assistant's calls: refused, not dropped
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, max_tokens=4)
    assert e.value.body["param"] == "messages[2].tool_calls"
    # nor a tool message without the call it answers
    msgs[2] = {"role": "assistant", "content": None}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, max_tokens=4)
    assert e.value.body["param"] == "messages[3].tool_call_id"
    msgs[3] = {"role": "user", "content": "a.py b.py"}
    r = client.chat.completions.create(model="colibri-stdlib-moe", messages=msgs, max_tokens=4)
    want = chat_ids(engine, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "a.py b.py"},
        {"role": "user", "content": "Which one\nis first?"}])
    assert r.usage.prompt_tokens == len(want)


@pytest.fixture(scope="module")
def thinking_server(default_store, tmp_path_factory):
    """The default model with a template that opens a <think> block for the answer."""
    import json
    import shutil
    d = tmp_path_factory.mktemp("think") / "store"
    shutil.copytree(default_store, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["chat_template"].endswith("{{ '<|assistant|>\n' }}{% endif %}")
    tc["chat_template"] = tc["chat_template"].replace("{{ '<|assistant|>\n' }}", "{{ '<|assistant|>\n<think>\n' }}")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with Engine.open(EngineConfig(store=str(d), **ENGINE_KW)) as eng:
        srv = LocalServer.for_engine(eng, ServerOptions(port=0), SamplingParams(max_new_tokens=8))
        srv.start()
        yield srv
        srv.stop()


def test_reasoning_content_when_the_prompt_opens_a_think_block(thinking_server):
    c = openai.OpenAI(base_url=thinking_server.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT))
    m = c.chat.completions.create(**kw).choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and m.content == ""   # 8 tokens: the block is never closed
    parts = []
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            parts.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            assert not choice.delta.content
    assert "".join(parts) == reasoning


def test_a_stop_string_inside_the_reasoning_leaves_it_whole(thinking_server):
    c = openai.OpenAI(base_url=thinking_server.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model="colibri-stdlib-moe", messages=chat(LONG_PROMPT))
    full = c.chat.completions.create(**kw)
    reasoning = full.choices[0].message.model_extra["reasoning_content"]
    stop = reasoning[len(reasoning) // 2:][:3]
    assert len(stop) == 3
    for stream in (False, True):
        if stream:
            parts, reason = [], None
            for ch in c.chat.completions.create(stream=True, stop=[stop], **kw):
                for choice in ch.choices:
                    parts.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
                    assert not choice.delta.content
                    reason = choice.finish_reason or reason
            got = "".join(parts)
        else:
            r = c.chat.completions.create(stop=[stop], **kw)
            got, reason = r.choices[0].message.model_extra["reasoning_content"], r.choices[0].finish_reason
            assert r.choices[0].message.content == "" and r.usage.completion_tokens == full.usage.completion_tokens
        assert (got, reason) == (reasoning, full.choices[0].finish_reason) == (reasoning, "length")


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_answer_filter_stops_in_the_answer_only(size):
    text = "<think>\nplan STOP more\n</think>\n\nanswer STOP tail"
    f = AnswerFilter(("STOP",), chat=True)
    parts = [f.push(p) for p in _pieces(text, size)]
    tail = f.flush()
    assert "".join(p[0] for p in parts) + tail[0] == "plan STOP more"
    assert "".join(p[1] for p in parts) + tail[1] == "answer "
    assert f.stopped and parts[-1][2]
    raw = AnswerFilter(("STOP",))      # a completion: no reasoning split, the stop applies to it all
    out = [raw.push(p) for p in _pieces(text, size)]
    assert "".join(p[1] for p in out) + raw.flush()[1] == "<think>\nplan "


def test_non_streamed_client_that_leaves_cancels_its_generation(engine, server):
    slow = SlowDown(0.05)
    engine.model.subscribe(slow)
    try:
        before = metrics(server.url).get("colibri_generations_total{reason=cancelled}", 0)
        body = {"model": "colibri-stdlib-moe", "messages": chat(LONG_PROMPT), "max_tokens": 400}
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(server.url + "/chat/completions", json=body, timeout=httpx2.Timeout(30, read=1.0))
        assert wait_until(lambda: not server.queue.busy, timeout_s=600)  # only a hang trips it
        m = metrics(server.url)
        assert m["colibri_generations_total{reason=cancelled}"] == before + 1
        assert m["colibri_cancel_overrun_tokens"] <= 1
    finally:
        engine.model.unsubscribe(slow)


def test_bench_serve_reports_overhead_and_multi_turn_prefill(default_store, tmp_path, capsys):
    import json
    from engine.cli import main
    assert main(["bench", "serve", "--store", default_store, "--tokens", "6", "--reps", "1", "--ram-budget-gb", "2",
                 "--out-dir", str(tmp_path), "--name", "serve_t"]) == 0
    d = json.loads((tmp_path / "serve_t.json").read_text())
    assert [r["arm"] for r in d["rows"]] == ["direct", "server"] and all(r["tokens"] == 6 for r in d["rows"])
    assert d["summary"]["identical_text"] is True
    assert "overhead_cpu_ms_per_token" in d["summary"] and "server_overhead_cpu_ms_per_token" in d["summary"]
    mt = d["multi_turn"]
    # at most one token at the answer's end is read again: its text can re-tokenize differently
    # (BPE merges across the cut) from the ids the model generated
    assert mt["turn2_prefill_tokens"] <= mt["turn2_new_tokens"] + 1
    assert mt["turn2_prefill_tokens"] < mt["turn2_cold_prefill_tokens"]
    assert "Multi-turn" in (tmp_path / "serve_t.md").read_text()
