"""Speculative decoding (engine/speculative.py): greedy ids identical with speculation on and
off for every family (hybrids with recurrent state and MLA included), seeded sampling the same
token stream, the sampled distribution equal to plain sampling (chi-square), drafts that are
both kept and rejected, several tokens per forward, the drafter and the draft-length rule."""

from __future__ import annotations

import numpy as np
import pytest

from engine import convert_checkpoint, speculative
from engine.config import EngineConfig
from engine.events import Finished, GenerateRequest, SamplingParams, StepMetrics
from engine.generate import Engine
from engine.observers import Observer
from engine.speculative import DraftLength, PromptLookup
from engine.bench.synthetic import gpt_oss_config, write_checkpoint

from test_families import FAMILY_CONFIGS

CONFIGS = {**FAMILY_CONFIGS, "gpt_oss": gpt_oss_config()}
# a prompt that repeats itself: prompt lookup drafts from it, the random models follow it only
# in part, so drafts are both kept and rejected
INT4 = ("olmoe", "qwen3_moe", "deepseek_v3", "qwen3_next")
PROMPT = tuple([5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7])


@pytest.fixture(autouse=True)
def _fixed_draft_length(monkeypatch):
    """Every draft as long as allowed: which drafts are made does not depend on timing."""
    monkeypatch.setattr(speculative, "ADAPT", False)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    out = {}
    for name, cfg in CONFIGS.items():
        d = tmp_path_factory.mktemp("spec")
        ck = write_checkpoint(d / name, cfg, seed=11, std=0.1)
        out[name] = convert_checkpoint(ck, d / f"{name}-int8", quant="int8")
        if name in INT4:  # the int4 kernels too: sorted prefill experts vs the one-call decode step
            out[f"{name}@int4"] = convert_checkpoint(ck, d / f"{name}-int4", quant="int4")
    return out


class Forwards(Observer):
    """Records (pos0, T) of every forward."""

    def __init__(self):
        self.calls = []

    def on_forward_start(self, pos0, num_tokens):
        self.calls.append((pos0, num_tokens))


class NoStop:
    """A constraint that rules out the stop ids, so every answer runs to its length (and the
    constraint path is exercised with drafts)."""

    def __init__(self, eos_ids):
        self.eos = sorted(eos_ids)

    def mask(self, n: int) -> np.ndarray:
        m = np.ones(n, bool)
        m[[e for e in self.eos if e < n]] = False
        return m

    def accept(self, token_id: int) -> None:
        assert token_id not in self.eos


def _run(store, speculation: str, temperature: float = 0.0, seeds=(7,), n: int = 24, prompt=PROMPT,
         draft_max: int = 4, top_k: int = 0, observer=None, stop: bool = False) -> list[Finished]:
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, speculation=speculation,
                       draft_max=draft_max)
    out = []
    with Engine.open(cfg) as eng:
        eng.model.wait_decode_ready(600)  # plain steps in the one-call kernel where the family has it
        if observer is not None:
            eng.subscribe(observer)
        for seed in seeds:
            req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(
                temperature=temperature, max_new_tokens=n, seed=seed, top_k=top_k),
                constraint=None if stop else NoStop(eng.tokenizer.eos_ids))
            fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
            assert fin.error == "", fin.error
            out.append(fin)
    return out


@pytest.mark.parametrize("name", list(CONFIGS) + [f"{n}@int4" for n in INT4])
def test_greedy_ids_identical_with_speculation(stores, name, monkeypatch):
    monkeypatch.setattr(speculative, "NGRAM_MIN", 1)  # draft after any token seen before
    said, = _run(stores[name], "off")
    prompt = PROMPT + said.token_ids  # tokens the model favours: its answer repeats some
    off, = _run(stores[name], "off", prompt=prompt)
    on, = _run(stores[name], "prompt_lookup", prompt=prompt)
    assert on.token_ids == off.token_ids
    assert on.text == off.text
    assert off.draft_tokens == 0 and off.tokens_per_forward == 1.0
    assert on.draft_tokens > 0  # drafts were verified


def test_drafts_are_kept_and_rejected_across_families(stores):
    """The prompt makes drafts that the models keep in part: both outcomes are exercised."""
    kept = rejected = 0
    for name in ("olmoe", "qwen3_next", "deepseek_v3", "lfm2_moe", "granitemoehybrid"):
        on, = _run(stores[name], "prompt_lookup")
        kept += on.accepted_tokens
        rejected += on.draft_tokens - on.accepted_tokens
    assert kept > 0 and rejected > 0


