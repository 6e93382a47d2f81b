"""Helpers of the server tests: the converted default model, a real server, /metrics parsing."""

from __future__ import annotations

import threading
import time

from engine.observers import Observer

#: Engine settings of every server test (and of the `colibri run` it is compared with): a fixed
#: RAM budget (the "auto" one follows the machine's free memory), no routing history on disk.
ENGINE_FLAGS = ["--ram-budget-gb", "2", "--no-history", "--no-pinning"]
ENGINE_KW = dict(ram_budget_gb=2.0, history=False, pinning=False)
LONG_PROMPT = "Write a long explanation of the os module."   # the default model answers at length
SHORT_PROMPT = "What does `json.dumps` do?"


def metrics(base_url: str, key: str = "") -> dict[str, float]:
    """GET /metrics -> {sample name with labels: value}."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx2.get(base_url.removesuffix("/v1") + "/metrics",
                   headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    r.raise_for_status()
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


class SlowDown(Observer):
    """Test instrumentation: every forward call waits ``seconds`` first, so a generation lasts
    long enough for a second client to arrive while it runs (the token ids are unchanged)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        time.sleep(self.seconds)


class HeldForward(Observer):
    """Test instrumentation: every forward call waits until ``go`` is set, so a generation is
    still running when a second client arrives however slow the machine is (the token ids are
    unchanged)."""

    def __init__(self):
        self.go = threading.Event()

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        self.go.wait(600)  # only a hang trips it


def wait_until(cond, timeout_s: float = 600.0, poll_s: float = 0.02) -> bool:
    """Poll ``cond`` until it holds; the time limit is one only a hang trips."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


class Background(threading.Thread):
    """Run ``fn()`` on a thread; ``result`` / ``error`` after join()."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
