"""How the plan writes sizes, counts and durations (decimal units: 1 GB = 1e9 bytes)."""

from __future__ import annotations


def gb(n: float | None) -> str:
    """Bytes as ``"13.5 GB"`` / ``"538.1 MB"`` / ``"4.0 KB"`` / ``"12 B"``; ``"-"`` for None."""
    if n is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


def num(n: float | None) -> str:
    """A count as ``"6.7G"`` / ``"95.4M"`` / ``"63.3k"`` / ``"12"``; ``"-"`` for None."""
    if n is None:
        return "-"
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= f:
            return f"{n / f:.1f}{unit}"
    return str(int(n))


def dur(sec: float | None) -> str:
    """Seconds as ``"1.5 h"`` / ``"4.6 min"`` / ``"42 s"``; ``"-"`` for None."""
    if sec is None:
        return "-"
    if sec >= 3600:
        return f"{sec / 3600:.1f} h"
    if sec >= 60:
        return f"{sec / 60:.1f} min"
    return f"{sec:.0f} s"
