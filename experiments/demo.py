"""The main job (``make demo``): compression x transport on 8 simulated workers, in about 10 minutes on 2 cores.

Two tasks (``experiments.common.tasks``): ``recsys-zipf``, an embedding-heavy click model whose
gradients are block-sparse (a batch touches a few dozen embedding rows), and ``digits-mlp``, a dense
MLP on scikit-learn's digits. Each is trained with four compression schemes

    none            uncompressed gradients (the baseline)
    top-k + EF      top-k sparsification with error feedback (biased, contractive)
    DIANA + rand-k  shared-seed rand-k with DIANA's gradient shifts (unbiased)
    QSGD            QSGD quantisation, no memory (unbiased)

over each transport (ring all-reduce, OmniReduce block-sparse aggregation, SwitchML in-network
aggregation, the sparse switch (OmniReduce's look-ahead in the switch), and allgather, the carrier for
sparse or unshared payloads). A pair the library rejects (``sparsecomm.pipeline.resolve.check_pair``:
e.g. top-k's worker-specific indices on ``ring``) is not run; the table shows the library's reason.

Every run uses 8 workers as threads over a SimFabric. Each configuration is trained once per network
model (10 and 100 Gbps per worker link, 2 us latency, no loss): training is identical on both
(no loss, no timeouts), and the **modelled communication time is the SimFabric's virtual clock**
(the slowest worker's clock advance per step; compute is not modelled). Bytes and messages come from
the fabric's ledger (``opt.last_stats``), never from the compressors' declared bits; the table's
``compression factor`` column is the one the library reports, measured on the wire
(``compression_stats()["compression_factor_sent"]``: the bytes uncompressed gradients would cost on that
transport over the bytes sent; below 1x where a transport ships more than the dense gradient, e.g. whole
blocks or every worker's payload; docs/transports.md, "Bytes on the wire").

Output: a progress bar per run, a table per task, ``demo.png`` (held-out loss vs training step, with a
scheme's coinciding transports drawn once, and vs modelled time; bytes per step; modelled time per step at
both bandwidths), per-step CSVs, and one wandb run per configuration (``WANDB_MODE``: ``offline`` by
default, ``disabled`` writes nothing); the last lines on stdout are one ``final task=... scheme=...
transport=... train_loss=... ...`` per configuration that ran, for scripts.

    python -m experiments.demo                  # the full demo
    python -m experiments.demo --tiny           # every cell at 2 workers, 2 steps
    python -m experiments.demo --docs           # also refresh docs/demo.png (the picture in docs/theory.md)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .common import config as C
from .common import cli, plots, report, tracking, train

TASKS = ("recsys-zipf", "digits-mlp")
TRANSPORTS = ("ring", "omnireduce", "switch", "sparse-switch", "allgather")
BANDWIDTHS = (10.0, 100.0)
LATENCY_US = 2.0
WORKERS = 8
BLOCK_SIZE = 256
EVAL_EVERY = 5
#: where ``--docs`` copies the figure (the picture in docs/theory.md; run it from the repository root)
DOCS = Path("docs")
DEFAULT_OUT = tracking.OUT_ROOT / "demo"


@dataclass(frozen=True)
class Scheme:
    """A compression scheme of the demo: a method around a compressor, with hyper-parameters."""

    name: str
    compressor: str
    method: str = "none"
    compressor_kw: dict[str, Any] = field(default_factory=dict)
    #: multiplies the task's learning rate (the noisy unbiased schemes need a smaller step)
    lr_factor: float = 1.0


SCHEMES = (
    Scheme("none", "identity"),
    Scheme("top-k + EF", "topk", "ef", {"ratio": 0.01}),
    # rand-k's variance (omega = d/k - 1 = 3; shared-seed, so it does not shrink with n) needs a
    # smaller step: at the task's lr, DIANA + rand-k diverges on recsys-zipf
    Scheme("DIANA + rand-k", "randk", "diana", {"ratio": 0.25}, lr_factor=0.25),
    Scheme("QSGD", "qsgd", "none", {"levels": 4}),
)
#: transport settings of the demo: the switch uses the P4 program's larger packets (256 elements).
TRANSPORT_KW = {"switch": {"slot_elems": 256}}
#: per-task overrides. The switch emulation costs Python time per packet; on recsys-zipf (~200 packets
#: per worker per step) 8 packets share one simulated message (``burst``), so the emulation handles a
#: message per 8 packets. The price is modelled time: a message is padded to 8 rows when fewer packets
#: are ready, and the padding's bytes cross the modelled links.
TASK_TRANSPORT_KW = {("recsys-zipf", "switch"): {"burst": 8}}


@dataclass
class Cell:
    task: str
    scheme: Scheme
    transport: str
    cfg: C.RunConfig | None          # None: the library rejects the pair
    reason: str | None = None
    results: dict[float, train.RunResult] = field(default_factory=dict)

    @property
    def diverged(self) -> str | None:
        """The library's message if the model diverged (at any bandwidth: training is the same)."""
        return next((r.summary["diverged"] for r in self.results.values() if "diverged" in r.summary), None)


