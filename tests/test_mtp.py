"""Multi-token-prediction heads (engine/mtp.py): the converter keeps DeepSeek-V3's, GLM-4.5's,
the sparse-attention families' (DeepSeek-V3.2, GLM-5: the block with its own indexer) and
Qwen3-Next's next-n layer (its experts in the store's expert table, read through the same cache), the head's
logits equal a torch reference written from the published definition (vLLM's DeepSeekMTP /
Glm4MoeMTP / Qwen3NextMTP over transformers' own decoder layer), and speculation "mtp" drafts with it while the
greedy ids stay those of plain decoding.

The tiny checkpoints are transformers models with one layer more than config.json says: that
last layer is the next-n layer's decoder block, saved beside the head's enorm / hnorm / eh_proj /
shared_head tensors under model.layers.{num_hidden_layers}.*, as the published checkpoints name
them (config.json: num_nextn_predict_layers 1); Qwen3-Next's as mtp.layers.0.* beside mtp.fc,
mtp.pre_fc_norm_embedding / _hidden and mtp.norm (mtp_num_hidden_layers 1). llama.cpp's
converter writes GLM-4.5's and GLM-4.7-Flash's as blk.L.* and blk.L.nextn.*: the GGUF import
keeps the head too (needs $LLAMA_CPP_DIR, skipped otherwise).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine import convert_checkpoint, speculative  # noqa: E402
from engine.bench.synthetic import write_tokenizer  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.events import Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.mtp import MTPHead  # noqa: E402
from engine.observers import Observer  # noqa: E402
from parity_helpers import hf_logits, open_model, saved_model  # noqa: E402

V, L = 256, 3
BASE = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, eos_token_id=0, pad_token_id=0,
            bos_token_id=None)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, intermediate_size=96)
CONFIGS = {
    # DeepSeek-V3: q LoRA, dense layer 0, grouped sigmoid routing, YaRN
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        **MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    # GLM-4.5: GQA with biases and q/k norms, partial rotary, dense layer 0, groups
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5)),
    # GLM-4.7-Flash: MLA with q LoRA, GLM routing over 2 groups, layer 0 dense (mlp_layer_types)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        **MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True)),
    # Qwen3-Next: Gated DeltaNet and gated full-attention layers (the head's block is a full one)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        intermediate_size=64)),
    # Qwen3.5-MoE's language model (separate projections); "qwen3_5_moe" below: as published, the
    # multimodal checkpoint's names (model.language_model.*) and config.json (text_config)
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}
CONFIGS["qwen3_5_moe"] = CONFIGS["qwen3_5_moe_text"]
# the sparse-attention families: the head's block is a full decoder layer with its own indexer;
# index_topk 8 under 20-token prompts so the selection matters, 16 indexer heads (no exact ties)
DSA = dict(**MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
           index_topk=8, index_head_dim=16, index_n_heads=16)
CONFIGS["deepseek_v32"] = ("DeepseekV32Config", "DeepseekV32ForCausalLM", DSA)
# GLM-5 with a "shared" decoder layer (it reuses layer 0's selection); the head's block runs its own
CONFIGS["glm_moe_dsa"] = ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
    DSA, indexer_types=["full", "shared", "full", "full"]))
PER_LAYER = ("layer_types", "indexer_types")  # per-layer lists: the decoder's are all but the head's block
MULTIMODAL = {"qwen3_5_moe"}  # saved as the published multimodal checkpoint's language model
# How each family publishes its head, written from the published checkpoints (not the engine):
# the block's prefix, the head's tensors (enorm, hnorm, eh_proj, shared_head.norm), the count key
# of config.json, whether the runtime zeroes position 0's embedding, zero-centred norms
_DS = dict(block=f"model.layers.{L}.", names=[f"model.layers.{L}.{n}.weight" for n in
                                             ("enorm", "hnorm", "eh_proj", "shared_head.norm")],
           count="num_nextn_predict_layers", zero_first=True, centred=False)
PUBLISHED = {"deepseek_v3": _DS, "glm4_moe": _DS, "glm4_moe_lite": _DS, "qwen3_next": dict(
    block="mtp.layers.0.", names=["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                                  "mtp.fc.weight", "mtp.norm.weight"],
    count="mtp_num_hidden_layers", zero_first=False, centred=True)}
PUBLISHED["qwen3_5_moe_text"] = PUBLISHED["qwen3_5_moe"] = PUBLISHED["qwen3_next"]
PUBLISHED["deepseek_v32"] = PUBLISHED["glm_moe_dsa"] = _DS


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """The next-n head from its published definition: the main model (transformers, L layers)
    gives the final hidden states (after model.norm); the head zeroes the embedding at position
    0 (DeepSeek / GLM), norms the embedding (enorm) and the hidden state (hnorm), projects their
    concatenation (eh_proj), runs transformers' decoder layer L, and
    shared_head.head(shared_head.norm(.)). Qwen3-Next's norms multiply by 1 + w."""

    def __init__(self, full, main, extra, pub):
        self.full, self.main, self.x, self.pub = full, main, extra, pub
        self.eps = full.config.rms_norm_eps
        self.block = full.model.layers[L]

    def norm(self, x, w):
        return rms(x, 1 + w if self.pub["centred"] else w, self.eps)

    def rows(self, tokens_ahead, hidden, n_chain_from=None):
        """Head outputs [T, D] for rows 0..T-1 (token ahead and hidden per row)."""
        x = self.x
        e = self.full.model.embed_tokens(torch.tensor(tokens_ahead))
        if self.pub["zero_first"]:
            e[0] = 0
        h = self.block.input_layernorm.weight.new_tensor(hidden) if not torch.is_tensor(hidden) else hidden
        inp = torch.cat([self.norm(e, x["enorm"]), self.norm(h, x["hnorm"])], -1) @ x["eh_proj"].T
        T = inp.shape[0]
        pos = torch.arange(T)[None]
        pe = self.full.model.rotary_emb(inp[None], pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = self.block(inp[None], attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return (y[0] if isinstance(y, tuple) else y)[0]  # GLM-5's layer also returns its selection

    def logits(self, y):
        return self.norm(y, self.x["shared_norm"]) @ self.x["head"].T


def checkpoint_with_head(tmp_path, name, head_tensors=True, vocab=V):
    """(reference, folder): a transformers model with L + 1 layers whose last layer is saved as
    the next-n layer (with the head's tensors) of a config.json of L layers (``vocab`` tokens)."""
    import transformers
    from safetensors.torch import save_file
    cfg_cls, model_cls, kw = CONFIGS[name]
    pub = PUBLISHED[name]
    kw = {**kw, "vocab_size": vocab}
    full, _ = saved_model(tmp_path, f"{name}-full", cfg_cls, model_cls,
                          **{**BASE, **kw, "num_hidden_layers": L + 1})
    kw = {**kw, **{k: kw[k][:L] for k in PER_LAYER if k in kw}}  # the decoder's: all but the head's block
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, b in list(full.named_buffers()) + list(full.named_parameters()):
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3, generator=g)
            elif n.endswith("norm.weight"):  # not 1: the head's input is the hidden state after model.norm
                b.normal_(1, 0.1, generator=g)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **kw, "num_hidden_layers": L})
    cfg._attn_implementation = "eager"
    main = getattr(transformers, model_cls)(cfg).eval()
    sd = full.state_dict()
    missing, _ = main.load_state_dict({k: v for k, v in sd.items()}, strict=False)
    assert not missing
    D = cfg.hidden_size
    one = 0 if pub["centred"] else 1
    extra = {"enorm": one + 0.1 * torch.randn(D, generator=g), "hnorm": one + 0.1 * torch.randn(D, generator=g),
             "eh_proj": 0.08 * torch.randn(D, 2 * D, generator=g),
             "shared_norm": one + 0.1 * torch.randn(D, generator=g), "head": sd["lm_head.weight"]}
    p = f"model.layers.{L}."
    out = {k: v for k, v in sd.items() if not k.startswith(p)}
    if head_tensors:  # the block under its published prefix, the head's own tensors
        out.update({pub["block"] + k[len(p):]: v for k, v in sd.items() if k.startswith(p)})
        out.update(dict(zip(pub["names"], (extra["enorm"], extra["hnorm"], extra["eh_proj"], extra["shared_norm"]))))
        if not pub["centred"]:  # DeepSeek / GLM publish copies of the embedding and lm_head in the layer
            out.update({p + "shared_head.head.weight": sd["lm_head.weight"],
                        p + "embed_tokens.weight": sd["model.embed_tokens.weight"]})
    if name in MULTIMODAL:  # the language model's names inside the multimodal checkpoint's
        out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in out.items()}
    d = tmp_path / name
    d.mkdir()
    save_file({k: v.detach().contiguous().clone() for k, v in out.items()}, str(d / "model.safetensors"))
    c = json.loads(main.config.to_json_string())
    c.update(num_hidden_layers=L, **{pub["count"]: 1})
    if name in MULTIMODAL:  # the language model's settings inside the multimodal checkpoint's
        c = {"model_type": name, "text_config": c, "tie_word_embeddings": c.get("tie_word_embeddings", False)}
    (d / "config.json").write_text(json.dumps(c))
    write_tokenizer(d, vocab)
    return Reference(full, main, extra, pub), d


