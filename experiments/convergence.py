"""Convergence runs: any compressor x method x transport on a bundled task or your own, logged per step.

Examples::

    # top-k (1 %) with error feedback over OmniReduce, 8 simulated workers on a 100 Gbps network
    python -m experiments.convergence --task recsys-zipf --compressor topk --ratio 0.01 --method ef \\
        --transport omnireduce --block-size 256 --workers 8 --steps 200 \\
        --backend sim --bandwidth-gbps 100 --latency-us 2 --loss 0 --out runs/conv

    # DIANA around shared-seed rand-k on the switch, logistic regression
    python -m experiments.convergence --task breast-cancer-logreg --compressor randk --ratio 0.1 \\
        --method diana --transport switch

    # real processes (torch.distributed, gloo) ...; QSGD's variance (omega ~ 57 at 4 levels) needs a smaller
    # step than the task's uncompressed --lr 0.5 (which diverges with it): --lr 0.1
    python -m experiments.convergence --backend gloo --workers 4 --compressor qsgd --transport allgather --lr 0.1
    # ... or under torchrun (one process per worker; only rank 0 writes results)
    torchrun --nproc-per-node 4 -m experiments.convergence --compressor qsgd --transport allgather --lr 0.1

    python -m experiments.convergence --list     # every task, compressor, method and transport

    # your own task, from your own package (docs/your-own-task.md), over three seeds
    python -m sparsecomm.experiments.convergence --task my_task.tasks:build --workers 2 --seeds 3

Every step logs (to wandb, mode from ``WANDB_MODE``, ``offline`` by default, and to
``<out>/<name>.csv``; ``<name>`` is e.g. ``recsys-zipf_ef-topk-ratio-0.01_omnireduce_n8_s0``): training
loss, held-out loss and accuracy (every ``--eval-every`` steps), the local gradient norm, bits sent per
worker, the gradient's block density (per worker and the union over workers), the modelled communication
time (SimFabric's clock; 0 on real fabrics) and the measured wall-clock time of the collectives; the
run's configuration goes to the wandb config and ``<out>/<name>.json``; ``<out>/<name>.png`` plots loss
and accuracy vs step and held-out loss vs communication time. ``--seed`` fixes data, model
initialisation and compressor randomness: two runs with the same arguments give the same numbers.
``--seeds K`` runs seeds ``--seed`` .. ``--seed + K - 1`` (a CSV, JSON and wandb run each), prints the
run-level numbers as mean ± std over them, writes the per-step mean and std to ``<out>/<stem>_s0-2.csv``
(for K = 3) and plots the mean with a ± std band in ``<out>/<stem>_s0-2.png``.

``--task`` takes a bundled name or ``module:function``, a researcher's ``build(seed) -> TaskSpec``
(:class:`experiments.common.tasks.TaskSpec`; the guide is docs/your-own-task.md): imported, built and
tried on one mini-batch before anything runs.

An unknown name or a pair the library cannot run (e.g. top-k's sparse payload on ``ring``) stops
before anything runs, with the library's message. ``--lr`` defaults to the task's learning rate, tuned
for uncompressed training; an unbiased compressor (QSGD, rand-k) without memory may need a smaller one:
the start-up warning and a diverged run say what theory allows at the ``--lr`` given (the worst case
and the i.i.d.-data rule, ``opt.step_size_hint``). A run that diverges keeps the steps before it in the
CSV and exits with status 1. Progress bars are drawn only on a terminal; the last line on stdout is
``final key=value ...`` (training and held-out loss, accuracy, bytes per step, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from .common import cli, plots, report, tasks, tracking, train
from .common import config as C

DEFAULT_OUT = tracking.OUT_ROOT / "convergence"


def parser() -> argparse.ArgumentParser:
    p = cli.base_parser("python -m experiments.convergence", __doc__,
                        out_help=f"folder for CSV/JSON results and wandb runs (default {DEFAULT_OUT})")
    g = p.add_argument_group("what to run")
    g.add_argument("--task", default="recsys-zipf", help=cli.TASK_HELP)
    g.add_argument("--compressor", default="identity",
                   help="a registered compressor (identity = no compression, alias: none; see --list)")
    g.add_argument("--ratio", type=float, default=None,
                   help="kept fraction of sparsifiers (top-k, rand-k: their ratio)")
    g.add_argument("--method", default="none", help="none | ef | ef21 | diana")
    g.add_argument("--transport", default="ring", help="ring | omnireduce | switch | allgather | native")
    g.add_argument("--block-size", type=int, default=256,
                   help="block size of the block-density measurement and of block-based transports")
    g.add_argument("--workers", type=int, default=8, help="number of workers (ignored under torchrun)")
    cli.add_common(p)
    cli.add_seeds(p)
    p.add_argument("--name", default=None, help="run name (default: from the configuration)")
    return p


def config_from_args(args: argparse.Namespace, seed: int | None = None) -> C.RunConfig:
    fixed = cli.fixed_settings(args)
    if seed is not None:
        fixed["seed"] = seed
    if args.ratio is not None:
        fixed["compressor_kw"] = {**fixed["compressor_kw"], "ratio": args.ratio}
    cfg = C.RunConfig(task=args.task, compressor=args.compressor, method=args.method,
                      transport=args.transport, block_size=args.block_size, workers=args.workers, **fixed)
    if under_torchrun():  # this process is one rank; the job's ranks are the workers plus the services
        size = int(os.environ["WORLD_SIZE"])
        workers = next((n for n in range(size, 0, -1) if n + len(train.services_for(cfg, n)) == size), None)
        if workers is None:
            raise C.ConfigError(f"torchrun started {size} ranks; transport {cfg.transport!r} needs "
                                f"service ranks besides the workers ({train.services_for(cfg, 1)} for 1 worker)")
        cfg = C.RunConfig(**{**cfg.as_dict(), "backend": "gloo", "workers": workers})
    return C.validate(cfg)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ


def is_writer() -> bool:
    """Under torchrun only global rank 0 writes results."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


