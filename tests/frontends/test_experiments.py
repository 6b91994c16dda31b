"""Smoke tests of the studies: the demo and one ablation cell at a tiny size, and early failure on bad input.

They run in-process with ``WANDB_MODE=disabled`` (nothing may be written by wandb).
"""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
import torch

from experiments import ablation, convergence, demo
from experiments.common import config as C
from experiments.common import plots, tracking

from tests._figures import problems

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the mains pin one intra-op thread


def _no_wandb_files(root):
    return not any(p.name == "wandb" or p.name.startswith("offline-run") for p in root.rglob("*"))


def test_demo_tiny(tmp_path, capsys, monkeypatch):
    figures = []
    save = plots.save
    monkeypatch.setattr(plots, "save", lambda fig, path, **kw: (figures.append(fig), save(fig, path, **kw))[1])
    cpu = time.process_time()
    assert demo.main(["--tiny", "--out", str(tmp_path), "--no-progress"]) == 0
    # docs/theory.md, "The demo": "about 10 s of CPU time" (imports aside, which this process has paid; a cold Numba cache adds
    # its compilation): 4x that fails, whatever the load on the machine (CPU time, not wall time)
    assert time.process_time() - cpu < 40
    out = capsys.readouterr().out
    # the table: every runnable cell has numbers, the rejected pairs carry the library's reason
    assert re.search(r"top-k \+ EF +ring +n/a \(incompatible: compressor 'topk'", out)
    assert "QSGD            allgather" in out
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    ran = [r for r in rows if not r.get("incompatible")]
    rejected = [r for r in rows if r.get("incompatible")]
    assert len(rows) == len(demo.TASKS) * len(demo.SCHEMES) * len(demo.TRANSPORTS)
    assert {(r["scheme"], r["transport"]) for r in rejected} >= {("top-k + EF", "ring"), ("top-k + EF", "switch")}
    for r in ran:
        assert float(r["bytes_per_step"]) > 0
        for bw in demo.BANDWIDTHS:
            assert float(r[f"modelled_comm_per_step_s_{bw:g}gbps"]) > 0
        # the slower network can only take longer
        lo, hi = (float(r[f"modelled_comm_per_step_s_{bw:g}gbps"]) for bw in demo.BANDWIDTHS)
        assert lo > hi
        assert 0.0 < float(r["block_density"]) <= float(r["block_density_union"]) <= 1.0
    sparse = [float(r["block_density"]) for r in ran if r["task"] == "recsys-zipf"]
    assert max(sparse) < 0.5  # the recommendation model's gradients are block-sparse
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert _no_wandb_files(tmp_path)
    # the figure keeps the rules of tests/_figures.py (no empty panel: --tiny evaluates every step)
    (fig,) = figures
    assert problems(fig) == []


def test_readme_picture_is_the_current_demo():
    """docs/demo.png (the picture in docs/theory.md) is the full demo's figure for the demo as it is now (its tasks,
    schemes, transports, network models and workers: the PNG records them); `python -m experiments.demo
    --docs` regenerates it."""
    from PIL import Image

    with Image.open(ROOT / "docs" / "demo.png") as img:
        shown = json.loads(img.text.get("Description", "{}"))
    assert shown == demo.contents(demo.WORKERS)


def test_ablation_one_cell_resumes(tmp_path, capsys):
    argv = ["--task", "breast-cancer-logreg", "--compressor", "topk", "--method", "ef", "--transport",
            "allgather", "--workers", "2", "--density", "0.2", "--steps", "4", "--eval-every", "2",
            "--target-acc", "0.5", "--out", str(tmp_path), "--no-progress"]
    assert ablation.main(argv) == 0
    first = tracking.read_jsonl(tmp_path / "results.jsonl")
    assert len(first) == 1 and first[0]["summary"]["steps"] == 4
    assert (tmp_path / "ablation.png").exists() and (tmp_path / "summary.csv").exists()
    capsys.readouterr()
    assert ablation.main(argv) == 0  # finished cells are skipped
    assert "resuming: 1 of 1 cells already" in capsys.readouterr().out
    assert tracking.read_jsonl(tmp_path / "results.jsonl") == first
    assert _no_wandb_files(tmp_path)


