"""`colibri bench kernels` end to end on a tiny store (no llama.cpp here: the llama arms need a
native build; their parsing is checked on a recorded llama-bench JSON line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import convert_checkpoint
from engine.bench import kernels as bench_kernels

ROOT = Path(__file__).resolve().parents[1]


def _bench_kernels(out: Path, *args: str) -> dict:
    """Run `colibri bench kernels ARGS --name k --out-dir out` in a child; its k.json."""
    # --read-ahead-kb -1: a test leaves the machine's disks as they are
    p = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "kernels", *args, "--name", "k",
                        "--out-dir", str(out), "--read-ahead-kb", "-1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "k.json").read_text())


def _cgroup_or_skip() -> None:
    import pytest
    from engine.bench.peers import cgroup_available
    ok, why = cgroup_available()
    if not ok:
        pytest.skip(why)


@pytest.mark.slow  # 2 stores x 2 reps x decode, prefill and CPU-time runs in a subprocess
def test_bench_kernels_writes_results(tiny_checkpoint, tiny_store, tmp_path):
    s4 = convert_checkpoint(tiny_checkpoint, tmp_path / "tiny-int4", quant="int4")
    out = tmp_path / "results"
    # CPU rates are by difference (decode 16 + 48 vs 16 + 16 tokens, prompt 112 vs 16): wide
    # enough apart that the tiny model's difference is not lost in the timer's noise (at 20 vs 16
    # tokens a non-positive difference left the cell blank, as _rates should)
    res = _bench_kernels(out, "--ours", f"int4={s4}", f"int8={tiny_store}", "--prompts", "4", "112", "--tokens", "48",
                         "--reps", "2", "--threads", "1", "--cpu-time")
    assert [r["arm"] for r in res["rows"]] == ["ours-int4", "ours-int8", "ours-int8", "ours-int4"]
    keys = {"tg48", "pp4", "pp112", "tg_per_cpu_s", "pp112_per_cpu_s"}
    for arm in ("ours-int4", "ours-int8"):
        m = res["medians"][arm]
        # beside the rates, each arm records the device it read from: read-ahead (None where the
        # store's device has no queue, e.g. tmpfs) and the blkio limit (0: none was set)
        assert set(m) - {"read_ahead_kb"} == keys | {"read_bps"}
        assert m["read_bps"] == 0
        assert all(m[k] > 0 for k in keys)
    assert set(res["ratios"]["int4/int8"]) == keys
    assert "ours-int4" in (out / "k.md").read_text()


def test_bench_kernels_refuses_missing_inputs(tmp_path, capsys):
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    bench_kernels.add_parser(sub)
    a = sub.choices["kernels"].parse_args(["--ours", f"int4={tmp_path / 'nope'}"])
    assert bench_kernels.main(a) == 2
    assert "no store there" in capsys.readouterr().err


def test_llama_bench_json_is_parsed(monkeypatch):
    recorded = [{"n_prompt": 16, "n_gen": 0, "avg_ts": 97.5}, {"n_prompt": 0, "n_gen": 64, "avg_ts": 52.25}]

    class P:
        returncode = 0
        stdout = json.dumps(recorded)
        stderr = ""
    monkeypatch.setattr(bench_kernels.subprocess, "run", lambda *a, **k: P)
    assert bench_kernels._llama_arm("llama-bench", "m.gguf", [16], 64, 2) == {"pp16": 97.5, "tg64": 52.25}


def test_llama_bench_inner_reps_keep_the_median_sample(monkeypatch):
    recorded = [{"n_prompt": 16, "n_gen": 0, "avg_ts": 90.0, "samples_ts": [80.0, 100.0, 85.0]},
                {"n_prompt": 0, "n_gen": 64, "avg_ts": 45.0, "samples_ts": [40.0, 50.0, 41.0]}]
    seen = {}

    class P:
        returncode = 0
        stdout = json.dumps(recorded)
        stderr = ""

    def run(cmd, **k):
        seen["cmd"] = cmd
        return P
    monkeypatch.setattr(bench_kernels.subprocess, "run", run)
    r = bench_kernels._llama_arm("llama-bench", "m.gguf", [16], 64, 2, inner_reps=3)
    assert seen["cmd"][seen["cmd"].index("-r") + 1] == "3"
    assert r == {"pp16": 85.0, "pp16_runs": [80.0, 100.0, 85.0], "tg64": 41.0, "tg64_runs": [40.0, 50.0, 41.0]}


def test_ours_arm_inner_reps_run_each_test_that_often(tiny_store):
    r = bench_kernels._ours_arm(str(tiny_store), [4], 8, 1, 0, inner_reps=3)
    for key in ("pp4", "tg8"):
        runs = r[f"{key}_runs"]
        assert len(runs) == 3 and all(v > 0 for v in runs)
        assert r[key] == sorted(runs)[1]  # the median, not the fastest
    assert "tg8_runs" not in bench_kernels._ours_arm(str(tiny_store), [4], 8, 1, 0)


def test_bench_kernels_refuses_zero_inner_reps(tiny_store, capsys):
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    bench_kernels.add_parser(sub)
    a = sub.choices["kernels"].parse_args(["--ours", f"int8={tiny_store}", "--inner-reps", "0"])
    assert bench_kernels.main(a) == 2
    assert "--inner-reps 0" in capsys.readouterr().err


def test_bench_kernels_cgroup_arm(tiny_store, tmp_path):
    """--cgroup-gb: the arm streams the store at that budget inside a memory cgroup of the same
    size and reports decode tok/s, hit rate, MB read per token and the cgroup's peak."""
    _cgroup_or_skip()
    out = tmp_path / "results"
    res = _bench_kernels(out, "--ours", f"int8={tiny_store}", "--prompts", "4", "--tokens", "12",
                         "--reps", "1", "--threads", "1", "--cgroup-gb", "2")
    rows = {r["arm"]: r for r in res["rows"]}
    assert set(rows) == {"ours-int8", "ours-int8@2GB"}
    r = rows["ours-int8@2GB"]
    assert "failed" not in r, r["failed"]  # the arm's own words when it could not run
    # the headline is the first generation after open, cold (every expert's first use a read), at
    # the user's default context length; a second one right after is reported apart
    assert r["budget_gb"] == 2.0 and r["tg12"] > 0 and 0 <= r["hit_rate"] <= 1 and r["mb_per_token"] > 0
    assert r["tg12_warm"] > 0 and r["hit_rate"] <= r["hit_rate_warm"] and r["mb_per_token_warm"] >= 0
    from engine.config import ModelArgs
    from engine.sizing import effective_context
    ctx = effective_context(ModelArgs.from_hf_config(tiny_store / "config.json"), 0)  # the setting's default
    assert r["context_length"] == ctx and r["ttft_s"] > 0 and r["open_s"] > 0
    assert 0 < r["cgroup_max_usage_bytes"] <= 2e9 and r["cgroup_oom_kills"] == 0
    assert res["cgroup_gb"] == 2.0 and "MB read / token" in (out / "k.md").read_text()
    # the overlap ceiling of the same run: the decode's own compute and bytes, the disk measured first
    assert r["compute_s_per_token"] > 0 and r["decode_mb_per_token"] >= 0 and res["disk_gbps"] > 0
    io_s = r["decode_mb_per_token"] * 1e6 / (res["disk_gbps"] * 1e9)
    assert abs(r["ceiling_tok_s"] - 1 / max(r["compute_s_per_token"], io_s)) < 1e-6 * r["ceiling_tok_s"]
    assert abs(r["ceiling_share"] - r["tg12"] / r["ceiling_tok_s"]) < 1e-9 and "of ceiling" in (out / "k.md").read_text()