#: the run-level numbers the printed summary and the seeds' summary show
SUMMARY_KEYS = ("final_test_loss", "final_test_acc", "final_train_loss", "bytes_per_step", "block_density",
                "block_density_union", "modelled_comm_per_step_s", "measured_comm_per_step_s")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(cli.list_components())
        return 0
    try:
        seeds = cli.seed_list(args)
        cfgs = [config_from_args(args, seed) for seed in seeds]
        task_name = tasks.display_name(cfgs[0].task, cfgs[0].seed)
        metric = tasks.metric_of(cfgs[0].task, cfgs[0].seed)
    except C.INVALID as e:
        p.exit(2, f"{p.prog}: invalid configuration: {e}\n")
    train.set_cpu_threads()
    cfg = cfgs[0]
    if is_writer():
        print(f"{cfg.label} on {task_name}: {cfg.workers} workers ({cfg.backend}), {cfg.steps} steps, "
              f"lr {cfg.lr:g}, batch {cfg.batch_size}/worker"
              + (f", {cfg.bandwidth_gbps:g} Gbps / {cfg.latency_us:g} us / loss {cfg.loss:g}"
                 if cfg.backend == "sim" else "")
              + (f"; seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else ""))
    out = args.out or DEFAULT_OUT
    where = (f"SimFabric, {cfg.bandwidth_gbps:g} Gbps" if cfg.backend == "sim" else cfg.backend)
    title = f"{cfg.label} on {task_name}: {cfg.workers} workers ({where})"
    metric_name = f"held-out {metric}"
    results = []
    for cfg in cfgs:
        result = train.run(cfg, progress=not args.no_progress and is_writer())
        if not is_writer():
            continue
        name = (f"{args.name}_s{cfg.seed}" if len(cfgs) > 1 else args.name) if args.name else cfg.stem
        stem = _file_stem(name)
        csv_path = tracking.write_csv(out / f"{stem}.csv", result.records, train.STEP_COLUMNS)
        (out / f"{stem}.json").write_text(json.dumps({"config": cfg.as_dict(), "summary": result.summary,
                                                      "initial": result.initial}, indent=2, default=str))
        tracking.log_run(result.records, result.summary, {**cfg.as_dict(), "scheme": cfg.scheme}, name=name,
                         group=args.group or f"convergence-{C.slug(task_name)}", wandb_dir=out,
                         project=args.project, job_type="convergence", enabled=not args.no_wandb)
        s = result.summary
        if "diverged" in s:
            print(f"the run (seed {cfg.seed}) diverged {s['diverged']}")
            print(lr_advice(cfg.lr, result.step_size_hint))
            print(f"per-step CSV (the steps before it): {csv_path}")
            return 1
        seed_note = f"seed {cfg.seed}: " if len(cfgs) > 1 else ""
        print(f"{seed_note}held-out loss {s['final_test_loss']:.4f}, {metric} {s['final_test_acc']:.4f}; "
              f"{s['bytes_per_step']:.0f} B/worker/step, block density {s['block_density']:.3f} "
              f"(union {s['block_density_union']:.3f}); modelled comm. {s['modelled_comm_per_step_s'] * 1e6:.1f} "
              f"us/step, measured {s['measured_comm_per_step_s'] * 1e3:.2f} ms/step; {result.wall_s:.1f} s wall")
        print(f"{seed_note}per-step CSV: {csv_path}")
        results.append(result)
    if not is_writer():
        return 0
    if len(results) == 1:
        png_stem = stem
    else:
        png_stem = _file_stem(args.name or cfgs[0].stem.rsplit("_s", 1)[0] + f"_s{seeds[0]}-{seeds[-1]}")
        _write_seed_summary(results, out, png_stem, metric)
    png = plots.save(plots.convergence_figure([(r.records, r.initial) for r in results], title,
                                              modelled=cfgs[0].backend == "sim", metric_name=metric_name),
                     out / f"{png_stem}.png")
    print(f"plot: {png}")
    tracking.print_sync_hint(out, enabled=not args.no_wandb)
    summary = (results[0].summary if len(results) == 1 else
               {k: float(np.nanmean([r.summary[k] for r in results])) for k in SUMMARY_KEYS})
    print(tracking.metrics_line(summary))
    return 0


def lr_advice(lr: float, hint: dict | None) -> str:
    """What to try after a divergence at ``--lr lr``: a smaller ``--lr``, with what theory allows
    (``hint``: :attr:`train.RunResult.step_size_hint`) if ``lr`` suits uncompressed training."""
    if not hint or hint.get("scale") is None:
        return f"try a smaller --lr than {lr:g} (theory gives no step bound for this method: opt.step_size_hint)"
    iid = (f", or --lr {lr * hint['iid_scale']:.3g} by the i.i.d.-data rule"
           if hint.get("iid_scale") is not None else "")
    return (f"try a smaller --lr: if --lr {lr:g} suits uncompressed training, theory allows --lr "
            f"{lr * hint['scale']:.3g} in the worst case{iid} ({hint['text']}; opt.step_size_hint)")


def _file_stem(name: str) -> str:
    return "_".join(C.slug(part) for part in name.split("_"))


def _write_seed_summary(results: list, out, stem: str, metric: str) -> None:
    """Mean +- std over the seeds: printed, ``<stem>.csv`` per step (``<column>_mean``, ``<column>_std``)
    and ``<stem>.json`` (the run-level numbers per seed and their mean and std)."""
    columns = [c for c in train.STEP_COLUMNS if c != "step"]
    runs = [[r for r in res.records] for res in results]
    steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
    rows = []
    for step in steps:
        row: dict = {"step": step}
        for c in columns:
            vals = [r[c] for recs in runs for r in recs if r["step"] == step and c in r]
            if len(vals) == len(runs):
                row[f"{c}_mean"] = float(np.mean(vals))
                row[f"{c}_std"] = float(np.std(vals, ddof=1))
        rows.append(row)
    header = ["step"] + [f"{c}_{k}" for c in columns for k in ("mean", "std")]
    csv_path = tracking.write_csv(out / f"{stem}.csv", rows, header)
    per_seed = {k: [res.summary[k] for res in results] for k in SUMMARY_KEYS}
    stats = {k: {"mean": float(np.nanmean(v)), "std": float(np.nanstd(v, ddof=1)), "per_seed": v}
             for k, v in per_seed.items()}
    (out / f"{stem}.json").write_text(json.dumps({"seeds": [res.config.seed for res in results],
                                                  "config": results[0].config.as_dict(), "summary": stats},
                                                 indent=2, default=str))
    headers = ["quantity", f"mean ± std over {len(results)} seeds"]
    names = {"final_test_loss": "final held-out loss", "final_test_acc": f"final held-out {metric}",
             "final_train_loss": "final training loss", "bytes_per_step": "bytes / worker / step",
             "block_density": "block density", "block_density_union": "block density (union)",
             "modelled_comm_per_step_s": "modelled comm. / step (us)",
             "measured_comm_per_step_s": "measured comm. / step (ms)"}
    scale = {"modelled_comm_per_step_s": 1e6, "measured_comm_per_step_s": 1e3}
    rows_t = [(names[k], report.fmt_mean_std([x * scale.get(k, 1.0) for x in v],
                                             ".0f" if k == "bytes_per_step" else ".4f"))
              for k, v in per_seed.items()]
    print(report.table(headers, rows_t, align="lr"))
    print(f"mean ± std per step: {csv_path}")


if __name__ == "__main__":
    sys.exit(main())
