"""The studies end their stdout with parseable ``final key=value ...`` lines, one per run (the convergence CLI's
is tested in test_own_task.py): the ablation CLI per cell, ``make demo`` (experiments.demo) per configuration."""

from __future__ import annotations

import pytest
import torch

from experiments import ablation, demo
from experiments.common import tracking


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the mains pin one intra-op thread


def _parse(line: str) -> dict[str, str]:
    head, *pairs = line.split()
    assert head == "final" and all(p.count("=") == 1 for p in pairs), line
    return dict(p.split("=") for p in pairs)


def test_metrics_line_puts_the_run_first_without_spaces():
    line = tracking.metrics_line({"final_train_loss": 0.5, "final_test_acc": 0.875, "bytes_per_step": 12.0},
                                 {"scheme": "top-k + EF", "transport": "ring"})
    assert line == "final scheme=top-k-+-EF transport=ring train_loss=0.5000 test_acc=0.8750 bytes_per_step=12"


def test_the_ablation_ends_with_one_final_line_per_cell(tmp_path, capsys):
    argv = ["--task", "breast-cancer-logreg", "--compressor", "topk", "identity", "--transport", "allgather",
            "--workers", "2", "--density", "0.2", "--steps", "3", "--eval-every", "3", "--out", str(tmp_path),
            "--no-progress", "--no-wandb"]
    assert ablation.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    finals = [_parse(x) for x in lines[-2:]]
    assert not any(x.startswith("final ") for x in lines[:-2])
    assert {f["cell"] for f in finals} == {"none-allgather", "topk-ratio-0.2-allgather"}
    for f in finals:
        assert f["workers"] == "2" and f["seed"] == "0"
        assert float(f["test_loss"]) > 0 and 0 <= float(f["test_acc"]) <= 1 and float(f["bytes_per_step"]) > 0


def test_the_demo_ends_with_one_final_line_per_configuration(tmp_path, capsys, monkeypatch):
    """A reduced demo (one task, one scheme per kind, two transports; the full one is test_experiments.py's)."""
    monkeypatch.setattr(demo, "TASKS", ("digits-mlp",))
    monkeypatch.setattr(demo, "TRANSPORTS", ("ring", "allgather"))
    monkeypatch.setattr(demo, "SCHEMES", demo.SCHEMES[:2])          # none, top-k + EF (rejected on ring)
    assert demo.main(["--tiny", "--out", str(tmp_path), "--no-progress", "--no-wandb"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    finals = [_parse(x) for x in lines if x.startswith("final ")]
    assert lines[-len(finals):] == [x for x in lines if x.startswith("final ")], "final lines not last"
    assert [(f["scheme"], f["transport"]) for f in finals] == [("none", "ring"), ("none", "allgather"),
                                                               ("top-k-+-EF", "allgather")]
    assert all(f["task"] == "digits-mlp" and float(f["test_loss"]) > 0 for f in finals)