def plan(tasks_: tuple[str, ...], schemes: tuple[Scheme, ...], transports: tuple[str, ...], *,
         steps: int | None, workers: int, seed: int, eval_every: int = EVAL_EVERY) -> list[Cell]:
    """Every (task, scheme, transport) cell, validated before anything runs.

    Unknown names and bad settings raise here; an incompatible compressor x transport pair becomes a
    cell without a config, carrying the library's message.
    """
    cells = []
    for task in tasks_:
        for s in schemes:
            for t in transports:
                tkw = {**TRANSPORT_KW.get(t, {}), **TASK_TRANSPORT_KW.get((task, t), {})}
                base = C.RunConfig(task=task, compressor=s.compressor, method=s.method, transport=t,
                                   compressor_kw=dict(s.compressor_kw), transport_kw=tkw, workers=workers,
                                   steps=steps, eval_every=eval_every, block_size=BLOCK_SIZE, seed=seed,
                                   bandwidth_gbps=BANDWIDTHS[0], latency_us=LATENCY_US)
                reason = C.incompatibility(base)
                if reason is not None:
                    cells.append(Cell(task, s, t, None, reason))
                    continue
                cfg = C.validate(base)
                cells.append(Cell(task, s, t, replace(cfg, lr=cfg.lr * s.lr_factor)))
    return cells


def run_cells(cells: list[Cell], bandwidths: tuple[float, ...], *, progress: bool) -> None:
    todo = [c for c in cells if c.cfg is not None]
    bar = tracking.progress(desc="demo", total=len(todo) * len(bandwidths), enabled=progress, unit="run")
    for c in todo:
        for bw in bandwidths:
            bar.set_description(f"demo: {c.task} | {c.scheme.name} / {c.transport} @ {bw:g} Gbps")
            c.results[bw] = train.run(replace(c.cfg, bandwidth_gbps=bw), progress=progress)
            bar.update(1)
            if c.diverged:  # training does not depend on the bandwidth
                bar.update(len(bandwidths) - len(c.results))
                break
    bar.close()


def merged_records(c: Cell, bandwidths: tuple[float, ...]) -> list[dict[str, Any]]:
    """The first bandwidth's per-step records plus each bandwidth's modelled times (``..._10gbps``)."""
    recs = [dict(r) for r in c.results[bandwidths[0]].records]
    for bw in bandwidths:
        for r, other in zip(recs, c.results[bw].records):
            r[f"modelled_comm_s_{bw:g}gbps"] = other["modelled_comm_s"]
            r[f"modelled_time_s_{bw:g}gbps"] = other["modelled_time_s"]
    return recs


