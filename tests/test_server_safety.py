"""The server refuses what a web page or a broken client sends, before any work: foreign Host
names (DNS rebinding), foreign Origins, bodies that are not JSON, and malformed JSON of every
kind (a fuzz of 2,000 bodies), each with a 4xx and an OpenAI error body, never a 500. On a tiny
random OLMoE model (the gate and the parsing do not depend on the model)."""

from __future__ import annotations

import json
import random

import pytest

httpx2 = pytest.importorskip("httpx2")

from engine import ConfigError, Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.server import LocalServer, ServerOptions  # noqa: E402
from engine.server.gate import split_host  # noqa: E402

from server_helpers import ENGINE_KW  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_store):
    with Engine.open(EngineConfig(store=str(tiny_store), **ENGINE_KW)) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    srv = LocalServer.for_engine(engine, ServerOptions(port=0), SamplingParams(max_new_tokens=2))
    srv.start()
    yield srv
    srv.stop()


def model_id(server) -> str:
    return server.api.served().model_id


def ended(server) -> int:
    """Jobs the queue ended (generations run, or refused by the engine)."""
    return sum(server.stats.results.values())


def ok_body(server) -> dict:
    return {"model": model_id(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _assert_error(r, status=None):
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# --- Host, Origin, Content-Type ------------------------------------------------------------------


def test_foreign_host_is_refused_before_any_work(server):
    before = ended(server)
    url = server.url + "/chat/completions"
    for host in (f"evil.example:{server.port}", "evil.example", "127.0.0.1.evil.example", "[::2]:80",
                 f"192.168.1.4:{server.port}"):
        r = httpx2.post(url, json=ok_body(server), headers={"Host": host})
        assert _assert_error(r, 421)["code"] == "host_not_allowed", host
        r = httpx2.get(server.url + "/models", headers={"Host": host})
        assert r.status_code == 421
    assert ended(server) == before
    assert server.stats.request_count("/v1/") >= 5   # the refusals show in /metrics
    assert 'status="421"' in httpx2.get(server.url.removesuffix("/v1") + "/metrics").text
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", f"[::1]:{server.port}",
                 "127.3.4.5"):
        r = httpx2.post(url, json=ok_body(server), headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    assert ended(server) == before + 5


def test_foreign_origin_is_refused_whatever_the_body(server):
    before = ended(server)
    url = server.url + "/chat/completions"
    body = json.dumps(ok_body(server))
    for origin in ("http://evil.example", "null", "https://localhost.evil.example",
                   f"http://localhost:{server.port + 1 if server.port < 65535 else 1}"):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "application/json"):
            r = httpx2.post(url, content=body, headers={"Origin": origin, "Content-Type": ctype})
            err = _assert_error(r, 403)
            assert err["code"] == "origin_not_allowed", (origin, ctype)
            # the fix it offers exists: 'null' (a sandboxed or file:// page) cannot be allowed
            assert ("--cors-origin null" not in err["message"]) and (origin != "null" or "http(s)" in err["message"])
    assert ended(server) == before
    # the server's own origin, and clients that send none (SDKs, curl), are served
    r = httpx2.post(url, json=ok_body(server), headers={"Origin": f"http://127.0.0.1:{server.port}"})
    assert r.status_code == 200, r.text
    assert httpx2.post(url, json=ok_body(server)).status_code == 200
    assert ended(server) == before + 2


def test_a_body_that_is_not_json_is_refused(server):
    before = ended(server)
    body = json.dumps(ok_body(server))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                  "application/jsonp", "text/json"):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx2.post(server.url + "/chat/completions", content=body, headers=headers)
        assert _assert_error(r, 415)["code"] == "unsupported_media_type", ctype
    assert ended(server) == before
    r = httpx2.post(server.url + "/chat/completions", content=body,
                    headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_listed_origins_get_cors_and_are_served(engine):
    page = "http://localhost:5173"
    srv = LocalServer.for_engine(engine, ServerOptions(port=0, cors_origins=(page,)), SamplingParams(max_new_tokens=2))
    srv.start()
    try:
        pre = httpx2.options(srv.url + "/chat/completions",
                             headers={"Origin": page, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
        r = httpx2.post(srv.url + "/chat/completions", json=ok_body(srv), headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        # the page may read the seed its answer used
        assert "x-colibri-seed" in r.headers["access-control-expose-headers"].lower()
        r = httpx2.post(srv.url + "/chat/completions", json=ok_body(srv), headers={"Origin": "http://other.example"})
        assert r.status_code == 403
    finally:
        srv.stop()


def test_cors_origins_are_checked_and_the_host_parser():
    for bad in ("*", "localhost:3000", "http://x.example/path", "ftp://x"):
        with pytest.raises(ConfigError, match="--cors-origin"):
            ServerOptions(cors_origins=(bad,)).validated()
    ServerOptions(cors_origins=("http://localhost:3000", "https://app.example")).validated()
    assert split_host("LOCALHOST:8000") == ("localhost", 8000)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("::1") == ("::1", None)
    for bad in ("", "[::1", "a:b", "x:99999"):
        with pytest.raises(ValueError):
            split_host(bad)


# --- malformed bodies: 4xx, never 500 -----------------------------------------------------------

SURROGATE = '"\\ud800"'


def _malformed(rng: random.Random, base: dict) -> bytes:
    """One body that must be refused: the valid ``base`` with one thing broken."""
    kind = rng.randrange(6)
    fields = ["model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop",
              "stream", "stream_options", "tools", "tool_choice", "chat_template_kwargs", "n", "top_k",
              "repetition_penalty", "response_format", "presence_penalty", "logprobs"]
    if kind == 0:  # nesting, in the body or inside a field
        depth = rng.choice([65, 100, 1000, 5000, 100000])
        opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
        nested = opener * depth + "1" + closer * depth
        if rng.random() < 0.3:
            return nested.encode()
        body = json.dumps({**base, rng.choice(fields): "@@"}).replace('"@@"', nested)
        return body.encode()
    if kind == 1:  # bad UTF-8 inside a string, or a truncated body
        raw = json.dumps(base).encode()
        junk = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c", b"\x80", b"\xfe\xfe"])
        if rng.random() < 0.2:
            return raw[:rng.randrange(1, len(raw) - 1)]
        i = raw.index(b'"hi"') + 2
        return raw[:i] + junk + raw[i:]
    if kind == 2:  # a wrong type for a field
        wrong = rng.choice([[], {}, "x", 3, -1, True, [1, 2], {"a": 1}, [None], [[]], 2.5])
        field = rng.choice(fields + ["messages[0]", "messages[0].role", "messages[0].content", "tool_calls",
                                     "tool_calls[0]", "tool_calls[0].function", "tools[0]", "tools[0].function",
                                     "content_parts"])
        body = json.loads(json.dumps(base))
        m0 = body["messages"][0]
        if field == "messages[0]":
            body["messages"][0] = wrong if not isinstance(wrong, dict) or wrong == {} else {"x": 1}
        elif field == "messages[0].role":
            m0["role"] = wrong
        elif field == "messages[0].content":
            m0["content"] = rng.choice([3, {"a": 1}, [1], [{"type": "text", "text": 5}], True])
        elif field == "tool_calls":
            body["messages"].append({"role": "assistant", "content": None,
                                     "tool_calls": rng.choice(["x", 3, {"a": 1}, True])})
        elif field == "tool_calls[0]":
            body["messages"].append({"role": "assistant", "tool_calls": [rng.choice(["x", 3, [], None])]})
        elif field == "tool_calls[0].function":
            fn = rng.choice(["x", 3, [], {"name": 5}, {"name": "f", "arguments": 7}, {"arguments": "{}"}])
            body["messages"].append({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                          "function": fn}]})
        elif field == "tools[0]":
            body["tools"] = [rng.choice(["x", 3, [], {"type": "function"}, {"type": "other", "function": {}}])]
        elif field == "tools[0].function":
            body["tools"] = [{"type": "function", "function": rng.choice(
                ["x", 3, {"name": 3}, {"parameters": {}}, {"name": "f", "parameters": "x"}])}]
        elif field == "content_parts":
            m0["content"] = [rng.choice([{"type": "text"}, "x", 3, {"type": "image_url"}])]
        elif field in ("model",):
            body["model"] = rng.choice([3, [], {}, True, "no-such-model"])
        elif field in ("stream", "stream_options", "chat_template_kwargs", "logprobs"):
            body[field] = rng.choice(["yes", 3, [1]] + ([{"include_usage": "x"}] if field == "stream_options" else []))
        elif field in ("tool_choice",):
            body[field] = rng.choice(["sometimes", 3, [], {"type": "function"}, {"type": "function", "function": {}},
                                      {"type": "function", "function": {"name": "not_offered"}}])
        elif field in ("response_format",):
            body[field] = rng.choice(["json", 3, {"type": "xml"}, {"type": "json_schema"},
                                      {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}])
        elif field in ("messages",):
            body[field] = rng.choice(["x", 3, {}, [], [1], None])
        elif field == "tools":
            body[field] = rng.choice(["x", 3, {}, [1]])
        elif field == "stop":
            body[field] = rng.choice([3, {}, [1], ["a"] * 5, [None]])
        else:
            body[field] = rng.choice(["x", [], {}, [1], -1e308 if field != "seed" else -5])
        return json.dumps(body).encode()
    if kind == 3:  # huge numbers
        field = rng.choice(["temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "top_k",
                            "repetition_penalty", "n", "presence_penalty"])
        num = rng.choice(["1e999", "-1e999", "1" + "0" * 5000, "1" + "0" * 400, "1e308", "-" + "9" * 40,
                          "123456789012345678901234567890", "NaN", "Infinity"])
        return json.dumps({**base, field: "@@"}).replace('"@@"', num).encode()
    if kind == 4:  # a lone surrogate in a string or a key
        where = rng.choice(["content", "model", "role", "stop", "key", "tool"])
        body = json.dumps(base)
        if where == "content":
            return body.replace('"hi"', SURROGATE).encode()
        if where == "model":
            return json.dumps({**base, "model": "@@"}).replace('"@@"', SURROGATE).encode()
        if where == "role":
            return body.replace('"user"', '"us\\udfffer"').encode()
        if where == "stop":
            return json.dumps({**base, "stop": ["@@"]}).replace('"@@"', SURROGATE).encode()
        if where == "key":
            return body.replace('"max_tokens"', '"max\\ud83d_tokens"').encode()
        tools = [{"type": "function", "function": {"name": "f", "description": "@@", "parameters": {"type": "object"}}}]
        return json.dumps({**base, "tools": tools}).replace('"@@"', SURROGATE).encode()
    # not a JSON object at all
    return rng.choice([b"", b"null", b"[]", b"3", b'"x"', b"{", b"{}", b'{"model": 1', b"\x00\x01", b"nan",
                       b'{"messages": []}'])


def test_fuzz_of_malformed_bodies_gets_only_4xx(server):
    rng = random.Random(49)
    base = ok_body(server)
    before = ended(server)
    statuses: dict[int, int] = {}
    with httpx2.Client(timeout=60) as h:
        for i in range(2000):
            raw = _malformed(rng, base)
            # no 'prompt' for /completions, no 'max_tokens' for /messages: refused there too
            path = {0: "/completions", 1: "/messages"}.get(i % 4, "/chat/completions")
            if path == "/messages":   # OpenAI-only fields are not errors there: take max_tokens away
                raw = raw.replace(b'"max_tokens"', b'"max_tokens_"')
            r = h.post(server.url + path, content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (i, raw[:300], r.status_code, r.text[:500])
            if path == "/messages":   # Anthropic's error shape
                body = r.json()
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
                continue
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
    assert ended(server) == before, "a malformed body reached the engine"
    assert len(statuses) >= 2, statuses


def test_listed_origins_may_send_the_browser_sdks_headers(engine):
    """The official JS SDKs send x-stainless-* (and Anthropic's its direct-browser header) on
    every request, and Chrome preflights a public page's request to this computer with
    Access-Control-Request-Private-Network: a listed origin's preflight allows them all."""
    page = "https://app.example"
    srv = LocalServer.for_engine(engine, ServerOptions(port=0, cors_origins=(page,)), SamplingParams(max_new_tokens=2))
    srv.start()
    try:
        pre = httpx2.options(srv.url + "/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-stainless-os,anthropic-dangerous-direct-browser-access",
            "Access-Control-Request-Private-Network": "true"})
        assert pre.status_code == 200, pre.text
        allowed = pre.headers["access-control-allow-headers"].lower()
        assert "x-stainless-os" in allowed and "anthropic-dangerous-direct-browser-access" in allowed
        assert pre.headers.get("access-control-allow-private-network") == "true"
        other = httpx2.options(srv.url + "/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        srv.stop()


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(server, caplog):
    """A client that closes the connection before its whole body arrived: counted as 499 in
    /metrics, no error logged and no traceback (there were two: the handler's and uvicorn's)."""
    import logging
    import socket
    import time
    from urllib.parse import urlsplit
    u = urlsplit(server.url)
    before = sum(n for (ep, st), n in server.stats.requests.items() if st == 499)
    with caplog.at_level(logging.INFO):
        with socket.create_connection((u.hostname, u.port), timeout=60) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\": 1}")
            s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 600   # only a hang trips this
        while (sum(n for (ep, st), n in server.stats.requests.items() if st == 499) == before
               and time.monotonic() < deadline):
            time.sleep(0.05)
    assert sum(n for (ep, st), n in server.stats.requests.items() if st == 499) == before + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_messages_refuse_a_null_max_tokens(server):
    """Anthropic's API requires max_tokens: null is refused as an absent one is (it ran with
    the server's default)."""
    r = httpx2.post(server.url.removesuffix("/v1") + "/v1/messages", json={
        "model": model_id(server), "max_tokens": None, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "max_tokens" in r.text


# --- what never reaches the API, tools a template cannot write, the Messages API's own names ------


def _raw_http(server, request: bytes) -> tuple[int, dict, bytes]:
    """Send ``request`` as it is on a new connection -> (status, headers, body) of the answer
    (read until the server closes the connection)."""
    import socket
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_a_request_that_is_not_http_gets_a_json_error_in_the_apis_shape(server):
    before = ended(server)
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        status, headers, body = _raw_http(server, f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\n"
                                                  f"Content-Length: 2\r\n\r\n{{}}".encode())
        assert status == 400 and headers["content-type"] == "application/json", (path, headers, body)
        data = json.loads(body)
        if path.startswith("/v1/messages"):
            assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
            message = data["error"]["message"]
        else:
            assert data["error"]["code"] == "invalid_http"
            message = data["error"]["message"]
        assert "no Host header" in message, message
    status, headers, body = _raw_http(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http"
    assert ended(server) == before
    assert server.stats.requests[("/v1/messages/count_tokens", 400)] == 1


def test_tools_the_template_cannot_write_are_refused_not_dropped(server):
    """The tiny model's template has no place for tools: answering as if none were offered would
    be another question's answer; the refusal names the model and 'tools'."""
    before = ended(server)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), "tools": tools})
    err = _assert_error(r, 400)
    assert err["param"] == "tools" and err["code"] == "tools_not_supported" and repr(model_id(server)) in err["message"]
    r = httpx2.post(server.url + "/messages", json={**ok_body(server), "tools": [{"name": "f", "input_schema": {}}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "'tools'" in r.json()["error"]["message"] and repr(model_id(server)) in r.json()["error"]["message"]
    assert ended(server) == before
    # nor an assistant's calls in the history: the model would not see what it did
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), "messages": [USER_HI, call, USER_HI]})
    err = _assert_error(r, 400)
    assert err["param"] == "messages[1].tool_calls" and repr(model_id(server)) in err["message"], err
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]}
    r = httpx2.post(server.url + "/messages", json={**ok_body(server), "messages": [USER_HI, use, result]})
    assert r.status_code == 400 and "tool_use blocks" in r.json()["error"]["message"], r.text
    assert ended(server) == before
    # "none" puts no tools into the prompt: nothing is dropped
    r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200, r.text


