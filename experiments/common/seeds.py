"""Statistics over seeds: what a study run with ``--seeds K`` (:func:`.cli.add_seeds`) reports.

A number measured once per seed becomes its mean ± sample standard deviation (:func:`stats`, and
:func:`.report.fmt_mean_std` for a table cell); curves, one per seed, become their mean with a band
(:func:`band`, drawn by :func:`draw`): arithmetic mean ± one standard deviation on a linear axis, geometric
mean ×/÷ one geometric standard deviation on a log axis (the spread of quantities that fall over decades,
such as a distance to the optimum, is a factor, not a difference). One seed: its own numbers, no band.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import cli
from .config import ConfigError


def seeds_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The seeds ``--seed`` and ``--seeds`` name (:func:`.cli.seed_list`); a ``--seeds`` below 1 ends the
    program with the parser's usage error (status 2)."""
    try:
        return cli.seed_list(args)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: {e}\n")


def stats(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std", "per_seed"}`` of one number measured per seed: NaNs ignored in mean and std
    (NaN when none is left), std the sample standard deviation (``ddof=1``; 0 for a single value)."""
    v = np.asarray([np.nan if x is None else float(x) for x in values], dtype=float)
    ok = v[~np.isnan(v)]
    mean = float(ok.mean()) if ok.size else math.nan
    std = float(ok.std(ddof=1)) if ok.size > 1 else (0.0 if ok.size else math.nan)
    return {"mean": mean, "std": std, "per_seed": [float(x) for x in v]}


@dataclass(frozen=True)
class Band:
    """A curve over seeds: at ``x`` the centre ``mid`` and the band ``lo`` .. ``hi``; ``n`` seeds."""

    x: np.ndarray
    mid: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    n: int


def band(keys: Sequence[Sequence[float]], ys: Sequence[Sequence[float]],
         xs: Sequence[Sequence[float]] | None = None, *, log: bool = False) -> Band:
    """The seeds' curves as one :class:`Band`. Run ``i`` has the value ``ys[i][j]`` at the point
    ``keys[i][j]`` (an iteration, a step, a grid point); the band is taken at the points every run has with
    a finite value (positive too when ``log``), in sorted order. ``xs[i][j]`` is what the point is drawn at
    (e.g. bits sent; default the key itself): its mean over the runs. ``log``: geometric mean ×/÷ one
    geometric standard deviation, else mean ± one standard deviation (both ``ddof=1``)."""
    if not keys or len(keys) != len(ys) or (xs is not None and len(xs) != len(ys)):
        raise ValueError(f"band: one sequence of keys, values (and x) per run, got {len(keys)} keys and "
                         f"{len(ys)} value sequences")
    xs = keys if xs is None else xs

    def good(y: float) -> bool:
        return math.isfinite(y) and (y > 0 or not log)

    per_run = [{k: (float(y), float(x)) for k, y, x in zip(ks, yy, xx) if good(float(y))}
               for ks, yy, xx in zip(keys, ys, xs)]
    common = sorted(set.intersection(*(set(d) for d in per_run)))
    y = np.array([[d[k][0] for k in common] for d in per_run], dtype=float).reshape(len(per_run), len(common))
    x = np.array([[d[k][1] for k in common] for d in per_run], dtype=float).reshape(len(per_run), len(common))
    v = np.log(y) if log else y
    mid = v.mean(0)
    sd = v.std(0, ddof=1) if len(per_run) > 1 else np.zeros_like(mid)
    lo, hi = mid - sd, mid + sd
    if log:
        mid, lo, hi = np.exp(mid), np.exp(lo), np.exp(hi)
    return Band(x.mean(0), mid, lo, hi, len(per_run))


def draw(ax, b: Band, *, band_alpha: float = 0.2, **line_kw):
    """``b``'s centre as a line (``line_kw``: ``color``, ``ls``, ``label``, ``marker``, ...) and, over
    several seeds, its band shaded in the line's colour (opacity ``band_alpha``); returns the line."""
    line, = ax.plot(b.x, b.mid, **line_kw)
    if b.n > 1:
        ax.fill_between(b.x, b.lo, b.hi, color=line.get_color(), alpha=band_alpha, lw=0)
    return line


def caption(n: int, *, log: bool = False) -> str:
    """What a figure's band means, for its title (empty for one seed)."""
    if n <= 1:
        return ""
    if log:
        return f"geometric mean of {n} seeds, shaded: ×/÷ one geometric standard deviation"
    return f"mean of {n} seeds, shaded: ± one standard deviation"
