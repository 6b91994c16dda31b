"""Replica consistency: rank 0's initial parameters and buffers on every worker (as DDP broadcasts them),
or a check that every worker already holds them.

``sync_replicas(fabric, tensors, mode="broadcast"|"check")`` over any :class:`~sparsecomm.fabric.Fabric`
(point-to-point messages through rank 0, so it runs on SimFabric and TorchFabric alike):

1. rank 0 sends a fixed-size header (tensor count, total bytes, a digest of the shapes and dtypes) to
   every worker; each compares it with its own and answers with a verdict (and, for ``check``, a
   digest of its tensors' bytes); rank 0 decides and sends the decision to every worker;
2. on a mismatch every worker raises the same :class:`~sparsecomm.errors.MismatchError`; otherwise,
   for ``broadcast``, rank 0 sends its tensors' bytes (one message per dtype) and every worker copies
   them in.

Nothing a peer sends is unpickled or sized by the peer: every receive buffer has the size this rank
computed from its own tensors, after the header agreed.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch

from .errors import InvalidValueError, MismatchError

#: the tag of these messages (top of the int32 range, below the barrier's)
TAG = 2**31 - 6

_OK, _SHAPES, _VALUES = 0, 1, 2


def _digest(data: bytes) -> int:
    return struct.unpack("<q", hashlib.blake2b(data, digest_size=8).digest())[0]


def _layout_digest(tensors: Sequence[torch.Tensor]) -> int:
    return _digest(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode())


def _value_digest(tensors: Sequence[torch.Tensor]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return struct.unpack("<q", h.digest())[0]


def _groups(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


@torch.no_grad()
def sync_replicas(fabric, tensors: Sequence[torch.Tensor], mode: str = "broadcast") -> None:
    """Make (``broadcast``) or verify (``check``) ``tensors`` identical on every worker (see module doc)."""
    from .transports.base import drain

    if mode not in ("broadcast", "check"):
        raise InvalidValueError(f"mode must be 'broadcast' or 'check', got {mode!r}")
    n, rank = int(fabric.world_size), int(fabric.rank)
    if n == 1:
        return
    drain(fabric)                       # nothing of ours may be in flight on the fabric
    dev = fabric.device
    # dedupe (a tensor listed twice, shared parameters)
    seen: set[int] = set()
    ts = [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    header = torch.tensor([len(ts), nbytes, _layout_digest(ts)], dtype=torch.int64)
    values = _value_digest(ts) if mode == "check" else 0
    if rank == 0:
        for r in range(1, n):
            fabric.send(header.to(dev), r, TAG)
        worst, bad_rank = _OK, -1
        for r in range(1, n):
            reply = torch.zeros(2, dtype=torch.int64, device=dev)
            fabric.recv(reply, r, TAG)
            verdict = int(reply[0])
            if verdict == _OK and mode == "check" and int(reply[1]) != values:
                verdict = _VALUES
            if verdict != _OK and worst == _OK:
                worst, bad_rank = verdict, r
        decision = torch.tensor([worst, bad_rank], dtype=torch.int64)
        for r in range(1, n):
            fabric.send(decision.to(dev), r, TAG)
    else:
        theirs = torch.zeros(3, dtype=torch.int64, device=dev)
        fabric.recv(theirs, 0, TAG)
        ok = torch.equal(theirs.cpu(), header)
        reply = torch.tensor([_OK if ok else _SHAPES, values], dtype=torch.int64)
        fabric.send(reply.to(dev), 0, TAG)
        decision = torch.zeros(2, dtype=torch.int64, device=dev)
        fabric.recv(decision, 0, TAG)
        decision = decision.cpu()
    worst, bad_rank = int(decision[0]), int(decision[1])
    if worst == _SHAPES:
        raise MismatchError(
            f"the workers' models differ in their parameters' shapes or dtypes (worker {bad_rank} "
            f"disagrees with worker 0): every worker must build the same model")
    if worst == _VALUES:
        raise MismatchError(
            f"the workers start from different parameters (worker {bad_rank} differs from worker 0) and "
            f"init_sync='check' was asked; use init_sync='broadcast' (the default) to copy worker 0's, or "
            f"build the model identically on every worker (on the sim backend: `with ctx.seeded(0): "
            f"model = make_model()`)")
    if mode == "check":
        return
    for dtype, group in _groups(ts).items():
        flat_len = sum(t.numel() for t in group)
        if rank == 0:
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(dev)
            for r in range(1, n):
                fabric.send(flat, r, TAG)
        else:
            flat = torch.empty(flat_len, dtype=dtype, device=dev)
            fabric.recv(flat, 0, TAG)
            off = 0
            for t in group:
                k = t.numel()
                t.copy_(flat[off:off + k].view_as(t))
                off += k