def _fake_group(groups: list):
    """A memory-group class for the llama.cpp cgroup arms: each one made is appended to
    ``groups``; it wraps nothing, reports an 8 GB peak and no OOM kill, and records its removal."""
    class G:
        def __init__(self):
            self.removed = False
            groups.append(self)

        def wrap(self, cmd):
            return cmd

        def stats(self):
            return {"cgroup_max_usage_bytes": 8e9, "cgroup_oom_kills": 0}

        def remove(self):
            self.removed = True
    return G


def test_llama_cgroup_arm_reads_per_token_by_difference(monkeypatch):
    """The llama.cpp cgroup arm: two cold runs (-n tokens, -n 16), each in a fresh group after
    evicting the GGUF's pages; MB read per token from the difference of their block reads."""
    calls, evicted, groups = [], [], []
    reads = iter([0, 9_000_000_000, 9_000_000_000, 11_000_000_000])  # run 64: 9 GB, run 16: 2 GB

    G = _fake_group(groups)

    def fake_llama(bench, gguf, prompts, n, threads, wrap=None, extra=()):
        calls.append((prompts, n, wrap is not None, list(extra)))
        return {f"tg{n}": 4.0 if n == 64 else 3.0}
    monkeypatch.setattr(bench_kernels, "_llama_arm", fake_llama)
    monkeypatch.setattr(bench_kernels, "_children_read_bytes", lambda: next(reads))
    monkeypatch.setattr(bench_kernels, "_evict", lambda paths: evicted.append(list(paths)))
    r = bench_kernels._llama_cgroup_arm("llama-bench", "m.gguf", 64, 2, G)
    # llama.cpp's default flags, as its users run it
    assert calls == [([], 64, True, []), ([], 16, True, [])] and evicted == [["m.gguf"], ["m.gguf"]]
    assert len(groups) == 2 and all(g.removed for g in groups)
    assert r["tg64"] == 4.0 and "tg16" not in r and r["read_gb"] == 9.0
    assert abs(r["mb_per_token"] - 7000 / 48) < 1e-9 and r["cgroup_max_usage_bytes"] == 8e9


