"""History: SQLite storage, crash recovery, corrupt files, defensive reads."""

from __future__ import annotations

import sqlite3

import pytest

from colibri_app.history import COMPLETE, INTERRUPTED, STREAMING, History


def test_roundtrip_and_search(tmp_path):
    h, msg = History.open(tmp_path / "h.sqlite3")
    assert msg is None
    a = h.create_conversation("Python json question", "be brief")
    b = h.create_conversation("100% off_topic")
    m1 = h.add_message(a.id, "user", "hi")
    m2 = h.add_message(a.id, "assistant", "hello", COMPLETE, {"tokens": 3})
    assert [(m.role, m.content, m.meta) for m in h.messages(a.id)] == [("user", "hi", {}), ("assistant", "hello", {"tokens": 3})]
    assert [c.id for c in h.conversations("JSON")] == [a.id]
    assert [c.id for c in h.conversations("100%")] == [b.id]        # LIKE wildcards are escaped
    assert [c.id for c in h.conversations("f_t")] == [b.id]
    assert h.conversations("x%y") == []
    h.rename_conversation(a.id, "renamed")
    h.set_system_prompt(a.id, "sys")
    c = h.conversation(a.id)
    assert (c.title, c.system_prompt) == ("renamed", "sys")
    h.delete_from(a.id, m2)
    assert [m.id for m in h.messages(a.id)] == [m1]
    h.delete_conversation(a.id)
    assert h.conversation(a.id) is None and h.messages(a.id) == []
    assert h.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    h.close()


def test_streaming_rows_become_interrupted_on_open(tmp_path):
    p = tmp_path / "h.sqlite3"
    h, _ = History.open(p)
    c = h.create_conversation("t")
    h.add_message(c.id, "user", "q")
    mid = h.add_message(c.id, "assistant", "partial ans", STREAMING)
    h.close()  # the app "crashed" here
    h2, _ = History.open(p)
    m = h2.message(mid)
    assert m.status == INTERRUPTED and m.content == "partial ans"
    h2.close()


def test_corrupt_file_is_moved_aside(tmp_path):
    p = tmp_path / "h.sqlite3"
    p.write_bytes(b"this is not a database" * 200)
    h, msg = History.open(p)
    aside = list(tmp_path.glob("h.sqlite3.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    assert msg and str(aside[0]) in msg
    assert h.conversations() == []
    h.create_conversation("fresh")
    h.close()


def test_one_bad_row_does_not_hide_the_others(tmp_path):
    p = tmp_path / "h.sqlite3"
    h, _ = History.open(p)
    c = h.create_conversation("t")
    h.add_message(c.id, "user", "good 1")
    h.add_message(c.id, "assistant", "good 2")
    with h.conn:
        h.conn.execute("INSERT INTO messages(conversation_id, role, content, status, meta_json, created) "
                       "VALUES (?, 'robot', 'bad role', 'complete', '{}', 0)", (c.id,))
        h.conn.execute("INSERT INTO messages(conversation_id, role, content, status, meta_json, created) "
                       "VALUES (?, 'user', CAST(X'fffe41' AS TEXT), 'weird', 'not json', 'yesterday')", (c.id,))
        h.conn.execute("INSERT INTO messages(conversation_id, role, content, status, meta_json, created) "
                       "VALUES (?, 'assistant', 'good 3', 'complete', '[1]', 0)", (c.id,))
        h.conn.execute("INSERT INTO conversations(title, system_prompt, created, updated) VALUES (X'fffe', '', 'x', 0)")
    msgs = h.messages(c.id)
    assert [m.content for m in msgs][:2] == ["good 1", "good 2"]
    assert msgs[-1].content == "good 3" and msgs[-1].meta == {}
    odd = msgs[2]   # undecodable bytes and unknown status read as best we can
    assert odd.role == "user" and odd.status == INTERRUPTED and odd.meta == {} and "A" in odd.content
    assert len(h.conversations()) == 2
    h.close()


def test_readonly_sqlite_error_is_not_swallowed(tmp_path):
    # a healthy database opened twice (WAL) works from both connections
    p = tmp_path / "h.sqlite3"
    h, _ = History.open(p)
    h.create_conversation("a")
    other = sqlite3.connect(str(p))
    assert other.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 1
    other.close()
    h.close()


# --- busy is not broken -------------------------------------------------------------------------

from history_lock import hold_lock as _hold_lock, release as _release  # noqa: E402


def _history_with_a_chat(p, journal_mode):
    h, _ = History.open(p)
    c = h.create_conversation("kept")
    h.add_message(c.id, "user", "q")
    h.add_message(c.id, "assistant", "partial", STREAMING)
    h.close()
    if journal_mode != "wal":
        conn = sqlite3.connect(str(p))
        assert conn.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0] == journal_mode
        conn.close()
    return c



@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_a_locked_history_opens_read_only_and_is_never_renamed(tmp_path, journal_mode):
    p = tmp_path / "h.sqlite3"
    c = _history_with_a_chat(p, journal_mode)
    before = sorted(x.name for x in tmp_path.iterdir())
    holder = _hold_lock(p)
    try:
        h, msg = History.open(p, busy_wait_s=0.2)
        assert h.read_only and msg == h.read_only
        assert "in use by another program" in msg and f"pid {holder.pid}" in msg and "read-only" in msg
        assert [x.title for x in h.conversations()] == ["kept"]          # the chats are shown
        assert [m.content for m in h.messages(c.id)] == ["q", "partial"]
        assert not list(tmp_path.glob("*.corrupt-*"))
        h.close()
    finally:
        _release(holder)
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.endswith(("-wal", "-shm"))) == \
        [n for n in before if not n.endswith(("-wal", "-shm"))]
    h, msg = History.open(p)                     # the lock is gone: writable again, recovered
    assert msg is None and not h.read_only
    assert [m.status for m in h.messages(c.id)] == [COMPLETE, INTERRUPTED]
    h.close()


