"""The Fabric contract: point-to-point messages between endpoints, written against once by every protocol.

Endpoints are numbered: workers are ``0 .. world_size-1``; *services* (dedicated OmniReduce
aggregators, a SwitchML switch) get ids ``>= world_size`` through :meth:`Fabric.service`.

Semantics every implementation keeps (they are what lets one protocol run on :class:`SimFabric` and on
``TorchFabric`` unchanged):

- ``send(tensor, dst)`` is blocking until ``tensor`` may be reused; ``isend`` returns a :class:`Work`;
  ``isend_each(tensor, dsts, tag, works, reliable=True)`` is ``isend`` to each of ``dsts`` in order.
  ``stable=True`` on ``isend``/``isend_each``: the caller does not write ``tensor`` until the message has
  been taken, so a fabric that would copy it may keep a reference (:meth:`Fabric.isend`).
- ``recv(tensor, src)`` fills the pre-allocated ``tensor`` in place (the receiver must know the
  message's shape and dtype, as with ``torch.distributed``); a message of another shape or dtype
  raises :class:`~sparsecomm.errors.MismatchError`. ``src=None`` receives from any source. It
  returns the source endpoint id.
- Messages between one (src, dst, tag) are delivered in the order they were sent.
- *Express tags* (:func:`express`, a range of tags): a protocol's small control messages whose delay holds
  up the peer (a verdict it must have before it posts the receives of the data), which it does not want
  queued behind the bulk data it is sending the same peer. A fabric may carry them on a path of their own,
  keeping the order per (src, dst, tag): ``TorchFabric`` with two-way channels, between workers, on the pair's
  connection whose direction carries no data; the SimFabric models them as any other message (one NIC
  queue per endpoint). An express receive names its source (``src=None`` raises
  :class:`~sparsecomm.errors.IncompatibleError`).
- ``reliable=False`` on a send marks a datagram channel: the network model may drop it (loss), and
  the receiver then relies on ``timeout=`` (modelled seconds on SimFabric, wall seconds on real
  fabrics) to notice. Reliable sends are never dropped.
- Any wait longer than the fabric's ``timeout_s`` raises :class:`~sparsecomm.errors.FabricTimeout`;
  when another endpoint failed, waits raise :class:`~sparsecomm.errors.PeerFailure` naming it.
- ``wait_any(works)`` blocks until one of several posted operations has completed and returns its
  index, so that an endpoint can serve whichever of its peers is ready first (an event-driven loop);
  SimFabric picks the receive delivered first in *modelled* time, deterministically.
- ``stats`` is this endpoint's cumulative :class:`CommStats`; transports report per-call deltas.
- ``drive(roles, inbox, outbox)`` runs a protocol written as roles (generators yielding their I/O,
  :mod:`.roles`) on this endpoint until every one has returned; every fabric runs the same roles.

Capabilities. Layers above ask a fabric what it can do, never which class it is:

- ``modelled_time``: ``now()`` is a modelled clock (a blocking send occupies the sender's modelled NIC
  until its last byte, a message is one datagram of the model, ``timeout=`` is in modelled seconds);
  ``False``: wall time on a real network.
- ``in_process_services``: ``service(name, main)`` runs ``main`` itself (a thread of this process);
  ``False``: a service is a rank the launcher started, found by its spec in ``services()``.
- ``native_group``: a ``torch.distributed`` process group of exactly the workers, over which
  collectives (``all_reduce``) run, or ``None`` where there is none.
- ``lane_refusal()``: None where the fabric builds *lanes* (``lane()``: another fabric of the same workers on
  channels of its own, for calls in flight together, :mod:`sparsecomm.pipeline.lanes`), else why not.
- ``device``: where message tensors live. ``serial_pairs``: a pair's messages share one ordered channel
  whatever their tag or direction (nccl).
- ``direct_waits``: ``wait_unbounded(work)`` waits on the calling thread itself, with no deadline and no
  helper thread (a service's receive threads, one wake-up per message), and ``wait_for_shutdown(stop)``
  watches a service rank's end of the run for them; ``False``: a service thread waits with ``work.wait()``.
- ``charges_host_work``: ``host_work(...)`` may charge time (a SimFabric whose network has a host model);
  ``False``: it is a no-op, and a caller may skip it and whatever it counts only to declare it.
- ``message_bytes``: how many bytes a message should carry for this fabric's fixed cost per message to be
  amortised; a protocol that may put several packets in one message (the switches' bursts) fills
  messages of about this size, and takes its other defaults from it (the transports' module docstrings,
  "Defaults"). ``None``: a message is one datagram of a modelled network, whose model states its every
  cost (SimFabric), so protocols send their packets one per message, as the papers do, and keep the
  papers' settings, which the reproductions compare with their closed forms. On a real fabric (the
  default, TorchFabric) :data:`MESSAGE_BYTES`, 1 MiB: over gloo and TCP a message costs the hosts a
  fixed CPU time beyond its bytes (the receiver's "receive posted" notice, system calls, thread
  wake-ups), which a message of this size amortises; the fixed cost and what a longer message still
  gains: BENCHMARKS.md, "Transports on loopback". The defaults each transport derives from it: docs/transports.md,
  "Transports and their defaults".
- ``native_messages()``: a context in which the endpoint's messages are those of the fabric's native collective
  library (gloo's C++ ring), which a model of the hosts charges at its own rates; elsewhere nothing.
- ``scratch``: a dict that lives and dies with this endpoint, where a layer above keeps its per-fabric
  state (a transport's caches) instead of a module-level dict keyed by fabric; ``world_scratch``: a
  dict shared by every endpoint of this job that lives in this process (the simulated world's; on a
  one-rank-per-process fabric, ``scratch`` itself). Keys are namespaced by their owner (``"switch/..."``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, ContextManager, Generator, Iterable, Sequence

import torch

from ..errors import IncompatibleError, InvalidValueError
from . import roles as _roles
from .stats import CommStats

#: a real fabric's ``message_bytes`` (module docstring, "Capabilities")
MESSAGE_BYTES = 1 << 20

#: the express tags (module docstring): ``EXPRESS_BASE + t`` for ``0 <= t < EXPRESS_SPAN`` (:func:`express`)
EXPRESS_BASE, EXPRESS_SPAN = 0x40000000, 1 << 24


def express(tag: int) -> int:
    """The express tag of a protocol's tag ``tag`` (``0 <= tag < EXPRESS_SPAN``): its small control messages
    that a fabric may carry apart from the bulk data to the same peer (module docstring)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < EXPRESS_SPAN:
        raise InvalidValueError(f"express: a protocol's tag in [0, {EXPRESS_SPAN:#x}), got {tag!r}")
    return EXPRESS_BASE + tag


