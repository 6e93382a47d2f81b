"""A GGUF file's tokenizer as Hugging Face tokenizer files, run by the ``tokenizers`` library.

GGUF carries the vocabulary in its metadata (``tokenizer.ggml.*``); llama.cpp tokenizes with its
own code (src/llama-vocab.cpp). This module writes the ``tokenizer.json`` that makes the
``tokenizers`` library encode as llama.cpp does, plus ``tokenizer_config.json`` (BOS / EOS,
``add_bos_token``, the chat template) and ``generation_config.json`` (the ids that end a turn):

``gpt2`` (byte-level BPE): the merges as published; the pre-tokenizer is llama.cpp's list of
    regular expressions for ``tokenizer.ggml.pre`` (each one splitting the pieces of the one
    before, as llama.cpp's unicode_regex_split does), then the byte-to-unicode mapping; the
    pre-tokenizers whose merges llama.cpp skips for whole-word tokens (``ignore_merges``:
    llama-bpe, glm4, ...) get the BPE model's ``ignore_merges``.
``llama`` (SentencePiece): llama.cpp's SPM tokenizer merges the adjacent pair whose joined text
    is a token of the highest score, so the BPE model gets, for every token that splits into two
    tokens, that merge, ranked by the token's score; characters without a token fall back to the
    ``<0xXX>`` byte tokens; a space is put before the text and after each special token
    (``add_space_prefix``) and spaces become "▁".

Special tokens: control and unknown tokens (token types 3 and 2) are special added tokens,
user-defined ones (type 4) plain added tokens, matched in the text before anything else, as
llama.cpp's parse_special does.

Where it differs from llama.cpp: ties between merges of equal score (llama.cpp takes the
leftmost pair, the BPE model the merge listed first), overlapping special tokens (llama.cpp tries
longer ones first, tokenizers leftmost-longest), and the character classes of the regular
expressions (llama.cpp's own Unicode tables, Oniguruma's here) for characters the two disagree
on. tests/test_gguf_tokenizer.py measures them on 500 strings per vocabulary.
"""

from __future__ import annotations

import json

from .errors import ConfigError

