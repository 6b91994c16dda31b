"""The studies' shared plumbing (experiments/common/): one command line, one wandb.init, progress bars on every
long run, and a one-line error (no traceback) for a missing or malformed config file."""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
REPRODUCTIONS = sorted(p.stem for p in EXPERIMENTS.glob("reproduce_*.py"))
STUDIES = ["demo", "convergence", "ablation", *REPRODUCTIONS]


def _ablation_error(argv, capsys) -> str:
    from experiments import ablation

    with pytest.raises(SystemExit) as e:
        ablation.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_missing_config_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    line = _ablation_error(["--config", str(missing), "--dry-run"], capsys)
    assert str(missing) in line and "no such file" in line


@pytest.mark.parametrize("text, where", [("grid: [identity, topk\n", "line 2"),
                                         ("grid:\n  compressor: [a]\n bad: 1\n", "line 3"),
                                         ("a: b: c\n", "line 1")])
def test_malformed_yaml_is_one_line(tmp_path, capsys, text, where):
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    line = _ablation_error(["--config", str(path), "--dry-run"], capsys)
    assert str(path) in line and "not valid YAML" in line and where in line, line


def test_a_config_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    path = tmp_path / "grid.yaml"
    path.write_text("- just\n- a list\n")
    assert "expected a mapping" in _ablation_error(["--config", str(path), "--dry-run"], capsys)


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_uses_the_shared_command_line(name, capsys):
    """Each study's --help lists the shared options (from experiments.common.cli.base_parser)."""
    mod = importlib.import_module(f"experiments.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--out", "--seed", "--no-progress", "--no-wandb"):
        assert opt in out, f"{name}: {opt} missing"


def _calls(path: Path, attr: str, owner: str | None = None) -> list[int]:
    """Lines of calls ``<x>.attr(...)`` (``owner.attr(...)`` when ``owner`` is given) in ``path``."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
            and (owner is None or isinstance(n.func.value, ast.Name) and n.func.value.id == owner)]


def test_one_wandb_init_and_one_argument_parser():
    inits, parsers = [], []
    for path in EXPERIMENTS.rglob("*.py"):
        if "bench" in path.parts or path.name == "netbed_train_step.py":
            continue  # benchmarks, and the torchrun recipe's one-step worker: neither is a study
        rel = path.relative_to(ROOT).as_posix()
        inits += [rel for _ in _calls(path, "init", "wandb")]
        parsers += [rel for _ in _calls(path, "ArgumentParser", "argparse")]
    assert inits == ["experiments/common/tracking.py"], inits
    assert parsers == ["experiments/common/cli.py"], parsers


@pytest.mark.parametrize("name", REPRODUCTIONS)
def test_every_reproduction_shows_progress(name):
    """Each reproduction's long loop goes through ``Run.progress`` (a tqdm bar; --no-progress hides it)."""
    tree = ast.parse((EXPERIMENTS / f"{name}.py").read_text())
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "progress"
            and isinstance(n.value, ast.Name) and n.value.id == "R"]
    assert uses, f"{name}: no progress bar (R.progress)"


def test_run_progress_draws_a_bar_only_on_a_terminal_and_no_progress_hides_it(tmp_path, capsys, monkeypatch):
    """A bar on a terminal; none on a redirected stderr (a log file, a pipe), none with --no-progress."""
    import sys

    from experiments.common import reproduce as U

    args = argparse.Namespace(out=tmp_path, threads=1, no_progress=False, no_wandb=True, quick=True)
    R = U.Run("reproduce_x", args, {})
    assert list(R.progress(range(3), desc="points")) == [0, 1, 2]
    assert capsys.readouterr().err == ""                     # captured stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(R.progress(range(3), desc="points")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "reproduce_x: points" in err and "3/3" in err
    R = U.Run("reproduce_x", argparse.Namespace(**{**vars(args), "no_progress": True}), {})
    assert list(R.progress(range(3), desc="points")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def _recipe(doc: str, program: str) -> list[str]:
    """The torchrun command line a study's docstring (its --help) gives, as arguments after ``torchrun``."""
    line = next(ln.strip() for ln in doc.splitlines() if ln.strip().startswith(f"torchrun ") and program in ln)
    return line.split()[1:]


@pytest.mark.multiprocess
def test_the_torchrun_recipe_of_convergence_writes_its_results(tmp_path):
    """The recipe in ``convergence --help`` (torchrun, one process per worker), with 2 ranks and the
    smallest settings: it trains, gathers every rank's records (numpy block masks among them: they
    could not cross ranks) and rank 0 writes the CSV and JSON."""
    import csv
    import json
    import math
    import os
    import subprocess
    import sys

    from experiments import convergence

    args = _recipe(convergence.__doc__, "experiments.convergence")
    args[args.index("--nproc-per-node") + 1] = "2"
    small = ["--task", "breast-cancer-logreg", "--steps", "2", "--eval-every", "1", "--no-wandb", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", *args, *small,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*.csv")
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["1", "2"], rows
    assert all(math.isfinite(float(r[c])) for r in rows for c in ("loss", "test_loss", "test_acc")), rows
    assert all(0 < float(r["block_density"]) <= float(r["block_density_union"]) <= 1 for r in rows), rows
    assert all(float(r["bytes_sent"]) > 0 for r in rows), rows
    config = json.loads(path.with_suffix(".json").read_text())["config"]
    assert (config["workers"], config["backend"], config["transport"]) == (2, "gloo", "allgather"), config
