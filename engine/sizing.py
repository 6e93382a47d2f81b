"""The one sizing rule: what a model needs in RAM, how many expert slots per layer fit, and the
verdict shown before a download. Used by ``Engine.open``, the model wizard and ``colibri
download`` (through engine.library), and the settings dialog's "auto" values.

Sizes are bytes (GB = 1e9 bytes), context lengths tokens.

    dense   resident weights: the loaded store's arrays (``manifest["dense_bytes"]`` less the
            token-embedding table, which the engine reads row by row from the store:
            engine.expert_store.EmbeddingRows), or before conversion the sum over the family's
            resident tensors at the store's dense quantization (engine.models.dense_bytes: the
            tensor list convert.py writes; attention, norms, routers, lm_head, biases, shared
            experts, dense-layer MLPs; engine.models.embedding_bytes left out).
    kv      2 (K and V) x transformer layers (num_hidden_layers) x KV heads x context x
            head_dim x 2 bytes (the kv_dtype setting's default f16; 4 bytes with f32).
    kv_open the KV of the first KV_OPEN_TOKENS of the context: what the cap sets aside (the
            KV's pages are mapped as the context fills; the expert cache gives slots back as
            it grows).
    slots   one routed-expert slab per MoE layer (``manifest["slot_bytes"]``, else
            engine.models.expert_slot_bytes over moe_intermediate_size); dense layers
            (Qwen's mlp_only_layers / decoder_sparse_step) have no expert row.
    reserve RESERVE_BYTES for the Python / numpy / numba runtime, activations and logits.

Automatic cap (after colibri's cap_for_ram, PR #1445, counted in single slots):
    slots = (budget - dense - kv_open - reserve) // slot bytes, clamped to [L, L x num_experts],
    cap = ceil(slots / L): every MoE layer holds cap or cap - 1 experts (ExpertCache.set_slots),
    so no budget is left unused for want of a whole slot in every layer (up to L - 1 slots:
    56 MB of a 7B int4 model's 4 GB budget).
The automatic budget is RSS after the dense weights are loaded + AVAILABLE_SHARE x available
memory (ram_budget.probe_available), but never more than the model can use: that RSS + KV +
every expert of every layer + reserve (a 13 MB model took a 21 GB budget, and claimed it from
other colibri processes). The pre-download verdict applies the same plan_cap to the
share of available memory the engine would budget.

A new model family plugs in through its file in engine/models/ (``dense_tensors``, registered
by ``model_type``); everything else here reads the common ModelArgs fields (num_hidden_layers,
num_moe_layers, num_experts, num_key_value_heads, head_dim, max_position_embeddings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import BudgetError, StoreError
from .quant import QUANTS
from .ram_budget import AVAILABLE_SHARE, GB, RESERVE_BYTES, per_layer, probe_available
from .units import format_bytes

MAX_DEFAULT_CONTEXT = 4096  # the context when the setting is 0 (capped by the model's own)
# The KV cache's pages are mapped as the context fills (engine.models.base.kv_zeros), so the
# plan sets aside the KV of the first KV_OPEN_TOKENS only (a question and its answer) and gives
# the rest of the room to the expert cache, which gives slots back as the context grows
# (Engine: RssGuard.make_room before each forward). The whole context's KV still counts in the
# minimum a budget must hold (ram_needed, plan_cap's refusal).
KV_OPEN_TOKENS = 512


# --- the parts -----------------------------------------------------------------------------


def effective_context(args, context_length: int) -> int:
    """Tokens of KV cache for the setting ``context_length`` (0 = the model's
    max_position_embeddings, at most MAX_DEFAULT_CONTEXT)."""
    return int(context_length) or min(args.max_position_embeddings, MAX_DEFAULT_CONTEXT)


KV_ELEMENT_BYTES = {"f16": 2, "f32": 4}  # bytes of one KV cache element per kv_dtype setting
DEFAULT_KV_DTYPE = "f16"  # the kv_dtype setting's default (engine.settings)


def kv_bytes(args, context_length: int, kv_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """KV cache bytes at ``context_length`` tokens: ``args.kv_values_per_token`` elements per
    token and layer (K and V of every KV head; MLA: the latent, kv_lora_rank +
    qk_rope_head_dim; DeepSeek sparse attention: plus index_head_dim indexer-key values on the
    layers that run their own indexer; ``args.kv_values_all_layers`` in all, over the
    ``args.num_kv_layers`` layers that have a KV cache), each 2 bytes (kv_dtype "f16") or 4
    ("f32"), plus ``args.recurrent_state_bytes`` (a hybrid family's linear-attention state,
    float32, whatever the context length).

    Raises:
        ValueError: unknown kv_dtype.
    """
    if kv_dtype not in KV_ELEMENT_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_ELEMENT_BYTES)}")
    return (args.kv_values_all_layers * int(context_length) * KV_ELEMENT_BYTES[kv_dtype]
            + args.recurrent_state_bytes)


def dense_bytes(args, quant: str) -> int:
    """Resident bytes of ``args`` converted with experts at ``quant``: attention, norms,
    routers, lm_head, and - per family - biases, shared experts and the MLPs of dense layers
    (engine.models.dense_bytes, from the tensor list the converter writes, less
    engine.models.embedding_bytes: the embedding table stays in the store; equals the bytes
    Engine.open loads: tests check it per family for int8 / int4 / f16)."""
    from .models import dense_bytes as family_dense_bytes
    from .models import embedding_bytes
    return int(family_dense_bytes(args, quant)) - int(embedding_bytes(args, quant))


def store_dense_bytes(args, manifest: dict) -> int:
    """Resident bytes of a converted store: its ``dense_bytes`` less its embedding table (read
    row by row from the store), at the store's dense quantization and group size."""
    from .models import embedding_bytes
    quant = str(manifest.get("quant", "int8"))
    return int(manifest["dense_bytes"]) - int(embedding_bytes(args, quant, int(manifest.get("group_size") or 32),
                                                              manifest.get("dense_quant")))


