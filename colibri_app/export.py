"""Export a conversation to Markdown or JSON (File › Export chat…).

Markdown: a ``# title`` heading, the system prompt as a quote, then one ``## You`` /
``## <model>`` section per message (the text as written, with its code fences; an answer's
numbers in italics under it). JSON: ``{"format": "colibri-chat", "version": 1, ...}`` with every
message's role, content, status, Unix time and meta (tokens, tok/s, TTFT, hit rate, MB/token,
finish reason). Both are written atomically (temporary file, fsync, rename:
``engine.library.atomic_write_text``), so an existing file is replaced whole or not at all.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from engine import library

from .chat_view import format_meta
from .history import Conversation, Message

EXPORT_FORMAT = "colibri-chat"
EXPORT_VERSION = 1


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""


def to_markdown(conv: Conversation, messages: list[Message], model: str = "") -> str:
    """The conversation as Markdown text (see the module docstring)."""
    out = [f"# {conv.title or 'Untitled'}", ""]
    out.append(f"_Exported from colibri on {_when(time.time())}; started {_when(conv.created)}_")
    out.append("")
    if conv.system_prompt:
        out += ["> **System prompt:** " + conv.system_prompt.replace("\n", "\n> "), ""]
    for m in messages:
        who = "You" if m.role == "user" else (model or "Assistant") if m.role == "assistant" else m.role.title()
        out += [f"## {who}", "", m.content.rstrip(), ""]
        note = format_meta(m.meta)
        if m.role == "assistant" and note:
            out += [f"_{note}_", ""]
        if m.status not in ("complete",):
            out += [f"_({m.status})_", ""]
    return "\n".join(out).rstrip() + "\n"


def to_json(conv: Conversation, messages: list[Message], model: str = "") -> str:
    """The conversation as JSON text (see the module docstring)."""
    return json.dumps({
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "title": conv.title,
        "system_prompt": conv.system_prompt, "created": conv.created, "updated": conv.updated,
        "model": model, "exported": time.time(),
        "messages": [{"role": m.role, "content": m.content, "status": m.status, "created": m.created,
                      "meta": m.meta} for m in messages],
    }, indent=1, ensure_ascii=False) + "\n"


def suggested_name(conv: Conversation, suffix: str) -> str:
    """A file name from the title: letters, digits, - and _ only (``chat.md`` when empty)."""
    stem = re.sub(r"[^\w\-]+", "-", conv.title or "").strip("-")[:60] or "chat"
    return stem + suffix


def export_conversation(conv: Conversation, messages: list[Message], path: str | Path, model: str = "") -> Path:
    """Write the conversation to ``path``: JSON for ``.json``, Markdown for ``.md`` /
    ``.markdown`` (a name without a suffix gets ``.md``). Atomic. Returns the path written.

    Raises:
        ValueError: another suffix (the message names the two formats).
        OSError: the folder is missing or not writable.
    """
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if not suffix:
        p, suffix = p.with_suffix(".md"), ".md"
    if suffix == ".json":
        text = to_json(conv, messages, model)
    elif suffix in (".md", ".markdown"):
        text = to_markdown(conv, messages, model)
    else:
        raise ValueError(f"{p.name}: export as Markdown (.md) or JSON (.json)")
    if not p.parent.is_dir():
        raise OSError(f"the folder {p.parent} does not exist")
    library.atomic_write_text(p, text)
    return p
