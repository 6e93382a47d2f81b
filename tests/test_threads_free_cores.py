"""Compute threads follow the cores other programs leave free, the kernels
are prepared before "ready", and the automatic budget fits the model."""

from __future__ import annotations

import numpy as np

from engine import Engine, EngineConfig, Finished, GenerateRequest, SamplingParams
from engine.sysinfo import FreeCores, threads_for


class FakeStat:
    """A /proc/stat that advances by hand: ``tick(cpu_busy={cpu: ticks}, cpu_idle=...)``."""

    def __init__(self, path, ncpu=2):
        self.path, self.n = path, ncpu
        self.busy = [0] * ncpu
        self.nice = [0] * ncpu
        self.idle = [0] * ncpu
        self.running = 1
        self.write()

    def write(self):
        lines = [f"cpu  {sum(self.busy)} {sum(self.nice)} 0 {sum(self.idle)} 0 0 0 0 0 0"]
        for i in range(self.n):
            lines.append(f"cpu{i} {self.busy[i]} {self.nice[i]} 0 {self.idle[i]} 0 0 0 0 0 0")
        lines.append(f"procs_running {self.running}")
        self.path.write_text("\n".join(lines) + "\n")

    def advance(self, busy, nice=(0, 0), ticks=100):
        for i in range(self.n):
            self.busy[i] += busy[i]
            self.nice[i] += nice[i]
            self.idle[i] += ticks - busy[i] - nice[i]
        self.write()


def _free(tmp_path, own, clock, **kw):
    st = FakeStat(tmp_path / "stat")
    fc = FreeCores(stat_path=st.path, cpus={0, 1}, own_cpu_s=lambda: own[0], clock=lambda: clock[0], **kw)
    return st, fc


def test_threads_for_rounds_half_down():
    assert threads_for(2, 0.0) == 2 and threads_for(2, 0.4) == 2
    assert threads_for(2, 0.5) == 1 and threads_for(2, 1.0) == 1 and threads_for(2, 2.0) == 1
    assert threads_for(8, 3.2) == 5 and threads_for(1, 0.0) == 1


def test_free_cores_sees_a_busy_program_but_not_itself(tmp_path):
    own, clock = [0.0], [100.0]
    st, fc = _free(tmp_path, own, clock)
    st.running = 1
    st.write()
    assert fc.others() == 0.0          # first call: the run queue (only the caller runs)
    # 1 s: this process used both cores fully -> nobody else
    clock[0] += 1.0
    own[0] += 2.0
    st.advance((100, 100))
    assert fc.others() == 0.0
    # 1 s: another program holds one core, we ran on the other
    clock[0] += 1.0
    own[0] += 1.0
    st.advance((100, 100))
    assert abs(fc.others() - 1.0) < 1e-9
    assert threads_for(2, 1.0) == 1
    # too short an interval: no new estimate (the engine keeps its count)
    clock[0] += 0.01
    assert fc.others() is None


def test_niced_background_work_does_not_take_cores_from_us(tmp_path):
    own, clock = [0.0], [0.0]
    st, fc = _free(tmp_path, own, clock, count_nice=False)
    fc.others()
    clock[0] += 1.0
    st.advance((0, 0), nice=(100, 0))   # a build at nice 10 on one core
    assert fc.others() == 0.0
    st2, fc2 = _free(tmp_path, own, clock, count_nice=True)   # we are niced ourselves: it counts
    fc2.others()
    clock[0] += 1.0
    st2.advance((0, 0), nice=(100, 0))
    assert abs(fc2.others() - 1.0) < 1e-9


def test_stale_interval_uses_the_run_queue(tmp_path):
    own, clock = [0.0], [0.0]
    st, fc = _free(tmp_path, own, clock)
    fc.others()
    clock[0] += 60.0                  # the engine sat idle for a minute
    st.running = 2                    # us + one busy program right now
    st.advance((100, 0), ticks=6000)
    assert fc.others() == 1.0


