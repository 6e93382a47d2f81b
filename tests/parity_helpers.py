"""Helpers shared by the parity tests against transformers (test_parity.py for OLMoE,
test_families_parity.py for the other families)."""

from __future__ import annotations

import numpy as np
import torch

from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore
from engine.models import build_model


def open_model(store_dir, cap=None, context=256, kv_dtype="f16"):
    """(model, store, cache) over a converted store, all experts cached unless ``cap``; the KV
    cache at ``kv_dtype`` (the engine's default f16, or f32 for the exact path)."""
    st = ExpertStore(store_dir, o_direct=False)
    a = st.args
    cache = ExpertCache(st, a.num_moe_layers, a.num_experts, cap or a.num_experts)
    return (build_model(a, st.load_dense(), st.dense_quant, st.quant, cache, context, st.group_size,
                        kv_dtype=kv_dtype), st, cache)


def hf_logits(m, ids):
    """transformers' logits float32 [T, V] for one sequence."""
    with torch.no_grad():
        return m(torch.tensor(ids)[None]).logits[0].float().numpy()


def hf_decode_logits(m, prompt, steps):
    """Prefill ``prompt`` with the KV cache, then feed ``steps`` tokens one at a time."""
    with torch.no_grad():
        out = m(torch.tensor(prompt)[None], use_cache=True)
        past = out.past_key_values
        res = []
        for t in steps:
            out = m(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            res.append(out.logits[0, -1].float().numpy())
        return np.stack(res)


def kl(ref_logits, got_logits):
    """Per-row KL(ref || got) in nats (float64)."""
    p = torch.log_softmax(torch.tensor(ref_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor(got_logits, dtype=torch.float64), -1)
    return (p.exp() * (p - q)).sum(-1).numpy()


def saved_model(tmp_path, name, config_cls: str, model_cls: str, router_std: float | None = None, **config):
    """A transformers model (``model_cls`` over ``config_cls(**config)``, seeded by ``name``)
    with widened weights, saved with save_pretrained to tmp_path / name: (model, folder).

    HF's init is tiny (std 0.02); matrices are redrawn from N(0, 0.08) and biases from
    N(0, 0.05) so logits are not all ~0 (norm weights stay 1). ``router_std``: the routers
    (``*.gate.weight``, [E, D]) are then redrawn from N(0, router_std)."""
    import transformers
    torch.manual_seed(sum(map(ord, name)))
    cfg = getattr(transformers, config_cls)(**config)
    cfg._attn_implementation = "eager"
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif not torch.all(p == 1):  # biases
                p.normal_(0, 0.05)
        if router_std is not None:
            for n, p in m.named_parameters():
                if n.endswith(".gate.weight"):
                    p.normal_(0, router_std)
    d = tmp_path / name
    m.save_pretrained(d)
    return m, d


def assert_f32_parity(m, store, vocab: int, n_prefill: int = 24, n_decode: int = 16) -> None:
    """Our f32 store's logits within 1e-4 x logit scale of transformers' at every prefill
    position and over ``n_decode`` steps through the KV cache (transformers' cached decode).
    The exact path: f32 weights and an f32 KV cache (the f16 cache's own bound is
    tests/test_kv_cache.py's KL; the quantized-store KL tests run with it)."""
    ours, st, cache = open_model(store, kv_dtype="f32")
    try:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, vocab, n_prefill).tolist()
        ref = hf_logits(m, ids)
        got = ours.forward(np.array(ids), 0, all_logits=True)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 1e-4 * scale, (np.abs(got - ref).max(), scale)
        steps = rng.integers(0, vocab, n_decode).tolist()
        ref_dec = hf_decode_logits(m, ids, steps)
        dec = np.concatenate([ours.forward(np.array([t]), len(ids) + k) for k, t in enumerate(steps)])
        assert np.abs(dec - ref_dec).max() <= 1e-4 * np.abs(ref_dec).max()
    finally:
        cache.close()
        st.close()


def teacher_forced_agreement(m, store, vocab: int, n: int = 256, ids=None) -> tuple[float, float]:
    """(mean KL(transformers || ours) in nats, top-1 agreement) over ``n`` teacher-forced positions
    of random ids, or over the given ``ids`` (e.g. held-out text)."""
    ours, st, cache = open_model(store)
    try:
        if ids is None:
            ids = np.random.default_rng(1).integers(0, vocab, n).tolist()
        ref = hf_logits(m, ids)
        got = ours.forward(np.array(ids), 0, all_logits=True)
        return float(kl(ref, got).mean()), float((ref.argmax(-1) == got.argmax(-1)).mean())
    finally:
        cache.close()
        st.close()


def fake_quantized_copy(m, quant: str, group_size: int = 32):
    """A copy of transformers model ``m`` whose weights are rounded as our stores round them,
    by an independent torch implementation (not engine.quant): int8 = per row (last axis)
    absmax / 127; int4 (routed experts only; everything else int8, as convert.py's default
    dense quant) = per group of ``group_size`` absmax / 7, codes -8..7. Routers, norms and the
    sparse-attention indexer's weights_proj stay exact, as in our stores. Run through
    transformers' own forward (float activations), it gives the error of the rounded weights
    alone."""
    import copy
    mq = copy.deepcopy(m)
    with torch.no_grad():
        for n, p in mq.named_parameters():
            if p.dim() < 2 or n.endswith((".gate.weight", "shared_expert_gate.weight", "indexer.weights_proj.weight")):
                continue
            w = p.double()
            if quant == "int4" and ".experts." in n:  # per-expert or fused 3-D expert tensors
                sh = w.shape
                g = w.reshape(*sh[:-1], sh[-1] // group_size, group_size)
                s = g.abs().amax(-1, keepdim=True) / 7
                p.copy_((torch.round(g / s).clamp(-8, 7) * s).reshape(sh).float())
            else:
                s = w.abs().amax(-1, keepdim=True) / 127
                p.copy_((torch.round(w / s).clamp(-127, 127) * s).float())
    return mq


def assert_absorbed_equals_expanded(ours, ids, n_prefill: int) -> None:
    """An MLA model's decode with kv_b_proj absorbed into the query/output paths equals the
    expanded path: a prefill of ids[:n_prefill] and one-token steps for the rest, both ways,
    logits within 1e-5 x their scale. Leaves ``ours.absorb`` False."""
    def run():
        return np.concatenate([ours.forward(ids[:n_prefill], 0, all_logits=True)]
                              + [ours.forward(ids[t:t + 1], t) for t in range(n_prefill, len(ids))])
    absorbed = run()
    ours.absorb = False
    expanded = run()
    assert np.abs(absorbed - expanded).max() <= 1e-5 * np.abs(expanded).max()
