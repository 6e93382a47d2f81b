"""Helpers shared by the parity tests against transformers (test_parity.py for OLMoE,
test_families_parity.py for the other families)."""

from __future__ import annotations

import numpy as np
import torch

from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore
from engine.models import build_model


def open_model(store_dir, cap=None, context=256):
    """(model, store, cache) over a converted store, all experts cached unless ``cap``."""
    st = ExpertStore(store_dir, o_direct=False)
    a = st.args
    cache = ExpertCache(st, a.num_moe_layers, a.num_experts, cap or a.num_experts)
    return build_model(a, st.load_dense(), st.dense_quant, st.quant, cache, context, st.group_size), st, cache


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
