"""`colibri bench spec`: both arms on a store, prompts alternated, ids checked equal, results written."""

from __future__ import annotations

import json


def test_bench_spec_writes_both_arms_and_the_medians(tiny_store, tmp_path):
    from engine.cli.main import main
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([
        {"about": f"p{i}", "messages": [{"role": "user", "content": "Repeat: a b c d a b c d a b c d " * (i + 1)}]}
        for i in range(3)]))
    rc = main(["bench", "spec", "--store", str(tiny_store), "--prompts", str(prompts), "--max-new-tokens", "12",
               "--threads", "1", "--ram-budget-gb", "1", "--name", "s", "--out-dir", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "s.json").read_text())
    assert [r["prompt"] for r in res["rows"]] == ["p0", "p1", "p2"]
    assert all(r["tokens_per_forward"] >= 1.0 for r in res["rows"] if r["tokens"] > 1)
    s = res["summary"]
    assert s["prompts"] == 3 and s["median_tok_s_off"] > 0 and len(s["load_average_start"]) == 3
    assert "Greedy ids identical in both arms" in (tmp_path / "s.md").read_text()
