"""The catalog of MoE models people run and "Recommended for this computer": every entry's
config parses with its family's own parser, and the recommendations for 8, 16, 32 and 64 GB
machines (memory given, not probed) carry the sizing module's own numbers."""

from __future__ import annotations

import dataclasses

import pytest

from engine import sizing
from engine.library import CATALOG, recommend
from engine.library.catalog import MIN_TOKENS_PER_S, SPEED_FOR_QUALITY

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
        est = sizing.estimate_gguf(a, r.gguf, 0).estimate if r.gguf else sizing.estimate(a, r.quant, 0)
        assert r.estimate == est
        assert r.download_bytes == (sizing.estimate_gguf(a, r.gguf, 0).download_bytes if r.gguf else
                                    sizing.estimate(a, r.model.published, 0).store_bytes)
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
        assert (r.quant == "gguf" if r.gguf else r.quant in r.model.quants) and not r.disk_measured
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
    # its safetensors: the 30B-A3B takes int8 when the budget holds every expert, int4 when it does not
    st_only = tuple(dataclasses.replace(m, gguf=()) for m in CATALOG)
    small = {r.model.repo_id: r for r in recommend(8 * GB, int(6.4 * GB), catalog=st_only)}
    big = {r.model.repo_id: r for r in recommend(64 * GB, int(51.2 * GB), catalog=st_only)}
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


def test_gguf_sizes_match_the_files_people_download():
    """sizing.estimate_gguf from the config alone against the -GGUF repositories' published file
    sizes (llama.cpp's quantizer mixes: Q4_K_M keeps half the experts' down rows at Q6_K)."""
    by = {m.repo_id: m for m in CATALOG}
    for repo, file_type, published in (("allenai/OLMoE-1B-7B-0125-Instruct", "Q4_K_M", 4.21 * GB),
                                       ("Qwen/Qwen3-30B-A3B", "Q4_K_M", 18.6 * GB)):
        g = sizing.estimate_gguf(by[repo].args(), file_type)
        assert abs(g.download_bytes / published - 1) < 0.02, (repo, g.download_bytes)
        assert g.expert_types == ("Q4_K", "Q4_K", "Q6_K")
    # rows no multiple of 256 wide take llama.cpp's fallback type
    assert sizing.estimate_gguf(by["zai-org/GLM-4.5-Air"].args(), "Q4_K_M").expert_types == ("Q4_K", "Q4_K", "Q8_0")
    with pytest.raises(ValueError, match="IQ1_S"):
        sizing.estimate_gguf(by["Qwen/Qwen3-30B-A3B"].args(), "IQ1_S")


def test_a_gguf_estimate_is_the_store_its_import_makes(tmp_path):
    """The estimate the recommendations use for a GGUF file is the one the check of the
    downloaded file makes (same slab, dense and RAM numbers), and its download size is the
    file's tensor data."""
    pytest.importorskip("gguf")
    import gguf

    from engine.bench import synthetic
    from engine.bench.gguf import write_gguf
    from engine.config import ModelArgs
    from engine.library.gguf_check import check_gguf
    ck = tmp_path / "ck"
    synthetic.write_checkpoint(ck, synthetic.olmoe_config(), seed=0)
    write_gguf(ck, tmp_path / "m-Q8_0.gguf", matrix_type="q8_0", log=lambda *_: None)
    args = ModelArgs.from_dict(synthetic.olmoe_config(), "config.json")
    g = sizing.estimate_gguf(args, "Q8_0", 256)
    got = check_gguf(tmp_path / "m-Q8_0.gguf", 256).estimate
    for f in ("slot_bytes", "expert_bytes", "dense_bytes", "kv_bytes", "ram_needed", "layer_slot_bytes"):
        assert getattr(g.estimate, f) == getattr(got, f), f
    data = sum(int(t.n_bytes) for t in gguf.GGUFReader(tmp_path / "m-Q8_0.gguf").tensors)
    assert g.download_bytes == data


@pytest.mark.parametrize("ram_gb", [8, 16, 32, 64])
def test_the_gguf_file_is_taken_where_it_is_the_smaller_download(ram_gb):
    total, available = ram_gb * GB, int(ram_gb * GB * 0.8)
    recs = recommend(total, available)
    for r in recs:
        a = r.model.args()
        st = sizing.estimate(a, r.model.published, 0).store_bytes
        assert r.safetensors_bytes == st
        if not r.model.gguf:
            assert not r.gguf and r.repo_id == r.model.repo_id
            continue
        g = sizing.estimate_gguf(a, r.model.gguf[1], 0)
        if r.gguf:
            assert r.quant == "gguf" and r.gguf == r.model.gguf[1] and r.take == f"GGUF {r.gguf}"
            assert r.repo_id == r.model.gguf[0] and r.repo_id.endswith("-GGUF")
            assert r.estimate == g.estimate and r.download_bytes == g.download_bytes < st
            assert (r.verdict, r.message) == sizing.ram_verdict(g.estimate, a.num_experts_per_tok, total, available)
        else:
            assert r.repo_id == r.model.repo_id and r.download_bytes == st and r.quant in r.model.quants
    take = {r.model.repo_id: r.take for r in recs}
    # a quarter of the bf16 download: the GGUF; gpt-oss's safetensors are already 4-bit, no larger
    assert take["Qwen/Qwen3-30B-A3B"] == take["allenai/OLMoE-1B-7B-0125-Instruct"] == "GGUF Q4_K_M"
    assert take["openai/gpt-oss-20b"] == "int4"


def test_a_gguf_not_taken_is_the_slower_one_here():
    """Where the GGUF is the smaller download but its store runs markedly slower on this machine
    (here a slow disk and RAM for the int4 store only), the safetensors are taken and the GGUF's
    download and speed are kept for the wizard to say so."""
    recs = {r.model.repo_id: r for r in recommend(24 * GB, int(22 * GB), disk_bytes_per_s=0.2e9)}
    r = recs["Qwen/Qwen3-30B-A3B"]
    g = sizing.estimate_gguf(r.model.args(), "Q4_K_M", 0)
    assert not r.gguf and r.quant == "int4" and r.gguf_bytes == g.download_bytes < r.download_bytes
    assert r.gguf_tokens_per_s[0] < SPEED_FOR_QUALITY * r.tokens_per_s[0]
    taken = recs["allenai/OLMoE-1B-7B-0125-Instruct"]
    assert taken.gguf and taken.gguf_bytes == 0 and taken.gguf_tokens_per_s == (0.0, 0.0)
