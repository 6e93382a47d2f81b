"""``colibri bench grammar``: the cost of constrained decoding's token mask, llguidance vs xgrammar.

For each tokenizer (the bundled model's, and a byte-level BPE of ``--big-vocab`` tokens trained
on Python source, the size of the large models' vocabularies) and each library, ``--runs`` random
walks through a JSON schema's language: at every step the library computes the mask of allowed
tokens (timed), one allowed token is drawn (seeded) and given back to the matcher (timed). The
per-request cost (a schema not seen before compiled to a matcher with its first mask) is
reported apart. The
llguidance row "as used" times the server's whole step (engine/server/grammar.TokenConstraint:
the mask unpacked to the bool array the sampler reads). No model runs: the mask's cost does not
depend on the weights.
"""

from __future__ import annotations

import glob
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import check_results_target, machine_info, md_table, write_results

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
               "properties": {"name": {"type": "string", "maxLength": 24},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                              "ok": {"type": "boolean"}}},
    "call": {"type": "object", "additionalProperties": False, "required": ["city", "days", "query"],
             "properties": {"city": {"type": "string", "maxLength": 32}, "days": {"type": "integer"},
                            "query": {"type": "string", "maxLength": 48}}},
}
SEPARATORS = (", ", ": ")


def _big_tokenizer(vocab: int, cache: Path):
    """A byte-level BPE of ``vocab`` tokens trained on the Python sources of this interpreter
    (cached in ``cache``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = cache / f"bpe{vocab}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))

    def texts():
        n = 0
        for f in sorted(glob.glob(sys.prefix + "/lib/python3*/**/*.py", recursive=True)):
            try:
                s = Path(f).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            n += len(s)
            yield s
            if n > 30e6:
                return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                         special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cache.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


class _LL:
    name = "llguidance"

    def __init__(self, hf, eos: int):
        import llguidance
        import llguidance.numpy as lnp
        self.lnp, self.llg = lnp, llguidance
        self.tok = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=eos)
        self.n = self.tok.vocab_size

    def matcher(self, schema):
        from ..server.grammar import json_rule
        m = self.llg.LLMatcher(self.tok, "start: " + json_rule(schema) + "\n", log_level=0)
        bits = self.lnp.allocate_token_bitmask(1, self.n)
        return m, bits

    def mask(self, state) -> np.ndarray:
        m, bits = state
        self.lnp.fill_next_token_bitmask(m, bits, 0)
        return bits

    def allowed(self, bits) -> np.ndarray:
        return np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:self.n])

    def accept(self, state, t: int) -> bool:
        return state[0].consume_token(t)

    def done(self, state) -> bool:
        return state[0].is_stopped()


class _XG:
    name = "xgrammar"

    def __init__(self, hf, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        fast = PreTrainedTokenizerFast(tokenizer_object=hf)
        self.info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=hf.get_vocab_size(), stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.n = self.info.vocab_size

    def matcher(self, schema):
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
        return self.xgr.GrammarMatcher(cg), self.xgr.allocate_token_bitmask(1, self.n)

    def mask(self, state):
        m, bits = state
        m.fill_next_token_bitmask(bits)
        return bits

    def allowed(self, bits) -> np.ndarray:
        b = bits[0].numpy().view(np.uint8)
        return np.flatnonzero(np.unpackbits(b, bitorder="little")[:self.n])

    def accept(self, state, t: int) -> bool:
        return state[0].accept_token(t)

    def done(self, state) -> bool:
        return state[0].is_terminated()


def _walks(lib, schema, runs: int, max_tokens: int, seed: int) -> dict:
    mask_s, accept_s, compile_s, tokens = [], [], [], 0
    for r in range(runs):
        rng = np.random.default_rng([seed, r])
        t0 = time.perf_counter()
        state = lib.matcher({**schema, "description": f"run {r}"})  # a new schema: no compile cache helps
        bits = lib.mask(state)
        compile_s.append(time.perf_counter() - t0)
        for _ in range(max_tokens):
            ok = lib.allowed(bits)
            if ok.size == 0 or lib.done(state):
                break
            t = int(rng.choice(ok))
            t1 = time.perf_counter()
            if not lib.accept(state, t):
                raise RuntimeError(f"{lib.name} refused a token its own mask allowed")
            t2 = time.perf_counter()
            if lib.done(state):
                break
            bits = lib.mask(state)
            t3 = time.perf_counter()
            accept_s.append(t2 - t1)
            mask_s.append(t3 - t2)
            tokens += 1
    ms, acc = np.array(mask_s) * 1e6, np.array(accept_s) * 1e6
    return {"tokens": tokens, "compile_ms": 1e3 * float(np.median(compile_s)),
            "mask_us_median": float(np.median(ms)), "mask_us_p90": float(np.percentile(ms, 90)),
            "accept_us_median": float(np.median(acc)),
            "step_us_mean": float((ms + acc).mean())}


def _as_used(hf, eos_id: int, schema, runs: int, max_tokens: int, seed: int) -> dict:
    """The server's step: TokenConstraint.mask (llguidance + unpacking to bool) and accept."""
    from ..server.grammar import TokenConstraint, json_grammar

    class Tok:  # the attributes TokenConstraint reads of engine.tokenizer.Tokenizer
        backend_tokenizer, vocab_size, eos_ids = hf, hf.get_vocab_size(), {eos_id}
    steps, tokens = [], 0
    for r in range(runs):
        rng = np.random.default_rng([seed, r])
        c = TokenConstraint(Tok, json_grammar(Tok, schema))
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            m = c.mask(Tok.vocab_size)
            ok = np.flatnonzero(m)
            if ok.size == 0 or c.done:
                break
            t = int(rng.choice(ok))
            c.accept(t)
            steps.append(time.perf_counter() - t0)
            tokens += 1
    s = np.array(steps) * 1e6
    return {"tokens": tokens, "step_us_median": float(np.median(s)), "step_us_mean": float(s.mean())}


