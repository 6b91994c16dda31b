"""The pipeline's byte counts, kept in one place for every kind of round: :class:`Accounting` records
each completed round (its declared payload bytes, scaled by the transport's
:meth:`~sparsecomm.transports.base.Transport.wire_copies`, and
the transport's measured :class:`~sparsecomm.fabric.stats.CommStats`) and each call (the dense bytes it
stands for) into :class:`CompressionStats`, the cumulative figures ``compression_stats()`` reports."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..deprecation import warn_renamed
from ..fabric.stats import CommStats


class Stats(dict):
    """The dict ``compression_stats()`` returns: renamed keys stay readable (``stats["ratio"]``, ``.get``)
    with a :class:`FutureWarning` naming the new key; they are not listed among its keys."""

    renamed: ClassVar[dict[str, str]] = {"ratio": "compression_factor", "ratio_sent": "compression_factor_sent",
                                         "iterations": "steps"}

    def __missing__(self, key: Any) -> Any:
        new = self.renamed.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        warn_renamed(f"compression_stats()[{key!r}]", f"[{new!r}]")
        return self[new]

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self or (self.renamed.get(key) in self):
            return self[key]
        return default


@dataclass
class CompressionStats:
    """Cumulative counters of a pipeline (bytes are per worker)."""

    rounds: int = 0             # aggregations (a multi-round method counts each of its rounds)
    bytes_dense: int = 0        # what plain fp32/fp64 allreduce inputs would be
    bytes_payload: int = 0      # what the compressor declares it sends (Payload.bits / 8)
    comm: CommStats = field(default_factory=CommStats)
    bytes_declared_sent: float = 0.0   # declared bytes x the transport's wire_copies()
    bytes_dense_sent: float = 0.0      # dense bytes x the transport's wire_copies()
    #: steps dropped on every worker for a non-finite sum (``nonfinite="skip"``)
    skipped_steps: int = 0
    #: rounds whose payload counted an underflow of a rounding cast (``fp16``/``bf16`` with
    #: ``underflow="count"``: entries rounded below the declared contraction), summed over the workers'
    #: own payloads on this worker
    underflow_rounds: int = 0
    #: ``transport="auto"``'s decision table (:meth:`sparsecomm.pipeline.auto.Chooser.table`), else empty
    decisions: list = field(default_factory=list)

    def as_dict(self) -> Stats:
        """Declared figures (``bytes_payload``; ``compression_factor``, dense bytes / declared payload
        bytes: 4.0 for ``ratio=0.25`` rand-k, whose ``ratio`` is the kept fraction) next to measured ones
        (``bytes_sent`` from the transport's ledger, headers included), and how they compare:
        ``bytes_declared_sent`` is what the ledger would show if every payload travelled as declared
        (declared bytes x the transport's ``wire_copies()``), ``sent_over_declared`` the measured / that
        (about 1 when the wire carries the declared bits; 3.56 for natural on a summing transport, tens
        for scattered top-k through omnireduce's blocks), ``compression_factor_sent`` the compression
        factor measured on the wire (dense bytes x ``wire_copies()`` / bytes sent). (``ratio`` and
        ``ratio_sent`` are deprecated names of the two factors: :class:`Stats`.) Under
        ``transport="auto"``, ``transport_decisions`` is the table of its per-bucket choices. ``skipped_steps``:
        the steps ``nonfinite="skip"`` dropped; ``underflow_rounds``: this worker's rounds whose fp16/bf16 cast
        lost more than its declared contraction to underflow (``underflow="count"``)."""
        nan = float("nan")
        sent = self.comm.bytes_sent
        extra = {"transport_decisions": [dict(d) for d in self.decisions]} if self.decisions else {}
        return Stats({**extra,
            "rounds": self.rounds, "bytes_dense": self.bytes_dense, "bytes_payload": self.bytes_payload,
            "compression_factor": self.bytes_dense / self.bytes_payload if self.bytes_payload else nan,
            "bytes_sent": sent, "bytes_received": self.comm.bytes_received,
            "messages": self.comm.messages, "modelled_time_s": self.comm.modelled_time_s,
            "bytes_declared_sent": self.bytes_declared_sent,
            "sent_over_declared": sent / self.bytes_declared_sent if self.bytes_declared_sent else nan,
            "compression_factor_sent": self.bytes_dense_sent / sent if sent else nan,
            "skipped_steps": self.skipped_steps, "underflow_rounds": self.underflow_rounds})


def payload_bytes(p: Any) -> int:
    """The declared bytes of a round's message: a tensor's bytes, a Payload's ``bits`` rounded up to
    bytes (its wire tensors' bytes when it declares none)."""
    if isinstance(p, torch.Tensor):
        return p.nbytes
    bits = int(p.bits)
    if bits:
        return (bits + 7) // 8
    return sum(t.numel() * t.element_size() for t in p.wire_tensors())


class Accounting:
    """The byte counts of one pipeline over ``transport``: the cumulative :attr:`stats` and the current
    step's :attr:`last_stats` (the transport's CommStats summed over the step's rounds). Every round of
    every kind (a bucket's, a parameter-wise bucket's, a later round of PowerSGD, a row-sparse gather) is
    recorded by :meth:`round` once its sum is in, and every call by :meth:`call`; both scale the declared
    bytes by the transport's ``wire_copies()`` (:attr:`copies`, a property of its configuration)."""

    def __init__(self, transport: Any) -> None:
        self.copies = float(transport.wire_copies())
        # rounds complete on several communication threads at once where the calls run on lanes
        # (:mod:`sparsecomm.pipeline.lanes`): each record is added whole
        self._lock = threading.Lock()
        #: the cumulative figures, the current step's rounds included
        self.stats = CompressionStats()
        #: the current step's CommStats, summed over its rounds
        self.last_stats = CommStats()

    def round(self, payload: Any, comm: CommStats, copies: float | None = None) -> None:
        """A completed round that sent ``payload`` (a tensor or a Payload: its declared bytes) and whose
        transport measured ``comm`` (``copies``: the sending transport's, when another than the
        pipeline's sent it)."""
        copies = self.copies if copies is None else copies
        if isinstance(payload, torch.Tensor):
            pbytes, underflow = payload.nbytes, False
        else:
            pbytes, underflow = payload_bytes(payload), bool(payload.meta.get("underflow"))
        with self._lock:
            s = self.stats
            s.rounds += 1
            s.underflow_rounds += underflow
            s.bytes_payload += pbytes
            s.bytes_declared_sent += copies * pbytes
            s.comm += comm
            self.last_stats += comm

    def finished(self, dense_bytes: int, payload: Any, comm: CommStats, copies: float | None = None) -> None:
        """A call's end: :meth:`call` (``dense_bytes``), then :meth:`round` of its last round (``payload``,
        ``comm``; ``copies`` as they take it): the same figures, added in the same order, with the call's inline."""
        with self._lock:
            s = self.stats
            s.bytes_dense += dense_bytes
            s.bytes_dense_sent += (self.copies if copies is None else copies) * dense_bytes
        self.round(payload, comm, copies)

    def finished_plain(self, nbytes: int, comm: CommStats) -> None:
        """:meth:`finished` of a plain average's call, whose one round sent the ``nbytes`` of its dense bucket
        (a tensor: ``payload.nbytes``): the same figures, added in the same order, in one call."""
        with self._lock:
            s, copies = self.stats, self.copies
            s.bytes_dense += nbytes
            s.bytes_dense_sent += copies * nbytes
            s.rounds += 1
            s.bytes_payload += nbytes
            s.bytes_declared_sent += copies * nbytes
            s.comm += comm
            self.last_stats += comm

    def call(self, dense_bytes: int, copies: float | None = None) -> None:
        """A call standing for ``dense_bytes`` of uncompressed gradient (``copies``: as :meth:`round`)."""
        with self._lock:
            self.stats.bytes_dense += dense_bytes
            self.stats.bytes_dense_sent += (self.copies if copies is None else copies) * dense_bytes

    def begin_step(self) -> None:
        """A new step: :attr:`last_stats` restarts."""
        with self._lock:
            self.last_stats = CommStats()
