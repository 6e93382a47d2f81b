"""The int8 store's KL on TRAINED weights: mean KL <= 1e-3 against transformers' own models.

test_deepseek_glm_parity.py and test_dsa_parity.py measure the int8 KL on random weights, where
the rounding itself (transformers with an independently rounded copy, fake_quantized_copy)
already costs 1.5e-3..3.8e-2 nats for DeepSeek-V3, GLM-4.7-Flash and the sparse-attention
models, so the 1e-3 bound cannot hold there. Here each of those models (the same tiny
configurations, imported from those files) is trained briefly by torch on real text: bytes
(vocab 256) of Python standard-library source, AdamW, warmup + cosine, seeded, one thread, with
DeepSeek-V3's auxiliary-loss-free balancing (the routers' e_score_correction_bias nudged towards
even expert load after each step, so the bias is not left at zero). The sparse-attention
indexer is computed by transformers under no_grad (the LM loss never reaches it), so it is
trained as DeepSeek-V3.2 trains it: a KL loss towards the main attention (summed over heads) on
detached inputs, over all causal positions in a dense warm-up (index_topk widened) and then over
the selected tokens with the sparse attention on. The model is saved with save_pretrained,
converted to int8, and the teacher-forced mean KL(transformers f32 || our int8 store, with its
default f16 KV cache) is measured on held-out text from other modules: <= 1e-3. The held-out
loss must be well below uniform (the test is about a trained model), and the rounded-weights KL
of transformers itself is reported beside ours.
"""

from __future__ import annotations

import importlib
import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import test_deepseek_glm_parity as mla_tests  # noqa: E402
import test_dsa_parity as dsa_tests  # noqa: E402
from engine import convert_checkpoint  # noqa: E402
from parity_helpers import fake_quantized_copy, hf_logits, kl, teacher_forced_agreement  # noqa: E402

pytestmark = pytest.mark.parity

V = 256
TRAIN_MODULES = ("collections", "argparse", "json.decoder", "json.encoder", "functools", "textwrap", "string",
                 "shlex", "fractions", "heapq", "bisect", "contextlib", "dataclasses", "enum")
HELD_OUT_MODULES = ("calendar", "difflib")
T = 128           # training and evaluation window (several times index_topk 8 / 11)
BATCH = 4
EVAL_WINDOWS = 4  # held-out windows of T bytes: 512 teacher-forced positions


def _bytes_of(modules) -> np.ndarray:
    src = "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)
    return np.frombuffer(src.encode("utf-8"), np.uint8).astype(np.int64)


def _held_out_windows() -> list[list[int]]:
    ev = _bytes_of(HELD_OUT_MODULES)
    starts = np.linspace(0, len(ev) - T, EVAL_WINDOWS + 2).astype(int)[1:-1]
    return [ev[s:s + T].tolist() for s in starts]


def _index_scores(ix, hidden, q_resid, pos_emb, mask):
    """The indexer's scores [B, S, T] with gradients: transformers' GlmMoeDsaIndexer /
    DeepseekV32Indexer forward (which runs under no_grad and returns only the top-k) up to the
    top-k, the RoPE variant taken from the indexer's own module. Checked against its choice."""
    mod = importlib.import_module(type(ix).__module__)
    rope = mod.apply_rotary_pos_emb_interleave if "glm" in type(ix).__name__.lower() else mod.apply_rotary_pos_emb
    B, S, _ = hidden.shape
    cos, sin = pos_emb
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    w = ix.weights_proj(hidden).float() * ix.n_heads ** -0.5
    s = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask


