"""A researcher's own task (``--task module:function``, ``docs/your-own-task.md``): the guide's example project
runs through the convergence CLI from outside the repository; a task that does not import or builds the wrong
thing stops the study with one line naming what is wrong; ``--seeds`` gives mean and std."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

from experiments import ablation, convergence  # noqa: E402
from experiments.common import plots, tasks  # noqa: E402

from tests._figures import problems  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs/your-own-task.md"
EXAMPLE = ROOT / "docs" / "examples" / "my_task"


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _guide_command() -> list[str]:
    """The guide's first convergence command on the example task (the one a reader runs first)."""
    for line in GUIDE.read_text().splitlines():
        if line.startswith("python -m sparsecomm.experiments.convergence --task my_task.tasks:build"):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"{GUIDE} shows no convergence command on my_task.tasks:build")


def _run_outside(tmp_path: Path, extra: list[str]) -> subprocess.CompletedProcess:
    project = tmp_path / "my_task"
    shutil.copytree(EXAMPLE, project)
    cmd = _guide_command()
    assert cmd[:3] == ["python", "-m", "sparsecomm.experiments.convergence"], cmd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]), "WANDB_MODE": "disabled",
           "SPARSECOMM_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *cmd[1:], *extra], cwd=project, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.multiprocess
def test_the_guides_project_runs_outside_the_tree_on_real_processes(tmp_path):
    """The example project, copied out of the repository, trains its own task on 2 ranks through the CLI
    the guide shows: a CSV with one row per step and a PNG. Under gloo every process imports the
    researcher's module and builds the task itself (one run covers both: a rank that could not import the
    module would stop the study)."""
    proc = _run_outside(tmp_path, ["--backend", "gloo", "--steps", "6", "--eval-every", "3", "--no-progress",
                                   "--out", "runs"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on teacher-mlp: 2 workers" in proc.stdout, proc.stdout
    runs = tmp_path / "my_task" / "runs"
    stem = "teacher-mlp_none_ring_n2_s0"
    with open(runs / f"{stem}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert all(float(r["loss"]) > 0 for r in rows) and rows[-1]["test_acc"] != ""
    assert json.loads((runs / f"{stem}.json").read_text())["config"]["task"] == "my_task.tasks:build"
    assert (runs / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- clear errors
GOOD = textwrap.dedent('''
    import torch
    from torch import nn
    from sparsecomm.experiments.common.tasks import TaskSpec

    X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    Y = (X.sum(1) > 0).long()

    def model():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Linear(4, 2)

    def batch(rank, world, step, bs):
        return X[rank::world][:bs], Y[rank::world][:bs]

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    def evaluate(m):
        out = m(X)
        return nn.functional.cross_entropy(out, Y).item(), (out.argmax(1) == Y).float().mean().item()

    def spec(**kw):
        return TaskSpec(**{"name": "tiny", "model": model, "batch": batch, "loss": loss, "evaluate": evaluate,
                           "lr": 0.1, "steps": 2, "batch_size": 8, **kw})

    def build(seed):
        return spec()
''')

BAD = {
    "nomodule_xyz:build": "cannot import module 'nomodule_xyz'",
    "{mod}:biuld": "has no attribute 'biuld'",
    "{mod}:X": "is a Tensor, not a function build(seed) -> TaskSpec",
    "{mod}:returns_dict": "returned dict, expected a TaskSpec",
    "{mod}:raises": "raises(seed=0) raised RuntimeError: no data here",
    "{mod}:bad_lr": "TaskSpec.lr must be a positive number, got -1",
    "{mod}:not_callable": "TaskSpec.loss must be callable",
    "{mod}:random_init": "two calls of model() returned different initial weights",
    "{mod}:vector_loss": "loss(model, batch) returned a tensor of shape (8,), expected a scalar float tensor",
    "{mod}:bad_eval": "evaluate(model) returned 0.5, expected two numbers (held_out_loss, metric)",
    "{mod}:not_a_module": "model() returned function, expected a torch.nn.Module",
    "bundled-typo": "unknown task 'bundled-typo'; valid names: breast-cancer-logreg",
}
BAD_DEFS = textwrap.dedent('''
    def returns_dict(seed):
        return {"model": model}

    def raises(seed):
        raise RuntimeError("no data here")

    def bad_lr(seed):
        return spec(lr=-1)

    def not_callable(seed):
        return spec(loss=3)

    def random_init(seed):
        return spec(model=lambda: nn.Linear(4, 2))

    def vector_loss(seed):
        return spec(loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"))

    def bad_eval(seed):
        return spec(evaluate=lambda m: 0.5)

    def not_a_module(seed):
        return spec(model=lambda: model)
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    name = f"user_task_{request.node.name.split('[')[-1].strip(']').replace('-', '_').replace(':', '_')}"
    name = re.sub(r"\W", "_", name)
    (tmp_path / f"{name}.py").write_text(GOOD + BAD_DEFS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("ref, words", sorted(BAD.items()))
def test_a_task_that_does_not_build_is_one_line(ref, words, user_module, capsys):
    ref = ref.format(mod=user_module)
    with pytest.raises(SystemExit) as e:
        convergence.main(["--task", ref, "--workers", "2", "--no-progress", "--no-wandb"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert words in err, err
    if ":" in ref:
        assert f"task {ref!r}" in err, err


def test_the_same_task_in_an_ablation_grid(user_module, tmp_path, capsys):
    assert ablation.main(["--task", f"{user_module}:build", "--compressor", "identity", "topk",
                          "--transport", "allgather", "--workers", "2", "--density", "0.5", "--dry-run",
                          "--out", str(tmp_path / "grid")]) == 0
    out = capsys.readouterr().out
    assert "ablation 'ablation-tiny'" in out and "2 cells to run" in out, out


def test_the_task_is_built_once_per_seed(user_module):
    a, b = tasks.get(f"{user_module}:build", 0), tasks.get(f"{user_module}:build", 0)
    assert a is b and a.name == "tiny" and (a.steps, a.batch_size, a.lr) == (2, 8, 0.1)
    assert tasks.defaults(f"{user_module}:build") == (2, 8, 0.1)
    assert tasks.get(f"{user_module}:build", 1) is not a


# ----------------------------------------------------------------------------- --seeds
def test_seeds_give_mean_and_std(tmp_path, capsys, monkeypatch):
    figures = {}
    real = plots.save

    def keep(fig, path, **kw):
        figures[path.name] = fig
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save", keep)
    argv = ["--task", "breast-cancer-logreg", "--compressor", "topk", "--ratio", "0.3", "--method", "ef", "--transport",
            "allgather", "--workers", "2", "--steps", "4", "--eval-every", "2", "--no-progress",
            "--out", str(tmp_path), "--seeds", "3", "--seed", "5"]
    assert convergence.main(argv) == 0
    base = "breast-cancer-logreg_ef-topk-ratio-0.3_allgather_n2"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"{base}_s{s}.{ext}" for s in (5, 6, 7) for ext in ("csv", "json")]
                           + [f"{base}_s5-7.{ext}" for ext in ("csv", "json", "png")])
    per_seed = []
    for s in (5, 6, 7):
        with open(tmp_path / f"{base}_s{s}.csv") as f:
            per_seed.append([float(r["loss"]) for r in csv.DictReader(f)])
    assert len({tuple(v) for v in per_seed}) == 3, "the seeds trained identically"
    with open(tmp_path / f"{base}_s5-7.csv") as f:
        agg = list(csv.DictReader(f))
    losses = np.array(per_seed)
    np.testing.assert_allclose([float(r["loss_mean"]) for r in agg], losses.mean(0), rtol=1e-12)
    np.testing.assert_allclose([float(r["loss_std"]) for r in agg], losses.std(0, ddof=1), rtol=1e-12)
    summary = json.loads((tmp_path / f"{base}_s5-7.json").read_text())
    acc = summary["summary"]["final_test_acc"]
    assert summary["seeds"] == [5, 6, 7] and len(acc["per_seed"]) == 3
    assert acc["mean"] == pytest.approx(np.mean(acc["per_seed"]))
    out = capsys.readouterr().out
    assert "final held-out accuracy" in out and "±" in out and "mean ± std over 3 seeds" in out
    fig = figures[f"{base}_s5-7.png"]
    assert problems(fig) == []
    ax_l = fig.axes[0]
    assert ax_l.collections, "no band drawn around the mean"
    assert any("mean ± std of 3 seeds" in t.get_text() for t in ax_l.get_legend().get_texts())


def test_seeds_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        convergence.main(["--task", "breast-cancer-logreg", "--seeds", "0", "--no-progress"])
    assert e.value.code == 2 and "--seeds must be a positive integer" in capsys.readouterr().err


def test_an_ablation_over_seeds_keeps_each_seed_and_shows_mean_and_std(tmp_path, capsys, monkeypatch):
    from experiments.common import tracking

    figures = {}
    real = plots.save

    def keep(fig, path, **kw):
        figures[path.name] = fig
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save", keep)
    argv = ["--task", "breast-cancer-logreg", "--compressor", "topk", "--method", "ef", "--transport", "allgather",
            "--workers", "2", "3", "--density", "0.2", "--steps", "4", "--eval-every", "2", "--target-acc", "0.5",
            "--out", str(tmp_path), "--no-progress", "--seeds", "2", "--seed", "3"]
    assert ablation.main(argv) == 0
    records = tracking.read_jsonl(tmp_path / "results.jsonl")
    assert sorted((r["workers"], r["seed"]) for r in records) == [(2, 3), (2, 4), (3, 3), (3, 4)]
    table = (tmp_path / "summary.txt").read_text().splitlines()
    rows = [line for line in table if "ef+topk(ratio=0.2) / allgather" in line]
    assert len(rows) == 2 and all("±" in line and "(2/2)" in line for line in rows), table
    fig = figures["ablation.png"]
    assert problems(fig) == [] and fig.axes[0].collections, "no band over the seeds"
    capsys.readouterr()
    assert ablation.main(argv) == 0
    assert "resuming: 4 of 4 cells already" in capsys.readouterr().out
