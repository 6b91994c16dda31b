"""Every documented convergence command trains as written: its training loss falls and it exits 0.

The commands are read from where users read them (``python -m experiments.convergence --help``, i.e. the
module's docstring, and docs/theory.md). The fast case runs the example that used to diverge (QSGD without
memory over allgather, at the documented ``--lr``) at 2 workers, where the task's default lr 0.5 diverged;
the slow case runs each documented command as written (a torchrun line as the same ranks under
``--backend gloo``: the recipe's plumbing is tests/frontends/test_experiments_cli.py's)."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "experiments.convergence"


def documented_commands() -> list[list[str]]:
    """The convergence runs the docs give, as argument lists after the program (continuations joined;
    ``--list`` and ``--out`` dropped; a run of a researcher's own ``--task module:function`` needs that
    package, and tests/frontends/test_own_task.py runs it from the guide's example project)."""
    from experiments import convergence

    texts = [convergence.__doc__, (ROOT / "docs/theory.md").read_text()]
    out = []
    for text in texts:
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if PROGRAM not in line or "--list" in line:
                continue
            words = shlex.split(line)
            at = next(i for i, w in enumerate(words) if w.endswith(PROGRAM))
            args = words[at + 1:]
            if "--task" in args and ":" in args[args.index("--task") + 1]:
                continue
            if words[0] == "torchrun":      # one process per rank: the same run as gloo workers
                args += ["--backend", "gloo", "--workers", words[words.index("--nproc-per-node") + 1]]
            if "--out" in args:
                i = args.index("--out")
                del args[i:i + 2]
            out.append(args)
    return out


def _trains(args: list[str], tmp_path: Path) -> tuple[float, float]:
    """Run ``args`` in this process; (mean loss of the first 10 steps, of the last 10)."""
    from experiments import convergence

    assert convergence.main([*args, "--out", str(tmp_path), "--no-wandb", "--no-progress"]) == 0, args
    (path,) = tmp_path.glob("*.csv")
    loss = [float(r["loss"]) for r in csv.DictReader(path.open())]
    assert len(loss) >= 20, (args, len(loss))
    return sum(loss[:10]) / 10, sum(loss[-10:]) / 10


def test_the_commands_are_found():
    cmds = documented_commands()
    assert len(cmds) >= 5 and any("qsgd" in c for c in cmds) and any("--backend" in c for c in cmds)


def test_the_qsgd_example_trains_at_two_workers(tmp_path):
    """The gloo/torchrun example's settings (at its ``--lr``) on 2 simulated workers: with the task's lr 0.5
    it diverged (QSGD's omega ~ 57 on the embeddings' 40x step) and left a CSV of its header."""
    args = next(c for c in documented_commands() if "qsgd" in c and "gloo" in c)
    args[args.index("--backend") + 1] = "sim"
    args[args.index("--workers") + 1] = "2"
    first, last = _trains(args, tmp_path)
    assert last < first - 0.01, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("args", documented_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_documented_command_trains_as_written(args, tmp_path):
    first, last = _trains(args, tmp_path)
    assert last < first, (first, last)