def test_bench_kernels_cgroup_only(tiny_store, tmp_path):
    """--cgroup-only: only the cgroup arm runs (a store larger than RAM streams at the budget;
    no all-resident arm), and no unconstrained ratio is reported."""
    _cgroup_or_skip()
    res = _bench_kernels(tmp_path / "results", "--ours", f"int8={tiny_store}", "--prompts", "4", "--tokens", "12",
                         "--reps", "1", "--threads", "1", "--cgroup-gb", "1", "--cgroup-only", "--pair", "int8/q8_0")
    assert [r["arm"] for r in res["rows"]] == ["ours-int8@1GB"]
    assert res["rows"][0]["tg12"] > 0 and res["rows"][0]["cgroup_oom_kills"] == 0
    assert res["ratios"] == {}


def test_cpu_rate_with_no_positive_difference_is_left_blank():
    """A by-difference CPU rate whose difference is 0 or negative (noise) is left out, not
    divided by ~0 (a llama-bench tg arm read 4.8e10 tok/CPU-s that way)."""
    from engine.bench.kernels import _rates
    assert _rates(tg_per_cpu_s=(48, 2.0), pp128_per_cpu_s=(224, 0.0)) == {"tg_per_cpu_s": 24.0}
    assert _rates(tg_per_cpu_s=(48, -0.01)) == {}


def test_paired_ratios_follow_each_repetition():
    """A load that drifts within a run: the per-repetition ratio's median keeps the side by
    side comparison (here 0.9 in every repetition) where the ratio of medians does not."""
    rows = []
    for rep, (ours, llama) in enumerate([(9.0, 10.0), (27.0, 30.0), (45.0, 50.0), (18.0, 20.0)]):
        rows.append({"arm": "ours-a", "rep": rep, "tg64": ours})
        rows.append({"arm": "llama-b", "rep": rep, "tg64": llama if rep != 1 else llama, "pp16": 5.0})
    rows.append({"arm": "llama-b", "rep": 4, "tg64": 1000.0})  # no ours run in repetition 4
    pr = bench_kernels._paired_ratios(rows, "ours-a", "llama-b", ["tg64", "pp16"])
    assert pr == {"tg64": pytest.approx(0.9)}  # pp16: ours never has it