@pytest.mark.parametrize("name", ["olmoe", "qwen3_next", "lfm2_moe", "granitemoehybrid", "deepseek_v3", "gpt_oss"])
def test_seeded_sampling_is_the_same_token_stream(stores, name):
    off = _run(stores[name], "off", temperature=0.9, seeds=(1, 2, 3))
    on = _run(stores[name], "prompt_lookup", temperature=0.9, seeds=(1, 2, 3))
    assert [f.token_ids for f in on] == [f.token_ids for f in off]
    assert [f.seed for f in on] == [1, 2, 3]


def test_several_tokens_per_forward_and_one_forward_per_draft(tiny_store):
    """Drafts kept: each draft verified by one forward over its positions, fewer forwards
    than tokens, and tokens per forward counted as such."""
    obs = Forwards()
    on, = _run(tiny_store, "prompt_lookup", n=40, observer=obs)
    off, = _run(tiny_store, "off", n=40)
    assert on.token_ids == off.token_ids and on.finish_reason == "length"
    decode = obs.calls[1:]
    # each forward starts where the kept positions of the one before end
    assert all(p0 < p1 <= p0 + t for (p0, t), (p1, _) in zip(decode, decode[1:]))
    assert 1 < max(t for _, t in decode) <= 5  # the last token and a draft of at most draft_max = 4
    assert on.accepted_tokens > 0
    assert len(decode) == len(on.token_ids) - 1 - on.accepted_tokens  # one forward less per kept token
    assert on.tokens_per_forward == pytest.approx((len(on.token_ids) - 1) / len(decode))


def test_step_metrics_report_tokens_per_forward(tiny_store):
    """Every token still has its StepMetrics (also a kept draft's), which carry the answer's
    tokens per forward and share of drafts kept so far."""
    cfg = EngineConfig(store=str(tiny_store), history=False, o_direct=False, speculation="prompt_lookup",
                       draft_max=4)
    with Engine.open(cfg) as eng:
        req = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
                              constraint=NoStop(eng.tokenizer.eos_ids))
        evs = list(eng.generate(req))
    steps = [e for e in evs if isinstance(e, StepMetrics)]
    fin = evs[-1]
    assert isinstance(fin, Finished) and fin.generated_tokens == 40 and fin.accepted_tokens > 0
    assert [s.token_index for s in steps] == list(range(1, 40))
    assert steps[-1].tokens_per_forward > 1 and 0 < steps[-1].draft_acceptance <= 1


def test_teacher_forcing_decodes_one_token_per_forward(tiny_store):
    """forced_ids (benchmarks, routing traces) measure one-token decode steps: no drafts."""
    fin, = _run(tiny_store, "prompt_lookup", prompt=PROMPT)
    cfg = EngineConfig(store=str(tiny_store), history=False, o_direct=False, speculation="prompt_lookup")
    with Engine.open(cfg) as eng:
        req = GenerateRequest(prompt_ids=PROMPT, forced_ids=fin.token_ids,
                              sampling=SamplingParams(max_new_tokens=len(fin.token_ids)))
        forced = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
    assert fin.draft_tokens > 0 and forced.draft_tokens == 0 and forced.tokens_per_forward == 1.0
    assert forced.token_ids == fin.token_ids


