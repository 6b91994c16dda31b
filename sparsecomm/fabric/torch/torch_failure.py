"""TorchFabric's failure propagation (:class:`FailStop`): one failure record per job, and every rank
stopped at once.

Failure propagation (fail-stop). The first rank that sees a failure -- an error it raises that the others
may not see (a malformed message, a transport disagreement only it detected, an exception out of ``fn``:
:meth:`FailStop.fail`), or a connection to a peer that closed (a peer died) -- writes one record
(error class name, rank, text: plain text, never pickled) under ``<shutdown_key>/failed`` in the
rendezvous store (first writer wins; the spawning launcher writes it too when a rank exits without a
report, e.g. after kill -9), then *trips* its process group: a deliberately timed-out receive makes gloo
close every connection of this rank, which ends every wait of this process and every peer's wait on it
at once. A watchdog thread per rank polls the record every 50 ms and trips its own group when another
rank wrote it. Every wait that ends that way raises the recorded error's class (from
:data:`sparsecomm.errors.REPORTABLE`; :class:`PeerFailure` otherwise) naming the rank that failed first
-- a dead worker, not the switch or survivor that noticed it. After a failure the fabric is unusable.
gloo errors raised while *posting* a send or receive (a connection already closed) are
:class:`PeerFailure` too, never a raw ``RuntimeError``. On nccl, waits poll ``is_completed()`` under
the same ``timeout_s`` and the failure record, so no wait is unbounded.

Naming the dead rank. A rank that loses a connection first waits up to ``_ROOT_GRACE_S`` for a failure
record (a rank that raised, timed out or tripped wrote one before closing its connections; the
spawning launcher writes one for a rank that died). Without one, a point-to-point wait names the peer
of the closed connection; a collective (:meth:`FailStop.collective_error`: ``native``'s all-reduce and
all-gather, the launcher's results gather) names a rank whose connection with this one is closed: a
receive posted on a closed gloo connection fails at once, one posted on an open connection stays
pending, so one receive posted (never waited for) per peer finds them. Since every trip follows its
record, a connection found closed with no record in the store is one whose rank died.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from datetime import timedelta
from typing import Sequence

import torch

from ...errors import REPORTABLE, FabricTimeout, PeerFailure, ServiceShutdown
from .torch_ranks import JobRanks

MAX_TAG = 2**31 - 1
_WATCH_S = 0.05            # how often a rank polls the failure record
_ROOT_GRACE_S = 1.0        # how long a rank that lost a connection waits for a failure record naming the root
_TRIP_TAG = MAX_TAG - 7    # the tag of the receive that is timed out on purpose to trip the group
_PROBE_TAG = MAX_TAG - 8   # the tag of the receives posted (never waited for) to find closed connections
_SEP = "\x1f"


def encode_failure(exc: BaseException | str, rank: int, kind: str | None = None) -> str:
    """The failure record's text: error class name, rank, message (never pickled)."""
    if isinstance(exc, BaseException):
        kind = kind or type(exc).__name__
        text = str(exc).strip() or repr(exc)
    else:
        kind, text = kind or "PeerFailure", str(exc)
    return f"{kind}{_SEP}{int(rank)}{_SEP}{text[:4000]}"


