"""``colibri bench serve``: the OpenAI-compatible server against the engine called directly (what
``colibri run`` does), on the same model, and multi-turn prefix reuse through the server.

One process, one engine, every expert resident after a warm-up (the default budget holds them
all on the default model), so both arms do the same work: the same greedy answer to the same
chat, the whole prompt prefilled each time (``Engine.forget_prefix``). Arms alternate, the order
reversed every other repetition. The server arm is a real HTTP client (``http.client``,
streamed SSE) on a loopback port. Per arm: time to first token and decode tok/s measured by the
caller (first / last streamed token), CPU seconds of the process (rusage: engine, server and
client threads together) per generated token, the client thread's own CPU (``time.thread_time``,
subtracted for the server's overhead without its client), and the engine's own TTFT and tok/s.
Overhead per token = server - direct, in wall and CPU milliseconds (medians).

Multi-turn: turn 1, then turn 2 = turn 1 + its answer + a new question; the server reports the
prompt tokens it computed (``colibri_last_prefill_tokens`` in /metrics). With the KV prefix
reused, turn 2 computes only its new tokens: its prompt minus turn 1's prompt and answer.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import statistics
import time

from .common import machine_info, md_table, write_results

SYSTEM = "You answer questions about Python."
QUESTION = "Write a long explanation of the os module."
FOLLOW_UP = "And what does `os.path.split` do?"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _direct(eng, msgs, tokens: int) -> dict:
    """The engine called as ``colibri run`` calls it (chat messages through the template)."""
    from ..events import ChatMessage, Finished, GenerateRequest, SamplingParams, TokenEvent
    eng.forget_prefix()
    req = GenerateRequest(messages=tuple(ChatMessage(m["role"], m["content"]) for m in msgs),
                          sampling=SamplingParams(max_new_tokens=tokens))
    c0, t0 = _cpu_s(), time.perf_counter()
    times, text, fin = [], [], None
    for ev in eng.generate(req):
        if isinstance(ev, TokenEvent):
            times.append(time.perf_counter())
            text.append(ev.text)
        elif isinstance(ev, Finished):
            fin = ev
    r = _row("direct", t0, c0, times, "".join(text), fin.generated_tokens, fin)
    r["client_cpu_ms_per_token"] = 0.0
    r["cpu_ms_per_token_without_client"] = r["cpu_ms_per_token"]
    return r


def _served(eng, srv, msgs, tokens: int) -> dict:
    """One streamed chat completion through the server, timed by the client."""
    eng.forget_prefix()
    body = json.dumps({"model": srv.api.served().model_id, "messages": msgs, "max_tokens": tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    c0, t0, th0 = _cpu_s(), time.perf_counter(), time.thread_time()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read()[:500]!r}")
    times, text, usage = [], [], None
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        d = json.loads(data)
        if d.get("usage"):
            usage = d["usage"]
        for ch in d.get("choices", []):
            piece = ch["delta"].get("content")
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    conn.close()
    r = _row("server", t0, c0, times, "".join(text), usage["completion_tokens"], None)
    # this thread is the HTTP client: its CPU is not the server's
    client = time.thread_time() - th0
    r["client_cpu_ms_per_token"] = 1e3 * client / max(r["tokens"], 1)
    r["cpu_ms_per_token_without_client"] = r["cpu_ms_per_token"] - r["client_cpu_ms_per_token"]
    return r


def _row(arm, t0, c0, times, text, n, fin) -> dict:
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - c0
    dec = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    r = {"arm": arm, "tokens": n, "ttft_s": times[0] - t0 if times else wall, "decode_tok_per_s": dec,
         "wall_s": wall, "cpu_s": cpu, "cpu_ms_per_token": 1e3 * cpu / max(n, 1),
         "wall_ms_per_token": 1e3 * wall / max(n, 1), "text": text, "load_avg": os.getloadavg()[0]}
    if fin is not None:
        r.update(engine_ttft_s=fin.ttft_s, engine_decode_tok_per_s=fin.decode_tok_per_s)
    return r


def _multi_turn(eng, srv, tokens: int) -> dict:
    """Turn 1, then turn 2 extending it: prompt tokens, computed (prefill) tokens, TTFT."""
    import urllib.request

    def chat(msgs):
        body = json.dumps({"model": srv.api.served().model_id, "messages": msgs, "max_tokens": tokens}).encode()
        req = urllib.request.Request(srv.url + "/chat/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return out, time.perf_counter() - t0

    def metric(name):
        with urllib.request.urlopen(srv.url.removesuffix("/v1") + "/metrics", timeout=60) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does `os.path.join` do?"}]
    eng.forget_prefix()
    r1, w1 = chat(turn1)
    p1 = int(metric("colibri_last_prefill_tokens"))
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": FOLLOW_UP}]
    r2, w2 = chat(turn2)
    p2 = int(metric("colibri_last_prefill_tokens"))
    eng.forget_prefix()           # the same turn 2 without the reused prefix, for comparison
    r2c, w2c = chat(turn2)
    p2c = int(metric("colibri_last_prefill_tokens"))
    new = r2["usage"]["prompt_tokens"] - r1["usage"]["prompt_tokens"] - r1["usage"]["completion_tokens"]
    return {"turn1_prompt_tokens": r1["usage"]["prompt_tokens"], "turn1_prefill_tokens": p1,
            "turn1_completion_tokens": r1["usage"]["completion_tokens"],
            "turn2_prompt_tokens": r2["usage"]["prompt_tokens"], "turn2_prefill_tokens": p2,
            "turn2_new_tokens": new, "turn2_prefill_is_only_new_tokens": p2 == new,
            "turn2_cold_prefill_tokens": p2c, "turn2_wall_s": w2, "turn2_cold_wall_s": w2c,
            "same_answer_warm_and_cold": r2["choices"][0]["message"]["content"] == r2c["choices"][0]["message"]["content"]}


def cmd_serve(a) -> int:
    """Both arms, interleaved; then multi-turn; results in bench/results/<name>.{json,md}."""
    from ..config import EngineConfig
    from ..generate import Engine
    from ..server import LocalServer, ServerOptions
    store = a.store
    if store is None:
        from ..library import default_store
        store = str(default_store())
    cfg = EngineConfig(store=store, history=False, pinning=False, ram_budget_gb=a.ram_budget_gb,
                       threads=a.threads).validated()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": a.prompt}]
    rows = []
    with Engine.open(cfg) as eng:
        srv = LocalServer.for_engine(eng, ServerOptions(port=0))
        srv.start()
        try:
            _direct(eng, msgs, a.tokens)      # warm-up: JIT, every expert the answer routes to
            _served(eng, srv, msgs, a.tokens)
            for rep in range(a.reps):
                order = (_direct, _served) if rep % 2 == 0 else (_served, _direct)
                for fn in order:
                    r = fn(eng, msgs, a.tokens) if fn is _direct else fn(eng, srv, msgs, a.tokens)
                    r["rep"] = rep
                    rows.append(r)
                    print(f"rep {rep} {r['arm']:>6}: TTFT {1e3 * r['ttft_s']:.1f} ms, {r['decode_tok_per_s']:.1f} "
                          f"tok/s, {r['cpu_ms_per_token']:.2f} CPU ms/token (load {r['load_avg']:.1f})", flush=True)
            multi = _multi_turn(eng, srv, a.tokens)
        finally:
            srv.stop()

    def med(arm, key):
        return statistics.median(r[key] for r in rows if r["arm"] == arm)
    texts = {r["text"] for r in rows}
    summary = {k: {arm: med(arm, k) for arm in ("direct", "server")}
               for k in ("ttft_s", "decode_tok_per_s", "cpu_ms_per_token", "cpu_ms_per_token_without_client",
                         "client_cpu_ms_per_token", "wall_ms_per_token")}
    summary["overhead_wall_ms_per_token"] = summary["wall_ms_per_token"]["server"] - summary["wall_ms_per_token"]["direct"]
    summary["overhead_cpu_ms_per_token"] = summary["cpu_ms_per_token"]["server"] - summary["cpu_ms_per_token"]["direct"]
    summary["server_overhead_cpu_ms_per_token"] = (summary["cpu_ms_per_token_without_client"]["server"]
                                                   - summary["cpu_ms_per_token_without_client"]["direct"])
    summary["overhead_ttft_ms"] = 1e3 * (summary["ttft_s"]["server"] - summary["ttft_s"]["direct"])
    summary["decode_ratio_server_over_direct"] = (summary["decode_tok_per_s"]["server"]
                                                  / summary["decode_tok_per_s"]["direct"])
    summary["identical_text"] = len(texts) == 1
    for r in rows:
        r.pop("text")
    table = md_table(rows, [("rep", "rep", "d"), ("arm", "arm", ""), ("tokens", "tokens", "d"),
                            ("TTFT s", "ttft_s", ".4f"), ("decode tok/s", "decode_tok_per_s", ".1f"),
                            ("CPU ms/token", "cpu_ms_per_token", ".2f"),
                            ("client CPU ms/token", "client_cpu_ms_per_token", ".2f"),
                            ("wall ms/token", "wall_ms_per_token", ".2f"),
                            ("load", "load_avg", ".1f")])
    s = summary
    table += (f"\n\nMedians: TTFT direct {1e3 * s['ttft_s']['direct']:.1f} ms, server {1e3 * s['ttft_s']['server']:.1f} ms "
              f"({s['overhead_ttft_ms']:+.1f} ms); decode direct {s['decode_tok_per_s']['direct']:.1f} tok/s, server "
              f"{s['decode_tok_per_s']['server']:.1f} tok/s (ratio {s['decode_ratio_server_over_direct']:.3f}); "
              f"overhead per token {s['overhead_wall_ms_per_token']:+.2f} ms wall, "
              f"{s['overhead_cpu_ms_per_token']:+.2f} ms CPU with the in-process HTTP client "
              f"({s['server_overhead_cpu_ms_per_token']:+.2f} ms CPU without the client thread's); direct CPU "
              f"{s['cpu_ms_per_token']['direct']:.2f} ms/token; same text in every run: {s['identical_text']}.\n\n"
              f"Multi-turn: turn 1 prompt {multi['turn1_prompt_tokens']} tokens (computed {multi['turn1_prefill_tokens']}), "
              f"answer {multi['turn1_completion_tokens']}; turn 2 prompt {multi['turn2_prompt_tokens']} tokens, "
              f"computed {multi['turn2_prefill_tokens']} = its new tokens {multi['turn2_new_tokens']}: "
              f"{multi['turn2_prefill_is_only_new_tokens']} (without the reused prefix: "
              f"{multi['turn2_cold_prefill_tokens']}; {multi['turn2_wall_s']:.3f} s vs {multi['turn2_cold_wall_s']:.3f} s; "
              f"same answer: {multi['same_answer_warm_and_cold']}).")
    write_results(a.name, {"machine": machine_info(), "store": store, "prompt": a.prompt, "tokens": a.tokens,
                           "threads": a.threads,
                           "reps": a.reps, "rows": rows, "summary": summary, "multi_turn": multi}, table,
                  out_dir=a.out_dir)
    return 0


def add_parser(bs) -> None:
    """Register ``serve`` under ``colibri bench``."""
    p = bs.add_parser("serve", help="the OpenAI-compatible server vs the engine called directly; multi-turn prefill")
    p.add_argument("--store", default=None, help="converted store (default: the bundled default model)")
    p.add_argument("--prompt", default=QUESTION)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ram-budget-gb", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads (1: the CPU time counts compute, not the spin-waits of OpenMP "
                        "threads on a shared machine; 0 = all cores)")
    p.add_argument("--name", default="serve_default")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(fn=cmd_serve)
