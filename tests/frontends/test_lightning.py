"""PyTorch Lightning (sparsecomm/integrations/lightning.py): the README's Lightning script trains on two
gloo processes through Lightning's Trainer with the hook registered by ``CommHook``, and its statistics
reach Lightning's logger; the callback refuses what cannot work."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from sparsecomm.errors import IncompatibleError
from tests._scripts import run_readme_script

LINE = re.compile(r"rank (\d): loss ([\d.]+) -> ([\d.]+) in (\d+) steps, ([\d.]+)x fewer gradient bytes")


@pytest.mark.multiprocess
def test_readme_lightning_script_trains_with_the_hook(tmp_path):
    """As written: both ranks finish (their replicas are bit-identical: the script asserts it at the end of
    training), the hook ran every one of the 32 steps (512 samples, 16 per batch, 2 ranks, 2 epochs) and
    compressed, the loss fell, and the logged statistics are in Lightning's TensorBoard events every 4
    steps, the last equal to rank 0's final figures."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_readme_script("train_lightning.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = {int(m[1]): m for m in LINE.finditer(proc.stdout)}
    assert sorted(ranks) == [0, 1], proc.stdout[-3000:]
    for m in ranks.values():
        first, last, steps, factor = float(m[2]), float(m[3]), int(m[4]), float(m[5])
        assert steps == 32 and factor > 3 and last < first / 5, m[0]
    (run,) = (tmp_path / "lightning_logs").iterdir()
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [e.value for e in acc.Scalars("sparsecomm/steps")] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert acc.Scalars("sparsecomm/bytes_saved")[-1].value > 0
    assert acc.Scalars("sparsecomm/compression_factor")[-1].value == pytest.approx(float(ranks[0][5]), abs=0.051)


def _trainer(model, optimizers=()):
    return SimpleNamespace(strategy=SimpleNamespace(model=model), optimizers=list(optimizers))


def test_comm_hook_refuses_a_distributed_optimizer_and_a_module_without_ddp():
    """A DistributedOptimizer (it would average the gradients DDP already averages) and a strategy that
    did not wrap the module in DDP are refused before anything is registered."""
    import sparsecomm as sc
    from sparsecomm.integrations.lightning import CommHook

    hook = CommHook(compressor="topk", ratio=0.1)
    with pytest.raises(IncompatibleError, match="DDPStrategy"):
        hook.on_fit_start(_trainer(torch.nn.Linear(2, 1)), None)

    def fn(ctx):
        model = torch.nn.Linear(2, 1)
        opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(IncompatibleError, match="averaged twice"):
            hook.on_fit_start(_trainer(model, [torch.optim.SGD(model.parameters(), lr=0.1), opt]), None)

    sc.launch(fn, world_size=1, backend="sim")
    assert hook.state is None


def _two_fits(ctx):
    """Two fits of one trainer: each wraps the module in a new DDP; the callback registers its one state
    on both."""
    from sparsecomm.integrations.lightning import CommHook

    hook = CommHook(compressor="topk", ratio=0.5, transport="allgather")
    with ctx.seeded(0):
        module = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(ctx.rank))
    states = []
    for _ in range(2):
        net = torch.nn.parallel.DistributedDataParallel(module)
        hook.on_fit_start(_trainer(net), None)
        states.append(hook.state)
        for _ in range(3):
            module.zero_grad()
            net(x).square().mean().backward()
    return hook.state.steps, states[0] is states[1], module.weight.grad.clone()


@pytest.mark.multiprocess
def test_comm_hook_keeps_its_state_across_fits():
    import sparsecomm as sc

    out = sc.launch(_two_fits, world_size=2, backend="gloo")
    for steps, same, _ in out:
        assert steps == 6 and same                       # the second DDP wrapper runs the same state's hook
    assert torch.equal(out[0][2], out[1][2])             # averaged: the same gradient on both ranks
