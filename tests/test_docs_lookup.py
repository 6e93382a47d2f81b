"""Documentation lookup (engine.docs_lookup): a model that ships
docs_index.jsonl is given the index entries matching each question, right before it; the answer
names them; off, or without an index, the prompt is exactly the plain chat."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import ChatMessage, Engine, EngineConfig, Finished, GenerateRequest, StoreError, convert_checkpoint
from engine.docs_lookup import HEADER, INDEX_FILE, DocEntry, DocsIndex, docs_block, with_docs, with_docs_each, write_index
from engine.events import SamplingParams

ENTRIES = [
    DocEntry("csv.reader", "function", "(csvfile, dialect='excel')", "Return a reader object that iterates over lines of a CSV file."),
    DocEntry("csv.writer", "function", "(csvfile)", "Return a writer object that writes rows to a CSV file."),
    DocEntry("json.dumps", "function", "(obj)", "Serialize obj to a JSON formatted str."),
    DocEntry("json.dump", "function", "(obj, fp)", "Serialize obj as a JSON formatted stream to fp."),
    DocEntry("pathlib.Path.glob", "method", "(self, pattern)", "Iterate over this subtree and yield all existing files matching the pattern."),
    DocEntry("glob.glob", "function", "", "Return a list of paths matching a pathname pattern."),
    DocEntry("cmath.tan", "function", "(z, /)", "Return the tangent of z."),
    DocEntry("math.tan", "function", "(x, /)", "Return the tangent of x (measured in radians)."),
    DocEntry("tempfile.mkdtemp", "function", "(suffix=None)", "Create and return a unique temporary directory."),
]


@pytest.fixture(scope="module")
def index():
    return DocsIndex(ENTRIES)


def names(es):
    return [e.name for e in es]


def test_a_named_object_comes_first(index):
    assert names(index.search("What does `json.dumps` do?"))[0] == "json.dumps"
    assert names(index.search("What does json.dump do?"))[0] == "json.dump"          # dotted, no backticks
    assert names(index.search("What is `Path.glob`?"))[0] == "pathlib.Path.glob"     # a suffix of the name
    assert names(index.search("Explain `cmath.tan()` please"))[0] == "cmath.tan"     # call parentheses
    assert names(index.search("compare `math.tan` and `cmath.tan`"))[:2] == ["math.tan", "cmath.tan"]


def test_full_text_ranks_by_the_question_words(index):
    got = names(index.search("How do I read a CSV file?"))
    assert got[0] == "csv.reader" and "csv.writer" in got
    assert names(index.search("How do I make a temporary directory?"))[0] == "tempfile.mkdtemp"
    assert index.search("zzz qqq") == [] and index.search("") == []                   # nothing matches
    assert len(index.search("Return a file", k=2)) == 2 and index.search("csv", k=0) == []
    assert index.search("How do I read a CSV file?") == index.search("How do I read a CSV file?")
    # a pasted file as the question: bounded work, still an answer; odd characters are plain text
    big = "How do I read a CSV file? " + " ".join(f"word{i}" for i in range(20000))
    assert names(index.search(big))[0] == "csv.reader"
    assert index.search('`"` OR * NEAR( ) ^ -csv {col}: "read"') is not None


def test_block_and_placement():
    block = docs_block(ENTRIES[:2])
    assert block.splitlines()[0] == HEADER
    assert block.splitlines()[1] == "- `csv.reader`: " + ENTRIES[0].summary     # as the answer writes it
    long = DocEntry("m.f", "function", "(" + "a, " * 40 + ")", "x" * 400)
    assert long.line().startswith("- `m.f`: ") and long.line().endswith("...") and len(long.line()) < 320
    msgs = (ChatMessage("system", "be terse"), ChatMessage("user", "a"), ChatMessage("assistant", "b"),
            ChatMessage("user", "c"))
    out = with_docs(msgs, ENTRIES[:1])
    assert [m.role for m in out] == ["system", "user", "assistant", "system", "user"]
    assert out[3].content == docs_block(ENTRIES[:1]) and out[4].content == "c"
    assert with_docs(msgs, []) == msgs
    dicts = [{"role": "user", "content": "q"}]
    assert with_docs(dicts, ENTRIES[:1])[0] == {"role": "system", "content": docs_block(ENTRIES[:1])}


GOOD = '{"name": "a.b", "summary": "Do b."}\n'


@pytest.mark.parametrize("bad, says", [
    (b"{not json\n", "not JSON"),
    (b'{"name": "x"}\n', '"summary" must be text'),                 # no summary
    (b'{"name": 3, "summary": "s"}\n', '"name" must be text'),
    (b'{"name": null, "summary": "s"}\n', '"name" must be text'),
    (b'{"name": ["a"], "summary": {"x": 1}}\n', '"name" must be text'),
    (b'{"name": "a", "summary": "s", "kind": 1}\n', '"kind" must be text'),
    (b'{"name": "a", "summary": "s", "uses": 1e400}\n', '"uses" must be a whole number'),
    (b'{"name": "a", "summary": "s", "uses": -1}\n', '"uses" must be a whole number'),
    (b'{"name": "a", "summary": "s", "uses": true}\n', '"uses" must be a whole number'),
    (b"[" * 100000 + b"]" * 100000 + b"\n", "nested too deeply"),
    (b'["a"]\n', "not an object"),
    (b'{"name": "caf\xe9", "summary": "s"}\n', "not UTF-8"),                 # Latin-1
    (b'{"name": "a", "summary": "bad \\ud800 x"}\n', "unpaired surrogate"),
    (b'{"name": "' + b"n" * 300 + b'", "summary": "s"}\n', "at most 200"),
])
def test_each_bad_line_is_named(tmp_path, bad, says):
    p = tmp_path / INDEX_FILE
    p.write_bytes(GOOD.encode() + bad)
    with pytest.raises(ValueError) as e:
        DocsIndex.open(p)
    assert str(p) in str(e.value) and "line 2" in str(e.value) and says in str(e.value), str(e.value)


def test_index_file_round_trip_bom_duplicates_and_empty(tmp_path):
    p = tmp_path / INDEX_FILE
    write_index(ENTRIES, p)
    assert DocsIndex.open(p).entries == ENTRIES
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())          # a byte-order mark (Windows editors)
    assert DocsIndex.open(p).entries == ENTRIES
    dup = '{"name": "json.dumps", "summary": "An impostor."}\n'
    p.write_text(p.read_text(encoding="utf-8-sig") + dup * 5)   # a name given twice keeps its first entry
    ix = DocsIndex.open(p)
    assert len(ix) == len(ENTRIES) and names(ix.search("What does json.dumps do? JSON"))[:2] == ["json.dumps", "json.dump"]
    p.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        DocsIndex.open(p)


# --- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_store(tiny_checkpoint, tmp_path_factory):
    """The tiny chat model converted from a folder that ships docs_index.jsonl (convert copies it)."""
    src = tmp_path_factory.mktemp("docs") / "ck"
    shutil.copytree(tiny_checkpoint, src)
    write_index(ENTRIES, src / INDEX_FILE)
    st = convert_checkpoint(src, tmp_path_factory.mktemp("docs") / "st", quant="int8")
    assert (st / INDEX_FILE).read_bytes() == (src / INDEX_FILE).read_bytes()
    return st


def _cfg(store, **kw):
    return EngineConfig(store=str(store), pilot=0, pinning=False, history=False, o_direct=False, **kw)


def _fin(eng, req) -> Finished:
    return [e for e in eng.generate(req) if isinstance(e, Finished)][-1]


def test_engine_gives_the_entries_before_the_question_and_reports_them(docs_store):
    q = (ChatMessage("user", "What does `json.dumps` do?"),)
    with Engine.open(_cfg(docs_store)) as eng:
        if not eng.has_chat_template:
            pytest.skip("the tiny model has no chat template")
        assert eng.loaded.docs_entries == len(ENTRIES)
        on = GenerateRequest(messages=q, sampling=SamplingParams(max_new_tokens=3))
        off = GenerateRequest(messages=q, sampling=SamplingParams(max_new_tokens=3, docs_lookup=False))
        expect = eng.docs.search(q[0].content, 3)
        assert names(expect)[0] == "json.dumps"
        assert eng.prompt_ids(on) == eng.tokenizer.encode_chat(with_docs(q, expect))
        assert eng.prompt_ids(off) == eng.tokenizer.encode_chat(q)
        fin = _fin(eng, on)
        assert fin.sources == tuple(names(expect)) and fin.prompt_tokens == len(eng.prompt_ids(on))
        assert _fin(eng, off).sources == ()
        raw = GenerateRequest(prompt="What does json.dumps do?", sampling=SamplingParams(max_new_tokens=2))
        assert _fin(eng, raw).sources == ()                 # raw prompts are never changed


def test_each_turn_keeps_its_block_so_the_next_turn_reuses_the_prefill(docs_store):
    with Engine.open(_cfg(docs_store)) as eng:
        if not eng.has_chat_template:
            pytest.skip("the tiny model has no chat template")
        t1 = [ChatMessage("user", "What does `json.dumps` do?")]
        f1 = _fin(eng, GenerateRequest(messages=tuple(t1), sampling=SamplingParams(max_new_tokens=4)))
        t2 = t1 + [ChatMessage("assistant", f1.text), ChatMessage("user", "And `cmath.tan`?")]
        ids1, ids2 = eng.prompt_ids(GenerateRequest(messages=tuple(t1))), eng.prompt_ids(GenerateRequest(messages=tuple(t2)))
        assert ids2[:len(ids1)] == ids1                       # turn 1's prompt, block included
        assert ids2 == eng.tokenizer.encode_chat(with_docs_each(t2, eng.docs.search))
        text = eng.tokenizer.decode(ids2, skip_special_tokens=False)
        second = text.rindex(HEADER)
        assert text.count(HEADER) == 2 and second < text.index("- `cmath.tan`: ", second) < text.index("And `cmath")
        f2 = _fin(eng, GenerateRequest(messages=tuple(t2), sampling=SamplingParams(max_new_tokens=4)))
        assert f2.sources[0] == "cmath.tan"


def test_a_trimmed_chat_keeps_the_block_before_the_last_question(docs_store):
    with Engine.open(_cfg(docs_store, context_length=256)) as eng:
        if not eng.has_chat_template:
            pytest.skip("the tiny model has no chat template")
        msgs = [ChatMessage("system", "You are terse.")]
        for i in range(6):
            msgs += [ChatMessage("user", f"question {i} " + "abc " * 40), ChatMessage("assistant", "xyz " * 40)]
        msgs.append(ChatMessage("user", "How do I read a CSV file?"))
        req = GenerateRequest(messages=tuple(msgs), sampling=SamplingParams(max_new_tokens=16))
        ids, dropped = eng.fit_prompt(req)
        assert dropped >= 2
        kept = tuple(msgs[:1]) + tuple(msgs[1 + dropped:])
        assert ids == eng.tokenizer.encode_chat(with_docs_each(kept, eng.docs.search))
        assert eng.lookup(req)[0].name == "csv.reader"
        text = eng.tokenizer.decode(ids, skip_special_tokens=False)
        assert text.index(HEADER) < text.index("How do I read a CSV file?") and "csv.reader" in text


def test_default_placement_never_changes_with_the_lookup_off_index_or_not(tiny_store, docs_store):
    """Without an index, or with the lookup off, the tokens are those of the plain chat."""
    q = (ChatMessage("user", "What does `json.dumps` do?"),)
    sp = SamplingParams(max_new_tokens=6, docs_lookup=False)
    with Engine.open(_cfg(tiny_store)) as a, Engine.open(_cfg(docs_store)) as b:
        if not a.has_chat_template:
            pytest.skip("the tiny model has no chat template")
        assert a.docs is None and a.loaded.docs_entries == 0
        fa = _fin(a, GenerateRequest(messages=q, sampling=SamplingParams(max_new_tokens=6)))
        fb = _fin(b, GenerateRequest(messages=q, sampling=sp))
        assert fa.token_ids == fb.token_ids and fa.sources == fb.sources == ()


def test_a_broken_index_is_named_and_the_model_runs_without_it(docs_store, tmp_path, capsys):
    bad = tmp_path / "st"
    shutil.copytree(docs_store, bad)
    (bad / INDEX_FILE).write_text('{"name": 3\n')
    q = (ChatMessage("user", "What does `json.dumps` do?"),)
    with Engine.open(_cfg(bad)) as eng:
        assert eng.docs is None and eng.loaded.docs_entries == 0
        assert INDEX_FILE in eng.loaded.docs_problem and "line 1" in eng.loaded.docs_problem
        if eng.has_chat_template:
            fin = _fin(eng, GenerateRequest(messages=q, sampling=SamplingParams(max_new_tokens=2)))
            assert fin.sources == () and fin.prompt_tokens == len(eng.tokenizer.encode_chat(q))
    from engine.cli.main import main
    assert main(["run", "--model", str(bad), "--prompt", "hi", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "line 1" in err and "Traceback" not in err


def test_convert_refuses_a_broken_index_before_writing(tiny_checkpoint, tmp_path):
    from engine import CheckpointError
    src = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, src)
    (src / INDEX_FILE).write_text(GOOD + '{"name": "x", "summ')          # cut mid-line
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(src, tmp_path / "st", quant="int8")
    assert "line 2" in str(e.value) and "delete it" in str(e.value) and not (tmp_path / "st").exists()


def test_the_entries_are_left_out_when_only_the_question_fits(docs_store):
    """A question that fits the context alone is answered without the entries, not refused."""
    with Engine.open(_cfg(docs_store, context_length=128)) as eng:
        if not eng.has_chat_template:
            pytest.skip("the tiny model has no chat template")
        text = "What does `json.dumps` do?"
        while len(eng.tokenizer.encode_chat((ChatMessage("user", text + " ok"),))) < 120:
            text += " ok"
        req = GenerateRequest(messages=(ChatMessage("user", text),), sampling=SamplingParams(max_new_tokens=4))
        assert eng.lookup(req) and len(eng.prompt_ids(req)) >= 128          # with the block: too long
        fin = _fin(eng, req)
        assert fin.finish_reason != "error" and fin.sources == ()
        assert fin.prompt_tokens == len(eng.tokenizer.encode_chat(req.messages)) < 128


def test_cli_run_names_what_it_looked_up(docs_store, capsys):
    from engine.cli.main import main
    with Engine.open(_cfg(docs_store)) as eng:
        if not eng.has_chat_template:
            pytest.skip("the tiny model has no chat template")
    rc = main(["run", "--model", str(docs_store), "--prompt", "What does `cmath.tan` do?", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0 and "looked up: cmath.tan" in err
    rc = main(["run", "--model", str(docs_store), "--prompt", "What does `cmath.tan` do?", "--max-new-tokens", "2",
               "--no-docs-lookup"])
    assert rc == 0 and "looked up" not in capsys.readouterr().err


def test_the_default_model_ships_an_index_of_its_python():
    from engine.library import default_model_dir
    p = default_model_dir() / INDEX_FILE
    if not (default_model_dir() / "model.safetensors").exists():
        pytest.skip("default model not trained yet")
    ix = DocsIndex.open(p)
    log = json.loads((default_model_dir() / "training_log.json").read_text())
    held = set(log["corpus"]["heldout_top_level_modules"])
    # the held-out modules are in the index (they are part of the user's Python) ...
    assert any(e.name.split(".")[0] in held for e in ix.entries)
    assert names(ix.search("What does `json.dumps` do?"))[0] == "json.dumps"


# --- copy from documentation (CopyPrior, SamplingParams.docs_copy) ------------------------------


def test_copy_prior_follows_one_entry_never_chooses_between_entries():
    from engine.docs_lookup import CopyPrior
    cp = CopyPrior([[1, 2, 3, 4, 5], [9, 2, 3, 7], [2, 3, 8]], 0.5)
    assert cp.propose([]) is None and cp.propose([3]) is None         # fewer than 2 tokens: no match
    assert cp.propose([2, 3]) is None                                 # three entries disagree: the model picks
    assert cp.propose([1, 2, 3]) == {4: 1.0}                          # the longest suffix is one entry
    assert cp.propose([6, 9, 2, 3]) == {7: 1.0}
    assert cp.propose([4, 5]) is None                                 # the end of an entry: nothing
    same = CopyPrior([[1, 2, 3, 4], [8, 2, 3, 4]], 0.5)
    assert same.propose([2, 3]) == {4: 1.0}                           # places that agree
    rep = CopyPrior([[1, 5, 6, 5, 6, 7]], 1.0)
    assert rep.propose([1, 5, 6]) == {5: 1.0} and rep.propose([1, 5, 6, 5, 6]) == {7: 1.0}
    assert rep.propose([5, 6]) is None                                # inside the entry, two places disagree
    loop = CopyPrior([[1, 2, 3]], 1.0)
    assert loop.propose([1, 2]) == {3: 1.0}
    assert loop.propose([1, 2, 3, 1, 2]) is None                      # would say "1 2 3" again: not proposed
    with pytest.raises(ValueError, match="docs_copy"):
        CopyPrior([[1, 2, 3]], 1.5)


def test_sampler_mixes_the_copy_distribution():
    import numpy as np

    from engine.sampling import Sampler
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert greedy(logits) == 0
    assert greedy(logits, (), (0.5, {2: 1.0})) == 2                   # 0.5*0.1 + 0.5 > 0.5*0.6
    assert greedy(logits, (), (0.2, {2: 1.0})) == 0                   # 0.8*0.1 + 0.2 < 0.8*0.6
    assert greedy(logits, (), (0.0, {2: 1.0})) == 0
    hot = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = [hot(logits, (), (1.0, {1: 1.0})) for _ in range(20)]
    assert set(draws) == {1}                                          # lambda 1: only what continues an entry


def test_copy_changes_no_placement_and_zero_is_the_model_alone(docs_store):
    q = (ChatMessage("user", "What does `json.dumps` do?"),)
    outs = {}
    for cap in (2, None):
        with Engine.open(_cfg(docs_store, cap=cap)) as eng:
            if not eng.has_chat_template:
                pytest.skip("the tiny model has no chat template")
            for lam in (0.0, 0.9):
                fin = _fin(eng, GenerateRequest(messages=q, sampling=SamplingParams(max_new_tokens=12, docs_copy=lam)))
                outs[cap, lam] = fin.token_ids
            ids = eng.prompt_ids(GenerateRequest(messages=q))
            plain = [e for e in eng.generate(GenerateRequest(prompt_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=12)))
                     if isinstance(e, Finished)][-1]
            assert plain.token_ids == outs[cap, 0.0]                  # docs_copy 0: the model's own tokens
    assert outs[2, 0.0] == outs[None, 0.0] and outs[2, 0.9] == outs[None, 0.9]
