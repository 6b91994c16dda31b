"""Where results go: wandb (offline by default) and plain CSV/JSONL files that need no service.

wandb's mode comes from ``WANDB_MODE`` (``offline`` when unset; ``disabled`` writes nothing, which is
what the tests use). Runs of one study share a ``group``; offline runs are synced later with
``wandb sync <dir>``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

PROJECT = "sparsecomm"
#: default home of the studies' outputs, relative to the working directory (git-ignored in the repository);
#: never inside the installed package
OUT_ROOT = Path("experiments") / "out"


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE", "offline")


def init_wandb(*, name: str, group: str, config: dict[str, Any], wandb_dir: Path | None,
               project: str = PROJECT, job_type: str = "train"):
    """The one place the studies start a wandb run (in ``<wandb_dir>/wandb``): ``None`` when
    ``WANDB_MODE=disabled``. The caller logs to the run and calls ``finish()``."""
    mode = wandb_mode()
    if mode == "disabled":
        return None
    import wandb

    if wandb_dir is not None:
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                              disable_git=True, save_code=False)
    return wandb.init(mode=mode, dir=str(wandb_dir) if wandb_dir else None, project=project, group=group,
                      name=name, job_type=job_type, config=config, reinit="finish_previous", settings=settings)


def log_run(records: list[dict[str, Any]], summary: dict[str, Any], config: dict[str, Any], *,
            name: str, group: str, wandb_dir: Path | None, project: str = PROJECT,
            job_type: str = "train", enabled: bool = True) -> None:
    """Log one finished run (per-step ``records``, a ``summary``) to wandb, in the folder
    ``<wandb_dir>/wandb``. Nothing is written when ``WANDB_MODE=disabled`` or ``enabled`` is false
    (``--no-wandb``)."""
    run = init_wandb(name=name, group=group, config=config, wandb_dir=wandb_dir, project=project,
                     job_type=job_type) if enabled else None
    if run is None:
        return
    try:
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        for rec in records:
            run.log({k: v for k, v in rec.items() if _loggable(v)})
        for k, v in summary.items():
            if _loggable(v):
                run.summary[k] = v
    finally:
        run.finish()


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None, enabled: bool = True,
             unit: str = "it", leave: bool = True):
    """A tqdm progress bar on stderr over ``iterable`` (or a manual one, ``.update()``, when it is
    ``None``), drawn only when stderr is a terminal: redirected to a file or a pipe (a batch job, a CI
    log) it draws nothing, as with ``enabled`` false (``--no-progress``); the stand-in keeps
    ``update``/``close``/``set_postfix_str``."""
    import sys

    from tqdm.auto import tqdm

    err = sys.stderr
    on_terminal = bool(getattr(err, "isatty", None) and err.isatty())
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, dynamic_ncols=True, file=err,
                disable=not (enabled and on_terminal))


def _loggable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) and not (isinstance(v, float) and math.isnan(v))


def write_csv(path: Path, rows: Iterable[dict[str, Any]], columns: list[str] | None = None) -> Path:
    """Write ``rows`` (missing values left empty) with ``columns`` (default: every key, first seen first)."""
    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in columns})
    return path


def _csv_value(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return v


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file (an absent file is empty; a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record (one line, flushed) so an interrupted study keeps what it finished."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def sync_hint(wandb_dir: Path, enabled: bool = True) -> str | None:
    """How to upload offline runs; ``None`` (print nothing) with ``--no-wandb`` (``enabled`` false)."""
    if not enabled:
        return None
    if wandb_mode() == "disabled":
        return "wandb is disabled (WANDB_MODE=disabled): no runs were written."
    return (f"wandb runs ({wandb_mode()}) are in {Path(wandb_dir) / 'wandb'}; upload them with:\n"
            f"    wandb sync {Path(wandb_dir) / 'wandb'}/offline-run-*")


def print_sync_hint(wandb_dir: Path, enabled: bool = True) -> None:
    """Print :func:`sync_hint` (nothing with ``--no-wandb``)."""
    hint = sync_hint(wandb_dir, enabled)
    if hint:
        print(hint)


def metrics_line(summary: dict[str, Any], labels: dict[str, Any] | None = None) -> str:
    """The one line a study ends with on stdout per run, ``key=value`` pairs a script can parse:
    ``final train_loss=0.6328 test_loss=0.6271 test_acc=0.6470 bytes_per_step=77727 ...``; ``labels`` (a
    study of several runs: which run) come first, their values without spaces
    (``final task=digits-mlp scheme=ef-topk transport=ring train_loss=...``)."""
    keys = (("train_loss", "final_train_loss", ".4f"), ("test_loss", "final_test_loss", ".4f"),
            ("test_acc", "final_test_acc", ".4f"), ("bytes_per_step", "bytes_per_step", ".0f"),
            ("compression_factor_sent", "compression_factor_sent", ".3g"),
            ("modelled_comm_per_step_s", "modelled_comm_per_step_s", ".3g"))
    parts = [f"{k}={re.sub(r'[^A-Za-z0-9.+_-]+', '-', str(v)).strip('-')}" for k, v in (labels or {}).items()]
    parts += [f"{name}={summary[k]:{fmt}}" for name, k, fmt in keys if isinstance(summary.get(k), (int, float))]
    return "final " + " ".join(parts)
