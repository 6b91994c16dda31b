"""What every figure of the studies must satisfy, checked on the matplotlib ``Figure`` (never on pixels):
:func:`problems` lists what is wrong with one figure, in words a reader would use.

- no empty panel: every axes shows data (a line of two finite points, a marker, a bar);
- both axes of every panel are labelled in words (not a variable name), a time with its unit;
- an axis that counts (steps, iterations, workers, ...) has integer ticks only;
- tick labels of one axis do not overlap each other;
- every legend entry is a word label, distinguishable from the others, and shows on a visible artist; every
  drawn line is explained by a legend entry (its own label, or the style of one);
- no line lies hidden exactly under another (curves that coincide are drawn once, and the legend says so).
"""

from __future__ import annotations

import re

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

#: an axis label that starts with one of these counts things: its ticks must be integers
COUNT_LABEL = re.compile(r"^(training )?(steps?|iterations?|workers|rounds?|number of)\b", re.I)
#: a label made only of a variable-like token (``test_acc``, ``best test_acc so far``)
VARIABLE = re.compile(r"\w+_\w+")
#: a quantity that needs a unit in parentheses
TIMED = re.compile(r"\btime\b", re.I)
TIME_UNIT = re.compile(r"\((s|ms|us|µs|ns)\b[^)]*\)")
#: two lines closer than this (in pixels, everywhere) lie on top of each other
HIDDEN_PX = 0.5


def _words(text: str) -> bool:
    """At least one word of three letters outside ``$...$`` math, and no variable-like token."""
    plain = re.sub(r"\$[^$]*\$", " ", text)
    return bool(re.search(r"[A-Za-z]{3,}", plain)) and not VARIABLE.search(plain)


def _data_lines(ax: Axes) -> list[Line2D]:
    return [ln for ln in ax.get_lines() if ln.get_visible()]


def _shows(ln: Line2D) -> bool:
    """Does the line put anything on the canvas: two finite points with a line style, or one with a marker."""
    x, y = (np.asarray(v, dtype=float) for v in ln.get_data())
    n = int(np.sum(np.isfinite(x) & np.isfinite(y)))
    drawn = ln.get_linestyle() not in ("None", "none", "", " ") and ln.get_linewidth() > 0
    marked = ln.get_marker() not in (None, "None", "none", "", " ")
    return (drawn and n >= 2) or (marked and n >= 1)


def _bars(ax: Axes) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_visible() and np.isfinite(p.get_height())
            and p.get_height() != 0]


def _style(artist) -> tuple:
    """What tells legend entries apart: colour, line style, marker (lines); colour, hatch (bars)."""
    if isinstance(artist, Line2D):
        ls = artist.get_linestyle()
        # the dash pattern itself: a custom pattern reports its style as "--" (matplotlib keeps it privately)
        ls = "None" if ls in ("None", "none", "", " ") else str(getattr(artist, "_unscaled_dash_pattern", ls))
        mk = artist.get_marker()
        mk = "None" if mk in (None, "None", "none", "", " ") else mk
        return ("line", tuple(round(c, 3) for c in to_rgb(artist.get_color())), ls, mk)
    return ("patch", tuple(round(c, 3) for c in to_rgb(artist.get_facecolor())), artist.get_hatch() or "")


def _legends(fig: Figure) -> list[Legend]:
    out = list(fig.legends)
    for ax in fig.axes:
        if ax.get_legend() is not None:
            out.append(ax.get_legend())
    return out


def _pixels(ln: Line2D) -> np.ndarray:
    x, y = (np.asarray(v, dtype=float) for v in ln.get_data())
    ok = np.isfinite(x) & np.isfinite(y)
    return ln.get_transform().transform(np.column_stack([x[ok], y[ok]]))


