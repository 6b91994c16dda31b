"""Faults under stock DDP with sparsecomm's comm hook, on real gloo processes: a NaN in one worker's
gradients is the library's ``NonFiniteError`` on every worker, whatever the transport, never torch's
"Unable to cast ... to Tensor" (the hook's future used to carry the exception as if it were the bucket's
value).

torch's C++ layer re-raises a failed hook future as a ``RuntimeError`` whose text is torch's prefix
("Got the following error when running the callback: ") and then the library error's class and
message; the hook state keeps the error itself (``state.error``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import sparsecomm as sc

from tests._faults_common import outcome

TIMEOUT = 30.0
BOUND = 5.0


def _nan_under_ddp(ctx, transport: str):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(net)
    state = sc.ddp.register(ddp, transport=transport)
    x = torch.randn(4, 8)
    ddp(x).sum().backward()                     # a clean iteration first
    if ctx.rank == 1:
        x[0, 0] = float("nan")
    got = outcome(lambda: ddp(x).sum().backward())
    return got, type(state.error).__name__


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["ring", "allgather", "native", "omnireduce"])
def test_a_nan_under_stock_ddp_is_a_nonfinite_error_on_every_worker(transport):
    res = sc.launch(functools.partial(_nan_under_ddp, transport=transport), 2, backend="gloo",
                    timeout_s=TIMEOUT)
    for (cls, text, secs), kept in res:
        assert cls == "RuntimeError" and "NonFiniteError: " in text, (cls, text)
        assert "Unable to cast" not in text
        assert kept == "NonFiniteError"
        assert secs < BOUND


def _dead_peer_under_lanes(ctx, transport: str, outdir: str):
    """Worker 2 dies (SIGKILL) in the middle of the second step, after starting its first bucket; the
    survivors' calls on both lanes wait for it."""
    import os
    import signal

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), *[m for _ in range(5) for m in (nn.ReLU(), nn.Linear(256, 256))],
                         nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    state = sc.ddp.CommHookState(ddp.process_group, transport=transport, model=ddp, lanes=2)

    def hook(st, bucket):
        dies = ctx.rank == 2 and st.steps == 1 and bucket.index() == 1
        fut = sc.ddp.comm_hook(st, bucket)
        if dies:
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    ddp.register_comm_hook(state, hook)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(ctx.rank))
    ddp(x).sum().backward()                     # a clean step first
    cls, text, secs = outcome(lambda: ddp(x).sum().backward())
    with open(os.path.join(outdir, f"rank{ctx.rank}.txt"), "w") as fh:
        fh.write(f"{cls}\t{type(state.error).__name__}\t{secs:.3f}\t{text}")
    raise state.error


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["ring", "omnireduce"])
def test_a_dead_peer_mid_step_on_lanes_is_a_clear_error_on_every_survivor(transport, tmp_path):
    with pytest.raises(sc.errors.PeerFailure) as info:
        sc.launch(functools.partial(_dead_peer_under_lanes, transport=transport, outdir=str(tmp_path)), 3,
                  backend="gloo", timeout_s=TIMEOUT)
    assert "worker 2" in str(info.value), str(info.value)
    for r in (0, 1):
        cls, kept, secs, text = (tmp_path / f"rank{r}.txt").read_text().split("\t", 3)
        assert cls == "RuntimeError" and "PeerFailure: " in text and "worker 2" in text, text
        assert kept == "PeerFailure" and float(secs) < BOUND, (kept, secs)