OPENAI_WORDS = ("'stop'", "function", '"required"', "tool_calls", "parameters", "chat_template_kwargs",
                "unsupported content block")
USER_HI = {"role": "user", "content": "hi"}
A_TOOL = {"name": "f", "input_schema": {"type": "object"}}
ANTHROPIC_BAD = [
    ({"stop_sequences": 3}, "'stop_sequences' must be a list"),
    ({"tool_choice": {"type": "any"}}, "list the tools the model may call in 'tools'"),
    ({"tool_choice": {"type": "tool", "name": "f"}}, "list the tools the model may call in 'tools'"),
    ({"tools": [A_TOOL], "tool_choice": {"type": "tool", "name": "g"}}, "names the tool 'g', which is not among"),
    ({"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema must be a JSON schema object"),
    ({"tools": [A_TOOL, A_TOOL]}, "tools[1]: the tool name 'f' is given twice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305'"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content is empty"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content is empty"),
    ({"messages": [USER_HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": '{"a": 1}'}]}, USER_HI]},
     "messages[1].content[0].input must be an object (the tool's arguments), got a string"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]},
     "a tool_use block belongs in an assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text must"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": None}]}]}]}, "content[0].content[0].text must be a string"),
    ({"messages": [USER_HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, "send each tool's answer in a tool_result"),
    ({"messages": [{"role": "system", "content": "x"}]}, "a system prompt goes in the request's 'system'"),
]


@pytest.mark.parametrize("change, says", ANTHROPIC_BAD, ids=range(len(ANTHROPIC_BAD)))
def test_messages_errors_speak_the_messages_apis_names(server, change, says):
    before = ended(server)
    body = {"model": model_id(server), "max_tokens": 2, "messages": [USER_HI], **change}
    for path in ("/messages", "/messages/count_tokens"):
        r = httpx2.post(server.url + path, json=body)
        assert r.status_code == 400, (path, r.text)
        data = r.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        message = data["error"]["message"]
        assert says in message, message
        assert not [w for w in OPENAI_WORDS if w in message], message
    assert ended(server) == before


def test_messages_take_more_than_four_stop_sequences(server):
    body = {"model": model_id(server), "max_tokens": 2, "messages": [USER_HI],
            "stop_sequences": ["<a>", "<b>", "<c>", "<d>", "<e>", "<f>"]}
    r = httpx2.post(server.url + "/messages", json=body)
    assert r.status_code == 200, r.text
    r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), "stop": body["stop_sequences"]})
    assert _assert_error(r, 400)["param"] == "stop"   # the OpenAI API's limit stays there


def test_openai_errors_say_what_to_do(server):
    """tool_choice without tools, empty content, template variables the request sets itself:
    each error says what is wrong in the request's terms and what to send instead."""
    before = ended(server)
    cases = [({"tool_choice": "required"}, "tool_choice", "list the functions the model may call in 'tools'"),
             ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
              "the request has no 'tools': list the function in 'tools'"),
             ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "is an empty list"),
             ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
              "messages[0].content[0].text must be a string"),
             ({"chat_template_kwargs": {"tools": 3}}, "chat_template_kwargs.tools",
              "give the functions in the request's 'tools'"),
             ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
              "cannot set 'add_generation_prompt'")]
    for change, param, says in cases:
        r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), **change})
        err = _assert_error(r, 400)
        assert err["param"] == param and says in err["message"], (change, err)
        assert "encode_chat" not in err["message"] and "keyword argument" not in err["message"]
    assert ended(server) == before


