"""The bundled default model: our engine reproduces its held-out loss, and routing is healthy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import Engine, EngineConfig, convert_checkpoint
from engine.library import default_model_dir
from engine.evaluate import teacher_forced_nll, usage_entropy

MODEL = default_model_dir()
pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(),
                                reason="default model not trained yet")

N_SEQ = 12  # a fixed held-out sample (the first 12 sequences of heldout_sample.jsonl)


@pytest.fixture(scope="module")
def seqs():
    lines = (MODEL / "heldout_sample.jsonl").read_text().splitlines()
    return [json.loads(x)["ids"] for x in lines[:N_SEQ]]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("default")
    return {q: convert_checkpoint(MODEL, d / q, quant=q) for q in ("f32", "int8")}


def _nll(store, seqs):
    with Engine.open(EngineConfig(store=str(store), pilot=0, pinning=False, history=False)) as eng:
        tot = n = 0
        for s in seqs:
            a, b = teacher_forced_nll(eng.model, s)
            tot, n = tot + a, n + b
        return tot / n, eng


@pytest.mark.parity
def test_heldout_nll_matches_transformers(stores, seqs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.OlmoeForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tot = n = 0
    with torch.no_grad():
        for s in seqs:
            logits = m(torch.tensor([s])).logits[0, :-1].double()
            tot += torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum").item()
            n += len(s) - 1
    ref = tot / n
    f32, _ = _nll(stores["f32"], seqs)
    int8, _ = _nll(stores["int8"], seqs)
    print(f"held-out NLL: transformers {ref:.5f}, colibri f32 {f32:.5f}, int8 {int8:.5f}")
    assert abs(f32 - ref) <= 1e-3
    assert abs(int8 - ref) <= 0.01 * ref


def test_routing_is_not_collapsed(stores, seqs):
    with Engine.open(EngineConfig(store=str(stores["int8"]), pilot=0, pinning=False, history=False)) as eng:
        eng.heat.reset()
        for s in seqs:
            eng.model.forward(np.asarray(s), 0)
        ent = usage_entropy(eng.heat.session)
        floor = 0.8 * np.log(eng.args.num_experts)
        assert (ent >= floor).all(), (ent, floor)


def test_topology_and_size():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "olmoe" and cfg["num_hidden_layers"] >= 8
    assert cfg["num_experts"] >= 32 and cfg["num_experts_per_tok"] >= 4
    assert (MODEL / "model.safetensors").stat().st_size <= 50_000_000
    assert "PSF" in (MODEL / "README.md").read_text()
