"""Multi-token-prediction (MTP / next-n) heads: kept by the converter, used as speculative drafters.

DeepSeek-V3 (``num_nextn_predict_layers``), GLM-4.5 and the sparse-attention families
(DeepSeek-V3.2, GLM-5) publish next-n layers after the decoder, checkpoint layers
``model.layers.{L}.*`` with L = num_hidden_layers; Qwen3-Next
(``mtp_num_hidden_layers``) publishes them as ``mtp.*``. Each family says how in its
``MTP_HEAD`` (engine/models/tensors.py ``HeadLayout``). The head as vLLM runs it
(vllm/model_executor/models/deepseek_mtp.py, glm4_moe_mtp.py, qwen3_next_mtp.py; transformers does
not implement it and drops the layer when it loads):

    e  = enorm(embed(t[q+1]))      (DeepSeek / GLM: the embedding of position 0 zeroed)
    h  = hnorm(norm(x_main[q]))    (the main model's final hidden state at q, after its final norm)
    y  = block(eh_proj([e ; h]), position q)   (one decoder layer of the family: attention with
                                                its own KV cache, routed + shared experts;
                                                Qwen3-Next's a full-attention layer; a DSA
                                                family's runs its own indexer and index-key
                                                cache: the head's model has no earlier layer)
    logits(t[q+2]) = shared_head.head(shared_head.norm(y))

Qwen3-Next's names: enorm = mtp.pre_fc_norm_embedding, hnorm = mtp.pre_fc_norm_hidden, eh_proj =
mtp.fc, shared_head.norm = mtp.norm (zero-centred norms, as its decoder's), the block
mtp.layers.0.*, the head the main lm_head.

Drafting k tokens chains the head (vLLM's method for a model with one next-n layer): after the
row of the last fed position p0 - 1 drafts d1, the row at p0 takes (y, embed(d1)) instead of
(x_main[p0], embed(t[p0+1])) and drafts d2, and so on. The chained rows' KV entries are
positional and rewritten when the true rows reach them.

The store keeps the first next-n layer (``mtp_layers`` = 1 in the manifest): its dense tensors
as ``layers.{L}.*`` (the family's own names) and ``mtp.0.{enorm, hnorm, eh_proj,
shared_head.norm}``; its routed experts as the expert table's last row, read through the same
expert cache as the decoder's (``ModelArgs.mtp_layers``: the row is listed in ``moe_layers``).
The head's copies of ``embed_tokens`` and ``shared_head.head`` are the main model's in the
published checkpoints (vLLM loads one embedding for every next-n layer); the main model's are
used, the copies are left out with a message. Further next-n layers are left out too (the
published runtimes chain the first).

Drafts are greedy (the head's argmax): a deterministic drafter, so the engine's verify rule
keeps the output exactly that of plain decoding (engine/speculative.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .errors import StoreError
from .models import FAMILIES, build_model
from .models.base import K, PREFILL_CHUNK, Linear, Tensor
from .speculative import PromptLookup

HEAD_TENSORS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")  # the head's own, by their store names


# families that publish next-n layers: their MTP_HEAD (engine/models/tensors.py HeadLayout)
LAYOUTS = {mt: fam.MTP_HEAD for mt, fam in FAMILIES.items() if getattr(fam, "MTP_HEAD", None) is not None}
HEAD_FAMILIES = tuple(LAYOUTS)


def head_names(args, k: int = 0) -> dict:
    """Store name -> checkpoint name of next-n layer k's own tensors (HEAD_TENSORS), for a family
    in LAYOUTS."""
    lay = LAYOUTS[args.model_type]
    block = lay.prefix(args.num_hidden_layers, k)
    return {ours: hf.format(block=block) for ours, hf in zip(HEAD_TENSORS, lay.names)}


def block_prefix(args, i: int) -> str:
    """The checkpoint prefix of transformer layer ``i``: a kept next-n layer's block (i >= the
    decoder's layers) as its family publishes it, else ``model.layers.{i}.``."""
    return LAYOUTS[args.model_type].block_prefix(args, i) if args.model_type in LAYOUTS else f"model.layers.{i}."
PENDING_ROWS = 256  # the drafter's unprocessed hidden rows kept at most (a long prefill runs through in chunks)


def kept_heads(args, names) -> int:
    """Next-n layers a conversion keeps: 1 when ``args`` is of a family with heads, config.json
    says it has some (``num_nextn_predict_layers``) and the checkpoint tensor names ``names``
    (a container) hold the first one's head tensors and its block's resident tensors (a DSA
    block's indexer among them); else 0."""
    if args.model_type not in HEAD_FAMILIES or getattr(args, "num_nextn_predict_layers", 0) < 1:
        return 0
    need = [t.hf for t in head_tensors(FAMILIES[args.model_type], with_heads(args, 1))]
    return 1 if all(n in names for n in need) else 0


