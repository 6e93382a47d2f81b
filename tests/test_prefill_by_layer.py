"""A streamed prompt longer than a chunk is prefilled layer by layer: each expert a layer needs is
read once per prompt (not once per chunk), with the same logits as chunk by chunk."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine import convert_checkpoint
from engine.config import EngineConfig
from engine.generate import Engine
from engine.models import base
from engine.observers import Observer
from engine.bench.synthetic import olmoe_config, qwen3_moe_config, write_checkpoint


class Loads(Observer):
    def __init__(self):
        self.n = Counter()

    def on_load(self, layer, expert, nbytes, seconds, speculative):
        self.n[(layer, expert)] += 1


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    d = tmp_path_factory.mktemp("bylayer")
    cfg = olmoe_config(hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_experts=16,
                       num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    out = {}
    for q in ("int8", "int4"):
        out[q] = convert_checkpoint(write_checkpoint(d / "ck", cfg, seed=5) if q == "int8" else d / "ck",
                                    d / q, quant=q)
    qcfg = qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1, num_experts_per_tok=3)
    out["qwen3_moe"] = convert_checkpoint(write_checkpoint(d / "qk", qcfg, seed=7), d / "qwen3", quant="int8")
    return out


def _prefill(store, by_layer: bool, monkeypatch, T: int = 300):
    monkeypatch.setattr(base, "PREFILL_BY_LAYER", by_layer)
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, cap=4, idle_fill=False, pinning=False)
    with Engine.open(cfg) as eng:
        loads = Loads()
        eng.subscribe(loads)
        ids = (np.arange(T) * 7 + 3) % eng.args.vocab_size
        logits = eng.model.forward(ids, 0, all_logits=True)
        prefill_loads = Counter(loads.n)
        nxt = eng.model.forward(ids[:1], T)  # a decode step reads the KV rows the prefill wrote
        return logits, nxt, prefill_loads


@pytest.mark.parametrize("name", ["int8", "int4", "qwen3_moe"])
def test_each_expert_read_once_per_prompt_with_the_same_logits(streamed, monkeypatch, name):
    by_chunk, nxt_c, loads_c = _prefill(streamed[name], False, monkeypatch)
    by_layer, nxt_l, loads_l = _prefill(streamed[name], True, monkeypatch)
    assert np.array_equal(by_layer, by_chunk) and np.array_equal(nxt_l, nxt_c)
    assert max(loads_c.values()) > 1  # chunk by chunk, a cap of 4 reads experts again
    assert max(loads_l.values()) == 1  # layer by layer: each (layer, expert) read once for the prompt
    assert set(loads_l) == set(loads_c)  # the same experts