def test_an_assistant_prefill_is_continued(server, engine):
    """A last assistant message is a prefill on /v1/messages (Anthropic's API) and with
    continue_final_message on /v1/chat/completions: the prompt ends right after its text and
    the answer is what the model writes from there."""
    prefill = "The quick brown"
    msgs = [USER_HI, {"role": "assistant", "content": prefill}]
    r = httpx2.post(server.url + "/messages", json={"model": model_id(server), "max_tokens": 2, "temperature": 0,
                                                    "messages": msgs})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["input_tokens"]
    prompt_ids = list(engine._kv_ids[:n])
    assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False) == \
        engine.tokenizer.apply_chat_template([USER_HI], add_generation_prompt=True) + prefill
    text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
    raw = httpx2.post(server.url + "/completions", json={"model": model_id(server), "prompt": prompt_ids,
                                                         "max_tokens": 2, "temperature": 0})
    assert raw.json()["choices"][0]["text"] == text
    r = httpx2.post(server.url + "/chat/completions", json={
        "model": model_id(server), "max_tokens": 2, "temperature": 0, "messages": msgs, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n and r.json()["choices"][0]["message"]["content"] == text
    # a prefill and a constrained answer do not go together
    r = httpx2.post(server.url + "/chat/completions", json={
        "model": model_id(server), "max_tokens": 2, "messages": msgs, "continue_final_message": True,
        "response_format": {"type": "json_object"}})
    assert _assert_error(r, 400)["param"] == "response_format"


def test_count_tokens_is_the_messages_input_tokens(server, engine):
    body = {"model": model_id(server), "system": "Be brief.", "messages": [USER_HI]}
    r = httpx2.post(server.url + "/messages/count_tokens", json=body)
    assert r.status_code == 200 and set(r.json()) == {"input_tokens"}, r.text
    n = r.json()["input_tokens"]
    assert n == len(engine.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, USER_HI]))
    r = httpx2.post(server.url + "/messages", json={**body, "max_tokens": 1})
    assert r.json()["usage"]["input_tokens"] == n
    r = httpx2.post(server.url + "/messages/count_tokens", json={"model": "nope", "messages": [USER_HI]})
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_every_answer_reports_its_seed(server):
    """Without a seed (the server's --seed auto) a fresh one is drawn and reported in a
    header; sending it back reproduces the sampled answer."""
    body = {**ok_body(server), "temperature": 1.5, "max_tokens": 2}
    r = httpx2.post(server.url + "/chat/completions", json=body)
    seed = int(r.headers["x-colibri-seed"])
    again = httpx2.post(server.url + "/chat/completions", json={**body, "seed": seed})
    assert again.headers["x-colibri-seed"] == str(seed)
    assert again.json()["choices"][0]["message"] == r.json()["choices"][0]["message"]
    with httpx2.stream("POST", server.url + "/chat/completions", json={**body, "stream": True}) as s:
        assert int(s.headers["x-colibri-seed"]) >= 0
        s.read()
    r = httpx2.post(server.url + "/messages", json={**body, "seed": None})
    assert int(r.headers["x-colibri-seed"]) >= 0
    r = httpx2.post(server.url + "/completions", json={"model": model_id(server), "prompt": "hi", "max_tokens": 1,
                                                       "seed": 7})
    assert r.headers["x-colibri-seed"] == "7"


