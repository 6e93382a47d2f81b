"""The wizard for every model family: a local folder and the loopback fake hub each convert a
tiny checkpoint saved by transformers' own class (OlmoeForCausalLM, Qwen3MoeForCausalLM,
MixtralForCausalLM, Qwen2MoeForCausalLM and the MoE families added
after them, Llama 4's and Gemma 4's multimodal checkpoints too) and the result chats, with the
family's own chat template where tests/chat_templates has one, rendered as transformers renders it; a GGUF-only folder and an
unsupported model_type each get one clear line and Next stays disabled."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hubserver  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from PySide6.QtWidgets import QWizard  # noqa: E402

from engine import ChatMessage, Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine import library as hub  # noqa: E402
from engine.bench.synthetic import write_tokenizer  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from test_chat_template import write_family_tokenizer  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

T = 1_800_000  # ms: only a hang trips it (a loaded machine converts and compiles slowly)
V = 320
BASE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, eos_token_id=0, pad_token_id=0, bos_token_id=None)
# family -> (config class, model class, config kwargs, words the wizard shows for it)
FAMILIES = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=16), "OLMoE"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48, head_dim=8,
        mlp_only_layers=[0]), "1 dense"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            intermediate_size=16), "Mixtral"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        intermediate_size=48), "shared expert width 24"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1, intermediate_size=48),
        "ERNIE 4.5"),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, intermediate_size=48,
        first_k_dense_replace=1, head_dim=8), "dots.llm1"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        num_experts=4, moe_topk=2, intermediate_size=16, head_dim=8), "Hunyuan"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), "MiniMax-M2"),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=1, intermediate_size=16, intermediate_size_mlp=48, head_dim=8,
        interleave_moe_layer_step=2, attention_chunk_size=8), "Llama 4"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, intermediate_size=24, head_dim=8, global_head_dim=16,
        enable_moe_block=True, hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8), "Gemma 4"),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48, num_dense_layers=1,
        layer_types=["conv", "full_attention"]), "LFM2-MoE"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, shared_intermediate_size=24,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8), "Granite 4.0"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, moe_intermediate_size=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        linear_num_heads=2, linear_head_dim=16, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"]), "Kimi-Linear"),
    # the published multimodal checkpoints (a tiny vision tower beside Llama 4's): their language models
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", dict(
        text_config=dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=16, intermediate_size_mlp=48,
                         head_dim=8, interleave_moe_layer_step=2, attention_chunk_size=8),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                           image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32)), "Llama 4"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(
        text_config=dict(num_experts=4, top_k_experts=2, moe_intermediate_size=16, intermediate_size=24, head_dim=8,
                         global_head_dim=16, enable_moe_block=True, hidden_size_per_layer_input=0,
                         attention_k_eq_v=True, num_global_key_value_heads=1,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=8),
        vision_config=None, audio_config=None), "Gemma 4"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, sliding_window=4, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"]), "DeepSeek-V4"),
}


# family -> its chat template's family in test_chat_template (the published template or the
# family's format, with its markers as special tokens); the others get write_tokenizer's
TEMPLATE_OF = {"ernie4_5_moe": "ernie4_5_moe", "dots1": "dots1", "hunyuan_v1_moe": "hunyuan_v1_moe",
               "minimax_m2": "minimax_m2", "llama4_text": "llama4", "llama4": "llama4", "gemma4_text": "gemma4",
               "gemma4": "gemma4", "lfm2_moe": "lfm2_moe", "granitemoehybrid": "granitemoehybrid",
               "kimi_linear": "kimi_linear", "deepseek_v4": "deepseek_v4"}
TEMPLATE_V = 640  # the vocabulary of a model whose tokenizer is test_chat_template's (up to 620 ids)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> a folder saved by transformers' save_pretrained, plus a small BPE tokenizer with
    the family's chat template (TEMPLATE_OF) or a generic one (engine.bench.synthetic.write_tokenizer)."""
    root = tmp_path_factory.mktemp("hf-families")
    out = {}
    for fam, (cfg_cls, model_cls, kw, _) in FAMILIES.items():
        torch.manual_seed(len(fam))
        base = {**BASE, "vocab_size": TEMPLATE_V if fam in TEMPLATE_OF else V}
        kw = {**kw, "text_config": {**base, **kw["text_config"]}} if "text_config" in kw else {**base, **kw}
        m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
        d = root / f"tiny-{fam.replace('_', '-')}"
        m.save_pretrained(d)
        if fam in TEMPLATE_OF:
            write_family_tokenizer(d, TEMPLATE_OF[fam])
        else:
            write_tokenizer(d, V)
        out[fam] = d
    return out


@pytest.fixture
def wizard(app_dirs, wizard_dialog):
    return wizard_dialog


def _finish(qtbot, w) -> str:
    """From the check page: (download,) convert at int8, self-test, Finish; the store path."""
    assert w.check.ok, (w.check.disk_message, w.check.ram_message)
    w.next()
    if w.currentId() == wz.PAGE_DOWNLOAD:
        qtbot.waitUntil(w.download_page.isComplete, timeout=T)
        w.next()
    assert w.currentId() == wz.PAGE_CONVERT
    w.convert_page.convert_button.click()
    qtbot.waitUntil(w.convert_page.isComplete, timeout=T)
    w.next()
    qtbot.waitUntil(w.done_page.isComplete, timeout=T)
    assert w.done_page.passed, w.done_page.info.text()
    with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
        w.button(QWizard.FinishButton).click()
    return sig.args[0]


