"""The switch path's direct waits: the switch's port threads wait on their receives themselves
(``TorchFabric.wait_unbounded``, with the service's main thread watching the end of the run through
``wait_for_shutdown(stop)``), and the encoder's range check skipped where no code can leave int32."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.errors import OverflowError_
from sparsecomm.transports.switchml.jobs import FloatJob
from sparsecomm.transports.switchml.dataplane import EXP_MIN, HEADER


# ----------------------------------------------------------------------------- encoder
def _job(x: torch.Tensor, E: int, n: int):
    e_loc = np.maximum(codec.chunk_exponents(x, E).numpy().astype(np.int64), -126)
    M = -(-x.numel() // E)
    job = FloatJob(x, torch.empty_like(x), None, e_loc, E, M, n, None)   # lanes = M: one window
    return job, e_loc, M


def _reference(x: np.ndarray, s: float) -> np.ndarray:
    """``round(x s)``, half away from zero, the product in float64 (numpy, element-wise)."""
    v = x.astype(np.float64) * s
    t = np.trunc(v)
    return (t + (v - t >= 0.5) - (v - t <= -0.5)).astype(np.int32)


@pytest.mark.parametrize("n", [2, 5])
def test_encoded_codes_are_the_same_from_the_unchecked_and_the_checked_loop(n):
    """Agreed exponents at, above and one below the chunk's own (one below: a larger scale, the codes
    still fit for n >= 2): the codes are the float64 rounding's bit for bit, and the same whether a
    chunk takes the unchecked loop (agreed exponent at least the local one) or, forced by a table that
    admits none, the checked one."""
    from sparsecomm.transports.switchml.jobs import _encode

    E, chunks = 64, 48
    g = torch.Generator().manual_seed(9)
    x = torch.randn(chunks * E, generator=g) * torch.rand(chunks * E, generator=g) * 100
    x[:8] = torch.tensor([0.5, -0.5, 1.5, -2.5, 0.0, -0.0, 3.0, 1e-30])
    job, e_loc, M = _job(x, E, n)
    agreed = e_loc + np.tile([0, 1, 3, -1], chunks // 4)
    job.scales[:] = job.table[agreed - EXP_MIN]
    pkts = np.arange(M, 2 * M, dtype=np.int64)                     # the codes of chunks 0..M-1
    rows = np.zeros((M, HEADER + E), dtype=np.int32)
    job.payload(pkts, rows)
    checked = np.zeros_like(rows)
    none = np.full_like(job.table, -np.inf)                        # no chunk may skip the check
    assert _encode(job.xnp, E, M, M, pkts, e_loc, job.scales, none, checked) == -1
    assert np.array_equal(rows, checked)
    for c in range(chunks):
        assert np.array_equal(rows[c, HEADER:], _reference(job.xnp[c * E:(c + 1) * E], job.scales[c])), c
    big = np.abs(rows[agreed < e_loc, HEADER:]).max()
    assert big > (2**31 - 1) / n                                   # the checked loop's codes exceed Q / n


def test_a_forged_smaller_exponent_that_overflows_still_raises():
    E = 64
    x = torch.full((2 * E,), 3.0)
    x[E + 5] = 1000.0                                              # chunk 1: local exponent 10
    job, e_loc, M = _job(x, E, 2)
    job.scales[:] = job.table[e_loc - EXP_MIN]
    job.scales[1] = job.table[1 - EXP_MIN]                          # forged: 2^1, far below 1000
    rows = np.zeros((2, HEADER + E), dtype=np.int32)
    with pytest.raises(OverflowError_, match=f"element {E + 5} "):
        job.payload(np.arange(M, 2 * M, dtype=np.int64), rows)
    job.scales[1] = job.table[e_loc[1] - EXP_MIN]                   # the honest scale: no error
    job.payload(np.arange(M, 2 * M, dtype=np.int64), rows)


# ----------------------------------------------------------------------------- direct waits
def _direct(ctx, outdir):
    from sparsecomm.errors import InvalidValueError

    f = ctx.fabric
    if ctx.rank == 0:
        f.send(torch.arange(4, dtype=torch.float32), 1, tag=3)
        f.recv(torch.zeros(1), 1, tag=4)           # rank 1 has checked the first message
        f.fail(ValueError("rank 0 stops on purpose"))
        deadline = time.monotonic() + 30            # stay (not a crash) until rank 1 has seen it
        while not os.path.exists(os.path.join(outdir, "rank1.txt")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return []
    buf = torch.zeros(4)
    work = f.irecv(buf, 0, tag=3)
    src = f.wait_unbounded(work)
    problems = [] if f.direct_waits else ["TorchFabric does not declare direct_waits"]
    if src != 0 or buf.tolist() != [0.0, 1.0, 2.0, 3.0]:
        problems.append(f"first message: {src} {buf.tolist()}")
    if f.wait_unbounded(work) != 0 or work.wait() != 0:
        problems.append("a finished work does not return its source again")
    try:
        f.wait_unbounded(_Foreign())
        problems.append("a foreign Work was accepted")
    except InvalidValueError:
        pass
    t0 = time.monotonic()
    if f.wait_for_shutdown(stop=lambda: True) is not False or time.monotonic() - t0 > 1.0:
        problems.append("wait_for_shutdown(stop) did not return False at once")
    pending = f.irecv(torch.zeros(1), 0, tag=5)    # never sent: rank 0 fails instead
    f.send(torch.zeros(1), 0, tag=4)
    t0 = time.monotonic()
    try:
        f.wait_unbounded(pending)
        problems.append("the wait on a failed peer returned")
    except Exception as e:  # noqa: BLE001
        with open(os.path.join(outdir, "rank1.txt"), "w") as fh:
            fh.write(f"{type(e).__name__}|{time.monotonic() - t0:.3f}|{'; '.join(problems)}|{e}")
        raise
    return problems


class _Foreign(sc.fabric.base.Work):
    def wait(self, timeout=None):
        return None

    def is_completed(self):
        return True


@pytest.mark.multiprocess
def test_wait_unbounded_returns_the_source_and_ends_with_the_peers_failure(tmp_path):
    """A receive waited for on the caller's thread: the data and the source, once; a Work of another
    kind refused; a peer that fails while the wait is pending ends it with the failure (no hang), as a
    service's port thread must see it."""
    import functools

    with pytest.raises(Exception, match="on purpose"):   # the job's recorded failure
        sc.launch(functools.partial(_direct, outdir=str(tmp_path)), 2, backend="gloo", timeout_s=60)
    kind, seconds, problems, text = (tmp_path / "rank1.txt").read_text().split("|", 3)
    assert problems == "", problems
    assert kind == "PeerFailure" and "worker 0" in text, text
    assert float(seconds) < 10.0, seconds
