"""The Engine: opens a store, sizes the expert cache to the RAM budget, and generates.

``Engine.generate(request, cancel_event)`` is a generator of plain events (events.py):
TokenEvent and StepMetrics after every token, ResidencySnapshot at most ~10 per second, and
always a final Finished. The loop has no I/O of its own and no Qt (mlx-lm stream_generate).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

import numpy as np

from .config import EngineConfig
from .docs_lookup import DOCS_PER_QUESTION, INDEX_FILE, CopyPrior, DocEntry, DocsIndex, last_user_text, with_docs_each
from .errors import Cancelled, ContextOverflowError, EngineError, ExpertReadError, StoreError
from .events import Finished, FinishReason, GenerateRequest, Loaded, LoadProgress, ResidencySnapshot, TokenEvent
from .expert_cache import ExpertCache
from .expert_store import EMBED_TENSORS, ExpertStore
from .kernel_prepare import CHILD_TIMEOUT_S, exit_with_parent, kernel_kind, prepare_in_child
from .heat import RoutingHeat, cap_pins, pins_per_layer
from .metrics import MetricsTracker, answer_rates, residency_snapshot
from .models import build_model
from .models.base import K, mean_router_probs, softmax_rows
from .observers import Observer, ObserverFailure
from .ram_budget import GROWTH_HEADROOM_BYTES, RssGuard, current_rss, release_compiler_memory
from .sizing import estimate_store, kv_bytes, plan_estimate
from .sampling import Sampler
from .settings import check_context_length
from .mtp import drafter_for, open_head
from .speculative import DraftLength
from .sysinfo import BudgetClaim, FreeCores, threads_for, usable_cpus
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

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

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def on_layer_start(self, layer: int) -> None:
        if self.engine.guard.poll() is not None:
            self.engine.sync_pins()


class _PassFollower(Observer):
    """A first answer asked while the pre-read (idle fill) still runs, on a cache that holds all
    but at most top-k experts of every layer: before each MoE layer of the prefill, wait until
    the pass has read that layer (ExpertCache.fill_pending(layer) is 0), so the layer computes
    on experts read at the disk's sequential rate instead of reading them on demand beside the
    pass. The pass goes in file order, which is layer order: layer l computes while l + 1 is read.
    Stops waiting when ``cancel`` is set or the layer's count has not moved for ``stall_s``
    seconds (then the layer reads on demand, as without the pass). Token-batched: a one-token
    prompt's decode step publishes every layer's start before it runs, and waits for all."""

    token_batched = True

    def __init__(self, cache: ExpertCache, cancel: threading.Event | None, stall_s: float = 10.0):
        self.cache, self.cancel, self.stall_s = cache, cancel, stall_s
        self.waited_s = 0.0

    def on_layer_start(self, layer: int) -> None:
        t0 = last_t = time.monotonic()
        last = -1
        while not (self.cancel is not None and self.cancel.is_set()):
            n = self.cache.fill_pending(layer)
            now = time.monotonic()
            if n == 0:
                break
            if n != last:
                last, last_t = n, now
            elif now - last_t > self.stall_s:
                break
            time.sleep(0.002)
        self.waited_s += time.monotonic() - t0


class Engine:
    """A loaded model ready to generate. Create with :meth:`open`; close with :meth:`close`.

    Attributes: config (EngineConfig), store (ExpertStore), args (ModelArgs), tokenizer,
    model (the family's Model, engine/models), cache (ExpertCache;
    rows = MoE layers), heat (RoutingHeat), plan (BudgetPlan),
    loaded (Loaded event), pilot (Pilot or None), threads (compute threads in use),
    usable_threads (the most it may use), free_cores (sysinfo.FreeCores with threads = 0, else None),
    cluster (engine.cluster.ClusterExperts when the cluster setting names a Ray head, else None),
    kernel_prepare_s (seconds the first compile of this kind of model took in a child process,
    engine.kernel_prepare; 0.0 when numba's cache already held it), kernel_warmup_s (seconds the
    kernels took to load or compile in this process before "ready").
    """

    def __init__(self):
        raise TypeError("use Engine.open(config)")

    @classmethod
    def open(cls, config: EngineConfig, progress: Callable[[LoadProgress], None] | None = None,
             read_rss: Callable[[], int] = current_rss, cluster_options=None,
             prepare_kernels: bool = True) -> "Engine":
        """Open ``config.store``.

        ``prepare_kernels``: when this machine has not yet compiled the kernels of this kind of
        model, compile them in a child process first (engine.kernel_prepare), so the ~500 MB
        the compiler leaves behind is not this process's; False compiles in this process.

        ``config.cluster`` (a Ray address) serves the experts placed on the cluster's workers
        there (engine/cluster.py); ``cluster_options`` (engine.cluster.ClusterOptions: a fixed
        placement, an injected per-call delay) is for tests and benchmarks.

        Raises:
            ConfigError: a setting is out of range.
            StoreError / TokenizerError: the store or its tokenizer is missing or corrupt.
            BudgetError: the budget cannot hold one expert slot per layer (numbers given).
        """
        self = object.__new__(cls)
        self.config = config = config.validated()
        self.read_rss = read_rss
        self._closed = False
        self._lock = threading.Lock()
        self.cluster = None
        self._cluster_options = cluster_options
        # threads = 0 (auto): the cores the CPU affinity and cgroup quota allow, minus those other
        # programs keep busy, re-counted while generating (sysinfo.FreeCores; bench contention)
        self.usable_threads = config.threads or usable_cpus()
        self.threads = self.usable_threads
        self.free_cores = FreeCores() if config.threads == 0 else None
        self._adapted_at = float("-inf")
        self._apply_threads()
        report = progress or (lambda ev: None)
        report(LoadProgress("open", 0, 3, "", f"opening {config.store}"))
        self.store = ExpertStore(config.store, o_direct=config.o_direct)
        try:
            self._open_rest(report, prepare_kernels)
        except BaseException:
            if self.cluster is not None:
                self.cluster.close()
            if getattr(self, "cache", None) is not None:
                self.cache.close()
            self.store.close()
            raise
        return self

    def _open_rest(self, report, prepare_kernels: bool) -> None:
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
                lambda done, msg: report(LoadProgress("compile", done, 1, "", msg)), child=compile_child)
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

    # --- observers ----------------------------------------------------------------------------

    def subscribe(self, observer) -> None:
        """Subscribe ``observer`` (engine/observers.py) to everything this engine publishes:
        the model (forward, layers, routing), the cache (loads, evictions, pins) and, when
        PILOT is on, its predictions. It is called after the engine's own observers (routing
        heat, EMA scores, PILOT), so it sees their state after each event."""
        self.model.subscribe(observer)
        self.cache.subscribe(observer)
        if self.pilot is not None:
            self.pilot.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        """Undo :meth:`subscribe` (no-op where it is not subscribed)."""
        self.model.unsubscribe(observer)
        self.cache.unsubscribe(observer)
        if self.pilot is not None:
            self.pilot.unsubscribe(observer)

    def observer_failures(self) -> list[ObserverFailure]:
        """Observer hooks that raised (and were unsubscribed) on the model, cache or PILOT."""
        lists = [self.model.observers, self.cache.observers]
        if self.pilot is not None:
            lists.append(self.pilot.observers)
        return [f for ol in lists for f in ol.failures]

    def forget_prefix(self) -> None:
        """Make the next generation prefill its whole prompt (no reuse of the KV rows of the
        previous one). Benchmarks use it to time the full prefill."""
        self._kv_ids = []

    # --- generation ---------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """False when the store has no chat template: only raw prompts (GenerateRequest.prompt)
        can run; messages raise TokenizerError."""
        return self.tokenizer.has_chat_template

    def lookup(self, request: GenerateRequest) -> list[DocEntry]:
        """The documentation entries given with ``request`` (engine.docs_lookup): the best
        DOCS_PER_QUESTION matches of its last user message when the store ships a documentation
        index, the request is a chat and ``request.sampling.docs_lookup`` is on; else []."""
        if request.prompt_ids is not None:  # the caller did the lookup (the server) or none
            return list(request.docs_entries) if request.sampling.docs_lookup else []
        if self.docs is None or not request.sampling.docs_lookup:
            return []
        text = last_user_text(request.messages)
        return self.docs.search(text, DOCS_PER_QUESTION) if text else []

    def _encode_chat(self, messages, docs: bool) -> list[int]:
        if docs:  # each question with the block it is answered with (KV rows reused turn after turn)
            messages = with_docs_each(messages, lambda text: self.docs.search(text, DOCS_PER_QUESTION))
        return self.tokenizer.encode_chat(messages)

    def _docs_on(self, request: GenerateRequest) -> bool:
        return self.docs is not None and request.sampling.docs_lookup and request.prompt_ids is None

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template with the documentation lookup's
        block before each user message, raw text or ids)."""
        return self._prompt_ids(request, self._docs_on(request))

    def _check_ids(self, what: str, ids) -> list[int]:
        """``ids`` as ints, each checked against the vocabulary (the kernels index the embedding
        without bounds checks). Raises ValueError naming ``what`` and the first bad id."""
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        return ids

    def _prompt_ids(self, request: GenerateRequest, docs: bool) -> list[int]:
        if request.prompt_ids is not None:
            return self._check_ids("prompt_ids", request.prompt_ids)
        if request.messages:
            return self._encode_chat(request.messages, docs)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt)
        raise ValueError("empty request: give messages, prompt or prompt_ids")

    def generate(self, request: GenerateRequest,
                 cancel: threading.Event | None = None) -> Iterator[object]:
        """Generate for ``request``; see the module docstring for the events.

        Raises (before any compute):
            ContextOverflowError: the prompt does not fit in the context window.
            ValueError / TokenizerError: invalid request or template.
        """
        if self._closed:
            raise EngineError("engine is closed")
        cancel = cancel or threading.Event()
        sampler = Sampler(request.sampling)
        C = self.context_length
        entries = self.lookup(request)
        docs = self._docs_on(request) and not self._surely_too_long(request)
        ids, dropped = self._fit_prompt(request, docs)
        if self._docs_on(request) and (not docs or len(ids) >= C):  # it fits only without the entries
            if docs:
                ids, dropped = self._fit_prompt(request, False)
            entries = []
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        if request.forced_ids is not None:
            self._check_ids("forced_ids", request.forced_ids)
        if len(ids) >= C:
            raise ContextOverflowError(self._overflow_message(len(ids), bool(request.messages), dropped))
        return self._run(ids, request, sampler, cancel, dropped, tuple(entries))

    def answer_room(self, max_new_tokens: int) -> int:
        """Tokens a chat prompt must leave free for the answer: min(max_new_tokens, context / 4)
        (a long setting must not make every later message refuse to fit)."""
        return max(1, min(int(max_new_tokens), self.context_length // 4))

    def fit_prompt(self, request: GenerateRequest) -> tuple[list[int], int]:
        """(prompt token ids, oldest messages left out) for ``request``.

        A chat whose prompt leaves less than :meth:`answer_room` tokens of the context drops
        its oldest turns, a user message and the answers that follow it at a time, never the
        system prompt(s) at its start nor the last user message. Among the shortened prompts
        that fit, the one sharing the longest prefix with the KV rows kept from the previous
        generation wins (so the next turns of a trimmed chat still reuse the prefill); with no
        such prefix, enough turns are dropped to leave a quarter of the context free for the
        turns to come. Raw prompts and token ids are never shortened (0 dropped). The result
        may still not fit: :meth:`generate` refuses it then. With the documentation lookup each
        user message keeps its block right before it, so a dropped turn takes its block along.
        """
        return self._fit_prompt(request, self._docs_on(request))

    def _surely_too_long(self, request: GenerateRequest) -> bool:
        """True when the last user message's text alone needs more tokens than the context
        holds, by a lower bound (characters / the longest vocabulary entry): a long paste is
        then encoded once, alone, before it is refused. Never changes a result: a bound that
        misjudges (a normalizer that removes characters) costs one more encoding."""
        if request.prompt_ids is not None or not request.messages:
            return False
        text = last_user_text(request.messages) or ""
        return len(text) > self.context_length * self.tokenizer.max_token_chars

    def _fit_prompt(self, request: GenerateRequest, docs: bool) -> tuple[list[int], int]:
        msgs = request.messages
        head = 0
        while msgs and head < len(msgs) and msgs[head].role == "system":
            head += 1
        starts = [i for i in range(head + 1, len(msgs or ())) if msgs[i].role == "user"]
        C = self.context_length
        room = self.answer_room(request.sampling.max_new_tokens)
        last = None
        if starts and self._surely_too_long(request):
            # the last question alone first: the whole chat (as long) need not be encoded
            last = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[starts[-1]:]), docs)
            if len(last) + room > C:
                return last, starts[-1] - head
        ids = self._prompt_ids(request, docs)
        if request.prompt_ids is not None or not msgs:
            return ids, 0
        if len(ids) + room <= C:
            return ids, 0
        if not starts:
            return ids, 0
        # the last question alone: when even it does not fit, no shorter prompt does (each
        # encoding of a long paste costs as much as the first)
        if last is None:
            last = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[starts[-1]:]), docs)
        if len(last) + room > C:
            # send it alone (the answer gets what is left) or let generate() refuse it
            return last, starts[-1] - head
        cands = []  # (start, ids) that fit, fewest dropped first
        for st in starts[:-1]:
            c = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[st:]), docs)
            if len(c) + room <= C:
                cands.append((st, c))
        cands.append((starts[-1], last))

        def common(c: list[int]) -> int:
            n = 0
            for x, y in zip(c, self._kv_ids):
                if x != y:
                    break
                n += 1
            return n
        base = common(cands[-1][1])  # what every candidate shares (the system prompt, template head)
        best = max(cands, key=lambda sc: common(sc[1]))
        if common(best[1]) <= base:
            slack = C - room - C // 4
            best = next((sc for sc in cands if len(sc[1]) <= slack), cands[-1])
        return best[1], best[0] - head

    def _overflow_message(self, n: int, chat: bool, dropped: int = 0) -> str:
        C, limit = self.context_length, int(self.args.max_position_embeddings)
        what = "The message" if chat else "The prompt"
        s = (f"{what} has {n} tokens but the context holds {C} tokens (one more is needed to answer)"
             + (f"; the {dropped} earlier messages were already left out" if dropped else "") + ". Shorten it")
        if C < limit:
            s += f", or raise the context length (this model takes up to {limit} tokens)"
        else:
            s += f" (this model takes at most {limit} tokens)"
        return s + "."

    def _run(self, ids, request, sampler, cancel, dropped=0, sources=()) -> Iterator[object]:
        with self._lock:
            self.cache.begin_answer()
            try:
                self._following = self._follow_pass(cancel)
                if self._following is None:
                    self.cache.hold_fill()  # the pre-read waits while the answer reads on demand
                try:
                    yield from self._run_locked(ids, request, sampler, cancel, dropped, sources)
                finally:
                    self._stop_following()
                    self.cache.release_fill()
            finally:
                self.cache.end_answer()

    def _follow_pass(self, cancel) -> _PassFollower | None:
        """When the pre-read still has experts to read and brings all but at most top-k of every
        layer's (the cache holds that many), the prefill follows it layer by layer
        (:class:`_PassFollower`) instead of reading on demand beside it: a store that fits is
        then wholly resident by the first token. A cache with fewer slots keeps the pass
        held while it answers (its demand reads alone on the disk). Returns the subscribed
        follower, or None."""
        a = self.args
        if (min(self.cache.layer_caps()) < a.num_experts - a.num_experts_per_tok
                or self.cache.fill_pending() == 0):
            return None
        f = _PassFollower(self.cache, cancel)
        self.model.subscribe(f)
        return f

    def _stop_following(self) -> None:
        """End :meth:`_follow_pass` (after the prefill; a no-op when not following): the pass is
        held for the rest of the answer, as when it was not followed."""
        f, self._following = getattr(self, "_following", None), None
        if f is not None:
            self.model.unsubscribe(f)
            self.cache.hold_fill()
            if f.waited_s:
                log.info("the prefill waited %.2f s for the pre-read", f.waited_s)

    def _run_locked(self, ids, request, sampler, cancel, dropped=0, sources=()) -> Iterator[object]:
        self._apply_threads()
        self._adapt_threads(force=True)
        C = self.context_length
        sp = request.sampling
        # the answer is capped by the room the context has left
        max_new = min(sp.max_new_tokens, C - len(ids))
        forced = request.forced_ids
        cons = request.constraint
        tracker = MetricsTracker(self.cache, self.plan.budget, self.read_rss, self.pilot,
                                 remote=self.cluster.remote_mask if getattr(self, "cluster", None) else None)
        dec = self.tokenizer.incremental_decoder()
        t0 = time.perf_counter()
        out_ids: list[int] = []
        copier = CopyPrior.for_entries(self.tokenizer, sources, request.sampling.docs_copy)
        text_parts: list[str] = []
        reason = FinishReason.LENGTH
        error = ""
        prefill_s = 0.0
        dec_forwards, t_dec0, t_dec1 = 0, 0.0, 0.0
        dec_rows, drafted, accepted = 0, 0, 0  # rows sampled after decode forwards; draft tokens, kept
        lengths = DraftLength(self.config.draft_max) if self.config.speculation != "off" else None
        # before the prefill: an MTP head takes the prompt's hidden states (engine/mtp.py)
        drafter = drafter_for(self.config.speculation if forced is None else "off", self.model, self.mtp)
        # Prefix reuse: keep the KV rows of the longest common prefix with the last run.
        p = 0
        for a, b in zip(self._kv_ids, ids):
            if a != b:
                break
            p += 1
        p = min(p, len(ids) - 1)
        p = self.model.rewind(p)  # a family with recurrent state may resume earlier (qwen3_next.py)
        self._kv_ids = self._kv_ids[:p]
        try:
            self._kv_room(len(ids))
            logits = self.model.forward(np.asarray(ids[p:]), p, cancel=cancel)
            self._stop_following()
            self._kv_ids = list(ids)
            self.heat.tokens += len(ids) - p
            prefill_s = time.perf_counter() - t0
            t_dec0 = t_dec1 = time.perf_counter()  # decode rate: every forward timed is counted
            context = list(ids)
            pos = len(ids)  # the position the token sampled from rows[0] takes
            if self.guard.step(0) is not None:  # the prefill may have filled the cache
                self.sync_pins()
            # Speculation (engine/speculative.py): each forward after the prefill feeds the last
            # sampled token and a draft; every row is sampled as plain decoding samples it, and
            # the draft is kept up to the first token the sampler did not pick.
            # teacher forcing (forced_ids: benchmarks, routing traces) measures one-token steps

            def step_metrics(n: int):
                m_ev = tracker.step(n, self.threads, rss=self.guard.last_rss)  # one RSS read a forward
                if dec_forwards > 1:  # the forwards whose rows were sampled so far
                    m_ev = replace(m_ev, tokens_per_forward=dec_rows / (dec_forwards - 1),
                                   draft_acceptance=accepted / drafted if drafted else 0.0)
                return m_ev if self.cluster is None else replace(m_ev, cluster=self.cluster.status().summary())

            rows, fed, draft = logits[-1:], None, []  # fed: the tokens the last forward fed
            timed = None  # (draft tokens, seconds) of the last decode forward
            while True:
                m, done = 0, False  # m: draft tokens the sampler confirmed
                for r in range(rows.shape[0]):
                    if r and cancel.is_set():  # Stop ends within one token, also inside a kept draft
                        reason, done = FinishReason.CANCELLED, True
                        break
                    row = rows[r]
                    if not np.isfinite(row).all():
                        raise EngineError(
                            f"the model produced non-finite logits (NaN/inf) at output token {len(out_ids)}: "
                            f"{self.store.path} holds broken weights; convert the checkpoint again "
                            f"(`colibri convert --overwrite` refuses NaN/inf weights and names the tensor)")
                    if fed is not None:
                        dec_rows += 1
                    prop = copier.propose(out_ids) if copier is not None else None
                    allowed = cons.mask(logits.shape[-1]) if cons is not None else None
                    tok = sampler(row, context, None if prop is None else (copier.weight, prop), allowed)
                    if forced is not None:
                        if len(out_ids) >= len(forced):
                            reason, done = FinishReason.LENGTH, True
                            break
                        tok = int(forced[len(out_ids)])
                    step_t = time.perf_counter()
                    if cons is not None:
                        cons.accept(tok)
                    is_eos = forced is None and tok in self.tokenizer.eos_ids
                    if is_eos:
                        reason, done = FinishReason.STOP, True
                        text_parts.append(dec.flush())
                        break
                    if r:  # a kept draft's next token: its StepMetrics, as every token has one
                        yield step_metrics(len(out_ids))
                    out_ids.append(tok)
                    context.append(tok)
                    piece = dec.push(tok)
                    text_parts.append(piece)
                    yield TokenEvent(len(out_ids) - 1, tok, piece, time.perf_counter() - step_t)
                    if len(out_ids) >= max_new or pos + r >= C:
                        reason, done = FinishReason.LENGTH, True
                        break
                    if r < len(draft) and tok == draft[r]:
                        m += 1
                        continue
                    break
                if fed is not None:  # the positions of the last forward that stay
                    self.model.accept(1 + m)
                    self._kv_ids.extend(fed[:1 + m])
                    if draft:
                        drafted += len(draft)
                        accepted += m
                    if timed is not None and lengths is not None:
                        lengths.record(timed[0], m, timed[1])
                if done:
                    break
                if cancel.is_set():
                    reason = FinishReason.CANCELLED
                    break
                p0 = pos + m  # where the last sampled token goes
                self._adapt_threads()
                draft = []
                t_d = time.perf_counter()
                if drafter is not None:
                    room = min(max_new - len(out_ids) - 1, C - p0 - 1)
                    k = lengths.choose(room)
                    if k:
                        draft = drafter.propose(context, k)
                fed = [tok] + draft
                t_d = time.perf_counter() - t_d  # a forward's cost counts its drafting (an MTP head's rows)
                self._kv_room(p0 + len(fed))
                t_f = time.perf_counter() - t_d
                if draft:
                    rows = self.model.verify(np.asarray(fed), p0, cancel=cancel)
                else:
                    rows = self.model.forward(np.asarray(fed), p0, cancel=cancel)
                dec_forwards += 1
                t_dec1 = time.perf_counter()
                timed = (len(draft), t_dec1 - t_f)
                self.heat.tokens += len(fed)
                pos = p0 + 1
                n = len(out_ids)
                if self.guard.step(n) is not None:  # before the metrics: they show the RSS it left
                    self.sync_pins()
                yield step_metrics(n)
                snap = tracker.residency(n, self.heat.counts)
                if snap is not None:
                    yield snap
                self._maybe_pin()
        except Cancelled:
            reason = FinishReason.CANCELLED
        except EngineError as e:
            # Reported once, by whoever shows the Finished event (CLI line, app banner); a log
            # record at error level as well printed every failure twice on stderr.
            reason, error = FinishReason.ERROR, str(e)
            log.debug("generation failed: %s", e)
        except Exception as e:  # noqa: BLE001 - reported as a Finished(error) event
            reason, error = FinishReason.ERROR, f"{type(e).__name__}: {e}"
            log.debug("generation failed", exc_info=True)
        if reason != FinishReason.STOP:
            text_parts.append(dec.flush())
        self._maybe_pin()
        if self.config.history:
            try:
                self.heat.save(self.store.path)
            except OSError as e:
                log.warning("could not save routing history: %s", e)
        snap = tracker.residency(len(out_ids), self.heat.counts, force=True)
        if snap is not None:
            yield snap
        tot = tracker.totals()
        n = len(out_ids)
        hit_rate, mb_per_token = answer_rates(tot, n)
        yield Finished(
            finish_reason=reason, prompt_tokens=len(ids), generated_tokens=n, text="".join(text_parts),
            token_ids=tuple(out_ids), ttft_s=tracker.ttft if tracker.t_first else time.perf_counter() - t0,
            decode_tok_per_s=dec_rows / (t_dec1 - t_dec0) if dec_rows and t_dec1 > t_dec0 else 0.0,
            prefill_tok_per_s=(len(ids) - p) / prefill_s if prefill_s > 0 else 0.0,
            hit_rate=hit_rate, mb_per_token=mb_per_token,
            felt_wait_s=tot["felt_wait_s"], error=error, dropped_messages=dropped, answer_room=max_new,
            sources=tuple(e.name for e in sources), source_summaries=tuple(e.summary for e in sources),
            threads=self.threads, seed=sampler.seed,
            tokens_per_forward=dec_rows / dec_forwards if dec_forwards else 0.0,
            draft_tokens=drafted, accepted_tokens=accepted)

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

    def cluster_status(self):
        """engine.cluster.ClusterStatus (workers, which experts live where: placement int16
        [M, E], -1 = this computer; states, round trips, bytes) or None without a cluster."""
        return None if self.cluster is None else self.cluster.status()

    def residency_snapshot(self) -> ResidencySnapshot:
        """Which experts are in RAM now (``token_index`` -1: not tied to a token), for a view that
        follows the cache between answers (idle fill, pre-warm, a lowered cap). Thread-safe: the
        cache's state is read under its lock; the heat array may be one routing step behind."""
        return residency_snapshot(self.cache, self.heat.counts, -1,
                                  self.cluster.remote_mask if getattr(self, "cluster", None) else None)

    def reset_history(self) -> None:
        """Forget routing heat and pins (in memory and on disk)."""
        self.heat.reset()
        self.cache.set_pinned(np.zeros_like(self.heat.pinned))
        self._pins_applied = False
        if self.config.history:
            self.heat.save(self.store.path, force=True)  # asked for: replaces even a kept file

    def close(self) -> None:
        """Join prefetch and I/O threads and close every file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.pilot is not None:
            self.pilot.close()
        if self.cluster is not None:
            self.cluster.close()
        self.cache.close()
        self.store.close()
        claim = getattr(self, "budget_claim", None)
        if claim is not None:
            claim.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def engine_threads_alive() -> list[str]:
    """Names of live threads the engine started (tests check none survive close())."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("colibri-io", "colibri-pilot", "colibri-cluster", "colibri-fill",
                                  "colibri-populate"))]


