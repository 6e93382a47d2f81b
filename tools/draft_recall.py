"""How well can the next layer's experts be predicted while a layer waits for a miss?

    python tools/draft_recall.py STORE [DECODE_STEPS]

Opens STORE with every expert resident, decodes a seeded forced token stream (8-token prompt,
then DECODE_STEPS steps, default 16) and, at every decode layer j, scores predictions of layer
j+1's top-k experts (recall: the share of the real top-k predicted) made from:

  P1       router_{j+1}(x after layer j's attention)        (PILOT mode 1's input)
  FULL     router_{j+1}(x after layer j's MoE)               (no attention of layer j+1)
  PART     as FULL, one routed expert's share left out       (a miss: the draft residual)
  PARTATT  PART + attention_{j+1}(PART)                      (PILOT's draft lookahead)
  D2FULL / D2PART  layer j+2 from FULL / from PARTATT

each through layer t's own post-attention norm and router. The draft's attention writes the
KV row of the position, which the real layer j+1 rewrites before reading (a measurement tool,
not the engine's path: MoEModel.draft_attention puts the row back). On the 7B random-weight
store: P1 0.70, FULL 0.75, PART 0.74, PARTATT 0.96, D2 0.63 / 0.72.
"""
import sys, numpy as np
from engine.config import EngineConfig
from engine.generate import Engine
from engine.observers import Observer
from engine import kernels as K
from engine.bench.common import forced_stream

if len(sys.argv) < 2:
    sys.exit(__doc__)
store = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
from engine.config import ModelArgs
E = ModelArgs.from_hf_config(f"{store}/config.json").num_experts
eng = Engine.open(EngineConfig(store=store, cap=E, pilot=0, pinning=False, history=False, context_length=256).validated())
m = eng.model; a = m.args; L = m.num_moe_layers; k = a.num_experts_per_tok
for l in range(L):
    eng.cache.load_experts(l, np.arange(a.num_experts))
rng = np.random.default_rng(1)
def top(t, x):
    h = np.empty_like(x); K.rmsnorm(x, m.moe_norm(t), a.rms_norm_eps, h)
    lg = m.router_logits(t, h)[0]
    return set(np.argsort(-lg, kind="stable")[:k].tolist())
class Obs(Observer):
    def __init__(s):
        s.pred = {}; s.stats = {n: [] for n in ("P1", "FULL", "PART", "PARTATT", "D2FULL", "D2PART")}; s.pos = 0
    def on_forward_start(s, pos0, T): s.pos = pos0; s.T = T
    def on_after_attention(s, j, x):
        if s.T != 1: return
        s.xa = x.copy()
        if j + 1 < L: s.pred[(j + 1, "P1")] = top(j + 1, x)
    def on_route(s, j, idx, logits):
        if s.T != 1: return
        for (t, name), p in list(s.pred.items()):
            if t == j:
                s.stats[name].append(len(p & set(idx[0].tolist())) / k); del s.pred[(t, name)]
        s.idx, s.w = m.route(j, logits)
    def on_after_moe(s, j, x):
        if s.T != 1 or j + 1 >= L: return
        h = np.empty_like(s.xa); K.rmsnorm(s.xa, m.layers[m.moe_layer_ids[j]]["post_attention_layernorm"], a.rms_norm_eps, h)
        r = int(rng.integers(k)); e = int(s.idx[0, r])
        views = eng.cache.acquire(j, e)
        y = np.empty((1, a.hidden_size), np.float32); sc = np.empty((1, a.moe_intermediate_size), np.float32)
        m.expert_forward(views, h, sc, y); eng.cache.release(j, e)
        part = x - s.w[0, r] * y
        s.pred[(j + 1, "FULL")] = top(j + 1, x)
        s.pred[(j + 1, "PART")] = top(j + 1, part)
        att = m.attention(m.moe_layer_ids[j + 1], part.copy(), s.pos)
        s.pred[(j + 1, "PARTATT")] = top(j + 1, part + att)
        if j + 2 < L:
            s.pred[(j + 2, "D2FULL")] = top(j + 2, x); s.pred[(j + 2, "D2PART")] = top(j + 2, part + att)
o = Obs(); m.subscribe(o)
ids = forced_stream(a.vocab_size, 8 + n, 0)
x = m.forward(np.array(ids[:8]), 0)
for p in range(8, 8 + n):
    m.forward(np.array([ids[p]]), p)
for name, v in o.stats.items():
    print(f"{name:8s} recall {np.mean(v):.3f} over {len(v)}")
eng.close()