def _block_fields(lay, args, layers: tuple) -> dict:
    """The per-layer fields of ``args`` that give the next-n blocks ``layers`` (transformer layer
    numbers) their type: ``layer_types`` (typed families), ``indexer_layers`` (a DSA block runs
    its own indexer). ``layers`` is appended to the decoder's when they follow it, else (a
    one-layer model of the block) replaces them."""
    n, own = len(layers), layers[0] == 0
    out = {}
    if lay.block_types:
        out["layer_types"] = lay.block_types * n if own else tuple(args.layer_types) + lay.block_types * n
    if lay.block_indexer:
        out["indexer_layers"] = layers if own else tuple(args.indexer_layers) + layers
    return out


def with_heads(args, n: int):
    """``args`` with ``n`` next-n layers kept: their transformer layers L.. appended to
    ``moe_layers`` (expert rows M..), ``mtp_layers`` = n. ``n`` = 0 returns ``args``."""
    if not n:
        return args
    L = args.num_hidden_layers
    return replace(args, mtp_layers=n, moe_layers=tuple(args.moe_layers) + tuple(range(L, L + n)))


def store_args(args, manifest: dict, path) -> object:
    """The ModelArgs of a store whose manifest says ``mtp_layers``: :func:`with_heads`.

    Raises:
        StoreError: naming ``path``, when the count is not 0 or 1, or the family or its
            config.json has no next-n layer.
    """
    n = manifest.get("mtp_layers", 0)
    if n == 0:
        return args
    if (type(n) is not int or n != 1 or args.model_type not in HEAD_FAMILIES
            or getattr(args, "num_nextn_predict_layers", 0) < 1):
        key = LAYOUTS[args.model_type].count_key if args.model_type in LAYOUTS else "num_nextn_predict_layers"
        raise StoreError(f"{path}: mtp_layers {n!r} does not match config.json ({args.model_type}, "
                         f"{key} {getattr(args, 'num_nextn_predict_layers', 0)}); "
                         f"re-run `colibri convert --overwrite`")
    return with_heads(args, n)


