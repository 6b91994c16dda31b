"""An OmniReduce aggregator's receive windows: receives consumed in the order they are posted, through
one pooled ring of bytes, so that an aggregator's memory for the workers' messages is the ring's,
whatever the number of workers (Fei et al., SIGCOMM'21, Sec. 4: ``lanes`` blocks per slot; here each
channel's ring holds a fixed number of its largest messages, :data:`.aggregator.WINDOW_MESSAGES`).
"""

from __future__ import annotations

from collections import deque

import torch

from ...errors import ProtocolError
from ...fabric.roles import PostInto

__all__ = ["ALIGN", "VIEWS", "Window"]


#: a message in a :class:`Window` starts at a multiple of this many bytes (any dtype's view of it is aligned)
ALIGN = 64
#: the ring views a :class:`Window` keeps for reuse (its first spans posted)
VIEWS = 16


class Window:
    """Receives consumed in the order they are posted, through one pooled ring of ``buf.numel()`` bytes:
    :meth:`want` queues a receive, :meth:`feed` posts the queued ones, in order, while the ring has room
    for them, :meth:`done` frees the oldest posted one once it is consumed. Its memory is the ring's,
    however many receives are queued (one larger than the ring is a bug). A receive's buffer is the ring's
    bytes ``[start, stop)``: a view of the first :data:`VIEWS` spans posted is kept and reused for the receives
    posted there later (two posted receives never share a span: their bytes do not overlap), so that receives
    of one size, which cycle through the same few spans, make no tensor each; the window's memory stays
    bounded whatever the sizes."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.size = buf.numel()         # (the ring's bytes, read per receive)
        self.queue: deque = deque()     # (key, nbytes, src, tag), not yet posted
        self.spans: deque = deque()     # (key, start, stop), posted, oldest first
        self.views: dict = {}           # (start, stop) -> the ring's view there
        self.room = VIEWS               # views that may still be kept

    def want(self, key, nbytes: int, src: int, tag: int) -> None:
        if not 0 < nbytes <= self.size:
            raise ProtocolError(f"omnireduce: a receive of {nbytes} bytes through a window of "
                                f"{self.size} (a bug)")
        self.queue.append((key, nbytes, src, tag))

    def posted(self) -> list:
        """The keys of the receives posted and not yet consumed, oldest first."""
        return [k for k, _, _ in self.spans]

    def feed(self) -> list:
        """The requests (:class:`PostInto`) that post the queued receives which fit now, in order."""
        out, queue, spans, size = [], self.queue, self.spans, self.size
        while queue:
            key, nbytes, src, tag = queue[0]
            # where it fits now (at a multiple of ALIGN), or None: in use is [tail, head) (room after it, or from
            # 0 up to it), or, wrapped around, all but [head, tail)
            if not spans:
                start = 0
            else:
                tail, head = spans[0][1], -(-spans[-1][2] // ALIGN) * ALIGN
                if head > tail:
                    start = head if head + nbytes <= size else (0 if nbytes <= tail else None)
                else:
                    start = head if head + nbytes <= tail else None
            if start is None:
                break
            queue.popleft()
            span, views = (start, start + nbytes), self.views
            if span in views:
                view = views[span]
            else:
                view = self.buf[start: start + nbytes]
                if self.room:
                    views[span] = view
                    self.room -= 1
            spans.append((key, start, start + nbytes))
            out.append(PostInto.new((key, view, src, tag)))
        return out

    def done(self, key) -> list:
        """The oldest posted receive, ``key``, is consumed: its room is free; returns :meth:`feed`'s posts."""
        if not self.spans or self.spans[0][0] != key:
            raise ProtocolError(f"omnireduce: {key} consumed out of its window's order (a bug)")
        self.spans.popleft()
        return self.feed()