# token types (gguf-py constants.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CHATGLM4 = _LLAMA3
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regular expressions, ignore_merges, add_bos default): llama-vocab.cpp
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{k: ([_LLAMA3], True, True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{k: ([_QWEN2], False, False) for k in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    "qwen35": ([_QWEN35], False, False),
    **{k: ([_GPT2], False, False) for k in ("gpt-2", "phi-2", "olmo", "mpt", "jais")},
    "deepseek-v3": (_DEEPSEEK3, False, False),
    "chatglm-bpe": ([_CHATGLM4], False, False),
    **{k: ([_CHATGLM4], True, False) for k in ("glm4", "glm5")},
    "gpt-4o": ([_GPT4O], False, False),
    **{k: ([_LLAMA3], False, False) for k in ("dbrx", "smaug-bpe")},
}

# the tokens llama.cpp ends a generation on when the vocabulary has them (llama-vocab.cpp's EOG list)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>")


def _kv_list(g, key: str):
    v = g.kv.get(key)
    return list(v) if isinstance(v, (list, tuple)) else None


def tokenizer_files(g) -> dict[str, str]:
    """{file name: text} of the tokenizer files for the GGUF model ``g`` (engine.gguf_import.GGUFModel):
    tokenizer.json, tokenizer_config.json, generation_config.json; {} for a model without a
    vocabulary (``tokenizer.ggml.model`` "none" or absent: it runs on token ids only).

    Raises:
        ConfigError: a tokenizer model or pre-tokenizer this module does not reproduce, or
            metadata that disagree (naming the key).
    """
    model = g.kv.get("tokenizer.ggml.model")
    if model in (None, "none"):
        return {}
    where = g.files[0]
    tokens = _kv_list(g, "tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError(f"{where}: tokenizer.ggml.model is {model!r} but tokenizer.ggml.tokens is missing")
    n = len(tokens)
    types = _kv_list(g, "tokenizer.ggml.token_type") or [NORMAL] * n
    if len(types) != n:
        raise ConfigError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    if model == "gpt2":
        merges = _kv_list(g, "tokenizer.ggml.merges")
        if merges is None:
            raise ConfigError(f"{where}: a gpt2 (BPE) vocabulary without tokenizer.ggml.merges")
        pre = g.kv.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise ConfigError(f"{where}: tokenizer.ggml.pre {pre!r}: this pre-tokenizer is not reproduced yet "
                              f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
        regexes, ignore_merges, bos_default = PRE_TOKENIZERS[pre]
        tj = bpe_json(tokens, types, merges, regexes, ignore_merges)
    elif model == "llama":
        scores = _kv_list(g, "tokenizer.ggml.scores")
        if scores is None or len(scores) != n:
            raise ConfigError(f"{where}: a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores for each token")
        unk = g.kv.get("tokenizer.ggml.unknown_token_id", 0)
        tj = spm_json(tokens, types, scores, unk, bool(g.kv.get("tokenizer.ggml.add_space_prefix", True)))
        bos_default = True
    else:
        raise ConfigError(f"{where}: tokenizer.ggml.model {model!r} is not supported (gpt2 BPE and llama "
                          f"SentencePiece vocabularies are)")

    def tok(key):
        i = g.kv.get(key)
        return tokens[i] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n else None

    bos, eos = g.kv.get("tokenizer.ggml.bos_token_id"), g.kv.get("tokenizer.ggml.eos_token_id")
    tc = {"add_bos_token": bool(g.kv.get("tokenizer.ggml.add_bos_token", bos_default)) and tok("tokenizer.ggml.bos_token_id") is not None,
          "add_eos_token": bool(g.kv.get("tokenizer.ggml.add_eos_token", False)),
          "bos_token": tok("tokenizer.ggml.bos_token_id"), "eos_token": tok("tokenizer.ggml.eos_token_id"),
          "unk_token": tok("tokenizer.ggml.unknown_token_id"), "pad_token": tok("tokenizer.ggml.padding_token_id"),
          "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    tc = {k: v for k, v in tc.items() if v is not None}
    tmpl = g.kv.get("tokenizer.chat_template")
    named = {k.split("tokenizer.chat_template.", 1)[1]: v for k, v in g.kv.items()
             if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
    if isinstance(tmpl, str) and named:
        tc["chat_template"] = [{"name": "default", "template": tmpl}] + [{"name": k, "template": v}
                                                                          for k, v in named.items()]
    elif isinstance(tmpl, str):
        tc["chat_template"] = tmpl
    stop = [i for i in (eos, g.kv.get("tokenizer.ggml.eot_token_id"), g.kv.get("tokenizer.ggml.eom_token_id"))
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n]
    index = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    stop += [index[t] for t in EOG_TEXTS if t in index]
    gc = {"eos_token_id": sorted(set(stop))}
    if isinstance(bos, int) and not isinstance(bos, bool):
        gc["bos_token_id"] = bos
    return {"tokenizer.json": tj, "tokenizer_config.json": json.dumps(tc, indent=1, ensure_ascii=False),
            "generation_config.json": json.dumps(gc, indent=1)}


def _added(tokens, types) -> list[dict]:
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": ty in (CONTROL, UNKNOWN)}
            for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, UNKNOWN, USER_DEFINED)]


def _vocab(tokens) -> dict[str, int]:
    v: dict[str, int] = {}
    for i, t in enumerate(tokens):
        v.setdefault(t, i)  # a repeated token keeps its first id, as llama.cpp's token_to_id map does
    return v


def bpe_json(tokens, types, merges, regexes, ignore_merges: bool) -> str:
    """tokenizer.json text of a byte-level BPE vocabulary with llama.cpp's pre-tokenizer ``regexes``."""
    pre = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes]
    pre.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added(tokens, types),
          "normalizer": None, "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
          "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                    "ignore_merges": ignore_merges, "vocab": _vocab(tokens),
                    "merges": [m.split(" ", 1) for m in merges if " " in m]}}
    return json.dumps(tj, ensure_ascii=False)


def spm_merges(tokens, types, scores) -> list[list[str]]:
    """The BPE merges reproducing llama.cpp's SPM tokenizer: for every token (byte tokens aside)
    and every split of its text into two tokens, that pair, ordered by the joined token's score,
    highest first (then by the token's id and the split's position)."""
    vocab = _vocab(tokens)
    found = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == BYTE or len(t) < 2 or vocab.get(t) != i:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                found.append((-float(scores[i]), i, k, a, b))
    found.sort()
    return [[a, b] for *_x, a, b in found]


def spm_json(tokens, types, scores, unk_id: int, add_space_prefix: bool) -> str:
    """tokenizer.json text of a SentencePiece ("llama") vocabulary, as llama.cpp tokenizes it."""
    norm = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    if add_space_prefix:
        norm.insert(0, {"type": "Prepend", "prepend": "\u2581"})
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added(tokens, types),
          "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": None, "post_processor": None,
          "decoder": {"type": "Sequence", "decoders": [
              {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
              {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if add_space_prefix else [])},
          "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                    "vocab": _vocab(tokens), "merges": spm_merges(tokens, types, scores)}}
    return json.dumps(tj, ensure_ascii=False)