def test_engine_auto_threads_follow_the_free_cores(tiny_store, tmp_path, monkeypatch):
    """threads = 0: the count the engine uses drops to 1 when another program holds a core and
    comes back when it is gone; the tokens never change (placement never changes values)."""
    import engine.generate as gen
    monkeypatch.setattr(gen, "usable_cpus", lambda: 2)
    cfg = EngineConfig(store=str(tiny_store), pilot=0, pinning=False, history=False, o_direct=False, threads=0)
    seen = []
    with Engine.open(cfg) as eng:
        assert eng.loaded.auto_threads and eng.usable_threads == 2
        answers = []
        for others in (0.0, 1.0, 0.0):
            eng.free_cores.others = lambda o=others: o
            eng._adapted_at = float("-inf")
            req = GenerateRequest(prompt="hello there", sampling=SamplingParams(max_new_tokens=6))
            evs = list(eng.generate(req))
            fin = [e for e in evs if isinstance(e, Finished)][-1]
            seen.append(fin.threads)
            answers.append(fin.token_ids)
            steps = [e.threads for e in evs if hasattr(e, "total_hit_rate")]
            assert steps and set(steps) == {fin.threads}
    assert seen == [2, 1, 2]
    assert answers[0] == answers[1] == answers[2]


def test_fixed_thread_count_is_never_changed(tiny_store):
    cfg = EngineConfig(store=str(tiny_store), pilot=0, pinning=False, history=False, o_direct=False, threads=1)
    with Engine.open(cfg) as eng:
        assert eng.free_cores is None and not eng.loaded.auto_threads
        fin = [e for e in eng.generate(GenerateRequest(prompt="hi", sampling=SamplingParams(max_new_tokens=3)))
               if isinstance(e, Finished)][-1]
        assert fin.threads == 1


def test_kernels_are_prepared_before_ready_and_leave_no_trace(tiny_store, monkeypatch):
    import engine.engine_setup as engine_setup
    monkeypatch.setattr(engine_setup, "_WARMED", set())
    stages = []
    # the pre-read off: it fills the cache in the background; the warm-up itself leaves nothing
    cfg = EngineConfig(store=str(tiny_store), pilot=0, pinning=False, history=False, o_direct=False, idle_fill=False)
    with Engine.open(cfg, progress=lambda ev: stages.append((ev.stage, ev.done, ev.total, ev.message))) as eng:
        names = [s[0] for s in stages]
        assert "kernels" in names and names.index("kernels") < len(names) - 1
        assert stages[-1][3] == "ready"
        assert eng.cache.stats.loads == 0 and eng.cache.stats.misses == 0
        assert not eng.cache.residency().any() and int(eng.heat.counts.sum()) == 0
        # a second engine of the same kind in this process does not warm up again
        stages.clear()
        with Engine.open(cfg, progress=lambda ev: stages.append(ev.stage)):
            assert "kernels" not in stages


def test_automatic_budget_fits_the_model_and_reads_well(tiny_store):
    cfg = EngineConfig(store=str(tiny_store), pilot=0, pinning=False, history=False, o_direct=False)
    with Engine.open(cfg) as eng:
        est = eng.sizing
        rss_base = eng.plan.budget - est.kv_bytes - est.expert_bytes - est.reserve_bytes
        # not "21 GB" for a model of a few MB: the RSS it was planned on plus the model (the
        # process's RSS varies with what ran before in it: ~2 GB late in the test suite)
        assert rss_base <= eng.read_rss() + 50e6
        assert eng.plan.budget < rss_base + 1e9
        assert rss_base > 0                              # the whole model fits: capped there
        assert eng.cache.cap == eng.args.num_experts     # and every expert still fits
        msg = eng.loaded.message
        assert "0.00 GB" not in msg and ("MB dense" in msg or "kB dense" in msg)
    np.testing.assert_equal(eng.plan.auto_budget, True)