def _covers(top: Line2D, under: Line2D) -> bool:
    """``top`` (drawn later) hides ``under``: same points within :data:`HIDDEN_PX`, and a style that leaves
    nothing of ``under`` to see (the same dashes, or a solid line at least as wide; the same marker)."""
    a, b = _pixels(top), _pixels(under)
    if a.shape != b.shape or not a.size or np.max(np.abs(a - b)) > HIDDEN_PX:
        return False
    (_, _, dash_top, mark_top), (_, _, dash_under, mark_under) = _style(top), _style(under)
    same_dash = dash_top == dash_under or top.get_linestyle() == "-"
    return same_dash and top.get_linewidth() >= under.get_linewidth() and mark_under in (mark_top, "None")


def _tick_overlaps(axis) -> list[str]:
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * abs(hi - lo)
    boxes = [(tk.label1.get_text(), tk.label1.get_window_extent())
             for tk in axis.get_major_ticks() + axis.get_minor_ticks()
             if tk.label1.get_visible() and tk.label1.get_text() and lo - eps <= tk.get_loc() <= hi + eps]
    out = []
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (ta, a), (tb, b) = boxes[i], boxes[j]
            if a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1:
                out.append(f"tick labels {ta!r} and {tb!r} overlap")
    return out


def problems(fig: Figure) -> list[str]:
    """Everything wrong with ``fig`` (empty when it satisfies the module's rules)."""
    fig.canvas.draw()
    found: list[str] = []
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    legends = _legends(fig)
    entries = [(leg, h, t.get_text()) for leg in legends for h, t in zip(leg.legend_handles, leg.get_texts())]
    legend_styles = {_style(h) for _, h, _ in entries if isinstance(h, (Line2D, Rectangle))}
    legend_labels = {text for _, _, text in entries}
    visible_styles = set()
    for ax in panels:
        name = ax.get_title() or f"panel {panels.index(ax)}"
        lines = _data_lines(ax)
        shown = [ln for ln in lines if _shows(ln)]
        if not shown and not _bars(ax) and not any(c.get_visible() for c in ax.collections):
            found.append(f"{name}: empty panel (nothing drawn)")
        for which, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if not label.strip():
                found.append(f"{name}: no {which} label")
            elif not _words(label):
                found.append(f"{name}: {which} label {label!r} is not in words")
            elif TIMED.search(label) and not TIME_UNIT.search(label):
                found.append(f"{name}: {which} label {label!r} names a time without its unit")
            axis = ax.xaxis if which == "x" else ax.yaxis
            if COUNT_LABEL.search(label.strip()):
                lo, hi = sorted(axis.get_view_interval())
                ticks = [t for t in axis.get_majorticklocs() if lo - 1e-9 <= t <= hi + 1e-9]
                if any(abs(t - round(t)) > 1e-9 for t in ticks):
                    found.append(f"{name}: {which} axis counts ({label!r}) but has ticks {ticks}")
            found += [f"{name}: {which} axis: {p}" for p in _tick_overlaps(axis)]
        hidden = set()
        for i, ln in enumerate(shown):
            for later in shown[i + 1:]:
                if ln.get_zorder() <= later.get_zorder() and _covers(later, ln):
                    hidden.add(id(ln))
                    found.append(f"{name}: line {ln.get_label()!r} is hidden under {later.get_label()!r} "
                                 f"(draw coinciding curves once and say so in the legend)")
        for ln in shown:
            if ln.get_label() not in legend_labels and _style(ln) not in legend_styles:
                found.append(f"{name}: line {ln.get_label()!r} {_style(ln)[1:]} is in no legend")
        visible_styles |= {_style(ln) for ln in shown if id(ln) not in hidden}
        visible_styles |= {_style(p) for p in _bars(ax)}
    for leg in legends:
        seen: dict[tuple, str] = {}
        for h, t in zip(leg.legend_handles, leg.get_texts()):
            text = t.get_text()
            if not text.strip() or VARIABLE.search(re.sub(r"\$[^$]*\$", " ", text)):
                found.append(f"legend entry {text!r} is not in words")
            if not isinstance(h, (Line2D, Rectangle)):
                continue
            key = _style(h)
            if key in seen:
                found.append(f"legend entries {seen[key]!r} and {text!r} look the same")
            seen[key] = text
            if key not in visible_styles:
                found.append(f"legend entry {text!r} {key[1:]} matches no visible curve or bar")
    return found
