"""Regenerate draws a fresh seed; the seed is stored with the answer and reproduces it.

On a sampled answer (temperature 0.7) three regenerations give three different answers, each
stored with its own seed (history column ``seed``, schema version 2); sending the question
again with Settings > Seed set to a stored seed gives that answer again, token for token.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from PySide6.QtCore import Qt

from engine import SamplingParams
from colibri_app.history import COMPLETE, SCHEMA_VERSION, History
from colibri_app.settings_store import Settings
from answer_helpers import send as _send, wait_finished as _wait_finished


def _answer(win):
    return [m for m in win.history.messages(win.conv_id) if m.role == "assistant"][-1]


def test_regenerate_samples_fresh_seeds_and_a_stored_seed_reproduces(qtbot, make_window):
    win = make_window(sampling=SamplingParams(temperature=0.7, max_new_tokens=12))
    first = _wait_finished(qtbot, win, lambda: win.send("What does json.dumps do?"))
    answers = [(_answer(win), first)]
    for _ in range(3):
        fin = _wait_finished(qtbot, win, win.regenerate)
        answers.append((_answer(win), fin))
    regens = answers[1:]
    texts = [m.content for m, _ in regens]
    assert len(set(texts)) == 3, texts                      # three regenerations, three answers
    seeds = [m.seed for m, _ in regens]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 3, seeds
    for m, fin in answers:                                  # stored seed = the seed the engine used
        assert m.seed == fin.seed and m.meta["seed"] == fin.seed
        assert m.sampling["temperature"] == 0.7 and m.sampling["seed"] == m.seed
        assert f"seed {m.seed}" in win.chat.view(m.id).meta_label.text() if win.chat.view(m.id) else True
    # reproduce answer 2: Seed = its stored seed, send the same question again (edit + send)
    target, target_fin = regens[1]
    win.settings = replace(win.settings, sampling=replace(win.settings.sampling, seed=target.seed))
    user = [m for m in win.history.messages(win.conv_id) if m.role == "user"][-1]
    win.edit_message(user.id)
    again = _wait_finished(qtbot, win, lambda: qtbot.keyClick(win.chat.input, Qt.Key_Return))
    assert again.seed == target.seed
    assert again.token_ids == target_fin.token_ids and _answer(win).content == target.content
    # a fixed Seed does not freeze Regenerate: it still draws a fresh one
    fin = _wait_finished(qtbot, win, win.regenerate)
    assert fin.seed != target.seed and _answer(win).seed == fin.seed


def test_greedy_answers_show_no_seed(qtbot, make_window):
    win = make_window(sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    _wait_finished(qtbot, win, lambda: win.send("hello"))
    m = _answer(win)
    assert isinstance(m.seed, int) and "seed" not in m.meta      # stored, but not shown: greedy
    assert "seed" not in win.chat.view(m.id).meta_label.text()


_V1_SCHEMA = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '', status TEXT NOT NULL DEFAULT 'complete',
    meta_json TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
INSERT INTO conversations VALUES (1, 'old chat', '', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'hi', 'complete', '{}', 1.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'hello there', 'complete', '{"tokens": 2}', 1.5);
PRAGMA user_version=1;
"""


def _v1_file(path):
    conn = sqlite3.connect(str(path))
    conn.executescript(_V1_SCHEMA)
    conn.commit()
    conn.close()


def test_version_1_history_is_migrated_in_place(tmp_path):
    p = tmp_path / "history.sqlite3"
    _v1_file(p)
    ro, msg = History.open(p, read_only=True)          # read-only: readable, never migrated
    assert msg is None and [m.seed for m in ro.messages(1)] == [None, None]
    ro.close()
    assert sqlite3.connect(str(p)).execute("PRAGMA user_version").fetchone()[0] == 1
    h, msg = History.open(p)
    assert msg is None
    old = h.messages(1)
    assert [(m.role, m.content, m.seed, m.sampling) for m in old] == [
        ("user", "hi", None, {}), ("assistant", "hello there", None, {})]
    assert old[1].meta == {"tokens": 2}
    mid = h.add_message(1, "assistant", "new", COMPLETE, seed=2 ** 63 - 1,
                        sampling={"temperature": 0.7, "seed": 2 ** 63 - 1})
    h.close()
    conn = sqlite3.connect(str(p))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    cols = {r[1] for r in conn.execute("PRAGMA table_info(messages)")}
    assert {"seed", "sampling_json"} <= cols
    conn.close()
    h, _ = History.open(p)                              # reopening: nothing to migrate, data intact
    m = h.message(mid)
    assert m.seed == 2 ** 63 - 1 and m.sampling == {"temperature": 0.7, "seed": 2 ** 63 - 1}
    assert [x.content for x in h.messages(1)] == ["hi", "hello there", "new"]
    h.close()


def test_version_1_settings_seed_0_becomes_auto():
    v1 = json.loads(Settings().to_json())
    v1["version"] = 1
    v1["sampling"]["seed"] = 0
    assert Settings.from_json(json.dumps(v1)).sampling.seed is None
    v1["sampling"]["seed"] = 42                          # a seed the user chose is kept
    assert Settings.from_json(json.dumps(v1)).sampling.seed == 42
    s = Settings()
    assert s.sampling.seed is None and Settings.from_json(s.to_json()).sampling.seed is None
    fixed = replace(s, sampling=replace(s.sampling, seed=7))
    assert Settings.from_json(fixed.to_json()).sampling.seed == 7