def test_queue_full_message_counts_in_words():
    from engine.server.jobs import QueueFull
    assert "1 request is waiting" in str(QueueFull(1, 2))
    assert "3 requests are waiting" in str(QueueFull(3, 2))


def test_a_request_the_engine_refuses_mid_stream_keeps_its_4xx_type(tiny_store):
    """A streamed request the engine refuses when its turn comes (the HTTP status is already
    200) ends with an error event whose type is the refusal's, not a server error."""
    from engine.server.jobs import JobResult
    from engine.server.openai_api import ServedModel
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_store)
    served = ServedModel("refuser", tok, 2048, 300, 0, None)

    def runner(fn, job):   # the engine's own request check said no
        job.finish(JobResult("error", len(job.ids), error="the engine refused the request", status=400))

    srv = LocalServer(lambda: served, runner, ServerOptions(port=0))
    srv.start()
    try:
        body = {"model": "refuser", "max_tokens": 2, "stream": True, "messages": [USER_HI]}
        with httpx2.stream("POST", srv.url + "/chat/completions", json=body) as r:
            events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and "[DONE]" not in ln]
        assert events[-1]["error"]["type"] == "invalid_request_error", events
        with httpx2.stream("POST", srv.url + "/messages", json=body) as r:
            events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:")]
        assert events[-1] == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "the engine refused the request"}}, events
    finally:
        srv.stop()


