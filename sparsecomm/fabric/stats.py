"""CommStats: the ledger of what one endpoint put on and took off the wire."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

#: an empty ``Counter`` (``Counter()`` without its ``__init__`` and ``update``, two Python calls that an empty
#: one does not need: a ledger is made per call and per step)
_empty_links = functools.partial(Counter.__new__, Counter)


@dataclass
class CommStats:
    """Bytes and messages of one endpoint, per link, plus rounds and (SimFabric) modelled time.

    ``messages`` counts messages *sent* by this endpoint. ``links`` maps ``(src, dst)`` to bytes
    carried on that directed link as seen from this endpoint (its sends and its receives).
    ``modelled_time_s`` is the virtual-clock time of the SimFabric network model (0 on real fabrics);
    ``wall_time_s`` is measured time. ``estimated_bytes``: how many of ``bytes_sent + bytes_received``
    were booked from a formula rather than measured (a transport whose traffic the library cannot see,
    e.g. ``native``: ``torch.distributed.all_reduce``); when it is non-zero, ``messages``,
    ``messages_received`` and ``rounds`` include estimated counts too (:attr:`estimated`).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    messages_received: int = 0
    rounds: int = 0
    modelled_time_s: float = 0.0
    wall_time_s: float = 0.0
    estimated_bytes: int = 0
    links: Counter = field(default_factory=_empty_links)

    def record_send(self, src: int, dst: int, nbytes: int) -> None:
        """Count one message of ``nbytes`` sent from endpoint ``src`` to endpoint ``dst``."""
        self.bytes_sent += nbytes
        self.messages += 1
        self.links[(src, dst)] += nbytes

    def record_recv(self, src: int, dst: int, nbytes: int) -> None:
        """Count one message of ``nbytes`` that endpoint ``dst`` received from endpoint ``src``."""
        self.bytes_received += nbytes
        self.messages_received += 1
        self.links[(src, dst)] += nbytes

    def unbook_recv(self, src: int, dst: int, nbytes: int) -> None:
        """Take back ``nbytes`` of a receive booked at its buffer's size that a shorter message filled (a
        real fabric fills a prefix of a larger receive; only the protocol that sent the message knows how
        long it was).

        Args:
            src: the sending endpoint of the receive.
            dst: the receiving endpoint.
            nbytes: the bytes the message was shorter than its buffer.
        """
        self.bytes_received -= nbytes
        self.links[(src, dst)] -= nbytes

    @property
    def estimated(self) -> bool:
        """True if some of these figures come from a formula, not from counting messages."""
        return self.estimated_bytes > 0

    def copy(self) -> "CommStats":
        """An independent copy (the ``links`` counter included)."""
        return CommStats(self.bytes_sent, self.bytes_received, self.messages, self.messages_received,
                         self.rounds, self.modelled_time_s, self.wall_time_s, self.estimated_bytes,
                         Counter(self.links) if self.links else _empty_links())

    def __sub__(self, other: "CommStats") -> "CommStats":
        if self.links or other.links:
            links = Counter(self.links)
            links.subtract(other.links)
            links = Counter({k: v for k, v in links.items() if v})
        else:
            links = _empty_links()
        return CommStats(self.bytes_sent - other.bytes_sent, self.bytes_received - other.bytes_received,
                         self.messages - other.messages, self.messages_received - other.messages_received,
                         self.rounds - other.rounds, self.modelled_time_s - other.modelled_time_s,
                         self.wall_time_s - other.wall_time_s, self.estimated_bytes - other.estimated_bytes,
                         links)

    def __add__(self, other: "CommStats") -> "CommStats":
        c = self.copy()
        c += other
        if not other.links:
            c.links = +c.links      # (the sum of two Counters keeps the positive counts only)
        return c

    def __iadd__(self, other: "CommStats") -> "CommStats":
        """Add ``other``'s figures into this one (in place)."""
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.messages += other.messages
        self.messages_received += other.messages_received
        self.rounds += other.rounds
        self.modelled_time_s += other.modelled_time_s
        self.wall_time_s += other.wall_time_s
        self.estimated_bytes += other.estimated_bytes
        if other.links:
            self.links = self.links + other.links
        return self

    def as_dict(self) -> dict:
        """Scalar fields only, for logging."""
        return {k: getattr(self, k) for k in self._scalars()}

    @staticmethod
    def _scalars() -> tuple[str, ...]:
        return ("bytes_sent", "bytes_received", "messages", "messages_received", "rounds",
                "modelled_time_s", "wall_time_s",
                "estimated_bytes")
