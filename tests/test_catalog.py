"""The catalog of MoE models people run and "Recommended for this computer": every entry's
config parses with its family's own parser, and the recommendations for 8, 16, 32 and 64 GB
machines (memory given, not probed) carry the sizing module's own numbers."""

from __future__ import annotations

import pytest

from engine import sizing
from engine.library import CATALOG, recommend
from engine.library.catalog import MIN_TOKENS_PER_S

GB = 10 ** 9
REPOS = {m.repo_id for m in CATALOG}


def test_the_catalog_names_the_models_people_run_and_parses():
    for repo in ("allenai/OLMoE-1B-7B-0125-Instruct", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-Coder-30B-A3B-Instruct",
                 "openai/gpt-oss-20b", "openai/gpt-oss-120b", "zai-org/GLM-4.5-Air", "deepseek-ai/DeepSeek-V2-Lite-Chat",
                 "mistralai/Mixtral-8x7B-Instruct-v0.1", "Qwen/Qwen3-235B-A22B"):
        assert repo in REPOS
    for m in CATALOG:
        a = m.args()  # the family's parser: a wrong key or shape raises ConfigError
        assert a.num_experts > a.num_experts_per_tok > 0 and a.num_moe_layers > 0
    # the published sizes are the parameter counts people know (bf16: 2 bytes a parameter)
    by = {m.repo_id: m for m in CATALOG}
    for repo, billions in (("Qwen/Qwen3-30B-A3B", 30.5), ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7),
                           ("Qwen/Qwen3-235B-A22B", 235), ("allenai/OLMoE-1B-7B-0125-Instruct", 6.9),
                           ("deepseek-ai/DeepSeek-V2-Lite-Chat", 15.7), ("zai-org/GLM-4.5-Air", 106)):
        size = sizing.estimate(by[repo].args(), "f16").store_bytes
        assert abs(size / (2 * billions * GB) - 1) < 0.06, (repo, size)


@pytest.mark.parametrize("ram_gb", [8, 16, 32, 64])
def test_recommendations_per_machine_use_the_sizing_rule(ram_gb):
    total, available = ram_gb * GB, int(ram_gb * GB * 0.8)
    recs = recommend(total, available)
    assert {r.model.repo_id for r in recs} == REPOS
    for r in recs:
        a = r.model.args()
        est = sizing.estimate(a, r.quant, 0)
        assert r.estimate == est
        assert r.download_bytes == sizing.estimate(a, r.model.published, 0).store_bytes
        assert (r.verdict, r.message) == sizing.ram_verdict(est, a.num_experts_per_tok, total, available)
        try:
            plan = sizing.plan_before_open(est, available)
        except sizing.BudgetError:
            assert r.budget_bytes == 0 and r.slots_per_layer == 0 and not r.recommended
            continue
        assert r.budget_bytes == min(plan.budget, est.all_in_ram_bytes)
        assert r.slots_per_layer == plan.slots // plan.layers
        assert f"about {r.slots_per_layer} expert slots per layer fit" in r.message or r.verdict != "ok"
        assert r.tokens_per_s == sizing.expected_speed_range(est, r.slots_per_layer)
        assert r.recommended == (r.verdict != "refuse" and r.tokens_per_s[0] >= MIN_TOKENS_PER_S)
        assert r.quant in r.model.quants and not r.disk_measured
    rec = [r.model.repo_id for r in recs if r.recommended]
    assert rec and recs[:len(rec)] == [r for r in recs if r.recommended]  # recommended first
    assert [r.tokens_per_s[0] for r in recs[:len(rec)]] == sorted((r.tokens_per_s[0] for r in recs[:len(rec)]),
                                                                  reverse=True)



def test_what_each_machine_gets():
    small = {r.model.repo_id: r for r in recommend(8 * GB, int(6.4 * GB))}
    big = {r.model.repo_id: r for r in recommend(64 * GB, int(51.2 * GB))}
    assert small["allenai/OLMoE-1B-7B-0125-Instruct"].recommended
    assert small["Qwen/Qwen3-235B-A22B"].verdict == "refuse" and not small["Qwen/Qwen3-235B-A22B"].recommended
    assert small["zai-org/GLM-4.5-Air"].verdict == "refuse"
    assert not small["openai/gpt-oss-120b"].recommended and big["openai/gpt-oss-120b"].recommended
    # more RAM: a budget at least as large, at least as many experts in RAM, never slower
    for repo in REPOS:
        if small[repo].quant == big[repo].quant and small[repo].slots_per_layer:
            assert big[repo].budget_bytes >= small[repo].budget_bytes
            assert big[repo].slots_per_layer >= small[repo].slots_per_layer
            assert big[repo].tokens_per_s[0] >= small[repo].tokens_per_s[0]
    # the 30B-A3B takes int8 when the budget holds every expert, int4 when it does not
    assert big["Qwen/Qwen3-30B-A3B"].quant == "int8" and small["Qwen/Qwen3-30B-A3B"].quant == "int4"


def test_a_measured_disk_speed_is_used_and_said():
    slow = {r.model.repo_id: r for r in recommend(16 * GB, 12 * GB, disk_bytes_per_s=0.2e9)}
    fast = {r.model.repo_id: r for r in recommend(16 * GB, 12 * GB)}
    r = slow["Qwen/Qwen3-30B-A3B"]
    assert r.disk_measured and r.disk_bytes_per_s == 0.2e9
    assert r.tokens_per_s[0] < fast["Qwen/Qwen3-30B-A3B"].tokens_per_s[0]


def test_expected_speed_is_the_measured_rate_when_every_expert_is_in_ram():
    """All experts cached: no disk reads, so the speed is the compute rate over the bytes a
    token reads (OLMoE-1B-7B int8 measured 21.9 tok/s: the rate's source)."""
    a = next(m for m in CATALOG if m.repo_id.startswith("allenai/OLMoE")).args()
    est = sizing.estimate(a, "int8", 0)
    lo, hi = sizing.expected_speed_range(est, a.num_experts)
    assert hi == pytest.approx(sizing.COMPUTE_BYTES_PER_S_HIGH / sizing.active_bytes(est))
    assert hi == pytest.approx(21.9, rel=0.02)
    assert lo < hi and sizing.expected_tokens_per_s(est, 0) == 0.0
