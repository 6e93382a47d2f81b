"""Streaming benchmarks on stores with dense MLP layers (expert rows = MoE layers) and stores
written with the fast "codes" expert draw."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.bench.arm import run_arm
from engine.bench.disk import measure_disk
from engine.bench.matrix import matrix_markdown, summary_row
from engine.expert_store import ExpertStore
from engine.quant import dequantize, slab_views
from engine.bench.synthetic import SeededSource, qwen3_moe_config, write_store_from_seed

# 4 layers, layer 1 a dense MLP: 3 MoE layers, whose rows (0, 1, 2) are not layer numbers.
CFG = qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {draw: write_store_from_seed(d / draw, CFG, quant="int4", seed=3, expert_draw=draw)
            for draw in ("exact", "codes")}


def test_codes_draw_keeps_dense_and_layout_changes_only_expert_values(stores, tmp_path):
    exact, codes = stores["exact"], stores["codes"]
    d1, d2 = load_file(str(exact / "dense.safetensors")), load_file(str(codes / "dense.safetensors"))
    assert d1.keys() == d2.keys() and all(np.array_equal(d1[k], d2[k]) for k in d1)
    m1, m2 = (json.loads((s / "manifest.json").read_text()) for s in (exact, codes))
    assert m1["slab_layout"] == m2["slab_layout"] and m1["moe_layers"] == m2["moe_layers"] == [0, 2, 3]
    strip = lambda m: [[(x["offset"], x["length"]) for x in row] for row in m["experts"]]  # noqa: E731
    assert strip(m1) == strip(m2)
    assert [x["xxh3_64"] for x in m1["experts"][0]] != [x["xxh3_64"] for x in m2["experts"][0]]
    assert "expert codes drawn directly" in m2["source"] and "codes" not in m1["source"]
    # deterministic from the seed
    again = write_store_from_seed(tmp_path / "again", CFG, quant="int4", seed=3, expert_draw="codes")
    assert json.loads((again / "manifest.json").read_text())["experts"] == m2["experts"]
    # dequantized experts have the exact draw's spread (std 0.05)
    with ExpertStore(codes, o_direct=False) as st:
        buf = st.new_buffer()
        st.read(2, 5, buf, verify=True)
        v = slab_views(buf, st.layout)
        w = dequantize({"w": v["up_proj.w"], "s": v["up_proj.s"]}, "int4", st.group_size)
        assert w.shape == (CFG["moe_intermediate_size"], CFG["hidden_size"])
        assert 0.04 < w.std() < 0.06


def test_codes_draw_refuses_float_stores(tmp_path):
    with pytest.raises(ValueError, match="needs quant int8, int4, mxfp4"):
        write_store_from_seed(tmp_path / "f16", CFG, quant="f16", expert_draw="codes")
    with pytest.raises(ValueError, match="expert_draw"):
        SeededSource(CFG, expert_draw="fast")


def test_arm_disk_and_summary_use_moe_rows(stores):
    store = str(stores["codes"])
    disk = measure_disk(store, n=4)
    assert disk["qd1_gbps"] > 0 and disk["qd4_gbps"] > 0
    over = dict(pilot=0, pinning=False, history=False, o_direct=False, context_length=64)
    resident = run_arm(store, {**over, "cap": 8, "warm_all": True}, 4, 6, seed=0)
    small = run_arm(store, {**over, "cap": 2}, 4, 6, seed=0)
    for r in (resident, small):
        assert len(r["distinct_per_layer"]) == 3 and r["quant"] == "int4"
        assert r["distinct_experts"] == sum(r["distinct_per_layer"]) and r["max_rss_gb"] > 0
    assert resident["sha256_ids"] == small["sha256_ids"]
    # what depends on the values: every call's top-k ids, identical across caps
    assert resident["sha256_routing"] == small["sha256_routing"] and resident["route_calls"] == small["route_calls"] > 0
    assert small["guard_fired"] == 0 and small["gen_cpu_s"] > 0 and small["gen_wall_s"] > 0
    assert small["code"]["engine"].endswith("engine")
    assert resident["decode_hit_rate"] == 1.0 and small["decode_hit_rate"] < 1.0
    # one forward a decoded token: a forced stream is not drafted (prompt lookup would keep every
    # draft of the known answer), not even with speculation asked for; the ids are the same
    assert resident["decode_steps"] == small["decode_steps"] == small["decode_tokens"] > 0
    spec = run_arm(store, {**over, "cap": 2, "speculation": "prompt_lookup"}, 4, 6, seed=0)
    assert spec["decode_steps"] == spec["decode_tokens"] and spec["sha256_ids"] == small["sha256_ids"]
    rows = []
    for r, b in ((resident, "all"), (small, 0.1)):
        r = {**r, "budget_gb": b, "rep": 0, "load_avg": 1.5, "ceiling_tok_per_s": 2.0, "of_ceiling": 0.5}
        rows.append(r)
    s = summary_row(rows[1])
    assert s["hit_pct"] == pytest.approx(100 * small["decode_hit_rate"])
    assert s["felt_wait_s_per_token"] == pytest.approx(small["decode_felt_wait_s"] / 5)
    assert s["distinct_per_layer_min_median_max"][0] == min(small["distinct_per_layer"])
    run = {"store": store, "quant": "int4", "disk": disk, "compute_s_per_token": 0.1,
           "compute_source": "test", "prompt_len": 4, "tokens": 6, "seed": 0}
    md = matrix_markdown([run], rows + [{"quant": "int4", "budget_gb": 0.01, "pilot": 0, "hit_rate": None,
                                         "error": "budget too small"}], note="a note")
    assert "int4: distinct generated-id hashes across its cells: 1" in md
    assert "Distinct routing digests (every call's top-k ids, in order): 1 " in md
    assert s["sha256_routing"] == small["sha256_routing"] and s["cpu_per_wall"] > 0
    assert "Failed cells: int4 budget 0.01 pilot 0: budget too small" in md and md.endswith("a note")
    assert md.count("\n| int4 |") == 2
