"""The Engine: opens a store, sizes the expert cache to the RAM budget, and generates.

``Engine.generate(request, cancel_event)`` is a generator of plain events (events.py):
TokenEvent and StepMetrics after every token, ResidencySnapshot at most ~10 per second, and
always a final Finished. The loop has no I/O of its own and no Qt (mlx-lm stream_generate).

``Engine`` is composed of two parts beside this file's open, observers and generation loop:
engine_setup.EngineSetup (what opening sets up: plan, cache, model, kernels warmed, threads,
pins, the KV cache's room) and prompt_fit.PromptFit (the prompt's ids, fitted to the context).
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
from .docs_lookup import CopyPrior
from .engine_setup import EngineSetup, RoutingFeed  # noqa: F401 - RoutingFeed: its home before
from .errors import Cancelled, ContextOverflowError, EngineError, ErrorKind
from .events import Finished, FinishReason, GenerateRequest, LoadProgress, ResidencySnapshot, TokenEvent
from .expert_cache import ExpertCache
from .expert_store import ExpertStore
from .kernel_prepare import CHILD_TIMEOUT_S, exit_with_parent
from .metrics import MetricsTracker, answer_rates, residency_snapshot
from .observers import Observer, ObserverFailure
from .prompt_fit import PromptFit
from .ram_budget import current_rss
from .sampling import Sampler
from .mtp import drafter_for
from .speculative import DraftLength
from .sysinfo import FreeCores, usable_cpus

log = logging.getLogger(__name__)


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


class Engine(EngineSetup, PromptFit):
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
            self._open_rest(report, prepare_kernels, compile_child)
        except BaseException:
            if self.cluster is not None:
                self.cluster.close()
            if getattr(self, "cache", None) is not None:
                self.cache.close()
            self.store.close()
            raise
        return self

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
        error = error_kind = ""
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
            lent = self._scratch_room(len(ids) - p)
            try:
                logits = self.model.forward(np.asarray(ids[p:]), p, cancel=cancel)
            finally:
                self._scratch_back(lent)
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
            reason, error, error_kind = FinishReason.ERROR, str(e), str(e.kind)
            log.debug("generation failed: %s", e)
        except Exception as e:  # noqa: BLE001 - reported as a Finished(error) event
            reason, error, error_kind = FinishReason.ERROR, f"{type(e).__name__}: {e}", str(ErrorKind.INTERNAL)
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
            felt_wait_s=tot["felt_wait_s"], error=error, error_kind=error_kind, dropped_messages=dropped,
            answer_room=max_new,
            sources=tuple(e.name for e in sources), source_summaries=tuple(e.summary for e in sources),
            threads=self.threads, seed=sampler.seed,
            tokens_per_forward=dec_rows / dec_forwards if dec_forwards else 0.0,
            draft_tokens=drafted, accepted_tokens=accepted)

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
