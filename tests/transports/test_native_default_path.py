"""``native`` at its defaults (a fresh result, NaN/Inf raise): the same bits as ``torch.distributed.all_reduce``
and as in place, its input untouched, its non-finite contract kept, on a work copy large enough to be advised
as huge pages (:mod:`sparsecomm.transports.buffers`) and on one below it, unfolded and folded.

Also the buffers themselves: a fresh clone holds the input's bits (NaN payloads, signed zeros), the advice
covers the buffer's 2 MiB-aligned interior only, from the threshold on, and a SimFabric's work copy is a plain
buffer declared as the advised one a real endpoint makes.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)
from sparsecomm.errors import NonFiniteError, OverflowError_
from sparsecomm.transports import buffers
from sparsecomm.transports.buffers import ADVISE_MIN_BYTES, HUGE_PAGE_BYTES, advise_huge, advises, fresh_clone

#: a work copy above the advice threshold (and above native's fold limit: every call has its handshake), and
#: one below both (folded from its third call on)
LARGE = ADVISE_MIN_BYTES // 4 + 12345
SMALL = 300_001


def _input(rank: int, numel: int, call: int) -> torch.Tensor:
    # (values of every magnitude and sign: a sum of three in another order would round differently)
    g = torch.Generator().manual_seed(7919 * rank + call)
    return torch.randn(numel, generator=g) * torch.exp(4 * torch.randn(numel, generator=g))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _bits_of_the_default_path(ctx) -> list[str]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    nat = sc.transports.get("native", ctx.fabric)
    nati = sc.transports.get("native", ctx.fabric, inplace=True)
    problems = []
    for numel in (LARGE, SMALL):
        for call in range(4):
            x = _input(ctx.rank, numel, call)
            pristine = x.clone()
            raw = x.clone()
            dist.all_reduce(raw)
            y = nat.allreduce(x)
            where = f"rank {ctx.rank} numel {numel} call {call}"
            if not _same_bits(x, pristine):
                problems.append(f"{where}: the input changed")
            if y.data_ptr() == x.data_ptr() or not y.is_contiguous():
                problems.append(f"{where}: the result is the input, or not contiguous")
            if not _same_bits(y, raw):
                problems.append(f"{where}: the default path's sum differs from dist.all_reduce's")
            z = nati.allreduce(x)
            if z.data_ptr() != x.data_ptr() or not _same_bits(z, raw):
                problems.append(f"{where}: in place differs")
            # a 2-D input: the result has its shape and the same bits
            y2 = nat.allreduce(pristine.view(-1, 1)[: numel // 3 * 3].view(3, -1))
            if y2.shape != (3, numel // 3) or not _same_bits(y2.reshape(-1), _raw_prefix(pristine, numel // 3 * 3)):
                problems.append(f"{where}: a 2-D input's sum differs")
    return problems


def _raw_prefix(x: torch.Tensor, numel: int) -> torch.Tensor:
    import torch.distributed as dist

    r = x[:numel].clone()
    dist.all_reduce(r)
    return r


@pytest.mark.multiprocess
def test_native_default_gives_gloos_bits_above_and_below_the_advice_threshold():
    """Three gloo ranks (a sum whose order matters): ``native``'s fresh result equals ``dist.all_reduce``'s and
    the in-place one bit for bit, for a work copy advised as huge pages and one that is not, unfolded and
    folded; the input is untouched and not the result."""
    problems = sc.launch(_bits_of_the_default_path, 3, backend="gloo", timeout_s=300)
    assert not [p for r in problems for p in r]


def _nonfinite_large(ctx) -> list[str]:
    torch.set_num_threads(1)
    nat = sc.transports.get("native", ctx.fabric)
    out = []
    x = torch.ones(LARGE)
    if ctx.rank == 1:
        x[LARGE - 5] = float("nan")
    try:
        nat.allreduce(x)
        out.append("nan: no error")
    except NonFiniteError as exc:
        out.append("nan: worker 1" if "worker 1" in str(exc) else f"nan: {exc}")
    big = torch.full((LARGE,), 3e38)
    try:
        nat.allreduce(big)
        out.append("overflow: no error")
    except OverflowError_:
        out.append("overflow")
    y = nat.allreduce(torch.ones(LARGE))      # (the fabric is usable after a synchronous call's error)
    out.append("after: ok" if torch.equal(y, torch.full((LARGE,), 2.0)) else "after: wrong sum")
    return out


@pytest.mark.multiprocess
def test_native_default_keeps_the_nonfinite_contract_on_an_advised_work_copy():
    """A NaN in one worker's large input raises NonFiniteError naming it, finite inputs that overflow float32
    raise OverflowError_, on every worker, and the next call sums."""
    got = sc.launch(_nonfinite_large, 2, backend="gloo", timeout_s=300)
    assert got == [["nan: worker 1", "overflow", "after: ok"]] * 2


def test_a_fresh_clone_holds_the_inputs_bits():
    x = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -3.5])
    x.view(torch.int32)[0] = 0x7FC01234                   # (a NaN with a payload)
    y = fresh_clone(x)
    assert y.data_ptr() != x.data_ptr() and _same_bits(y, x)
    s = torch.arange(10.0)[::3]                           # (a strided view: a contiguous copy)
    assert fresh_clone(s).is_contiguous() and torch.equal(fresh_clone(s), s)
    big = torch.randn(LARGE, generator=torch.Generator().manual_seed(1))
    assert _same_bits(fresh_clone(big), big)


def test_the_advice_covers_the_aligned_interior_from_the_threshold_on(monkeypatch):
    calls = []
    monkeypatch.setattr(buffers, "_MADVISE", lambda addr, length, advice: calls.append((addr, length, advice)) or 0)
    assert advises(ADVISE_MIN_BYTES) and not advises(ADVISE_MIN_BYTES - 1) and not advises(ADVISE_MIN_BYTES, "meta")
    small = torch.empty(ADVISE_MIN_BYTES // 4 - 1)
    assert not advise_huge(small) and calls == []
    t = torch.empty(max(ADVISE_MIN_BYTES, 2 * HUGE_PAGE_BYTES) // 4 + 1000)   # (an aligned huge page inside)
    assert advise_huge(t)
    (addr, length, advice), = calls
    assert advice == buffers.MADV_HUGEPAGE
    assert addr % HUGE_PAGE_BYTES == 0 and length % HUGE_PAGE_BYTES == 0 and length > 0
    assert t.data_ptr() <= addr < t.data_ptr() + HUGE_PAGE_BYTES
    assert addr + length <= t.data_ptr() + t.nbytes < addr + length + HUGE_PAGE_BYTES
    monkeypatch.setattr(buffers, "_MADVISE", None)         # (no madvise: a plain buffer)
    assert not advise_huge(t)


def test_a_simfabric_work_copy_is_plain_and_declared_as_the_modelled_hosts(monkeypatch):
    """A work copy on a fabric whose time is modelled is a plain buffer (every simulated worker's copy lives in one
    process), declared to the host model as the advised buffer a real endpoint makes; on any other fabric it is
    advised. The same bits either way."""
    from sparsecomm.fabric.sim.sim import SimWorld
    from sparsecomm.transports.linear import linear_operand

    calls = []
    monkeypatch.setattr(buffers, "_MADVISE", lambda addr, length, advice: calls.append((addr, length, advice)) or 0)
    big = torch.randn(max(ADVISE_MIN_BYTES, 2 * HUGE_PAGE_BYTES) // 4 + 1000, generator=torch.Generator().manual_seed(3))
    for modelled in (True, False):
        fabric = SimWorld(2).fabric(0)
        declared = []
        monkeypatch.setattr(fabric, "host_work", lambda op, count, *a, **k: declared.append((op, count)))
        if not modelled:
            monkeypatch.setattr(fabric, "modelled_time", False)     # (what a real endpoint says)
        del calls[:]
        y = linear_operand(big, "ring").work_copy(fabric)
        assert y.data_ptr() != big.data_ptr() and _same_bits(y, big)
        assert declared == [("copy", big.nbytes), ("fresh_advised", big.nbytes)]
        assert (calls == []) == modelled and all(c[2] == buffers.MADV_HUGEPAGE for c in calls)
