"""Show that two colibri processes do not each take 88% of RAM.

Opens the bundled default model in a first process and keeps it open, opens it in a second
process meanwhile, then once more alone; each prints the automatic RAM budget it chose.

    python tools/budget_two_processes.py
"""

from __future__ import annotations

import subprocess
import sys
import time

CHILD = """
import sys, time
from engine import Engine, EngineConfig
from engine.library import default_store
with Engine.open(EngineConfig(store=str(default_store()), history=False)) as eng:
    print(sys.argv[1], "automatic budget GB", round(eng.plan.budget / 1e9, 2), flush=True)
    time.sleep(float(sys.argv[2]))
"""


def main() -> int:
    """Run the three openings; returns 0."""
    first = subprocess.Popen([sys.executable, "-c", CHILD, "first", "30"], stdout=subprocess.PIPE, text=True)
    print(first.stdout.readline().strip(), flush=True)  # the first is open now
    subprocess.run([sys.executable, "-c", CHILD, "second (first still open)", "0"], check=True)
    first.terminate()
    first.wait()
    time.sleep(0.5)
    subprocess.run([sys.executable, "-c", CHILD, "first again, alone", "0"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
