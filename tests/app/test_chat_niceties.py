"""Chat niceties: search in message text (SQLite FTS5, a v1 file
migrated safely) from the sidebar; export a chat to Markdown and JSON (atomic); the
"generating" mark in the sidebar; the "Ask anything" hint after New chat; a narrow window."""

from __future__ import annotations

import json
import os
import sqlite3

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt  # noqa: E402

from colibri_app.history import COMPLETE, History  # noqa: E402

V1_SCHEMA = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '', status TEXT NOT NULL DEFAULT 'complete',
    meta_json TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
PRAGMA user_version=1;
"""


def _v1_file(path):
    """A history file as version 1 of the app wrote it (no full-text index)."""
    c = sqlite3.connect(str(path))
    c.executescript(V1_SCHEMA)
    c.execute("INSERT INTO conversations VALUES (1, 'Reading files', '', 1, 1)")
    c.execute("INSERT INTO conversations VALUES (2, 'Sorting', '', 2, 2)")
    rows = [(1, "user", "How do I read a CSV file?"),
            (1, "assistant", "Use csv.DictReader; each row is a dict. Voilà, café."),
            (2, "user", "How do I sort a list of dicts by a key?"),
            (2, "assistant", "sorted(rows, key=lambda r: r['age'])")]
    for i, (conv, role, text) in enumerate(rows, 1):
        c.execute("INSERT INTO messages VALUES (?,?,?,?,?,?,?)", (i, conv, role, text, "complete", "{}", i))
    c.commit()
    c.close()


def test_v1_history_is_migrated_and_searchable(tmp_path):
    p = tmp_path / "history.sqlite3"
    _v1_file(p)
    h, msg = History.open(p)
    assert msg is None and h.has_fts
    assert h.conn.execute("PRAGMA user_version").fetchone()[0] == 2
    assert (tmp_path / "history.sqlite3.v1-backup").is_file()       # the old file, kept once
    b = sqlite3.connect(str(tmp_path / "history.sqlite3.v1-backup"))
    assert b.execute("SELECT count(*) FROM messages").fetchone()[0] == 4
    b.close()
    hits = h.search("csv")
    assert [(x.conversation_id, x.message_id) for x in hits] and {x.message_id for x in hits} == {1, 2}
    assert "[" in hits[0].snippet and "]" in hits[0].snippet
    assert [x.message_id for x in h.search("cafe")] == [2]           # diacritics folded
    assert [x.message_id for x in h.search("dict key")] == [3]        # every word, prefixes
    assert h.search('"') == [] and h.search("   ") == []
    for q in ("AND (", "NEAR( ) * ^ -", "csv OR", "col:x"):            # never an FTS5 syntax error
        assert isinstance(h.search(q), list)
    # the index follows new, edited and deleted messages (triggers)
    mid = h.add_message(2, "assistant", "use operator.itemgetter")
    assert [x.message_id for x in h.search("itemgetter")] == [mid]
    h.update_message(mid, content="use attrgetter instead")
    assert h.search("itemgetter") == [] and [x.message_id for x in h.search("attrgetter")] == [mid]
    h.delete_conversation(2)
    assert h.search("attrgetter") == [] and h.search("sorted") == []
    h.close()
    h2, msg = History.open(p)                                          # opened again: no second migration
    assert msg is None and [x.message_id for x in h2.search("csv")] != []
    h2.close()


def test_search_without_fts5_falls_back(tmp_path, monkeypatch):
    """A SQLite built without FTS5: the history opens, stays at version 1, search scans."""
    import colibri_app.history as hist
    p = tmp_path / "history.sqlite3"
    _v1_file(p)
    monkeypatch.setattr(hist, "_FTS_SCHEMA", ("CREATE VIRTUAL TABLE messages_fts USING no_fts_here(content)",))
    h, msg = History.open(p)
    assert msg is None and not h.has_fts
    assert h.conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert {x.message_id for x in h.search("csv")} == {1, 2} and h.search("100%") == []
    h.close()


def test_sidebar_search_finds_message_text(qtbot, make_window):
    win = make_window(wait_loaded=False)
    h = win.history
    a = h.create_conversation("Reading files")
    h.add_message(a.id, "user", "How do I read a CSV file?")
    ans = h.add_message(a.id, "assistant", "Use csv.DictReader from the standard library.", COMPLETE)
    b = h.create_conversation("Sorting")
    h.add_message(b.id, "user", "How do I sort a list of dicts?")
    win.sidebar.search.setText("DictReader")
    lst = win.sidebar.list
    assert lst.count() == 1 and lst.item(0).data(Qt.UserRole) == a.id   # found by text, not title
    assert "DictReader" in lst.item(0).text() and "Reading files" in lst.item(0).text()
    assert win.sidebar.hits_label.isVisibleTo(win) and "1 chat" in win.sidebar.hits_label.text()
    lst.item(0).setSelected(True)
    assert win.conv_id == a.id and win.chat.view(ans).property("found") is True
    win.sidebar.search.setText("Sorting")                               # titles still match
    assert [lst.item(i).data(Qt.UserRole) for i in range(lst.count())] == [b.id]
    win.sidebar.search.setText("nothing-like-this")
    assert lst.count() == 0 and "Nothing found" in win.sidebar.hits_label.text()
    win.sidebar.search.setText("")
    assert lst.count() == 2 and not win.sidebar.hits_label.isVisibleTo(win)


def test_a_200_kb_paste_in_the_search_box_keeps_the_window_on_screen(qtbot, make_window):
    """The line under the search box quotes the query shortened to one line: a pasted source
    file made it thousands of pixels tall and pushed the message box off the screen."""
    win = make_window(wait_loaded=False)
    h = win.history
    h.add_message(h.create_conversation("Reading files").id, "user", "How do I read a CSV file?")
    height = win.minimumSizeHint().height()
    for query in ("def read(path):\n    return open(path).read()\n" * 4000, "csv " * 50_000):
        win.sidebar.search.setText(query)
        text = win.sidebar.hits_label.text()
        assert len(text) < 120 and "\n" not in text, text[:200]
        assert win.minimumSizeHint().height() <= height + 100
    assert "csv csv" in win.sidebar.hits_label.text() and "…" in win.sidebar.hits_label.text()


def test_export_markdown_and_json(qtbot, make_window, tmp_path):
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    win = make_window(wait_loaded=False)
    h = win.history
    c = h.create_conversation("CSV question", "be brief")
    h.add_message(c.id, "user", "How do I read a CSV file?")
    h.add_message(c.id, "assistant", "Like this:\n\n```python\nimport csv\n```\n", COMPLETE,
                  {"tokens": 9, "tok_per_s": 50.0, "ttft_s": 0.1, "finish_reason": "stop"})
    win.select_conversation(c.id)
    assert win.act_export.isEnabled()
    md = win.export_conversation(str(tmp_path / "chat.md"))
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# CSV question")
    assert "## You\n\nHow do I read a CSV file?" in text and "```python\nimport csv\n```" in text
    assert "be brief" in text and "9 tokens" in text
    js = win.export_conversation(str(tmp_path / "chat.json"))
    d = json.loads(js.read_text(encoding="utf-8"))
    assert d["format"] == "colibri-chat" and d["title"] == "CSV question" and d["system_prompt"] == "be brief"
    assert [(m["role"], m["status"]) for m in d["messages"]] == [("user", "complete"), ("assistant", "complete")]
    assert d["messages"][1]["meta"]["tokens"] == 9
    # atomic: a failed write leaves the earlier export whole, and says why in the banner
    import colibri_app.export as ex
    before = js.read_bytes()

    def boom(path, text, mode=None):
        raise OSError("disk full")
    orig = ex.library.atomic_write_text
    ex.library.atomic_write_text = boom
    try:
        assert win.export_conversation(str(js)) is None
    finally:
        ex.library.atomic_write_text = orig
    assert js.read_bytes() == before and "disk full" in win.banner.text.text()
    assert not list(tmp_path.glob("*.tmp*")) and sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "chat.md"]
    assert win.export_conversation(str(tmp_path / "chat.txt")) is None   # only .md / .json
    assert "Markdown (.md) or JSON (.json)" in win.banner.text.text()
    win.new_chat()
    assert not win.act_export.isEnabled()


def test_generating_mark_in_sidebar(qtbot, make_window):
    from colibri_app.main_window import GENERATING
    win = make_window(max_new_tokens=400)
    win.send("Tell me a long story")
    qtbot.waitUntil(lambda: win.answer is not None, timeout=1_800_000)
    lst = win.sidebar.list
    [row] = [i for i in range(lst.count()) if lst.item(i).data(Qt.UserRole) == win.conv_id]
    it = lst.item(row)
    assert it.data(Qt.UserRole + 1) == GENERATING == "generating…" and "generating" in it.text()
    assert not it.icon().isNull()
    win.stop()
    qtbot.waitUntil(lambda: win.answer is None, timeout=1_800_000)
    it = lst.item(row)
    assert it.data(Qt.UserRole + 1) == "" and "generating" not in it.text() and it.icon().isNull()


def test_ask_anything_hint_comes_back_after_new_chat(qtbot, make_window):
    win = make_window(wait_loaded=False)
    h = win.history
    c = h.create_conversation("old")
    h.add_message(c.id, "user", "hello")
    win.select_conversation(c.id)
    assert not win.chat.empty_label.isVisibleTo(win)
    win.new_chat()
    assert win.chat.empty_label.isVisibleTo(win) and "Ask anything" in win.chat.empty_label.text()
    win.select_conversation(c.id)
    assert not win.chat.empty_label.isVisibleTo(win)


def test_window_can_be_narrow(qtbot, make_window):
    """Before: at least 1124 px with a model open and the panels shown."""
    win = make_window()                      # a model open: the status bar holds its numbers
    win.st_model.setText("a-model-with-a-rather-long-name-int8 (int8)")
    assert win.dock.isVisible()

    def narrow():
        win.resize(780, 700)                 # as a user drags the edge: in steps
        return win.width() <= 800
    qtbot.waitUntil(narrow, timeout=1_800_000)
    qtbot.waitUntil(lambda: win.minimumSizeHint().width() <= 800, timeout=1_800_000)   # was 1124 px
    qtbot.waitUntil(lambda: win.chat.width() >= 300, timeout=1_800_000)   # the chat stays usable
    assert win.chat.send_btn.isVisibleTo(win) and win.chat.input.width() >= 150
    # the panels stack under the chat (two by two), and go back beside it in a wide window
    assert win.dockWidgetArea(win.dock) == Qt.BottomDockWidgetArea and win.panels.columns == 2
    assert win.dock.isVisible() and win.dock.width() >= 600
    win.resize(1300, 800)
    qtbot.waitUntil(lambda: win.dockWidgetArea(win.dock) == Qt.RightDockWidgetArea, timeout=1_800_000)
    assert win.panels.columns == 1


def test_an_export_over_a_folder_says_why_in_words(qtbot, make_window, tmp_path):
    """The banner said "[Errno 21] Is a directory: ..." (Python's tag first)."""
    win = make_window(wait_loaded=False)
    c = win.history.create_conversation("A chat", "")
    win.history.add_message(c.id, "user", "What does len do?")
    win.select_conversation(c.id)
    target = tmp_path / "chat.md"
    target.mkdir()  # a folder where the file would go
    assert win.export_conversation(str(target)) is None
    said = win.banner.text.text()
    assert "Is a directory" in said and "[Errno" not in said, said
