"""Plain text tables and durations for the day-2 commands."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f"({empty})"
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join("   ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True))
                     .rstrip() for line in lines)


def ago(seconds: float, suffix: str = " ago") -> str:
    s = max(0, int(seconds))
    if s < 60:
        text = f"{s}s"
    elif s < 3600:
        text = f"{s // 60}m{s % 60:02d}s"
    elif s < 86400:
        text = f"{s // 3600}h{s % 3600 // 60:02d}m"
    else:
        text = f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return text + suffix