def test_a_damaged_history_is_moved_aside_with_how_to_get_it_back(tmp_path):
    p = tmp_path / "h.sqlite3"
    _history_with_a_chat(p, "delete")
    raw = bytearray(p.read_bytes())
    raw[100:4096] = b"\xff" * (4096 - 100)        # the schema page's cells: SQLite calls it corrupt
    p.write_bytes(bytes(raw))
    h, msg = History.open(p, busy_wait_s=0.2)
    aside = list(tmp_path.glob("h.sqlite3.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(raw)
    assert "damaged" in msg and str(aside[0]) in msg and f"rename {aside[0].name} to h.sqlite3" in msg
    assert not h.read_only and h.conversations() == []
    h.close()


def test_streamed_pieces_after_the_last_checkpoint_survive_a_crash(tmp_path):
    p = tmp_path / "h.sqlite3"
    h, _ = History.open(p)
    c = h.create_conversation("t")
    mid = h.add_message(c.id, "assistant", "", STREAMING)
    h.append_stream(mid, "Hel")
    h.update_message(mid, content="Hel")           # a checkpoint takes the pieces in
    h.append_stream(mid, "lo, ")
    h.append_stream(mid, "world")
    h.close()                                      # the app died here
    h, _ = History.open(p)
    m = h.message(mid)
    assert (m.content, m.status) == ("Hello, world", INTERRUPTED)
    assert h.conn.execute("SELECT count(*) FROM stream_tail").fetchone()[0] == 0
    h.close()


def test_a_history_that_cannot_be_opened_is_left_where_it_is(tmp_path):
    """Not busy and not damaged (here a folder where the file should be: SQLite cannot open
    it): nothing is renamed; an empty read-only history and a message."""
    p = tmp_path / "h.sqlite3"
    p.mkdir()
    (p / "mine.txt").write_text("keep me")
    h, msg = History.open(p, busy_wait_s=0.2)
    assert h.read_only and msg == h.read_only and "could not be opened for writing" in msg
    assert (p / "mine.txt").read_text() == "keep me" and not list(tmp_path.glob("*.corrupt-*"))
    assert h.conversations() == []
    h.close()


def test_a_damaged_history_that_cannot_be_moved_aside_is_left_where_it_is(tmp_path, monkeypatch):
    """The folder refuses the rename (permissions): the damaged file stays as it was, the
    history is read-only (nothing written), and the message says why; never a traceback."""
    import errno
    import colibri_app.history as hist
    p = tmp_path / "h.sqlite3"
    _history_with_a_chat(p, "delete")
    raw = bytearray(p.read_bytes())
    raw[100:4096] = b"\xff" * (4096 - 100)
    p.write_bytes(bytes(raw))

    def refused(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(src))
    monkeypatch.setattr(hist.os, "replace", refused)
    h, msg = History.open(p, busy_wait_s=0.2)
    assert h.read_only and msg == h.read_only
    assert "damaged" in msg and "could not be moved aside" in msg and "left as it is" in msg
    assert p.read_bytes() == bytes(raw) and not list(tmp_path.glob("*.corrupt-*"))
    assert h.conversations() == []
    h.close()


def test_a_lock_taken_while_the_window_runs_keeps_every_write(tmp_path):
    """Another program takes the lock after the history opened: an answer's writes (its
    pieces, its final text) wait in memory and are written in order once the lock goes; a
    write that needs its row now is refused with HistoryBusy naming the program, nothing
    half-written; closing writes what still waits."""
    from colibri_app.history import HistoryBusy
    p = tmp_path / "h.sqlite3"
    h, _ = History.open(p)
    c = h.create_conversation("kept")
    q = h.add_message(c.id, "user", "q")
    a = h.add_message(c.id, "assistant", "", STREAMING)
    seen = []
    h.subscribe_busy(seen.append)
    holder = _hold_lock(p)
    try:
        h.append_stream(a, "par")                  # kept, not raised
        h.update_message(a, content="partial answer", status=COMPLETE)
        h.touch(c.id)
        assert h.waiting_writes == 3
        assert len(seen) == 1 and f"pid {holder.pid}" in seen[0] and str(p) in seen[0]
        with pytest.raises(HistoryBusy, match="in use by another program"):
            h.add_message(c.id, "user", "next question")
        assert not h.flush(force=True) and h.waiting_writes == 3
    finally:
        _release(holder)
    assert h.flush(force=True) and h.waiting_writes == 0 and seen[-1] == "" and h.busy == ""
    assert [(m.id, m.content, m.status) for m in h.messages(c.id)] == \
        [(q, "q", COMPLETE), (a, "partial answer", COMPLETE)]
    holder = _hold_lock(p)
    h.update_message(a, content="the final answer")
    _release(holder)
    h.close()                                       # writes what still waited
    h, _ = History.open(p)
    assert [m.content for m in h.messages(c.id)] == ["q", "the final answer"]
    h.close()