def save_cell(c: Cell, out: Path, group: str, *, wandb: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Write a cell's per-step CSV and wandb run; return its summary row and its figure entry."""
    head = {"task": c.task, "scheme": c.scheme.name, "transport": c.transport}
    if c.cfg is None:
        return {**head, "incompatible": c.reason}, None
    if c.diverged:
        return {**head, "diverged": c.diverged}, None
    recs = merged_records(c, BANDWIDTHS)
    res = c.results[BANDWIDTHS[0]]
    summ = dict(res.summary)
    for bw in BANDWIDTHS:
        summ[f"modelled_comm_per_step_s_{bw:g}gbps"] = comm_per_step(c, bw)
    stem = f"{c.task}__{C.slug(c.cfg.scheme)}__{c.transport}"
    tracking.write_csv(out / "csv" / f"{stem}.csv", recs)
    conf = {**c.cfg.as_dict(), "scheme": c.scheme.name, "bandwidths_gbps": list(BANDWIDTHS),
            "modelled_time_source": "SimFabric virtual clock"}
    tracking.log_run(recs, summ, conf, name=f"{c.task} | {c.scheme.name} / {c.transport}", group=group,
                     wandb_dir=out, job_type="demo", enabled=wandb)
    entry = {"scheme": c.scheme.name, "transport": c.transport, "records": res.records,
             "initial": res.initial, "summary": summ,
             "comm_per_step": {bw: comm_per_step(c, bw) for bw in BANDWIDTHS}}
    return {**head, **summ}, entry


def comm_per_step(c: Cell, bw: float) -> float:
    return c.results[bw].summary["modelled_comm_per_step_s"]


def _compression_factor(s: dict) -> str:
    """The compression factor measured on the wire (``compression_stats()["compression_factor_sent"]``)."""
    v = s.get("compression_factor_sent", float("nan"))
    return f"{v:.3g}x" if v == v else "-"


def print_tables(cells: list[Cell], bandwidths: tuple[float, ...]) -> str:
    lo, hi = bandwidths[0], bandwidths[-1]
    headers = ["scheme", "transport", "final loss", "accuracy", "bytes/worker/step",
               "compression factor", "block density (worker/union)", f"comm/step @{lo:g}G", f"@{hi:g}G",
               f"speed-up @{lo:g}G", f"@{hi:g}G"]
    out = []
    notes: list[str] = []
    for task in dict.fromkeys(c.task for c in cells):
        tc = [c for c in cells if c.task == task]
        base = next((c for c in tc if c.cfg is not None and not c.diverged
                     and c.scheme.compressor == "identity" and c.transport == "ring"), None)
        rows: list[Any] = []
        for c in tc:
            if c.cfg is None:
                notes.append(f"{c.scheme.name} / {c.transport}: {c.reason}")
                rows.append((c.scheme.name, c.transport,
                             f"n/a (incompatible: {report.first_sentence(c.reason)})"))
                continue
            if c.diverged:
                rows.append((c.scheme.name, c.transport, f"diverged: {report.first_sentence(c.diverged)}"))
                continue
            s = c.results[lo].summary
            speed = []
            for bw in (lo, hi):
                ref = comm_per_step(base, bw) if base is not None else float("nan")
                mine = comm_per_step(c, bw)
                speed.append(f"{ref / mine:.2f}x" if mine > 0 else "-")
            rows.append((c.scheme.name, c.transport, report.fmt_num(s["final_test_loss"]),
                         report.fmt_num(s["final_test_acc"]), report.fmt_bytes(s["bytes_per_step"]),
                         _compression_factor(s),
                         f"{s['block_density']:.3f} / {s['block_density_union']:.3f}",
                         report.fmt_time(comm_per_step(c, lo)), report.fmt_time(comm_per_step(c, hi)),
                         speed[0], speed[1]))
        cfg0 = next(c.cfg for c in tc if c.cfg is not None)
        settings = {f"{c.transport}({', '.join(f'{k}={v}' for k, v in c.cfg.transport_kw.items())})"
                    for c in tc if c.cfg is not None and c.cfg.transport_kw}
        out.append(f"\n{task}: {cfg0.workers} workers, {cfg0.steps} steps, batch {cfg0.batch_size}/worker, "
                   f"block {cfg0.block_size}" + (f", {', '.join(sorted(settings))}" if settings else "")
                   + f"; times modelled by the SimFabric ({LATENCY_US:g} us latency)\n"
                   + report.table(headers, rows))
    text = "\n".join(out)
    if notes:
        text += "\n\nIncompatible pairs (the library's message):\n" + "\n".join(
            f"  - {n}" for n in dict.fromkeys(notes))
    print(text)
    return text


def contents(workers: int) -> dict[str, Any]:
    """What the figure shows, written into the PNG (``Description``): tests compare the picture in docs/theory.md
    (``docs/demo.png``) with the demo as it is."""
    return {"tasks": list(TASKS), "schemes": [s.name for s in SCHEMES], "transports": list(TRANSPORTS),
            "bandwidths_gbps": list(BANDWIDTHS), "workers": workers}


def main(argv: list[str] | None = None) -> int:
    p = cli.base_parser("python -m experiments.demo", __doc__,
                        out_help=f"output folder: CSV, PNG, wandb runs (default {DEFAULT_OUT})")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the task's)")
    p.add_argument("--tiny", action="store_true",
                   help="smoke size: every cell at 2 steps, 2 workers, evaluated every step")
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--docs", action="store_true", help="also copy the figure to docs/demo.png")
    args = p.parse_args(argv)
    steps, workers, eval_every = args.steps, args.workers, EVAL_EVERY
    if args.tiny:
        steps, workers, eval_every = steps or 2, min(workers, 2), 1
    train.set_cpu_threads()
    t0 = time.perf_counter()
    try:
        cells = plan(TASKS, SCHEMES, TRANSPORTS, steps=steps, workers=workers, seed=args.seed,
                     eval_every=eval_every)
    except (C.ConfigError, C.UnknownNameError, C.IncompatibleError) as e:
        print(f"demo: invalid configuration: {e}", file=sys.stderr)
        return 2
    nrun = sum(c.cfg is not None for c in cells)
    print(f"sparsecomm demo: {len(TASKS)} tasks x {len(SCHEMES)} schemes x {len(TRANSPORTS)} transports "
          f"-> {nrun} runs x {len(BANDWIDTHS)} network models ({', '.join(f'{b:g}' for b in BANDWIDTHS)} "
          f"Gbps), {workers} simulated workers each; {len(cells) - nrun} pairs rejected by the library")
    run_cells(cells, BANDWIDTHS, progress=not args.no_progress)

    out: Path = args.out or DEFAULT_OUT
    group = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    by_task: dict[str, list[dict]] = {}
    summary_rows = []
    for c in cells:
        row, entry = save_cell(c, out, group, wandb=not args.no_wandb)
        summary_rows.append(row)
        if entry is not None:
            by_task.setdefault(c.task, []).append(entry)
    tracking.write_csv(out / "summary.csv", summary_rows)
    text = print_tables(cells, BANDWIDTHS)
    (out / "table.txt").write_text(text.lstrip() + "\n")
    png = plots.save(plots.demo_figure(by_task, BANDWIDTHS,
                                       title=f"sparsecomm demo: {workers} simulated workers; modelled times from "
                                             f"the SimFabric ({', '.join(f'{b:g}' for b in BANDWIDTHS)} Gbps, "
                                             f"{LATENCY_US:g} µs latency)"),
                     out / "demo.png", description=json.dumps(contents(workers)))
    if args.docs:
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(png, DOCS / "demo.png")
    print(f"\nplot: {png}" + (f" (copied to {DOCS / 'demo.png'})" if args.docs else ""))
    print(f"per-step CSVs: {out / 'csv'}; summary: {out / 'summary.csv'}")
    tracking.print_sync_hint(out, enabled=not args.no_wandb)
    print(f"total time: {time.perf_counter() - t0:.0f} s")
    for c, row in zip(cells, summary_rows):     # last on stdout: one parseable line per run
        if c.cfg is not None and not c.diverged:
            print(tracking.metrics_line(row, {"task": c.task, "scheme": c.scheme.name, "transport": c.transport}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
