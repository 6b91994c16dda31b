"""The network's parameters as a collective sees them, measured on any fabric by every worker: the
one-way latency of a small message, the bandwidth of a large one and the host's cost of each further
message of a burst (the ``alpha``, ``B`` and per-message terms of the alpha-beta model,
:mod:`sparsecomm.theory.costs`).

Each figure times *ring shifts*: every worker posts a receive from its left neighbour, sends to its right
one and waits for both (the pattern of a handshake round or a ring step), so that in lock-step a shift
lasts one message's trip. On the SimFabric a shift of ``m`` bytes takes the model's ``latency_us`` plus
``m / B``; on real hosts it adds the kernel's path, gloo's and the threads' wake-ups.

- :func:`fabric_latency_s`: the median shift of a small message (``alpha``, serialisation included).
- :func:`link_parameters`: :class:`Link` ``(latency_s, bandwidth_Bps, per_message_s)``:
  ``B = (M - m) / (t_M - t_m)`` from a shift of ``M`` bytes against one of ``m``, and the host cost of a
  message ``c = max(0, (t_k - t_1) / (k - 1) - m / B)`` from a burst of ``k`` small messages against one
  (what a burst costs beyond its bytes on the wire: 0 on the SimFabric, whose messages cost only bytes
  and latency).

Every worker returns the same values: each figure is the median over workers of the per-worker medians,
gathered to worker 0 and sent back. Every function must be called by every worker, with nothing else in
flight on the fabric; a world of one measures nothing (zero latency and host cost, infinite bandwidth).
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

import torch

#: tag of the probe's messages (apart from the transports' and the handshake's)
LATENCY_TAG = 0x5C7A


class Link(NamedTuple):
    """A fabric's measured network parameters (the same on every worker)."""

    latency_s: float           # one-way latency of a small message, its serialisation included
    bandwidth_Bps: float       # bytes per second of one large message
    per_message_s: float       # host cost of each further message of a burst, beyond its bytes


def _shift_s(fabric, rounds: int, nbytes: int, messages: int, tag: int) -> float:
    """This worker's median time of a ring shift of ``messages`` messages of ``nbytes`` each."""
    n, r = fabric.world_size, fabric.rank
    out = torch.zeros(max(1, nbytes // 4), dtype=torch.int32)
    inps = [torch.empty_like(out) for _ in range(messages)]
    shifts = []
    fabric.barrier()
    for _ in range(rounds + 1):
        t0 = fabric.now()
        recvs = [fabric.irecv(inp, (r - 1) % n, tag) for inp in inps]
        sends = [fabric.isend(out, (r + 1) % n, tag) for _ in range(messages)]
        for w in recvs + sends:
            w.wait()
        shifts.append(fabric.now() - t0)
    return statistics.median(shifts[1:])


def _agreed(fabric, values: list[float], tag: int) -> list[float]:
    """The median over workers of each of ``values``, on every worker (gathered to worker 0, sent back)."""
    n, r = fabric.world_size, fabric.rank
    mine = torch.tensor(values, dtype=torch.float64)
    if r == 0:
        every = [mine.tolist()]
        for src in range(1, n):
            fabric.recv(mine, src, tag)
            every.append(mine.tolist())
        mine = torch.tensor([statistics.median(col) for col in zip(*every)], dtype=torch.float64)
        for dst in range(1, n):
            fabric.send(mine, dst, tag)
    else:
        fabric.send(mine, 0, tag)
        fabric.recv(mine, 0, tag)
    return [float(v) for v in mine.tolist()]


def fabric_latency_s(fabric, *, rounds: int = 30, nbytes: int = 256, tag: int = LATENCY_TAG) -> float:
    """One-way latency of an ``nbytes`` message between ring neighbours over ``fabric``, seconds: the
    median over ``rounds`` shifts (after a warm-up one) and over workers (see the module doc)."""
    if fabric.world_size == 1:
        return 0.0
    return _agreed(fabric, [_shift_s(fabric, rounds, nbytes, 1, tag)], tag)[0]


def link_parameters(fabric, *, rounds: int = 10, small: int = 256, large: int = 1 << 20, burst: int = 8,
                    tag: int = LATENCY_TAG) -> Link:
    """The fabric's :class:`Link`, measured by ring shifts of one ``small`` message, one ``large`` one and
    a burst of ``burst`` small ones (see the module doc for the formulas)."""
    if fabric.world_size == 1:
        return Link(0.0, math.inf, 0.0)
    t1, tl, tk = _agreed(fabric, [_shift_s(fabric, rounds, small, 1, tag), _shift_s(fabric, rounds, large, 1, tag),
                                  _shift_s(fabric, rounds, small, burst, tag)], tag)
    bw = (large - small) / (tl - t1) if tl > t1 else math.inf
    per_message = max(0.0, (tk - t1) / (burst - 1) - small / bw)
    return Link(t1, bw, per_message)