def _chi2_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples of categories (categories
    seen fewer than 10 times in both together pooled into one)."""
    cats, tot = np.unique(np.concatenate([a, b]), return_counts=True)
    rare = cats[tot < 10]
    a = np.where(np.isin(a, rare), -1, a)
    b = np.where(np.isin(b, rare), -1, b)
    cats = np.union1d(a, b)
    ca = np.array([(a == c).sum() for c in cats], float)
    cb = np.array([(b == c).sum() for c in cats], float)
    tot = ca + cb
    ea, eb = tot * len(a) / (len(a) + len(b)), tot * len(b) / (len(a) + len(b))
    return float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()), len(cats) - 1


def _chi2_quantile_999(dof: int) -> float:
    """The 99.9% quantile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampled_distribution_equals_plain_sampling(tiny_store, monkeypatch):
    """Disjoint seeds, speculation on and off: at each answer position the tokens drawn follow
    the same distribution (two-sample chi-square; a sampler that kept drafts it should reject
    shifts the positions after a draft towards the drafted tokens)."""
    n_each = 300
    # draft after any single token seen before: most sampled tokens were (the answers repeat theirs)
    monkeypatch.setattr(speculative, "NGRAM_MIN", 1)
    prompt = PROMPT + (177, 293, 163, 208, 60, 79, 74, 214, 254, 43)  # the tokens this model favours after it
    on = _run(tiny_store, "prompt_lookup", temperature=1.5, seeds=range(n_each), n=6, prompt=prompt, top_k=3)
    off = _run(tiny_store, "off", temperature=1.5, seeds=range(10_000, 10_000 + n_each), n=6, prompt=prompt,
               top_k=3)
    assert sum(f.draft_tokens for f in on) > n_each
    rejected = sum(f.draft_tokens - f.accepted_tokens for f in on)
    assert rejected > 50 and sum(f.accepted_tokens for f in on) > 50
    for i in range(1, 6):  # position 0 comes from the prefill
        a = np.array([f.token_ids[i] for f in on if len(f.token_ids) > i])
        b = np.array([f.token_ids[i] for f in off if len(f.token_ids) > i])
        stat, dof = _chi2_two_sample(a, b)
        assert dof >= 1 and stat < _chi2_quantile_999(dof), (i, stat, dof)


def test_prompt_lookup_takes_the_longest_latest_match():
    d = PromptLookup(n_max=3, n_min=2)
    ctx = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 2, 3]
    assert d.propose(ctx, 3) == [7, 6, 5]  # "2 3" last followed by 7 6 5 (latest match)
    ctx += [7]
    assert d.propose(ctx, 2) == [6, 5]  # "2 3 7" (3-gram) beats the 2-gram "3 7"
    assert PromptLookup(n_max=2, n_min=2).propose([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # periodic
    assert d.propose([4, 4], 3) == []
    assert PromptLookup().propose([1, 2, 3, 4], 4) == []  # no earlier occurrence


def test_draft_length_follows_acceptance_and_cost(monkeypatch):
    monkeypatch.setattr(speculative, "ADAPT", True)
    good = DraftLength(8)
    assert good.choose(8) == 0  # the first decode forward measures a one-token one
    good.record(0, 0, 0.010)  # a one-token forward: 10 ms
    for _ in range(20):
        good.record(8, 8, 0.012)  # 9 positions for 12 ms, every draft token kept
    assert good.choose(8) == 8
    assert good.choose(3) == 3  # never more than the room
    bad = DraftLength(8)
    bad.record(0, 0, 0.010)
    for _ in range(20):
        bad.record(4, 0, 0.030)  # every draft rejected at its first token, 5 positions for 30 ms
    assert bad.choose(8) == 0
    assert any(bad.choose(8) for _ in range(speculative.EXPLORE_EVERY))  # still measured now and then
    # a fast one-token step beside a slower verify path: worth it only at high acceptance
    costly = DraftLength(8)
    costly.record(0, 0, 0.001)
    costly.record(1, 1, 0.002)
    costly.record(8, 8, 0.005)  # 9 positions: 5 ms
    assert costly.estimate(5) == pytest.approx(0.002 + 3 * 0.003 / 7)
    for _ in range(30):
        costly.record(8, 8, 0.005)
    assert costly.choose(8) == 8  # ~9 tokens for 5 ms beats 1 for 1 ms
    for _ in range(30):
        costly.record(8, 1, 0.005)
    assert costly.choose(8) == 0  # ~2 tokens for 2-5 ms does not


def test_cancel_ends_within_one_token_inside_a_kept_draft(tiny_store):
    """Stop: no further token of a verified draft comes after the cancel is set."""
    import threading

    from engine.events import TokenEvent
    cfg = EngineConfig(store=str(tiny_store), history=False, o_direct=False, speculation="prompt_lookup",
                       draft_max=4)
    with Engine.open(cfg) as eng:
        req = GenerateRequest(prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
                              constraint=NoStop(eng.tokenizer.eos_ids))
        full = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
        assert full.accepted_tokens > 0
        for stop_at in range(1, 12):  # some of these land inside a kept draft
            cancel, after = threading.Event(), 0
            for ev in eng.generate(req, cancel):
                if isinstance(ev, TokenEvent):
                    after += cancel.is_set()
                    if ev.index == stop_at:
                        cancel.set()
                if isinstance(ev, Finished):
                    fin = ev
            assert fin.finish_reason == "cancelled" and after == 0 and fin.generated_tokens == stop_at + 1
            assert fin.token_ids == full.token_ids[:stop_at + 1]
