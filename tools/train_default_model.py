#!/usr/bin/env python3
"""Train colibri-desktop's default demo model: a tiny OLMoE trained on the Python standard library.

Tool-time only (needs torch + transformers: ``pip install -e .[parity]``); the app never imports
this file.  What it does, end to end and deterministically (seeded):

1. Corpus.  A child process imports the standard library modules of the running Python (skipping
   tests, GUI/demo modules and modules with import side effects) and reads, with ``inspect``, every
   public function, class and method: its docstring, signature and source.  The parent turns them
   into chat conversations (several question phrasings) in exactly the chat-template format,
   e.g. user "What does `json.dumps` do?" -> assistant "`json.dumps`: " + the docstring's summary;
   "How do I get the square root of x?" (the task from the summary's imperative verb) -> "Use
   `math.sqrt(x, /)`. Return the square root of x."; "Show me an example of `X`." -> X's doctest
   examples (``doctest.DocTestParser``); "Write a function that <first docstring line>" -> the
   library's source code; "Explain the `for` statement in Python." -> the language reference and
   library topics of ``pydoc_data.topics`` (what ``help('for')`` shows), whose method entries
   (``str.join(iterable)`` + description) also become questions; plus plain source-code chunks of
   the module files and topic chunks for completion.
   A fixed, seeded ~5 % of the top-level modules is held out (never trained on, not even by the
   tokenizer; topic paragraphs naming them are dropped); a 64-sequence sample of it measures the
   held-out loss, and 50 questions about it (heldout_questions.json) the answer quality
   (tools/model_card_samples.py).
2. Tokenizer.  Byte-level BPE (``tokenizers``), ByteLevel pre-tokenizer and decoder, special tokens
   <|endoftext|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>; a Jinja chat template.
3. Model.  A genuine ``transformers.OlmoeForCausalLM`` (fine-grained MoE scaled down: 8 layers,
   32 experts, top-4) trained with AdamW + warmup/cosine and the router load-balancing loss, for
   a wall-clock budget (``--minutes``).
4. Output (``--out``, default resources/models/colibri-stdlib-moe/): a standard Hugging Face OLMoE
   checkpoint (config.json, generation_config.json, model.safetensors), tokenizer.json,
   tokenizer_config.json, training_log.json (steps, tokens, time, losses, routing statistics),
   heldout_sample.jsonl, questions.json and heldout_questions.json.  With ``--checkpoint-dir``
   a loadable checkpoint (model + tokenizer) is also saved at every evaluation (atomically, in
   ``latest/``), so a run cut short still leaves its last one.

Reproduce (the bundled model).  1 torch thread: on the shared 2-core machine (load average
~25) a 2-thread run used 0.7 CPU for 111 tokens/s (a 6 M-active variant, so not a clean
comparison), the 1-thread run of this model 0.5 CPU for ~800 tokens/s:
  python tools/train_default_model.py --cache-dir /tmp/colibri-train-cache --minutes 70 \
      --threads 1 --vocab 8192 --batch 8 --warmup 60
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "resources" / "models" / "colibri-stdlib-moe"

# --- special tokens and chat template -------------------------------------------------------

EOT, PAD, SYSTEM, USER, ASSISTANT, END = (
    "<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = [EOT, PAD, SYSTEM, USER, ASSISTANT, END]  # ids 0..5 in this order

# Every conversation starts with <|endoftext|> (document separator / BOS); each message is
# "<|role|>\n" + content + "<|end|>\n"; the generation prompt is "<|assistant|>\n".  The model
# ends its answer with <|end|>.  Training text is rendered by render_chat(), which is checked
# against this template with jinja2 at start-up.
CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are Colibri, a small assistant that knows the Python standard library.",
    "You are a helpful assistant for Python programmers.",
    "Answer questions about the Python standard library.",
]


def render_chat(messages, add_generation_prompt=False) -> str:
    s = EOT + "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return s + ("<|assistant|>\n" if add_generation_prompt else "")


# --- 1. corpus: extraction (child process) ---------------------------------------------------

# Top-level modules never imported: tests, GUI / demos, import side effects, Windows-only,
# deprecated shadows (distutils is replaced by setuptools' copy in virtualenvs), codec tables,
# and redundant platform twins (os re-exports posix; ntpath documents Windows paths).
SKIP_TOP = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
    "pydoc_data", "distutils", "encodings", "msilib", "msvcrt", "nt", "winreg", "winsound",
    "posix", "ntpath", "nturl2path", "test", "site", "__hello__", "__phello__",
}
SKIP_PART = re.compile(r"^(test|tests|idle_test|__main__|_.*)$")
MAX_SOURCE_LINES = 60


def _first_paragraph(doc: str) -> str:
    paras = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    return paras[0].strip() if paras and paras[0].strip() else ""


def _extract_child(out_path: str) -> None:
    """Runs in a fresh interpreter (stdout/stderr discarded): import stdlib modules and dump
    docstrings/signatures/sources as JSON.  Import side effects stay in this process."""
    import importlib
    import inspect
    import pkgutil
    import sysconfig
    import warnings

    warnings.simplefilter("ignore")
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()

    def in_stdlib(mod) -> str | None:
        """'' for built-in modules, the path relative to the stdlib folder, or None if the
        module comes from elsewhere (site-packages, a shadowing copy)."""
        f = getattr(mod, "__file__", None)
        if not f:
            return ""
        p = Path(f).resolve()
        try:
            rel = p.relative_to(stdlib)
        except ValueError:
            return None
        if "site-packages" in rel.parts:
            return None
        return str(rel)

    def alarm(signum, frame):
        raise TimeoutError("import took too long")

    signal.signal(signal.SIGALRM, alarm)

    def try_import(name):
        signal.alarm(20)
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - SystemExit, platform errors, missing extensions
            return None
        finally:
            signal.alarm(0)

    tops = sorted(n for n in sys.stdlib_module_names
                  if not n.startswith("_") and n not in SKIP_TOP and not n.startswith("test"))
    modules = []  # (display name, module object, relative file)
    for top in tops:
        mod = try_import(top)
        if mod is None:
            continue
        rel = in_stdlib(mod)
        if rel is None:
            continue
        todo = [(top, mod, rel)]
        while todo:
            name, m, r = todo.pop(0)
            modules.append((name, m, r))
            if hasattr(m, "__path__"):
                subs = sorted(info.name for info in pkgutil.iter_modules(m.__path__))
                for sub in subs:
                    if SKIP_PART.match(sub):
                        continue
                    sm = try_import(f"{name}.{sub}")
                    if sm is None:
                        continue
                    sr = in_stdlib(sm)
                    if sr is None:
                        continue
                    todo.append((f"{name}.{sub}", sm, sr))
    # os.path is posixpath on this platform; the familiar name is os.path
    names = [n for n, _, _ in modules]
    if "os" in names and "posixpath" in names:
        import posixpath
        i = names.index("os")
        modules.insert(i + 1, ("os.path", posixpath, in_stdlib(posixpath)))

    def own_doc(obj):
        d = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
        d = inspect.cleandoc(d) if isinstance(d, str) and d.strip() else ""
        d = re.sub(r" at 0x[0-9a-fA-F]+", "", d)
        return d if machine_free(d) else ""

    class _Name:  # a default value shown by name instead of by its run-time value
        def __init__(self, text):
            self.text = text

        def __repr__(self):
            return self.text

    # Run-time values that must never reach the corpus: environment variables and the paths of
    # this machine (e.g. cgi.parse(environ=os.environ) would otherwise print the environment).
    own_env = {"PATH", "LANG", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONNOUSERSITE"}
    machine = sorted({v for k, v in os.environ.items() if k not in own_env and len(v) >= 8}
                     | {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.executable, os.getcwd(),
                        os.path.expanduser("~")} - {"", "/"}, key=len, reverse=True)

    def machine_free(text):
        return not any(v in text for v in machine)

    def signature(obj):
        try:
            sig = inspect.signature(obj)
            params = []
            for prm in sig.parameters.values():
                d = prm.default
                if d is os.environ:
                    prm = prm.replace(default=_Name("os.environ"))
                elif isinstance(d, str) and d == sys.executable:
                    prm = prm.replace(default=_Name("sys.executable"))
                params.append(prm)
            text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(sig.replace(parameters=params)))
        except Exception:  # noqa: BLE001 - some C signatures do not evaluate
            return ""
        return text if machine_free(text) and len(text) <= 400 else ""

    def source(obj):
        try:
            src = inspect.getsource(obj)
        except Exception:  # noqa: BLE001
            return ""
        src = textwrap.dedent(src).strip("\n")
        if len(src.splitlines()) > MAX_SOURCE_LINES:
            return ""
        return src

    def top_of(modname):
        return (modname or "").split(".")[0]

    seen = set()
    items, mods = [], []
    for mname, mod, rel in modules:
        mtop = top_of(mname)
        mods.append({"name": mname, "top": mtop, "file": rel, "summary": _first_paragraph(own_doc(mod))})
        if hasattr(mod, "__all__") and isinstance(mod.__all__, (list, tuple)):
            pub = sorted({n for n in mod.__all__ if isinstance(n, str)})
        else:
            try:
                pub = sorted(n for n in dir(mod) if not n.startswith("_"))
            except Exception:  # noqa: BLE001
                continue
        prefix = "" if mname == "builtins" else mname + "."
        for n in pub:
            try:
                obj = getattr(mod, n)
            except Exception:  # noqa: BLE001
                continue
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            om = getattr(obj, "__module__", None) or ""
            # defined here, in a private accelerator (_json, _heapq), or listed in __all__
            if not (om == mod.__name__ or om.startswith("_") or om == "builtins"
                    or n in getattr(mod, "__all__", ())):
                continue
            if om == "builtins" and mname != "builtins":
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            owners = sorted({mtop} | ({top_of(om)} if om and not om.startswith("_") else set()))
            kind = "class" if inspect.isclass(obj) else "function"
            qn = prefix + n
            items.append({"name": qn, "kind": kind, "owners": owners, "doc": own_doc(obj),
                          "signature": signature(obj), "source": source(obj)})
            if kind != "class":
                continue
            for mn in sorted(vars(obj)):
                if mn.startswith("_"):
                    continue
                raw = vars(obj)[mn]
                if isinstance(raw, (staticmethod, classmethod)):
                    raw = raw.__func__
                if not (inspect.isfunction(raw) or inspect.ismethoddescriptor(raw)
                        or inspect.isbuiltin(raw)):
                    continue
                if id(raw) in seen:
                    continue
                seen.add(id(raw))
                items.append({"name": f"{qn}.{mn}", "kind": "method", "owners": owners,
                              "doc": own_doc(raw), "signature": signature(raw),
                              "source": source(raw) if inspect.isfunction(raw) else ""})
    data = {"python": sys.version, "stdlib": str(stdlib), "modules": mods, "items": items}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def extract_stdlib(cache_dir: Path, reuse: Path | None = None) -> dict:
    """The extraction JSON (see _extract_child), made in a child process; ``reuse``: a cache
    folder where the extraction of this exact Python and tool version is kept between runs."""
    if reuse is not None:
        import hashlib
        key = hashlib.sha256((sys.version + Path(__file__).read_text().split("# --- 1b.")[0])
                             .encode()).hexdigest()[:16]
        cached = reuse / f"stdlib_extract-{key}.json"
        if cached.exists():
            with open(cached, encoding="utf-8") as f:
                return json.load(f)
        data = extract_stdlib(cache_dir)
        reuse.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, cached)
        return data
    out = cache_dir / "stdlib_extract.json"
    # a minimal, fixed environment: the corpus must not depend on (or contain) this machine's
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONWARNINGS": "ignore",
           "PYTHONNOUSERSITE": "1"}
    subprocess.run([sys.executable, os.path.abspath(__file__), "--_extract", str(out)],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env, cwd=str(cache_dir), timeout=1800, check=True)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


# --- 1b. corpus: documents ---------------------------------------------------------------

DOC_TEMPLATES = [
    "What does `{n}` do?",
    "What does {n} do?",
    "Explain `{n}`.",
    "What is `{n}` for?",
    "Can you tell me what `{n}` does?",
    "What's the purpose of `{n}` in Python?",
    "In the Python standard library, what does `{n}` do?",
    "Describe the {k} `{n}`.",
    "I found `{n}` in some code. What is it?",
    "`{n}`: what does it do?",
]
WRITE_TEMPLATES = [
    "Write a function that {s}",
    "Write a Python function that {s}",
    "Implement a function that {s}",
    "Show me code for a function that {s}",
    "How would you write a function that {s}",
    "Write `{short}`, a function that {s}",
]
WRITE_CLASS_TEMPLATES = [
    "Write a class that {s}",
    "Write a Python class that {s}",
    "Implement a class that {s}",
]
MODULE_TEMPLATES = [
    "What is the `{n}` module for?",
    "What does the `{n}` module do?",
    "Explain the Python module `{n}`.",
    "What is `{n}` in the standard library?",
]
FULLDOC_TEMPLATES = [
    "Show me the documentation of `{n}`.",
    "Tell me more about `{n}`.",
    "Give me the full docstring of `{n}`.",
    "How do I use `{n}`?",
    "Explain `{n}` in detail.",
]
SIG_TEMPLATES = [
    "What are the parameters of `{n}`?",
    "What is the signature of `{n}`?",
    "How do I call `{n}`?",
]


def _oneline(p: str) -> str:
    return " ".join(line.strip() for line in p.splitlines()).strip()


def _lower_first(s: str) -> str:
    w = s.split(" ", 1)[0]
    if len(w) > 1 and (w[1:].lower() != w[1:] or not w.isalpha()):
        return s  # acronym / identifier: keep as written
    return s[:1].lower() + s[1:]


def _clip_doc(doc: str, limit: int = 1200) -> str:
    """The docstring, cut at a paragraph boundary to at most ``limit`` characters."""
    doc = doc.strip()
    if len(doc) <= limit:
        return doc
    paras = re.split(r"(\n\s*\n)", doc)
    out = ""
    for p in paras:
        if len(out) + len(p) > limit:
            break
        out += p
    return out.strip()


_DETERMINERS = {"a", "an", "the", "this", "these", "abstract", "base", "helper", "internal",
                "simple", "wrapper", "class", "object", "mixin", "common", "utility", "instances",
                "basic", "default", "generic", "new", "custom", "dummy", "null", "standard"}


def _task_phrase(first_line: str) -> str:
    """'Return the square root of x' -> 'returns the square root of x.' (for 'a function that ...')."""
    s = _lower_first(first_line).rstrip(".")
    w, _, rest = s.partition(" ")
    if w.endswith("ed"):
        return f"is {s}."
    if w.lower() in _DETERMINERS:
        return f"implements {s}."
    if w.isalpha() and w.islower():
        if w.endswith("s") and not w.endswith("ss"):
            pass
        elif w.endswith(("sh", "ch", "x", "z", "o", "ss")):
            w += "es"
        elif w.endswith("y") and len(w) > 1 and w[-2] not in "aeiou":
            w = w[:-1] + "ies"
        else:
            w += "s"
    return (f"{w} {rest}" if rest else w) + "."


def _good_summary(p: str, name: str) -> bool:
    if len(p) < 12 or len(p) > 700:
        return False
    # old-style C docstrings whose first paragraph is only a signature line
    if re.fullmatch(r"[\w.]+\(.*\)(\s*->.*)?", p) and "\n" not in p:
        return False
    return True


def index_summary(doc: str, name: str) -> str:
    """The summary the documentation index shows for a docstring: its first paragraph, or the
    next one when the first is only a call signature (``time() -> floating point number``)."""
    paras = [_oneline(p) for p in re.split(r"\n\s*\n", doc or "") if p.strip()]
    for p in paras[:3]:
        if _good_summary(p, name):
            return p
    return ""


def usage_counts(stdlib: str | Path, entries: list[dict]) -> None:
    """Set ``uses`` on each entry: how often the standard library's own source uses it, the
    documentation lookup's prior for how-to questions (``shutil.rmtree`` before
    ``mailbox.MH.remove_folder``). Functions and classes: ``module.name`` written in the source
    (``name(`` for builtins); methods: ``.name(`` calls, shared by the methods of that name;
    modules: ``import`` statements. Test suites and site-packages are not counted."""
    from collections import Counter
    pairs, calls, imports = Counter(), Counter(), Counter()
    root = Path(stdlib)
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).parts
        if rel and (rel[0] in ("test", "site-packages", "idlelib", "lib2to3", "tkinter") or "tests" in rel):
            continue
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        pairs.update(re.findall(r"\b([A-Za-z_]\w*\.[A-Za-z_]\w*)\b", text))
        calls.update(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(", text))
        imports.update(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", text, flags=re.M))
        calls.update("." + m for m in re.findall(r"\.([A-Za-z_]\w*)\(", text))
    n_methods = Counter(e["name"].rsplit(".", 1)[-1] for e in entries if e["kind"] == "method")
    for e in entries:
        parts = e["name"].split(".")
        if e["kind"] == "module":
            u = imports[e["name"]]
        elif e["kind"] == "method":
            u = calls["." + parts[-1]] // max(1, n_methods[parts[-1]])
        elif len(parts) == 1:
            u = calls[parts[0]]
        else:
            u = pairs[".".join(parts[-2:])]
        e["uses"] = int(u)


def docs_index_entries(data: dict, extra=()) -> list[dict]:
    """Every documented object of the extraction (all modules, held-out ones included: the
    index describes the user's Python, and training never searches it), plus ``extra`` seeds
    (str.join etc. from the library topics), one per name, sorted by name."""
    out = {}
    for it in data["items"]:
        s = index_summary(it["doc"], it["name"])
        if s:
            out.setdefault(it["name"], {"name": it["name"], "kind": it["kind"], "signature": it["signature"],
                                        "summary": s})
    for m in data["modules"]:
        s = _oneline(m["summary"]) if m["summary"] else ""
        if _good_summary(s, m["name"]):
            out.setdefault(m["name"], {"name": m["name"], "kind": "module", "signature": "", "summary": s})
    for t in extra:
        if t.get("summary"):
            out.setdefault(t["name"], {k: t.get(k, "") for k in ("name", "kind", "signature", "summary")})
    entries = [out[k] for k in sorted(out)]
    usage_counts(data["stdlib"], entries)
    return entries


def build_items(data: dict, heldout_tops: set[str]):
    """Split the extracted records into train / held-out 'seeds' (one per function, class,
    method or module).  An item is held out when any of its owning top-level modules is."""
    train, held = [], []
    for it in data["items"]:
        doc = it["doc"]
        summary = _oneline(_first_paragraph(doc)) if doc else ""
        seed = {"name": it["name"], "kind": it["kind"], "signature": it["signature"],
                "summary": summary if _good_summary(summary, it["name"]) else "",
                "source": it["source"], "doc": _clip_doc(doc) if summary else ""}
        first = summary.split(". ")[0].rstrip(".") if seed["summary"] else ""
        seed["first_line"] = first if 8 <= len(first) <= 200 else ""
        seed["examples"] = doctest_examples(doc) if doc else []
        if not (seed["summary"] or seed["source"]):
            continue
        (held if set(it["owners"]) & heldout_tops else train).append(seed)
    for m in data["modules"]:
        s = _oneline(m["summary"]) if m["summary"] else ""
        if not _good_summary(s, m["name"]):
            continue
        seed = {"name": m["name"], "kind": "module", "summary": s, "signature": "", "source": "",
                "first_line": "", "doc": "", "examples": []}
        (held if m["top"] in heldout_tops else train).append(seed)
    return train, held


def code_chunks(data: dict, heldout_tops: set[str], min_lines=12, max_lines=40):
    """Plain source-code chunks (cut at blank lines before a def/class when possible)."""
    stdlib = Path(data["stdlib"])
    train, held = [], []
    seen = set()
    for m in data["modules"]:
        rel = m["file"]
        if not rel or not rel.endswith(".py") or rel in seen:
            continue
        seen.add(rel)
        try:
            text = (stdlib / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if EOT in text or END in text:
            continue
        lines = text.splitlines()
        chunks, cur = [], []
        for i, line in enumerate(lines):
            starts_def = re.match(r"\s*(def |class |async def |@)", line) is not None
            if cur and ((len(cur) >= min_lines and starts_def and not lines[i - 1].strip().startswith("@"))
                        or len(cur) >= max_lines):
                chunks.append(cur)
                cur = []
            cur.append(line)
        if cur:
            chunks.append(cur)
        for j, c in enumerate(chunks):
            body = "\n".join(c).strip("\n")
            if len(body) < 40:
                continue
            doc = f"{EOT}# Lib/{rel}\n{body}\n"
            (held if m["top"] in heldout_tops else train).append(doc)
    return train, held


def doctest_examples(doc: str, max_chars: int = 600) -> list[str]:
    """The interactive examples (doctest blocks: ``>>>`` lines and their expected output) of a
    docstring, each at most ``max_chars`` characters, found with the standard library's own
    ``doctest.DocTestParser``."""
    import doctest

    try:
        exs = doctest.DocTestParser().get_examples(doc)
    except ValueError:  # malformed doctest (inconsistent indentation)
        return []
    blocks, cur, last_line = [], [], None
    for ex in exs:
        if cur and last_line is not None and ex.lineno > last_line + 1:
            blocks.append(cur)
            cur = []
        src = ex.source.rstrip("\n").split("\n")
        text = ">>> " + "\n... ".join(src) + ("\n" + ex.want.rstrip("\n") if ex.want.strip() else "")
        cur.append(text)
        last_line = ex.lineno + len(src) + len(ex.want.splitlines())
    if cur:
        blocks.append(cur)
    out = []
    for b in blocks:
        t = "\n".join(b)
        if 10 <= len(t) <= max_chars and EOT not in t and END not in t:
            out.append(t)
    return out


# Imperative first words of docstring summaries -> the verb of a "How do I ...?" question.
# ("Return the square root of x" -> "How do I get the square root of x?")
HOWTO_VERBS = {
    "return": "get", "get": "get", "compute": "compute", "calculate": "calculate",
    "create": "create", "make": "make", "build": "build", "construct": "construct",
    "convert": "convert", "read": "read", "write": "write", "open": "open", "close": "close",
    "remove": "remove", "delete": "delete", "add": "add", "insert": "insert", "find": "find",
    "search": "search", "test": "test", "check": "check", "parse": "parse", "format": "format",
    "encode": "encode", "decode": "decode", "compress": "compress", "decompress": "decompress",
    "copy": "copy", "move": "move", "rename": "rename", "send": "send", "receive": "receive",
    "start": "start", "stop": "stop", "run": "run", "call": "call", "generate": "generate",
    "split": "split", "join": "join", "sort": "sort", "load": "load", "dump": "dump",
    "serialize": "serialize", "deserialize": "deserialize", "register": "register",
    "unregister": "unregister", "wait": "wait", "acquire": "acquire", "release": "release",
    "update": "update", "reset": "reset", "clear": "clear", "print": "print", "display": "display",
    "iterate": "iterate", "apply": "apply", "replace": "replace", "translate": "translate",
    "escape": "escape", "quote": "quote", "unquote": "unquote", "normalize": "normalize",
    "validate": "validate", "initialize": "initialize", "extract": "extract", "append": "append",
    "extend": "extend", "pop": "pop", "push": "push", "count": "count", "match": "match",
    "filter": "filter", "list": "list", "walk": "walk", "change": "change", "set": "set",
    "determine": "determine", "emit": "emit", "execute": "execute", "evaluate": "evaluate",
    "flush": "flush", "truncate": "truncate", "seek": "seek", "fetch": "fetch", "lock": "lock",
    "unlock": "unlock", "schedule": "schedule", "cancel": "cancel", "submit": "submit",
    "connect": "connect", "bind": "bind", "listen": "listen", "accept": "accept", "shut": "shut",
    "retrieve": "retrieve", "store": "store", "save": "save", "restore": "restore", "wrap": "wrap",
    "fill": "fill", "indent": "indent", "dedent": "dedent", "shorten": "shorten", "strip": "strip",
    "pad": "pad", "round": "round", "truncating": "", "hash": "hash", "sign": "sign",
    "verify": "verify", "install": "install", "import": "import", "reload": "reload",
    "merge": "merge", "compare": "compare", "shuffle": "shuffle", "choose": "choose",
    "select": "select", "pick": "pick", "log": "log", "raise": "raise", "handle": "handle",
    "send_": "send", "transform": "transform", "expand": "expand", "resolve": "resolve",
}


def howto_question(seed) -> str | None:
    """'Return True if the path exists' -> 'check if the path exists';
    'Return the square root of x.' -> 'get the square root of x'.  None when the summary does
    not start with a known verb (so the question would not read as English)."""
    fl = seed["first_line"]
    if not fl or seed["kind"] == "module":
        return None
    w, _, rest = fl.partition(" ")
    lw = w.lower().rstrip(",:")
    if not rest:
        return None
    if lw in ("return", "returns") and re.match(r"(?i)(true|a true value|whether|nonzero)\b", rest):
        rest = re.sub(r"(?i)^(true|a true value|nonzero)\s+(if|when|iff)\s+", "", rest)
        rest = re.sub(r"(?i)^whether\s+", "", rest)
        return f"check if {rest}"
    base = lw[:-1] if lw.endswith("s") and lw[:-1] in HOWTO_VERBS else lw
    if lw.endswith("es") and lw[:-2] in HOWTO_VERBS:
        base = lw[:-2]
    if lw.endswith("ies") and lw[:-3] + "y" in HOWTO_VERBS:
        base = lw[:-3] + "y"
    verb = HOWTO_VERBS.get(base)
    if not verb:
        return None
    return f"{verb} {rest}"


HOWTO_TEMPLATES = [
    "How do I {t}?",
    "How can I {t} in Python?",
    "How do I {t} with the standard library?",
    "Which function can I use to {t}?",
    "What should I use to {t}?",
    "I need to {t}. What can I use?",
]
EXAMPLE_TEMPLATES = [
    "Show me an example of `{n}`.",
    "Give an example of using `{n}`.",
    "How is `{n}` used? Show an example.",
    "Can you show `{n}` in action?",
]
TOPIC_TEMPLATES = [
    "Explain {t} in Python.",
    "How does {t} work in Python?",
    "Tell me about {t}.",
    "What does the Python language reference say about {t}?",
    "Describe {t}.",
]


def _topic_phrase(key: str, title: str) -> str:
    import keyword

    if keyword.iskeyword(key) or key in ("async", "await"):
        return f"the `{key}` statement" if key not in ("in", "lambda", "await", "yield") else f"`{key}`"
    title = re.sub(r'"', "`", title.strip())
    return title[:1].lower() + title[1:] if title else key.replace("-", " ")


def topic_docs(heldout_tops: set[str]):
    """The language reference and library topics shipped with Python (``pydoc_data.topics``,
    what ``help('for')`` shows), as (question phrase, answer) pairs and as plain text chunks;
    also the method entries of library topics ("str.join(iterable)" + its description) as
    (name, signature, description) records.  Paragraphs that name a held-out module are dropped."""
    from pydoc_data.topics import topics

    held = re.compile(r"\b(" + "|".join(re.escape(t) for t in sorted(heldout_tops)) + r")\b")
    pairs, chunks, methods = [], [], []
    for key in sorted(topics):
        text = topics[key].replace(EOT, "").replace(END, "")
        lines = text.splitlines()
        title = lines[0].strip() if lines else key
        body = "\n".join(lines[2:]) if len(lines) > 2 and set(lines[1].strip()) <= {"*", "="} else text
        paras = [p.strip("\n") for p in re.split(r"\n\s*\n", body) if p.strip()]
        paras = [p for p in paras if not held.search(p)]
        # chunks of <= 1200 characters at paragraph boundaries
        cur = ""
        first = True
        for para in paras:
            if cur and len(cur) + len(para) > 1200:
                chunks.append((key, title, cur, first))
                first = False
                cur = ""
            cur = (cur + "\n\n" + para) if cur else para
        if cur:
            chunks.append((key, title, cur, first))
        # method entries: "str.join(iterable)" at column 0 followed by an indented description
        for i, para in enumerate(paras[:-1]):
            m = re.fullmatch(r"(?:(?:class|classmethod|staticmethod) )?([A-Za-z_][\w.]*)(\(.*\))?", para.strip())
            if not m or "\n" in para.strip() or "." not in m.group(1):
                continue
            desc = paras[i + 1]
            if not desc.startswith("   "):
                continue
            d = textwrap.dedent(desc).strip()
            if len(d) >= 12:
                methods.append({"name": m.group(1), "signature": m.group(2) or "",
                                "summary": _oneline(d), "topic": key})
    for key, title, chunk, first in chunks:
        pairs.append({"key": key, "phrase": _topic_phrase(key, title), "text": chunk, "first": first})
    return pairs, [f"{EOT}{c[2]}\n" for c in chunks], methods


def conversation(seed, rng: random.Random, category: str):
    """One chat (list of messages) for a seed, or None.  category: 'qa', 'write', 'howto',
    'example'."""
    n, k = seed["name"], seed["kind"]
    if category == "howto":
        t = howto_question(seed)
        if not t:
            return None
        q = rng.choice(HOWTO_TEMPLATES).format(t=t)
        sig = re.sub(r"^\((self|cls)(, )?", "(", seed["signature"]) if seed["kind"] == "method" else seed["signature"]
        sig = sig if sig and len(sig) <= 80 else ""
        a = f"Use `{n}{sig}`. {seed['summary']}"
        if seed.get("examples") and rng.random() < 0.3:
            a += f"\n\n```pycon\n{rng.choice(seed['examples'])}\n```"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if category == "example":
        if not seed.get("examples"):
            return None
        q = rng.choice(EXAMPLE_TEMPLATES).format(n=n)
        a = f"`{n}`: {seed['summary']}\n\n" if seed["summary"] else ""
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": a + f"```pycon\n{rng.choice(seed['examples'])}\n```"}]
    return _conversation(seed, rng, category)


# Module-swap augmentation (set by main from --module-swap): in this share of the "What does
# `mod.name` do?" conversations (and their full-docstring / signature variants) the module path
# is replaced by another one, a real training module or a made-up path, in the question and the
# answer alike, the summary kept.  The summary is carried by the base name (`tan`: "Return the
# tangent of x"), not by the module, so a held-out `cmath.tan` gets math.tan's summary and its own
# name copied.  A standard data augmentation: a mention replaced by another of the same type
# ("mention replacement", Dai and Adel 2020, "An Analysis of Simple Data Augmentation for Named
# Entity Recognition"); made-up paths never use a held-out top-level module's name.
MODULE_SWAP = {"p": 0.0, "modules": [], "module_set": set(), "banned": set()}


def _module_of(name: str, modules: list[str]) -> str:
    """The longest training module name that is a dotted prefix of ``name`` ('' if none)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        m = ".".join(parts[:i])
        if m in MODULE_SWAP["module_set"]:
            return m
    return ""


def _made_up_word(rng: random.Random) -> str:
    """A word made of pieces of real module names ('json' + 'string' -> 'jsring') or of random
    letters: names that tokenize like a module the model never saw."""
    mods = MODULE_SWAP["modules"]
    if mods and rng.random() < 0.6:
        a = rng.choice(mods).split(".")[-1]
        b = rng.choice(mods).split(".")[-1]
        w = a[:rng.randint(1, max(1, len(a)))] + b[rng.randint(0, max(0, len(b) - 1)):]
        w = re.sub(r"[^a-z0-9_]", "", w.lower()).strip("_")
        if len(w) >= 2 and w[0].isalpha():
            return w
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))


def swapped_module(module: str, rng: random.Random) -> str:
    """Another module path for ``module``: a real training module (40%) or a made-up path of
    one to three segments; never a held-out top-level module's name."""
    mods = MODULE_SWAP["modules"]
    for _ in range(20):
        if mods and rng.random() < 0.4:
            m = rng.choice(mods)
        else:
            m = ".".join(_made_up_word(rng) for _ in range(rng.choice((1, 1, 1, 2, 2, 3))))
        if m != module and m.split(".")[0] not in MODULE_SWAP["banned"]:
            return m
    return module


def _conversation(seed, rng: random.Random, category: str):

    """One chat (list of messages) for a seed, or None.  category: 'qa' or 'write'."""
    n, k = seed["name"], seed["kind"]
    if category == "qa" and k != "module" and MODULE_SWAP["p"] > 0:
        mod = _module_of(n, MODULE_SWAP["modules"])
        if mod and rng.random() < MODULE_SWAP["p"]:
            seed = dict(seed, name=swapped_module(mod, rng) + n[len(mod):])
            seed["doc"] = ""  # the full docstring may name the real module
            n = seed["name"]
    if category == "write":
        if not (seed["source"] and seed["first_line"]) or k == "module":
            return None
        s = _task_phrase(seed["first_line"])
        tpls = WRITE_CLASS_TEMPLATES if k == "class" else WRITE_TEMPLATES
        q = rng.choice(tpls).format(s=s, short=n.rsplit(".", 1)[-1])
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": f"```python\n{seed['source']}\n```"}]
    if not seed["summary"]:
        return None
    if k == "module":
        q = rng.choice(MODULE_TEMPLATES).format(n=n)
        a = f"`{n}`: {seed['summary']}"
    elif seed["doc"] and len(seed["doc"]) > len(seed["summary"]) + 40 and rng.random() < 0.25:
        q = rng.choice(FULLDOC_TEMPLATES).format(n=n)
        a = seed["doc"]
    elif seed["signature"] and rng.random() < 0.12:
        q = rng.choice(SIG_TEMPLATES).format(n=n)
        a = f"`{n}{seed['signature']}`\n\n{seed['summary']}"
    else:
        q = rng.choice(DOC_TEMPLATES).format(n=n, k={"function": "function", "method": "method",
                                                      "class": "class"}[k])
        a = f"`{n}`: {seed['summary']}"
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def next_texts_preview(pools, topic_text, train_code, n):
    rng = random.Random(0)
    out = []
    while len(out) < n:
        cat = rng.choice(list(pools) + ["topic_text", "code"])
        t = (rng.choice(topic_text) if cat == "topic_text" else rng.choice(train_code)
             if cat == "code" else make_doc(pools[cat], rng, cat))
        if t:
            out.append(t)
    return out


COPY_TEMPLATES = [
    ("Repeat after me: {l}", "{l}"),
    ("Please say {l} back to me.", "{l}"),
    ("Which names did I mention? I used {l}.", "You mentioned {l}."),
    ("Write these names again: {l}", "{l}"),
    ("I am looking at {l}. Which names was that?", "{l}"),
]


def _random_identifier(rng: random.Random) -> str:
    """A made-up dotted Python name (``xvq.load_items``-like), so a copy drill cannot be answered
    from memory."""
    def word():
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
    parts = ["_".join(word() for _ in range(rng.choice((1, 1, 2)))) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts[-1] = parts[-1][:1].upper() + parts[-1][1:]
    return ".".join(parts)


def copy_drill(seeds, rng: random.Random):
    """A copy drill: the user names one to three things in backticks (real library names or
    made-up identifiers) and the assistant repeats them in order.  Copying a name from the
    question into the answer is what a "What does `X` do?" answer needs for a name the model
    never saw; induction-style copying forms fast on dense drills like these and slowly, if at
    all, from one copy per document (Olsson et al. 2022, "In-context learning and induction
    heads")."""
    def pick():
        r = rng.random()
        if r < 0.45:
            return rng.choice(seeds)["name"]
        if r < 0.7 and MODULE_SWAP["modules"]:
            # a dotted path whose module is made up or swapped, the rest real: copying the
            # module segment exactly (a held-out `typing.X` came back as `tyed.X`)
            n = rng.choice(seeds)["name"]
            mod = _module_of(n, MODULE_SWAP["modules"])
            if mod:
                return swapped_module(mod, rng) + n[len(mod):]
        return _random_identifier(rng)
    names = [pick() for _ in range(rng.choice((1, 1, 2, 3)))]
    shown = [f"`{n}`" for n in names]
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    q, a = rng.choice(COPY_TEMPLATES)
    return [{"role": "user", "content": q.format(l=listed)},
            {"role": "assistant", "content": a.format(l=listed)}]


# Documentation-grounded questions (set by main): the same questions as "qa" / "howto", with a
# system message right before the question holding the entries the app's documentation lookup
# (engine.docs_lookup) returns for it, searched in an index of the TRAINING seeds only (held-out
# modules never appear, not even as context). The answer copies the asked entry's summary from
# that block: reading, not recall, so it carries over to any documented name (retrieval-augmented
# generation, Lewis et al. 2020). With module swap the asked name is replaced in the question,
# the block and the answer alike, so memory of the real name cannot answer it; in 10% the
# asked entry is left out of the block (a lookup miss) and the answer comes from memory.
DOCS = {"index": None, "p_missing": 0.10, "p_made_up": 0.6}


def docs_conversation(seeds, rng: random.Random):
    """A "What does `X` do?" or how-to question answered from a documentation block (see DOCS).

    In DOCS["p_made_up"] of them the asked object gets a made-up name (``xvq.load_items``, or a
    real module with a made-up attribute), in the block, the question and the answer alike: the
    model has memorized the summaries of the training names (and module swap keeps the base
    name), so without names it cannot know, reading the block would never be needed to lower
    the loss. A held-out name is exactly such a name."""
    from engine.docs_lookup import DocEntry, docs_block
    seed = rng.choice(seeds)
    if not seed["summary"] or len(seed["summary"]) > 300:
        return None
    n, k = seed["name"], seed["kind"]
    made_up = k != "module" and rng.random() < DOCS["p_made_up"]
    if made_up:
        made = _random_identifier(rng)
        mod = _module_of(n, MODULE_SWAP["modules"]) if rng.random() < 0.3 else ""
        n = f"{mod}.{made.split('.')[-1]}" if mod else made
    elif k != "module" and MODULE_SWAP["p"] > 0 and rng.random() < MODULE_SWAP["p"]:
        mod = _module_of(n, MODULE_SWAP["modules"])
        if mod:
            n = swapped_module(mod, rng) + n[len(mod):]
    sig = seed["signature"] if k != "module" else ""
    howto = howto_question(seed) if k != "module" and rng.random() < 0.35 else None
    if howto:  # (the block shows no signatures: the answer names what it can copy)
        q = rng.choice(HOWTO_TEMPLATES).format(t=howto)
        a = f"Use `{n}`: {seed['summary']}"
    elif k == "module":
        q = rng.choice(MODULE_TEMPLATES).format(n=n)
        a = f"`{n}`: {seed['summary']}"
    else:
        q = rng.choice(DOC_TEMPLATES).format(n=n, k={"function": "function", "method": "method",
                                                      "class": "class"}.get(k, "function"))
        a = f"`{n}`: {seed['summary']}"
    entries = DOCS["index"].search(q, 3)
    entries = [e for e in entries if e.name != n and e.name != seed["name"]]
    if made_up or rng.random() >= DOCS["p_missing"]:  # (a made-up name is never a lookup miss: no one could answer)
        entries.insert(rng.randint(0, len(entries)) if howto else 0, DocEntry(n, k, sig, seed["summary"]))
    block = [{"role": "system", "content": docs_block(entries[:3])}] if entries else []
    return block + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def make_doc(seeds, rng: random.Random, category: str) -> str | None:
    """A rendered training document: one conversation, sometimes with a system prompt or a
    second turn (multi-turn)."""
    seed = rng.choice(seeds)
    if category == "copy":
        conv = copy_drill(seeds, rng)
        if rng.random() < 0.5:  # then a real question about a name, which must be copied too
            extra = conversation(rng.choice(seeds), rng, "qa")
            if extra:
                conv = conv + extra
        return render_chat(conv)
    if category == "docs":
        conv = docs_conversation(seeds, rng)
    elif category == "topic":
        tpl = rng.choice(TOPIC_TEMPLATES) if seed["first"] else "Tell me more about {t}."
        conv = [{"role": "user", "content": tpl.format(t=seed["phrase"])},
                {"role": "assistant", "content": seed["text"]}]
    else:
        conv = conversation(seed, rng, category)
    if conv is None:
        return None
    if category in ("qa", "howto", "docs") and rng.random() < 0.2:
        extra = conversation(rng.choice(seeds), rng, "qa")
        if extra:  # a second question; a documentation block stays right before the last one
            conv = extra + conv if category == "docs" else conv + extra
    if rng.random() < 0.2:
        conv = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + conv
    return render_chat(conv)


# --- 2. tokenizer -----------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    for s in ["héllo wörld ✓ 日本語 🐍\t\r\n  x", "def f(x):\n    return x ** 2\n", "\x00\x7f\ufeff"]:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s, s
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT, "eos_token": END, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


# --- 3. model --------------------------------------------------------------------------------

def model_config(args, vocab_size: int):
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=False,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=args.aux_coef,
        bos_token_id=0, eos_token_id=[SPECIAL_TOKENS.index(END), 0], pad_token_id=1,
        initializer_range=0.02, hidden_act="silu", attention_bias=False,
    )


def count_params(cfg) -> int:
    D, V, L, E, I = (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts,
                     cfg.intermediate_size)
    hd = D // cfg.num_attention_heads
    kv = hd * cfg.num_key_value_heads
    attn = D * D + 2 * D * kv + D * D + D + kv  # q, k, v, o, q_norm, k_norm
    layer = attn + 2 * D + E * D + E * 3 * D * I  # norms, router, experts
    return V * D * (1 if cfg.tie_word_embeddings else 2) + L * layer + D


def held_out_nll(model, sample, torch, batch: int = 1, pad_id: int = 1):
    """Mean NLL (nats/token) of next-token prediction over the held-out sample: all positions
    1..n-1 of every sequence, summed then divided by the count.  batch=1 (the reported number)
    runs every sequence alone; batch>1 right-pads (causal attention and per-token routing keep
    the real positions unchanged up to float rounding) and is used for the periodic evals."""
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(sample), batch):
            chunk = sample[b:b + batch]
            n = max(map(len, chunk))
            x = torch.full((len(chunk), n), pad_id, dtype=torch.long)
            y = torch.full((len(chunk), n), -100, dtype=torch.long)
            for r, ids in enumerate(chunk):
                x[r, :len(ids)] = torch.tensor(ids)
                y[r, :len(ids)] = torch.tensor(ids)
            logits = model(input_ids=x, output_router_logits=False).logits[:, :-1].float()
            tot += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y[:, 1:].reshape(-1), ignore_index=-100,
                                                     reduction="sum").item()
            cnt += sum(len(ids) - 1 for ids in chunk)
    return tot / cnt