def _chat(store: str, family: str) -> None:
    with Engine.open(EngineConfig(store=store, context_length=128, history=False)) as eng:
        assert eng.args.model_type == family and eng.has_chat_template
        req = GenerateRequest(messages=(ChatMessage("user", "Hello there"),),
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
        fin = list(eng.generate(req))[-1]
    assert isinstance(fin, Finished) and fin.finish_reason in ("length", "stop"), fin.error
    assert len(fin.token_ids) >= 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_local_folder_of_each_family_converts_and_chats(qtbot, wizard, checkpoints, family, monkeypatch):
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(checkpoints[family]))
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    assert w.check.args.model_type == family
    sub = w.check_page.subTitle()
    assert f"({family})" in sub and FAMILIES[family][3] in sub, sub
    store = _finish(qtbot, w)
    assert Path(store).name == f"{checkpoints[family].name}-int8"
    entry = [e for e in hub.list_models() if e.path == store][0]
    assert entry.family == family
    _chat(store, family)
    if family in TEMPLATE_OF:
        _renders_as_transformers(store, checkpoints[family], monkeypatch)


def _renders_as_transformers(store: str, folder: Path, monkeypatch) -> None:
    """The converted store's chat template renders (text and ids) as transformers renders the
    source folder's: a multi-turn chat with a system prompt, and a tool loop with tools offered."""
    from test_chat_template import MULTI_TURN, TOOL_CHAT, TOOLS, _FrozenClock
    import engine.chat_template
    import transformers.utils.chat_template_utils as theirs
    monkeypatch.setattr(engine.chat_template, "datetime", _FrozenClock)  # Hunyuan's tool prompt shows the time
    monkeypatch.setattr(theirs, "datetime", _FrozenClock)
    ours = Tokenizer.from_dir(Path(store))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for msgs, kw in ((MULTI_TURN, {}), (TOOL_CHAT, {"tools": TOOLS})):
        text = ours.apply_chat_template(msgs, add_generation_prompt=True, **kw)
        assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.encode_chat(msgs, add_generation_prompt=True, **kw) == hf.apply_chat_template(
            msgs, tokenize=True, return_dict=False, add_generation_prompt=True, **kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fake_hub_repo_of_each_family_converts_and_chats(qtbot, wizard, checkpoints, tmp_path, monkeypatch,
                                                        family):
    h = hubserver.FakeHub()
    url = h.start()
    try:
        hubserver.hub_env(monkeypatch, tmp_path, url)
        repo = f"someone/{checkpoints[family].name}"
        h.add_folder(repo, checkpoints[family])
        w = wizard
        w.source_page.repo_edit.setText(repo)
        w.next()
        qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
        assert w.check.source == "hub" and w.check.args.model_type == family
        store = _finish(qtbot, w)
        _chat(store, family)
    finally:
        h.stop()


def _refused_line(qtbot, w) -> str:
    sp = w.source_page
    qtbot.waitUntil(lambda: sp.task is None and "Refused" in sp.status.text(), timeout=T)
    text = sp.status.text()
    assert "\n" not in text and "Traceback" not in text
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None
    assert not sp.isComplete() and not w.button(QWizard.NextButton).isEnabled()  # reason shown, Next off
    return text


def test_damaged_gguf_in_a_folder_gets_one_clear_line(qtbot, wizard, tmp_path):
    d = tmp_path / "Qwen3-30B-A3B-GGUF"
    d.mkdir()
    (d / "Qwen3-30B-A3B-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(d))
    w.next()
    qtbot.waitUntil(lambda: "download it again" in w.source_page.status.text(), timeout=1_800_000)
    text = w.source_page.status.text()
    assert "Qwen3-30B-A3B-Q4_K_M.gguf" in text and "download it again" in text and "\n" not in text
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None


def test_damaged_gguf_of_a_hub_repo_gets_one_clear_line(qtbot, wizard, tmp_path, monkeypatch):
    d = tmp_path / "gguf-repo"
    d.mkdir()
    (d / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))
    (d / "README.md").write_text("quantized")
    h = hubserver.FakeHub()
    url = h.start()
    try:
        hubserver.hub_env(monkeypatch, tmp_path, url)
        h.add_folder("someone/Model-GGUF", d)
        w = wizard
        w.source_page.repo_edit.setText("someone/Model-GGUF")
        w.next()
        sp = w.source_page
        qtbot.waitUntil(lambda: sp.task is None and "download it again" in sp.status.text(), timeout=T)
        text = sp.status.text()
        assert "\n" not in text and w.currentId() == wz.PAGE_SOURCE and w.check is None
        assert "someone/Model-GGUF: model-Q4_K_M.gguf: damaged GGUF header (its version field reads 0)" in text
        assert "Nothing was downloaded" in text and h.weight_requests() == []
    finally:
        h.stop()


def test_unsupported_model_type_gets_one_line_naming_the_families(qtbot, wizard, checkpoints, tmp_path):
    d = tmp_path / "tiny-llama"
    d.mkdir()
    cfg = json.loads((checkpoints["mixtral"] / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(d))
    w.next()
    text = _refused_line(qtbot, w)
    assert "'llama' is not supported" in text
    for fam in FAMILIES:
        assert fam in text