def test_grid_with_incompatible_pair_fails_before_running(tmp_path, capsys):
    argv = ["--task", "digits-mlp", "--compressor", "topk", "--method", "ef", "--transport", "ring",
            "allgather", "--density", "0.1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        ablation.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "ef+topk(ratio=0.1) / ring" in err and "'sparse' payloads" in err and "skip_incompatible" in err
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--compressor", "topkk"], "unknown compressor or method 'topkk'"),
    (["--transport", "ringg"], "unknown transport 'ringg'"),
    (["--task", "mnist"], "unknown task 'mnist'"),
    (["--compressor", "topk", "--ratio", "0.1", "--method", "diana"], "needs an unbiased compressor"),
    (["--compressor", "randk", "--compressor-arg", "levels=3"], "does not take 'levels'"),
    (["--transport", "switch", "--transport-arg", "slot_elems=100"], "slot_elems must be one of"),
])
def test_convergence_rejects_bad_configuration(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        convergence.main(argv + ["--out", str(tmp_path)])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_convergence_is_reproducible(tmp_path):
    argv = ["--task", "breast-cancer-logreg", "--compressor", "randk", "--ratio", "0.3", "--method", "diana",
            "--transport", "ring", "--workers", "3", "--steps", "4", "--seed", "7", "--no-progress"]
    for sub in ("a", "b"):
        assert convergence.main(argv + ["--out", str(tmp_path / sub), "--name", "run"]) == 0
    a, b = ((tmp_path / s / "run.csv").read_text().splitlines() for s in ("a", "b"))
    cols = a[0].split(",")
    keep = [i for i, c in enumerate(cols) if c != "measured_comm_s"]  # wall-clock time differs
    assert [[r.split(",")[i] for i in keep] for r in a] == [[r.split(",")[i] for i in keep] for r in b]
    conf = json.loads((tmp_path / "a" / "run.json").read_text())["config"]
    assert conf["seed"] == 7 and conf["method"] == "diana"


def test_density_axis_collapses_for_compressors_without_ratio():
    spec = ablation.merge_args({}, ablation.parser().parse_args(
        ["--task", "digits-mlp", "--compressor", "identity", "randk", "--transport", "ring",
         "--density", "0.1", "0.2", "--block-size", "64", "256"]))
    cells, incompatible = ablation.expand(spec)
    labels = sorted(c["cfg"].label for c in cells)
    # identity: one cell (no ratio, ring has no block size); rand-k: one per density
    assert labels == ["none / ring", "randk(ratio=0.1) / ring", "randk(ratio=0.2) / ring"]
    assert not incompatible
    assert len({c["cfg"].key() for c in cells}) == 3


def test_run_config_key_is_stable():
    a = C.RunConfig(task="digits-mlp", compressor="topk", compressor_kw={"ratio": 0.1})
    b = C.RunConfig(task="digits-mlp", compressor="topk", compressor_kw={"ratio": 0.1})
    assert a.key() == b.key() != C.RunConfig(task="digits-mlp").key()


def test_ablation_records_a_diverged_cell_and_goes_on(tmp_path, capsys):
    argv = ["--task", "digits-mlp", "--compressor", "randk", "--method", "diana", "--transport", "ring",
            "--workers", "2", "--density", "0.25", "--steps", "8", "--lr", "10000", "--out", str(tmp_path),
            "--no-progress"]
    assert ablation.main(argv) == 0
    (rec,) = tracking.read_jsonl(tmp_path / "results.jsonl")
    # the steps before the divergence are kept (every worker raises at the same step)
    assert "NaN or Inf" in rec["summary"]["diverged"]
    at = int(rec["summary"]["diverged"].split("at step ")[1].split(":")[0])
    assert [r["step"] for r in rec["records"]] == list(range(1, at))
    out = capsys.readouterr().out      # the library's NonFiniteError (raised on every worker), recorded as a result
    assert "diverged: " in out and "NaN or Inf" in out


def test_memory_around_the_identity_is_the_uncompressed_run():
    """EF, EF21 and DIANA around the identity feed back nothing (the error or shift of an exact operator is
    zero, or cancels): such a cell is the 'none' cell, run once."""
    spec = ablation.merge_args({}, ablation.parser().parse_args(
        ["--task", "digits-mlp", "--compressor", "identity", "topk", "--method", "none", "ef", "ef21", "diana",
         "--transport", "allgather", "--density", "0.1", "--skip-incompatible"]))
    cells, incompatible = ablation.expand(spec)
    assert sorted(c["cfg"].label for c in cells) == [
        "ef+topk(ratio=0.1) / allgather", "ef21+topk(ratio=0.1) / allgather", "none / allgather",
        "topk(ratio=0.1) / allgather"]
    assert [c["cfg"].label for c in incompatible] == ["diana+topk(ratio=0.1) / allgather"]  # biased top-k


def test_shipped_grid_has_a_baseline_and_no_duplicate_runs():
    path = ROOT / "experiments" / "ablation.yaml"
    spec = ablation.merge_args(ablation.load_spec(path), ablation.parser().parse_args(["--config", str(path)]))
    cells, _ = ablation.expand(spec)
    cfgs = [c["cfg"] for c in cells]
    assert all(c.method == "none" for c in cfgs if c.compressor == "identity")
    assert {c.transport for c in cfgs if c.compressor == "identity"} == set(spec["grid"]["transport"])
    assert len({c.key() for c in cfgs}) == len(cfgs)


def test_compressor_benchmark_loads_grace_at_run_time_or_says_why_not(tmp_path, capsys, monkeypatch):
    """experiments/bench/compressors.py --grace PATH imports GRACE's operators from a checkout or a git
    mirror given at run time (here a stand-in with one operator and one that needs a missing package),
    times each pair, and skips with a message what it cannot load; an absent path skips the table."""
    import subprocess
    import sys

    from experiments.bench import compressors as bench

    root = tmp_path / "grace"
    comp = root / "grace_dl" / "torch" / "compressor"
    comp.mkdir(parents=True)
    for d in (root / "grace_dl", root / "grace_dl" / "torch"):
        (d / "__init__.py").write_text("")
    (comp / "signsgd.py").write_text(
        "class SignSGDCompressor:\n"
        "    def compress(self, tensor, name):\n"
        "        return [(tensor >= 0).to(dtype=__import__('torch').uint8)], tensor.size()\n"
        "    def decompress(self, tensors, shape):\n"
        "        return (tensors[0].float() * 2 - 1).view(shape)\n")
    (comp / "natural.py").write_text("import a_package_that_is_not_installed\n")
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(path):
        for name in [m for m in sys.modules if m.split(".")[0] == "grace_dl"]:
            monkeypatch.delitem(sys.modules, name)
        bench.main(["--n", "1000", "--only", "grace", "--median-of", "1", "--grace", str(path)])
        return capsys.readouterr().out

    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "stand-in"], check=True)
    for path in (root, root / ".git"):
        out = run(path)
        row = next(line for line in out.splitlines() if line.startswith("signsgd"))
        assert "signsgd's VoteSign" in row and float(row.split()[-3]) > 0        # the GRACE/ours ratio
        assert "skipped: natural (a_package_that_is_not_installed is not importable here)" in out
        assert "skipped: topk (grace_dl.torch.compressor.topk is not importable here)" in out
        assert "skipped: powersgd" in out
    out = run(tmp_path / "absent")
    assert "GRACE comparison skipped:" in out and "does not exist" in out and "signsgd" not in out


def test_compressor_benchmark_runs_at_the_torch_thread_count_it_is_given(capsys):
    """``--torch-threads T`` sets torch's thread count for the run (GRACE's casts use torch's threads) and
    the machine line reports it; a count below 1 is refused."""
    from experiments.bench import compressors as bench

    before = torch.get_num_threads()
    try:
        bench.main(["--n", "2000", "--only", "throughput", "--repeat", "1", "--torch-threads", "1"])
        assert torch.get_num_threads() == 1
        assert "(1 threads)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        bench.main(["--n", "2000", "--torch-threads", "0"])
    assert torch.get_num_threads() == before


def test_compressor_benchmark_interleaves_in_alternating_order():
    """The benchmark's rounds call the entries in the given order, then in the reverse one, so that no entry
    always runs right after the same neighbour (its input warm in the cache, its freed buffers, torch's thread
    pool awake): one warm-up call each first, a sample per timed call, ``block`` calls in a row."""
    from experiments.bench import compressors as bench

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench.interleaved_samples(fns, rounds=3, block=2)
    assert calls == list("abc") + list("aabbcc") + list("ccbbaa") + list("aabbcc")
    assert {k: len(v) for k, v in times.items()} == {"a": 6, "b": 6, "c": 6}
