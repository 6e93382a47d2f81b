"""Chat history: conversations and messages in one SQLite file (stdlib sqlite3, WAL).

The file lives in ``user_data_dir()/history.sqlite3``. Used only from the GUI thread.

Crash safety: an answer is written while it streams (status "streaming"): every piece the
window shows is appended to ``stream_tail`` (a small append-only table, so a long answer is not
rewritten, nor re-indexed, 25 times a second); on the next start :meth:`History.open` joins the
pieces to their message and marks every message still "streaming" as "interrupted", so the
partial answer is kept up to the last piece shown.

Busy is not broken: a file another program holds (SQLITE_BUSY / SQLITE_LOCKED: a database
browser's open write transaction, the sqlite3 shell, a backup tool) is waited for, then opened
read-only (:attr:`History.read_only` says why, naming the program when it can be found); it is
never renamed. Only a file SQLite reports as not a database or corrupt, or that fails
``PRAGMA quick_check`` (a subset of integrity_check: failing it fails both), is moved aside
(``history.sqlite3.corrupt-<time>``) and a fresh one is created; the message returned by
:meth:`History.open` says where it went and how to get it back. Any other error (permissions,
a full disk, an I/O error) leaves the file where it is and opens it read-only (or, when it cannot
be read either, an empty history in memory). A lock another program takes while the window runs
neither freezes the window nor loses what it shows: the writes of an answer (its pieces, its
final text) wait in memory and are written, in order, once the lock goes (:meth:`History.flush`,
at the latest on :meth:`History.close`); a write that needs its row now (a new chat or message,
a rename, a delete) raises :class:`HistoryBusy`, so the caller keeps what the user typed.
Rows are read one by one and converted defensively, so one bad row never hides the others.

Search: :meth:`History.search` finds words in message text with SQLite's FTS5 full-text index
(``messages_fts``, an external-content table over ``messages.content`` kept in step by triggers;
unicode61 tokenizer, diacritics folded, prefix matching). Schema version 2 added it: a version-1
file is migrated in one transaction on open (index built from the existing messages), after a
copy of the file is kept as ``history.sqlite3.v1-backup``; if the SQLite build has no FTS5 the
history still opens and search falls back to a LIKE scan.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import library

log = logging.getLogger(__name__)

FILENAME = "history.sqlite3"
# 1: conversations, messages.  2: the full-text index messages_fts (set by _migrate_fts when
# this SQLite has FTS5). Columns added since version 1 (messages.seed and messages.sampling_json:
# the sampling seed and parameters an answer was generated with, so it can be reproduced) are
# added to an older file in place by _migrate, whatever its version (old answers get NULL / '{}').
SCHEMA_VERSION = 2
DEFAULT_TITLE = "New chat"

# Message status values.
COMPLETE, STREAMING, STOPPED, INTERRUPTED, ERROR = "complete", "streaming", "stopped", "interrupted", "error"
STATUSES = (COMPLETE, STREAMING, STOPPED, INTERRUPTED, ERROR)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'complete',
    meta_json TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    seed INTEGER,
    sampling_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS stream_tail (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id INTEGER NOT NULL,
    piece TEXT NOT NULL
);
"""

# How long a locked file is waited for before it is opened read-only (seconds).
BUSY_WAIT_S = 5.0
#: how long a write waits for another program's lock while the window runs (it blocks the GUI
#: thread); then it is kept for later (:meth:`History.flush`) or refused (:class:`HistoryBusy`)
SESSION_BUSY_WAIT_S = 0.25
RETRY_S = 2.0                 # kept writes are tried again at most this often
_BUSY_CODES = (5, 6)          # SQLITE_BUSY, SQLITE_LOCKED (primary codes)
_BROKEN_CODES = (11, 26)      # SQLITE_CORRUPT, SQLITE_NOTADB


class _Corrupt(sqlite3.DatabaseError):
    """The file opened but failed PRAGMA quick_check."""


class HistoryBusy(sqlite3.OperationalError):
    """A write that cannot wait: another program holds the history locked (the text names the
    file and the program); nothing was written."""


