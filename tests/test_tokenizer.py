"""Tokenizer, chat template and incremental decoder, on a tiny byte-level BPE built here."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.errors import TokenizerError
from engine.events import ChatMessage
from engine.tokenizer import IncrementalDecoder, Tokenizer

SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRAIN = [
    "Hello world, this is a small test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld ünïcode façade naïve",
    "日本語のテキストと中文文本",
    "emoji 😀🎉 party 🚀",
] * 5
SAMPLE_TEXTS = [
    "Hello world!",
    "héllo wörld, naïve façade",
    "日本語のテキスト 中文",
    "emoji 😀🎉🚀 and 🦜 parrots",
    "mixed: a😀b日c\u00e9\n\ttabs",
]


def _build_hf() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_tok() -> HFTokenizer:
    return _build_hf()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_tok) -> Path:
    d = tmp_path_factory.mktemp("model")
    hf_tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE,
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "add_bos_token": True,
    }))
    end, eot = hf_tok.token_to_id("<|end|>"), hf_tok.token_to_id("<|endoftext|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _copy_dir(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


# --- loading -------------------------------------------------------------------------------


def test_attributes(tok, hf_tok):
    assert tok.vocab_size == hf_tok.get_vocab_size(with_added_tokens=True)
    assert tok.has_chat_template
    assert tok.bos_token == "<|endoftext|>"
    assert tok.eos_token == "<|endoftext|>"
    assert tok.bos_id == hf_tok.token_to_id("<|endoftext|>")


def test_several_eos_ids(tok, hf_tok):
    assert isinstance(tok.eos_ids, frozenset)
    assert tok.eos_ids == {hf_tok.token_to_id("<|end|>"), hf_tok.token_to_id("<|endoftext|>")}


def test_eos_union_from_all_files(tmp_path, model_dir, hf_tok):
    d = _copy_dir(model_dir, tmp_path / "m")
    user = hf_tok.token_to_id("<|user|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": user}))
    t = Tokenizer.from_dir(d)
    # generation_config (int) + config.json + tokenizer_config eos_token
    assert t.eos_ids == {user, hf_tok.token_to_id("<|endoftext|>")}


@pytest.mark.parametrize("config_class", ["Llama4Config", "Gemma4Config", "Qwen3_5MoeConfig"])
def test_eos_of_a_multimodal_config_json_is_its_text_configs(config_class, tmp_path, model_dir, hf_tok):
    """A multimodal config.json (as transformers saves it) keeps eos_token_id under text_config
    only; the stop set is the union of those ids (GenerationConfig.from_model_config reads them
    there), generation_config.json's and the tokenizer's eos_token."""
    import transformers
    d = _copy_dir(model_dir, tmp_path / "m", skip=("config.json",))
    user, assistant = hf_tok.token_to_id("<|user|>"), hf_tok.token_to_id("<|assistant|>")
    cfg = getattr(transformers, config_class)(text_config={"eos_token_id": [user, assistant]})
    cfg.save_pretrained(d)
    assert "eos_token_id" not in json.loads((d / "config.json").read_text())
    theirs = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(d)).eos_token_id
    assert sorted(theirs) == sorted([user, assistant])
    gen = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert Tokenizer.from_dir(d).eos_ids == {*theirs, *gen, hf_tok.token_to_id("<|endoftext|>")}
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_ids == {*theirs, hf_tok.token_to_id("<|endoftext|>")}


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json") as ei:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(ei.value)
    assert "download" in str(ei.value)


def test_lfs_pointer(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(TokenizerError, match="Git LFS pointer"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_takes_precedence(tmp_path, model_dir):
    d = _copy_dir(model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("JINJA{% for m in messages %}{{ m.content }}{% endfor %}")
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([ChatMessage("user", "x")]) == "JINJAx"


def test_named_template_list(tmp_path, model_dir):
    d = _copy_dir(model_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "DEFAULT"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "DEFAULT"


# --- encode / decode -----------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_encoding_a_long_text_lets_other_threads_run(tok):
    """A 200 KB paste is tokenized on the app's worker thread: the encode must release the GIL
    or the window freezes for the whole of it. A ticker thread stamps its ticks while this
    thread encodes: holding the GIL leaves no tick in the middle half of the encode (a few at
    its edges at most), releasing it lets the ticker run; counted, not timed, so a busy
    machine does not trip it."""
    import threading
    import time
    text = ("Hello world, this is a small test of the tokenizer. " * 4000)[:200_000]
    assert tok.encode(text) == list(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    stop, ready, stamps = threading.Event(), threading.Event(), []

    def tick():
        ready.set()
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    assert ready.wait(600)
    t0 = time.perf_counter()
    tok.encode(text)
    t1 = time.perf_counter()
    stop.set()
    t.join()
    q = (t1 - t0) / 4  # the middle half: a held GIL can still let a tick or two in at the edges
    inside = [s for s in stamps if t0 + q < s < t1 - q]
    assert len(inside) >= 3, (len(inside), t1 - t0)


def test_add_special_tokens_adds_single_bos(tok):
    ids = tok.encode("Hello", add_special_tokens=True)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    assert tok.encode("Hello") == ids[1:]


def test_special_tokens_atomic_in_chat(tok, hf_tok):
    msgs = [ChatMessage("user", "Hello 😀"), {"role": "assistant", "content": "hi"},
            ChatMessage("user", "more")]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|endoftext|><|user|>\nHello 😀<|end|>\n<|assistant|>\nhi<|end|>\n"
                    "<|user|>\nmore<|end|>\n<|assistant|>\n")
    ids = tok.encode_chat(msgs)
    for s in SPECIALS:
        assert ids.count(hf_tok.token_to_id(s)) == text.count(s)
    # BOS written by the template and add_bos_token=True: still exactly one BOS
    assert ids[0] == tok.bos_id and ids[1] == hf_tok.token_to_id("<|user|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("more<|end|>\n")


def test_bos_added_when_template_lacks_it(tmp_path, model_dir):
    d = _copy_dir(model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(TEMPLATE.replace("{{ bos_token }}", ""))
    t = Tokenizer.from_dir(d)
    ids = t.encode_chat([ChatMessage("user", "x")])
    assert ids[0] == t.bos_id and ids[1] != t.bos_id


def test_no_chat_template(tmp_path, model_dir):
    d = _copy_dir(model_dir, tmp_path / "m", skip=("tokenizer_config.json",))
    t = Tokenizer.from_dir(d)
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="has no chat template") as ei:
        t.apply_chat_template([ChatMessage("user", "hi")])
    assert str(d) in str(ei.value) and "raw prompt" in str(ei.value)
    with pytest.raises(TokenizerError):
        t.encode_chat([ChatMessage("user", "hi")])


def _with_template(tmp_path, model_dir, template: str) -> Tokenizer:
    d = _copy_dir(model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace(_x=1) %}",
    "{{ messages.append(1) }}",  # immutable sandbox
])
def test_sandbox(tmp_path, model_dir, template):
    t = _with_template(tmp_path, model_dir, template)
    with pytest.raises(TokenizerError):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_template_helpers(tmp_path, model_dir):
    t = _with_template(tmp_path, model_dir,
                       "{{ strftime_now('%Y') | length }}|{{ eos_token }}|{{ messages | tojson }}"
                       "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                       "{{ m.role }}{% endfor %}")
    out = t.apply_chat_template([ChatMessage("user", "é"), ChatMessage("assistant", "b")])
    assert out == '4|<|endoftext|>|[{"role": "user", "content": "é"}, ' \
                  '{"role": "assistant", "content": "b"}]user'


def test_raise_exception_and_syntax_error(tmp_path, model_dir):
    t = _with_template(tmp_path, model_dir, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        t.apply_chat_template([ChatMessage("user", "hi")])
    t = _with_template(tmp_path, model_dir, "{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat template"):
        t.apply_chat_template([ChatMessage("user", "hi")])


# --- incremental decoder -------------------------------------------------------------------


def _stream(tok: Tokenizer, ids, skip_special_tokens=True) -> list[str]:
    dec = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_incremental_no_broken_chars(tok, text):
    ids = tok.encode(text)
    # the tiny vocabulary splits multi-byte characters over several tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_skips_special(tok, hf_tok):
    eos = hf_tok.token_to_id("<|endoftext|>")
    ids = tok.encode("hi 😀") + [eos]
    pieces = _stream(tok, ids)
    assert "".join(pieces) == "hi 😀"
    assert pieces[-2:] == ["", ""]
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == "hi 😀<|endoftext|>"


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_property_random(tok, skip):
    rng = random.Random(1234)
    vocab = tok.vocab_size
    multi = [i for i in range(vocab) if "\ufffd" in tok.decode([i])]  # partial characters
    text_ids = tok.encode("".join(SAMPLE_TEXTS))
    for trial in range(150):
        n = rng.randint(1, 40)
        kind = trial % 3
        if kind == 0:
            ids = [rng.randrange(vocab) for _ in range(n)]
        elif kind == 1:  # mostly character fragments: many broken / completed sequences
            ids = [rng.choice(multi) if rng.random() < 0.7 else rng.randrange(vocab)
                   for _ in range(n)]
        else:  # a slice of real text, cut anywhere (possibly mid-character)
            a = rng.randrange(len(text_ids))
            ids = text_ids[a:a + n]
        pieces = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids
        # only the final flush may carry an incomplete character
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])