def _mutations(value, path=()):
    """Every (path, value) inside a JSON value, for the fuzz below to break one at a time."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _mutations(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _mutations(v, path + (i,))


def test_fuzz_of_messages_bodies_gets_no_server_error(server):
    """A valid Messages request (system, tools, thinking, stop sequences, a prefill) with one
    value replaced by a wrong one, 600 times: each is answered (the change may be harmless) or
    refused with a 4xx in Anthropic's shape; never a 5xx. (The tiny model's template writes
    neither tools nor calls: tool_choice none, and no tool_use in the history, so no tool_result
    either: one without its tool_use is refused.)"""
    rng = random.Random(2026)
    base = {"model": model_id(server), "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "none"}, "stop_sequences": ["x"], "thinking": {"type": "disabled"},
            "messages": [USER_HI,
                         {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
                         {"role": "user", "content": [{"type": "text", "text": "r"}]},
                         {"role": "assistant", "content": "pre"}]}
    spots = [p for p, _ in _mutations(base) if p]
    wrong = [None, "", "x", 0, -1, 1e308, 10 ** 30, True, [], {}, [None], {"type": "text"}, "\u0000",
             {"type": "image", "source": {}}, [{"type": "tool_use"}], "a" * 10000]
    statuses: dict[int, int] = {}
    with httpx2.Client(timeout=120) as h:
        for _ in range(600):
            body = json.loads(json.dumps(base))
            path = rng.choice(spots)
            target = body
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = rng.choice(wrong)
            for url in ("/messages", "/messages/count_tokens"):
                r = h.post(server.url + url, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400, 404), (path, target, r.status_code, r.text[:300])
                if r.status_code != 200:
                    data = r.json()
                    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 100, statuses


# --- fields that would change the answer are refused, never ignored ------------------------------

A_FUNCTION = {"name": "f", "parameters": {"type": "object"}}


def test_legacy_functions_are_refused_pointing_to_tools(server):
    before = ended(server)
    for change, param, says in (({"functions": [A_FUNCTION]}, "functions", "'tools'"),
                                ({"function_call": "auto"}, "function_call", "'tool_choice'")):
        r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), **change})
        err = _assert_error(r, 400)
        assert err["param"] == param and says in err["message"], err
    assert ended(server) == before


ANSWER_CHANGING = [({"min_p": 0.1}, "min_p"), ({"modalities": ["text", "audio"]}, "modalities"),
                   ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                   ({"web_search_options": {}}, "web_search_options"), ({"reasoning_effort": "high"}, "reasoning_effort"),
                   ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"verbosity": "low"}, "verbosity"),
                   ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
                   ({"frobnicate": 1}, "frobnicate"),
                   ({"messages": [{"role": "user", "content": "hi", "frobnicate": 1}]}, "messages[0].frobnicate"),
                   ({"messages": [{"role": "user"}]}, "messages[0].content"),
                   ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
                   ({"messages": [{"role": "system", "content": None}, USER_HI]}, "messages[0].content"),
                   ({"stop": ""}, "stop"), ({"stop": ["a", ""]}, "stop[1]"),
                   ({"stream_options": {"include_usage": True}}, "stream_options"),
                   ({"messages": [USER_HI, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
                   ({"messages": [USER_HI, {"role": "assistant", "content": "ok"},
                                  {"role": "tool", "tool_call_id": "call_1", "content": "42"}]},
                    "messages[2].tool_call_id")]


@pytest.mark.parametrize("change, param", ANSWER_CHANGING, ids=[p for _, p in ANSWER_CHANGING])
def test_chat_fields_that_would_change_the_answer_are_refused(server, change, param):
    """The tiny model's template has no reasoning setting, so reasoning_effort cannot be honoured."""
    before = ended(server)
    r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), **change})
    err = _assert_error(r, 400)
    assert err["param"] == param, err
    assert ended(server) == before


