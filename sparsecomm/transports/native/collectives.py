"""The torch.distributed collectives that ``native`` makes, over the workers' group, each booked in the
fabric's ledger and each failure translated into the library's error.

torch.distributed does not report its traffic, so every collective is booked as an estimate
(:func:`book`; ``CommStats.estimated_bytes`` counts it): an all-reduce at the bandwidth-optimal ring
volume, ``2 (n-1)/n`` of the vector each way per worker, in one message per direction and ``2 (n-1)``
rounds (gloo and NCCL use ring-like algorithms for large tensors); an all-gather at ``n - 1`` copies of
the vector, one message, ``n - 1`` rounds.

A collective that raises (a rank died, raised or timed out) raises the fabric's error naming the rank
that failed first (:meth:`~sparsecomm.fabric.torch.torch_fabric.TorchFabric.collective_error`), on every rank
(:func:`translated`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...fabric.base import Fabric
from ...fabric.stats import CommStats
from ...fabric.torch.torch_waiters import retain

#: vectors of at most this many bytes are summed by an all_gather and a local sum in rank order (``n - 1``
#: latency steps instead of the ring all-reduce's ``2 (n - 1)``); a constant, so that every worker picks
#: alike
GATHER_SUM_BYTES = 64 << 10


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``inp`` into ``out`` (flat, ``world_size * numel``), torch's current name for it
    (with ``async_op``: the pending work)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(out, inp, group=group, async_op=async_op)
    if not async_op:
        retain(out, inp)           # a pending work's caller retains it once it has completed
    return work


def translated(f: Fabric, name: str, exc: RuntimeError) -> BaseException:
    """The library's error for torch.distributed's ``name`` having raised ``exc``: the fabric's
    (:meth:`~sparsecomm.fabric.torch.torch_fabric.TorchFabric.collective_error`: the job's recorded failure, a
    timeout, or a peer failure naming the rank that died), reported to every rank."""
    return f.collective_error(exc, name)


def collective(f: Fabric, call: Callable[[], object], name: str = "all_gather") -> None:
    """Run the collective ``call()`` (torch.distributed's ``name``), its failure :func:`translated`."""
    try:
        call()
    except RuntimeError as exc:
        raise translated(f, name, exc) from exc


def book(f: Fabric, moved: int, messages: int, rounds: int) -> CommStats:
    """Book ``moved`` bytes each way in ``messages`` messages and ``rounds`` latency steps in ``f.stats``,
    as an estimate (module docstring); returns what was booked."""
    booked = CommStats(bytes_sent=moved, bytes_received=moved, messages=messages, messages_received=messages,
                       rounds=rounds, estimated_bytes=2 * moved)
    f.stats += booked
    return booked


def _sum_rows(acc: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``acc`` = the sum of the ``n`` gathered copies in ``rows``, in rank order (the same bits on
    every worker)."""
    r = rows.view(n, -1)
    acc.copy_(r[0])
    for j in range(1, n):
        acc.add_(r[j])
    return acc


def join_figures(n: int, nbytes: int, small: bool) -> tuple[int, int, int]:
    """What one join of ``nbytes`` by ``n`` workers books (``small``: the all-gather sum): :func:`book`'s
    ``moved``, ``messages`` and ``rounds``."""
    if small:
        return (n - 1) * nbytes, 1, n - 1
    return 2 * (n - 1) * nbytes // n, 1, 2 * (n - 1)


def book_join(f: Fabric, n: int, nbytes: int, small: bool) -> CommStats:
    """Book one join of ``nbytes`` by ``n`` workers on ``f`` (``small``: the all-gather sum) and return it."""
    return book(f, *join_figures(n, nbytes, small))


def _gathers(acc: torch.Tensor) -> bool:
    """Whether :func:`join` sums ``acc`` by an all_gather (:data:`GATHER_SUM_BYTES`)."""
    return acc.numel() * acc.element_size() <= GATHER_SUM_BYTES and acc.is_contiguous()


def join(f: Fabric, acc: torch.Tensor) -> torch.Tensor:
    """The sum of ``acc`` over the workers' group, in place, booked in ``f.stats``: gloo's ``all_reduce``,
    or for a vector of at most :data:`GATHER_SUM_BYTES` an ``all_gather`` and a sum in rank order (the
    same bits on every worker; ``n - 1`` latency steps instead of the ring's ``2 (n - 1)``, for ``n - 1``
    instead of ``2 (n - 1) / n`` copies of a vector that small). The choice depends on the length and
    dtype only, which every worker agreed on, so every worker makes the same one."""
    import torch.distributed as dist

    n = f.world_size
    if n <= 1:
        return acc
    nbytes = acc.numel() * acc.element_size()
    small = _gathers(acc)
    try:
        if small:
            rows = torch.empty(n * acc.numel(), dtype=acc.dtype, device=acc.device)
            all_gather(rows, acc, group=f.native_group)
            _sum_rows(acc, rows, n)
        else:
            dist.all_reduce(acc, group=f.native_group)
            retain(acc)
    except RuntimeError as exc:
        raise translated(f, "all_gather" if small else "all_reduce", exc) from exc
    book_join(f, n, nbytes, small)
    return acc


def post_join(f: Fabric, acc: torch.Tensor) -> Callable[[], tuple[torch.Tensor, CommStats]]:
    """Post :func:`join`'s collective on ``acc`` without waiting (``async_op``); returns a function that
    waits for it and gives the sum in ``acc`` (booked in the fabric's stats, as :func:`join` does) and
    what was booked."""
    import torch.distributed as dist

    n = f.world_size
    nbytes = acc.numel() * acc.element_size()
    small = _gathers(acc)
    name = "all_gather" if small else "all_reduce"
    rows = None
    try:
        if small:
            rows = torch.empty(n * acc.numel(), dtype=acc.dtype, device=acc.device)
            handle = all_gather(rows, acc, group=f.native_group, async_op=True)
        else:
            handle = dist.all_reduce(acc, group=f.native_group, async_op=True)
    except RuntimeError as exc:
        raise translated(f, name, exc) from exc

    def wait() -> torch.Tensor:
        try:
            handle.wait()
        except RuntimeError as exc:
            raise translated(f, name, exc) from exc
        retain(handle, acc, rows)
        if small:
            _sum_rows(acc, rows, n)
        return acc, book_join(f, n, nbytes, small)

    return wait
