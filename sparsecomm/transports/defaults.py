"""Transport defaults that depend on the fabric: defaults are fast where they run (docs/transports.md, "Transports
and their defaults").

A setting that trades a message's fixed cost against pipelining (packets per message, the packet's size,
the lanes in flight) takes its default from what the fabric declares, its ``message_bytes``
(:mod:`sparsecomm.fabric.base`, "Capabilities"), never from the fabric's class:

- ``None``: a message is one datagram of a modelled network, which states its every cost (SimFabric).
  The papers' settings, which the reproductions compare with their closed forms
  (``tests/theory/test_switch_theory.py``, ``tests/theory/test_sparse_switch_theory.py``,
  ``experiments/reproduce_switchml.py``): one packet per message, the program's first packet size
  (SwitchML's one-pass 64 values), a pool of :data:`SIM_POOL` lanes.
- a size (real fabrics: 1 MiB over gloo): the program's largest packet (SwitchML's 256 values with
  recirculation: 8 header words per 256 values instead of per 64), up to as many packets per message as
  fill ``message_bytes`` (:func:`packets_per_message`: 1024 of 256 values; a message holds only the
  packets that are ready, so a small job pays its packets' bytes, not a burst's), and as many lanes as
  fill :data:`WINDOW_MESSAGES` messages (:func:`pool_size`: 8191 of the switch's 8192 slots; the sparse
  switch's 1024 slots allow 1023), so that the workers send a lane window's next messages while the switch
  answers the ones before, and a window's round trip fits in the time its bytes take on the link.
These defaults against the paper's settings: BENCHMARKS.md, "Transports on loopback" and "The switch
at 0.5 Gbit/s".

The switch program's constants (packet, packets per message) are the switch rank's: a rank started as
``services=["switch"]`` runs this fabric's program, and a worker that passes no constants talks to the
started one (:func:`.switchml.control.started_program`), so workers and switch agree without the user
giving the numbers twice. The other transports need no rule of their own: their defaults are the real
fabric's and the simulations that need others pass them (``ring``'s pipelined segments; ``omnireduce``'s
16384 lanes and 2 channels per aggregator, whose reproduction sets its own lanes), or they have no such
setting (``allgather``: one message per peer; ``native``: gloo's or NCCL's own algorithm).
"""

from __future__ import annotations

#: lanes of a switch job on a modelled network: above the bandwidth-delay product of the reproductions'
#: links (100 Gbit/s, 2 us: about 200 slots of 64 values)
SIM_POOL = 256
#: on a real fabric a switch job's lanes fill this many messages (8192 lanes of 1024-packet messages, less
#: the control slot: 8191 of the default 8192 slots). A lane's next packet leaves only when its result has
#: come back, so a worker's link stays busy only while a window's round trip (its message up, the slowest
#: worker's copy, the switch's program, the result down, the decode and the next encode) is shorter than the
#: window's bytes on the link: 73.5 ms at 1 Gbit/s, where the round trip of 4 netbed hosts sharing 2 cores
#: with the switch takes 46 ms (median; 59 at the 90th percentile, 76 at the 99th)
WINDOW_MESSAGES = 8


def packet_elems(fabric, sizes: tuple[int, ...]) -> int:
    """Values per packet: of a program's packet ``sizes`` (smallest first), the first on a modelled
    network (the paper's), the largest on a real fabric (fewer headers and rows per byte)."""
    return sizes[0] if fabric.message_bytes is None else sizes[-1]


def packets_per_message(fabric, elems: int, most: int | None = None) -> int:
    """Packets of ``elems`` int32 values per fabric message: one on a modelled network, else as many as
    fill the fabric's ``message_bytes`` (at least one, at most ``most``)."""
    if fabric.message_bytes is None:
        return 1
    k = max(1, fabric.message_bytes // (4 * elems))
    return k if most is None else min(k, most)


def pool_size(fabric, burst: int, slots: int) -> int:
    """Lanes (switch slots) a job keeps in flight: :data:`SIM_POOL` on a modelled network, else
    :data:`WINDOW_MESSAGES` messages of ``burst`` packets; at most ``slots - 1`` (slot 0 is the control
    slot)."""
    lanes = SIM_POOL if fabric.message_bytes is None else WINDOW_MESSAGES * burst
    return max(1, min(lanes, slots - 1))