def slot_bytes(args, quant: str) -> int:
    """Bytes of one routed expert's slab (gate, up, down at ``quant`` over the expert width
    ``moe_intermediate_size``, 4096-aligned: engine.models.expert_slot_bytes)."""
    from .models import expert_slot_bytes
    return int(expert_slot_bytes(args, quant))


# --- what a model needs --------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Disk and RAM numbers of one model at one quantization and context (bytes).

    ram_needed = dense + kv + one expert slot per MoE layer + reserve: the minimum plan_cap
    accepts. expert_bytes: every expert (a cache holding all of them). store_bytes: the
    converted store on disk. num_experts: experts per layer. kv_bytes: the KV cache at the
    whole context; kv_open_bytes: at its first KV_OPEN_TOKENS (what the cap sets aside).
    """

    quant: str
    slot_bytes: int
    expert_bytes: int
    dense_bytes: int
    store_bytes: int
    kv_bytes: int
    slots_bytes: int
    reserve_bytes: int
    ram_needed: int
    context_length: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    layer_slot_bytes: tuple[int, ...] = ()
    kv_open_bytes: int = -1  # the KV the cap sets aside at open (KV_OPEN_TOKENS); -1: kv_bytes

    @property
    def all_in_ram_bytes(self) -> int:
        """RAM with every expert cached (dense + KV + all experts + reserve)."""
        return self.dense_bytes + self.kv_bytes + self.expert_bytes + self.reserve_bytes


def estimate(args, quant: str = "int8", context_length: int = MAX_DEFAULT_CONTEXT,
             extra_store_bytes: int = 0, kv_dtype: str = DEFAULT_KV_DTYPE) -> Estimate:
    """Store size and minimum RAM of ``args`` converted at ``quant`` (before any conversion).

    Args:
        context_length: tokens of KV cache (0 = the engine's default for this model).
        extra_store_bytes: copied files (tokenizer, config) to add to the store size.
        kv_dtype: the KV cache element ("f16" or "f32", the kv_dtype setting).
    Raises:
        ValueError: unknown quant.
    """
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r}: choose one of {', '.join(QUANTS)}")
    from .models import family_for
    ctx = effective_context(args, context_length)
    slot = slot_bytes(args, quant)
    M, E = args.num_moe_layers, args.num_experts  # expert rows: one per MoE layer
    experts = M * E * slot
    dense = dense_bytes(args, quant)
    kv = kv_bytes(args, ctx, kv_dtype)
    slots = M * slot
    n_dense = 3 * len(family_for(args.model_type).dense_tensors(args))  # arrays in dense.safetensors (about)
    # + manifest (~120 B per expert) + dense.safetensors header (~128 B per array)
    from .models import embedding_bytes
    # on disk the dense file holds the embedding table too (read from there row by row)
    store = experts + dense + embedding_bytes(args, quant) + extra_store_bytes + 4096 + 120 * M * E + 128 * n_dense
    return Estimate(quant, slot, experts, dense, store, kv, slots, RESERVE_BYTES,
                    dense + kv + slots + RESERVE_BYTES, ctx, E, args.num_experts_per_tok, (slot,) * M,
                    kv_bytes(args, min(ctx, KV_OPEN_TOKENS), kv_dtype))


def read_manifest(store: str | Path) -> dict:
    """The manifest.json of a converted store. Raises StoreError naming the file."""
    p = Path(store) / "manifest.json"
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StoreError(f"{p}: cannot read the store manifest ({e}); convert the model again") from None
    if not isinstance(m, dict) or "slot_bytes" not in m or "dense_bytes" not in m:
        raise StoreError(f"{p}: not a store manifest (no slot_bytes / dense_bytes); convert the model again")
    return m


def estimate_store(args, manifest: dict, context_length: int, kv_dtype: str = DEFAULT_KV_DTYPE) -> Estimate:
    """The Estimate of a converted store from its manifest (exact dense and slot bytes), with
    the KV cache at ``kv_dtype`` ("f16" or "f32")."""
    layer_slots = tuple(int(b) for b in manifest["slot_bytes"])
    ctx = effective_context(args, context_length)
    dense = store_dense_bytes(args, manifest)
    kv = kv_bytes(args, ctx, kv_dtype)
    slots = sum(layer_slots)
    E = args.num_experts
    return Estimate(str(manifest.get("quant", "")), max(layer_slots), E * slots, dense, 0, kv, slots,
                    RESERVE_BYTES, dense + kv + slots + RESERVE_BYTES, ctx, E, args.num_experts_per_tok,
                    layer_slots, kv_bytes(args, min(ctx, KV_OPEN_TOKENS), kv_dtype))


# --- the cap -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPlan:
    """Outcome of sizing; all sizes in bytes."""

    budget: int
    dense: int
    kv: int  # the KV cache at the whole context
    reserve: int
    slot_bytes_sum: int  # one slot in every layer
    cap: int
    auto_budget: bool
    auto_cap: bool
    slots: int = 0  # expert slots of all MoE layers together (cap x layers, or fewer: cap - 1 in some)
    layers: int = 0  # MoE layers
    room_slots: int = 0  # the slots the budget has room for (an explicit cap may ask for more)
    kv_open: int = -1  # the KV set aside at open (sizing.KV_OPEN_TOKENS); -1: all of ``kv``

    @property
    def kv_set_aside(self) -> int:
        """The KV bytes the cap was planned around (``kv_open``, or ``kv`` when unset)."""
        return self.kv if self.kv_open < 0 else self.kv_open

    def describe(self) -> str:
        """One line: slots per layer, budget and its parts (sizes in the unit that reads: kB,
        MB, GB)."""
        spread = (f"{self.slots / self.layers:.1f} slots/layer ({self.slots} in all, "
                  f"{per_layer(self.slots, self.layers)} per layer)"
                  if self.layers and self.slots and self.slots != self.cap * self.layers else f"{self.cap} slots/layer")
        over = ""
        if self.layers and self.room_slots and self.slots > self.room_slots:
            over = (f"; cap {self.cap} is more than the budget holds ({self.room_slots / self.layers:.1f} "
                    f"per layer): the RSS guard will lower it, or raise the RAM budget")
        return (f"{spread}: {format_bytes(self.budget)} budget "
                f"({'auto' if self.auto_budget else 'set'}), {format_bytes(self.dense)} dense, "
                + (f"{format_bytes(self.kv)} KV" if self.kv_set_aside >= self.kv else
                   f"{format_bytes(self.kv_set_aside)} KV (up to {format_bytes(self.kv)} as the context fills)")
                + f", {format_bytes(self.reserve)} reserve, "
                f"{format_bytes(self.slot_bytes_sum)} per slot across layers{over}")


def plan_cap(num_experts: int, slot_bytes: list[int], dense_bytes: int, kv_bytes: int,
             ram_budget_gb: float | None, cap: int | None, rss_now: int | None = None,
             available: int | None = None, reserve: int = RESERVE_BYTES, kv_open: int | None = None) -> BudgetPlan:
    """Size the expert cache.

    Args:
        slot_bytes: per-layer slot size (bytes). dense_bytes: resident bytes. kv_bytes: the
            KV cache at the whole context (the minimum a budget must hold counts it all).
        kv_open: the KV the cap sets aside (the first KV_OPEN_TOKENS; None: all of kv_bytes);
            the cache gives slots back as the context grows past it.
        ram_budget_gb: explicit budget (GB) or None for automatic (rss_now, default
            dense_bytes, + AVAILABLE_SHARE x available, default probed).
        cap: explicit slots/layer (overrides the automatic cap; still refused if its minimum,
            one slot per layer, does not fit the budget).
    Returns:
        BudgetPlan: automatic, ``slots`` = what the room holds in single slots of the largest
        layer's size, ``cap`` = ceil(slots / layers); explicit, cap x layers.
    Raises:
        BudgetError: not even one slot per layer fits; the message gives the numbers.
    """
    per = int(sum(slot_bytes))
    if ram_budget_gb is None:
        if available is None:
            available, _ = probe_available()
            # what other colibri processes have budgeted but not yet taken is not ours
            # (two instances must not each take 88% of RAM)
            from .sysinfo import others_unreserved
            available = max(0, available - others_unreserved())
        base = rss_now if rss_now is not None else dense_bytes
        # never more than the whole model can use: every expert cached (the RSS holds the dense)
        whole = max(base, dense_bytes) + kv_bytes + num_experts * per + reserve
        budget = int(min(base + AVAILABLE_SHARE * available, whole))
    else:
        budget = int(ram_budget_gb * GB)
    kv_open = kv_bytes if kv_open is None else min(int(kv_open), kv_bytes)
    room = budget - dense_bytes - kv_open - reserve
    L = max(1, len(slot_bytes))
    one = max(slot_bytes, default=0)
    fit = room // one if one > 0 else num_experts * L  # single slots
    full = (budget - dense_bytes - kv_bytes - reserve) // one if one > 0 else fit  # at the whole context
    if full < L:
        raise BudgetError(
            f"RAM budget {format_bytes(budget)} cannot hold the dense weights ({format_bytes(dense_bytes)}) + "
            f"KV cache ({format_bytes(kv_bytes)}) + reserve ({format_bytes(reserve)}) + one expert slot per "
            f"layer ({format_bytes(per)}): {format_bytes(dense_bytes + kv_bytes + reserve + per)} needed. "
            f"Raise the RAM budget, lower the context length, or use a smaller quantization.")
    auto_cap = cap is None
    if auto_cap:
        slots = int(min(fit, num_experts * L))
        c = -(-slots // L)
    else:
        c = int(min(cap, num_experts))
        slots = c * L
    return BudgetPlan(budget, dense_bytes, kv_bytes, reserve, per, c, ram_budget_gb is None, auto_cap,
                      slots=slots, layers=L, room_slots=int(fit), kv_open=kv_open)


def plan_estimate(est: Estimate, ram_budget_gb: float | None, cap: int | None,
                  rss_now: int | None = None, available: int | None = None) -> BudgetPlan:
    """plan_cap for an Estimate (what Engine.open does for the same model and settings)."""
    return plan_cap(est.num_experts, list(est.layer_slot_bytes), est.dense_bytes, est.kv_bytes,
                    ram_budget_gb, cap, rss_now=rss_now, available=available, reserve=est.reserve_bytes,
                    kv_open=None if est.kv_open_bytes < 0 else est.kv_open_bytes)


def plan_for_store(store: str | Path, config, rss_now: int | None = None,
                   available: int | None = None) -> BudgetPlan:
    """The BudgetPlan Engine.open would choose for ``store`` with EngineConfig ``config``
    (without loading it; the settings dialog shows it for "auto").

    Raises:
        StoreError: the store's manifest or config.json is unreadable. BudgetError: as plan_cap.
    """
    from .config import ModelArgs
    args = ModelArgs.from_hf_config(store)
    est = estimate_store(args, read_manifest(store), config.context_length)
    return plan_estimate(est, config.ram_budget_gb, config.cap, rss_now=rss_now, available=available)


# --- the verdict before a download --------------------------------------------------------


def plan_before_open(est: Estimate, available: int) -> BudgetPlan:
    """The plan a model gets before it is downloaded, on a machine with ``available`` bytes
    free: AVAILABLE_SHARE of them as the budget (the engine's automatic one, counted before the
    dense weights are loaded). ram_verdict judges it; the wizard's recommendations show it.
    Raises BudgetError: not one slot per layer fits."""
    num_experts = est.num_experts or est.expert_bytes // max(1, est.slots_bytes)
    layer_slots = list(est.layer_slot_bytes) or [est.slots_bytes]
    return plan_cap(num_experts, layer_slots, est.dense_bytes, est.kv_bytes, int(AVAILABLE_SHARE * available) / GB,
                    None, reserve=est.reserve_bytes, kv_open=None if est.kv_open_bytes < 0 else est.kv_open_bytes)


def ram_verdict(est: Estimate, num_experts_per_tok: int, total: int, available: int) -> tuple[str, str]:
    """("ok" | "warn" | "refuse", message with the numbers).

    refuse: the minimum (dense + KV + one slot per layer + reserve) exceeds physical RAM.
    warn: plan_cap refuses the share of available RAM the engine budgets (AVAILABLE_SHARE),
    or fewer expert slots per layer fit than experts are routed per token (every token then
    reads experts from the SSD).
    """
    need = est.ram_needed
    usable = int(AVAILABLE_SHARE * available)
    head = (f"needs at least {format_bytes(need)} (dense {format_bytes(est.dense_bytes)} + KV "
            f"{format_bytes(est.kv_bytes)} at {est.context_length} tokens + one expert slot per MoE layer "
            f"{format_bytes(est.slots_bytes)} + reserve {format_bytes(est.reserve_bytes)}); this machine has "
            f"{format_bytes(total)} RAM, {format_bytes(available)} available")
    if need > total:
        return "refuse", (f"Not enough RAM: the model {head}. Lower the context length or choose a "
                          f"smaller quantization.")
    num_experts = est.num_experts or est.expert_bytes // max(1, est.slots_bytes)
    layer_slots = list(est.layer_slot_bytes) or [est.slots_bytes]
    try:
        p = plan_before_open(est, available)
        fit = p.slots // p.layers  # the slots every layer has at least
    except BudgetError:
        return "warn", (f"Tight on RAM: the model {head}. Close other programs or lower the context "
                        f"length before opening it.")
    stream = streaming_text(fit, num_experts, num_experts_per_tok, layer_slots)
    if fit < num_experts_per_tok:
        return "warn", (f"Runs, but slowly: the model {head}; only about {fit} expert slots per layer fit "
                        f"while {num_experts_per_tok} experts are routed per token, so most experts are "
                        f"read from the SSD for every token{stream}.")
    whole = fit >= num_experts
    return "ok", (f"The model {head}; about {fit} expert slots per layer fit"
                  + (" (the whole model fits in RAM)." if whole else f"; the rest streams from the SSD{stream}."))


DISK_READ_BYTES_PER_S = 2e9  # a typical NVMe SSD with O_DIRECT reads of a few MB (measured here: 1.8-2 GB/s)


def uniform_miss_bytes(cap: int, num_experts: int, num_experts_per_tok: int, layer_slots: list[int]) -> float:
    """Expected expert bytes read per decoded token when routing is uniform over the experts
    and each MoE layer caches ``cap`` of ``num_experts``: sum over layers of K (1 - cap / E)
    slot bytes. Trained routing reuses experts, so real reads are lower (an upper guide)."""
    miss = max(0.0, 1.0 - cap / max(1, num_experts))
    return float(sum(num_experts_per_tok * miss * b for b in layer_slots))


def streaming_text(cap: int, num_experts: int, num_experts_per_tok: int, layer_slots: list[int]) -> str:
    """", up to about N MB read per token (~T s/token at 2 GB/s) ..." for the verdict, or ""."""
    b = uniform_miss_bytes(cap, num_experts, num_experts_per_tok, layer_slots)
    if b <= 0:
        return ""
    return (f" (cap {cap} of {num_experts} per layer: up to about {b / 1e6:,.0f} MB read per token if routing "
            f"were uniform, ~{b / DISK_READ_BYTES_PER_S:.2g} s per token on a 2 GB/s SSD; real routing "
            f"repeats experts, so usually less)")


def machine_ram() -> tuple[int, int]:
    """(total, available) RAM in bytes this process may use (psutil, cut to the cgroup limit)."""
    from .sysinfo import memory
    return memory()


# Weight bytes the decode kernels go through per second once they are in RAM (active_bytes
# per token x tokens/s), measured on this project's 2-core machine, int8 stores, 2 threads:
# OLMoE-1B-7B's shape with every expert resident, 1.19 GB a token at 21.9 tok/s
# (bench/results/peers_olmoe_1b_7b*.md), and Qwen3-30B-A3B's shape streamed, 3.09 GB a token
# in 0.41 s of compute (bench/results/stream_qwen3_30b_a3b.md). The larger model ran at the
# lower rate, so speeds are given as the range of the two; another CPU scales both.
COMPUTE_BYTES_PER_S_LOW = 7.5e9
COMPUTE_BYTES_PER_S_HIGH = 26e9


def active_bytes(est: Estimate) -> int:
    """Weight bytes one decoded token reads: the resident dense weights and the
    ``num_experts_per_tok`` routed experts of every MoE layer."""
    return int(est.dense_bytes + est.num_experts_per_tok * sum(est.layer_slot_bytes))


def expected_tokens_per_s(est: Estimate, slots_per_layer: int, disk_bytes_per_s: float = DISK_READ_BYTES_PER_S,
                          compute_bytes_per_s: float = COMPUTE_BYTES_PER_S_LOW) -> float:
    """Decode speed to expect (tokens/s) with ``slots_per_layer`` experts cached per MoE
    layer: 1 / (active_bytes / compute_bytes_per_s + uniform_miss_bytes / disk_bytes_per_s).
    Uniform routing misses the most, so trained routing usually reads less; 0 when not one
    slot per layer fits."""
    if slots_per_layer < 1:
        return 0.0
    miss = uniform_miss_bytes(slots_per_layer, est.num_experts, est.num_experts_per_tok, list(est.layer_slot_bytes))
    return 1.0 / (active_bytes(est) / compute_bytes_per_s + miss / disk_bytes_per_s)


def expected_speed_range(est: Estimate, slots_per_layer: int,
                         disk_bytes_per_s: float = DISK_READ_BYTES_PER_S) -> tuple[float, float]:
    """(low, high) tokens/s: expected_tokens_per_s at the two measured compute rates."""
    return (expected_tokens_per_s(est, slots_per_layer, disk_bytes_per_s, COMPUTE_BYTES_PER_S_LOW),
            expected_tokens_per_s(est, slots_per_layer, disk_bytes_per_s, COMPUTE_BYTES_PER_S_HIGH))


# --- a GGUF model before its download --------------------------------------------------------

# The tensor types llama.cpp's quantizer gives each part of a model for a file type (its
# llama_tensor_get_type, for the mixes the model catalog names): routed experts' gate, up and
# down, down in the "more bits" layers, the other matrices, the token embedding and the output.
GGUF_FILE_TYPES = {
    "Q4_K_M": dict(gate="Q4_K", up="Q4_K", down="Q4_K", down_more="Q6_K", other="Q4_K", embed="Q4_K", output="Q6_K"),
    "Q8_0": dict(gate="Q8_0", up="Q8_0", down="Q8_0", down_more="Q8_0", other="Q8_0", embed="Q8_0", output="Q8_0"),
    "MXFP4": dict(gate="MXFP4", up="MXFP4", down="MXFP4", down_more="MXFP4", other="Q8_0", embed="Q8_0",
                  output="Q8_0"),
}
# a K-quant for rows whose width is no multiple of 256 (llama.cpp's fallback types)
_GGUF_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _gguf_more_bits(i: int, n: int) -> bool:
    """The layers a _M mix gives more bits in ffn_down: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _gguf_row(type_name: str, cols: int) -> tuple[str, int]:
    """(the type a row of ``cols`` values gets, its bytes) with llama.cpp's fallback."""
    from .gguf_blocks import TYPE_IDS, row_bytes
    t = TYPE_IDS[type_name]
    try:
        return type_name, row_bytes(t, cols)
    except ValueError:
        alt = _GGUF_FALLBACK.get(type_name, "F16")
        return alt, row_bytes(TYPE_IDS[alt], cols)


def gguf_store_estimate(args, widths: dict, context_length: int = 0, dense_quant: str = "int8",
                        extra_store_bytes: int = 0) -> Estimate:
    """The Estimate of the store a GGUF model imports to (quant "gguf": each routed expert's
    blocks as published in one slab whose projections are ``widths`` bytes per row, see
    engine.gguf_blocks.gguf_slab_layout; the dense weights at ``dense_quant``)."""
    from .gguf_blocks import gguf_slab_layout
    from .models import dense_bytes as family_dense_bytes
    from .models import embedding_bytes, family_for
    a = args
    slot = gguf_slab_layout(a.hidden_size, a.moe_intermediate_size, widths, bias=a.expert_bias)["slot_bytes"]
    ctx = effective_context(a, context_length)
    M, E = a.num_moe_layers, a.num_experts
    dense = family_dense_bytes(a, dense_quant, dense_quant=dense_quant)
    kv = kv_bytes(a, ctx)
    n_dense = 3 * len(family_for(a.model_type).dense_tensors(a))
    store = (M * E * slot + dense + embedding_bytes(a, dense_quant, dense_quant=dense_quant) + extra_store_bytes
             + 4096 + 120 * M * E + 128 * n_dense)
    return Estimate("gguf", slot, M * E * slot, dense, store, kv, M * slot, RESERVE_BYTES,
                    dense + kv + M * slot + RESERVE_BYTES, ctx, E, a.num_experts_per_tok, (slot,) * M)


@dataclass(frozen=True)
class GGUFEstimate:
    """A GGUF file of one file type before its download: ``download_bytes`` (about: every tensor at
    the type llama.cpp's quantizer gives it, norms float32, no metadata) and ``estimate``, the
    store it imports to (gguf_store_estimate). ``expert_types``: (gate, up, down) types, down
    the widest one."""

    file_type: str
    download_bytes: int
    estimate: Estimate
    expert_types: tuple[str, str, str]


def estimate_gguf(args, file_type: str, context_length: int = 0) -> GGUFEstimate:
    """Download and store sizes of ``args`` published as a GGUF of ``file_type`` (a key of
    GGUF_FILE_TYPES: "Q4_K_M", "Q8_0", "MXFP4"), from the config alone.

    Raises:
        ValueError: a file type not in GGUF_FILE_TYPES.
    """
    mix = GGUF_FILE_TYPES.get(file_type)
    if mix is None:
        raise ValueError(f"GGUF file type {file_type!r}: sized are {', '.join(GGUF_FILE_TYPES)}")
    from .models import family_for
    a = args
    D, I, E, M = a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_moe_layers
    gate_t, gate_b = _gguf_row(mix["gate"], D)
    up_t, up_b = _gguf_row(mix["up"], D)
    downs = [_gguf_row(mix["down_more" if _gguf_more_bits(i, M) else "down"], I) for i in range(M)]
    down_t, down_b = max(downs, key=lambda x: x[1])
    bias = (2 * I + D) * 4 if a.expert_bias else 0
    total = sum(E * (I * gate_b + I * up_b + D * b + bias) for _t, b in downs)
    seen = set()
    for t in family_for(a.model_type).dense_tensors(a):
        if t.ours in seen:
            continue
        seen.add(t.ours)
        n = 1
        for s in t.shape:
            n *= int(s)
        if t.kind == "keep" or len(t.shape) < 2:
            total += n * 4  # norms, routers' biases: float32 in GGUF
            continue
        kind = "embed" if t.ours == "embed_tokens" else "output" if t.ours == "lm_head" else "other"
        cols = int(t.shape[-1])
        total += n // cols * _gguf_row(mix[kind], cols)[1]
    est = gguf_store_estimate(a, {"gate_proj": gate_b, "up_proj": up_b, "down_proj": down_b}, context_length)
    return GGUFEstimate(file_type, int(total), est, (gate_t, up_t, down_t))
