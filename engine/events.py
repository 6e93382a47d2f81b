"""Plain-data requests and events exchanged with the engine.

Every type here is a frozen dataclass holding only str, int, float, bool and tuples,
so the same objects serve the CLI, the tests and the Qt bridge (which carries them in
``Signal(object)``). No numpy views into engine buffers, no Qt types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .settings import SamplingParams  # noqa: F401  (declared in the settings table)


# --- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation; role is "system", "user" or "assistant"."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerateRequest:
    """A generation request.

    Either ``messages`` (chat mode: rendered with the model's own chat template; control tokens
    typed in a message stay text) or ``prompt`` (raw mode: no template, the text is the prompt and
    special tokens written in it are recognised) must be given; ``prompt_ids`` (token ids)
    overrides both. Messages on a model without a chat template raise TokenizerError (check
    ``Engine.has_chat_template`` / ``Loaded.has_chat_template`` and choose raw mode knowingly).
    ``forced_ids``: teacher forcing for benchmarks; when given, the token fed at each decode
    step comes from this tuple instead of the sampler (the sampled token is still reported).
    ``docs_entries``: with ``prompt_ids`` built by the caller with the documentation lookup's
    blocks (the server), the entries given with the last question (engine.docs_lookup.DocEntry):
    they feed the copy prior and ``Finished.sources`` as the engine's own lookup would.
    ``constraint``: constrained decoding (the server's grammars): an object with
    ``mask(n) -> np.ndarray`` bool (n,) of the tokens allowed next and ``accept(token_id)``
    called with every generated token; the sampler draws only allowed tokens.
    """

    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    forced_ids: tuple[int, ...] | None = None
    docs_entries: tuple = ()
    constraint: Any = None


# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadProgress:
    """Progress of a long step; done/total in units. Stages: "convert", "download", "open",
    "compile" (the first compile of a kind of model's kernels, in a child process:
    engine.kernel_prepare, a minute or two), "kernels" (loading them), "prewarm", "cluster"."""

    stage: str
    done: int
    total: int
    unit: str = ""
    message: str = ""


@dataclass(frozen=True)
class Loaded:
    """The engine finished opening a store and is ready to generate.

    num_layers: layers with routed experts (MoE layers: the rows of the cache, the heat and
    the residency snapshot; dense layers of Qwen models have no row), not num_hidden_layers.
    """

    model_name: str
    store_path: str
    quant: str
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    context_length: int
    cap_per_layer: int
    ram_budget_bytes: int
    dense_bytes: int
    expert_slot_bytes: int
    pilot: int
    prewarmed_experts: int = 0
    prewarm_seconds: float = 0.0
    message: str = ""
    has_chat_template: bool = True  #: False: only raw prompts can run (GenerateRequest.prompt)
    max_context: int = 0            #: the model's limit (max_position_embeddings), tokens
    threads: int = 0                #: compute threads in use now (threads = 0: re-counted while generating)
    auto_threads: bool = False      #: the thread count follows the free cores (setting 0)
    pins_per_layer: int = 0         #: experts per layer hot pinning may hold (setting 0: slots / 4)
    cluster: str = ""               #: expert-parallel serving: ClusterStatus.summary() ("" = off)
    moe_layers: tuple[int, ...] = ()  #: the transformer layer of each MoE row (() = rows 0..num_layers-1)
    docs_entries: int = 0           #: entries in the store's documentation index (0: no lookup)
    docs_problem: str = ""          #: why the store's documentation index is not used ("" = fine or none)
    expert_slots: int = 0           #: cache slots of all MoE layers together (each has cap_per_layer or one fewer)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the newly completed UTF-8 text (may be empty while a
    multi-byte character is incomplete). ``step_seconds`` is the wall time of this step."""

    index: int
    token_id: int
    text: str
    step_seconds: float


@dataclass(frozen=True)
class StepMetrics:
    """Engine counters after one generated token (cumulative counts are per generation).

    Units: bytes, seconds, tokens. hit_rate = hits / (hits + misses) over this step's
    demand lookups (NaN-free: 1.0 when there were no lookups).
    """

    token_index: int
    hits: int
    misses: int
    pinned_hits: int
    hit_rate: float
    pinned_hit_rate: float
    lru_hit_rate: float
    loads: int
    demand_bytes: int
    speculative_bytes: int
    mb_per_token: float
    felt_wait_s: float
    read_service_s: float
    rss_bytes: int
    budget_bytes: int
    cache_bytes: int
    cap_per_layer: int
    tok_per_s: float
    ttft_s: float
    spec_issued: int = 0
    spec_completed: int = 0
    spec_dropped_stale: int = 0
    spec_dropped_guard: int = 0
    spec_dropped_full: int = 0
    spec_used: int = 0
    spec_wasted_bytes: int = 0
    pilot_recall: tuple[float, ...] = ()
    threads: int = 0  #: compute threads used for this token
    total_hit_rate: float = 1.0      #: this answer so far (metrics.answer_rates: as Finished.hit_rate)
    total_mb_per_token: float = 0.0  #: this answer so far (as Finished.mb_per_token)
    cluster: str = ""  #: expert-parallel serving: ClusterStatus.summary() now ("" = off)
    expert_slots: int = 0  #: cache slots of all MoE layers together (each has cap_per_layer or one fewer)
    tokens_per_forward: float = 1.0  #: tokens per decode forward so far (above 1: speculation's drafts kept)
    draft_acceptance: float = 0.0  #: share of the draft tokens verified so far that were kept


# Residency states in ResidencySnapshot.state (REMOTE: not in this computer's cache, held in the
# RAM of a worker of an expert-parallel cluster that is up, engine/cluster.py)
ABSENT, RESIDENT, PINNED, LOADING, REMOTE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class ResidencySnapshot:
    """MoE layers x experts view of the expert cache (one row per layer with routed experts).

    state: flattened row-major [num_layers * num_experts] of ABSENT / RESIDENT / PINNED / LOADING
        / REMOTE (on a cluster worker that is up).
    heat: same shape, routing counts of this model (persisted history plus this session).
    routed: same shape, 1 where the expert was routed for the latest token.
    """

    num_layers: int
    num_experts: int
    state: tuple[int, ...]
    heat: tuple[int, ...]
    routed: tuple[int, ...]
    token_index: int


class FinishReason(StrEnum):
    """Why a generation ended (a ``str``: compares equal to "stop", "length", ...)."""

    STOP = "stop"            # an end-of-sequence token was sampled
    LENGTH = "length"        # max_new_tokens, the forced ids or the context ran out
    CANCELLED = "cancelled"  # the cancel event was set
    ERROR = "error"          # a failure; Finished.error says what


@dataclass(frozen=True)
class Finished:
    """End of one generation. finish_reason: a FinishReason (stop, length, cancelled, error).

    hit_rate and mb_per_token cover the whole generation (prefill and decode): every demand
    lookup, and demand + speculative bytes read over the generated tokens; StepMetrics carries
    the same totals (``total_hit_rate``, ``total_mb_per_token``) so panels and the per-answer
    line agree. dropped_messages: the oldest turns left out because the conversation no longer
    fit (never the system prompt). answer_room: tokens the answer could use,
    min(max_new_tokens, context - prompt). threads: compute threads at the end. sources: the
    names of the documentation entries given to the model with the question (documentation
    lookup, engine.docs_lookup; () when off or when the model has no index), and
    source_summaries their summaries as the model read them (same order). decode_tok_per_s:
    tokens sampled from decode forwards per second, from the end of the prefill to the end of
    the last decode forward (0.0 when none ran); with speculation a forward gives several.
    """

    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    text: str
    token_ids: tuple[int, ...]
    ttft_s: float
    decode_tok_per_s: float
    prefill_tok_per_s: float
    hit_rate: float
    mb_per_token: float
    felt_wait_s: float
    error: str = ""
    #: with finish_reason error: the failure's engine.errors.ErrorKind value ("io" for a store
    #: that could not be read, "internal" for a bug), else ""
    error_kind: str = ""
    dropped_messages: int = 0
    answer_room: int = 0
    threads: int = 0
    sources: tuple[str, ...] = ()
    source_summaries: tuple[str, ...] = ()
    seed: int | None = None  #: the sampling seed used (SamplingParams.seed, or the fresh one for "auto")
    tokens_per_forward: float = 0.0  #: tokens sampled per decode forward (1.0 without speculation; 0.0: none ran)
    draft_tokens: int = 0  #: draft tokens verified (speculation, engine/speculative.py)
    accepted_tokens: int = 0  #: draft tokens kept (each the token the sampler picked)

    @property
    def draft_acceptance(self) -> float:
        """Share of the draft tokens that were kept (0.0 without drafts)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class EngineFailure:
    """Something went wrong; ``kind`` is an engine.errors.ErrorKind (a str enum: config, store,
    budget, context, io, ...), ``message`` tells the user what happened and what to do."""

    kind: str
    message: str
    detail: str = ""
