"""Plain-text tables and number formatting for the studies' printed summaries."""

from __future__ import annotations

import math
from typing import Any, Sequence


def fmt_bytes(b: float) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_time(s: float) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_num(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def fmt_mean_std(values: Sequence[float], spec: str = ".3f") -> str:
    """``mean ± std`` of ``values`` (sample std, ``ddof=1``); a single value as is; NaNs ignored (``-``
    when none is left)."""
    v = [float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "-"
    if len(v) == 1:
        return format(v[0], spec)
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return f"{format(mean, spec)} ± {format(std, spec)}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, align: str | None = None) -> str:
    """A fixed-width table. A row with fewer cells than columns fills the first columns and its last
    cell spans the rest (e.g. ``("top-k", "ring", "n/a (incompatible: ...)")``)."""
    ncol = len(headers)
    full = [r for r in rows if len(r) == ncol]
    widths = [max([len(h)] + [len(str(r[i])) for r in full]) for i, h in enumerate(headers)]
    align = align or "l" * 2 + "r" * (ncol - 2)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            c = str(c)
            out.append(c.ljust(widths[i]) if align[i] == "l" else c.rjust(widths[i]))
        return "  ".join(out)

    sep = "  ".join("-" * w for w in widths)
    lines = [line(headers).rstrip(), sep]
    for r in rows:
        lines.append(line(r).rstrip() if len(r) == ncol else f"{line(r[:-1])}  {r[-1]}")
    return "\n".join(lines)


def first_sentence(msg: str, limit: int = 110) -> str:
    """The first sentence of a library error message, clipped for a table cell."""
    s = msg.split(". ")[0].rstrip(".")
    return s if len(s) <= limit else s[: limit - 3] + "..."