def is_express(tag: int) -> bool:
    """Is ``tag`` an express tag (:func:`express`)?"""
    return EXPRESS_BASE <= tag < EXPRESS_BASE + EXPRESS_SPAN


def check_any_source(tag: int) -> None:
    """A receive from any source on ``tag``: :class:`~sparsecomm.errors.IncompatibleError` if ``tag`` is express (module
    docstring: an express receive names its source)."""
    if is_express(tag):
        raise IncompatibleError(f"a receive on express tag {tag:#x} must name its source (src=None: a fabric may "
                                f"carry express messages on paths of their own, per source)")


class Work(ABC):
    """Handle of an asynchronous send or receive."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Block until complete; for a receive, return the source endpoint id.

        Args:
            timeout: seconds to wait at most (modelled seconds on SimFabric), raising ``FabricTimeout``;
                ``None``: the fabric's ``timeout_s``.
        """

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation has completed."""


class Fabric(ABC):
    """Point-to-point messaging between numbered endpoints with a :class:`CommStats` ledger."""

    rank: int
    world_size: int
    stats: CommStats
    timeout_s: float

    #: capabilities (see the module docstring); implementations override the ones they have
    modelled_time: bool = False
    in_process_services: bool = False
    serial_pairs: bool = False
    direct_waits: bool = False
    charges_host_work: bool = False
    message_bytes: int | None = MESSAGE_BYTES

    @property
    def native_group(self) -> object | None:
        """The workers' ``torch.distributed`` process group for collectives, or ``None``."""
        return None

    @property
    def scratch(self) -> dict:
        """Per-endpoint state of the layers above (see the module docstring)."""
        d = self.__dict__.get("_scratch")
        if d is None:
            d = self.__dict__.setdefault("_scratch", {})
        return d

    @property
    def world_scratch(self) -> dict:
        """State shared by this job's endpoints in this process (default: :attr:`scratch`)."""
        return self.scratch

    @property
    def device(self) -> torch.device:
        """Where this fabric wants message tensors (``cuda`` for nccl, ``cpu`` otherwise)."""
        return torch.device("cpu")

    @property
    def is_worker(self) -> bool:
        """True on a worker rank, false on a service rank (a switch, an aggregator)."""
        return self.rank < self.world_size

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        """Send ``tensor`` to endpoint ``dst``; returns when ``tensor`` may be reused.

        Args:
            tensor: the message (contiguous).
            dst: the receiving endpoint.
            tag: the message tag: a receive takes only messages sent with the same tag (in order per (src,
                dst, tag))
            reliable: False marks a datagram the network model may drop (``Network.loss``); real fabrics
                deliver every message, and reliable sends are never dropped
        """

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        """Receive into ``tensor`` from ``src`` (any source if ``None``); return the source id.

        ``timeout`` (modelled seconds on SimFabric) raises :class:`FabricTimeout` if nothing
        arrives in time; without it the fabric-wide ``timeout_s`` applies.

        Args:
            tensor: the buffer the message fills (a shorter message fills a prefix).
            src: the sending endpoint, ``None`` for any.
            tag: the message tag: a receive takes only messages sent with the same tag (in order per (src,
                dst, tag))
            timeout: see above.
        """

    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True,
              stable: bool = False) -> Work:
        """Start sending ``tensor``; the caller must not modify it until ``wait()`` returns.

        Args:
            tensor: the message.
            dst: the receiving endpoint.
            tag: the message tag: a receive takes only messages sent with the same tag (in order per (src,
                dst, tag))
            reliable: False marks a datagram the network model may drop (``Network.loss``); real fabrics
                deliver every message, and reliable sends are never dropped
            stable: the caller's promise that nothing writes ``tensor`` until the receiver has taken the
                message (not only until ``wait()`` returns): it is written, if ever, only after this endpoint
                has received something the receiver sent once it had taken it, or the bytes no longer matter
                (the call failed). A fabric whose send completes before the message is taken, and which
                therefore copies it (:class:`~.sim.SimFabric`), may then keep a reference instead of the
                copy; a fabric that reads the caller's tensor until the send completes anyway
                (:class:`~.torch.TorchFabric`) ignores it. ``False``: no promise beyond the one above.
        """

    def isend_each(self, tensor: torch.Tensor, dsts: Sequence[int], tag: int, works: list, *,
                   reliable: bool = True, stable: bool = False) -> list:
        """Start sending ``tensor`` to each endpoint of ``dsts``, in that order, on ``tag``: what ``isend`` per
        endpoint does, which this generic version is (a real fabric's wire is the same);
        a fabric may start them in one pass (:class:`~.roles.SendEach`). Each send's :class:`Work` is
        appended to ``works`` as it starts (so that an error leaves the caller those started before it), which
        is returned. A wrapper that intercepts ``isend`` and delegates the rest to the fabric it wraps sets
        ``isend_each = Fabric.isend_each``, so that these sends pass through its ``isend`` too.

        Args:
            tensor: the message, the same for every endpoint.
            dsts: the receiving endpoints.
            tag: the message tag.
            works: the list the sends' operations are appended to.
            reliable: as for :meth:`isend`, for every send (a switch's multicast of a result is datagrams).
            stable: as for :meth:`isend`, for every send.
        """
        promise = {"stable": True} if stable else {}     # (an ``isend`` of before the flag is called as it was)
        for dst in dsts:
            works.append(self.isend(tensor, dst, tag, reliable=reliable, **promise))
        return works

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor``.

        The buffer belongs to the fabric from this call until the receive is seen complete (its
        ``wait()`` returned, or ``wait_any`` returned an element holding it): the caller must neither
        read nor write it before, as the fabric may write the message into it at any moment between.

        Args:
            tensor: the buffer the message fills.
            src: the sending endpoint, ``None`` for any.
            tag: the message tag: a receive takes only messages sent with the same tag (in order per (src,
                dst, tag))
        """

    def wait_any(self, works: Sequence[Work | Sequence[Work]]) -> int:
        """Block until one element of ``works`` has completed and return its index; an element is an
        operation or a list of operations (complete once all of them are), and its operations have
        been waited for. Among the receives, at most one per ``(src, tag)``, and it must be the next
        one posted on that ``(src, tag)`` (receives on one channel complete in posting order).

        List the elements in order of preference. This generic version polls ``is_completed()`` and
        returns the lowest index complete, backing off from 10 us to 1 ms, bounded by ``timeout_s``;
        :class:`SimFabric` returns the lowest index complete by the time the first element completes
        in modelled time, deterministically.
        """
        import time

        from ..errors import FabricTimeout

        if not works:
            raise InvalidValueError("wait_any needs at least one operation")
        groups = [list(el) if isinstance(el, (list, tuple)) else [el] for el in works]
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-5
        while True:
            for i, g in enumerate(groups):
                if all(w.is_completed() for w in g):
                    for w in g:
                        w.wait()
                    return i
            if time.monotonic() >= deadline:
                raise FabricTimeout(f"endpoint {self.rank}: none of {len(works)} operations completed "
                                    f"within {self.timeout_s:g} s")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def wait_all(self, works: Iterable[Work]) -> None:
        """Wait for each of ``works`` (operations of this endpoint), in order: what ``for w in works: w.wait()``
        does, which this generic version is; a fabric may do it without a call per operation (the roles' sends
        finished at a reap, :meth:`.roles.Outbox.reap`).

        Args:
            works: the operations to wait for.
        """
        for w in works:
            w.wait()

    def drive(self, roles: list, inbox: _roles.Inbox, outbox: _roles.Outbox, *, keep: int = 64) -> None:
        """Run ``roles`` (generators yielding the requests of :mod:`.roles`) on this endpoint until every
        one has returned: their sends go out through ``outbox``, their receives are posted in ``inbox``,
        and a role waiting for its messages (:class:`~.roles.Recv`) is resumed when the scheduler's rules
        allow (``docs/omnireduce-scheduler.md``). Before choosing a role to resume, when every role able to
        run waits at a stage that reaps (:attr:`.roles.Stage.reaps`), all but ``keep`` of this endpoint's
        sends are finished. A role's exception propagates to the caller; roles of which none can ever run
        raise :class:`~sparsecomm.errors.ProtocolError`.

        This generic version is the one scheduler of :func:`.roles.drive`, on this endpoint alone (its
        waits are :meth:`wait_any`); every fabric runs it for now.
        """
        _roles.drive(self, inbox, outbox, roles, keep)

    def drive_process(self, roles: list, inbox: _roles.Inbox, outbox: _roles.Outbox, keep: int = 64) -> Generator:
        """:meth:`drive` as a process of this fabric's own event loop, for a service whose ``main`` is a
        generator function (``yield from fabric.drive_process(...)``, see :meth:`service`). Only a fabric whose
        time is modelled (:attr:`modelled_time`) runs its endpoints as one loop; on any other this raises
        :class:`NotImplementedError` (a service's ``main`` there blocks in :meth:`drive`).

        Args:
            roles: the roles to run, as :meth:`drive`'s.
            inbox: where their receives are posted, as :meth:`drive`'s.
            outbox: what their sends go out through, as :meth:`drive`'s.
            keep: the sends left unfinished when every role able to run reaps, as :meth:`drive`'s.
        """
        raise NotImplementedError(f"{type(self).__name__} has no event loop of its own: a service's main blocks "
                                  f"in drive()")

    #: tag reserved for :meth:`barrier` (torch.distributed accepts tags in [0, 2**31))
    barrier_tag: int = 2**31 - 2

    def barrier(self) -> None:
        """Block until every worker (not services) has reached the barrier: gather to worker 0 and
        release, 2 (n-1) one-byte messages, counted in ``stats``."""
        if not self.is_worker:
            raise RuntimeError("barrier is for workers only")
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            for r in range(1, self.world_size):
                self.recv(token, r, self.barrier_tag)
            for r in range(1, self.world_size):
                self.send(token, r, self.barrier_tag)
        else:
            self.send(token, 0, self.barrier_tag)
            self.recv(token, 0, self.barrier_tag)

    def fail(self, exc: BaseException | str, rank: int | None = None) -> None:
        """Tell every endpoint about a failure only this one saw (a malformed message), so that their waits
        end at once naming it rather than at the timeout. The default does nothing: where the endpoints
        share a process (SimFabric) the launcher reports the exception out of ``fn`` to all of them;
        TorchFabric records it in the rendezvous store and closes its connections.

        Args:
            exc: the failure (an exception or its text).
            rank: the rank it is blamed on (default: this one).
        """

    def now(self) -> float:
        """This endpoint's clock in seconds: modelled time on SimFabric, wall time elsewhere."""
        import time

        return time.perf_counter()

    def compute(self, seconds: float) -> None:
        """Account ``seconds`` of local computation (advances the modelled clock; no-op elsewhere)."""

    def host_work(self, op: str, count: int, dtype: torch.dtype | None = None, *,
                  transport: str | None = None) -> None:
        """Declare host work a protocol has just done, for a fabric that models the hosts' CPU: ``op`` is
        ``"sum"`` (``count`` elements of ``dtype`` added), ``"scan"`` (elements scanned for non-zero
        blocks), ``"scan_zero"`` (the elements of the zero blocks among them), ``"switch_packet"`` (packets
        run through a switch program), ``"switch_message"`` (messages whose packets a switch program ran, one
        call each), ``"sparse_switch_packet"``, ``"sparse_switch_value"``, ``"sparse_switch_result"``,
        ``"sparse_switch_message"`` (the sparse switch's program: packets it ran, the value packets among them,
        result rows it produced, messages it took), ``"sparse_switch_round"`` (results a sparse switch's worker
        took), ``"copy"`` (bytes copied), ``"fresh"`` (bytes of a
        buffer allocated in the call, whose pages are touched for the first time), ``"fresh_advised"`` (bytes of
        such a buffer advised as huge pages before its first touch), ``"span"`` (blocks of
        the range a block-sparse worker covers), ``"index"`` (blocks moved by a block index), ``"move"`` (bytes of
        blocks copied between a block-sparse endpoint's tensors and its messages), ``"check"`` (elements a
        finiteness guard reads), ``"call"`` (calls of
        the transport named ``transport``, :meth:`sparsecomm.transports.base.Transport.run`), ``"call_peer"`` (the
        other workers of such a call, the part of its cost that grows with them), ``"sync"`` (calls of it whose
        start waits for their last worker on shared cores, a wait rather than CPU), or one of a method's
        encode and decode (:meth:`sparsecomm.methods.base.Method.work`: ``"elementwise"``, ``"select"``,
        ``"sample"``, ``"matmul"``, ``"matmul_t"``, ``"kernel"``; :mod:`sparsecomm.fabric.sim.sim_host`).
        A no-op here and on real fabrics (the work took its real time); SimFabric with a host model
        advances the clock by the model's rate (:mod:`sparsecomm.fabric.sim.sim_host`)."""

    def native_messages(self) -> ContextManager[None]:
        """A context in which this endpoint's messages (those it sends and those it takes) are the messages of the
        fabric's native collective library (gloo's ring all-reduce: C++ on gloo's own threads, no Python per
        message), for a model of that collective written against this fabric
        (:class:`sparsecomm.transports.native.model.GlooRing`): a fabric that models the hosts' CPU charges them
        its model's native message rates (:meth:`sparsecomm.fabric.sim.sim_host.HostModel.native_messages`)
        instead of its own. Here and on real fabrics it does nothing (a message took its real time). Every
        message the endpoint sends or takes inside it is such a message: a transport enters it around its own
        call's messages only."""
        return contextlib.nullcontext()

    @abstractmethod
    def service(self, name: str, main: Callable[["Fabric"], None], **link) -> int:
        """The endpoint id of the service ``name``, started on first use with ``main(fabric)``.

        Idempotent across workers: every worker asking for the same name gets the same id. On
        SimFabric the service is an endpoint with its own link (``bandwidth_gbps``, ``latency_us``,
        ``per_port``) whose ``main`` is a process of the simulated world's loop where it is a generator
        function (its waits ``yield from fabric.drive_process(...)``: no thread, and what it does between
        two waits happens in the same step of the loop), else a thread of its own, parked on the loop through
        every wait as a worker's training loop is; on TorchFabric it is an extra rank started by the
        launcher, and asking for a service the launcher did not start raises a clear error.

        On SimFabric a blocking ``send`` advances the sender's clock to the end of its transmission;
        a service that must not stall on output (a switch's dataplane, a per-port endpoint) replies
        with ``isend`` and never waits, so its ports transmit in parallel.
        """

    def services(self) -> dict[str, int]:
        """The services started so far, by name."""
        return {}

    def lane_refusal(self) -> str | None:
        """Why this fabric cannot build a lane (another fabric of the same workers on channels of its own, for
        calls in flight together: ``TorchFabric.lane``), or None when it can; the same answer on every worker."""
        return "this fabric has no lanes (lanes are TorchFabric's, on gloo)"
