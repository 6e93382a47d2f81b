"""``colibri run``, ``colibri convert`` and ``colibri info``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..events import ChatMessage, Finished, FinishReason, GenerateRequest, StepMetrics, TokenEvent
from ..settings import ENGINE, SAMPLING
from .flags import add_setting_flags, engine_config, sampling_params


@contextlib.contextmanager
def interrupt_sets(cancel: threading.Event):
    """While inside, Ctrl+C (SIGINT) sets ``cancel`` and then raises KeyboardInterrupt as
    Python's own handler does. A KeyboardInterrupt raised while the main thread runs a ctypes
    callback (llvmlite's, as numba loads a cached kernel) is printed and dropped by ctypes
    ("Exception ignored on calling ctypes callback"), and the answer ran to its end; the
    engine polls ``cancel`` between layers, so the flag stops it all the same. Outside the
    main thread (no signal handler can be set there), or when SIGINT is ignored (a background
    job), it does nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return

    def on_sigint(signum, frame):
        cancel.set()
        if callable(previous):
            previous(signum, frame)  # Python's default handler raises KeyboardInterrupt
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _layers(n: int, kind: str) -> str:
    """'1 full-attention layer' / '3 full-attention layers'."""
    return f"{n} {kind} layer" + ("" if n == 1 else "s")


def _progress_printer(label: str):
    from .models import cli_progress  # one progress line format for every command
    return cli_progress(label)


def resolve_model_name(model: str) -> str:
    """``model`` as given when it is an existing path or looks like one; else a bare name from
    ``colibri models`` (the manifest's model name or the store's folder name in the library's
    models folder, as the app lists them) resolved to that store's path.
    Raises ValueError: the name matches several stores (their folder names are listed)."""
    if Path(model).exists() or os.sep in model or "/" in model:
        return model
    from ..library import list_models
    try:
        ms = list_models()
    except OSError:
        return model
    hits = [m for m in ms if Path(m.path).name == model] or [m for m in ms if m.name == model]
    if len(hits) > 1:
        raise ValueError(f"--model {model}: {len(hits)} converted models have that name ("
                         + ", ".join(Path(m.path).name for m in hits) + "); give the folder name or the path "
                         f"(see `colibri models`)")
    return hits[0].path if hits else model


def resolve_store(model: str | None) -> str:
    """The store to open: ``model`` (a path, or a name listed by ``colibri models``), else the
    bundled default model (converted on first use)."""
    if model:
        return resolve_model_name(model)
    from ..library import default_store
    return str(default_store(progress=_progress_printer("converting the default model (first run)")))


def cmd_run(a) -> int:
    """``colibri run``: generate from a prompt, streaming the text to stdout."""
    from ..chat_template import raw_mode_warning
    from ..generate import Engine
    from .models import open_notices
    from ..bench.prof import Profile
    if not a.prompt.strip():
        raise ValueError("--prompt is empty: give the text to answer or continue")
    if a.trace:  # refuse a trace path that cannot be written before any compute
        t = Path(a.trace)
        if t.is_dir():
            raise ValueError(f"--trace {t}: is a folder; give a file name, e.g. {t / 'trace.jsonl'}")
        if not t.parent.is_dir():
            raise ValueError(f"--trace {t}: folder {t.parent} does not exist")
    store = resolve_store(a.model)
    cfg = engine_config(a, store)
    cancel = threading.Event()
    with interrupt_sets(cancel), Engine.open(cfg, progress=open_notices) as eng:
        if cancel.is_set():  # a Ctrl+C while it opened that a ctypes callback swallowed
            raise KeyboardInterrupt
        if a.prof:
            print(f"[prof] {eng.loaded.message}", file=sys.stderr)
        if eng.loaded.docs_problem and a.docs_lookup and not a.raw:
            print(f"warning: {eng.loaded.docs_problem}", file=sys.stderr)
        if (not a.raw and not eng.has_chat_template) or (a.raw and a.system):  # never silently raw (18.5)
            print(raw_mode_warning(eng.loaded.store_path, eng.has_chat_template, bool(a.system)), file=sys.stderr)
        if a.raw or not eng.has_chat_template:
            req = GenerateRequest(prompt=a.prompt, sampling=sampling_params(a))
        else:
            msgs = ((ChatMessage("system", a.system),) if a.system else ()) + (ChatMessage("user", a.prompt),)
            req = GenerateRequest(messages=msgs, sampling=sampling_params(a))
        prof = Profile(eng) if a.prof else None
        trace = None
        if a.trace:
            from ..trace import TraceRecorder
            trace = TraceRecorder(eng, logits=a.trace_logits)
        fin = None
        try:
            for ev in eng.generate(req, cancel):
                if isinstance(ev, TokenEvent):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, StepMetrics) and prof:
                    prof.add(ev)
                elif isinstance(ev, Finished):
                    fin = ev
        except KeyboardInterrupt:
            cancel.set()
        print(flush=True)  # the answer's line ends before any note on stderr (both may go to one file)
        if trace:
            trace.save(a.trace)
        if fin is not None and fin.finish_reason == FinishReason.ERROR:
            print(f"error: {fin.error}", file=sys.stderr)
            return 1
        if fin is not None and req.sampling.temperature > 0 and req.sampling.seed is None:
            print(f"seed {fin.seed} (--seed {fin.seed} reproduces this answer)", file=sys.stderr)
        if fin is not None and fin.sources:
            print(f"looked up: {', '.join(fin.sources)} (--no-docs-lookup answers without)", file=sys.stderr)
        elif fin is not None and a.docs_lookup and not a.raw and eng.docs is not None:
            print("looked up: no entry of the model's documentation matched the question and fit in the "
                  "context (--context-length)", file=sys.stderr)
        if prof and fin:
            print(prof.report(fin), file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    """``colibri convert SRC DST``: convert a Hugging Face checkpoint folder into a store."""
    from ..convert import convert_checkpoint
    from ..gguf_import import convert_gguf, is_gguf_path
    t0 = time.perf_counter()
    gguf = is_gguf_path(a.src)
    if gguf and a.quant is not None:
        print(f"colibri: {a.src}: a GGUF's experts keep the blocks it was published with; --quant does not "
              f"apply (--dense-quant sets the resident weights)", file=sys.stderr)
        return 2
    quant = a.quant or "int8"
    try:
        if gguf:
            dst = convert_gguf(a.src, a.dst, overwrite=a.overwrite, dense_quant=a.dense_quant or "int8",
                               group_size=a.group_size, progress=_progress_printer("importing GGUF"))
        else:
            dst = convert_checkpoint(a.src, a.dst, quant=quant, overwrite=a.overwrite, group_size=a.group_size,
                                     dense_quant=a.dense_quant, expert_layout=a.expert_layout,
                                     progress=_progress_printer(f"converting ({quant})"))
    except KeyboardInterrupt:  # the converter removed its partial folder on the way out
        from .models import end_progress_line
        end_progress_line()
        print(f"colibri: interrupted; no store was written to {a.dst}", file=sys.stderr)
        return 130
    print(f"store written to {dst} in {time.perf_counter() - t0:.1f} s")
    if not (Path(dst) / "tokenizer.json").exists():
        print(f"note: {a.src} has no tokenizer.json, so the store cannot chat or take a text prompt; copy the "
              f"model's tokenizer.json (and tokenizer_config.json) into {dst}", file=sys.stderr)
    return 0


def _gguf_types(m: dict) -> str:
    """The expert block types of a GGUF-born store's manifest, e.g. "Q4_K, Q6_K"."""
    types = (m.get("gguf") or {}).get("expert_types") or []
    return ", ".join(sorted({t for row in types for t in row if isinstance(t, str)})) or "GGUF"


def describe_store(path: str, context_length: int = 0) -> str:
    """A few lines describing a converted store (``colibri info``): family, MoE and dense
    layers, shared expert, experts and top-k, slab bytes, and the RAM estimate of the one
    sizing rule (engine.sizing) at ``context_length`` tokens (0 = the engine's default).
    Raises StoreError; ConfigError for a context length `colibri run` would refuse (negative,
    beyond the settings range or the model's max_position_embeddings)."""
    from ..config import describe_model
    from ..expert_store import ExpertStore
    from ..settings import check_context_length
    from ..sizing import estimate_store
    from ..units import format_bytes
    with ExpertStore(path, o_direct=False) as st:
        m, a = st.manifest, st.args
        L, M = a.num_hidden_layers, a.num_moe_layers
        n_exp = M * a.num_experts
        context_length = check_context_length(context_length, a.max_position_embeddings, str(path))
        est = estimate_store(a, m, context_length)
        dense_layers = sorted(set(range(L)) - set(a.moe_layers))
        lines = [
            f"store       {st.path}",
            f"model       {m.get('model_name')}, converted {m.get('created')} from {m.get('source')}",
            f"family      {describe_model(a)}",
            f"layers      {L} transformer layers: {M} MoE (routed experts)"
            + (f", {len(dense_layers)} dense MLP (layers {', '.join(map(str, dense_layers))}, resident, width "
               f"{a.intermediate_size})"
               if dense_layers else ", none dense")
            + f"; hidden {a.hidden_size}, " + _attention_text(a),
            (f"KV cache    {a.kv_values_all_layers} values per token over the {L} layers: a sliding key row of "
             f"{a.head_dim} (one shared K = V head) per layer, the compressor inputs and 1 / m of an entry on the "
             f"compressed layers" if getattr(a, "hc_mult", 0) else
             f"KV cache    {_kv_per_layer_text(a)}")
            + (f" + {a.index_head_dim} indexer-key values on the {len(a.indexer_layers)} layers with an indexer"
               if getattr(a, "indexer_layers", ()) else "")
            + f" ({format_bytes(a.kv_values_all_layers * 4)} per token of context at f32, "
            f"{format_bytes(a.kv_values_all_layers * 2)} at f16"
            + (f", in the {_layers(a.num_kv_layers, 'full-attention')}; recurrent state of the "
               f"{_layers(L - a.num_kv_layers, _recurrent_kind(a))} {format_bytes(a.recurrent_state_bytes)} (live + prefix snapshot, "
               f"float32, any context)" if a.recurrent_state_bytes else "") + ")",
            f"experts     {a.num_experts} per MoE layer, top-{a.num_experts_per_tok} routed per token, width "
            f"{a.moe_intermediate_size}, norm_topk_prob {a.norm_topk_prob}, router {a.scoring_func}"
            + (f" in {a.n_group} groups (best {a.topk_group} kept, {a.topk_method})" if a.n_group > 1 else "")
            + (", e_score_correction_bias for the choice" if a.router_bias else "")
            + (f", routed_scaling_factor {a.routed_scaling_factor:g}" if a.routed_scaling_factor != 1.0 else "")
            + _expert_kind_text(a),
            "shared      " + (("one shared expert per MoE layer, width" if getattr(a, "n_shared_experts", 1) <= 1
                               else f"{a.n_shared_experts} shared experts per MoE layer, total width")
                              + f" {a.shared_expert_intermediate_size} "
                              f"(resident, computed every token{', gated' if a.shared_expert_gated else ''})"
                              if a.shared_expert_intermediate_size else "none")
            + (f"; a dense GeGLU MLP of width {a.intermediate_size} runs beside the experts in every layer "
               f"(resident)" if _is_gemma4(a) else ""),
            f"vocab       {a.vocab_size}, context {a.max_position_embeddings}",
            f"quant       experts {m['quant']}" + (f" (group {m['group_size']})" if m.get("group_size") else "")
            + (f" ({_gguf_types(m)} blocks as published)" if m["quant"] == "gguf" else "")
            + f", dense {m['dense_quant']}"
            + (", experts stored row-interleaved by 4" if m.get("expert_layout") == "interleaved_4" else ""),
            f"expert slab {format_bytes(st.slot_bytes)} each (one {m['alignment']}-byte-aligned read), "
            f"{n_exp} routed experts = {format_bytes(n_exp * st.slot_bytes)} on disk",
            f"dense       {format_bytes(est.dense_bytes)} resident ({format_bytes(m['dense_bytes'] - est.dense_bytes)} "
            f"of token embeddings read from the store row by row)",
            f"RAM         at least {format_bytes(est.ram_needed)} at {est.context_length} tokens (dense "
            f"{format_bytes(est.dense_bytes)} + KV {format_bytes(est.kv_bytes)} + one slot per MoE layer {format_bytes(est.slots_bytes)} + reserve "
            f"{format_bytes(est.reserve_bytes)}); every expert in RAM: {format_bytes(est.all_in_ram_bytes)}",
        ]
        lines.insert(5, "rope        " + _rope_text(a))
        if getattr(a, "indexer_layers", ()) and a.index_topk >= est.context_length:
            lines.append(f"note        index_topk {a.index_topk} >= the context {est.context_length} tokens: "
                         f"every query attends every past token, so attention is dense at this context "
                         f"(the indexer only picks among fewer tokens than it may keep)")
        if not (Path(st.path) / "tokenizer.json").exists():
            lines.append(f"warning     the store has no tokenizer.json: it cannot take a text prompt or chat; copy "
                         f"the model's tokenizer.json (and tokenizer_config.json) into {st.path}")
        return "\n".join(lines)


def _rope_text(a) -> str:
    """The rotary embedding line of ``colibri info``: theta, then YaRN's parameters or "no scaling"
    ("none" for a model whose attention has no rotary embedding: Kimi-Linear, NoPE Granite)."""
    if getattr(a, "use_rope", True) is False:
        return "none (attention without rotary embeddings)"
    if getattr(a, "hc_mult", 0):  # DeepSeek-V4: plain RoPE on sliding layers, its own on compressed ones
        return (f"theta {a.rope_theta:g} on the sliding layers, no scaling; compressed layers and their "
                f"compressors: " + _theta_text(a.compress_rope_theta, a.compress_rope_scaling))
    return _theta_text(getattr(a, "rope_theta", 0), getattr(a, "rope_scaling", ()))


def _theta_text(theta: float, scaling) -> str:
    text = f"theta {theta:g}"
    sc = dict(scaling or ())
    if not sc:
        return text + ", no scaling (plain RoPE)"
    text += (f", YaRN scaling factor {sc.get('factor', 1.0):g} (original context "
             f"{int(sc.get('original_max_position_embeddings', 0))}, beta_fast {sc.get('beta_fast', 32.0):g}, "
             f"beta_slow {sc.get('beta_slow', 1.0):g}")
    text += "".join(f", {k} {sc[k]:g}" for k in ("mscale", "mscale_all_dim", "attention_factor") if k in sc)
    return text + ")"


def _attention_text(a) -> str:
    """The attention part of ``colibri info``'s layers line."""
    if getattr(a, "hc_mult", 0):  # DeepSeek-V4
        kinds = {t: sum(1 for x in a.layer_types if x == t) for t in set(a.layer_types)}
        parts = [f"{_layers(kinds.get('sliding_attention', 0), 'sliding')} (window {a.sliding_window})",
                 f"{_layers(kinds.get('compressed_sparse_attention', 0), 'compressed sparse')} (every "
                 f"{a.csa_rate} positions, the indexer keeps {a.index_topk}: index_n_heads {a.index_n_heads}, "
                 f"index_head_dim {a.index_head_dim})",
                 f"{_layers(kinds.get('heavily_compressed_attention', 0), 'heavily compressed')} (every "
                 f"{a.hca_rate} positions)"]
        hashed = sum(1 for x in a.mlp_layer_types if x == "hash_moe")
        return (f"heads {a.num_attention_heads} over one shared K = V head of {a.head_dim} (rotary {a.qk_rope_head_dim}, "
                f"interleaved), attention sinks, q LoRA rank {a.q_lora_rank}, grouped output projection ({a.o_groups} "
                f"groups of rank {a.o_lora_rank}); {a.hc_mult} residual streams (hyper-connections); "
                + ", ".join(parts) + f"; {_layers(hashed, 'hash-routed')}, sqrt-softplus routing, SwiGLU clamped "
                f"at {a.swiglu_limit:g}")
    if getattr(a, "kv_lora_rank", 0):
        q = f"q LoRA rank {a.q_lora_rank}" if a.q_lora_rank else "plain q_proj"
        if getattr(a, "linear_layers", ()):  # Kimi-Linear: KDA layers around NoPE latent attention
            return (f"{_layers(len(a.full_layers), 'multi-head latent attention')} (heads {a.num_attention_heads}, "
                    f"no RoPE, kv_lora_rank {a.kv_lora_rank}, qk_nope_head_dim {a.qk_nope_head_dim}, "
                    f"qk_rope_head_dim {a.qk_rope_head_dim}, v_head_dim {a.v_head_dim}, {q}; latent KV cache), "
                    f"{_layers(len(a.linear_layers), 'Kimi Delta Attention linear-attention')} "
                    f"({a.linear_num_heads} heads of {a.linear_head_dim}, conv {a.linear_conv_kernel_dim})")
        out = (f"heads {a.num_attention_heads}, multi-head latent attention (kv_lora_rank {a.kv_lora_rank}, "
               f"qk_rope_head_dim {a.qk_rope_head_dim}, qk_nope_head_dim {a.qk_nope_head_dim}, v_head_dim "
               f"{a.v_head_dim}, {q}); latent KV cache")
        if getattr(a, "indexer_layers", ()):
            L = a.num_hidden_layers
            shared = L - len(a.indexer_layers)
            out += (f"; sparse attention: each query attends the index_topk {a.index_topk} past tokens its "
                    f"indexer picks (index_n_heads {a.index_n_heads}, index_head_dim {a.index_head_dim}"
                    + (f"; {shared} of {L} layers reuse the previous layer's choice" if shared else "") + ")")
        return out
    if _is_gemma4(a):
        return _gemma4_attention_text(a)
    rot = f", rotary {a.rotary_dim} of {a.head_dim}" if a.rotary_dim and a.rotary_dim != a.head_dim else ""
    extra = {"head": ", q/k RMSNorm per head", "proj": ", q/k RMSNorm over the projection"}.get(
        getattr(a, "qk_norm", "none"), "")
    extra += ", q/k/v biases" if getattr(a, "attention_bias", False) else ""
    extra += ", attention sinks" if a.model_type == "gpt_oss" else ""
    text = f"heads {a.num_attention_heads} (KV heads {a.num_key_value_heads}, head size {a.head_dim}{rot}{extra})"
    if getattr(a, "rope_layers", ()):  # Llama 4
        text += _llama4_layers_text(a)
    text += _windows_text(a)
    if getattr(a, "conv_layers", ()):  # LFM2: gated short convolutions between the attention layers
        text = (f"{_layers(len(a.full_layers), 'attention')} ({text}), "
                f"{_layers(len(a.conv_layers), 'gated short-convolution')} ({a.conv_L_cache} taps)")
    if getattr(a, "mamba_layers", ()):  # Granite 4.0 hybrids
        text = (f"{_layers(len(a.full_layers), 'attention')} ({text}"
                + ("" if a.use_rope else ", no RoPE") + f"), {_layers(len(a.mamba_layers), 'Mamba2')} "
                f"({a.mamba_n_heads} heads of {a.mamba_d_head}, {a.mamba_n_groups} groups, state {a.mamba_d_state}, "
                f"conv {a.mamba_d_conv})")
    if getattr(a, "linear_layers", ()):
        text = (f"{_layers(len(a.full_layers), 'gated full-attention')} ({text}), "
                f"{_layers(len(a.linear_layers), 'Gated DeltaNet linear-attention')} ({a.linear_num_key_heads} key / {a.linear_num_value_heads} value heads "
                f"of {a.linear_key_head_dim} / {a.linear_value_head_dim}, conv {a.linear_conv_kernel_dim})")
    return text


def _layer_list(idx) -> str:
    """'layer 3' / 'layers 0, 2, 4'."""
    idx = list(idx)
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(map(str, idx))


def _is_gemma4(a) -> bool:
    return a.model_type in ("gemma4_text", "gemma4")


def _windows_text(a) -> str:
    """The sliding-window and full-attention layers of ``layer_windows`` ('' when every layer
    attends causally to everything)."""
    w = tuple(getattr(a, "layer_windows", ()) or ())
    slid = [i for i, x in enumerate(w) if x]
    if not slid:
        return ""
    sizes = " / ".join(map(str, sorted({w[i] for i in slid})))
    if len(slid) == len(w):
        return f"; every layer attends a sliding window of {sizes} tokens"
    full = [i for i, x in enumerate(w) if not x]
    return (f"; {_layers(len(slid), 'sliding-window')} (window {sizes} tokens: {_layer_list(slid)}), "
            f"{_layers(len(full), 'full-attention')} ({_layer_list(full)})")


def _llama4_layers_text(a) -> str:
    """Llama 4's RoPE layers (chunked attention, weightless q/k norms) and NoPE layers."""
    rope = [i for i, r in enumerate(a.rope_layers) if r]
    nope = [i for i, r in enumerate(a.rope_layers) if not r]
    norm = ", q/k RMS-normalised per head without a weight" if a.use_qk_norm else ""
    if a.attention_chunk_size:
        kind = _layers(len(rope), "chunked-attention RoPE")
        how = f"each query sees its own chunk of {a.attention_chunk_size} tokens"
    else:
        kind, how = _layers(len(rope), "RoPE"), "causal over all tokens"
    text = f"; {kind} ({how}{norm}" + (f": {_layer_list(rope)}" if nope else "") + ")"
    if nope:
        temp = (f", q scaled by the position temperature (attn_scale {a.attn_scale:g}, floor_scale "
                f"{a.floor_scale:g})" if a.attn_temperature_tuning else "")
        text += (f", {_layers(len(nope), 'NoPE')} (causal over all tokens, no rotary embedding{temp}: "
                 f"{_layer_list(nope)})")
    return text


def _gemma4_attention_text(a) -> str:
    """Gemma 4's two attention kinds, each with its own KV heads, head size and RoPE."""
    slid = [i for i, x in enumerate(a.layer_windows) if x]
    full = [i for i, x in enumerate(a.layer_windows) if not x]
    win = " / ".join(map(str, sorted({a.layer_windows[i] for i in slid})))
    parts = []
    if slid:
        parts.append(f"{_layers(len(slid), 'sliding-window')} (window {win} tokens: KV heads "
                     f"{a.num_key_value_heads}, head size {a.head_dim}, RoPE theta {a.rope_theta:g}; "
                     f"{_layer_list(slid)})")
    if full:
        rope = (f"RoPE theta {a.full_rope_theta:g} on {a.full_rotary_angles} of {a.full_head_dim // 2} frequencies"
                + (f", factor {a.full_rope_factor:g}" if a.full_rope_factor != 1.0 else ""))
        parts.append(f"{_layers(len(full), 'full-attention')} (KV heads {a.full_kv_heads}, head size "
                     f"{a.full_head_dim}" + (", K = V (no v_proj)" if a.attention_k_eq_v else "")
                     + f", {rope}; {_layer_list(full)})")
    cap = (f"; logits soft-capped at {a.final_logit_softcapping:g}" if a.final_logit_softcapping else "")
    return (f"heads {a.num_attention_heads}, q/k RMSNorm per head, v without a weight, score scale 1; "
            + ", ".join(parts) + cap)


def _kv_per_layer_text(a) -> str:
    """The KV cache values per token: one count for every layer, or one per layer kind."""
    if _is_gemma4(a):
        kinds = {}
        for i in range(a.num_hidden_layers):
            h, d = a.layer_shape(i)
            kinds.setdefault(("sliding-window" if a.layer_windows[i] else "full-attention", 2 * h * d), []).append(i)
        return ", ".join(f"{v} values per token on each {k} layer ({len(ls)} of them)" for (k, v), ls in kinds.items())
    return f"{a.kv_values_per_token} values per token and layer"


def _recurrent_kind(a) -> str:
    """What the recurrent layers of a hybrid family are, for the KV cache line."""
    if getattr(a, "conv_layers", ()):
        return "gated short-convolution"
    if getattr(a, "mamba_layers", ()):
        return "Mamba2"
    return "linear-attention"


def _expert_kind_text(a) -> str:
    """How a family's experts differ from plain SwiGLU experts weighed by their router scores."""
    if _is_gemma4(a):
        return ", GeGLU experts (tanh GELU) scaled by per_expert_scale"
    if getattr(a, "rope_layers", ()):  # Llama 4
        return ", the sigmoid of each chosen logit scales the expert's input"
    if a.model_type == "gpt_oss":
        return f", SwiGLU clamped at {a.swiglu_limit:g} (alpha {a.swiglu_alpha:g}), expert biases"
    return ""


def cmd_info(a) -> int:
    """``colibri info STORE``."""
    print(describe_store(resolve_model_name(a.store), a.context_length))
    return 0


def add_parsers(sub) -> None:
    """Add ``run``, ``convert`` and ``info`` to the ``colibri`` argparse subparsers ``sub``."""
    r = sub.add_parser("run", help="generate from a prompt, streaming to stdout")
    r.add_argument("--model", help="converted store (default: the bundled model)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--system", default="", help="system prompt (chat models)")
    r.add_argument("--raw", action="store_true", help="raw mode: no chat template, the prompt is plain text for the "
                   "model to continue (special tokens in it are recognised; --system is not used)")
    r.add_argument("--prof", action="store_true", help="print a closing profile (hit rate, MB/token, felt wait)")
    r.add_argument("--trace", help="record routing and PILOT predictions to this file")
    r.add_argument("--trace-logits", action="store_true", help="also record router and PILOT predictor logits "
                   "in the trace (drives `colibri bench overlap --routing realistic`)")
    add_setting_flags(r, SAMPLING)
    add_setting_flags(r, ENGINE)
    r.set_defaults(fn=cmd_run)

    from ..models import FAMILY_NAMES
    c = sub.add_parser("convert", help="convert a Hugging Face MoE folder or a GGUF model into a store",
                       description=f"Convert a Hugging Face MoE folder ({', '.join(FAMILY_NAMES.values())}) "
                                   f"or a GGUF model (a .gguf file, a split's parts, or a folder holding them) "
                                   f"into a store.")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--quant", choices=("int8", "int4", "f16", "f32", "mxfp4"), default=None,
                   help="expert quantization (default int8); mxfp4 keeps an MXFP4 checkpoint's experts (gpt-oss) "
                        "as they are; a GGUF's experts always keep their published blocks")
    c.add_argument("--group-size", type=int, default=32, help="int4 group size")
    c.add_argument("--dense-quant", choices=("int8", "int4", "f16", "f32"), default=None,
                   help="resident dense weights; int4 = attention int4, embedding and lm_head int8 "
                        "(default: int8 for int8/int4 stores, else the --quant)")
    from ..store_format import EXPERT_LAYOUTS  # convert's choices, without importing the converter
    c.add_argument("--expert-layout", choices=("auto",) + EXPERT_LAYOUTS, default="auto",
                   help="int4 expert weights row-interleaved by 4 (interleaved_4: the decode kernels' fastest "
                        "read) or row_major; auto (default): interleaved_4 for int4 with group size 32 and "
                        "widths that are multiples of 64 on a CPU with the SIMD int4 kernels, else row_major. "
                        "The outputs are bit-identical either way")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(fn=cmd_convert)

    i = sub.add_parser("info", help="describe a converted store")
    i.add_argument("store")
    i.add_argument("--context-length", type=int, default=0,
                   help="tokens of KV cache for the RAM estimate (default: the engine's default)")
    i.set_defaults(fn=cmd_info)
