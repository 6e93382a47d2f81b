"""Seeded random OLMoE checkpoints in Hugging Face layout, written without torch.

Used by the tests (tiny models), the benchmarks (1B-parameter and OLMoE-1B-7B-shaped models)
and nowhere at run time. Tensors are written shard by shard through safetensors, so peak RSS
stays near one shard (``shard_bytes``) whatever the model size.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from .config import ModelArgs
from .checkpoint import hf_names
from .paths import normalize_modes

TOKENIZER_SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def olmoe_config(**kw) -> dict:
    """A config.json dict for OLMoE with the given overrides."""
    cfg = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 300,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "norm_topk_prob": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "clip_qkv": None, "eos_token_id": 0, "pad_token_id": 0,
        "bos_token_id": None, "router_aux_loss_coef": 0.01, "output_router_logits": False,
    }
    cfg.update(kw)
    return cfg


def write_tokenizer(folder: Path, vocab_size: int, corpus: list[str] | None = None) -> None:
    """A byte-level BPE tokenizer (tokenizers library) with chat markers and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = corpus or [
        "def dumps(obj): return a JSON string. The quick brown fox jumps over the lazy dog.",
        "Return the number of items in a container. héllo wörld 日本語 😀",
        "import os\nimport sys\n\nclass Path:\n    def __init__(self, name):\n        self.name = name\n",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 256 + len(TOKENIZER_SPECIALS)),
                                  special_tokens=TOKENIZER_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "bos_token": None,
        "pad_token": "<|endoftext|>"}))
    end_id = tok.token_to_id("<|end|>")
    eot_id = tok.token_to_id("<|endoftext|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_id, eot_id]}))


def write_checkpoint(folder: str | os.PathLike, config: dict, seed: int = 0, dtype: str = "bf16",
                     shard_bytes: int = 1 << 30, tokenizer: bool = True, std: float = 0.05) -> Path:
    """Write a random OLMoE checkpoint (config.json, model*.safetensors [+ index], tokenizer).

    Weights are N(0, std) (norms 1.0 +- 0.05), seeded per tensor name so the result does not
    depend on sharding. Written to ``folder.partial`` then renamed (atomic).
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = ModelArgs.from_dict(config)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    np_dtype = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[dtype]
    names = hf_names(args)
    shard: dict[str, np.ndarray] = {}
    size = 0
    shards: list[tuple[str, list[str]]] = []

    def flush():
        nonlocal shard, size
        if not shard:
            return
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        shards.append((name, list(shard)))
        shard, size = {}, 0

    for i, (name, shape) in enumerate(names.items()):
        rng = np.random.default_rng([seed, i])
        if len(shape) == 1:
            w = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
        else:
            w = std * rng.standard_normal(shape, dtype=np.float32)
        arr = w.astype(np_dtype)
        shard[name] = arr
        size += arr.nbytes
        if size >= shard_bytes:
            flush()
    flush()
    if len(shards) == 1:
        os.replace(tmp / shards[0][0], tmp / "model.safetensors")
    else:
        total = sum((tmp / n).stat().st_size for n, _ in shards)
        wm = {t: n for n, ts in shards for t in ts}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1))
    if tokenizer:
        write_tokenizer(tmp, args.vocab_size)
    normalize_modes(tmp)  # safetensors writes 0600 files
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
