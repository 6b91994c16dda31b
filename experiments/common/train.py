"""The worker training loop shared by the demo, the convergence runs and the ablations.

:func:`run` trains ``cfg.task`` on ``cfg.workers`` workers (``sc.launch``: threads over a SimFabric,
or torch.distributed processes) with ``sc.DistributedOptimizer`` and returns per-step records:

==========================  ==================================================================
``loss``                    training loss of the step's mini-batches, mean over workers
``grad_norm``               norm of the local (uncompressed) gradient, mean over workers
``block_density``           fraction of ``block_size`` blocks of the flat local gradient (parameters
                            in optimizer order) holding a non-zero (``sc.codec.nonzero_blocks``),
                            mean over workers: what a worker sends upstream in OmniReduce
``block_density_union``     the same for the union over workers: what OmniReduce sends downstream
``bytes_sent``, ``bits_sent``, ``bytes_received``, ``messages``
                            this step's traffic per worker (``opt.last_stats``, the fabric's ledger),
                            mean over workers
``modelled_comm_s``         this step's modelled communication time: the advance of the slowest
                            worker's SimFabric clock (no compute is modelled, so the clock only moves
                            in the collectives); 0 on real fabrics
``modelled_time_s``         cumulative modelled time (the slowest worker's clock)
``measured_comm_s``         wall-clock time of the step's collectives, slowest worker
``test_loss``, ``test_acc`` held-out loss and accuracy (worker 0's model; every ``eval_every`` steps)
==========================  ==================================================================
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import sparsecomm as sc
from sparsecomm.errors import NonFiniteError

from . import tasks, tracking
from .config import RunConfig

STEP_COLUMNS = ["step", "loss", "test_loss", "test_acc", "grad_norm", "block_density",
                "block_density_union", "bytes_sent", "bits_sent", "bytes_received", "messages",
                "modelled_comm_s", "modelled_time_s", "measured_comm_s"]


@dataclass
class RunResult:
    config: RunConfig
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    wall_s: float
    #: the held-out evaluation before training (``step`` 0, ``modelled_time_s`` 0)
    initial: dict[str, Any] = field(default_factory=dict)
    #: what theory allows (``opt.step_size_hint``): ``text``, and ``scale`` / ``iid_scale``, the factors on a
    #: learning rate that suits uncompressed training (``None`` where theory gives none)
    step_size_hint: dict[str, Any] | None = None


def get_task(name: str, seed: int) -> tasks.Task:
    """The task, built once per process (simulated workers share its read-only data): :func:`tasks.get`."""
    return tasks.get(name, seed=seed)


def _worker(cfg: RunConfig, progress: bool, ctx) -> dict[str, Any]:
    task = get_task(cfg.task, cfg.seed)
    model = task.build_model()
    inner = torch.optim.SGD(task.param_groups(model, cfg.lr), lr=cfg.lr)
    opt = sc.DistributedOptimizer(inner, compressor=cfg.compressor, method=cfg.method,
                                  transport=cfg.transport, transport_kwargs=cfg.transport_kwargs(),
                                  seed=cfg.seed, warmup_steps=cfg.warmup_steps,
                                  **cfg.compressor_kw, **cfg.method_kw)
    params = [p for g in inner.param_groups for p in g["params"]]
    rank, n = ctx.rank, ctx.world_size
    bar = tracking.progress(desc=f"  {cfg.label}", total=cfg.steps, enabled=progress and rank == 0,
                            unit="step", leave=False)
    rows, masks = [], []
    diverged = None
    initial = {}
    if rank == 0:
        loss0, acc0 = task.evaluate(model)
        initial = {"step": 0, "test_loss": loss0, "test_acc": acc0, "modelled_time_s": 0.0}
    try:
        for step in range(1, cfg.steps + 1):
            batch = task.batch(rank, n, step, cfg.batch_size)
            opt.zero_grad()
            loss = task.loss(model, batch)
            loss.backward()
            with torch.no_grad():
                flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                  for p in params])
                mask = sc.codec.nonzero_blocks(flat, cfg.block_size)
                grad_norm = float(flat.norm())
            opt.step()
            st = opt.last_stats
            row = {"step": step, "loss": loss.item(), "grad_norm": grad_norm,
                   "block_density": float(mask.float().mean()),
                   "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                   "messages": st.messages, "clock": float(ctx.fabric.now()) if ctx.backend == "sim" else 0.0,
                   "measured_comm_s": st.wall_time_s}
            masks.append(np.packbits(mask.numpy().astype(bool)))
            if rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                row["test_loss"], row["test_acc"] = task.evaluate(model)
            rows.append(row)
            bar.update(1)
            if "test_acc" in row:
                bar.set_postfix_str(f"loss={row['test_loss']:.3f}, acc={row['test_acc']:.3f}")
    except NonFiniteError as e:  # raised alike on every worker: keep the steps before it
        diverged = f"at step {len(rows) + 1}: {str(e).splitlines()[0]}"
    finally:
        bar.close()
    h = opt.step_size_hint
    return {"rank": rank, "rows": rows, "masks": masks,
            "nblocks": int(mask.numel()) if rows else 0, "initial": initial,
            "compression": opt.compression_stats(), "diverged": diverged,
            "step_size_hint": {"text": str(h), "scale": h.scale, "iid_scale": h.iid_scale}}


def services_for(cfg: RunConfig, workers: int | None = None) -> list[str]:
    """The service ranks a torch.distributed launch must start for ``cfg``'s transport: the switch
    program (``sparsecomm.transports.switchml.dataplane.SwitchConfig.spec``) or dedicated OmniReduce
    aggregators (``omnireduce-agg:i``). On the SimFabric the transports start their own services."""
    kw = cfg.transport_kwargs()
    if cfg.transport == "switch":
        from sparsecomm.transports.switchml.dataplane import SwitchConfig

        names = {"slot_elems": "elems", "switch_slots": "slots", "burst": "burst"}
        return [SwitchConfig(**{names[k]: v for k, v in kw.items() if k in names and v is not None}).spec()]
    if cfg.transport == "omnireduce" and kw.get("deployment") == "dedicated":
        return [f"omnireduce-agg:{i}" for i in range(kw.get("num_aggregators") or workers or cfg.workers)]
    return []


def run(cfg: RunConfig, *, progress: bool = False) -> RunResult:
    """Train ``cfg`` (validated and resolved by the caller) and aggregate the per-rank records.

    A run whose model diverges (a compressor or transport refuses NaN/Inf, on every worker alike) returns
    the records of the steps before it and ``"diverged"`` (the step and the library's message) in its
    summary; :attr:`RunResult.step_size_hint` is what theory allows.
    """
    fn = functools.partial(_worker, cfg, progress)
    t0 = time.perf_counter()
    try:
        if cfg.backend == "sim":
            network = sc.Network(bandwidth_gbps=cfg.bandwidth_gbps, latency_us=cfg.latency_us,
                                 loss=cfg.loss, seed=cfg.seed)
            per_rank = sc.launch(fn, cfg.workers, backend="sim", network=network)
        else:
            per_rank = sc.launch(fn, cfg.workers, backend=cfg.backend, services=services_for(cfg))
    except NonFiniteError as e:  # the model diverged: a result of the study, not a failure of it
        return RunResult(cfg, [], {"diverged": str(e).splitlines()[0]}, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    per_rank = [r for r in per_rank if r is not None]
    diverged = next((r["diverged"] for r in per_rank if r.get("diverged")), None)
    records = aggregate(per_rank) if per_rank and per_rank[0]["rows"] else []
    initial = next((r["initial"] for r in per_rank if r["rank"] == 0), {})
    summary = summarize(records, per_rank) if records else {}
    if diverged:
        summary["diverged"] = diverged
    return RunResult(cfg, records, summary, wall, initial, per_rank[0]["step_size_hint"] if per_rank else None)


def aggregate(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-step records over workers (means of per-worker quantities, the slowest clock)."""
    ranks = sorted(per_rank, key=lambda r: r["rank"])
    nsteps = min(len(r["rows"]) for r in ranks)
    nblocks = ranks[0]["nblocks"]
    out, prev_clock = [], 0.0
    for i in range(nsteps):
        rows = [r["rows"][i] for r in ranks]
        union = np.bitwise_or.reduce([r["masks"][i] for r in ranks])
        clock = max(r["clock"] for r in rows)
        rec = {"step": rows[0]["step"]}
        for k in ("loss", "grad_norm", "block_density", "bytes_sent", "bytes_received", "messages"):
            rec[k] = float(np.mean([r[k] for r in rows]))
        rec["bits_sent"] = 8.0 * rec["bytes_sent"]
        rec["block_density_union"] = float(np.unpackbits(union)[:nblocks].mean())
        rec["modelled_comm_s"] = clock - prev_clock
        rec["modelled_time_s"] = clock
        rec["measured_comm_s"] = max(r["measured_comm_s"] for r in rows)
        prev_clock = clock
        for k in ("test_loss", "test_acc"):
            if k in rows[0]:
                rec[k] = rows[0][k]
        out.append(rec)
    return out


def summarize(records: list[dict[str, Any]], per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run-level numbers: final held-out loss/accuracy, and per-step means of the traffic and times."""
    evals = [r for r in records if "test_acc" in r]
    tail = records[-max(1, len(records) // 10):]
    mean = lambda k: float(np.mean([r[k] for r in records]))  # noqa: E731
    s = {"final_test_loss": evals[-1]["test_loss"] if evals else float("nan"),
         "final_test_acc": evals[-1]["test_acc"] if evals else float("nan"),
         "final_train_loss": float(np.mean([r["loss"] for r in tail])),
         "steps": len(records),
         "bytes_per_step": mean("bytes_sent"), "bytes_received_per_step": mean("bytes_received"),
         "messages_per_step": mean("messages"),
         "block_density": mean("block_density"), "block_density_union": mean("block_density_union"),
         "modelled_comm_per_step_s": mean("modelled_comm_s"),
         "modelled_time_s": records[-1]["modelled_time_s"] if records else 0.0,
         "measured_comm_per_step_s": mean("measured_comm_s")}
    if per_rank:
        comp = per_rank[0].get("compression") or {}
        # declared (the compressor's bits) and measured (the fabric's ledger) side by side
        s["compression_factor"] = comp.get("compression_factor", float("nan"))
        s["compression_factor_sent"] = comp.get("compression_factor_sent", float("nan"))
        s["sent_over_declared"] = comp.get("sent_over_declared", float("nan"))
    return s


def first_reaching(records: list[dict[str, Any]], target: float, key: str = "test_acc") -> dict | None:
    """The first evaluated record whose ``key`` reaches ``target`` (``None`` if never)."""
    for r in records:
        if key in r and r[key] >= target:
            return r
    return None


def cumulative_bytes(records: list[dict[str, Any]], upto_step: int) -> float:
    return float(sum(r["bytes_sent"] for r in records if r["step"] <= upto_step))


def set_cpu_threads() -> None:
    """One intra-op thread per process: the simulated workers are the parallelism (call from mains)."""
    torch.set_num_threads(int(os.environ.get("SPARSECOMM_TORCH_THREADS", "1")))
