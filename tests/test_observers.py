"""Observers (engine/observers.py): what the model, cache and PILOT publish, what a failing
observer does, and that nothing is patched in from outside any more."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineConfig, EngineError, Finished, GenerateRequest, SamplingParams
from engine.observers import Observer, ObserverList
from engine.bench.synthetic import qwen3_moe_config, write_store_from_seed
from engine.trace import TraceRecorder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dense_gap_store(tmp_path_factory):
    """Qwen3-MoE, 4 transformer layers of which layer 1 is dense: 3 MoE layers."""
    cfg = qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[1])
    return write_store_from_seed(tmp_path_factory.mktemp("obs") / "q3", cfg, quant="int8", seed=7)


def _cfg(store, **over):
    # the pre-read off: its background loads would race the counts these tests compare
    return EngineConfig(store=str(store), history=False, pinning=False, **{"idle_fill": False, **over})


class Counter(Observer):
    def __init__(self):
        self.calls: dict[str, int] = {}
        self.routes: list[tuple[int, tuple]] = []

    def _n(self, hook):
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def on_forward_start(self, pos0, num_tokens):
        self._n("forward")

    def on_layer_start(self, layer):
        self._n("layer")

    def on_after_attention(self, layer, x):
        self._n("attn")

    def on_route(self, layer, idx, router_logits):
        assert idx.dtype == np.int64 and router_logits.dtype == np.float32
        assert idx.shape[0] == router_logits.shape[0]
        self.routes.append((layer, idx.shape))
        self._n("route")

    def on_after_moe(self, layer, x):
        self._n("moe")

    def on_load(self, layer, expert, nbytes, seconds, speculative):
        assert nbytes > 0 and seconds >= 0
        self._n("load")

    def on_evict(self, layer, expert):
        self._n("evict")


def test_model_observer_sees_every_routing_call(dense_gap_store):
    with Engine.open(_cfg(dense_gap_store, cap=2)) as eng:
        M = eng.args.num_moe_layers
        assert M == 3 and eng.args.num_hidden_layers == 4
        c = Counter()
        eng.subscribe(c)
        eng.model.forward(np.arange(5, 12), 0)  # one prefill forward of 7 tokens
        for k in range(4):  # four decode forwards
            eng.model.forward(np.asarray([20 + k]), 7 + k)
        forwards = 5
        assert c.calls["forward"] == forwards
        for hook in ("layer", "attn", "route", "moe"):
            assert c.calls[hook] == M * forwards, hook  # dense layers publish nothing
        assert [layer for layer, _ in c.routes[:M]] == list(range(M))  # MoE-layer indices
        assert c.routes[0][1] == (7, eng.args.num_experts_per_tok)
        # cap 2 < top-k distinct experts: the cache loaded and evicted, and said so
        assert c.calls["load"] == eng.cache.stats.loads and c.calls["evict"] == eng.cache.stats.evictions > 0
        eng.unsubscribe(c)
        eng.model.forward(np.asarray([3]), 11)
        assert c.calls["forward"] == forwards


def _ids(eng, observer=None):
    if observer is not None:
        eng.subscribe(observer)
    req = GenerateRequest(prompt_ids=(5, 9, 11, 40), sampling=SamplingParams(max_new_tokens=12))
    fin = [e for e in eng.generate(req) if isinstance(e, Finished)][0]
    assert fin.finish_reason == "length", fin.error
    return fin.token_ids


class Boom(Observer):
    """Raises on its third routing call."""

    def __init__(self):
        self.seen = 0

    def on_route(self, layer, idx, router_logits):
        self.seen += 1
        if self.seen == 3:
            raise RuntimeError("observer bug")


def test_failing_observer_is_unsubscribed_and_generation_is_unchanged(dense_gap_store):
    with Engine.open(_cfg(dense_gap_store, cap=3)) as eng:
        want = _ids(eng)
    with Engine.open(_cfg(dense_gap_store, cap=3)) as eng:
        boom = Boom()
        got = _ids(eng, boom)
        assert got == want  # same ids, run finished normally
        assert boom.seen == 3  # unsubscribed at its failure: never called again
        [f] = eng.observer_failures()
        assert f.observer is boom and f.hook == "on_route" and "observer bug" in str(f.error)
        assert boom not in eng.model.observers


def test_observer_after_a_failing_one_still_sees_everything(dense_gap_store):
    with Engine.open(_cfg(dense_gap_store)) as eng:
        boom, after = Boom(), Counter()
        eng.subscribe(boom)
        eng.subscribe(after)
        for k in range(3):
            eng.model.forward(np.asarray([7 + k]), k)
        assert after.calls["route"] == 3 * eng.args.num_moe_layers


class FailingRecorder(TraceRecorder):
    def on_pins(self, pinned):
        raise ValueError("disk full")


def test_trace_recorder_that_failed_refuses_to_save(dense_gap_store, tmp_path):
    with Engine.open(_cfg(dense_gap_store)) as eng:
        rec = FailingRecorder(eng)
        eng.model.forward(np.asarray([7]), 0)
        eng.cache.set_pinned(np.zeros((eng.cache.L, eng.cache.E), bool))
        with pytest.raises(EngineError, match="trace not written.*on_pins.*disk full"):
            rec.save(tmp_path / "t.jsonl")
        assert not (tmp_path / "t.jsonl").exists()
        assert len(rec.records) == eng.args.num_moe_layers  # routing was recorded until then


def test_subscribe_rejects_objects_without_hooks_and_ignores_duplicates():
    ol = ObserverList()

    class Typo:
        def on_routes(self, *a):
            pass
    with pytest.raises(TypeError, match="none of the observer hooks"):
        ol.subscribe(Typo())
    c = Counter()
    ol.subscribe(c)
    ol.subscribe(c)
    assert len(ol) == 1 and ol.has("on_route") and not ol.has("on_pins")
    ol.publish("on_route", 0, np.zeros((1, 2), np.int64), np.zeros((1, 4), np.float32))
    assert c.calls["route"] == 1
    ol.unsubscribe(c)
    ol.unsubscribe(c)
    assert len(ol) == 0 and not ol.has("on_route")


# --- nothing is patched in from outside ------------------------------------------------------


def _py_files(*roots):
    for r in roots:
        yield from sorted((ROOT / r).rglob("*.py"))


def _own_names(tree) -> set[str]:
    return {"self", "cls"} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


# namedtuple's public methods start with an underscore so as not to clash with field names
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults",
                  "_exit"}  # os._exit: public, the underscore says "without clean-up"


def _scan(path: Path, src: str | None = None) -> tuple[list[str], list[str]]:
    """(assignments to / setattr of ``on_*`` attributes of another object, private attributes
    of another object used) in one module. "Another object": anything but self, cls, super()
    (the same object) or a class of the same module."""
    tree = ast.parse(src if src is not None else path.read_text(encoding="utf-8"))
    own = _own_names(tree)
    hooks, private = [], []

    def foreign(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
            return False
        return not (isinstance(node, ast.Name) and node.id in own)

    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else (
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and a.attr.startswith("on_") and foreign(a.value):
                    hooks.append(f"{path.name}:{n.lineno}: {ast.unparse(t)} = ...")
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
                and str(n.args[1].value).startswith("on_")):
            hooks.append(f"{path.name}:{n.lineno}: {ast.unparse(n)}")
        if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and n.attr not in NAMEDTUPLE_API and foreign(n.value)):
            private.append(f"{path.name}:{n.lineno}: {ast.unparse(n)}")
    return hooks, private


def test_checker_finds_planted_patches(tmp_path):
    planted = ("class A:\n    def f(self, eng):\n        self.on_x = 1\n        A._n = 2\n"
               "        eng.model.on_route = self.f\n        setattr(eng.cache, 'on_pins', 3)\n"
               "        super()._build()\n        return eng.pilot._predict\n")
    hooks, private = _scan(tmp_path / "planted.py", planted)
    assert len(hooks) == 2 and "eng.model.on_route" in hooks[0] and "on_pins" in hooks[1]
    assert private == ["planted.py:8: eng.pilot._predict"]


def test_no_hook_is_assigned_from_outside():
    """Observers subscribe (model / cache / Pilot / Engine .subscribe); nobody replaces an
    ``on_*`` attribute of another object (engine, app, tools and tests alike)."""
    found = [h for p in _py_files("engine", "colibri_app", "tools", "tests") for h in _scan(p)[0]]
    assert found == []


def test_engine_reaches_into_no_private_names_of_other_objects():
    found = [h for p in _py_files("engine") for h in _scan(p)[1]]
    assert found == []


def test_grouped_routing_goes_to_on_route_layers_or_to_on_route_per_layer():
    """ObserverList.publish_route_layers: one ``on_route_layers`` call to an observer that
    defines it, n ``on_route`` calls (layer order, one row each) to one that does not; a
    failing group hook unsubscribes its observer like any hook and the others still get it."""
    got: list = []

    class PerLayer(Observer):
        token_batched = True

        def on_route(self, layer, idx, router_logits):
            got.append(("one", layer, idx.tolist(), router_logits.shape))

    class Grouped(PerLayer):
        def on_route_layers(self, l0, idx, router_logits):
            got.append(("group", l0, idx.tolist(), router_logits.shape))

    class Broken(PerLayer):
        def on_route_layers(self, l0, idx, router_logits):
            raise RuntimeError("boom")

    obs = ObserverList()
    broken = Broken()
    for o in (PerLayer(), broken, Grouped()):
        obs.subscribe(o)
    idx = np.array([[1, 2], [3, 4], [5, 6]], np.int64)
    logits = np.zeros((3, 8), np.float32)
    obs.publish_route_layers(4, idx, logits)
    assert got == [("one", 4, [[1, 2]], (1, 8)), ("one", 5, [[3, 4]], (1, 8)), ("one", 6, [[5, 6]], (1, 8)),
                   ("group", 4, [[1, 2], [3, 4], [5, 6]], (3, 8))]
    assert broken not in obs and [f.hook for f in obs.failures] == ["on_route"]


def test_routing_feed_groups_leave_heat_and_ema_as_per_layer_calls(dense_gap_store):
    """RoutingFeed.on_route_layers (the one-call decode step's grouped routing) leaves the
    routing heat and the "ema" policy's probability EMA bit for bit as one ``on_route`` call
    per layer."""
    from engine.generate import RoutingFeed
    ends = []
    for grouped in (False, True):
        with Engine.open(_cfg(dense_gap_store, policy="ema")) as eng:
            M, E, K = eng.cache.L, eng.args.num_experts, eng.args.num_experts_per_tok
            feed = RoutingFeed(eng.heat, eng.cache)
            r = np.random.default_rng(3)
            for _ in range(5):
                logits = r.standard_normal((M, E)).astype(np.float32)
                idx = np.argsort(-logits, axis=1, kind="stable")[:, :K]
                if grouped:
                    feed.on_route_layers(0, idx, logits)
                else:
                    for j in range(M):
                        feed.on_route(j, idx[j:j + 1], logits[j:j + 1])
            ends.append((eng.heat.counts.copy(), eng.heat.session.copy(), eng.cache.prob_ema.copy()))
    for a, b in zip(*ends):
        assert np.array_equal(a, b)
    assert ends[0][2].any()
