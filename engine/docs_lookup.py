"""Documentation lookup: the entries of a model's documentation index that best match a question,
given to the model with the question (retrieval-augmented generation, Lewis et al. 2020,
"Retrieval-Augmented Generation for Knowledge-Intensive NLP Tasks"; the desktop form is GPT4All's
LocalDocs).

A model folder (and the store converted from it) may ship ``docs_index.jsonl``: one JSON object
per line, ``{"name": "csv.reader", "kind": "function", "signature": "(csvfile, ...)",
"summary": "Return a reader object ..."}``. The bundled default model ships the docstring
summaries of the Python standard library it was built from (tools/train_default_model.py) and was
trained to answer from the block :func:`docs_block` renders; other models ship no index and are
never given one.

Ranking, in order:

1. names the question spells out: a backticked or dotted name equal to an entry's name, else the
   shortest entry whose name ends with it (```Path.glob``` -> ``pathlib.Path.glob``);
2. SQLite FTS5 full-text search (https://sqlite.org/fts5.html) over the name's words and the
   summary, Porter-stemmed, ranked by BM25 with the name's words weighted twice.

The index lives in an in-memory SQLite database built when it is opened (~10 k entries: ~0.1 s).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from .events import ChatMessage

INDEX_FILE = "docs_index.jsonl"
DOCS_PER_QUESTION = 3  # entries given with a question (what the default model was trained with)
HEADER = "Python documentation:"
MAX_SUMMARY_CHARS = 300
MAX_QUERY_WORDS = 48      # the first distinct words of a question that the full-text search uses
MAX_MEMO_CHARS = 8192     # longer questions are not memoized

_STOP = frozenset("""a an and are as at be by can do does for from how i in into is it its me my of on or
please show tell that the this to use using what when where which who why with you your explain
mean means work works way python""".split())
# the full-text score's prior: BM25 (lower is better) + _DEPTH_PENALTY per dot in the name -
# _USE_BONUS * ln(1 + uses); tuned on how-to questions about training modules (tools/
# train_default_model.py), not on the held-out ones
_DEPTH_PENALTY = 1.0
_USE_BONUS = 0.5
_NAME = re.compile(r"`([^`\s]{1,120})`|\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\b")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]+")


@dataclass(frozen=True)
class DocEntry:
    """One documented object: dotted ``name``, ``kind`` (function, class, method, module),
    ``signature`` ("(x, /)" or ""), and the docstring's first paragraph ``summary``."""

    name: str
    kind: str
    signature: str
    summary: str
    uses: int = 0  #: how often the library's own source uses it (the full-text ranking's prior)

    def line(self) -> str:
        """The entry as the model reads it: ``- `name`: summary`` (the summary cut at
        MAX_SUMMARY_CHARS). The name is written as the answer writes it, so the summary follows
        the same two tokens (name, "`:") in the block and in the answer: copying it is a plain
        induction step (Olsson et al. 2022); with the signature between them
        (``- `name(sig)`: ...``) a tiny model did not learn to copy in 1,000 steps."""
        s = self.summary if len(self.summary) <= MAX_SUMMARY_CHARS else self.summary[:MAX_SUMMARY_CHARS - 3] + "..."
        return f"- `{self.name}`: {s}"


def docs_block(entries) -> str:
    """The system message given before the question: HEADER then one :meth:`DocEntry.line` per
    entry. The default model's training renders it with this same function."""
    return "\n".join([HEADER] + [e.line() for e in entries])


def _role(m) -> str:
    return m.get("role", "") if isinstance(m, dict) else m.role


def last_user_text(messages) -> str | None:
    """The content of the last user message (ChatMessage or OpenAI-style dict), or None."""
    for m in reversed(tuple(messages)):
        if _role(m) == "user":
            c = m.get("content") if isinstance(m, dict) else m.content
            return c if isinstance(c, str) else None
    return None


def with_docs(messages, entries) -> tuple:
    """``messages`` (ChatMessage objects or OpenAI-style dicts) with a system message holding
    :func:`docs_block` inserted right before the last user message (of the same type as the
    messages); unchanged when ``entries`` is empty or there is no user message."""
    msgs = tuple(messages)
    last = max((i for i, m in enumerate(msgs) if _role(m) == "user"), default=None)
    if not entries or last is None:
        return msgs
    block = docs_block(entries)
    sys_msg = {"role": "system", "content": block} if isinstance(msgs[last], dict) else ChatMessage("system", block)
    return msgs[:last] + (sys_msg,) + msgs[last:]


def with_docs_each(messages, search) -> tuple:
    """``messages`` with, before every user message, a system message holding
    :func:`docs_block` of ``search(that message's text)`` (none where it finds nothing).

    Every turn keeps the block it was answered with (the search is deterministic), so the
    prompt of a chat's next turn starts with the previous turn's prompt and its KV rows are
    reused; a block only before the last question would change the prompt from the first
    turn on."""
    out = []
    for m in messages:
        if _role(m) == "user":
            c = m.get("content") if isinstance(m, dict) else m.content
            entries = search(c) if isinstance(c, str) and c else []
            if entries:
                block = docs_block(entries)
                out.append({"role": "system", "content": block} if isinstance(m, dict) else ChatMessage("system", block))
        out.append(m)
    return tuple(out)


