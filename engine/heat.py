"""Routing heat (per-model routing counts per (layer, expert)) and the persisted pin set.

File ``routing_heat.json`` next to the store, written atomically after each generation:
    {"format": "colibri-routing-heat", "version": 1, "engine": "colibri-desktop/olmoe",
     "num_layers": L, "num_experts": E, "store_created": ..., "tokens": n,
     "counts": [[...E ints] x L], "pinned": [[expert ids] x L]}
A file whose format, version, engine or dimensions do not match is ignored with a log line
(colibri's .coli_usage rules: never trust a mismatched history). Ignored is not overwritten:
a file that cannot be read now (permissions, I/O), or that a newer version or another program
wrote, stays as it is and this session's counts are not saved over it (:attr:`keep_file`);
only a file that does not parse or contradicts itself (truncated, negative counts, other
dimensions) is moved aside as ``routing_heat.json.bad-<time>`` before a fresh one is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from .fsutil import atomic_write_text

log = logging.getLogger(__name__)

HEAT_FORMAT = "colibri-routing-heat"
HEAT_VERSION = 1
ENGINE_NAME = "colibri-desktop/olmoe"
FILENAME = "routing_heat.json"


def pins_per_layer(cap: int, pin_per_layer: int = 0) -> int:
    """How many experts per layer hot pinning may pin at ``cap`` slots: ``pin_per_layer`` or
    cap // 4 when it is 0 (auto), never all ``cap`` slots (at most cap - 1)."""
    return max(0, min(pin_per_layer or cap // 4, cap - 1))


def choose_pins(counts: np.ndarray, per_layer: int) -> np.ndarray:
    """The ``per_layer`` hottest experts of each layer by ``counts`` (int [L, E]; ties: lower
    id; never an expert with a zero count), bool [L, E]."""
    out = np.zeros(counts.shape, bool)
    if per_layer <= 0:
        return out
    for layer in range(counts.shape[0]):
        order = np.argsort(-counts[layer], kind="stable")[:per_layer]
        out[layer, [e for e in order if counts[layer, e] > 0]] = True
    return out


def cap_pins(pinned: np.ndarray, counts: np.ndarray, per_layer: int) -> np.ndarray:
    """A persisted pin set (bool [L, E]) cut to the ``per_layer`` hottest by ``counts``."""
    out = np.zeros_like(pinned)
    for layer in range(pinned.shape[0]):
        ids = np.nonzero(pinned[layer])[0]
        out[layer, ids[np.argsort(-counts[layer, ids], kind="stable")][:per_layer]] = True
    return out


class RoutingHeat:
    """counts int64 [L, E] (history + this session), pinned bool [L, E], tokens seen."""

    def __init__(self, num_layers: int, num_experts: int, store_created: str = ""):
        self.L, self.E = num_layers, num_experts
        self.store_created = store_created
        self.counts = np.zeros((num_layers, num_experts), np.int64)
        self.pinned = np.zeros((num_layers, num_experts), bool)
        self.session = np.zeros((num_layers, num_experts), np.int64)  # this process only
        self.tokens = 0
        self.message = ""
        #: the file on disk was not used and must not be overwritten (set by :meth:`load`)
        self.keep_file = False

    def observe(self, layer: int, idx: np.ndarray) -> None:
        """Count routing selections idx (int [T, K]) of ``layer``."""
        n = np.bincount(idx.reshape(-1), minlength=self.E)  # the same counts as np.add.at, faster
        self.counts[layer] += n
        self.session[layer] += n

    def observe_layers(self, l0: int, idx: np.ndarray) -> None:
        """Count one routing row per layer: idx int [n, K], row i of layer l0 + i (the same
        counts as n :meth:`observe` calls)."""
        n, E = idx.shape[0], self.E
        c = np.bincount((np.arange(n)[:, None] * E + idx).reshape(-1), minlength=n * E).reshape(n, E)
        self.counts[l0:l0 + n] += c
        self.session[l0:l0 + n] += c

    def choose_pins(self, per_layer: int) -> np.ndarray:
        """The ``per_layer`` hottest experts of each layer (ties: lower id), bool [L, E]."""
        return choose_pins(self.counts, per_layer)

    def reset(self) -> None:
        self.counts[:] = 0
        self.session[:] = 0
        self.pinned[:] = False
        self.tokens = 0

    def to_json(self) -> str:
        return json.dumps({
            "format": HEAT_FORMAT, "version": HEAT_VERSION, "engine": ENGINE_NAME,
            "num_layers": self.L, "num_experts": self.E, "store_created": self.store_created,
            "tokens": int(self.tokens), "counts": self.counts.tolist(),
            "pinned": [np.nonzero(r)[0].tolist() for r in self.pinned],
        })

    def save(self, folder: str | Path, force: bool = False) -> Path:
        """Write the file atomically; nothing when :attr:`keep_file` (a file this build could
        not use is left as it is) unless ``force`` (the user reset the history)."""
        p = Path(folder) / FILENAME
        if self.keep_file and not force:
            return p
        atomic_write_text(p, self.to_json())
        self.keep_file = False
        return p

    def load(self, folder: str | Path) -> bool:
        """Load the history if it matches; otherwise keep zeros, set ``message``, return False."""
        p = Path(folder) / FILENAME
        if not p.exists():
            return False
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            if isinstance(e, OSError):  # busy or unreadable, not broken: left alone, not saved over
                self.keep_file = True
                self.message = f"ignoring routing history {p} (it is left as it is and not saved this session): {e}"
                log.warning(self.message)
                return False
            return self._broken(p, e)
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if (d.get("format") != HEAT_FORMAT or d.get("engine") != ENGINE_NAME
                    or not isinstance(d.get("version"), int) or d["version"] > HEAT_VERSION):
                self.keep_file = True   # another program's or a newer version's: not ours to replace
                self.message = (f"ignoring routing history {p}: format/version/engine {d.get('format')!r} "
                                f"{d.get('version')!r} {d.get('engine')!r} are not this version's; it is left "
                                f"as it is and not saved this session")
                log.warning(self.message)
                return False
            ok = (d.get("version") == HEAT_VERSION and d.get("num_layers") == self.L
                  and d.get("num_experts") == self.E)
            if not ok:
                raise ValueError(f"format/version/engine/dimensions do not match this store "
                                 f"({self.L} layers x {self.E} experts)")
            counts = np.asarray(d["counts"], dtype=np.int64)
            if counts.shape != (self.L, self.E) or (counts < 0).any():
                raise ValueError("counts have the wrong shape or negative values")
            pinned = np.zeros((self.L, self.E), bool)
            rows = d.get("pinned", [])
            if len(rows) != self.L:
                raise ValueError("pin rows do not match the layer count")
            for layer, ids in enumerate(rows):
                ids = np.asarray(ids, dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= self.E):
                    raise ValueError("pinned expert id out of range")
                pinned[layer, ids] = True
        except (ValueError, KeyError, TypeError) as e:
            return self._broken(p, e)
        self.counts, self.pinned, self.tokens = counts, pinned, int(d.get("tokens", 0))
        return True

    def _broken(self, p: Path, e: BaseException) -> bool:
        """A file that does not parse or contradicts itself: moved aside (never deleted), so
        that the next save starts a fresh one; ``message`` says where it went."""
        aside = p.with_name(f"{p.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            aside = p.with_name(f"{p.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        try:
            os.replace(p, aside)
            where = f"it was moved to {aside}"
        except OSError:
            self.keep_file = True
            where = "it is left as it is and not saved this session"
        self.message = f"ignoring routing history {p}: {e}; {where}"
        log.warning(self.message)
        return False
