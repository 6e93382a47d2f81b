"""Time a command from its start to the first byte it writes on stdout (``colibri run`` writes
only the answer there, so that byte is the first streamed token), with each stderr line
stamped (the conversion and compile notices say where the wait went).

    python tools/first_token.py [--label L] [--json OUT] -- colibri run --prompt "What does json.dumps do?"

Prints one line per stderr line ("  12.3 s  colibri: compiling ..."), then
"first token after S s, done after T s, exit code C"; --json appends the numbers as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import subprocess
import sys
import time


def run(argv: list[str], env: dict | None = None) -> dict:
    """Run ``argv``; {"first_token_s", "total_s", "cpu_s" (user + system seconds of the command
    and every process it waited for), "returncode", "stderr": [(s, line)], "answer"}."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "out")
    sel.register(p.stderr, selectors.EVENT_READ, "err")
    first = None
    out, err_lines, partial = b"", [], b""
    open_streams = 2
    while open_streams:
        for key, _ in sel.select():
            data = os.read(key.fileobj.fileno(), 65536)
            now = time.perf_counter() - t0
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "out":
                if first is None:
                    first = now
                out += data
            else:
                partial += data
                *lines, partial = partial.replace(b"\r", b"\n").split(b"\n")
                err_lines += [(round(now, 2), ln.decode(errors="replace")) for ln in lines if ln.strip()]
    rc = p.wait()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
    if partial.strip():
        err_lines.append((round(time.perf_counter() - t0, 2), partial.decode(errors="replace")))
    return {"first_token_s": None if first is None else round(first, 2), "total_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(cpu, 1), "returncode": rc, "stderr": err_lines, "answer": out.decode(errors="replace")[:300]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="", help="name of this measurement in the JSON line")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    r = run(cmd)
    last = None
    for s, line in r["stderr"]:
        if line != last:  # a progress line redrawn in place is shown once per text
            print(f"{s:7.1f} s  {line[:110]}")
        last = line
    print(f"first token after {r['first_token_s']} s, done after {r['total_s']} s ({r['cpu_s']} CPU s), "
          f"exit code {r['returncode']}, load {os.getloadavg()[0]:.1f}")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"label": a.label, "load1": os.getloadavg()[0], **r}) + "\n")
    return 0 if r["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
