"""The command line every study shares: :func:`base_parser` (the demo, the convergence runs, the ablations
and, through :func:`.reproduce.parser`, the paper reproductions) and :func:`add_common` (a training run's
settings, for the convergence runs and the ablations)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import sparsecomm as sc

from . import config as C
from . import tasks


#: the ``--task`` option's help: the bundled names and a researcher's own ``module:attr``
TASK_HELP = ("recsys-zipf | digits-mlp | breast-cancer-logreg, or module:function naming your own "
             "build(seed) -> TaskSpec (e.g. my_task.tasks:build; docs/your-own-task.md)")


def base_parser(prog: str, doc: str | None, *, out_help: str = "output folder") -> argparse.ArgumentParser:
    """A parser with the options every study takes: ``--out``, ``--seed``, ``--no-progress``,
    ``--no-wandb``."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help=out_help)
    o.add_argument("--seed", type=int, default=0,
                   help="seed of data, model and compressors (runs are reproducible)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--no-wandb", action="store_true", help="do not log to wandb (also: WANDB_MODE=disabled)")
    return p


def add_seeds(p: argparse.ArgumentParser, *, default: int | None = 1, help: str | None = None) -> None:
    """``--seeds K``: repeat every run for the seeds ``--seed``, ``--seed + 1``, ..., ``--seed + K - 1``
    (:func:`seed_list`); tables show mean +- std over them, figures the mean with a band. ``default`` and
    ``help`` replace the usual ones where a study runs several seeds by default or repeats only some of
    its parts (``default=None``: the study picks the count itself)."""
    p.add_argument("--seeds", type=int, default=default, metavar="K",
                   help=help or "repeat each run for K seeds (--seed, --seed+1, ...): tables show mean ± std, "
                                "plots the mean with a ± std band (default 1)")


def seed_list(args: argparse.Namespace) -> list[int]:
    """The seeds ``--seed`` and ``--seeds`` name; a ``--seeds`` below 1 raises ConfigError."""
    k = int(args.seeds)
    if k < 1:
        raise C.ConfigError(f"--seeds must be a positive integer (the number of seeds to run), got {k}")
    return [int(args.seed) + i for i in range(k)]


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every training study takes (on a :func:`base_parser`): the run's fixed settings, the
    network and wandb's project and group."""
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the task's)")
    g.add_argument("--batch-size", type=int, default=None, help="mini-batch per worker (default: the task's)")
    g.add_argument("--lr", type=float, default=None, help="learning rate of the inner SGD (default: the task's)")
    g.add_argument("--warmup-steps", type=int, default=0, help="first steps sent uncompressed")
    g.add_argument("--eval-every", type=int, default=10, help="held-out evaluation period (steps)")
    g.add_argument("--compressor-arg", action="append", metavar="KEY=VALUE", default=[],
                   help="compressor hyper-parameter, repeatable (e.g. levels=8)")
    g.add_argument("--method-arg", action="append", metavar="KEY=VALUE", default=[],
                   help="method hyper-parameter, repeatable (e.g. alpha=0.1, init=grad)")
    g.add_argument("--transport-arg", action="append", metavar="KEY=VALUE", default=[],
                   help="transport hyper-parameter, repeatable")
    n = p.add_argument_group("network / backend")
    n.add_argument("--backend", choices=C.BACKENDS, default="sim",
                   help="sim: threads over a SimFabric (modelled network); gloo: real torch.distributed "
                        "processes (also used automatically under torchrun)")
    n.add_argument("--bandwidth-gbps", type=float, default=100.0, help="SimFabric link bandwidth")
    n.add_argument("--latency-us", type=float, default=2.0, help="SimFabric per-message latency")
    n.add_argument("--loss", type=float, default=0.0, help="SimFabric datagram loss probability")
    o = p.add_argument_group("wandb")
    o.add_argument("--project", default="sparsecomm", help="wandb project")
    o.add_argument("--group", default=None, help="wandb group")
    o.add_argument("--list", action="store_true", help="list tasks, compressors, methods, transports and exit")


def fixed_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields the common options set."""
    return {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "warmup_steps": args.warmup_steps, "eval_every": args.eval_every, "seed": args.seed,
            "compressor_kw": C.parse_kv(args.compressor_arg), "method_kw": C.parse_kv(args.method_arg),
            "transport_kw": C.parse_kv(args.transport_arg), "backend": args.backend,
            "bandwidth_gbps": args.bandwidth_gbps, "latency_us": args.latency_us, "loss": args.loss}


def list_components() -> str:
    """What can be named on the command line, with the payload kind and carrying transports."""
    lines = ["tasks (or module:function naming your own build(seed) -> TaskSpec):"]
    for name in tasks.available():
        lines.append(f"  {name:22s} {tasks.registry.factory(name).describe()}")
    lines.append("compressors (payload kind -> transports that carry it):")
    tnames = sc.transports.available()
    for name in sc.compressors.available():
        f = sc.compressors.registry.product(name)
        kind, shared = getattr(f, "payload_kind", "?"), bool(getattr(f, "shared_scale", False))
        ok = [t for t in tnames if sc.transports.registry.factory(t).can_carry(kind, shared)]
        lines.append(f"  {name:22s} {kind:10s} -> {', '.join(ok) or 'none registered'}")
    lines.append(f"methods: {', '.join(sc.methods.available())}")
    lines.append(f"transports: {', '.join(tnames) or 'none registered'}")
    return "\n".join(lines)