def test_bookkeeping_fields_are_accepted_and_a_model_may_be_left_out(server):
    """store / metadata / service_tier / user change no answer; min_p 0 and modalities ["text"]
    are what the server does anyway; a request without 'model' gets the one model served."""
    body = {**ok_body(server), "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u1",
            "min_p": 0, "modalities": ["text"]}
    assert httpx2.post(server.url + "/chat/completions", json=body).status_code == 200
    del body["model"]
    assert httpx2.post(server.url + "/chat/completions", json=body).json()["model"] == model_id(server)
    r = httpx2.post(server.url + "/completions", json={"model": model_id(server), "prompt": "a", "max_tokens": 1,
                                                      "frobnicate": 1})
    assert _assert_error(r, 400)["param"] == "frobnicate"
    r = httpx2.post(server.url + "/completions", json={"prompt": "a", "max_tokens": 1, "stop": ""})
    assert _assert_error(r, 400)["param"] == "stop"


ANTHROPIC_REFUSED = [
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "frobnicate": 1}]}, "messages[0].frobnicate"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": ["a", " \n"]}, "stop_sequences[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4096}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}, "thinking"),
    ({"output_format": {"type": "json_object"}}, "output_format"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),   # the tiny model's template has no reasoning setting
    ({"output_config": {"effort": "max"}}, "output_config.effort"),
    ({"output_config": {"task_budget": {"total": 9}}}, "output_config.task_budget"),
]