def head_tensors(family, args) -> list[Tensor]:
    """The resident tensors of the kept next-n layers (``args.mtp_layers`` of them), checkpoint
    -> store names: the decoder block as the family names its layers (``layers.{L}.*``), then
    ``mtp.{k}.enorm`` / ``hnorm`` / ``shared_head.norm`` [D] (float32) and ``mtp.{k}.eh_proj``
    [D, 2D] (dense quantization). [] without heads."""
    n = args.mtp_layers
    if not n:
        return []
    L, D = args.num_hidden_layers, args.hidden_size
    lay = LAYOUTS[args.model_type]
    wide = replace(args, num_hidden_layers=L + n, mtp_layers=0,
                   layer_windows=tuple(args.layer_windows) + (0,) * n if args.layer_windows else (),
                   **_block_fields(lay, args, tuple(range(L, L + n))))
    out = []
    for t in family.dense_tensors(wide):
        for k in range(n):
            p = f"{lay.layers}{L + k}."
            if t.hf.startswith(p):  # the family's name for layer L + k -> the published block's
                out.append(t._replace(hf=lay.prefix(L, k) + t.hf[len(p):]))
    shapes = {"enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D), "shared_head.norm": (D,)}
    for k in range(n):
        out += [Tensor(hf, f"mtp.{k}.{ours}", shapes[ours], "quant" if ours == "eh_proj" else "keep")
                for ours, hf in head_names(args, k).items()]
    return out


def dense_tensors(family, args) -> list[Tensor]:
    """Every resident tensor of a store of ``args``: the family's, then the heads'."""
    return family.dense_tensors(args) + head_tensors(family, args)


class _RowShift:
    """The expert provider seen by the head's one-layer model: its MoE layer 0 is the provider's
    row ``row`` (the expert table's row after the decoder's)."""

    _LAYER_CALLS = ("prepare", "acquire", "release", "take_split", "slot_offsets", "prepare_split",
                    "acquire_many", "release_many", "release_slots", "dispatch")
    _SHARED = ("arena", "store", "slots")

    def __init__(self, inner, row: int):
        self._inner, self._row = inner, row
        for name in self._LAYER_CALLS:
            call = getattr(inner, name, None)
            if call is not None:
                setattr(self, name, lambda j, *a, _c=call, **kw: _c(j + row, *a, **kw))

    def __getattr__(self, name):
        if name in _RowShift._SHARED:
            return getattr(self._inner, name)
        raise AttributeError(name)


class MTPHead:
    """The first kept next-n layer of a model, as a one-layer model of its family sharing the
    main model's expert provider (its experts: the provider's row after the decoder's), the
    embedding and lm_head.

    Args:
        model: the main MoEModel (its args with ``mtp_layers`` >= 1). dense: the store's dense
            tensors (``layers.{L}.*`` and ``mtp.0.*`` among them). experts: the main model's
            provider. embed_rows: as the main model's (None: ``dense`` holds the table).
    """

    def __init__(self, model, dense: dict, experts, embed_rows=None):
        a = model.args
        L = a.num_hidden_layers
        self.model = model
        self.D = a.hidden_size
        self.eps = np.float32(a.rms_norm_eps)
        p = f"layers.{L}."
        sub = {"layers.0." + k[len(p):]: v for k, v in dense.items() if k.startswith(p)}
        sub.update({k: v for k, v in dense.items() if k.startswith(("lm_head.", "embed_tokens."))})
        sub["norm"] = dense["mtp.0.shared_head.norm"]
        lay = LAYOUTS[a.model_type]
        sub_args = replace(a, num_hidden_layers=1, moe_layers=(0,), mtp_layers=0,
                           layer_windows=(0,) if a.layer_windows else (), **_block_fields(lay, a, (0,)))
        self.zero_first = lay.zero_first
        self.block = build_model(sub_args, sub, model.dense_quant, model.expert_quant,
                                 _RowShift(experts, a.num_moe_layers - a.mtp_layers), model.C, model.gs,
                                 kv_dtype=model.kv_dtype, embed_rows=embed_rows)
        self.enorm, self.hnorm = dense["mtp.0.enorm"], dense["mtp.0.hnorm"]
        if lay.norm_one:  # zero-centred: the kernels multiply by w, the checkpoint holds w - 1
            self.enorm, self.hnorm = (np.asarray(w, np.float32) + np.float32(1.0) for w in (self.enorm, self.hnorm))
        self.eh_proj = Linear(dense, "mtp.0.eh_proj", model.dense_quant, model.gs)
        self.drafter = MTPDrafter(self)

    def main_hidden(self, x: np.ndarray) -> np.ndarray:
        """The main model's final hidden states (after its final norm) float32 [T, D] of its
        last layer's residual rows x [T, D]: what the head takes."""
        h = np.empty_like(x)
        K.rmsnorm(np.ascontiguousarray(x, dtype=np.float32), self.model.norm, self.eps, h)
        return h

    def step(self, ids, hidden: np.ndarray, pos0: int) -> np.ndarray:
        """Head rows at positions pos0..pos0+T-1: ``ids`` int [T] the tokens one position ahead
        (t[q+1] for row q), ``hidden`` float32 [T, D] the main model's final hidden states at q
        (:meth:`main_hidden`) or, chained, the head's output of the row before. Writes the
        head's KV rows; returns the head's output y float32 [T, D] (before shared_head.norm)."""
        ids = np.asarray(ids, dtype=np.int64)
        T, D = len(ids), self.D
        e = self.block.embed(ids)  # [T, D]
        if pos0 == 0 and self.zero_first:
            e[0] = 0.0  # the published runtime's input at position 0: no embedding
        eh = np.empty((T, 2 * D), np.float32)
        K.rmsnorm(e, self.enorm, self.eps, eh[:, :D])
        K.rmsnorm(np.ascontiguousarray(hidden, dtype=np.float32), self.hnorm, self.eps, eh[:, D:])
        y = self.eh_proj(eh, np.empty((T, D), np.float32))
        y += self.block.attention(0, y, pos0)
        y += self.block.mlp(0, y)
        return y

    def logits(self, y: np.ndarray) -> np.ndarray:
        """shared_head.head(shared_head.norm(y)): float32 [T, V] for head outputs y [T, D]."""
        return self.block.logits(y)


class MTPDrafter:
    """Drafts with an :class:`MTPHead` (``propose(context, k) -> list[int]``, as PromptLookup).

    Fed through the main model's ``hidden_sink`` (engine/models/base.py): each forward's last
    layer rows, kept until the tokens one position ahead of them are final; then the head's rows
    for them run (at a draft, or in chunks once PENDING_ROWS are waiting: a long prompt). The
    head's KV holds rows 0..valid-1 computed from final inputs; a forward that feeds another
    token at a position than the head last saw (a new prompt after prefix reuse) lowers it. A
    row whose hidden state was never seen (fed while the sink was off) keeps what it held: the
    drafts get worse, the output stays that of plain decoding.
    """

    def __init__(self, head: MTPHead):
        self.head = head
        self.forget()

    def forget(self) -> None:
        """Drop every row and hidden state: the head's KV is rebuilt from the next forwards."""
        self.valid = 0  # head rows 0..valid-1 are computed from final inputs
        self.hidden: dict[int, np.ndarray] = {}  # position -> the main model's last residual row [D]
        self.tokens: dict[int, int] = {}  # position -> the token fed there (final below `final`)
        self.final = 0  # tokens at positions < final are final
        self.last: tuple[int, np.ndarray] | None = None  # (q, head output row [D]) of the last row run

    def on_hidden(self, pos0: int, ids, x: np.ndarray, kept: int) -> None:
        """The main model's hook: rows x float32 [T, D] of tokens ``ids`` at pos0..; the first
        ``kept`` tokens are final (a verify's draft tokens are not yet)."""
        if self.tokens.get(pos0) != int(ids[0]):
            self.valid = min(self.valid, max(pos0 - 1, 0))  # row pos0 - 1 took another token
        for d in (self.hidden, self.tokens):
            for q in [q for q in d if q >= pos0]:
                del d[q]
        for t in range(len(ids)):
            self.hidden[pos0 + t] = np.array(x[t], dtype=np.float32)
            self.tokens[pos0 + t] = int(ids[t])
        self.final = pos0 + kept
        if len(self.hidden) > PENDING_ROWS:
            self._catch_up(self.final - 1)
            for q in sorted(self.hidden)[:max(0, len(self.hidden) - PENDING_ROWS)]:
                del self.hidden[q]  # not final yet and too many: their rows are skipped

    def _catch_up(self, end: int) -> None:
        """Run the head's rows valid..end-1 (each needs the hidden state at q and the final token
        at q + 1), in chunks; rows before a missing hidden state are skipped."""
        q0 = self.valid
        for q in range(end - 1, q0 - 1, -1):
            if q not in self.hidden or q + 1 not in self.tokens:
                q0 = q + 1
                break
        for c0 in range(q0, end, PREFILL_CHUNK):
            qs = range(c0, min(end, c0 + PREFILL_CHUNK))
            h = self.head.main_hidden(np.stack([self.hidden[q] for q in qs]))
            y = self.head.step([self.tokens[q + 1] for q in qs], h, c0)
            self.last = (qs[-1], y[-1].copy())
        if end > self.valid:
            self.valid = end
        for q in [q for q in self.hidden if q < end - 1]:
            del self.hidden[q]  # the row before `end` stays: a new prompt may take another token after it
        for q in [q for q in self.tokens if q < end - 1]:
            del self.tokens[q]

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``context`` (the prompt and answer so far; its last
        token is the one the next forward feeds, at position p0 = len(context) - 1), [] when the
        head's row at p0 - 1 cannot run (its hidden state was not seen)."""
        p0 = len(context) - 1
        if k <= 0 or p0 < 1:
            return []
        for q in range(max(self.valid, 0), p0 + 1):
            self.tokens[q] = int(context[q])
        for q in [q for q in self.hidden if q >= p0]:
            del self.hidden[q]  # a rejected draft's rows
        self._catch_up(p0)
        if self.last is None or self.last[0] != p0 - 1:
            return []
        y = self.last[1][None]
        draft = [int(np.argmax(self.head.logits(y)[0]))]
        for i in range(1, k):
            y = self.head.step([draft[-1]], y, p0 + i - 1)
            draft.append(int(np.argmax(self.head.logits(y)[0])))
        return draft


def open_head(model, manifest_heads: int, dense: dict, experts, embed_rows=None) -> MTPHead | None:
    """The model's MTPHead when its store keeps next-n layers (``manifest_heads`` >= 1), else None."""
    return MTPHead(model, dense, experts, embed_rows) if manifest_heads else None


def drafter_for(mode: str, model, head: MTPHead | None):
    """The drafter of setting ``speculation`` = ``mode`` for one generation: "mtp" the model's
    head (its hidden-state hook on the model), or prompt lookup where the model has none;
    "prompt_lookup" a PromptLookup; "off" None. A drafter other than the head's unhooks it and
    makes it forget its rows (the forwards it will not see leave them stale)."""
    if mode == "mtp" and head is not None:
        if model.hidden_sink != head.drafter.on_hidden:
            head.drafter.forget()
            model.hidden_sink = head.drafter.on_hidden
        return head.drafter
    if model.hidden_sink is not None:
        model.hidden_sink = None
        if head is not None:
            head.drafter.forget()
    return PromptLookup() if mode in ("mtp", "prompt_lookup") else None
