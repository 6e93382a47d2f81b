"""The bundled default model: our engine reproduces its held-out loss, and routing is healthy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import Engine, EngineConfig, convert_checkpoint
from engine.library import default_model_dir
from engine.bench.evaluate import teacher_forced_nll, usage_entropy

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
    # The architecture is the one that trains best in the 90-minute budget: the side-by-side sweep (model card, architecture_sweep.json) chose
    # 6 layers x hidden 192 over 8 x 128 (held-out loss 4.435 vs 4.495 at equal wall-clock time).
    # Still a fine-grained MoE with trained routing: 32 experts, top-4, load-balancing loss.
    assert cfg["model_type"] == "olmoe" and cfg["num_hidden_layers"] >= 6
    assert cfg["num_experts"] >= 32 and cfg["num_experts_per_tok"] >= 4
    total = sum(f.stat().st_size for f in MODEL.iterdir() if f.is_file())
    assert total <= 60_000_000, total
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (MODEL / f).exists(), f
    assert json.loads((MODEL / "tokenizer_config.json").read_text())["chat_template"]
    assert "PSF" in (MODEL / "README.md").read_text()


def test_heldout_questions_are_about_heldout_modules():
    log = json.loads((MODEL / "training_log.json").read_text())
    held = set(log["corpus"]["heldout_top_level_modules"])
    qs = json.loads((MODEL / "heldout_questions.json").read_text())
    assert len(qs) == 50 and {q["kind"] for q in qs} == {"what", "howto"}
    assert all(q["about"].split(".")[0] in held for q in qs)
    assert len({q["about"] for q in qs}) == 50


def test_model_card_reports_the_measured_numbers():
    card = (MODEL / "README.md").read_text()
    ev = json.loads((MODEL / "engine_eval.json").read_text())
    before = json.loads((MODEL / "eval_before.json").read_text())
    for e in (ev, before):
        assert f"{e['int8']['nll']:.3f}" in card
        assert f"{e['heldout_text']['nats_per_char']:.3f}" in card
        for t in ("0.0", "0.7"):
            assert f"{e['score_t' + t]['all']['rouge_l']:.3f}" in card
    assert card.count("**Q: ") == 10
    for a in [a for a in ev["answers_t0.0"] if a["kind"] == "what"][:5]:
        assert a["answer"].strip() in card                  # verbatim


N_ANSWERS = 10
MIN_NAMED, MIN_ROUGE = 5, 0.25   # half the answers name the function; the model of 3b8b5be: 5 and 0.166;
# this model alone 7 and 0.111, with the documentation lookup and the copy prior 8 and 0.658


def test_answers_name_the_function(stores):
    """The bundled model as the app runs it answers held-out questions ("What does `cmath.tan`
    do?", modules it never saw) with the function's name and words of its docstring; the model
    it replaced answered "Return the file." to everything (0 of 10 named the function).

    The app's documentation lookup is on (the default, engine.docs_lookup): the model is given
    the entries of its Python's docstring index that match the question, held-out modules
    included (they are part of the user's Python; training never saw them, not even in a
    block), and has to find the asked one among them and copy its summary."""
    import sys
    sys.path.insert(0, str(MODEL.parent.parent.parent / "tools"))
    from model_card_samples import names_right, rouge_l

    from engine import ChatMessage, Finished, GenerateRequest, SamplingParams

    qs = [q for q in json.loads((MODEL / "heldout_questions.json").read_text()) if q["kind"] == "what"][:N_ANSWERS]
    named, rouge, found = 0, 0.0, 0
    with Engine.open(EngineConfig(store=str(stores["int8"]), history=False)) as eng:
        assert eng.loaded.docs_entries > 5000 and not eng.loaded.docs_problem
        for q in qs:
            req = GenerateRequest(messages=(ChatMessage("user", q["question"]),),
                                  sampling=SamplingParams(temperature=0.0, max_new_tokens=48))
            fin = [e for e in eng.generate(req) if isinstance(e, Finished)][0]
            found += q["about"] in fin.sources
            named += names_right(fin.text, q["names"])
            rouge += rouge_l(fin.text, q["reference"]) / len(qs)
    assert found == len(qs)                     # the lookup finds each asked object by its name
    assert named >= MIN_NAMED and rouge >= MIN_ROUGE, (named, rouge)