def _writes(later: bool):
    """A History write method (one transaction) that meets another program's lock: kept in
    memory and written by :meth:`History.flush` when ``later`` (the write needs no answer
    now), else :class:`HistoryBusy`. Kept writes stay in order: while any wait, every later
    write waits behind them (or is refused)."""
    def wrap(fn):
        @functools.wraps(fn)
        def write(self, *args, **kwargs):
            if self._kept and not self.flush():
                if later:
                    self._kept.append(functools.partial(fn, self, *args, **kwargs))
                    return None
                raise HistoryBusy(self.busy)
            try:
                return fn(self, *args, **kwargs)
            except sqlite3.OperationalError as e:
                if not is_busy(e):
                    raise
                self._went_busy(e)
                if later:
                    self._kept.append(functools.partial(fn, self, *args, **kwargs))
                    return None
                raise HistoryBusy(self.busy) from None
        return write
    return wrap


def _code(e: BaseException) -> int:
    return (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF


def is_busy(e: BaseException) -> bool:
    """True for SQLite's "database is locked" / "database table is locked" (another
    connection holds the lock): the file is healthy, only busy."""
    if not isinstance(e, sqlite3.Error):
        return False
    if _code(e) in _BUSY_CODES:
        return True
    return _code(e) == 0 and "locked" in str(e).lower()


def is_broken(e: BaseException) -> bool:
    """True only when the file itself is damaged: not a database, corrupt, or failing the
    integrity check. Permissions, a full disk, I/O errors and locks are not."""
    if isinstance(e, _Corrupt):
        return True
    if not isinstance(e, sqlite3.DatabaseError) or is_busy(e):
        return False
    if _code(e) in _BROKEN_CODES:
        return True
    text = str(e).lower()
    return _code(e) == 0 and ("not a database" in text or "malformed" in text)


def history_is_free(path: Path) -> bool:
    """True when a write transaction on ``path`` would get its lock now (no waiting, nothing
    written; False while another program holds it, or when it cannot be opened)."""
    try:
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=rw", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def holders(path: Path) -> list[str]:
    """"name (pid N)" of the other processes that have ``path`` open (best effort: those of
    this user that psutil may inspect; [] when none is found)."""
    try:
        import psutil
    except ImportError:
        return []
    target = {os.path.realpath(path)} | {os.path.realpath(str(path) + s) for s in ("-wal", "-journal")}
    out = []
    for proc in psutil.process_iter(["pid", "name"]):
        if proc.info["pid"] == os.getpid():
            continue
        try:
            if any(f.path in target for f in proc.open_files()):
                out.append(f"{proc.info['name']} (pid {proc.info['pid']})")
        except (psutil.Error, OSError):
            continue
    return out

# Version 2: full-text search over message text (https://sqlite.org/fts5.html, "External
# Content Tables": the index holds no copy of the text; the triggers keep it in step).
_FTS_SCHEMA = (
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', "
    "content_rowid='id', tokenize='unicode61 remove_diacritics 2')",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_ai AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_ad AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_au AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END",
)


@dataclass(frozen=True)
class SearchHit:
    """A message whose text matches a search: ids, role, and ``snippet`` (a few words around
    the match, the matched words between [ and ])."""

    conversation_id: int
    message_id: int
    role: str
    snippet: str


def fts_query(text: str) -> str:
    """The FTS5 query for words typed in the search box: every word must occur (AND), each as
    a quoted prefix ("csv"* matches csv, csvfile), so no input is an FTS5 syntax error."""
    words = [w for w in text.replace('"', " ").split() if w]
    return " ".join(f'"{w}"*' for w in words)


# Columns added after version 1: (table, column, declaration), added by _migrate when missing.
_ADDED_COLUMNS = (
    ("messages", "seed", "INTEGER"),
    ("messages", "sampling_json", "TEXT NOT NULL DEFAULT '{}'"),
)


@dataclass(frozen=True)
class Conversation:
    """One conversation (times are Unix seconds)."""

    id: int
    title: str
    system_prompt: str
    created: float
    updated: float


@dataclass(frozen=True)
class Message:
    """One stored message. role: user / assistant / system; status: see STATUSES; meta: the
    numbers shown under an answer (tokens, tok/s, TTFT, hit rate, MB/token, finish reason)."""

    id: int
    conversation_id: int
    role: str
    content: str
    status: str
    meta: dict = field(default_factory=dict)
    created: float = 0.0
    seed: int | None = None   #: sampling seed of an answer (None: not recorded, e.g. before v2)
    sampling: dict = field(default_factory=dict)  #: the SamplingParams fields the answer used


def history_path() -> Path:
    """Default location of the history database."""
    return library.user_data_dir() / FILENAME


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _num(v, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _meta(v) -> dict:
    try:
        d = json.loads(_text(v) or "{}")
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


class History:
    """The chat history database. Create with :meth:`open`; close with :meth:`close`."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path
        #: why this history cannot be written ("" = writable): the file is locked by another
        #: program or cannot be opened for writing (set by :meth:`open`)
        self.read_only = ""
        #: while another program holds the file during the session: why ("" = not busy)
        self.busy = ""
        self._busy_watchers: list = []  # subscribe_busy: called with busy, then with "" once written
        self._kept: list = []          # writes waiting for the lock, in order
        self._next_try = 0.0

    # --- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, read_only: bool = False,
             busy_wait_s: float | None = None) -> tuple["History", str | None]:
        """Open (or create) the database; returns (history, message or None).

        A file another program holds locked is waited for ``busy_wait_s`` seconds (default
        :data:`BUSY_WAIT_S`), then opened read-only (:attr:`read_only` and the message say so;
        nothing is renamed or written). A file that is damaged (:func:`is_broken`) is renamed
        with a timestamp and a fresh one is created; the message says where it went and how to
        get it back (a rename the folder refuses leaves it where it is, read-only). Any other error leaves the file alone: it is opened read-only (an empty
        history in memory when it cannot be read either), with a message. Messages left
        "streaming" become "interrupted" (with the pieces shown before the crash).
        ``read_only``: another instance owns the file: open it for reading only, never repair,
        recover or write it (a missing or unreadable file gives an empty in-memory history).
        """
        p = Path(path) if path else history_path()
        if read_only:
            return cls._open_read_only(p)
        busy_wait_s = BUSY_WAIT_S if busy_wait_s is None else busy_wait_s
        p.parent.mkdir(parents=True, exist_ok=True)
        message = None
        conn = None
        try:
            conn = cls._connect(p, busy_wait_s)
            self = cls(conn, p)
            n = self.recover_interrupted()
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            if is_busy(e):
                return cls._open_busy(p, e)
            if not is_broken(e):
                return cls._open_unusable(p, e)
            try:
                aside = cls._move_aside(p)
            except OSError as moving:  # a folder that cannot be written: the file stays, unwritten
                self, _ = cls._open_read_only(p)
                self.read_only = (f"The chat history {p} is damaged ({e}) and could not be moved aside "
                                  f"({moving.strerror or moving}); it was left as it is and nothing is "
                                  f"written. Check the folder's permissions, then restart colibri.")
                log.warning("%s", self.read_only)
                return self, self.read_only
            message = (f"The chat history {p} is damaged ({e}). It was moved to {aside} and a new, "
                       f"empty history was started. To get it back, quit colibri and rename "
                       f"{aside.name} to {p.name} (or rescue what it holds with the sqlite3 "
                       f"shell's .recover command).")
            log.warning("%s", message)
            self = cls(cls._connect(p, busy_wait_s), p)
            n = 0
        if n:
            log.info("marked %d interrupted answer(s)", n)
        self.conn.execute(f"PRAGMA busy_timeout={int(SESSION_BUSY_WAIT_S * 1000)}")
        return self, message

    @classmethod
    def _open_busy(cls, p: Path, e: sqlite3.Error) -> tuple["History", str]:
        who = holders(p)
        by = f"another program ({', '.join(who)})" if who else "another program"
        self, err = cls._open_read_only(p)
        if err:  # the lock keeps readers out too (an exclusive transaction)
            shown = "Its chats cannot be shown until it lets go"
        else:
            shown = "Its chats are shown read-only"
        self.read_only = (f"The chat history {p} is in use by {by} ({e}). {shown}: nothing is "
                          f"written or renamed. Close that program: the window opens it for writing "
                          f"as soon as it lets go.")
        log.warning("%s", self.read_only)
        return self, self.read_only

    @classmethod
    def _open_unusable(cls, p: Path, e: sqlite3.Error) -> tuple["History", str]:
        self, err = cls._open_read_only(p)
        self.read_only = (f"The chat history {p} could not be opened for writing ({e}). "
                          + ("It is shown read-only" if not err else "It was left as it is")
                          + "; nothing is written or renamed. Check the file's permissions and "
                          "the free disk space, then restart colibri.")
        log.warning("%s", self.read_only)
        return self, self.read_only

    @classmethod
    def _open_read_only(cls, p: Path) -> tuple["History", str | None]:
        conn = None
        try:
            conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
            conn.text_factory = lambda b: b.decode("utf-8", "replace")
            conn.execute("SELECT count(*) FROM conversations").fetchone()
            return cls(conn, p), None
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            conn = sqlite3.connect(":memory:")
            conn.executescript(_SCHEMA)
            return cls(conn, p), f"The chat history {p} could not be read ({e})."

    @staticmethod
    def _connect(p: Path, busy_wait_s: float = BUSY_WAIT_S) -> sqlite3.Connection:
        conn = sqlite3.connect(str(p), timeout=busy_wait_s)
        conn.text_factory = lambda b: b.decode("utf-8", "replace")  # bad bytes in one row stay readable
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")
            ok = conn.execute("PRAGMA quick_check").fetchone()
            if not ok or ok[0] != "ok":
                raise _Corrupt(f"integrity check failed: {ok[0] if ok else 'no answer'}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            with conn:
                conn.executescript(_SCHEMA)
            if version < 2:
                History._migrate_fts(conn, p, version)
            History._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _migrate_fts(conn: sqlite3.Connection, p: Path, version: int) -> None:
        """Schema 1 -> 2: add the full-text index and build it from the existing messages, in
        one transaction (a crash leaves version 1, migrated again next time). A file with
        messages is first copied to ``<name>.v1-backup`` (SQLite's online backup API)."""
        has_rows = conn.execute("SELECT EXISTS(SELECT 1 FROM messages)").fetchone()[0]
        if version >= 1 and has_rows:
            backup = p.with_name(p.name + ".v1-backup")
            if not backup.exists():
                tmp = backup.with_name(backup.name + ".partial")
                dst = sqlite3.connect(str(tmp))
                try:
                    conn.backup(dst)
                finally:
                    dst.close()
                os.replace(tmp, backup)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for stmt in _FTS_SCHEMA:
                conn.execute(stmt)
            conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.commit()
        except sqlite3.OperationalError as e:
            conn.rollback()   # the file stays at its version: migrated when a build has FTS5
            if "no such module" not in str(e).lower():
                raise
            log.warning("this SQLite has no FTS5 (%s): chat search scans the messages instead", e)

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Add the columns an older file lacks (_ADDED_COLUMNS), in one transaction (ALTER
        TABLE ... ADD COLUMN keeps every row; SQLite rolls the whole transaction back if
        anything fails, so the file is either fully migrated or untouched). The version number
        is _migrate_fts's; a file from a newer version is used as it is."""
        have = {t: {r[1] for r in conn.execute(f"PRAGMA table_info({t})")} for t, _, _ in _ADDED_COLUMNS}
        missing = [(t, c, d) for t, c, d in _ADDED_COLUMNS if c not in have[t]]
        if not missing:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            for t, c, d in missing:
                conn.execute(f"ALTER TABLE {t} ADD COLUMN {c} {d}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if missing:
            log.info("chat history: added %s", ", ".join(f"{t}.{c}" for t, c, _ in missing))

    def _message_columns(self) -> str:
        """The SELECT list for messages: seed and sampling_json only when the file has them (a
        version-1 file opened read-only is never migrated)."""
        if not hasattr(self, "_cols"):
            names = {r[1] for r in self.conn.execute("PRAGMA table_info(messages)")}
            extra = ", seed, sampling_json" if {"seed", "sampling_json"} <= names else ", NULL, '{}'"
            self._cols = "id, conversation_id, role, content, status, meta_json, created" + extra
        return self._cols

    @staticmethod
    def _move_aside(p: Path) -> Path:
        aside = p.with_name(f"{p.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            aside = p.with_name(f"{p.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        os.replace(p, aside)
        for suffix in ("-wal", "-shm"):
            side = p.with_name(p.name + suffix)
            if side.exists():
                try:
                    os.replace(side, aside.with_name(aside.name + suffix))
                except OSError:
                    pass
        return aside

    @property
    def waiting_writes(self) -> int:
        """How many writes wait for another program's lock (see :meth:`flush`)."""
        return len(self._kept)

    def flush(self, force: bool = False) -> bool:
        """Write the kept writes in order; True when none is left and the lock is gone. Tried
        at most every :data:`RETRY_S` seconds unless ``force``. Tells the busy watchers ""
        once all are in (or, with none kept, once a write would get the lock)."""
        if not self._kept and not self.busy:
            return True
        if not force and time.monotonic() < self._next_try:
            return False
        if not self._kept:  # only refused writes: is the lock gone?
            self._kept.append(self._probe)
        while self._kept:
            try:
                self._kept[0]()
            except sqlite3.OperationalError as e:
                if not is_busy(e):
                    raise
                self._next_try = time.monotonic() + RETRY_S
                return False
            self._kept.pop(0)
        self.busy = ""
        log.info("the chat history is free again: the kept writes are in")
        for watch in self._busy_watchers:
            watch("")
        return True

    def subscribe_busy(self, watch) -> None:
        """Call ``watch(why)`` when writes start waiting for another program's lock (``why``
        names it: :attr:`busy`) and ``watch("")`` once the kept writes are in."""
        self._busy_watchers.append(watch)

    def _probe(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("ROLLBACK")

    def _went_busy(self, e: sqlite3.Error) -> None:
        self._next_try = time.monotonic() + RETRY_S
        if self.busy:
            return
        who = holders(self.path)
        by = f"another program ({', '.join(who)})" if who else "another program"
        self.busy = f"The chat history {self.path} is in use by {by} ({e})"
        log.warning("%s; writes wait until it lets go", self.busy)
        for watch in self._busy_watchers:
            watch(self.busy)

    def close(self) -> None:
        """Close the connection (idempotent), after writing the kept writes (waiting up to
        :data:`BUSY_WAIT_S` for the lock; what still cannot be written is logged)."""
        if self.conn is not None and self._kept:
            try:
                self.conn.execute(f"PRAGMA busy_timeout={int(BUSY_WAIT_S * 1000)}")
                if not self.flush(force=True):
                    log.warning("%s: %d write(s) of this session could not be saved", self.busy, len(self._kept))
            except sqlite3.Error as e:
                log.warning("the chat history's kept writes could not be saved: %s", e)
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None

    def recover_interrupted(self) -> int:
        """Mark messages still "streaming" (the app died mid-answer) as "interrupted", their
        content completed with the pieces saved after the last checkpoint (stream_tail)."""
        with self.conn:
            for (mid,) in self.conn.execute("SELECT DISTINCT message_id FROM stream_tail").fetchall():
                tail = "".join(_text(r[0]) for r in self.conn.execute(
                    "SELECT piece FROM stream_tail WHERE message_id=? ORDER BY seq", (mid,)))
                self.conn.execute("UPDATE messages SET content=content || ? WHERE id=? AND status=?",
                                  (tail, mid, STREAMING))
            self.conn.execute("DELETE FROM stream_tail")
            cur = self.conn.execute("UPDATE messages SET status=? WHERE status=?", (INTERRUPTED, STREAMING))
        return cur.rowcount

    @_writes(later=True)
    def append_stream(self, msg_id: int, piece: str) -> None:
        """Save ``piece``, the next text of a streaming answer, as it is shown: one small
        insert (the message row and its search index change only at checkpoints)."""
        if piece:
            with self.conn:
                self.conn.execute("INSERT INTO stream_tail(message_id, piece) VALUES (?, ?)", (msg_id, piece))

    # --- conversations ------------------------------------------------------------------------

    @_writes(later=False)
    def create_conversation(self, title: str = DEFAULT_TITLE, system_prompt: str = "") -> Conversation:
        """Insert a conversation and return it."""
        now = time.time()
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO conversations(title, system_prompt, created, updated) VALUES (?,?,?,?)",
                (title, system_prompt, now, now))
        return Conversation(cur.lastrowid, title, system_prompt, now, now)

    def conversations(self, search: str = "") -> list[Conversation]:
        """Conversations, most recently updated first; ``search`` filters titles (case-insensitive)."""
        sql = "SELECT id, title, system_prompt, created, updated FROM conversations"
        args: tuple = ()
        if search:
            sql += " WHERE title LIKE ? ESCAPE '\\'"
            esc = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            args = (f"%{esc}%",)
        sql += " ORDER BY updated DESC, id DESC"
        out = []
        for row in self._rows(sql, args):
            try:
                out.append(Conversation(int(row[0]), _text(row[1]), _text(row[2]), _num(row[3]), _num(row[4])))
            except (TypeError, ValueError) as e:
                log.warning("skipping unreadable conversation row: %s", e)
        return out

    def conversation(self, conv_id: int) -> Conversation | None:
        """One conversation, or None if it does not exist."""
        for c in self._rows("SELECT id, title, system_prompt, created, updated FROM conversations WHERE id=?",
                            (conv_id,)):
            try:
                return Conversation(int(c[0]), _text(c[1]), _text(c[2]), _num(c[3]), _num(c[4]))
            except (TypeError, ValueError):
                return None
        return None

    @_writes(later=False)
    def rename_conversation(self, conv_id: int, title: str) -> None:
        """Set a conversation's title."""
        with self.conn:
            self.conn.execute("UPDATE conversations SET title=?, updated=? WHERE id=?", (title, time.time(), conv_id))

    @_writes(later=False)
    def set_system_prompt(self, conv_id: int, system_prompt: str) -> None:
        """Set a conversation's system prompt (used from its next message on)."""
        with self.conn:
            self.conn.execute("UPDATE conversations SET system_prompt=? WHERE id=?", (system_prompt, conv_id))

    @_writes(later=False)
    def delete_conversation(self, conv_id: int) -> None:
        """Delete a conversation and its messages."""
        with self.conn:
            self.conn.execute("DELETE FROM messages WHERE conversation_id=?", (conv_id,))
            self.conn.execute("DELETE FROM conversations WHERE id=?", (conv_id,))

    @_writes(later=True)
    def touch(self, conv_id: int) -> None:
        """Move a conversation to the top of the list."""
        with self.conn:
            self.conn.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conv_id))

    # --- messages -----------------------------------------------------------------------------

    def messages(self, conv_id: int) -> list[Message]:
        """A conversation's messages in order; unreadable rows are skipped (and logged)."""
        out = []
        for row in self._rows(f"SELECT {self._message_columns()} "
                              "FROM messages WHERE conversation_id=? ORDER BY id", (conv_id,)):
            try:
                role = _text(row[2])
                if role not in ("user", "assistant", "system"):
                    raise ValueError(f"unknown role {role!r}")
                status = _text(row[4])
                seed = int(row[7]) if isinstance(row[7], int) and row[7] >= 0 else None
                out.append(Message(int(row[0]), int(row[1]), role, _text(row[3]),
                                   status if status in STATUSES else INTERRUPTED, _meta(row[5]), _num(row[6]),
                                   seed, _meta(row[8])))
            except (TypeError, ValueError) as e:
                log.warning("skipping unreadable message row: %s", e)
        return out

    def message(self, msg_id: int) -> Message | None:
        """One message by id, or None."""
        row = next(iter(self._rows("SELECT conversation_id FROM messages WHERE id=?", (msg_id,))), None)
        if row is None:
            return None
        return next((m for m in self.messages(int(row[0])) if m.id == msg_id), None)

    @_writes(later=False)
    def add_message(self, conv_id: int, role: str, content: str, status: str = COMPLETE,
                    meta: dict | None = None, seed: int | None = None,
                    sampling: dict | None = None) -> int:
        """Append a message; returns its id. ``seed`` / ``sampling``: for an answer, the sampling
        seed (0 <= seed < 2**63) and SamplingParams fields it is generated with."""
        now = time.time()
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO messages(conversation_id, role, content, status, meta_json, created, seed, "
                "sampling_json) VALUES (?,?,?,?,?,?,?,?)",
                (conv_id, role, content, status, json.dumps(meta or {}), now, seed, json.dumps(sampling or {})))
            self.conn.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conv_id))
        return cur.lastrowid

    @_writes(later=True)
    def update_message(self, msg_id: int, content: str | None = None, status: str | None = None,
                       meta: dict | None = None) -> None:
        """Change a message's content, status and/or meta."""
        sets, args = [], []
        if content is not None:
            sets.append("content=?")
            args.append(content)
        if status is not None:
            sets.append("status=?")
            args.append(status)
        if meta is not None:
            sets.append("meta_json=?")
            args.append(json.dumps(meta))
        if not sets:
            return
        with self.conn:
            self.conn.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", (*args, msg_id))
            if content is not None:  # the pieces are in the content now
                self.conn.execute("DELETE FROM stream_tail WHERE message_id=?", (msg_id,))

    @_writes(later=True)
    def delete_message(self, msg_id: int) -> None:
        """Delete one message."""
        with self.conn:
            self.conn.execute("DELETE FROM messages WHERE id=?", (msg_id,))
            self.conn.execute("DELETE FROM stream_tail WHERE message_id=?", (msg_id,))

    @_writes(later=False)
    def delete_from(self, conv_id: int, msg_id: int) -> None:
        """Delete message ``msg_id`` and every later message of the conversation (edit, regenerate)."""
        with self.conn:
            self.conn.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?", (conv_id, msg_id))

    # --- search -------------------------------------------------------------------------------

    @property
    def has_fts(self) -> bool:
        """True when the full-text index exists (else :meth:`search` scans with LIKE)."""
        return next(iter(self._rows("SELECT 1 FROM sqlite_master WHERE name='messages_fts'")), None) is not None

    def search(self, text: str, limit: int = 200) -> list[SearchHit]:
        """Messages whose text holds every word of ``text`` (prefixes; case and diacritics
        ignored), best match first (FTS5 bm25), at most ``limit``. [] for an empty query."""
        q = fts_query(text)
        if not q:
            return []
        out: list[SearchHit] = []
        if self.has_fts:
            rows = self._rows(
                "SELECT m.conversation_id, m.id, m.role, snippet(messages_fts, 0, '[', ']', '…', 10) "
                "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                "WHERE messages_fts MATCH ? ORDER BY bm25(messages_fts) LIMIT ?", (q, limit))
        else:
            words = [w for w in text.replace('"', " ").split() if w]
            where = " AND ".join("content LIKE ? ESCAPE '\\'" for _ in words)
            esc = [("%" + w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%") for w in words]
            rows = self._rows(f"SELECT conversation_id, id, role, substr(content, 1, 80) FROM messages "
                              f"WHERE {where} ORDER BY id DESC LIMIT ?", (*esc, limit))
        for r in rows:
            try:
                out.append(SearchHit(int(r[0]), int(r[1]), _text(r[2]), " ".join(_text(r[3]).split())))
            except (TypeError, ValueError) as e:
                log.warning("skipping unreadable search row: %s", e)
        return out

    # --- helpers ------------------------------------------------------------------------------

    def _rows(self, sql: str, args: tuple = ()):
        """Yield rows one by one; a row that cannot be decoded is skipped instead of failing all."""
        cur = self.conn.execute(sql, args)
        errors = 0
        while True:
            try:
                row = cur.fetchone()
            except sqlite3.DatabaseError as e:  # a damaged page under one row
                log.warning("skipping unreadable row: %s", e)
                errors += 1
                if errors > 1000:
                    return
                continue
            if row is None:
                return
            yield row