class _Built(dict):
    """name -> (reference, checkpoint, {quant: store}), each family built on first use."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, name):
        tmp = self.factory.mktemp(f"mtp-{name}")
        ref, ck = checkpoint_with_head(tmp, name)
        self[name] = (ref, ck, {q: convert_checkpoint(ck, tmp / f"{name}-{q}", quant=q) for q in ("f32", "int8", "int4")})
        return self[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _Built(tmp_path_factory)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converter_keeps_the_next_n_layer(built, name):
    _, _, stores = built[name]
    m = json.loads((stores["int8"] / "manifest.json").read_text())
    assert m["mtp_layers"] == 1
    assert m["moe_layers"][-1] == L and m["num_layers"] == len(m["moe_layers"])  # the head's experts: the last row
    # only the head's copies of the embedding and lm_head are left out (the main model's are used)
    skipped = " ".join(m.get("skipped", []))
    if not PUBLISHED[name]["centred"]:
        assert f"model.layers.{L}.* (2 tensors: the kept multi-token-prediction head's copies" in skipped
    else:
        assert "mtp." not in skipped, skipped
    from safetensors import safe_open
    with safe_open(str(stores["int8"] / "dense.safetensors"), "np") as f:
        keys = set(f.keys())
    assert {"mtp.0.enorm", "mtp.0.hnorm", "mtp.0.shared_head.norm", "mtp.0.eh_proj.w"} <= keys
    assert f"layers.{L}.router" in keys and f"layers.{L}.input_layernorm" in keys
    from engine.config import describe_model
    from engine.expert_store import read_manifest
    _, a, _ = read_manifest(stores["int8"])
    dense_first = name in ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
    assert a.mtp_layers == 1 and a.num_moe_layers == (3 if dense_first else 4)
    assert ("3 layers (2 MoE, 1 dense) + an MTP head" if dense_first else "3 layers (3 MoE) + an MTP head") \
        in describe_model(a), describe_model(a)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_head_logits_match_the_published_definition(built, name):
    """f32 store: the head's rows over a prompt (one T > 1 call) and a chained row through its KV
    cache, within 1e-4 x logit scale of the reference; the main model unchanged."""
    ref, _, stores = built[name]
    model, st, cache = open_model(stores["f32"], kv_dtype="f32")
    try:
        assert model.num_moe_layers == st.args.num_moe_layers - 1
        head = MTPHead(model, st.load_dense(), cache)
        ids = np.random.default_rng(3).integers(1, V, 20).tolist()
        rows = []
        model.hidden_sink = lambda pos0, fed, x, kept: rows.append(x.copy())
        got_main = model.forward(np.array(ids), 0, all_logits=True)
        model.hidden_sink = None
        np.testing.assert_allclose(got_main, hf_logits(ref.main, ids), atol=1e-4 * np.abs(got_main).max())
        x = np.concatenate(rows)
        y = head.step(ids[1:], head.main_hidden(x[:-1]), 0)  # rows 0..18: t[q+1] and h[q]
        got = head.logits(y)
        with torch.no_grad():
            H = ref.main.model(torch.tensor(ids)[None]).last_hidden_state[0]
            y_ref = ref.rows(ids[1:], H[:-1])
            want = ref.logits(y_ref).numpy()
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
        # chained: row 19 takes the head's own output of row 18 and a drafted token
        d = int(np.argmax(got[-1]))
        y2 = head.step([d], y[-1:], len(ids) - 1)
        with torch.no_grad():
            y_ref2 = ref.rows(ids[1:] + [d], torch.cat([H[:-1], y_ref[-1:]]))
            want2 = ref.logits(y_ref2[-1:]).numpy()
        got2 = head.logits(y2)
        assert np.abs(got2 - want2).max() <= 1e-4 * np.abs(want2).max()
        assert np.abs(want2 - want[-1:]).max() > 1e-2 * scale  # the chained row differs from the last
    finally:
        cache.close()
        st.close()


class Forwards(Observer):
    def __init__(self):
        self.calls = []

    def on_forward_start(self, pos0, num_tokens):
        self.calls.append((pos0, num_tokens))


def _run(store, speculation, prompt, n=24, observer=None, draft_max=3, cap=None, pilot=0):
    cfg = EngineConfig(store=str(store), history=False, o_direct=False, speculation=speculation,
                       draft_max=draft_max, idle_fill=False, cap=cap, pilot=pilot)
    out = []
    with Engine.open(cfg) as eng:
        if observer is not None:
            eng.subscribe(observer)
        for p in (prompt, prompt + (7, 8)):  # the second prompt reuses the first's KV rows
            req = GenerateRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
            fin = [e for e in eng.generate(req) if isinstance(e, Finished)][-1]
            assert fin.error == "", fin.error
            out.append(fin)
        head_row_loaded = bool((eng.cache.where[-1] >= 0).any())
        has_head = eng.mtp is not None
    return out, head_row_loaded, has_head


@pytest.fixture
def fixed_length(monkeypatch):
    monkeypatch.setattr(speculative, "ADAPT", False)


PROMPT = (5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7)


@pytest.mark.parametrize("name,quant", [("deepseek_v3", "int8"), ("deepseek_v3", "int4"), ("glm4_moe", "int8"),
                                        ("glm4_moe", "int4"), ("qwen3_next", "int8"), ("qwen3_next", "int4"),
                                        ("glm4_moe_lite", "int4"), ("qwen3_5_moe", "int4"),
                                        ("deepseek_v32", "int8"), ("glm_moe_dsa", "int4")])
def test_greedy_ids_identical_with_mtp_drafts(built, name, quant, fixed_length):
    store = built[name][2][quant]
    off, row_off, has = _run(store, "off", PROMPT)
    assert has
    obs = Forwards()
    on, row_on, _ = _run(store, "mtp", PROMPT, observer=obs)
    assert [f.token_ids for f in on] == [f.token_ids for f in off]
    assert [f.text for f in on] == [f.text for f in off]
    assert all(f.draft_tokens > 0 for f in on)  # the head drafted in both answers
    # the head drafts from the first decode forward on (it saw the prompt's hidden states):
    # verify forwards of 1 + draft_max positions
    assert obs.calls[1] == (len(PROMPT), 4)
    assert row_on and not row_off  # the head's experts were read through the cache


def test_mtp_falls_back_to_prompt_lookup_without_a_head(tmp_path, fixed_length):
    """A checkpoint without the head tensors converts as before (no mtp_layers) and speculation
    "mtp" drafts by prompt lookup there, the same drafts as "prompt_lookup"."""
    _, ck = checkpoint_with_head(tmp_path, "glm4_moe", head_tensors=False)
    store = convert_checkpoint(ck, tmp_path / "plain", quant="int8")
    assert "mtp_layers" not in json.loads((store / "manifest.json").read_text())
    on, _, has = _run(store, "mtp", PROMPT)
    pl, _, _ = _run(store, "prompt_lookup", PROMPT)
    assert not has
    assert [(f.token_ids, f.draft_tokens, f.accepted_tokens) for f in on] == \
        [(f.token_ids, f.draft_tokens, f.accepted_tokens) for f in pl]
    assert on[0].draft_tokens > 0


@pytest.mark.parametrize("name,pilot", [("deepseek_v3", 0), ("deepseek_v32", 2), ("glm_moe_dsa", 0)])
def test_streamed_long_prompt_feeds_the_head(built, fixed_length, monkeypatch, name, pilot):
    """A prompt longer than a prefill chunk on a cache of 2 experts per layer (prefilled layer by
    layer) with fewer pending rows allowed than it has: the head runs its rows in chunks during
    the prefill and drafts from the first decode forward; the ids are those of plain decoding
    (the sparse-attention heads' indexers choosing among 200 positions; PILOT on for one)."""
    from engine import mtp
    monkeypatch.setattr(mtp, "PENDING_ROWS", 64)
    store = built[name][2]["int8"]
    prompt = tuple(np.random.default_rng(4).integers(1, V, 200).tolist())
    off, _, _ = _run(store, "off", prompt, n=12, cap=2)
    obs = Forwards()
    on, _, _ = _run(store, "mtp", prompt, n=12, cap=2, observer=obs, pilot=pilot)
    assert [f.token_ids for f in on] == [f.token_ids for f in off]
    assert obs.calls[0] == (0, len(prompt)) and obs.calls[1] == (len(prompt), 4)


def _per_expert_names(path, inter: int) -> None:
    """Rewrite the safetensors file ``path``: transformers' fused experts (``mlp.experts.gate_up_proj``
    [E, 2I, D], gate rows first; ``mlp.experts.down_proj`` [E, D, I]) as the published
    checkpoints' ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    from safetensors.numpy import load_file, save_file
    out = {}
    for k, w in load_file(str(path)).items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[:-len("gate_up_proj")]
            for e in range(w.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = np.ascontiguousarray(w[e, :inter])
                out[f"{p}{e}.up_proj.weight"] = np.ascontiguousarray(w[e, inter:])
        elif k.endswith("mlp.experts.down_proj"):
            p = k[:-len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = np.ascontiguousarray(w[e])
        else:
            out[k] = w
    save_file(out, str(path))


@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe_lite"])
def test_gguf_nextn_layer_drafts_as_the_checkpoints_head(tmp_path, fixed_length, name):
    """llama.cpp's converter writes the next-n layer of GLM-4.5 (``glm4moe``) and GLM-4.7-Flash
    (``deepseek2``, MLA) as block L (blk.L.*, the experts stacked) plus blk.L.nextn.{eh_proj,
    enorm, hnorm, shared_head_norm, embed_tokens, shared_head_head} and <arch>.nextn_predict_layers;
    its F16 file imports with the head kept, whose logits are the f16 safetensors store's head's,
    and speculation "mtp" drafts and accepts the same tokens on both."""
    import os
    import subprocess
    from engine.gguf_file import GGUFModel
    from engine.gguf_import import convert_gguf
    from engine.gguf_tokenizer import tokenizer_files
    from llama_helpers import convert_command, llama_cpp_dir
    d = llama_cpp_dir()
    if d is None:
        pytest.skip("needs $LLAMA_CPP_DIR: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    with GGUFModel(d / "models" / "ggml-vocab-qwen2.gguf") as g:  # a vocabulary the converter recognises
        tok = tokenizer_files(g)
        vocab = len(g.kv["tokenizer.ggml.tokens"])
    _, ck = checkpoint_with_head(tmp_path, name, vocab=vocab)
    for fname, text in tok.items():
        (ck / fname).write_text(text, encoding="utf-8")
    c = json.loads((ck / "config.json").read_text())
    # the published configs' keys llama.cpp reads (GLM-4.7-Flash's: its dense layer 0 as first_k_dense_replace,
    # its router's sigmoid scores as scoring_func, which transformers' config leaves out)
    lite = dict(first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc")
    c.update(architectures=[CONFIGS[name][1]], **(lite if name == "glm4_moe_lite" else {}))
    (ck / "config.json").write_text(json.dumps(c))
    _per_expert_names(ck / "model.safetensors", c["moe_intermediate_size"])  # as published (llama.cpp reads those)
    f = tmp_path / f"{name}-F16.gguf"
    r = subprocess.run(convert_command(d, ck, f, name), env={**os.environ, "PYTHONPATH": str(d / "gguf-py")},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    with GGUFModel(f) as g:  # the layout the import reads, as llama.cpp wrote it
        assert g.key("nextn_predict_layers") == 1 and g.key("block_count") == L + 1
        own = ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head")
        assert {f"blk.{L}.nextn.{n}.weight" for n in own} <= set(g.tensors)
    st = convert_gguf(f, tmp_path / "gguf", dense_quant="f16")
    ref = convert_checkpoint(ck, tmp_path / "ref", quant="f16", dense_quant="f16")
    m = json.loads((st / "manifest.json").read_text())
    assert m["mtp_layers"] == 1 and m["moe_layers"][-1] == L and m["num_hidden_layers"] == L
    ids = np.random.default_rng(6).integers(1, 4000, 20).tolist()
    heads = []
    for store in (st, ref):
        model, s_, cache = open_model(store, kv_dtype="f32")
        try:
            head = MTPHead(model, s_.load_dense(), cache)
            rows = []
            model.hidden_sink = lambda pos0, fed, x, kept: rows.append(x.copy())
            model.forward(np.array(ids), 0, all_logits=True)
            x = np.concatenate(rows)
            heads.append(head.logits(head.step(ids[1:], head.main_hidden(x[:-1]), 0)))
        finally:
            cache.close()
            s_.close()
    got, want = heads
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    prompt = tuple(ids[:11])
    on_gguf, _, has = _run(st, "mtp", prompt)
    on_ref, _, _ = _run(ref, "mtp", prompt)
    assert has
    assert [(f.token_ids, f.draft_tokens, f.accepted_tokens) for f in on_gguf] == \
        [(f.token_ids, f.draft_tokens, f.accepted_tokens) for f in on_ref]
    assert on_gguf[0].draft_tokens > 0