def compile_child(config: dict, parent_pid: int | None = None, niceness: int = 0) -> None:
    """The kernel compile's child process (engine.kernel_prepare.prepare_in_child): open the store
    with ``config`` (an EngineConfig as a dict, kernel_prepare.child_config: a small budget) and
    answer two tokens, so every kernel a generation calls gets compiled, or loaded, and written
    to numba's cache. ``parent_pid``: the process that started it; the child ends when that one
    does. ``niceness``: added to its scheduling priority (a compile in the background gives way
    to the answers)."""
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    if niceness and hasattr(os, "nice"):
        os.nice(niceness)
    from .events import SamplingParams
    eng = Engine.open(EngineConfig.from_dict(config), prepare_kernels=False)
    try:
        eng.model.wait_decode_ready(CHILD_TIMEOUT_S)
        req = GenerateRequest(prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=2))
        for _ in eng.generate(req):
            pass
    finally:
        eng.close()


def prepare_kernel_variants(config):
    """Compile, in the background, the kernels the other values of PILOT and the KV cache type
    need for ``config``'s store (engine.kernel_prepare.KernelVariants, whose child process runs
    :func:`compile_child`). Call it once the model is open."""
    from .kernel_prepare import prepare_kernel_variants as start
    return start(config, compile_child)