def per_layer_aux_loss(router_logits, num_experts: int, top_k: int):
    """Switch-Transformer load-balancing loss computed for every layer separately and averaged
    (= top_k when perfectly balanced).  transformers' load_balancing_loss_func is reused, one
    layer at a time: called with all layers at once it pools the token counts and router
    probabilities of all layers before taking the product, which does not balance each layer."""
    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    losses = [load_balancing_loss_func((rl,), num_experts, top_k) for rl in router_logits]
    return sum(losses) / len(losses)


def routing_stats(model, sample, torch):
    """Per layer: entropy of the expert-usage distribution of the top-k selections; and
    PILOT=1 recall: layer i+1's post_attention_layernorm + router applied to layer i's
    post-attention residual, top-k, vs layer i+1's actual top-k."""
    layers = model.model.layers
    L, E, K = len(layers), model.config.num_experts, model.config.num_experts_per_tok
    resid, routed = {}, {}
    capture = [False]  # off while the predictions call the same modules (their hooks fire too)

    def pre_norm(mod, inp, i):
        if capture[0]:
            resid[i] = inp[0].detach().reshape(-1, inp[0].shape[-1]).clone()

    def post_gate(mod, inp, out, i):
        if capture[0]:
            routed[i] = out[2].detach().clone()

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, inp, i=i: pre_norm(mod, inp, i)))
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: post_gate(mod, inp, out, i)))
    counts = torch.zeros(L, E, dtype=torch.float64)
    hits = torch.zeros(L, dtype=torch.float64)
    total = torch.zeros(L, dtype=torch.float64)
    try:
        with torch.no_grad():
            for ids in sample:
                resid.clear(), routed.clear()
                capture[0] = True
                model(input_ids=torch.tensor([ids]), output_router_logits=False)
                capture[0] = False
                assert len(resid) == L and len(routed) == L
                for i in range(L):
                    counts[i] += torch.bincount(routed[i].reshape(-1), minlength=E).double()
                for i in range(L - 1):
                    nxt = layers[i + 1]
                    h = nxt.post_attention_layernorm(resid[i])
                    _, _, pred = nxt.mlp.gate(h)
                    actual = routed[i + 1]
                    match = (pred.unsqueeze(-1) == actual.unsqueeze(-2)).any(-1).sum()
                    hits[i + 1] += match.item()
                    total[i + 1] += actual.numel()
    finally:
        for h in hooks:
            h.remove()
    p = counts / counts.sum(1, keepdim=True)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
    return {
        "tokens": int(counts[0].sum().item() // K),
        "log_num_experts": math.log(E),
        "usage_entropy_per_layer": [round(float(e), 4) for e in ent],
        "usage_entropy_ratio_per_layer": [round(float(e) / math.log(E), 4) for e in ent],
        "min_entropy_ratio": round(float(ent.min()) / math.log(E), 4),
        "pilot1_recall_per_layer": [None] + [round(float(hits[i] / total[i]), 4) for i in range(1, L)],
        "pilot1_recall_mean": round(float(hits[1:].sum() / total[1:].sum()), 4),
        "pilot1_definition": ("layer i+1 routed top-k experts predicted by applying layer i+1's "
                              "post_attention_layernorm and router (gate) to layer i's post-attention "
                              "residual; share of actual top-k experts that are in the predicted top-k"),
        "expert_usage_counts": counts.long().tolist(),
    }


# --- main -------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=50.0,
                    help="training budget in minutes of the clock chosen by --clock")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what --minutes counts: wall-clock time, or this process's CPU time "
                         "(time.process_time), which does not run while other programs preempt it")
    ap.add_argument("--max-wall-minutes", type=float, default=0.0,
                    help="with --clock cpu: also stop after this many wall-clock minutes of training "
                         "(0 = no limit); the cosine follows whichever clock is further along")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the training forward (throughput only; same math)")
    ap.add_argument("--docs-made-up", type=float, default=0.6,
                    help="share of the documentation-grounded questions (mixture share 'docs') asked "
                         "about a made-up name, so only reading the block answers them")
    ap.add_argument("--module-swap", type=float, default=0.0,
                    help="module-swap augmentation: share of 'What does `mod.name` do?' conversations "
                         "whose module path is replaced by another real or made-up one (0 = off)")
    ap.add_argument("--steps", type=int, default=0,
                    help="train this many steps unless --minutes runs out first; the cosine follows "
                         "whichever of steps/N and time/budget is further along (0 = by time only)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0, help="0 = same as --heads (no GQA)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=96, help="intermediate_size per expert")
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--aux-coef", type=float, default=0.02,
                    help="router_aux_loss_coef (per-layer load-balancing loss weight)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every-min", type=float, default=5.0)
    ap.add_argument("--heldout-n", type=int, default=64)
    ap.add_argument("--max-mb", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue from this checkpoint's weights (same shape and tokenizer)")
    ap.add_argument("--mixture", default="0.24,0.14,0.06,0.16,0.10,0.04,0.26",
                    help="shares of qa,howto,example,write,topic,topic_text,code[,copy[,docs]] documents (copy: copy "
                         "drills; docs: questions answered from a documentation-lookup block)")
    ap.add_argument("--name-split", type=float, default=0.0,
                    help="name-split augmentation: probability of cutting each token of a "
                         "backticked name (0 = off)")
    ap.add_argument("--name-split-docs", type=float, default=0.5,
                    help="share of training documents the name-split augmentation applies to")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: reload the checkpoint in --out, recompute the held-out loss "
                         "and routing statistics on its heldout_sample.jsonl, update training_log.json")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="keep the standard-library extraction here between runs (same Python)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None,
                    help="save a loadable checkpoint (model + tokenizer) here at every evaluation")
    ap.add_argument("--corpus-only", action="store_true",
                    help="build the corpus and tokenizer, print statistics and sample documents, stop")
    ap.add_argument("--questions-out", type=Path, default=None,
                    help="write the 50 held-out evaluation questions (JSON) here and stop")
    ap.add_argument("--docs-index-only", type=Path, default=None,
                    help="write the documentation index (docs_index.jsonl) of this Python here and stop")
    ap.add_argument("--_extract", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._extract:
        _extract_child(args._extract)
        return 0
    if args.eval_only:
        return reevaluate(args.out.resolve(), args.threads)

    import numpy as np
    import torch
    import transformers
    import tokenizers
    from transformers import GenerationConfig, OlmoeForCausalLM

    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="colibri_train_"))

    # 1. corpus
    log(f"extracting the standard library of Python {platform.python_version()} (child process)")
    data = extract_stdlib(work, args.cache_dir)
    tops = sorted({m["top"] for m in data["modules"]})
    rng = random.Random(args.seed)
    n_held = max(1, round(args.heldout_frac * len(tops)))
    heldout_tops = set(rng.sample(tops, n_held))
    train_seeds, held_seeds = build_items(data, heldout_tops)
    train_code, held_code = code_chunks(data, heldout_tops)
    log(f"{len(data['modules'])} modules ({len(tops)} top-level), {len(data['items'])} objects; "
        f"held out {sorted(heldout_tops)}; seeds train {len(train_seeds)} held {len(held_seeds)}; "
        f"code chunks train {len(train_code)} held {len(held_code)}")
    topic_pairs, topic_text, topic_methods = topic_docs(heldout_tops)
    known = {s["name"] for s in train_seeds}
    for tm in topic_methods:  # str.join etc. from the library topics, when inspect had no docstring
        if tm["name"] not in known and _good_summary(tm["summary"], tm["name"]):
            first = tm["summary"].split(". ")[0].rstrip(".")
            train_seeds.append({"name": tm["name"], "kind": "method", "signature": tm["signature"],
                                "summary": tm["summary"], "source": "", "doc": "",
                                "first_line": first if 8 <= len(first) <= 200 else "", "examples": []})
    qa_train = [s for s in train_seeds if s["summary"]]
    wr_train = [s for s in train_seeds if s["source"] and s["first_line"] and s["kind"] != "module"]
    qa_held = [s for s in held_seeds if s["summary"]]
    wr_held = [s for s in held_seeds if s["source"] and s["first_line"] and s["kind"] != "module"]
    ho_train = [s for s in qa_train if howto_question(s)]
    ex_train = [s for s in train_seeds if s.get("examples")]
    ho_held = [s for s in qa_held if howto_question(s)]
    log(f"topics: {len(topic_pairs)} chunks of {len({t['key'] for t in topic_pairs})} pydoc topics, "
        f"{len(topic_methods)} method entries; how-to seeds {len(ho_train)} (held {len(ho_held)}), "
        f"doctest-example seeds {len(ex_train)}")
    if args.questions_out:
        qs = heldout_questions(qa_held, 50, args.seed)
        args.questions_out.write_text(json.dumps(qs, indent=1, ensure_ascii=False) + "\n")
        log(f"wrote {len(qs)} held-out questions to {args.questions_out}")
        return 0
    # (the swap share is switched on after the tokenizer and the evaluation samples are made,
    # so they are the same as without the augmentation)
    MODULE_SWAP.update(p=0.0, banned=set(heldout_tops),
                       modules=sorted({m["name"] for m in data["modules"] if m["top"] not in heldout_tops}))
    MODULE_SWAP["module_set"] = set(MODULE_SWAP["modules"])
    pools = {"qa": qa_train, "copy": qa_train, "docs": qa_train, "write": wr_train, "howto": ho_train, "example": ex_train,
             "topic": topic_pairs}
    from engine.docs_lookup import INDEX_FILE, DocEntry, DocsIndex, write_index
    DOCS["p_made_up"] = args.docs_made_up
    DOCS["index"] = DocsIndex([DocEntry(t["name"], t["kind"], t["signature"], t["summary"]) for t in qa_train],
                              "training seeds")
    # what the app searches: every documented object of this Python, held-out modules included
    # (they are part of the user's Python); training only ever searches DOCS["index"]
    docs_all = docs_index_entries(data, [t for t in train_seeds if t["kind"] == "method" and not t["source"]])
    if args.docs_index_only:
        write_index(docs_all, args.docs_index_only)
        log(f"wrote {len(docs_all)} documentation entries to {args.docs_index_only}")
        return 0

    # the training renderer must equal the Jinja chat template
    import jinja2
    tmpl = jinja2.Environment().from_string(CHAT_TEMPLATE)
    crng = random.Random(0)
    for _ in range(300):
        cat = crng.choice(["qa", "write"])
        conv = conversation(crng.choice(qa_train if cat == "qa" else wr_train), crng, cat)
        if conv is None:
            continue
        if crng.random() < 0.5:
            conv = [{"role": "system", "content": SYSTEM_PROMPTS[0]}] + conv
        for gen in (False, True):
            assert tmpl.render(messages=conv, add_generation_prompt=gen) == render_chat(conv, gen)

    # 2. tokenizer (training text only)
    trng = random.Random(args.seed + 1)
    tok_texts = [render_chat(c) for s in qa_train if (c := conversation(s, trng, "qa"))]
    tok_texts += [render_chat(c) for s in wr_train if (c := conversation(s, trng, "write"))]
    tok_texts += [render_chat(c) for s in ho_train if (c := conversation(s, trng, "howto"))]
    tok_texts += [render_chat(c) for s in ex_train if (c := conversation(s, trng, "example"))]
    tok_texts += [make_doc([t], trng, "topic") for t in topic_pairs]
    tok_texts += topic_text
    tok_texts += train_code
    log(f"training byte-level BPE tokenizer, vocab {args.vocab}, on {sum(map(len, tok_texts)) / 1e6:.1f} M chars")
    tok = train_tokenizer(tok_texts, args.vocab)
    del tok_texts
    ids_of = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    end_id, eot_id = ids_of[END], ids_of[EOT]

    def encode(texts):
        return [e.ids for e in tok.encode_batch(texts)]

    # Name-split augmentation (a deterministic, seeded variant of BPE-dropout, Provilkov et al.
    # 2020, applied to backticked names only): in a share of the training documents every
    # token of a `name` is, with probability --name-split, cut at a random character and both
    # halves re-encoded, with the same segmentation for every occurrence of the name in the
    # document.  Held-out names are split into unusual pieces by a tokenizer that never saw
    # them; this makes copying the asked name from the question into the answer a skill the
    # model must learn on token sequences it has not memorized.  Boundaries are between a
    # backtick and a letter or digit, which are pre-token boundaries of the ByteLevel
    # pre-tokenizer, so the text between names tokenizes exactly as the whole text would.
    name_re = re.compile(r"(?<=`)([A-Za-z][\w.]*[A-Za-z0-9])(?=`)")
    arng = random.Random(args.seed + 5)

    def split_name(name: str) -> list[int]:
        out_ids = []
        for tid in tok.encode(name).ids:
            piece = tok.decode([tid])
            if len(piece) >= 2 and arng.random() < args.name_split:
                cut = arng.randrange(1, len(piece))
                out_ids += tok.encode(piece[:cut]).ids + tok.encode(piece[cut:]).ids
            else:
                out_ids.append(tid)
        return out_ids

    def encode_train(texts):
        if args.name_split <= 0:
            return encode(texts)
        res = []
        for text in texts:
            # (not documents with a documentation block: its `name(signature)` entries are not
            # split, so the answer's copy of the name must not be either)
            if arng.random() >= args.name_split_docs or "`" not in text or "Python documentation:" in text:
                res.append(tok.encode(text).ids)
                continue
            parts = name_re.split(text)
            memo, ids = {}, []
            for i, part in enumerate(parts):
                if not part:
                    continue
                if i % 2:
                    if part not in memo:
                        memo[part] = split_name(part)
                    ids += memo[part]
                else:
                    ids += tok.encode(part).ids
            res.append(ids)
        return res

    _chk = "<|user|>\nWhat does `json.dumps` do?<|end|>\n<|assistant|>\n`json.dumps`: Serialize `obj`.<|end|>\n"
    _parts = name_re.split(_chk)
    assert sum((tok.encode(p_).ids for p_ in _parts if p_), []) == tok.encode(_chk).ids, "name split boundaries"

    # held-out sample: whole documents of at most 256 tokens, so text <-> ids round-trips
    hrng = random.Random(args.seed + 2)
    sample = []
    quota = {"qa": args.heldout_n * 3 // 8, "write": args.heldout_n * 5 // 16}
    quota["code"] = args.heldout_n - quota["qa"] - quota["write"]
    for cat, n in quota.items():
        got, tries = 0, 0
        pool = list(held_code)
        hrng.shuffle(pool)
        while got < n and tries < 20000:
            tries += 1
            if cat == "code":
                if not pool:
                    break
                text = pool.pop()
            else:
                text = make_doc(qa_held if cat == "qa" else wr_held, hrng, cat)
                if text is None:
                    continue
            ids = tok.encode(text).ids
            if len(ids) > 256 or len(ids) < 16 or tok.decode(ids, skip_special_tokens=False) != text:
                continue
            if any(s["text"] == text for s in sample):
                continue
            sample.append({"kind": cat, "text": text, "ids": ids})
            got += 1
    held_ids = [s["ids"] for s in sample]
    log(f"held-out sample: {len(sample)} sequences, {sum(map(len, held_ids))} tokens")
    if args.corpus_only:
        MODULE_SWAP["p"] = args.module_swap
        prng = random.Random(7)
        for cat in list(pools) + ["topic_text", "code"]:
            for _ in range(5 if cat in ("qa", "copy") else 2):
                t = (prng.choice(topic_text) if cat == "topic_text" else prng.choice(train_code)
                     if cat == "code" else make_doc(pools[cat], prng, cat))
                if t:
                    print(f"----- {cat} ({len(tok.encode(t).ids)} tokens)\n{t[:700]}")
        chars = sum(len(t) for t in next_texts_preview(pools, topic_text, train_code, 2000))
        log(f"corpus-only: done ({chars} chars in 2000 sampled documents)")
        shutil.rmtree(work, ignore_errors=True)
        return 0

    # a same-shaped sample of training documents (to compare train vs held-out loss)
    srng = random.Random(args.seed + 3)
    train_sample = []
    while len(train_sample) < len(sample):
        cat = sample[len(train_sample)]["kind"]
        text = srng.choice(train_code) if cat == "code" else make_doc(
            qa_train if cat == "qa" else wr_train, srng, cat)
        if text is None:
            continue
        ids = tok.encode(text).ids
        if 16 <= len(ids) <= 256:
            train_sample.append(ids)

    MODULE_SWAP["p"] = args.module_swap  # training documents from here on

    # 3. model
    cfg = model_config(args, tok.get_vocab_size())
    n_params = count_params(cfg)
    f32_bytes = n_params * 4
    save_dtype = torch.float32 if f32_bytes <= args.max_mb * 1e6 else torch.bfloat16
    est_bytes = n_params * (4 if save_dtype == torch.float32 else 2)
    if est_bytes > args.max_mb * 1e6:
        raise SystemExit(f"checkpoint would be {est_bytes / 1e6:.1f} MB > {args.max_mb} MB; shrink the model")
    if args.init_from:
        # continued training: the weights of an earlier run of the same shape and tokenizer
        model = OlmoeForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_experts,
                model.config.intermediate_size, model.config.vocab_size) != (
                cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.intermediate_size, cfg.vocab_size):
            raise SystemExit(f"--init-from {args.init_from}: its shape differs from the arguments' model")
        from tokenizers import Tokenizer
        init_tok = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
        if init_tok.get_vocab() != tok.get_vocab():
            raise SystemExit(f"--init-from {args.init_from}: its tokenizer differs from this run's")
        log(f"weights from {args.init_from}")
    else:
        model = OlmoeForCausalLM(cfg)
    model.config._experts_implementation = "grouped_mm"  # training speed only (same math as eager)
    real = sum(p.numel() for p in model.parameters())
    assert real == n_params, (real, n_params)
    D, I, E, K, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    expert_params = L * E * 3 * D * I
    active = n_params - expert_params + L * K * 3 * D * I
    log(f"OLMoE: {L} layers, hidden {D}, {cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), "
        f"{E} experts x width {I}, top-{K}, vocab {cfg.vocab_size}; {n_params / 1e6:.2f} M params "
        f"({active / 1e6:.2f} M active/token); checkpoint {est_bytes / 1e6:.1f} MB as {save_dtype}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    # data stream: documents drawn by category, concatenated, cut into windows
    mix = args.mixture.split(",")
    mix = mix + ["0"] * (9 - len(mix)) if len(mix) in (7, 8) else mix  # older recipes: no copy / docs
    if len(mix) != 9 or not all(re.fullmatch(r"\d+(\.\d*)?", w) for w in mix) or sum(map(float, mix)) <= 0:
        raise SystemExit(f"--mixture {args.mixture!r}: give 7 to 9 non-negative shares "
                         "(qa,howto,example,write,topic,topic_text,code[,copy[,docs]]), e.g. 0.3,0.15,0.05,0.1,0.1,0.05,0.2,0.05")
    weights = dict(zip(("qa", "howto", "example", "write", "topic", "topic_text", "code", "copy", "docs"),
                       (float(w) for w in mix)))
    drng = random.Random(args.seed + 4)
    code_order = list(range(len(train_code)))
    drng.shuffle(code_order)
    code_pos = [0]

    def next_texts(n):
        res = []
        while len(res) < n:
            cat = drng.choices(list(weights), weights=list(weights.values()))[0]
            if cat == "code":
                if code_pos[0] >= len(code_order):
                    drng.shuffle(code_order)
                    code_pos[0] = 0
                res.append(train_code[code_order[code_pos[0]]])
                code_pos[0] += 1
            elif cat == "topic_text":
                res.append(drng.choice(topic_text))
            else:
                t = make_doc(pools[cat], drng, cat)
                if t:
                    res.append(t)
        return res

    buf: list[int] = []
    need = args.batch * args.seq_len

    def next_batch():
        while len(buf) < need:
            for ids in encode_train(next_texts(64)):
                buf.extend(ids)
        x = torch.tensor(buf[:need]).view(args.batch, args.seq_len)
        del buf[:need]
        return x

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("flag", True))
    budget = args.minutes * 60.0

    def lr_at(step, frac):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = min(1.0, frac)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    evals = []

    def evaluate(step, tokens, t_train):
        model.eval()
        h = held_out_nll(model, held_ids, torch, batch=16)
        tr = held_out_nll(model, train_sample, torch, batch=16)
        model.train()
        evals.append({"step": step, "tokens": tokens, "train_seconds": round(t_train, 1),
                      "heldout_loss": round(h, 4), "train_sample_loss": round(tr, 4)})
        log(f"eval step {step}: held-out loss {h:.4f} nats/token (ppl {math.exp(h):.1f}), "
            f"train-sample loss {tr:.4f}")
        if args.checkpoint_dir and step > 0:
            save_checkpoint(args.checkpoint_dir, step)

    def save_checkpoint(root: Path, step: int):
        """A loadable checkpoint (HF OLMoE + tokenizer + the held-out sample) in root/latest,
        written to a temp folder and renamed into place, so a cut run leaves the last whole one."""
        root.mkdir(parents=True, exist_ok=True)
        tmpd = Path(tempfile.mkdtemp(prefix="ckpt_", dir=root))
        impl = model.config._experts_implementation
        model.config._experts_implementation = "eager"
        m2 = model.to(save_dtype) if save_dtype != torch.float32 else model
        m2.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=[end_id, eot_id],
                                                pad_token_id=ids_of[PAD])
        m2.save_pretrained(tmpd, safe_serialization=True)
        if save_dtype != torch.float32:
            model.to(torch.float32)
        model.config._experts_implementation = impl
        tok.save(str(tmpd / "tokenizer.json"))
        (tmpd / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.max_pos), indent=2) + "\n")
        with open(tmpd / "heldout_sample.jsonl", "w", encoding="utf-8") as f:
            for s_ in sample:
                f.write(json.dumps({"kind": s_["kind"], "n_tokens": len(s_["ids"]), "ids": s_["ids"],
                                    "text": s_["text"]}, ensure_ascii=False) + "\n")
        write_index(docs_all, tmpd / INDEX_FILE)
        (tmpd / "checkpoint.json").write_text(json.dumps({"step": step, "evaluations": evals}, indent=1))
        old_ = root / "latest"
        if old_.exists():
            shutil.rmtree(root / "previous", ignore_errors=True)
            os.replace(old_, root / "previous")
        os.replace(tmpd, old_)
        log(f"checkpoint (step {step}) saved in {old_}")

    log(f"training for {args.minutes} min: batch {args.batch} x seq {args.seq_len}, lr {args.lr}, "
        f"warmup {args.warmup}, aux coef {args.aux_coef}")
    model.train()
    fwd = torch.compile(model) if args.compile else model
    evaluate(0, 0, 0.0)  # before the clock starts
    step, tokens, t_train, t_data = 0, 0, 0.0, 0.0
    ce_hist, aux_hist = [], []
    t_loop = time.time()
    c_loop = time.process_time()
    wall_cap = args.max_wall_minutes * 60.0 if args.clock == "cpu" and args.max_wall_minutes > 0 else 0.0

    def clock():
        """Seconds of the budget used: wall clock or this process's CPU time (--clock)."""
        return time.process_time() - c_loop if args.clock == "cpu" else time.time() - t_loop

    def budget_frac():
        f = clock() / budget
        return max(f, (time.time() - t_loop) / wall_cap) if wall_cap else f

    next_eval = args.eval_every_min * 60.0
    while not stop["flag"]:
        elapsed = clock()
        if budget_frac() >= 1.0 or (args.steps and step >= args.steps):
            break
        frac = max(step / args.steps, budget_frac()) if args.steps else budget_frac()
        lr = lr_at(step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        x = next_batch()
        t_data += time.time() - t0
        # no labels: transformers would add its layer-pooled aux loss; we add the per-layer one
        outp = fwd(input_ids=x, output_router_logits=True)
        ce_loss = torch.nn.functional.cross_entropy(
            outp.logits[:, :-1].reshape(-1, outp.logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        aux_loss = per_layer_aux_loss(outp.router_logits, E, K)
        loss = ce_loss + args.aux_coef * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_train += time.time() - t0
        step += 1
        tokens += x.numel()
        aux = aux_loss.item()
        ce = ce_loss.item()
        ce_hist.append(ce)
        aux_hist.append(aux)
        if step % 25 == 0 or step == 1:
            with torch.no_grad():  # expert-usage entropy of this batch's top-k selections
                ents = []
                for rl in outp.router_logits:
                    c = torch.bincount(rl.topk(K, dim=-1).indices.reshape(-1), minlength=E).double()
                    p = c[c > 0] / c.sum()
                    ents.append(float(-(p * p.log()).sum()) / math.log(E))
            log(f"step {step} tok {tokens / 1e6:.2f}M lr {lr:.2e} ce {sum(ce_hist[-25:]) / len(ce_hist[-25:]):.4f} "
                f"aux {sum(aux_hist[-25:]) / len(aux_hist[-25:]):.4f} gnorm {float(gn):.2f} "
                f"H/logE min {min(ents):.3f} mean {sum(ents) / len(ents):.3f} "
                f"{tokens / max(t_train, 1e-9):.0f} tok/s (data {t_data / max(t_train, 1e-9):.0%}), "
                f"{clock() / 60:.1f}/{args.minutes} {args.clock} min, wall {(time.time() - t_loop) / 60:.1f} min")
        if not math.isfinite(ce):
            raise SystemExit("loss is not finite")
        if next_eval <= clock() and budget_frac() < 1.0:  # the final evaluation follows the loop
            evaluate(step, tokens, t_train)
            next_eval += args.eval_every_min * 60.0
    loop_seconds = time.time() - t_loop
    loop_cpu_seconds = time.process_time() - c_loop
    log(f"training stopped after {step} steps, {tokens} tokens, {loop_seconds / 60:.1f} wall min, "
        f"{loop_cpu_seconds / 60:.1f} CPU min")

    model.eval()
    heldout = held_out_nll(model, held_ids, torch)
    train_sample_loss = held_out_nll(model, train_sample, torch)
    if evals and evals[-1]["step"] == step:
        evals.pop()
    evals.append({"step": step, "tokens": tokens, "train_seconds": round(t_train, 1),
                  "heldout_loss": round(heldout, 4), "train_sample_loss": round(train_sample_loss, 4)})
    log(f"final held-out loss {heldout:.4f} nats/token, train-sample loss {train_sample_loss:.4f}")
    stats = routing_stats(model, held_ids, torch)
    log(f"usage entropy / log(E): {stats['usage_entropy_ratio_per_layer']}")
    log(f"PILOT=1 recall: {stats['pilot1_recall_per_layer']} (mean {stats['pilot1_recall_mean']})")
    if stats["min_entropy_ratio"] < 0.8:
        log("WARNING: a layer's expert-usage entropy is below 0.8 x log(num_experts); raise --aux-coef")

    # 4. save
    model.config._experts_implementation = "eager"
    model = model.to(save_dtype)
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=[end_id, eot_id],
                                               pad_token_id=ids_of[PAD])
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.max_pos), indent=2) + "\n")
    with open(out / "heldout_sample.jsonl", "w", encoding="utf-8") as f:
        for s in sample:
            f.write(json.dumps({"kind": s["kind"], "n_tokens": len(s["ids"]), "ids": s["ids"],
                                "text": s["text"]}, ensure_ascii=False) + "\n")

    # verify the checkpoint: standard per-expert tensor names, reload, same held-out loss
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for li in range(L):
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{li}.mlp.experts.{e}.{proj}.weight" in keys, (li, e, proj)
        assert f"model.layers.{li}.mlp.gate.weight" in keys
    reloaded = OlmoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    heldout_reloaded = held_out_nll(reloaded, held_ids, torch)
    log(f"reloaded checkpoint: {len(keys)} tensors, held-out loss {heldout_reloaded:.4f}")

    # questions for the model card, and transformers' greedy answers as a reference
    questions = pick_questions(qa_train, wr_train)
    write_index(docs_all, out / INDEX_FILE)
    (out / "questions.json").write_text(json.dumps(questions, indent=2, ensure_ascii=False) + "\n")
    (out / "heldout_questions.json").write_text(
        json.dumps(heldout_questions(qa_held, 50, args.seed), indent=1, ensure_ascii=False) + "\n")
    refs = []
    with torch.no_grad():
        for q in questions:
            prompt = render_chat(q["messages"], add_generation_prompt=True)
            pids = tok.encode(prompt).ids
            g = reloaded.generate(torch.tensor([pids]), max_new_tokens=96, do_sample=False,
                                  eos_token_id=[end_id, eot_id], pad_token_id=ids_of[PAD])
            new = g[0, len(pids):].tolist()
            refs.append({"prompt_ids": pids, "output_ids": new,
                         "text": tok.decode(new, skip_special_tokens=True)})
            log(f"Q: {q['messages'][-1]['content']}\nA: {refs[-1]['text']}")

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    training_log = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "machine": {"cpu": _cpu_name(), "logical_cpus": os.cpu_count(), "torch_threads": args.threads,
                    "ram_gb": _ram_gb()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "command": "python tools/train_default_model.py " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:])),
        "args": {k: (_rel(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("_extract", "eval_only")},
        "corpus": {
            "source": f"Python {platform.python_version()} standard library: docstrings, signatures and "
                      f"source code (inspect), license: PSF License Agreement",
            "modules": len(data["modules"]), "top_level_modules": len(tops),
            "objects": len(data["items"]),
            "heldout_top_level_modules": sorted(heldout_tops),
            "seeds_train": len(train_seeds), "seeds_heldout": len(held_seeds),
            "qa_seeds_train": len(qa_train), "write_seeds_train": len(wr_train),
            "code_chunks_train": len(train_code), "code_chunks_heldout": len(held_code),
            "mixture_weights": weights,
            "extra": {"pydoc_topic_chunks": len(topic_pairs),
                      "pydoc_topics": len({t["key"] for t in topic_pairs}),
                      "topic_method_entries": len(topic_methods), "howto_seeds_train": len(ho_train),
                      "howto_seeds_heldout": len(ho_held), "doctest_example_seeds_train": len(ex_train)},
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_token_ids": ids_of, "chat_template": CHAT_TEMPLATE},
        "model": {"architecture": "OlmoeForCausalLM", "layers": L, "hidden_size": D,
                  "attention_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                  "experts": E, "experts_per_token": K, "expert_width": I,
                  "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
                  "tie_word_embeddings": False, "norm_topk_prob": False,
                  "router_aux_loss_coef": args.aux_coef,
                  "parameters": n_params, "expert_parameters": expert_params,
                  "active_parameters_per_token": active, "dtype": str(save_dtype).replace("torch.", "")},
        "training": {
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), weight decay on matrices except embeddings",
            "loss": ("next-token cross-entropy + router_aux_loss_coef x load-balancing loss; the "
                     "load-balancing loss is transformers' load_balancing_loss_func (Switch "
                     "Transformer) applied to each layer's router logits separately and averaged "
                     "over layers (balanced = num_experts_per_tok); transformers 5 "
                     "OlmoeForCausalLM, given labels and output_router_logits, adds the same "
                     "function over all layers at once, which pools the layers' expert counts "
                     "and so does not balance each layer"),
            "lr_peak": args.lr, "lr_min": args.lr * args.min_lr_frac, "warmup_steps": args.warmup,
            "schedule": "linear warmup, cosine decay over " + (
                f"{args.steps} steps or the {args.minutes}-minute budget, whichever is further along"
                if args.steps else f"the {args.minutes}-minute budget"),
            "batch": args.batch, "seq_len": args.seq_len, "grad_clip": 1.0, "seed": args.seed,
            "steps": step, "tokens_seen": tokens, "train_seconds": round(t_train, 1),
            "loop_seconds": round(loop_seconds, 1), "loop_cpu_seconds": round(loop_cpu_seconds, 1),
            "budget_minutes": args.minutes, "budget_clock": args.clock,
            "max_wall_minutes": args.max_wall_minutes,
            "stopped_by": "steps" if args.steps and step >= args.steps else (
                "signal" if stop["flag"] else
                "wall-clock cap" if wall_cap and (time.time() - t_loop) >= wall_cap
                and clock() < budget else "time budget"),
            "module_swap": args.module_swap,
            "final_train_loss": round(sum(ce_hist[-50:]) / max(1, len(ce_hist[-50:])), 4),
            "final_train_loss_definition": "mean cross-entropy (nats/token, aux loss excluded) of the last 50 training steps",
            "final_aux_loss": round(sum(aux_hist[-50:]) / max(1, len(aux_hist[-50:])), 4),
            "loss_curve": [{"step": i + 1, "ce": round(sum(ce_hist[max(0, i - 24):i + 1]) / len(ce_hist[max(0, i - 24):i + 1]), 4)}
                           for i in range(24, len(ce_hist), 25)],
        },
        "evaluations": evals,
        "heldout_loss": round(heldout, 4),
        "heldout_loss_reloaded": round(heldout_reloaded, 4),
        "heldout_loss_definition": ("mean next-token NLL in nats/token over heldout_sample.jsonl: each "
                                    "sequence alone (batch 1), positions 1..n-1, total NLL / total count"),
        "train_sample_loss": round(train_sample_loss, 4),
        "routing": stats,
        "reference_greedy_transformers": refs,
        "files": files,
        "total_seconds": round(time.time() - t_start, 1),
    }
    (out / "training_log.json").write_text(json.dumps(training_log, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {out}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in files.items()))
    return 0


def reevaluate(out: Path, threads: int) -> int:
    import torch
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(threads)
    model = OlmoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with open(out / "heldout_sample.jsonl", encoding="utf-8") as f:
        held_ids = [json.loads(line)["ids"] for line in f if line.strip()]
    heldout = held_out_nll(model, held_ids, torch)
    stats = routing_stats(model, held_ids, torch)
    log(f"held-out loss {heldout:.4f}; usage entropy / log(E) {stats['usage_entropy_ratio_per_layer']}; "
        f"PILOT=1 recall {stats['pilot1_recall_per_layer']} (mean {stats['pilot1_recall_mean']})")
    lp = out / "training_log.json"
    tlog = json.loads(lp.read_text()) if lp.exists() else {}
    tlog["heldout_loss_reloaded"] = round(heldout, 4)
    tlog["routing"] = stats
    tlog["routing_computed_on"] = "reloaded checkpoint (--eval-only, float32, eager experts)"
    lp.write_text(json.dumps(tlog, indent=1) + "\n")
    return 0 if stats["min_entropy_ratio"] >= 0.8 else 1


def heldout_questions(qa_held, n: int = 50, seed: int = 1234) -> list[dict]:
    """``n`` questions about the held-out modules (never trained on), half "What does `X` do?"
    and half "How do I <task>?" (the task from X's docstring summary, so the answer has to
    name X itself), each with the docstring summary as the reference answer and the names a
    right answer mentions (X's last dotted part, or X's top-level module).  Disjoint objects,
    chosen with random.Random(seed + 5) so every model is scored on the same questions."""
    rng = random.Random(seed + 5)
    objs = sorted((s for s in qa_held if s["kind"] != "module"), key=lambda s: s["name"])
    howto = [s for s in objs if howto_question(s)]
    rng.shuffle(howto)
    ho = howto[:n // 2]
    used = {s["name"] for s in ho}
    rest = [s for s in objs if s["name"] not in used]
    rng.shuffle(rest)
    wd = rest[:n - len(ho)]
    out = []
    for s in wd:
        out.append({"kind": "what", "about": s["name"], "question": f"What does `{s['name']}` do?",
                    "reference": s["summary"], "names": [s["name"].rsplit(".", 1)[-1], s["name"].split(".")[0]]})
    for s in ho:
        out.append({"kind": "howto", "about": s["name"], "question": f"How do I {howto_question(s)}?",
                    "reference": s["summary"], "names": [s["name"].rsplit(".", 1)[-1], s["name"].split(".")[0]]})
    return out


def pick_questions(qa_train, wr_train):
    """Five fixed questions about standard-library functions that were in the training data."""
    by = {s["name"]: s for s in qa_train}
    wby = {s["name"]: s for s in wr_train}
    wanted = [("json.dumps", "What does `json.dumps` do?"),
              ("os.path.join", "What does `os.path.join` do?"),
              ("math.sqrt", "What does `math.sqrt` do?"),
              ("collections", "What is the `collections` module for?"),
              ("str.join", "Explain `str.join`.")]
    backups = [("itertools.chain", "What does `itertools.chain` do?"),
               ("random.choice", "What does `random.choice` do?"),
               ("re", "What is the `re` module for?"),
               ("shutil.copyfile", "What does `shutil.copyfile` do?"),
               ("sorted", "What does `sorted` do?")]
    qs = []
    for name, q in wanted + backups:
        if name in by and len(qs) < 4:
            qs.append({"messages": [{"role": "user", "content": q}], "about": name,
                       "reference_answer": by[name]["summary"]})
    for name in ("shlex.quote", "os.path.splitext", "fnmatch.fnmatch", "textwrap.dedent"):
        if name in wby:
            s = wby[name]
            q = WRITE_TEMPLATES[0].format(s=_task_phrase(s["first_line"]), short="")
            qs.append({"messages": [{"role": "user", "content": q}], "about": name,
                       "reference_answer": f"```python\n{s['source']}\n```"})
            break
    return qs[:5]


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