@pytest.mark.parametrize("change, param", ANTHROPIC_REFUSED, ids=[p for _, p in ANTHROPIC_REFUSED])
def test_messages_fields_that_would_change_the_answer_are_refused(server, change, param):
    """As the Messages API refuses them (thinking.budget_tokens below 1024 or not below
    max_tokens; unknown fields); the tiny model's template has no thinking switch, so thinking
    enabled cannot be honoured."""
    before = ended(server)
    body = {"model": model_id(server), "max_tokens": 2, "messages": [USER_HI], **change}
    r = httpx2.post(server.url + "/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert param in r.json()["error"]["message"], r.text
    assert ended(server) == before
    # thinking disabled on a model that does not reason is what it does anyway
    ok = {"model": model_id(server), "max_tokens": 2, "messages": [USER_HI], "thinking": {"type": "disabled"},
          "metadata": {"user_id": "u"}, "cache_control": {"type": "ephemeral"}, "container": None,
          "context_management": None}
    assert httpx2.post(server.url + "/messages", json=ok).status_code == 200


def test_forced_tool_choice_on_a_model_without_tools_says_so_at_once(server):
    """tool_choice required / a named function (Anthropic's any / tool) with tools on a model
    whose template cannot write tools: the one refusal that helps, not "leave tool_choice out"
    followed by tools_not_supported."""
    tools = [{"type": "function", "function": A_FUNCTION}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = httpx2.post(server.url + "/chat/completions", json={**ok_body(server), "tools": tools, "tool_choice": choice})
        err = _assert_error(r, 400)
        assert err["code"] == "tools_not_supported" and err["param"] == "tools", err
        assert "cannot call tools" in err["message"] and "drop 'tools' and 'tool_choice'" in err["message"], err
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
        r = httpx2.post(server.url + "/messages", json={**ok_body(server), "tools": [A_TOOL], "tool_choice": choice})
        assert r.status_code == 400 and "cannot call tools" in r.json()["error"]["message"], r.text


def test_anthropic_clients_get_anthropics_error_shape_on_models(server):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.models.retrieve("claude-x")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error", e.value.body
    assert c.models.retrieve(model_id(server)).id == model_id(server)
    # an OpenAI client still gets OpenAI's shape there
    r = httpx2.get(server.url + "/models/claude-x")
    assert _assert_error(r, 404)["code"] == "model_not_found"


def test_ipv4_shorthands_of_loopback_are_this_computer(server):
    for host in ("127.1", "127.0.0.2", "2130706433"):
        r = httpx2.get(server.url + "/models", headers={"Host": f"{host}:{server.port}"})
        assert r.status_code == 200, (host, r.text)
    r = httpx2.get(server.url + "/models", headers={"Host": f"10.1:{server.port}"})
    assert r.status_code == 421


def test_health_says_loading_with_retry_after_while_no_model_is_open():
    """The port opens before the model: a health check gets 503 "loading" and Retry-After, and a
    request gets 503 model_not_ready (colibri serve listens first, then opens the model)."""
    srv = LocalServer(lambda: None, lambda fn, job: None, ServerOptions(port=0))
    srv.start()
    try:
        r = httpx2.get(srv.url.removesuffix("/v1") + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"] == "2"
        r = httpx2.post(srv.url + "/chat/completions", json={"messages": [USER_HI]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready" and r.headers["retry-after"]
    finally:
        srv.stop()


def test_models_lists_the_model_being_opened_and_its_requests_get_503(tiny_store, monkeypatch):
    """`colibri serve` listens before the model is open: GET /v1/models (the openai SDK's
    models.list) already lists the id the server will answer to, so a client that discovers the
    model first finds it; a completion meanwhile gets 503 model_not_ready with Retry-After (404
    for another name); once open, the same id answers."""
    import threading

    openai = pytest.importorskip("openai")
    from engine import generate
    from engine.cli.main import main
    from server_helpers import ENGINE_FLAGS, wait_until
    release, started, servers, rc = threading.Event(), threading.Event(), [], []
    real_open, real_start = generate.Engine.open.__func__, LocalServer.start

    def gated_open(cls, *a, **kw):  # the model opens only when the test says so
        assert release.wait(600), "the test never let the model open"
        return real_open(cls, *a, **kw)

    def recorded_start(self, *a, **kw):
        url = real_start(self, *a, **kw)
        servers.append(self)
        started.set()
        return url
    monkeypatch.setattr(generate.Engine, "open", classmethod(gated_open))
    monkeypatch.setattr(LocalServer, "start", recorded_start)
    argv = ["serve", "--model", str(tiny_store), "--port", "0", "--max-new-tokens", "2", *ENGINE_FLAGS]
    t = threading.Thread(target=lambda: rc.append(main(argv)), daemon=True)
    t.start()
    try:
        assert started.wait(600)
        srv = servers[0]
        c = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=600)
        ids = [m.id for m in c.models.list()]
        assert len(ids) == 1 and srv.api.served() is None
        assert c.models.retrieve(ids[0]).id == ids[0]
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=ids[0], messages=[USER_HI])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "2"
        assert e.value.body["code"] == "model_not_ready" and ids[0] in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="some-other-model", messages=[USER_HI])
        release.set()
        assert wait_until(lambda: srv.api.served() is not None)
        assert [m.id for m in c.models.list()] == ids == [srv.api.served().model_id]
        assert c.chat.completions.create(model=ids[0], messages=[USER_HI]).choices[0].message.content is not None
    finally:
        release.set()
        if servers:
            servers[0].stop()
        t.join(600)
    assert rc == [0]


def test_an_answer_message_sent_back_whole_is_taken(server):
    """Clients append the answer's message as the SDK returns it: its null fields (audio,
    function_call, annotations) are not refused; a legacy function_call in it is."""
    answer = {"content": "x", "refusal": None, "role": "assistant", "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    body = {**ok_body(server), "messages": [USER_HI, answer, USER_HI], "functions": None}
    assert httpx2.post(server.url + "/chat/completions", json=body).status_code == 200
    body["messages"][1]["function_call"] = {"name": "f", "arguments": "{}"}
    err = _assert_error(httpx2.post(server.url + "/chat/completions", json=body), 400)
    assert err["param"] == "messages[1].function_call" and "'tool_calls'" in err["message"]


def test_anthropic_clients_get_anthropics_shape_from_the_gate_and_the_key(engine):
    srv = LocalServer.for_engine(engine, ServerOptions(port=0, api_key="k" * 12), SamplingParams(max_new_tokens=2))
    srv.start()
    try:
        head = {"anthropic-version": "2023-06-01"}
        r = httpx2.get(srv.url + "/models", headers={**head, "x-api-key": "wrong-key-123"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        r = httpx2.get(srv.url + "/models", headers={**head, "Host": "evil.example"})
        assert r.status_code == 421 and r.json()["type"] == "error", r.text
        r = httpx2.get(srv.url + "/models", headers={"Authorization": "Bearer wrong-key-123"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    finally:
        srv.stop()
    assert ServerOptions(host="127.1").validated().host == "127.1"   # loopback: no key needed
