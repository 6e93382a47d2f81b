"""Sampling seeds: "auto" draws a fresh seed per sampler, reports it, and the reported seed
replays the same tokens (the engine side of Regenerate)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import ConfigError, Engine, EngineConfig, Finished, GenerateRequest, SamplingParams, convert_checkpoint
from engine.bench import synthetic
from engine.sampling import Sampler, fresh_seed
from engine.settings import setting


def _draws(s, n=64):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(n, 50))
    return [s(row) for row in logits]


def test_auto_seed_is_fresh_and_replays():
    assert setting("seed").default is None and setting("seed").auto
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert 0 <= a.seed < 2 ** 63 and a.seed != b.seed
    assert _draws(a) != _draws(b)
    again = Sampler(SamplingParams(temperature=1.0, seed=a.seed))
    assert _draws(Sampler(SamplingParams(temperature=1.0, seed=a.seed))) == _draws(again)
    assert len({fresh_seed() for _ in range(100)}) == 100
    with pytest.raises(ConfigError, match="seed"):
        Sampler(SamplingParams(temperature=1.0, seed=-1))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    ck = synthetic.write_checkpoint(root / "ck", synthetic.olmoe_config(), seed=0)
    return convert_checkpoint(ck, root / "store", quant="int8")


def test_finished_reports_the_seed_and_it_reproduces(store):
    with Engine.open(EngineConfig(store=str(store), history=False)) as eng:
        def run(seed):
            req = GenerateRequest(prompt_ids=(1, 2, 3), sampling=SamplingParams(
                temperature=0.7, max_new_tokens=10, seed=seed))
            return [e for e in eng.generate(req) if isinstance(e, Finished)][0]
        x, y = run(None), run(None)
        assert x.seed != y.seed and x.token_ids != y.token_ids
        assert run(x.seed).token_ids == x.token_ids and run(x.seed).seed == x.seed


def test_colibri_run_prints_the_auto_seed_and_it_reproduces(store, capsys):
    import re

    from colibri_app.launcher import main as colibri
    base = ["run", "--model", str(store), "--prompt", "hello", "--raw", "--max-new-tokens", "8",
            "--no-history", "--threads", "1", "--temperature", "0.7"]
    assert colibri(base) == 0
    cap = capsys.readouterr()
    m = re.search(r"seed (\d+) \(--seed \1 reproduces this answer\)", cap.err)
    assert m, cap.err
    assert colibri(base + ["--seed", m.group(1)]) == 0
    again = capsys.readouterr()
    assert again.out == cap.out and "reproduces" not in again.err   # a given seed is not repeated