def decode_failure(raw: bytes | str) -> tuple[str, int, str]:
    """``(class name, rank, text)`` of a failure record (plain text; malformed records read as text)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    parts = text.split(_SEP, 2)
    if len(parts) == 3 and parts[1].lstrip("-").isdigit():
        return parts[0], int(parts[1]), parts[2]
    return "PeerFailure", -1, text


def _timed_out(exc: BaseException) -> bool:
    msg = str(exc)
    return "Timed out" in msg or "timed out" in msg or "Timeout" in msg


def _last_line(exc: BaseException) -> str:
    msg = str(exc).strip()
    return msg.splitlines()[-1] if msg else repr(exc)


def _watch(ref, store, key: str) -> None:
    """The watchdog of one rank's :class:`FailStop` (a weak reference): trip it when another rank reports
    a failure."""
    while True:
        time.sleep(_WATCH_S)
        fs = ref()
        if fs is None or fs._failure is not None or fs._closed:
            return
        try:
            if not store.check([key]):
                del fs
                continue
            raw = store.get(key)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            return
        fs._adopt(raw)
        return


def _close_at_exit(ref) -> None:
    fs = ref()
    if fs is not None and not fs._closed:
        fs.close()


class FailStop:
    """One rank's part in the job's fail-stop propagation (see the module docstring).

    ``ranks`` names the job's ranks; ``store`` is the rendezvous store (``None``: no record, no
    watchdog) and ``key`` the failure record's key in it; ``timeout_s`` the fabric's bound on a wait.
    ``trips`` lists ``(group, this rank's rank in it, its size)`` for every gloo group of this rank that
    a trip closes; ``probes`` is the group (of every rank of the job) on which :meth:`collective_error`
    looks for closed connections. ``cuda`` (nccl): nothing to trip or probe; waits poll :attr:`failure`.
    With a store and more than one rank, a watchdog thread polls the record until :meth:`close`.
    """

    def __init__(self, rank: int, ranks: JobRanks, *, store, key: str, timeout_s: float, cuda: bool,
                 trips: Sequence[tuple[object, int, int]] = (), probes: object | None = None) -> None:
        self._rank = rank
        self._ranks = ranks
        self._store = store
        self._key = key
        self._timeout_s = timeout_s
        self._cuda = cuda
        self._trips = list(trips)
        self._probe_group = probes
        self._probes: list = []            # receives posted to find closed connections (module docstring)
        self._failure: tuple[str, int, str] | None = None
        self._closed = False
        self._watchdog: threading.Thread | None = None
        if store is not None and ranks.total > 1:
            ref = weakref.ref(self)
            self._watchdog = threading.Thread(target=_watch, args=(ref, store, key),
                                              name="sparsecomm-watchdog", daemon=True)
            self._watchdog.start()
            # a fabric nobody closes (the DDP hook's, in a user's script): stop the watchdog before the
            # interpreter finalizes, or a poll of the store still in C++ then aborts the process
            atexit.register(_close_at_exit, ref)

    @property
    def failure(self) -> tuple[str, int, str] | None:
        """``(error class name, rank, text)`` of the first failure reported in the job, once known."""
        return self._failure

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: the run is over on this rank."""
        return self._closed

    def close(self) -> None:
        """Stop the watchdog (before the process group is destroyed: a thread still polling the store
        during teardown can abort the process)."""
        self._closed = True
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2 * _WATCH_S + 1.0)

    def fail(self, exc: BaseException | str, rank: int | None = None) -> None:
        """Report a failure to every rank (see "Failure propagation" in the module docstring): record it
        in the store unless another failure came first, then trip this rank's groups."""
        if self._failure is not None:
            return
        record = encode_failure(exc, self._rank if rank is None else rank)
        if self._store is not None:
            try:
                record = self._store.compare_set(self._key, "", record)
            except Exception:  # noqa: BLE001 - the store is gone; keep the local record
                pass
        self._adopt(record)

    def _adopt(self, raw) -> None:
        """Take ``raw`` as the job's first failure and trip this rank's groups (idempotent)."""
        if self._failure is not None:
            return
        self._failure = decode_failure(raw)
        self.trip()

    def trip(self) -> None:
        """Close every gloo connection of this rank: a receive timed out on purpose does it (gloo closes
        the context's pairs on a timeout), which ends every pending wait here and every peer's wait on
        this rank. nccl waits poll :attr:`failure` instead."""
        if self._cuda or self._ranks.total < 2:
            return
        for g, mine, size in self._trips:
            # a receive from a peer whose connection is already closed fails at once without closing the
            # others; only a timed-out one closes the whole context, so try peers until one times out
            for peer in [p for p in range(size) if p != mine]:
                try:
                    g.recv([torch.zeros(1)], peer, _TRIP_TAG).wait(timedelta(milliseconds=1))
                except Exception as exc:  # noqa: BLE001 - expected: the timeout is the point
                    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                        break

    def error(self) -> BaseException:
        """The job's recorded failure as the error this rank raises (requires :attr:`failure`): its class
        (from :data:`~sparsecomm.errors.REPORTABLE`; :class:`PeerFailure` otherwise), naming the rank
        that failed first."""
        kind, rank, text = self._failure
        cls = REPORTABLE.get(kind, PeerFailure)
        me = self._ranks.name(self._rank)
        if rank == self._rank:
            return cls(f"{me}: {text}")
        who = self._ranks.name(rank) if rank >= 0 else "a rank"
        if cls is PeerFailure and kind != "PeerFailure":
            err = PeerFailure(f"{me}: stopped because {who} failed first: {kind}: {text}")
        else:
            err = cls(f"{me}: stopped because {who} failed first: {text}")
        err.sparsecomm_origin = rank     # a consequence of another rank's failure (the launcher reads it)
        return err

    def check(self) -> None:
        """Raise the job's recorded failure, if there is one."""
        if self._failure is not None:
            raise self.error()

    def wait_error(self, exc: BaseException, *, peer: int | None, tag: int, is_recv: bool,
                   limit: float | None) -> BaseException:
        """The library's error for a point-to-point operation with ``peer`` on ``tag`` (a receive if
        ``is_recv``) whose posting or wait (bounded by ``limit`` s; ``None``: ``timeout_s``) raised
        ``exc``: the recorded failure; :class:`ServiceShutdown` once closed (a wait left posted, ended by
        the fabric's release); :class:`FabricTimeout` for a timeout; else a lost connection, named as
        the module docstring says. A timeout and a lost connection are reported to every rank."""
        if self._failure is not None:        # this rank tripped itself after a failure report
            return self.error()
        if self._closed:                     # the run is over (a wait left posted, ended by ``release``)
            return ServiceShutdown("the run is over")
        if _timed_out(exc):
            return self._timed_out(
                f"no {'message from' if is_recv else 'send to'} {self._ranks.name(peer)} (tag {tag}) "
                f"completed within {limit if limit is not None else self._timeout_s:.6g} s", exc)
        return self._lost(peer, f"(tag {tag})", exc)

    def collective_error(self, exc: BaseException, what: str) -> BaseException:
        """The library's error for the torch.distributed collective ``what`` (on any group of this job)
        having raised ``exc``: the job's recorded failure if there is one; a timeout is
        :class:`FabricTimeout`; a lost connection is :class:`PeerFailure` naming the rank that failed first,
        found as the module docstring says ("Naming the dead rank"). Either is reported to every rank."""
        if self._failure is not None:
            return self.error()
        if _timed_out(exc):
            return self._timed_out(f"torch.distributed {what} did not complete within {self._timeout_s:.6g} s",
                                   exc)
        return self._lost(None, f"during torch.distributed {what}", exc)

    def _timed_out(self, what: str, exc: BaseException) -> BaseException:
        err = FabricTimeout(f"{self._ranks.name(self._rank)}: {what}; torch.distributed: {_last_line(exc)}")
        self.fail(err)
        return err if self._failure is None or self._failure[1] == self._rank else self.error()

    def _lost(self, peer: int | None, where: str, exc: BaseException) -> BaseException:
        """A connection closed (a peer died, or tripped after a failure report): the first failure, named
        by its record when one comes within the grace, else the peer of the closed connection (``peer``;
        for a collective: found by :meth:`_closed_peers`)."""
        raw = self._await_record(_ROOT_GRACE_S)
        if raw is not None:
            self._adopt(raw)
            return self.error()
        closed = [peer] if peer is not None else self._closed_peers()
        who = " and ".join(self._ranks.name(r) for r in closed) or "a rank"
        self.fail(f"lost the connection with {who} {where}: it died or was killed "
                  f"(torch.distributed: {_last_line(exc)})", rank=closed[0] if closed else -1)
        return self.error()

    def _closed_peers(self) -> list[int]:
        """The ranks whose gloo connection with this rank is closed, found by posting one receive per peer
        (module docstring); the receives stay posted, kept here, the fabric being unusable after a
        failure anyway. Empty on nccl (no per-connection state to read)."""
        if self._cuda or self._probe_group is None:
            return []
        closed = []
        for peer in range(self._ranks.total):
            if peer == self._rank:
                continue
            try:
                self._probes.append(self._probe_group.recv([torch.zeros(1)], peer, _PROBE_TAG))
            except RuntimeError:
                closed.append(peer)
        return closed

    def _await_record(self, grace: float):
        """The failure record, waiting up to ``grace`` s for one (the launcher writes it when a rank dies)."""
        if self._store is None:
            return None
        deadline = time.monotonic() + grace
        while True:
            try:
                if self._store.check([self._key]):
                    return self._store.get(self._key)
            except Exception:  # noqa: BLE001 - the store is gone
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
