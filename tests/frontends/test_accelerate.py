"""HuggingFace Accelerate: the README's Accelerate script, run with ``accelerate launch`` as written, trains
on two gloo processes with the hook registered on the module ``accelerator.prepare`` returns, and logs the
statistics through ``accelerator.log`` to its TensorBoard tracker."""

from __future__ import annotations

import re

import pytest

from tests._scripts import run_readme_script

LINE = re.compile(r"rank (\d): loss ([\d.]+) -> ([\d.]+) in (\d+) steps, ([\d.]+)x fewer gradient bytes")


@pytest.mark.multiprocess
def test_readme_accelerate_script_trains_with_the_hook(tmp_path):
    """Both ranks finish (replicas bit-identical: the script asserts it after training), the hook ran the
    32 steps (512 samples, 16 per batch, 2 ranks, 2 epochs) and compressed, the loss fell, and the
    tracker got the statistics at steps 4, 8, ..., 32, the last equal to rank 0's final figures."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_readme_script("train_accelerate.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = {int(m[1]): m for m in LINE.finditer(proc.stdout)}
    assert sorted(ranks) == [0, 1], proc.stdout[-3000:] + proc.stderr[-3000:]
    for m in ranks.values():
        first, last, steps, factor = float(m[2]), float(m[3]), int(m[4]), float(m[5])
        assert steps == 32 and factor > 3 and last < first / 5, m[0]
    acc = EventAccumulator(str(tmp_path / "runs" / "topk"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("sparsecomm/steps")] == [(s, s) for s in range(4, 33, 4)]
    assert acc.Scalars("sparsecomm/bytes_saved")[-1].value > 0
    assert acc.Scalars("sparsecomm/compression_factor")[-1].value == pytest.approx(float(ranks[0][5]), abs=0.051)
