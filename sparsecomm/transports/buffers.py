"""Buffers a transport allocates afresh in a call: one of at least a huge page is advised to the kernel as huge
pages before its first touch.

A per-call buffer's pages are often the kernel's afresh, and faulted in one 4 KiB page at a time by the first pass
that writes it: glibc's ``malloc`` (torch's CPU allocator under it) maps every block above its mmap threshold
(at most 32 MiB on 64-bit) afresh on each allocation and unmaps it on its free, and below that threshold a freed
block at the top of the heap is handed back to the kernel whenever the free space there passes the trim threshold,
which depends on what else the process has allocated and freed. Between two gloo processes on the loopback, the
ring's and ``native``'s work copy of a 10 MB input took a fresh page per 4 KiB on every call (2,441 minor faults,
6.6 ms of CPU where a copy into mapped pages takes 1.3-1.6 ms) in one allocation pattern and none in another, at 2,
3, 4 and 16 MB alike. Asked for huge pages (``madvise(MADV_HUGEPAGE)`` on the buffer's 2 MiB-aligned interior,
before anything writes it), the kernel backs its fresh pages with 2 MiB ones, faulted and freed 512 times less
often: the same 10 MB work copy then took no fault and 1.6 ms; what is left of a fresh buffer's first touch is the
zeroing of its huge pages, about half a copy's time. The values are the same bits. The advice is given from
:data:`ADVISE_MIN_BYTES` (one huge page, the smallest buffer with an aligned interior that can hold one; a smaller
buffer's pages stay small, and a buffer of a few huge pages keeps its small pages at its unaligned ends).

Where the advice cannot be given (no Linux ``madvise``, a CUDA tensor, a buffer under the threshold) the buffer is a
plain ``torch.empty``; where the kernel ignores it (transparent huge pages ``never``), the pages are small, as before.
Which buffers are advised depends on their size and device only (:func:`advises`), so a SimFabric declares the same
host work on every machine (``"fresh_advised"``, :mod:`sparsecomm.fabric.sim.sim_host`). The SimFabric's own work
copies are plain buffers all the same (``fresh_clone(v, advise=False)``, :meth:`.linear.LinearOperand.work_copy`): they
model a real endpoint's, and the simulator holds every simulated worker's at once in one process.
"""

from __future__ import annotations

import ctypes
import sys

import torch

#: the huge page size the advice is aligned to (x86-64's and arm64's with 4 KiB base pages)
HUGE_PAGE_BYTES = 2 << 20
#: buffers of at least this many bytes are advised as huge pages: one huge page, the smallest buffer whose aligned
#: interior can hold one (module docstring: below glibc's mmap threshold too, a freed block's pages are often
#: handed back to the kernel and faulted afresh by the next call)
ADVISE_MIN_BYTES = HUGE_PAGE_BYTES
#: ``MADV_HUGEPAGE`` of Linux's ``<sys/mman.h>``
MADV_HUGEPAGE = 14


def _madvise():
    """libc's ``madvise`` through ctypes, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advises(nbytes: int, device: torch.device | str = "cpu") -> bool:
    """Whether :func:`fresh_empty` advises a buffer of ``nbytes`` on ``device`` as huge pages (its size and
    device only, whatever the machine: what a transport declares to a host model)."""
    return nbytes >= ADVISE_MIN_BYTES and torch.device(device).type == "cpu"


def advise_huge(t: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned interior of ``t``'s memory as huge pages (:data:`MADV_HUGEPAGE`), for a CPU
    tensor of at least :data:`ADVISE_MIN_BYTES` whose pages nothing has written yet; True if the kernel took
    the advice. Contents are untouched; a failure (no ``madvise``, a kernel without transparent huge pages)
    leaves the pages small."""
    if _MADVISE is None or not advises(t.nbytes, t.device):
        return False
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + t.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0


def fresh_empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)``, advised as huge pages when :func:`advises` says so
    (module docstring)."""
    out = torch.empty(numel, dtype=dtype, device=device)
    advise_huge(out)
    return out


def fresh_clone(v: torch.Tensor, advise: bool = True) -> torch.Tensor:
    """A contiguous copy of the flat vector ``v`` (the same bits) in a :func:`fresh_empty` buffer (under
    :data:`ADVISE_MIN_BYTES`, nothing to advise: ``clone``, without the calls around it); ``advise=False``: in a
    plain buffer whatever its size (``clone``), for a caller whose buffers are not the ones the advice is for
    (a SimFabric's: :meth:`~sparsecomm.transports.linear.LinearOperand.work_copy`)."""
    if not advise or v.numel() * v.element_size() < ADVISE_MIN_BYTES:
        return v.clone()
    return fresh_empty(v.numel(), v.dtype, v.device).copy_(v)