@pytest.mark.parametrize("extra,needle", [
    (["--out-dir", "FILE"], "is a file, not a folder"),
    (["--out-dir", "FILE/sub"], "is a file, not a folder"),
    (["--name", "../escape"], "plain file name"),
])
def test_bench_result_target_refused_before_the_run(tmp_path, capsys, extra, needle):
    """A results folder that is a file (or under one) or a --name with folders in it is refused
    with one line, exit 2, before any arm runs (it used to fail after the whole run)."""
    from engine.cli.main import main
    f = tmp_path / "f.txt"
    f.write_text("x")
    extra = [str(f) + e[4:] if e.startswith("FILE") else e for e in extra]
    rc = main(["bench", "kernels", "--ours", f"int4={tmp_path / 'nope'}", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "no store there" not in err


def _kernels_args(*argv: str):
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    bench_kernels.add_parser(sub)
    return sub.choices["kernels"].parse_args(list(argv))


def test_arms_cover_first_answer_best_flags_and_each_read_bandwidth():
    """The run's arms: each pair side by side with ours' first answer, then the memory-limited
    arms once per read bandwidth, llama.cpp at its default flags and at its best flags."""
    a = _kernels_args("--ours", "int4=/s", "--llama", "q4_0=/g.gguf", "--pair", "int4/q4_0", "--first-answer",
                      "--cgroup-gb", "4", "--read-bps", "0", "2e9")
    a.read_bps = [int(b) for b in a.read_bps]
    names = [bench_kernels._arm_name(x) for x in bench_kernels._plan_arms(a, cg_ok=True)]
    assert names == ["ours-int4", "llama-q4_0", "ours-int4-first",
                     "ours-int4@4GB", "llama-q4_0@4GB", "llama-q4_0-best@4GB",
                     "ours-int4@4GB@2GB/s", "llama-q4_0@4GB@2GB/s", "llama-q4_0-best@4GB@2GB/s"]
    pairs = {p: (o, ll) for p, o, ll in bench_kernels._ratio_pairs(a, bench_kernels._plan_arms(a, cg_ok=True))}
    assert pairs["int4-first/q4_0"] == ("ours-int4-first", "llama-q4_0")
    assert pairs["int4/q4_0@4GB@2GB/s"] == ("ours-int4@4GB@2GB/s", "llama-q4_0@4GB@2GB/s")
    assert pairs["int4/q4_0-best@4GB"] == ("ours-int4@4GB", "llama-q4_0-best@4GB")


def test_throttled_llama_arm_runs_inside_a_blkio_group(monkeypatch, tmp_path):
    """A throttled memory-limited llama.cpp arm: its command joins a blkio group (read limit on
    the device holding the GGUF) inside the memory group; the row records the bandwidth and the
    device's read-ahead; both groups are removed after."""
    made, seen = [], {}

    class Blk:
        def __init__(self, dev, bps, root):
            made.append(self)
            self.dev, self.bps, self.removed = dev, bps, False

        def wrap(self, cmd):
            return ["BLKIO", *cmd]

        def remove(self):
            self.removed = True

    class Mem:
        def __init__(self, limit, root):
            pass

        def wrap(self, cmd):
            return ["MEM", *cmd]

        def stats(self):
            return {}

        def remove(self):
            pass

    def fake_llama(bench, gguf, prompts, n, threads, wrap=None, extra=()):
        seen.setdefault("cmds", []).append(wrap(["llama-bench"]))
        return {f"tg{n}": 5.0}
    from engine.bench import blockdev, peers
    monkeypatch.setattr(blockdev, "BlkioCgroup", Blk)
    monkeypatch.setattr(peers, "MemCgroup", Mem)
    monkeypatch.setattr(bench_kernels, "_llama_arm", fake_llama)
    monkeypatch.setattr(bench_kernels, "_evict", lambda paths: None)
    monkeypatch.setattr(bench_kernels, "_children_read_bytes", lambda: 0)
    monkeypatch.setattr(blockdev, "read_ahead_kb", lambda p: 128)
    a = _kernels_args("--llama", "q4_0=/g.gguf", "--tokens", "32", "--cgroup-gb", "8")
    arm = {"system": "llama", "label": "q4_0", "path": "/g.gguf", "limit": 8.0, "bps": 2_000_000_000,
           "variant": ""}
    r = bench_kernels._run_arm(a, arm, {"/g.gguf": "7:0"})
    assert seen["cmds"] == [["MEM", "BLKIO", "llama-bench"]] * 2
    assert len(made) == 1 and made[0].dev == "7:0" and made[0].bps == 2_000_000_000 and made[0].removed
    assert r["read_bps"] == 2_000_000_000 and r["read_ahead_kb"] == 128 and r["tg32"] == 5.0


def test_an_arm_that_fails_is_a_result(tmp_path):
    """llama.cpp OOM-killed in a memory limit (its default flags repack the weights into
    anonymous memory): the arm's row says it failed and why, instead of vanishing from the
    tables; the ratio is left out."""
    a = _kernels_args("--ours", "int4=/s", "--llama", "q4_0=/g.gguf", "--pair", "int4/q4_0", "--cgroup-gb", "8",
                      "--cgroup-only", "--tokens", "32", "--name", "k", "--out-dir", str(tmp_path))
    a.read_bps = [0]
    arms = bench_kernels._plan_arms(a, cg_ok=True)
    rows = [{"arm": "ours-int4@8GB", "rep": 0, "load_avg_1m": 1.0, "tg32": 8.0},
            {"arm": "llama-q4_0@8GB", "rep": 0, "load_avg_1m": 1.0,
             "failed": "llama-bench ... failed: / memory group: peak 8.00 GB, OOM kills 1"},
            {"arm": "llama-q4_0-best@8GB", "rep": 0, "load_avg_1m": 1.0, "tg32": 2.0}]
    bench_kernels._write(a, arms, rows, quiet=True)
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["medians"]["llama-q4_0@8GB"]["failed"].startswith("1 of 1 runs: ") and "OOM kills 1" in \
        res["medians"]["llama-q4_0@8GB"]["failed"]
    assert "int4/q4_0@8GB" not in res["ratios"] and res["ratios"]["int4/q4_0-best@8GB"]["tg32"] == 4.0
    assert "OOM kills 1" in (tmp_path / "k.md").read_text()


def test_long_prompt_arms_follow_the_memory_limited_arms():
    """--long-prompt N: after the memory-limited decode arms, one long-prompt arm per read
    bandwidth for ours and for llama.cpp (default and best flags), each paired with its peer."""
    a = _kernels_args("--ours", "int4=/s", "--llama", "q4_0=/g.gguf", "--pair", "int4/q4_0", "--cgroup-gb", "8",
                      "--cgroup-only", "--read-bps", "0", "2e9", "--long-prompt", "2048")
    a.read_bps = [int(b) for b in a.read_bps]
    arms = bench_kernels._plan_arms(a, cg_ok=True)
    names = [bench_kernels._arm_name(x) for x in arms]
    assert names[-6:] == ["ours-int4-long@8GB", "llama-q4_0-long@8GB", "llama-q4_0-best-long@8GB",
                          "ours-int4-long@8GB@2GB/s", "llama-q4_0-long@8GB@2GB/s", "llama-q4_0-best-long@8GB@2GB/s"]
    pairs = {p: (o, ll) for p, o, ll in bench_kernels._ratio_pairs(a, arms)}
    assert pairs["int4/q4_0-long@8GB"] == ("ours-int4-long@8GB", "llama-q4_0-long@8GB")
    assert pairs["int4/q4_0-best-long@8GB@2GB/s"] == ("ours-int4-long@8GB@2GB/s", "llama-q4_0-best-long@8GB@2GB/s")


def test_long_prompt_needs_a_memory_limit(tiny_store, capsys):
    """--long-prompt without --cgroup-gb is refused before any arm runs, naming both options."""
    from engine.cli import main
    assert main(["bench", "kernels", "--ours", f"int8={tiny_store}", "--long-prompt", "64"]) == 2
    err = capsys.readouterr().err
    assert "--long-prompt" in err and "--cgroup-gb" in err


def test_llama_long_prompt_arm_is_one_cold_run_in_a_fresh_group(monkeypatch):
    """The llama.cpp long-prompt arm: the GGUF's pages evicted, one llama-bench -p N -n 0 in a
    fresh group with the arm's flags; its pp tok/s and the bytes the process read."""
    calls, evicted, groups = [], [], []
    reads = iter([1_000_000_000, 35_000_000_000])

    G = _fake_group(groups)

    def fake_llama(bench, gguf, prompts, n, threads, wrap=None, extra=()):
        calls.append((prompts, n, wrap is not None, list(extra)))
        return {f"pp{prompts[0]}": 50.0}
    monkeypatch.setattr(bench_kernels, "_llama_arm", fake_llama)
    monkeypatch.setattr(bench_kernels, "_children_read_bytes", lambda: next(reads))
    monkeypatch.setattr(bench_kernels, "_evict", lambda paths: evicted.append(list(paths)))
    r = bench_kernels._llama_cgroup_long("llama-bench", "m.gguf", 2048, 2, G, "-lm mmap --repack 0")
    assert calls == [([2048], 0, True, ["-lm", "mmap", "--repack", "0"])] and evicted == [["m.gguf"]]
    assert len(groups) == 1 and groups[0].removed
    assert r["pp2048"] == 50.0 and r["prefill_read_gb"] == 34.0 and r["cgroup_oom_kills"] == 0


def test_ours_long_prompt_arm_reports_its_prefill_and_reads(tiny_store):
    """Ours' long-prompt arm (a fresh process at a budget): the prompt's tok/s over its TTFT,
    the bytes read from the prompt to its first token and the store's expert bytes."""
    p = subprocess.run([sys.executable, "-m", "engine.bench.kernels", "--store", str(tiny_store), "--threads", "1",
                        "--budget-gb", "1", "--long-prompt", "40"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("ARM "))[4:])
    assert r["pp40"] > 0 and abs(r["pp40"] - 40 / r["ttft_s"]) < 1e-6 * r["pp40"]
    assert r["expert_gb"] > 0 and r["prefill_read_gb"] >= 0 and r["budget_gb"] == 1.0 and 0 <= r["hit_rate"] <= 1
    assert r["dense_gb"] > 0 and r["open_to_token_read_gb"] >= r["prefill_read_gb"]


def _checkout_with_arm(folder: Path, tg: float) -> Path:
    """A checkout whose engine's one arm prints a fixed row: which engine an arm ran is visible."""
    (folder / "engine" / "bench").mkdir(parents=True)
    (folder / "engine" / "__init__.py").write_text("")
    (folder / "engine" / "bench" / "__init__.py").write_text("")
    (folder / "engine" / "bench" / "kernels.py").write_text(
        "import json, sys\n"
        f"print('ARM ' + json.dumps({{'tg8': {tg}, 'argv': sys.argv[1:]}}))\n")
    return folder


def test_ours_arm_runs_the_engine_of_another_checkout(tiny_store, tmp_path):
    """--ours-engine LABEL=CHECKOUT: that arm's fresh process imports `engine` from CHECKOUT
    (not this checkout's, not the working directory's), with the arm's usual arguments; the
    other arms keep this checkout's engine."""
    old = _checkout_with_arm(tmp_path / "old", 7.0)
    a = _kernels_args("--ours", f"after={tiny_store}", f"before={tiny_store}", "--ours-engine", f"before={old}",
                      "--tokens", "8", "--prompts", "4")
    r = bench_kernels._spawn_ours("before", str(tiny_store), a)
    assert r["tg8"] == 7.0 and r["argv"][:2] == ["--store", str(tiny_store)]
    assert ["--tokens", "8"] == r["argv"][r["argv"].index("--tokens"):][:2]


def test_a_pair_of_two_ours_arms_gives_their_ratio(tmp_path):
    """--pair after/before where both are ours arms: the ratio of the two engines' medians and
    the per-repetition ratio, as for a llama.cpp peer; the run records each checkout's commit."""
    a = _kernels_args("--ours", "after=/s", "before=/s", "--ours-engine", "before=/old", "--pair", "after/before",
                      "--tokens", "8", "--prompts", "4", "--name", "k", "--out-dir", str(tmp_path))
    arms = bench_kernels._plan_arms(a, cg_ok=False)
    assert [bench_kernels._arm_name(x) for x in arms] == ["ours-after", "ours-before"]
    assert bench_kernels._ratio_pairs(a, arms) == [("after/before", "ours-after", "ours-before")]
    rows = [{"arm": "ours-after", "rep": 0, "load_avg_1m": 1.0, "tg8": 9.0, "pp4": 30.0},
            {"arm": "ours-before", "rep": 0, "load_avg_1m": 1.0, "tg8": 10.0, "pp4": 30.0}]
    bench_kernels._write(a, arms, rows, quiet=True)
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["ratios"]["after/before"] == {"tg8": pytest.approx(0.9), "pp4": 1.0}
    assert res["paired_ratios"]["after/before"]["tg8"] == pytest.approx(0.9)


def test_ours_engine_must_name_an_ours_arm_and_a_checkout(tiny_store, tmp_path, capsys):
    for spec in (f"nope={tmp_path}", f"before={tmp_path}"):  # no such arm; no engine/ there
        a = _kernels_args("--ours", f"before={tiny_store}", "--ours-engine", spec)
        assert bench_kernels.main(a) == 2
        assert "--ours-engine" in capsys.readouterr().err
