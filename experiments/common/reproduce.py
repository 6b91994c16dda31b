"""What the paper reproductions (``experiments/reproduce_*.py``) share: their command line (the options of
:func:`.cli.base_parser` plus ``--quick`` and ``--threads``), a :class:`Run` (output folder, wandb through
:func:`.tracking.init_wandb`, progress bars) and the single-thread setting (the problems are tiny: one
intra-op thread each, so that a run does not fight other jobs for the cores).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from . import cli, tracking

#: default home of a reproduction's outputs: ``experiments/out/<name>`` under the working directory
OUT_DEFAULT = tracking.OUT_ROOT


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The shared options (``--out``, ``--seed``, ``--no-progress``, ``--no-wandb``) plus ``--quick`` and
    ``--threads``; a reproduction adds its own."""
    p = cli.base_parser(prog, doc, out_help=f"folder for the PNG/JSON/CSV outputs (default {OUT_DEFAULT}/<name>)")
    p.add_argument("--quick", action="store_true", help="a short version (seconds to a minute), for smoke tests")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    return p


class Run:
    """Output folder + optional wandb run; ``log`` forwards to wandb, ``save_figure`` writes PNGs,
    ``progress`` wraps a loop in a progress bar, ``finish`` writes ``summary.json``."""

    def __init__(self, name: str, args: argparse.Namespace, config: dict[str, Any]) -> None:
        torch.set_num_threads(max(1, int(getattr(args, "threads", 1))))
        self.name = name
        self.out = Path(args.out) if args.out is not None else OUT_DEFAULT / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.show_progress = not getattr(args, "no_progress", False)
        self.wandb = None
        if not getattr(args, "no_wandb", False):
            self.wandb = tracking.init_wandb(name=name + ("-quick" if getattr(args, "quick", False) else ""),
                                             group=name, config=config, wandb_dir=self.out,
                                             job_type="reproduction")

    def progress(self, iterable: Iterable, *, desc: str, total: int | None = None) -> Iterable:
        """``iterable`` with a progress bar on stderr (none with ``--no-progress``)."""
        return tracking.progress(iterable, desc=f"{self.name}: {desc}", total=total, enabled=self.show_progress)

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in data.items() if _finite_or_str(v)}, step=step)

    def save_figure(self, fig, stem: str) -> Path:
        path = self.out / f"{stem}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        if self.wandb is not None:
            import wandb

            self.wandb.log({stem: wandb.Image(str(path))})
        import matplotlib.pyplot as plt

        plt.close(fig)
        return path

    def finish(self, summary: dict[str, Any]) -> Path:
        summary = {**summary, "wall_s": round(time.time() - self.t0, 1)}
        path = self.out / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=_jsonable))
        if self.wandb is not None:
            for k, v in _flatten(summary).items():
                if _finite_or_str(v):
                    self.wandb.summary[k] = v
            self.wandb.finish()
        return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite_or_str(v: Any) -> bool:
    if isinstance(v, (int, float)):
        return math.isfinite(v)
    return isinstance(v, str)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return str(v)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif not isinstance(v, (list, tuple)):
            out[key] = v
    return out


def sqdist(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - y) ** 2).sum())


def fit_rate(values: list[float], its: list[int]) -> float:
    """The per-iteration contraction q of a geometric sequence, least squares on log(values) vs its."""
    pts = [(i, math.log(v)) for i, v in zip(its, values) if v > 0 and math.isfinite(v)]
    if len(pts) < 2:
        return math.nan
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return math.nan
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return math.exp(slope)