MAX_NAME_CHARS = 200


def _parse_line(raw: bytes, first: bool) -> DocEntry | None:
    """One line of a docs_index.jsonl (bytes) -> a DocEntry, or None for a blank line.
    Raises ValueError saying what is wrong with it (the caller adds the file and line)."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start} of the line is {raw[exc.start:exc.start + 1]!r})") from None
    if not line.strip():
        return None
    try:
        d = json.loads(line)
    except RecursionError:
        raise ValueError("not a documentation entry (nested too deeply)") from None
    except ValueError as exc:
        raise ValueError(f"not a documentation entry (not JSON: {exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"not a documentation entry (a JSON {type(d).__name__}, not an object)")
    for key, need in (("name", True), ("summary", True), ("kind", False), ("signature", False)):
        v = d.get(key)
        if (v is None and need) or (v is not None and not isinstance(v, str)):
            raise ValueError(f'"{key}" must be text' + (" and is required" if need else ""))
    uses = d.get("uses", 0)
    if isinstance(uses, bool) or not isinstance(uses, int) or uses < 0:
        raise ValueError('"uses" must be a whole number >= 0')
    name, summary = d["name"].strip(), d["summary"]
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f'"name" has {len(name)} characters; at most {MAX_NAME_CHARS}')
    kind, sig = d.get("kind") or "", d.get("signature") or ""
    for key, v in (("name", name), ("summary", summary), ("kind", kind), ("signature", sig)):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f'"{key}" holds an unpaired surrogate (\\ud800-\\udfff), not text') from None
    if not name or not summary.strip():
        return None
    return DocEntry(name, kind, sig, summary, min(uses, 1 << 62))


def _name_words(name: str) -> str:
    return " ".join([name] + [w for w in re.split(r"[._]+", name) if w])


class DocsIndex:
    """A searchable documentation index (see the module docstring).

    Thread-safe: one lock around the SQLite connection; :meth:`search` results are memoized
    (a chat searches each of its questions again at every turn).
    """

    def __init__(self, entries: list[DocEntry], source: str = "<memory>"):
        first: dict[str, DocEntry] = {}
        for e in entries:
            first.setdefault(e.name, e)  # a name given twice keeps its first entry
        if not first:
            raise ValueError(f"{source}: the documentation index is empty")
        self.entries = list(first.values())
        self.source = source
        self._by_name = {}
        for i, e in enumerate(self.entries):
            self._by_name.setdefault(e.name, i)
        self._suffix: dict[str, list[int]] = {}
        for i, e in enumerate(self.entries):
            parts = e.name.split(".")
            for j in range(1, len(parts)):
                self._suffix.setdefault(".".join(parts[j:]), []).append(i)
        self._lock = threading.Lock()
        self._memo: dict[tuple[str, int], tuple[DocEntry, ...]] = {}
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(name, summary, prior UNINDEXED, "
                         "tokenize='porter unicode61')")
        self._db.executemany("INSERT INTO docs(rowid, name, summary, prior) VALUES (?, ?, ?, ?)",
                             [(i, _name_words(e.name), e.summary,
                               _DEPTH_PENALTY * e.name.count(".") - _USE_BONUS * math.log1p(max(0, e.uses)))
                              for i, e in enumerate(self.entries)])

    @classmethod
    def open(cls, path: str | Path) -> "DocsIndex":
        """Read a ``docs_index.jsonl`` file (UTF-8, an optional byte-order mark; blank lines
        skipped; a name given twice keeps its first entry).

        Raises:
            ValueError: the message names the file and the line: not UTF-8 text, not a JSON
                object, ``name`` / ``summary`` missing or not text, ``name`` longer than
                MAX_NAME_CHARS, ``kind`` / ``signature`` not text, ``uses`` not a whole number
                >= 0; or the file has no entries.
            OSError: the file cannot be read (a folder, no permission).
        """
        path = Path(path)
        entries, seen = [], set()
        with path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    e = _parse_line(raw, n == 1)
                except ValueError as exc:
                    raise ValueError(f"{path}, line {n}: {exc}") from None
                if e is not None and e.name not in seen:
                    seen.add(e.name)
                    entries.append(e)
        return cls(entries, str(path))

    def __len__(self) -> int:
        return len(self.entries)

    def named(self, text: str) -> list[DocEntry]:
        """Entries for the names ``text`` spells out (backticked or dotted), in order of
        appearance: exact name, else the shortest name ending with ``.`` + it."""
        out, seen = [], set()
        for m in _NAME.finditer(text):
            name = (m.group(1) or m.group(2)).strip("().,:;?!")
            name = re.sub(r"\(.*$", "", name)
            i = self._by_name.get(name)
            if i is None:
                cands = self._suffix.get(name, [])
                if cands:
                    i = min(cands, key=lambda c: (len(self.entries[c].name), c))
            if i is not None and i not in seen:
                seen.add(i)
                out.append(self.entries[i])
        return out

    def search(self, text: str, k: int = DOCS_PER_QUESTION) -> list[DocEntry]:
        """The ``k`` entries that best match ``text`` (a question): named entries first, then
        BM25 full-text matches. Empty when nothing matches. Deterministic (ties by index order).
        """
        if k <= 0:
            return []
        if len(text) > MAX_MEMO_CHARS:  # a pasted file: searched each time, not kept
            return self._search(text, k)
        key = (text, k)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tuple(self._search(text, k))
            if len(self._memo) > 1024:
                self._memo.pop(next(iter(self._memo)))
        return list(hit)

    def _search(self, text: str, k: int) -> list[DocEntry]:
        out = self.named(text)[:k]
        words = [w.lower() for w in _WORD.findall(text)]
        words = list(dict.fromkeys(w for w in words if w not in _STOP))[:MAX_QUERY_WORDS]
        if len(out) < k and words:
            q = " OR ".join(f'"{w}"*' if len(w) >= 4 else f'"{w}"' for w in words)  # read* finds reader
            with self._lock:
                rows = self._db.execute("SELECT rowid FROM docs WHERE docs MATCH ? "
                                        "ORDER BY bm25(docs, 2.0, 1.0, 0.0) + prior, rowid LIMIT ?",
                                        (q, 2 * k + len(out))).fetchall()
            have = {e.name for e in out}
            for (i,) in rows:
                e = self.entries[i]
                if e.name not in have:
                    have.add(e.name)
                    out.append(e)
                if len(out) >= k:
                    break
        return out[:k]


class CopyPrior:
    """The copy distribution of the looked-up entries, mixed into the model's next-token
    distribution (``SamplingParams.docs_copy`` = lambda): p = (1 - lambda) p_model + lambda p_copy
    when the answer is repeating one entry, p_model otherwise.

    p_copy: the token that follows the longest suffix (MIN_MATCH..MAX_MATCH tokens) of the
    answer so far found in the entries (``- `name`: summary`` with the whole summary, each
    tokenized alone), when every place that suffix occurs continues with that same token; where
    the places disagree (``json.dump`` / ``json.dumps``, ``Counter`` / ``Counter.update``) the
    model chooses alone, so the prior never picks an entry for it. A token that would repeat an
    (n+1)-gram the answer already holds is not proposed (no loops). This is the interpolation of
    kNN-LM (Khandelwal et al. 2020, "Generalization through Memorization: Nearest Neighbor
    Language Models") with the looked-up entries as the datastore; the pointer-generator's copy
    distribution (See et al. 2017) plays the same role. The model still writes every token.
    Deterministic: greedy answers stay reproducible.
    """

    MIN_MATCH, MAX_MATCH = 2, 16

    def __init__(self, sequences: list[list[int]], weight: float):
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"docs_copy {weight}: must be in [0, 1]")
        self.seqs = [list(map(int, s)) for s in sequences if len(s) > self.MIN_MATCH]
        self.weight = float(weight)

    @classmethod
    def for_entries(cls, tokenizer, entries, weight: float) -> "CopyPrior | None":
        """A prior over ``entries`` (DocEntry: ``- `name`: summary`` with the summary whole)
        tokenized with ``tokenizer`` (engine Tokenizer), or None when there is nothing to copy
        or the weight is 0."""
        if not entries or weight <= 0:
            return None
        return cls([tokenizer.encode(f"- `{e.name}`: {e.summary}") for e in entries], weight)

    def propose(self, generated) -> dict[int, float] | None:
        """p_copy as {token id: 1.0} for the answer's ids so far, or None (no match, the
        matches disagree, or the token would repeat what the answer already says)."""
        g = [int(t) for t in generated]
        tail_max = g[-self.MAX_MATCH:]
        for n in range(min(len(tail_max), self.MAX_MATCH), self.MIN_MATCH - 1, -1):
            tail = tail_max[-n:]
            nxt = {s[i + n] for s in self.seqs for i in range(len(s) - n) if s[i:i + n] == tail}
            if not nxt:
                continue
            if len(nxt) > 1:
                return None
            t = nxt.pop()
            gram = tail + [t]
            if any(g[i:i + n + 1] == gram for i in range(len(g) - n)):
                return None
            return {t: 1.0}
        return None


def write_index(entries, path: str | Path) -> None:
    """Write ``entries`` (DocEntry or dicts with name, kind, signature, summary) as a
    ``docs_index.jsonl`` at ``path`` (temp file, fsync, rename)."""
    from .fsutil import atomic_write_text
    lines = []
    for e in entries:
        d = e if isinstance(e, dict) else e.__dict__
        row = {k: d.get(k, "") for k in ("name", "kind", "signature", "summary")}
        if d.get("uses"):
            row["uses"] = int(d["uses"])
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