def cmd_grammar(a) -> int:
    check_results_target(a.out_dir, a.name)
    from tokenizers import Tokenizer

    from ..library import default_model_dir
    toks = {"bundled": Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))}
    if a.big_vocab:
        toks[f"bpe{a.big_vocab}"] = _big_tokenizer(a.big_vocab, Path(a.cache or tempfile.gettempdir()) / "colibri-bench")
    rows = []
    for tname, hf in toks.items():
        eos = hf.token_to_id("<|endoftext|>")
        eos = eos if eos is not None else hf.get_vocab_size() - 1
        libs = [_LL(hf, eos)] + ([_XG(hf, eos)] if not a.no_xgrammar else [])
        for sname, schema in SCHEMAS.items():
            for lib in libs:
                rows.append({"tokenizer": tname, "vocab": hf.get_vocab_size(), "schema": sname, "library": lib.name,
                             **_walks(lib, schema, a.runs, a.max_tokens, a.seed)})
            u = _as_used(hf, eos, schema, a.runs, a.max_tokens, a.seed)
            rows.append({"tokenizer": tname, "vocab": hf.get_vocab_size(), "schema": sname,
                         "library": "llguidance as used", "tokens": u["tokens"], "step_us_mean": u["step_us_mean"],
                         "mask_us_median": u["step_us_median"]})
    table = md_table(rows, [("tokenizer", "tokenizer", ""), ("vocab", "vocab", "d"), ("schema", "schema", ""),
                            ("library", "library", ""), ("tokens", "tokens", "d"),
                            ("compile ms", "compile_ms", ".2f"), ("mask µs median", "mask_us_median", ".1f"),
                            ("mask µs p90", "mask_us_p90", ".1f"), ("accept µs", "accept_us_median", ".1f"),
                            ("step µs mean", "step_us_mean", ".1f")])
    table += ("\n\nmask: computing the allowed tokens after a token; accept: giving the matcher the drawn token; "
              "compile: the schema to a matcher and its first mask (once a request). \"as used\": the "
              "server's whole step with llguidance (mask unpacked to the sampler's bool array + accept).")
    write_results(a.name, {"machine": machine_info(), "runs": a.runs, "max_tokens": a.max_tokens, "seed": a.seed,
                           "schemas": SCHEMAS, "rows": rows}, table, out_dir=a.out_dir)
    return 0


def add_parser(bs) -> None:
    """Register ``grammar`` under ``colibri bench``."""
    p = bs.add_parser("grammar", help="constrained decoding: the token mask's cost per token, llguidance vs xgrammar")
    p.add_argument("--runs", type=int, default=20, help="random walks per schema and library")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per walk at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--big-vocab", type=int, default=65536,
                   help="also a byte-level BPE of this many tokens trained on Python source (0 = only the bundled one)")
    p.add_argument("--cache", default=None, help="folder for the trained tokenizer (default: the temp folder)")
    p.add_argument("--no-xgrammar", action="store_true", help="measure llguidance only (xgrammar not installed)")
    p.add_argument("--name", default="grammar_mask")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(fn=cmd_grammar)
