"""Ablation grids: compressor x method x transport x workers x block size x ratio, resumable.

A grid comes from a small YAML file (``experiments/ablation.yaml`` is an example) and/or command-line
lists (which override the file's)::

    python -m experiments.ablation --config experiments/ablation.yaml
    python -m experiments.ablation --task digits-mlp --compressor identity topk --method none ef \\
        --transport ring omnireduce allgather --workers 2 4 8 --block-size 64 256 --ratio 0.01 0.1 \\
        --steps 40 --target-acc 0.9 --skip-incompatible
    python -m experiments.ablation --config experiments/ablation.yaml --dry-run   # validate, list cells

Axes:

- ``compressor``, ``method``, ``transport``: registered names (``--list`` shows them);
- ``workers``: simulated workers;
- ``block_size``: OmniReduce's block size (given to every transport that takes ``block_size``) and the
  block of the block-density measurement; for other transports the axis collapses to its first value;
- ``ratio``: the kept fraction of sparsifying compressors (top-k, rand-k: their ``ratio``); for compressors
  without ``ratio`` the axis collapses (no duplicate runs). ``density`` (``--density``) is an alias of it
  (earlier files; "block density" is another quantity: the fraction of non-zero blocks);
- ``method`` around the ``identity`` compressor: ``ef``, ``ef21`` and ``diana`` have nothing to correct
  (the identity's error is zero) and train as ``none`` does, up to floating-point rounding: those cells
  collapse to ``none``.

Before anything runs, every cell is checked with the library's own checks (names, hyper-parameters,
compressor x transport compatibility). An unknown name or a bad setting stops the study; incompatible
pairs stop it too, listing each with the library's reason, unless ``skip_incompatible`` is set (then
they are reported as skipped).

The whole grid is one wandb group. Each finished cell is appended to ``<out>/results.jsonl`` keyed by
the hash of its configuration; a rerun skips the cells already there, so an interrupted study resumes
where it stopped (delete the file, or use another ``--out``, to start over). At the end: a summary table
(final accuracy, steps / modelled time / bytes to reach ``target_acc``, modelled communication time
per step) and ``<out>/ablation.png``: time-to-accuracy, bytes-to-accuracy, and modelled time per step
vs workers; the last lines on stdout are one ``final cell=... workers=... seed=... train_loss=... ...`` per
cell, for scripts.

``--seeds K`` (``seeds: K`` in the file) runs every cell for the seeds ``seed`` .. ``seed + K - 1``
(each one a record of its own, so a resumed study keeps finished seeds); the table shows mean ± std over
the seeds, the figure the mean with a ± std band (error bars in the workers panel).

``--task`` (``task:``) takes a bundled name or ``module:function``, a researcher's ``build(seed) ->
TaskSpec`` (docs/your-own-task.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import sparsecomm as sc
from .common import cli, plots, report, tasks, tracking, train
from .common import config as C

AXES = ("compressor", "method", "transport", "workers", "block_size", "ratio")
#: other names of axes, accepted in files and on the command line
AXIS_ALIASES = {"density": "ratio"}
DEFAULTS: dict[str, Any] = {"compressor": ["identity"], "method": ["none"], "transport": ["ring"],
                            "workers": [8], "block_size": [256], "ratio": [None]}
FIXED = ("task", "steps", "batch_size", "lr", "warmup_steps", "eval_every", "seed", "backend",
         "bandwidth_gbps", "latency_us", "loss")
#: per-name hyper-parameters: ``compressor_kw: {qsgd: {levels: 8}}`` (same for method_kw, transport_kw)
PER_NAME = ("compressor_kw", "method_kw", "transport_kw")
SPEC_KEYS = set(FIXED) | set(PER_NAME) | {"group", "target_acc", "skip_incompatible", "grid", "seeds"}


# ------------------------------------------------------------------------------------- the spec
def load_spec(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise C.ConfigError(f"{path}: no such file (an example grid: experiments/ablation.yaml)") from None
    except OSError as e:
        raise C.ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        spec = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise C.ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(spec, dict):
        raise C.ConfigError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise C.ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(SPEC_KEYS))}")
    grid = spec.get("grid") or {}
    for old, new in AXIS_ALIASES.items():
        if old in grid:
            if new in grid:
                raise C.ConfigError(f"{path}: grid axes {old!r} and {new!r} are one axis ({old!r} is an alias "
                                    f"of {new!r}); keep {new!r}")
            grid[new] = grid.pop(old)
    bad = sorted(set(grid) - set(AXES))
    if bad:
        raise C.ConfigError(f"{path}: unknown grid axis {', '.join(bad)}; axes: {', '.join(AXES)}")
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise C.ConfigError(f"{path}: grid axis {k!r} must be a non-empty list, got {v!r}")
    return spec


def _yaml_problem(e) -> str:
    """One line for a YAML error: what is wrong and where (PyYAML's own text spans several lines)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def merge_args(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The file's spec with the command line's values on top (only options given explicitly)."""
    spec = {**spec, "grid": dict(spec.get("grid") or {})}
    for axis in AXES:
        v = getattr(args, axis)
        if v is not None:
            spec["grid"][axis] = v
    for k in FIXED:  # unset options are None (RunConfig's defaults apply to what neither sets)
        if getattr(args, k, None) is not None:
            spec[k] = getattr(args, k)
    for k, opt in (("compressor_kw", "compressor_arg"), ("method_kw", "method_arg"),
                   ("transport_kw", "transport_arg")):
        extra = C.parse_kv(getattr(args, opt))
        if extra:  # command-line hyper-parameters apply to every name of that axis
            spec[k] = {**(spec.get(k) or {}), "*": extra}
    for k in ("group", "target_acc", "seeds"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    if "compressor" in spec["grid"]:  # "none" is the identity's alias (C.COMPRESSOR_ALIASES)
        spec["grid"]["compressor"] = list(dict.fromkeys(C.compressor_name(n) for n in spec["grid"]["compressor"]))
    spec["skip_incompatible"] = bool(args.skip_incompatible or spec.get("skip_incompatible", False))
    spec["task"] = spec.get("task") or "recsys-zipf"
    spec["group"] = spec.get("group") or f"ablation-{C.slug(tasks.display_name(spec['task']))}"
    return spec


def _kw_for(spec: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    table = spec.get(key) or {}
    return {**(table.get("*") or {}), **(table.get(name) or {})}


# ------------------------------------------------------------------------------------- the cells
def expand(spec: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """All distinct cells of the grid, validated: ``(runnable, incompatible)``.

    Each cell is ``{"cfg", "ratio", "block", "reason"}`` (``ratio``/``block`` are ``None`` where the
    axis does not apply); a runnable cell appears once per seed of :func:`seed_list`, in turn. Unknown
    names and bad settings raise (``UnknownNameError`` / ``ConfigError``); incompatible pairs are returned
    with the library's message.
    """
    grid = {a: list(spec["grid"].get(a, DEFAULTS[a])) for a in AXES}
    _check_names(spec["task"], grid)
    fixed = {k: spec[k] for k in FIXED if spec.get(k) is not None}
    seeds = seed_list(spec)
    runnable, incompatible, seen = [], [], set()
    for comp, meth, trans, workers, block, ratio in itertools.product(*(grid[a] for a in AXES)):
        if _no_op_memory(meth, comp):  # the same run as no method at all: collapse it
            meth = "none"
        ckw = _kw_for(spec, "compressor_kw", comp)
        applies = ratio is not None and C.accepts(sc.compressors.registry.factory(comp), "ratio")
        if applies:
            ckw["ratio"] = ratio
        block_applies = C.accepts(sc.transports.registry.factory(trans), "block_size")
        if not block_applies:  # the axis then only sets the density measurement's block: collapse it
            block = grid["block_size"][0]
        cfg = C.RunConfig(compressor=comp, method=meth, transport=trans, workers=int(workers),
                          block_size=int(block), compressor_kw=ckw, method_kw=_kw_for(spec, "method_kw", meth),
                          transport_kw=_kw_for(spec, "transport_kw", trans), **fixed)
        if cfg.key() in seen:
            continue
        seen.add(cfg.key())
        cell = {"ratio": ratio if applies else None, "block": int(block) if block_applies else None}
        reason = C.incompatibility(cfg)
        if reason is None:
            runnable += [{**cell, "cfg": C.validate(replace(cfg, seed=seed))} for seed in seeds]
        elif (comp, meth, trans) not in seen:  # reported once per combination, not per cell
            seen.add((comp, meth, trans))
            incompatible.append({**cell, "cfg": cfg, "reason": reason})
    return runnable, incompatible


def seed_list(spec: dict[str, Any]) -> list[int]:
    """The seeds of every cell: ``seed`` (default 0) and the ``seeds - 1`` after it."""
    k, first = spec.get("seeds") or 1, spec.get("seed") or 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise C.ConfigError(f"seeds must be a positive integer (the number of seeds per cell), got {k!r}")
    return [int(first) + i for i in range(k)]


def _no_op_memory(method: str, compressor: str) -> bool:
    """A method that keeps memory around its compressor (EF's error, EF21's and DIANA's shifts) around the
    identity: the error is zero and the shifts cancel in the estimate, so it trains as ``none`` does (up to
    floating-point rounding)."""
    return (method != "none" and sc.methods.wraps_compressor(method)
            and sc.compressors.registry.product(compressor) is sc.compressors.registry.product("identity"))


def _check_names(task: str, grid: dict[str, list]) -> None:
    """Every name of every axis at once, so one message lists all the unknown ones."""
    regs = {"compressor": sc.compressors.registry, "method": sc.methods.registry,
            "transport": sc.transports.registry}
    problems = []
    if tasks.is_external(task):
        tasks.check(task)  # a researcher's task: its own one-line error (ConfigError) if it does not build
    elif task not in tasks.registry:
        problems.append(f"task {task!r} (valid: {', '.join(tasks.available())}, or module:function)")
    for axis, reg in regs.items():
        for name in grid[axis]:
            if name not in reg:
                problems.append(f"{axis} {name!r} (valid: {', '.join(reg.available())})")
    for axis in ("workers", "block_size"):
        for v in grid[axis]:
            if not isinstance(v, int) or v < 1:
                problems.append(f"{axis} {v!r} (must be a positive integer)")
    for v in grid["ratio"]:
        if v is not None and not (isinstance(v, (int, float)) and 0 < v <= 1):
            problems.append(f"ratio {v!r} (the kept fraction: must be in (0, 1])")
    if problems:
        raise C.ConfigError("unknown or invalid grid value(s): " + "; ".join(problems))


def series_name(cell: dict) -> str:
    """A cell's name without its worker count (one line of the workers plot)."""
    cfg = cell["cfg"]
    b = f" b={cell['block']}" if cell["block"] is not None else ""
    return f"{cfg.scheme} / {cfg.transport}{b}"


def cell_name(cell: dict, seeded: bool = False) -> str:
    """A cell's name (with its seed when ``seeded``: a grid of several seeds)."""
    return f"{series_name(cell)} n={cell['cfg'].workers}" + (f" seed={cell['cfg'].seed}" if seeded else "")


# ------------------------------------------------------------------------------------- running
def run_grid(cells: list[dict], spec: dict[str, Any], out: Path, *, progress: bool,
             project: str, wandb: bool = True) -> list[dict]:
    """Run the cells not yet in ``out/results.jsonl``; return the finished records of every cell."""
    results_path = out / "results.jsonl"
    done = {r["key"]: r for r in tracking.read_jsonl(results_path)}
    todo = [c for c in cells if c["cfg"].key() not in done]
    if len(todo) < len(cells):
        print(f"resuming: {len(cells) - len(todo)} of {len(cells)} cells already in {results_path}")
    group = spec["group"]
    seeded = len(seed_list(spec)) > 1
    bar = tracking.progress(desc="ablation", total=len(todo), enabled=progress and bool(todo), unit="cell")
    for c in todo:
        cfg, name = c["cfg"], cell_name(c, seeded)
        bar.set_description(f"ablation: {name}")
        res = train.run(cfg, progress=progress)
        rec = {"key": cfg.key(), "name": name, "series": series_name(c),
               "scheme": cfg.scheme, "transport": cfg.transport, "workers": cfg.workers, "seed": cfg.seed,
               "block_size": c["block"], "ratio": c["ratio"], "config": cfg.as_dict(),
               "summary": res.summary, "initial": res.initial, "records": res.records, "wall_s": res.wall_s}
        tracking.write_csv(out / "cells" / f"{cfg.key()}.csv", res.records, train.STEP_COLUMNS)
        tracking.log_run(res.records, {**res.summary, **targets(res.records, spec.get("target_acc"))},
                         {**cfg.as_dict(), "ratio": c["ratio"], "scheme": cfg.scheme, "cell": cfg.key()},
                         name=name, group=group, wandb_dir=out, project=project, job_type="ablation",
                         enabled=wandb)
        tracking.append_jsonl(results_path, rec)
        done[rec["key"]] = rec
        bar.update(1)
    bar.close()
    return [done[c["cfg"].key()] for c in cells]


def targets(records: list[dict], target: float | None) -> dict[str, Any]:
    """Steps, modelled time and bytes per worker until held-out accuracy first reaches ``target``."""
    if target is None:
        return {}
    hit = train.first_reaching(records, target)
    if hit is None:
        return {"steps_to_target": None, "time_to_target_s": None, "bytes_to_target": None}
    return {"steps_to_target": hit["step"], "time_to_target_s": hit["modelled_time_s"],
            "bytes_to_target": train.cumulative_bytes(records, hit["step"])}


def _ratio(r: dict) -> float | None:
    """A finished cell's kept fraction (``"density"`` in results written before the axis was named ``ratio``)."""
    return r["ratio"] if "ratio" in r else r.get("density")


def summary_table(finished: list[dict], skipped: list[dict], target: float | None) -> str:
    """One row per cell; the cells of several seeds as one row of mean ± std over the seeds (steps, time
    and bytes to target over the seeds that reached it, ``k/K`` when not all did)."""
    tgt = f"{target:g}" if target is not None else "-"
    headers = ["cell", "scheme / transport", "workers", "block", "ratio", "final acc",
               f"steps to {tgt}", f"time to {tgt}", f"bytes to {tgt}", "comm/step", "bytes/step"]
    groups: dict[tuple, list[dict]] = {}
    for r in finished:
        groups.setdefault((r["series"], r["workers"]), []).append(r)
    rows: list[Any] = []
    for recs in groups.values():
        r = recs[0]
        cell = (r["key"], f"{r['scheme']} / {r['transport']}", r["workers"],
                "-" if r["block_size"] is None else r["block_size"],
                "-" if _ratio(r) is None else f"{_ratio(r):g}")
        diverged = [x for x in recs if "diverged" in x["summary"]]
        if diverged:
            seeds = f" ({len(diverged)} of {len(recs)} seeds)" if len(recs) > 1 else ""
            rows.append((*cell, f"diverged{seeds}: "
                                f"{report.first_sentence(diverged[0]['summary']['diverged'], 60)}"))
            continue
        hits = [t for t in (targets(x["records"], target) for x in recs) if t.get("steps_to_target") is not None]
        reached = f" ({len(hits)}/{len(recs)})" if len(recs) > 1 and target is not None else ""

        def over(key: str, fmt, note: str = "") -> str:
            v = [t[key] for t in hits]
            return (_mean_std(v, fmt) + note) if v else "-"

        rows.append((*cell, report.fmt_mean_std([x["summary"]["final_test_acc"] for x in recs]),
                     over("steps_to_target", lambda x: f"{x:g}", reached), over("time_to_target_s", report.fmt_time),
                     over("bytes_to_target", report.fmt_bytes),
                     _mean_std([x["summary"]["modelled_comm_per_step_s"] for x in recs], report.fmt_time),
                     _mean_std([x["summary"]["bytes_per_step"] for x in recs], report.fmt_bytes)))
    for c in skipped:
        cfg = c["cfg"]
        rows.append(("skipped", f"{cfg.scheme} / {cfg.transport}",
                     f"n/a (incompatible: {report.first_sentence(c['reason'])})"))
    return report.table(headers, rows, align="llrrrrrrrrr")


def _mean_std(values: list[float], fmt) -> str:
    """``fmt(mean) ± fmt(std)`` (sample std); one value as ``fmt(value)``."""
    v = np.asarray(values, dtype=float)
    if v.size == 1:
        return fmt(float(v[0]))
    return f"{fmt(float(v.mean()))} ± {fmt(float(v.std(ddof=1)))}"


# ------------------------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = cli.base_parser("python -m experiments.ablation", __doc__,
                        out_help="folder for results and wandb runs (default experiments/out/ablation/<group>)")
    p.add_argument("--config", type=Path, default=None, help="YAML grid (see experiments/ablation.yaml)")
    g = p.add_argument_group("grid axes (override the file's)")
    g.add_argument("--task", default=None, help=cli.TASK_HELP)
    g.add_argument("--compressor", nargs="+", default=None,
                   help="registered compressors (identity = no compression, alias: none)")
    g.add_argument("--method", nargs="+", default=None)
    g.add_argument("--transport", nargs="+", default=None)
    g.add_argument("--workers", nargs="+", type=int, default=None)
    g.add_argument("--block-size", dest="block_size", nargs="+", type=int, default=None)
    g.add_argument("--ratio", "--density", dest="ratio", nargs="+", type=float, default=None,
                   help="kept fraction of sparsifiers (top-k, rand-k: their ratio); --density is an alias")
    g.add_argument("--target-acc", type=float, default=None, help="accuracy of time-/bytes-to-accuracy")
    g.add_argument("--skip-incompatible", action="store_true",
                   help="skip (and report) compressor x transport pairs the library rejects")
    g.add_argument("--dry-run", action="store_true", help="validate the grid, list its cells, run nothing")
    cli.add_common(p)
    cli.add_seeds(p)
    # so that the file's values stand unless given here
    p.set_defaults(**{k: None for k in FIXED}, seeds=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(cli.list_components())
        return 0
    try:
        spec = merge_args(load_spec(args.config), args)
        cells, incompatible = expand(spec)
    except C.INVALID as e:
        p.exit(2, f"{p.prog}: invalid grid: {e}\n")
    if incompatible and not spec["skip_incompatible"]:
        lines = "\n".join(f"  - {c['cfg'].label}: {c['reason']}" for c in incompatible)
        p.exit(2, f"{p.prog}: {len(incompatible)} cell(s) of the grid cannot run:\n{lines}\n"
                  f"Remove them, or set skip_incompatible: true (--skip-incompatible) to run the rest.\n")
    out = args.out or tracking.OUT_ROOT / "ablation" / spec["group"]
    print(f"ablation {spec['group']!r} on {spec['task']}: {len(cells)} cells to run"
          + (f", {len(incompatible)} incompatible compressor x method x transport combination(s) skipped"
             if incompatible else "") + f"; results in {out}")
    if args.dry_run:
        for c in cells:
            print(f"  {c['cfg'].key()}  {cell_name(c, len(seed_list(spec)) > 1)}")
        return 0
    train.set_cpu_threads()
    finished = run_grid(cells, spec, out, progress=not args.no_progress, project=args.project,
                        wandb=not args.no_wandb)
    target = spec.get("target_acc")
    text = summary_table(finished, incompatible, target)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    tracking.write_csv(out / "summary.csv", [
        {"key": r["key"], "name": r["name"], "seed": r["config"]["seed"], **r["summary"],
         **targets(r["records"], target)} for r in finished])
    plotted = [{"label": r["name"], "series": r["series"], "scheme": r["scheme"], "transport": r["transport"],
                "workers": r["workers"], "records": r["records"], "summary": r["summary"]}
               for r in finished if r["records"]]
    if plotted:
        print(f"plot: {plots.save(plots.ablation_figure(plotted, target), out / 'ablation.png')}")
    tracking.print_sync_hint(out, enabled=not args.no_wandb)
    for r in finished:                  # last on stdout: one parseable line per run
        print(tracking.metrics_line(r["summary"], {"cell": r["series"], "workers": r["workers"],
                                                   "seed": r["config"]["seed"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
