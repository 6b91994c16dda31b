"""A researcher's first hour, end to end, as a new user walks it: scripts of their own started with
torchrun (one process per worker, stock DDP and this library's hook), not the library's launcher.

1. the convergence CLI's torchrun recipe (the line its ``--help`` prints) trains and writes its results
   (``tests/frontends/test_experiments_cli.py::test_the_torchrun_recipe_of_convergence_writes_its_results``; run
   from here too with the slow cases);
2. a PowerSGD hook run checkpointed by every rank mid-run and resumed in a *new* torchrun job equals the
   uninterrupted run bit for bit (DDP's first step in the new processes has its initial bucket layout; run
   with the slow cases: the default suite pins the same in
   ``tests/frontends/test_ddp_resume.py::test_hook_resumes_bit_for_bit_for_every_method``, PowerSGD among
   every method, restored in new processes, and ``tests/frontends/test_ddp.py::test_hook_resume_powersgd_exact``,
   ``start_powerSGD_iter`` and a fresh DDP's initial layout; a user's torchrun job registering the hook in 3.);
3. ranks started with different settings get, on every rank, an error that names the setting and both
   values, before any gradient moves.
"""

from __future__ import annotations

import textwrap

import pytest

from tests._faults_common import run_in_place
from .test_experiments_cli import test_the_torchrun_recipe_of_convergence_writes_its_results as _convergence

pytestmark = pytest.mark.multiprocess

TRAIN = textwrap.dedent('''
    """A user's script: DDP with the PowerSGD hook, checkpoints by rank."""
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import sparsecomm as sc

    mode, first, last, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ckpt_at = int(sys.argv[5]) if len(sys.argv) > 5 else None      # "full": checkpoint before this step
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)     # several buckets
    ratio = 0.1 if mode == "mismatch" and rank == 1 else 0.25
    try:
        if mode == "mismatch":
            state = sc.ddp.register(net, compressor="diana", ratio=ratio)
        else:
            state = sc.ddp.register(net, compressor="powersgd", matrix_approximation_rank=1,
                                    start_powerSGD_iter=2)
    except Exception as e:                                   # noqa: BLE001 - what the user sees
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    if mode == "resume":
        ck = torch.load(f"{out}/ckpt{rank}.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
    for step in range(first, last):
        if step == ckpt_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                       f"{out}/ckpt{rank}.pt")
            torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), f"{out}/save{rank}.pt")
        g = torch.Generator().manual_seed(1000 * rank + step)       # each worker its own data
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), f"{out}/{mode}{rank}.pt")
    dist.destroy_process_group()
''')


@pytest.mark.slow    # default suite: test_experiments_cli.py runs this very test (the torchrun recipe of convergence)
def test_the_convergence_recipe_runs_under_torchrun(tmp_path):
    _convergence(tmp_path)


@pytest.mark.slow    # default suite: test_ddp_resume.py and test_ddp.py pin the resume (module docstring, 2.)
def test_a_powersgd_hook_checkpoint_resumes_in_a_new_job_bit_for_bit(tmp_path):
    import torch

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # one job trains 10 steps and checkpoints before step 5; a second, new job resumes from it
    for args in (("full", "0", "10", str(tmp_path), "5"), ("resume", "5", "10", str(tmp_path))):
        codes = run_in_place(script, 2, tmp_path, args=args)
        assert codes == [0], (args, (tmp_path / "log0.txt").read_text()[-3000:])
    full = [torch.load(tmp_path / f"full{r}.pt") for r in range(2)]
    resumed = [torch.load(tmp_path / f"resume{r}.pt") for r in range(2)]
    assert torch.equal(full[0], full[1]) and torch.equal(resumed[0], resumed[1])
    assert torch.equal(resumed[0], full[0]), (resumed[0] - full[0]).abs().max()
    saved = torch.load(tmp_path / "save0.pt")
    assert not torch.equal(saved, full[0])                 # the second half did train


def test_ranks_with_different_settings_are_told_which_setting(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    codes = run_in_place(script, 2, tmp_path, args=("mismatch", "0", "3", str(tmp_path)))
    assert codes != [0]
    log = (tmp_path / "log0.txt").read_text()               # both ranks' output, interleaved
    errors = [e.split("\n")[0] for e in log.split("ERROR ")[1:]]
    assert len(errors) == 2 and all(e.startswith("MismatchError") for e in errors), log[-3000:]
    assert all("ratio" in e and "0.25" in e and "0.1" in e and "worker 0" in e and "worker 1" in e
               for e in errors), errors


ENDS = textwrap.dedent('''
    """A user's script that ends right after its last step: DDP over 2 buckets, the PowerSGD hook."""
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import sparsecomm as sc

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)      # 2 buckets
    sc.ddp.register(net, compressor="powersgd", transport=sys.argv[1], matrix_approximation_rank=1,
                    start_powerSGD_iter=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.02)
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()
    open(f"ended{rank}", "w").close()                        # (the ranks' prints interleave in the log)
''')


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "default"])
def test_a_hook_script_that_ends_after_its_last_step_exits_cleanly_every_time(transport, tmp_path):
    """The script ends right after DDP's last backward, with and without ``destroy_process_group``, ten
    times each (the abort at exit, "terminate called without an active exception", was intermittent):
    every torchrun job exits 0 and no rank prints an abort."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS)
    bad = []
    for i in range(10):
        mode = "destroy" if i % 2 else "keep"
        for r in range(2):
            (tmp_path / f"ended{r}").unlink(missing_ok=True)
        codes = run_in_place(script, 2, tmp_path, args=(transport, mode))
        log = (tmp_path / "log0.txt").read_text()
        ended = [(tmp_path / f"ended{r}").exists() for r in range(2)]
        if codes != [0] or "terminate called" in log or ended != [True, True]:
            bad.append((i, mode, codes, log[-1500:]))
    assert not bad, bad
