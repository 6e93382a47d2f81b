"""What Engine.open sets up around the model, and keeps up while it generates: the open after
the store (sizing plan, expert cache, model, cluster, PILOT, observers), the kernels warmed
before "ready", the compute threads (threads = 0 follows the free cores), the pinned experts,
and the KV cache's room within the RAM budget. ``EngineSetup`` is a part of
engine.generate.Engine, which is the public class.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from .docs_lookup import INDEX_FILE, DocsIndex
from .errors import ExpertReadError
from .events import Loaded, LoadProgress
from .expert_cache import ExpertCache
from .expert_store import EMBED_TENSORS
from .heat import RoutingHeat, cap_pins, pins_per_layer
from .kernel_prepare import kernel_kind, prepare_in_child
from .models import build_model
from .mtp import open_head
from .models.base import K, mean_router_probs, softmax_rows
from .observers import Observer
from .settings import check_context_length
from .ram_budget import GROWTH_HEADROOM_BYTES, RssGuard, release_compiler_memory
from .sizing import estimate_store, kv_bytes, plan_estimate
from .sysinfo import BudgetClaim, threads_for
from .tokenizer import Tokenizer

log = logging.getLogger("engine.generate")

WARMUP_TOKENS = 16
#: (model class, dense quant, expert quant) whose kernels this process has already run
_WARMED: set[tuple] = set()
ADAPT_INTERVAL_S = 0.25  # threads = 0 (auto): re-count the free cores this often while generating
# The KV cache's room is made (Engine._kv_room) this many positions at a time: its pages are
# mapped as positions are written, 16 positions to a 4 KB page for a 128-wide f16 head
KV_STEP_TOKENS = 64


class RoutingFeed(Observer):
    """The engine's own routing observer: counts the routing heat (RoutingHeat.observe) and,
    under the "ema" policy, feeds the cache the call's mean router probabilities
    (ExpertCache.observe_probs) before the layer's experts are requested.

    Token-batched (Observer.token_batched): a one-call run of a decode step's layers takes
    only resident experts, so no eviction reads the EMA during it, and its on_route calls come
    before the cache's bookkeeping of its takes (the layer that stops a run is routed and takes
    its experts the per-layer way); heat and EMA end the same."""

    token_batched = True

    def __init__(self, heat: RoutingHeat, cache: ExpertCache):
        self.heat, self.cache = heat, cache

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        self.heat.observe(layer, idx)
        if self.cache.policy == "ema":
            self.cache.observe_probs(layer, mean_router_probs(router_logits))

    def on_route_layers(self, l0: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        """One routing row per layer l0.. (a decode step's run of layers): the same heat and
        EMA as an ``on_route`` call per layer, in one array operation each."""
        self.heat.observe_layers(l0, idx)
        if self.cache.policy == "ema":
            self.cache.observe_probs_layers(l0, softmax_rows(router_logits))


class _GuardPoll(Observer):
    """Polls the engine's RSS guard at every MoE layer start; when the guard unpinned experts
    to lower the cap, the persisted pin set follows. Token-batched: each one-call run of a
    decode step's layers publishes the starts of its layers before it takes any expert, so
    the polls come at a safe point too (after the first, the others find no new load)."""

    token_batched = True

    def __init__(self, engine):
        self.engine = engine

    def on_layer_start(self, layer: int) -> None:
        if self.engine.guard.poll() is not None:
            self.engine.sync_pins()


class EngineSetup:
    """Part of engine.generate.Engine (its attributes are documented there)."""

    def _open_rest(self, report, prepare_kernels: bool, child) -> None:
        """Engine.open after the store is open: the tokenizer and documentation index, the
        kernels compiled first in a child process (``child``: engine.generate.compile_child) when
        ``prepare_kernels``, the dense weights, the sizing plan, the expert cache, the model,
        the kernels warmed, the observers, pins and PILOT; ``self.loaded`` last."""
        config, store = self.config, self.store
        a = self.args = store.args
        # before any weight is read: a context the model was not trained for gives garbage
        check_context_length(config.context_length, a.max_position_embeddings,
                             f"the model {store.manifest.get('model_name', store.path.name)}")
        self.tokenizer = Tokenizer.from_dir(store.path)
        self.docs = None  # the documentation index the store ships (engine.docs_lookup), if any
        self.docs_problem = ""  # why a shipped index could not be used (the model runs without it)
        if (store.path / INDEX_FILE).exists():
            try:
                self.docs = DocsIndex.open(store.path / INDEX_FILE)
            except (OSError, ValueError) as e:
                self.docs_problem = (f"{e}. The model answers without documentation lookup; delete "
                                     f"{store.path / INDEX_FILE} to silence this, or convert the model "
                                     f"again from a folder with a good index")
                log.warning("%s", self.docs_problem)
        # the embedding table stays in the store, read row by row (EmbeddingRows): its RAM goes
        # to the expert cache
        self.kernel_prepare_s = 0.0
        if prepare_kernels:
            self.kernel_prepare_s = prepare_in_child(
                config, kernel_kind(a, store, config),
                lambda done, msg: report(LoadProgress("compile", done, 1, "", msg)), child=child)
        dense = store.load_dense(exclude=EMBED_TENSORS)
        embed_rows = store.embedding_rows()
        dense_bytes = sum(v.nbytes for v in dense.values())
        # the one sizing rule (engine/sizing.py), with the dense bytes as loaded
        self.sizing = replace(estimate_store(a, store.manifest, config.context_length, config.kv_dtype),
                              dense_bytes=dense_bytes)
        ctx = self.context_length = self.sizing.context_length
        report(LoadProgress("open", 1, 3, "", "dense weights loaded"))
        self.plan = plan_estimate(self.sizing, config.ram_budget_gb, config.cap, rss_now=self.read_rss())
        self.heat = RoutingHeat(a.num_moe_layers, a.num_experts, store.manifest.get("created", ""))
        if config.history:
            self.heat.load(store.path)
        self._kv_reached = 0  # positions the KV cache has room made for (_kv_room)
        self.cache = ExpertCache(store, a.num_moe_layers, a.num_experts, self.plan.cap, config.policy,
                                 heat=self.heat.counts, checksum=config.checksum,
                                 io_threads=config.io_threads, reserve=config.reserve_cache, fill=config.idle_fill,
                                 grow_ok=self._grow_ok, slots=self.plan.slots)
        experts = self.cache
        if config.cluster:
            from .cluster import ClusterExperts
            report(LoadProgress("cluster", 0, 1, "", f"placing experts on the cluster at {config.cluster}"))
            experts = self.cluster = ClusterExperts(
                store, self.cache, self.heat.counts, config.cluster,
                local_keep=pins_per_layer(self.plan.cap, config.pin_per_layer) if config.pinning else 0,
                timeout_s=config.cluster_timeout_ms / 1000.0, options=self._cluster_options)
            report(LoadProgress("cluster", 1, 1, "", self.cluster.status().summary()))
        self.model = build_model(a, dense, store.dense_quant, store.quant, experts, ctx, store.group_size,
                                 kv_dtype=config.kv_dtype, embed_rows=embed_rows)
        self.mtp = open_head(self.model, a.mtp_layers, dense, experts, embed_rows)  # its MTP head, or None
        self.kernel_warmup_s = self._warm_kernels(report)
        # the compiler's pages and heap are not the cache's to lose (the one-call decode step's
        # warm thread releases them again once it has loaded its kernel)
        released = release_compiler_memory()
        log.debug("released %.1f MB the kernel compiler held", released / 1e6)
        start = getattr(self.model, "start_decode_warm", None)
        if start is not None:  # the one-call decode step: compiled beside the first answer, not before it
            start()
        if config.ram_budget_gb is None and self.kernel_warmup_s > 0:
            # An automatic budget is the RSS plus what the model needs: measured again after the
            # first compile, whose code and compiler memory (100-300 MB) are the process's own and
            # not the cache's; planned before it, the guard saw that growth as the cache's and
            # cut a tiny model's cap to 1 in its first answer.
            # the arena pages already in (populated ahead, or the whole cache with reserve_cache)
            # are the cache's own, planned again below, not memory beside it
            plan = plan_estimate(self.sizing, None, config.cap,
                                 rss_now=max(0, self.read_rss() - self.cache.resident_bytes()))
            cap = min(plan.cap, self.cache.max_cap)  # the arena is sized
            self.plan = replace(plan, cap=cap, slots=min(plan.slots, cap * a.num_moe_layers))
            if self.plan.slots != self.cache.slots:
                self.cache.set_slots(self.plan.slots)
        self.routing_feed = RoutingFeed(self.heat, self.cache)
        self.model.subscribe(self.routing_feed)  # first: heat and EMA scores before anyone else
        self.guard = RssGuard(self.cache, self.plan.budget, read_rss=self.read_rss,
                              pins_for_cap=lambda c: pins_per_layer(c, config.pin_per_layer))
        self._kv_ids: list[int] = []
        self.pilot = None
        if config.pilot > 0:
            from .prefetch import Pilot
            self.pilot = Pilot(self.model, self.cache, config)
        self._chain_layer_hook()
        pre_n, pre_s = 0, 0.0
        if config.pinning and self.heat.pinned.any():
            pre_n, pre_s = self._prewarm(self._cap_pins(self.heat.pinned), report)
        self._pins_applied = bool(self.cache.pinned.any())
        if self.plan.slots >= a.num_moe_layers * a.num_experts:  # the store fits: its table too
            embed_rows.will_need()
        self.cache.start_fill()  # idle_fill: after the warm-up's forget() and the pre-warm
        report(LoadProgress("open", 3, 3, "", "ready"))
        msg = self.plan.describe()
        if self.cluster is not None:
            msg += "; " + self.cluster.status().summary()
        if pre_n:
            msg += f"; pre-warmed {pre_n} experts in {pre_s:.2f} s"
        if self.heat.message:
            msg += f"; {self.heat.message}"
        log.info("%s", msg)
        self.loaded = Loaded(
            model_name=store.manifest.get("model_name", store.path.name), store_path=str(store.path),
            quant=store.quant, num_layers=a.num_moe_layers, num_experts=a.num_experts,
            num_experts_per_tok=a.num_experts_per_tok, context_length=ctx, cap_per_layer=self.cache.cap,
            ram_budget_bytes=self.plan.budget, dense_bytes=dense_bytes, expert_slot_bytes=store.slot_bytes,
            pilot=config.pilot, prewarmed_experts=pre_n, prewarm_seconds=pre_s, message=msg,
            has_chat_template=self.tokenizer.has_chat_template, max_context=int(a.max_position_embeddings),
            threads=self.threads, auto_threads=self.free_cores is not None, pins_per_layer=self._pins_per_layer(),
            cluster="" if self.cluster is None else self.cluster.status().summary(),
            moe_layers=tuple(int(i) for i in a.moe_layers), docs_entries=len(self.docs or ()),
            docs_problem=self.docs_problem, expert_slots=self.cache.slots)
        # other colibri processes size their automatic budget around this one (sysinfo)
        self.budget_claim = BudgetClaim(self.plan.budget)

    def _warm_kernels(self, report) -> float:
        """Run the model's kernels once before "ready", so the first answer does not wait for
        numba to compile or load them (~8 s on a fresh install); once per process and
        kind of model: a 2-token prefill and a 1-token decode step, each twice at the same
        positions (the decode step after the model's ``rewind``). The second of each routes
        exactly as the first, so it finds the experts the first left in the cache (at least
        the last one read per layer, even at cap 1: the child that compiles a first start,
        engine.kernel_prepare) beside misses: the kernels of resident experts
        (K.experts_q4_sorted, experts_q4_t1) run as well as those of misses. Before, the first
        prefill with a resident expert compiled K.experts_q4_sorted inside the engine after the
        child (~0.3 GB above the budget; out of memory in a 4 GB memory cgroup). The KV rows
        written are never reused (no prefix is kept) and ExpertCache.forget() undoes the
        loads, so nothing of it shows in residency, counters or routing heat (no observer is
        subscribed yet). Returns the seconds it took (0.0 when already warm)."""
        m = type(self.model)  # every family's class is named Model: its module tells them apart
        key = (m.__module__, m.__qualname__, self.store.dense_quant, self.store.quant, self.store.group_size,
               getattr(self.store, "expert_layout", "row_major"), getattr(self.model, "kv_dtype", None))
        if key in _WARMED or self.context_length < 3:
            return 0.0
        report(LoadProgress("kernels", 0, 1, "", "preparing the compute kernels"))
        t0 = time.perf_counter()
        ids = [i % self.args.vocab_size for i in (1, 2, 3)]
        try:
            def run(a: int, b: int) -> None:  # positions a..b-1
                self.model.forward(np.asarray(ids[a:b]), a)
            run(0, 2)
            run(0, 2)  # routed as the first: finds experts resident
            run(2, 3)
            s = self.model.rewind(2)  # a recurrent state (Qwen3-Next) is kept at some positions only
            if s < 2:
                run(s, 2)
            run(2, 3)  # the decode step again at its position: finds experts resident
            warmed = True
        except ExpertReadError:
            # a damaged expert slab is the store's problem, not the warm-up's: the model opens,
            # and a generation that routes to that expert ends with this error (named there)
            warmed = False
        self.cache.forget()
        if self.cluster is not None:
            self.cluster.forget()
        if not warmed:
            return time.perf_counter() - t0
        _WARMED.add(key)
        dt = time.perf_counter() - t0
        report(LoadProgress("kernels", 1, 1, "", f"compute kernels ready in {dt:.1f} s"))
        return dt

    def _apply_threads(self) -> None:
        """numba's thread count is per calling thread: set it in the thread that computes."""
        K.set_threads(self.threads)

    def _adapt_threads(self, force: bool = False) -> None:
        """threads = 0 (auto): at most every ADAPT_INTERVAL_S, set the compute threads to the
        cores other programs leave free (sysinfo.threads_for); a no-op for a fixed count."""
        if self.free_cores is None:
            return
        now = time.monotonic()
        if not force and now - self._adapted_at < ADAPT_INTERVAL_S:
            return
        others = self.free_cores.others()
        if others is None:
            return
        self._adapted_at = now
        n = threads_for(self.usable_threads, others)
        if n != self.threads:
            self.threads = n
            K.set_threads(n)

    def _chain_layer_hook(self) -> None:
        """Let the RSS guard look at every MoE layer start (a safe point: no expert is
        acquired), through the model's observer protocol (after PILOT, which subscribed first)."""
        self.model.subscribe(_GuardPoll(self))

    def sync_pins(self) -> None:
        """The guard unpinned experts to lower the cap: the persisted pin set follows."""
        self.heat.pinned = self.cache.pinned.copy()

    # --- pinning ------------------------------------------------------------------------------

    def _pins_per_layer(self) -> int:
        return pins_per_layer(self.cache.cap, self.config.pin_per_layer)

    def _cap_pins(self, pinned: np.ndarray) -> np.ndarray:
        return cap_pins(pinned, self.heat.counts, self._pins_per_layer())

    def _prewarm(self, pinned: np.ndarray, report) -> tuple[int, float]:
        """Load the pinned experts before the first token (the seeds' PILOT=3 pre-warm)."""
        t0 = time.perf_counter()
        self.cache.set_pinned(pinned)
        total = int(pinned.sum())
        for layer in range(pinned.shape[0]):
            self.cache.load_experts(layer, np.nonzero(pinned[layer])[0])
            report(LoadProgress("prewarm", int(pinned[:layer + 1].sum()), total, "experts"))
        return total, time.perf_counter() - t0

    def _maybe_pin(self) -> None:
        if not self.config.pinning or self._pins_applied or self.heat.tokens < WARMUP_TOKENS:
            return
        n = self._pins_per_layer()
        if n <= 0:
            return
        pins = self.heat.choose_pins(n)
        self.cache.set_pinned(pins)
        self.heat.pinned = pins.copy()
        self._pins_applied = True

    def _grow_ok(self, nbytes: int) -> bool:
        """Whether the expert cache's background growth (reservation, populate-ahead, pre-read)
        may add ``nbytes`` now: RSS + nbytes + the KV cache the plan set aside that the context
        has not reached yet (its pages are mapped as positions are written: kv_zeros) +
        GROWTH_HEADROOM_BYTES within the RAM budget (the plan read at call time: it is
        re-planned after the warm-up)."""
        kv = max(0, self.plan.kv_set_aside - self._kv_bytes(self._kv_reached))
        return self.read_rss() + nbytes + kv + GROWTH_HEADROOM_BYTES <= self.plan.budget

    def _kv_bytes(self, n: int) -> int:
        """KV cache bytes of the first ``n`` positions (engine.sizing.kv_bytes)."""
        return kv_bytes(self.args, n, self.config.kv_dtype)

    def _scratch_room(self, n: int) -> int:
        """Before a forward of ``n`` tokens: when the RSS, that forward's activations
        (MoEModel.forward_scratch_bytes) and the slots it may fill would pass the RAM budget,
        the expert cache gives back the slots they need (RssGuard.hold_room), before they are
        allocated. Returns the slots given back, for :meth:`_scratch_back` once the forward is
        done (its buffers freed)."""
        lent = self.guard.hold_room(self.model.forward_scratch_bytes(n))
        if lent:
            self.sync_pins()
        return lent

    def _scratch_back(self, slots: int) -> None:
        """After the forward :meth:`_scratch_room` made room for: the slots it gave back return
        (empty; the cache fills them as it reads), within the plan."""
        if slots > 0:
            self.cache.set_slots(min(self.plan.slots, self.cache.slots + slots))

    def _kv_room(self, n: int) -> None:
        """Before a forward that writes KV rows up to position ``n`` - 1: when that passes the
        positions room was made for (in steps of KV_STEP_TOKENS), the expert cache gives back
        the slots the KV cache's new pages need if the budget cannot hold them beside it
        (RssGuard.make_room), before they are written, so the RSS never runs past the budget
        for the KV's sake. The plan set aside the KV of the first sizing.KV_OPEN_TOKENS."""
        n = min(self.context_length, -(-int(n) // KV_STEP_TOKENS) * KV_STEP_TOKENS)
        if n <= self._kv_reached:
            return
        grow = self._kv_bytes(n) - self._kv_bytes(self._kv_reached)
        self._kv_reached = n
        if self.guard.make_room(grow) is not None:
            self.sync_pins()
