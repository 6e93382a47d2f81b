"""Another program with an open write transaction on a chat history (a database browser, the
sqlite3 shell), for the tests of a history that is busy, not broken."""

from __future__ import annotations

import subprocess
import sys

# prints "locked" once it holds the lock and keeps it until its stdin closes
_HOLD = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE conversations SET title = title")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


def hold_lock(path) -> subprocess.Popen:
    """Start the holder on ``path``; returns once it holds the write lock."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def release(proc: subprocess.Popen) -> None:
    """Let the holder roll back and end."""
    proc.stdin.close()
    assert proc.wait(600) == 0
