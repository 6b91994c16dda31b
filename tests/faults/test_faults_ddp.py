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