def train(cfg_cls: str, model_cls: str, config: dict, steps: int, lr: float = 3e-3, seed: int = 0):
    """A transformers model trained on the standard-library bytes (see the module docstring)."""
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**config)
    cfg._attn_implementation = "eager"
    m = getattr(transformers, model_cls)(cfg)
    data = _bytes_of(TRAIN_MODULES)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    routers = [mod for n, mod in m.named_modules() if n.endswith(".gate") and hasattr(mod, "e_score_correction_bias")]
    load = {}
    hooks = [r.register_forward_hook(lambda mod, inp, out: load.__setitem__(
        mod, torch.bincount(out[2].flatten(), minlength=mod.e_score_correction_bias.numel()).float())) for r in routers]
    indexers = [mod for n, mod in m.named_modules() if n.endswith(".indexer") and mod is not None]
    seen = {}  # indexer -> (inputs, its top-k)
    hooks += [ix.register_forward_hook(lambda mod, args, out: seen.__setitem__(mod, (args, out)))
              for ix in indexers]
    topk = {ix: ix.index_topk for ix in indexers}
    warmup = steps // 3 if indexers else 0
    log = {"lm": [], "indexer": []}  # per step: the LM loss, the indexer KL summed over layers
    m.train()
    try:
        for step in range(steps):
            for ix in indexers:  # dense warm-up: every causal position selected
                ix.index_topk = 1 << 30 if step < warmup else topk[ix]
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
            x = torch.tensor(np.stack([data[s:s + T] for s in rng.integers(0, len(data) - T, BATCH)]))
            out = m(x, labels=x, output_attentions=bool(indexers))
            loss = out.loss
            log["lm"].append(float(loss.detach()))
            ix_loss = torch.zeros(())
            for li, layer in enumerate(m.model.layers):
                ix = getattr(layer.self_attn, "indexer", None)
                if ix is None:
                    continue
                (hidden, q_resid, pos_emb, mask, *_), chosen = seen[ix]
                s = _index_scores(ix, hidden.detach(), q_resid.detach(), tuple(p.detach() for p in pos_emb), mask)
                if step == 0 or step == warmup:  # our copy of the indexer selects what transformers' does
                    sel = s.detach().topk(chosen.shape[-1], dim=-1).indices.sort(-1).values
                    assert torch.equal(sel, chosen.long().sort(-1).values), li
                target = out.attentions[li].detach().float().sum(1)
                target = target / target.sum(-1, keepdim=True)
                picked = torch.zeros_like(s, dtype=torch.bool).scatter(-1, chosen.long(), True)
                logq = torch.log_softmax(s.masked_fill(~picked, float("-inf")), -1)
                ix_loss = ix_loss + (target * (torch.log(target.clamp_min(1e-30)) - logq.masked_fill(target == 0, 0))
                                     ).sum(-1).mean()
            log["indexer"].append(float(ix_loss.detach()))
            loss = loss + ix_loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            with torch.no_grad():  # DeepSeek-V3's bias update: towards even load
                for r in routers:
                    c = load[r]
                    r.e_score_correction_bias += 1e-3 * torch.sign(c.mean() - c)
    finally:
        for h in hooks:
            h.remove()
        for ix in indexers:
            ix.index_topk = topk[ix]
    m.training_log = log
    return m.eval()


def _config(name):
    mod = mla_tests if name in mla_tests.CONFIGS else dsa_tests
    cfg_cls, model_cls, kw = mod.CONFIGS[name]
    return cfg_cls, model_cls, {**mod.BASE, **kw}


CASES = [  # name, training steps
    pytest.param("dsv3-qproj-onegroup", 150, id="dsv3-qproj-onegroup"),
    pytest.param("dsv3-dense-groups-yarn", 150, id="dsv3-dense-groups-yarn"),
    pytest.param("glm-lite-qlora-groups", 150, id="glm-lite-qlora-groups"),
    pytest.param("glm5-dense-shared", 150, id="glm5-dense-shared"),
    pytest.param("dsv32-allmoe-yarn", 150, id="dsv32-allmoe-yarn"),
]


@pytest.mark.parametrize("name,steps", CASES)
def test_int8_kl_on_trained_weights(tmp_path, name, steps, record_property):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = train(*_config(name), steps=steps)
        windows = _held_out_windows()
        ref = [hf_logits(m, ids) for ids in windows]
        held_out = float(np.mean([torch.nn.functional.cross_entropy(torch.tensor(r[:-1]), torch.tensor(ids[1:]))
                                  for r, ids in zip(ref, windows)]))
        d = tmp_path / name
        m.save_pretrained(d)
        store = convert_checkpoint(d, tmp_path / f"{name}-int8", quant="int8")
        res = [teacher_forced_agreement(m, store, V, ids=ids) for ids in windows]
        ours, top1 = float(np.mean([r[0] for r in res])), float(np.mean([r[1] for r in res]))
        mq = fake_quantized_copy(m, "int8")
        rounded = float(np.mean([kl(r, hf_logits(mq, ids)).mean() for r, ids in zip(ref, windows)]))
    finally:
        torch.set_num_threads(threads)
    record_property("mean_kl", ours)
    record_property("rounded_kl", rounded)
    record_property("held_out_loss", held_out)
    print(f"{name} trained {steps} steps: held-out loss {held_out:.3f} nats (uniform {math.log(V):.3f}); int8 mean KL "
          f"{ours:.2e} nats (transformers with rounded weights {rounded:.2e}), top-1 agreement {top1:.3f}")
    assert held_out < 0.6 * math.log(V)  # trained: well below uniform
    assert ours <= 1e-3  # the bound
    assert top1 >= 0.95
