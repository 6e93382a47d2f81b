"""Human-readable sizes and durations for messages (decimal units: 1 GB = 1e9 bytes)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes as a short decimal string ("1.23 GB")."""
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_duration(s: float) -> str:
    """``s`` seconds as "1 h 02 min", "3 min 05 s" or "12 s"."""
    if s != s or s == float("inf"):
        return "unknown"
    s = int(round(max(s, 0)))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"
