"""Tiny random checkpoints of Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss, Gemma 4, MiniMax-M2 and
Hunyuan with tokenizers whose added tokens and chat templates are written like the published ones
(tests/chat_templates/; Gemma 4's, MiniMax-M2's and Hunyuan's are the published ones), for the
function-calling tests of the server."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATES = Path(__file__).parent / "chat_templates"
CORPUS = ["What is the weather in Paris? It is sunny and 21 degrees. get_weather city days units",
          '{"city": "Paris", "days": 3} search query the web for news',
          "You are a helpful assistant. Answer briefly and precisely."] * 5

FAMILIES = {
    "qwen3_moe": dict(
        config="qwen3_moe_config", template="qwen3_moe.jinja",
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        eos=["<|im_end|>", "<|endoftext|>"]),
    "deepseek_v3": dict(
        config="deepseek_v3_config", template="deepseek_v3.jinja",
        special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        added=["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
               "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
        tokens={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "add_bos_token": False},
        eos=["<｜end▁of▁sentence｜>"]),
    "glm4_moe": dict(
        config="glm4_moe_config", template="glm4_moe.jinja",
        special=["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>", "<tool_response>", "</tool_response>"],
        tokens={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None},
        eos=["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "gpt_oss": dict(
        config="gpt_oss_config", template="gpt_oss.jinja",
        special=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"],
        added=[],
        tokens={"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        eos=["<|return|>", "<|endoftext|>", "<|call|>"]),
    "gemma4": dict(
        config="gemma4_text_config", template="gemma4.jinja",
        special=["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                 "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"],
        added=[],
        tokens={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        eos=["<eos>", "<turn|>", "<|tool_response>"]),
    "minimax_m2": dict(
        config="minimax_m2_config", template="minimax_m2.jinja",
        special=["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"],
        added=["<think>", "</think>"],
        tokens={"bos_token": "]~!b[", "eos_token": "[e~["},
        eos=["[e~["]),
    "hunyuan_v1_moe": dict(
        config="hunyuan_v1_moe_config", template="hunyuan_v1_moe.jinja",
        special=["<|startoftext|>", "<|extra_0|>", "<|extra_4|>", "<|extra_5|>", "<|eos|>", "<|pad|>"],
        added=["<tool_calls>", "</tool_calls>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        tokens={"eos_token": "<|eos|>", "pad_token": "<|pad|>", "bos_token": None},
        eos=["<|eos|>"]),
}


def write_family_tokenizer(folder: Path, family: str) -> None:
    """A byte-level BPE tokenizer with ``family``'s special and added tokens, its test chat
    template and end-of-turn ids."""
    f = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in f["special"]])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in f["added"]])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text((TEMPLATES / f["template"]).read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in f["tokens"].items()}}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in f["eos"]]}))


def family_store(tmp: Path, family: str) -> Path:
    """A converted int8 store of a tiny random ``family`` model with its tokenizer."""
    from engine import convert_checkpoint
    from engine.bench import synthetic
    cfg = getattr(synthetic, FAMILIES[family]["config"])(vocab_size=384)
    ck = synthetic.write_checkpoint(tmp / f"{family}-ck", cfg, seed=7, tokenizer=False)
    write_family_tokenizer(ck, family)
    # the end-of-turn ids are the tokenizer's (the random config's id 0 is an ordinary byte)
    config = json.loads((ck / "config.json").read_text())
    config["eos_token_id"] = json.loads((ck / "generation_config.json").read_text())["eos_token_id"]
    (ck / "config.json").write_text(json.dumps(config, indent=1))
    return convert_checkpoint(ck, tmp / f"{family}-int8", quant="int8")
