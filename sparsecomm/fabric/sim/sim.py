"""SimFabric: n endpoints of one simulated world, over a modelled network, in modelled time.

The Fabric API of the simulation: each worker's :class:`SimFabric` (sends, receives, ``wait_any``,
``drive``, services) and its :class:`~sparsecomm.fabric.base.Work` handles. The world it runs in is modelled
elsewhere: the links, NICs and message timing in :mod:`.sim_network` (:class:`~.sim_network.Network`), the
loop that runs every endpoint's processes in modelled time (ordered receives, timeouts, deadlock detection,
faults) in :mod:`.sim_world`; the state of an open ``wait_any``, kept per arrival, in :mod:`.sim_wait`.
Every wait is a process of that loop: a blocking call from a thread of user code (a worker's training
loop) hands its process to the world through the world's gate (:mod:`sparsecomm.fabric.sim_gate`) and
parks; a transport's roles (``drive``) are one process for the whole call. :class:`SimWorld` is that
world with a :meth:`SimWorld.fabric` per rank.
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial
from itertools import chain
from operator import attrgetter
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from ...errors import (EndpointCrashed, FabricTimeout, InvalidTypeError, InvalidValueError, MismatchError,
                       PeerFailure, ProtocolError)
from .. import roles as _roles
from .. import trace as _trace
from ..base import MESSAGE_BYTES, Fabric, Work, check_any_source
from ..engine import engine
from ..sim_gate import Gate
from ..stats import CommStats
from .sim_network import Msg, Network
from .sim_roles import RoleWaits
from .sim_world import AnyWait, RecvWait, World

__all__ = ["SimFabric", "SimWorld"]

_done = attrgetter("done")      # a posted receive's completion (:attr:`_RecvWork.done`)

#: a send of at least this many bytes is written into the buffer of the posted receive that will take it
#: (:class:`_RecvWork`), rather than copied at the send and again at the take; smaller ones are copied (a
#: receive listed and unlisted costs more than the copy it saves)
WRITE_THROUGH_BYTES = 4096


class SimWorld(World):
    """Shared state of one simulated run (:class:`~.sim_world.World`): the endpoints, their mailboxes, the
    network model and the loop, with the :class:`~sparsecomm.fabric.sim_gate.Gate` through which threads
    of user code call into it; :meth:`fabric` is rank ``r``'s endpoint."""

    def __init__(self, world_size: int, network: Network | None = None) -> None:
        super().__init__(world_size, network)
        self.gate = Gate(self)

    def fabric(self, rank: int) -> "SimFabric":
        return SimFabric(self, rank)

    # the thread-facing ends of a run (the launcher's), through the gate (its lock is re-entrant: the loop's
    # own calls of these pass through it too)
    def finished(self, eid: int) -> None:
        self.gate.finished(eid)

    def fail(self, eid: int, exc: BaseException) -> None:
        self.gate.fail(eid, exc)

    def close(self) -> None:
        self.gate.close()

class _SentWork(Work):
    """A started send of endpoint ``_ep`` whose last byte leaves at ``_tx_end``: complete; a wait moves the
    endpoint's clock to ``_tx_end`` (once). Made by :meth:`SimFabric.isend_each`, which sets both (no ``__init__``:
    one Python call the fewer per message)."""

    __slots__ = ("_ep", "_tx_end")

    def wait(self, timeout: float | None = None) -> None:
        ep, t = self._ep, self._tx_end
        if ep is not None:
            if t > ep.clock:
                ep.clock = t
            self._ep = None

    def is_completed(self) -> bool:
        return True


class _RecvWork(Work):
    """A posted receive: it takes its message when waited for (:meth:`wait` from a thread, :meth:`process`
    inside the loop), never before.

    One from a named source into a CPU tensor without grad of at least :data:`WRITE_THROUGH_BYTES` is listed
    in its endpoint's :attr:`~.sim_network.Endpoint.posted` until it completes: the message sent on its channel
    that receives taking them in the order they were posted would give it is written into its buffer at the
    send (as a real fabric writes a posted receive's buffer when the bytes arrive), instead of into a copy that
    the receive copies again (:meth:`SimFabric.isend`). Whichever receive takes a message, its bytes are the
    ones sent: a receive that takes another message than the one its buffer ``holds`` first moves that one's
    bytes to a copy (:meth:`SimFabric._deliver`). Like a real fabric's, the posted receives of a channel must
    not share memory, and a receive's buffer is not the caller's until it has completed.

    Made by :meth:`SimFabric.irecv`, which sets every field (no ``__init__``: one Python call the fewer per
    message): ``_args``, ``(tensor, src, tag)``; ``channel``, ``(source, tag)`` it receives from (``None``: any
    source); ``_fabric``; ``_result``, the source once complete; ``done``, completed (what :meth:`is_completed`
    says, read as a field where it is hot); ``_posted``, the endpoint's list of posted receives on its channel it
    is in (``None``: not listed); ``holds``, the queued message whose bytes its buffer holds
    (:meth:`SimFabric.isend`), if any."""

    __slots__ = ("_args", "channel", "_fabric", "_result", "done", "_posted", "holds")

    def _finish(self, msg: Msg) -> None:
        """Complete with taken ``msg``: its bytes into this receive's buffer (:meth:`SimFabric._deliver`; none
        to copy where the send wrote them there), and off the endpoint's list of posted receives."""
        into = msg.into
        if into is self:
            msg.into = self.holds = None
            self._result = msg.src
        elif into is None and self.holds is None:   # (_deliver's common case, inline: a copy of the message)
            tensor, data = self._args[0], msg.data
            if data.dtype is tensor.dtype and data.shape == tensor.shape and not tensor.requires_grad:
                tensor.copy_(data)
                self._result = msg.src
            else:
                self._result = self._fabric._deliver(msg, tensor, self._args[2], self)
        else:
            self._result = self._fabric._deliver(msg, self._args[0], self._args[2], self)
        self.done = True
        q = self._posted
        if q is not None:
            self._posted = None
            if q[0] is self:
                del q[0]
            else:
                q.remove(self)
            if not q:           # (an empty list is not kept: :attr:`~.sim_network.Endpoint.posted`)
                posted = self._fabric._ep.posted
                if posted.get(self.channel) is q:
                    del posted[self.channel]

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.done:
            # completed, and off the posted list, inside the loop's process (:meth:`process`), not after the
            # gate returns: another thread woken with this one may send on the channel first, and a send
            # writes into the buffer of a receive still listed (the message just taken would be overwritten)
            fabric = self._fabric
            src, tag = self._args[1], self._args[2]
            who = "any endpoint" if src is None else fabric.world.endpoints[src].name
            fabric.world.gate.call(fabric._ep, self.process(timeout), f"{who} (tag {tag})")
        return self._result

    def process(self, timeout: float | None = None, tried: bool = False) -> Generator:
        """The receive as a process of the loop (the world's gate runs it for :meth:`wait`); ``timeout``:
        modelled seconds, after which it raises :class:`FabricTimeout` and stays posted. ``tried``: its
        :meth:`take_now` (no timeout) has just found no message (not looked for again)."""
        if not self.done:
            fabric = self._fabric
            tensor, src, tag = self._args
            msg = None if tried else fabric.world.take_now(fabric._ep, src, tag, timeout)
            if msg is None:
                ep = fabric._ep
                deadline = None if timeout is None else ep.clock + timeout
                msg = yield RecvWait(src, tag, deadline, src is None and ep.per_port, timeout, True)
            self._finish(msg)
        return self._result

    def event(self) -> RecvWait:
        """What :meth:`process` (no timeout) waits for once :meth:`take_now` has missed: a process that
        yields it is resumed with the message for :meth:`complete`."""
        src = self._args[1]
        return RecvWait(src, self._args[2], None, src is None and self._fabric._ep.per_port, None, True)

    def take_now(self) -> bool:
        """Complete now if :meth:`process` would without a step of the loop (its message is in); has it?"""
        fabric = self._fabric
        world, ep = fabric.world, fabric._ep
        if (self._args[1] is None or world.failure is not None or ep.crashed or world.closed
                or world.deadlocked):
            msg = world.take_now(ep, self._args[1], self._args[2])
            if msg is None:
                return False
        else:                   # (World.take_now's case of a named source, inline: once per message)
            box, ch = ep.mailbox, self.channel
            q = box[ch] if ch in box else None
            if not q:
                return False
            msg = q.pop(0)          # (World.take, inline: once per message)
            if not q:
                del box[ch]
            ep.taken(msg)
            if ep.watch is not None:
                ep.watch.taken(msg)
            if _trace.recorder is not None:
                _trace.recorder.sim_received(world, msg.src, ep.id, msg.tag, msg.nbytes, ep.clock, msg.delivered)
            if msg.delivered > ep.clock:
                ep.clock = msg.delivered
            stats, nbytes = ep.stats, msg.nbytes
            stats.bytes_received += nbytes
            stats.messages_received += 1
            stats.links[(msg.src, ep.id)] += nbytes
            if msg.into is self:    # (_finish's common case, inline: written into this receive's buffer)
                msg.into = self.holds = None
                self._result = msg.src
                self.done = True
                q = self._posted
                self._posted = None
                if q[0] is self:
                    del q[0]
                else:
                    q.remove(self)
                if not q and ep.posted.get(ch) is q:
                    del ep.posted[ch]
                return True
        self._finish(msg)
        return True

    #: complete with ``msg``, taken for it by a ``wait_any`` (or a drive's wait set, :mod:`.sim_roles`)
    complete = _finish

    def is_completed(self) -> bool:
        return self.done


def _resumed(req, role) -> Generator:
    """``role`` from its request ``req`` on (yielded already, not performed yet), as a role bearing ``role``'s
    name: for the scheduler to take over a role that a driver has run alone (:meth:`SimFabric._drive_one`)."""
    def rest():
        yield req
        return (yield from role)

    gen = rest()
    gen.__qualname__ = role.__qualname__ if inspect.isgenerator(role) else type(role).__qualname__
    return gen


class SimFabric(Fabric):
    """One endpoint of a :class:`SimWorld`; the same interface as ``TorchFabric``.

    Args:
        world: the simulated job (:class:`~sparsecomm.fabric.sim.sim.SimWorld`) this endpoint belongs to.
        rank: this endpoint's id in it.
    """

    modelled_time = True
    in_process_services = True

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout_s = world.network.timeout_s
        self._ep = world.endpoints[rank]
        #: :attr:`.base.Fabric.charges_host_work`: a host model's (the network's, fixed for the run)
        self.charges_host_work = self._ep.host is not None

    @property
    def stats(self) -> CommStats:
        """This endpoint's :class:`~sparsecomm.fabric.stats.CommStats` (the fabric's ledger)."""
        return self._ep.stats

    @property
    def world_scratch(self) -> dict:
        return self.world.scratch

    @property
    def message_bytes(self) -> int | None:
        """``None`` (a message is one datagram of the model, whose every cost it states), or, where the host
        model charges a fixed CPU time per message (:attr:`.sim_host.HostModel.per_message`), a real
        fabric's :data:`~sparsecomm.fabric.base.MESSAGE_BYTES`: the transports then take a real fabric's
        defaults (the switches' bursts), as the hosts modelled would run them, and a receive takes a shorter
        message of its dtype into a prefix of its (contiguous) buffer, the rest untouched, as gloo's does
        (messages as long as their packets); otherwise a message of another length raises
        :class:`~sparsecomm.errors.MismatchError`."""
        host = self.world.network.host
        return MESSAGE_BYTES if host is not None and host.per_message else None

    @property
    def network(self) -> Network:
        """The modelled :class:`~sparsecomm.fabric.sim.sim_network.Network`."""
        return self.world.network

    def now(self) -> float:
        return self._ep.clock

    def compute(self, seconds: float) -> None:
        if seconds < 0:
            raise InvalidValueError("compute time must be non-negative")
        factor = self.world.network.stragglers.get(self.rank, 1.0)
        if _trace.recorder is not None:
            _trace.recorder.sim_compute(self.world, self.rank, self._ep.clock, seconds * factor)
        self._ep.clock += seconds * factor
        self._ep.unsynced += seconds * factor      # (work the next call's wait for its last worker counts)

    def host_work(self, op: str, count: int, dtype: torch.dtype | None = None, *,
                  transport: str | None = None) -> None:
        """:meth:`.base.Fabric.host_work`: the host model's charge (:mod:`.sim_host`) on this endpoint's clock;
        none without one.

        The clock is one timeline per endpoint, which the calls of its communication thread
        (:mod:`sparsecomm.fabric.engine`) advance too, through the world's loop. A charge from another thread
        (the training thread's encode while an earlier bucket's call is in flight) lands at its place in the
        order the thread submitted the calls (:meth:`~sparsecomm.fabric.engine.CommEngine.in_order`): after
        every call it started before, the charge's own work included, and before every call it starts after;
        never wherever the threads' scheduling puts it. A charge from a call's own code (on the communication
        thread, or in a process of the loop) is made at once.

        Args:
            op: the operation (:data:`.sim_host.HOST_OPS`).
            count: how many of its units.
            dtype: the dtype of the elements (``"sum"``).
            transport: the transport whose call ``"call"`` counts.
        """
        ep = self._ep
        if ep.host is None:
            return
        eng = engine(self, create=False)
        if eng is None or self.world.gate.looping():
            ep.host_work(op, count, dtype, transport)
        else:
            ep.host.work_s(op, count, dtype, transport=transport)      # (its checks, raised here)
            eng.in_order(partial(ep.host_work, op, count, dtype, transport))

    @contextlib.contextmanager
    def native_messages(self) -> Iterator[None]:
        """:meth:`.base.Fabric.native_messages`: inside it this endpoint's messages (those it sends and those it
        takes) are charged the host model's native message rates
        (:meth:`~.sim_host.HostModel.native_messages`: gloo's own ring, no Python per message) instead of its own
        message costs; every other charge, the CPU share and the network are as outside it. No host model, or one
        without native rates: nothing changes."""
        ep = self._ep
        host = ep.host
        native = host.native_messages() if host is not None else None
        if native is None or native is host:
            yield
            return
        ep.host = native
        try:
            yield
        finally:
            ep.host = host

    # --------------------------------------------------------------- sending
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True,
              stable: bool = False) -> Work:
        return self.isend_each(tensor, (dst,), tag, [], reliable, stable)[0]

    def isend_each(self, tensor: torch.Tensor, dsts, tag: int, works: list, reliable: bool = True,
                   stable: bool = False) -> list:
        """:meth:`.base.Fabric.isend_each` (:meth:`isend` is this to one endpoint) in one pass, the world's lock
        taken once: each send placed as it comes (the sender's NIC, the receiver's mailbox and NIC, the ledger),
        so that every modelled time is that of an ``isend`` per endpoint in order. A message not written into a
        posted receive (:data:`WRITE_THROUGH_BYTES`) holds a copy of ``tensor``, one shared by every such message
        of the call (a message's bytes are only read once it is sent), or, ``stable`` (:meth:`.base.Fabric.isend`:
        nothing writes ``tensor`` before the message is taken), ``tensor`` itself where it is a contiguous CPU
        tensor without grad (the send's bytes are then held once, by the sender, not again by the SimFabric until
        the take: a colocated OmniReduce worker's round-0 blocks, views of its input). ``reliable``: ``False``,
        the network model may drop each of them (:meth:`isend`'s).

        Args:
            tensor: the message, the same for every endpoint.
            dsts: the receiving endpoints.
            tag: the message tag.
            works: the list the sends' operations are appended to (returned).
            reliable: whether the sends are reliable.
            stable: the caller's promise of :meth:`.base.Fabric.isend`.
        """
        world, ep, rank = self.world, self._ep, self.rank
        nbytes = tensor.nbytes
        copy = None             # (the copy of ``tensor`` the messages not written through share, made once)
        meta = None             # (``tensor``'s dtype, shape, and whether it may be written through: read once)
        # (its NIC placed inline: Endpoint.transmit's plain case)
        plain = ep.host is None and not ep.per_port and not ep.burst
        with world.gate.lock:
            for dst in dsts:
                if dst < 0 or dst == rank:
                    raise InvalidValueError(f"{ep.name}: cannot send to itself" if dst == rank else
                                            f"{ep.name}: no endpoint {dst} (world has {len(world.endpoints)})")
                if world.failure is not None:
                    self._raise_if_failed()
                if ep.crashed:
                    raise EndpointCrashed(f"{ep.name} has crashed")
                try:
                    dst_ep = world.endpoints[dst]
                except IndexError:
                    raise InvalidValueError(f"{ep.name}: no endpoint {dst} (world has {len(world.endpoints)})") \
                        from None
                if plain:           # (Endpoint.transmit without a host model, one NIC, inline: once per message)
                    start = ep.clock
                    if ep.tx_free1 > start:
                        start = ep.tx_free1
                    tx_end = ep.tx_free1 = start + nbytes / ep.bw
                else:
                    start, tx_end = ep.transmit(dst, nbytes)
                stats = ep.stats            # (CommStats.record_send, inline: once per message)
                stats.bytes_sent += nbytes
                stats.messages += 1
                stats.links[(rank, dst)] += nbytes
                dropped = False
                if not reliable and world.network.loss > 0.0:
                    rng = ep.loss_rng.get(dst)
                    if rng is None:
                        rng = ep.loss_rng[dst] = np.random.default_rng([world.network.seed, rank, dst])
                    dropped = bool(rng.random() < world.network.loss)
                if _trace.recorder is not None:
                    _trace.recorder.sim_sent(world, rank, dst, tag, nbytes, start, tx_end, dropped)
                if not dropped and not dst_ep.crashed:
                    ch, box = (rank, tag), dst_ep.mailbox
                    if ch in box:
                        q = box[ch]
                    else:
                        q = box[ch] = []      # (a list: most channels hold one message at a time)
                    # the posted receive that takes this message if the channel's receives take them in the order
                    # they were posted (the k-th posted, with k messages queued before it): its bytes are written
                    # into that receive's buffer, which holds them until the message is taken (_deliver)
                    into = None
                    if nbytes >= WRITE_THROUGH_BYTES:
                        lists = dst_ep.posted
                        posted = lists[ch] if ch in lists else None
                        if posted and (k := len(q)) < len(posted):
                            into = posted[k]
                            buf = into._args[0]
                            if meta is None:
                                meta = (tensor.dtype, tensor.shape, tensor.is_cpu and not tensor.requires_grad)
                            if into.holds is None and meta[2] and buf.dtype is meta[0] and buf.shape == meta[1]:
                                buf.copy_(tensor)
                                data = buf
                            else:
                                into = None
                    if into is None:        # a send's copy: the buffer may change before the message is taken
                        if copy is None:
                            if stable and tensor.is_cpu and not tensor.requires_grad and tensor.is_contiguous():
                                copy = tensor       # (not written before the take: the caller's promise)
                            elif tensor.is_cpu and not tensor.requires_grad:    # the common case in one operation
                                copy = tensor.clone(memory_format=torch.contiguous_format)
                            else:
                                copy = tensor.detach().to("cpu", copy=True).contiguous()
                        data = copy
                    latency = (ep.latency + dst_ep.latency) / 2   # each end's link contributes half: symmetric
                    msg = Msg(rank, tag, data, nbytes, start, start + latency, tx_end)
                    if into is not None:
                        msg.into = into
                        into.holds = msg
                    q.append(msg)
                    retimed = dst_ep.schedule(msg)
                    if dst_ep.waiters or dst_ep.watch is not None:     # (what arrived looks at: none, nothing to do)
                        world.arrived(dst_ep, msg, retimed)
                ep.sends += 1
                limit = ep.crash_after
                if limit is not None and ep.sends >= limit:
                    ep.crashed = True
                    raise EndpointCrashed(f"{ep.name} crashed after {ep.sends} sends (fault injection)")
                wk = _SentWork()
                wk._ep, wk._tx_end = ep, tx_end
                works.append(wk)
        return works

    def wait_all(self, works) -> None:
        """:meth:`.base.Fabric.wait_all`: a send of this fabric's waited for here, without a call (its
        :meth:`_SentWork.wait`: the clock moved to its last byte's departure, once); any other operation by its
        ``wait``.

        Args:
            works: the operations to wait for.
        """
        for w in works:
            if type(w) is _SentWork:
                ep = w._ep
                if ep is not None:
                    t = w._tx_end
                    if t > ep.clock:
                        ep.clock = t
                    w._ep = None
            else:
                w.wait()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        self.isend(tensor, dst, tag, reliable=reliable).wait()      # (the clock moves to the send's tx_end)

    # ------------------------------------------------------------- receiving
    def _deliver(self, msg: Msg, tensor: torch.Tensor, tag: int, work: _RecvWork | None = None) -> int:
        """Copy taken ``msg`` into ``tensor``, the buffer of ``work`` if given (a message of another length or
        dtype: ``MismatchError``). A message whose bytes a posted receive's buffer holds (:meth:`isend`) leaves
        it; a receive whose buffer holds another message's bytes moves them to a copy first."""
        into = msg.into
        if into is not None:
            msg.into = into.holds = None
            if into is work:        # (written into this receive's buffer at the send)
                return msg.src
        if work is not None and work.holds is not None:
            later = work.holds      # (a message sent after this one, for the receive posted after it)
            later.data = tensor.clone()
            later.into = work.holds = None
        data = msg.data
        if data.dtype is tensor.dtype and data.shape == tensor.shape and not tensor.requires_grad:
            tensor.copy_(data)      # (the common case)
            return msg.src
        dn, tn = data.numel(), tensor.numel()
        if data.dtype is tensor.dtype and dn == tn and not tensor.requires_grad:
            tensor.copy_(data if data.shape == tensor.shape else data.reshape(tensor.shape))
            return msg.src
        if (data.dtype is tensor.dtype and dn < tn and tensor.is_contiguous()
                and self.message_bytes is not None):
            # a real fabric's receive (gloo), modelled with real hosts: a shorter message fills a prefix of
            # the buffer, the rest untouched (``message_bytes``)
            tensor.view(-1)[:data.numel()].copy_(data.reshape(-1))
            return msg.src
        if data.dtype is not tensor.dtype or dn != tn:
            world = self.world
            raise MismatchError(
                f"{self._ep.name} expected {tensor.numel()} x {tensor.dtype} from "
                f"{world.endpoints[msg.src].name} (tag {tag}) but received "
                f"{msg.data.numel()} x {msg.data.dtype}: workers disagree on the message's length "
                f"or dtype")
        if data.shape != tensor.shape:
            data = data.reshape(tensor.shape)
        if tensor.requires_grad:
            with torch.no_grad():
                tensor.copy_(data)
        else:
            tensor.copy_(data)
        return msg.src

    def _recv_process(self, tensor: torch.Tensor, src: int | None, tag: int, timeout: float | None) -> Generator:
        """A receive as a process of the world's loop (:class:`~.sim_world.RecvWait`): a ``per_port``
        endpoint's any-source receive is ordered."""
        ep = self._ep
        deadline = None if timeout is None else ep.clock + timeout
        msg = yield RecvWait(src, tag, deadline, src is None and ep.per_port, timeout)
        return self._deliver(msg, tensor, tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        if src is None:
            check_any_source(tag)
        who = "any endpoint" if src is None else self.world.endpoints[src].name
        return self.world.gate.call(self._ep, self._recv_process(tensor, src, tag, timeout), f"{who} (tag {tag})")

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        if src is None:
            check_any_source(tag)
        w = _RecvWork()             # (its fields: :class:`_RecvWork`)
        ch = (src, tag)
        w._args, w.channel, w._fabric = (tensor, src, tag), ch, self
        w._result = w._posted = w.holds = None
        w.done = False
        if src is not None and tensor.nbytes >= WRITE_THROUGH_BYTES and tensor.is_cpu and not tensor.requires_grad:
            posted = self._ep.posted    # (listed: a send on its channel may write into its buffer)
            if ch in posted:
                q = posted[ch]
                q.append(w)
            else:
                q = posted[ch] = [w]
            w._posted = q
        return w

    def wait_any(self, works) -> int:
        """The first element of ``works`` (in list order) that is in by the time the first of them is,
        in modelled time; an element is a receive or a list of receives (in once all of them are).
        Its receives are completed (in arrival order); an already completed element (e.g. a send) is
        returned at once. A caller lists the elements in order of preference: that order holds while
        the messages are there, and whichever arrives first is served when none is. On a ``per_port``
        endpoint (a switch) the element in first is chosen even while several are there (the lowest index
        on a tie): a switch port's packets are taken in the order they arrived, whatever their tags
        (:mod:`.sim_wait`).

        Ordered, like a ``per_port`` endpoint's any-source receive: unless the first element is in by
        this endpoint's clock already, the choice is made when the first element's arrival is the
        world's earliest event (:mod:`.sim_world`), so the choice is deterministic. This NIC serialises
        the messages in their arrival order, not in the order a fixed loop would have asked for them.
        """
        return self.world.gate.call(self._ep, self._wait_any_process(works), f"any of {len(works)} receives")

    def _wait_any_process(self, works, checked: bool = False) -> Generator:
        """:meth:`wait_any` as a process of the loop (:class:`~.sim_world.AnyWait`); ``checked``: ``works`` are
        lists of this endpoint's pending receives on distinct channels (the roles' scheduler's), taken as
        they are."""
        if not works:
            raise InvalidValueError("wait_any needs at least one operation")
        if checked:
            groups = works
            for i, g in enumerate(groups):
                if not g:
                    return i
            keys = [[w._args[1:] for w in g] for g in groups]
        else:
            ep = self._ep
            groups, keys, seen = [], [], set()      # per element its pending receives, and their (source, tag)
            for i, el in enumerate(works):
                g = el if isinstance(el, (list, tuple)) else (el,)
                pend = [w for w in g if not w.is_completed()]
                if not pend:
                    for w in g:
                        w.wait()
                    return i
                gk = []
                for w in pend:
                    if not isinstance(w, _RecvWork) or w._fabric is not self:
                        raise InvalidTypeError(f"{ep.name}: wait_any takes this endpoint's pending receives and "
                                               f"sends, got {type(w).__name__}")
                    key = w._args[1:]
                    if key in seen:
                        raise InvalidValueError(f"{ep.name}: wait_any was given two receives on (source, tag) "
                                                f"{key}; only the next one posted on a channel may be waited for")
                    seen.add(key)
                    gk.append(key)
                groups.append(pend)
                keys.append(gk)
        i, msgs = yield AnyWait(keys)
        for w, msg in zip(groups[i], msgs):
            w.complete(msg)
        return i

    def drive(self, roles: list, inbox: _roles.Inbox, outbox: _roles.Outbox, *, keep: int = 64) -> None:
        """Run ``roles`` (:meth:`.base.Fabric.drive`) as one process of the world's loop: the scheduler of
        :func:`.roles.schedule`, whose waits are this endpoint's receives and ``wait_any``.

        Args:
            roles: the generators to run (:mod:`sparsecomm.fabric.roles`).
            inbox: where their receives are posted.
            outbox: through which they send.
            keep: the sends left unfinished when the scheduler reaps (:meth:`.roles.Outbox.reap`).
        """
        self.world.gate.call(self._ep, self.drive_process(roles, inbox, outbox, keep), "a message of its roles")

    def drive_process(self, roles: list, inbox: _roles.Inbox, outbox: _roles.Outbox, keep: int = 64) -> Generator:
        """:meth:`drive` as a process of the loop, for a service whose main is one (``yield from``). The only
        role of a drive (a ring's, a switch port's) runs without the scheduler, its requests performed here
        (:meth:`_drive_one`), until it spawns another; then the scheduler runs them all.

        Args:
            roles: the generators to run (:mod:`sparsecomm.fabric.roles`).
            inbox: where their receives are posted.
            outbox: through which they send.
            keep: the sends left unfinished when the scheduler reaps (:meth:`.roles.Outbox.reap`).
        """
        ep = self._ep
        ws = None
        per_port, Choose = ep.per_port, _roles.Choose
        if ep.waitset is None:      # (a second drive at once on one endpoint builds its groups per choice)
            ws = ep.waitset = RoleWaits(ep, inbox, _RecvWork)
            choice = AnyWait(None, ws)      # (the wait of every choice the records decide: one object)
        try:
            if len(roles) == 1:
                rest = yield from self._drive_one(roles[0], inbox, outbox, keep)
                if rest is None:
                    return
                roles = [rest]
            sched = _roles.schedule(self, inbox, outbox, roles, keep, ws)
            value = None
            while True:
                try:
                    req = sched.send(value)
                except StopIteration:
                    return
                t = type(req)
                if t is Choose:     # answered (the role chosen, the key of an ``any`` one's receive)
                    ws.order = req.order
                    if ws.empties:          # an empty group: its role chosen at once (the first in order)
                        groups_ = ws.groups
                        value = (min([(groups_[s].req.stage, s) for s in ws.empties])[1], None)
                        continue
                    if not ws.odd and not per_port:     # the records decide: its receives completed by the wait
                        value = yield choice    # set (RoleWaits.choose), no other group holds them, none to update
                        continue
                    # groups the records do not decide: built as for a WaitAny
                    waiting = [(s, ws.groups[s].req) for _, s in req.order]
                    groups, owner, picks = _roles.groups(inbox, outbox, waiting)
                    i = yield from self._wait_any_process(groups, checked=True)
                    value = (owner[i], picks[i])
                    ws.completed(groups[i])
                    continue
                if t is _roles.WaitAny:
                    value = yield from self._wait_any_process(req.groups, checked=True)
                    continue
                if t is _roles.RecvWithin:
                    try:
                        value = yield from self._recv_process(req.buf, req.src, req.tag, req.timeout)
                    except FabricTimeout:
                        value = None
                    continue
                if t is _roles.AwaitWithin:
                    w, value = inbox.work(req.key), True
                    if w is not None and not w.is_completed():
                        try:
                            yield from w.process(req.timeout)
                        except FabricTimeout:
                            value = False
                        if ws is not None and w.is_completed():
                            ws.completed((w,))
                    continue
                value = None        # WaitAll: the role takes these at once; they are received first, here
                keys = req.keys     # (an ``any`` one: answered with the key found in, or the first, completed)
                if not req.any and not keys[1:] and keys:       # (the common case: one named receive)
                    w = inbox.box[keys[0]][0]
                    if w is not None and not w.done:
                        if not w.take_now():        # (the loop's wait, without process()'s frames: event())
                            src, tag = w.channel
                            w._finish((yield RecvWait(src, tag, None, src is None and ep.per_port, None, True)))
                        if ws is not None and ws.groups:
                            ws.completed((w,))
                    continue
                value, works = yield from self._take_keys(inbox, keys, req.any)
                if works is not None and ws is not None and ws.groups:
                    ws.completed(works)
        except BaseException:
            self._unlist()          # (its receives may stay posted, their buffers reused by the next call's)
            raise
        finally:
            if ws is not None:
                ep.waitset = ep.watch = None

    def _drive_one(self, role, inbox: _roles.Inbox, outbox: _roles.Outbox, keep: int) -> Generator:
        """Run ``role``, a drive's only one, performing its requests here: what :func:`.roles.schedule` does
        for one role (each wait in place, as its :class:`~.roles.WaitAll`, after the checks and the reap of its
        stage), without a round trip through the scheduler's generator per request. Returns ``None`` once the
        role has returned; at a :class:`~.roles.Spawn`, the role resumed from that request on, for the
        scheduler to run with those it spawns (:func:`_resumed`).

        The role is resumed by a ``for`` loop (no call of ``next`` per request), and with ``send`` only to
        give it a value (an ``any`` wait's key, a timed wait's outcome); ``step``, the request being performed,
        tells its own exceptions (noted as the scheduler notes them, :func:`.roles.note_role`) from those of
        their performing."""
        ep, rank = self._ep, self.rank
        send, post_into, settle, work = outbox.send, inbox.post_into, outbox.pool.settle, inbox.work
        box = inbox.box     # (its entries, read without a call per wait)
        Send, PostInto, Recv, Flush = _roles.Send, _roles.PostInto, _roles.Recv, _roles.Flush
        value = None
        requests = role
        while True:
            step = None
            try:
                if value is not None:       # (resumed with a value: its next request first, then the others)
                    try:
                        req = role.send(value)      # (a role may be a plain iterator)
                    except StopIteration:
                        return None
                    value = None
                    requests = chain((req,), role)
                for req in requests:
                    step = req
                    t = type(req)
                    if t is Send:
                        send(req.buf, req.dst, req.tag, req.hold, req.deferrable)
                    elif t is _roles.SendEach:
                        outbox.send_each(req.buf, req.dsts, req.tag, req.hold, req.deferrable)
                    elif t is PostInto:
                        post_into(req.key, req.buf, req.src, req.tag)
                    elif t is Recv:
                        keys = req.keys
                        if not req.any and not keys[1:] and keys and not req.gone:     # (the common case)
                            try:
                                w = box[keys[0]][0]     # (:meth:`~.roles.Inbox.work`)
                            except KeyError:
                                raise ProtocolError(f"endpoint {rank}: no role of this call can run (a bug)") from None
                            if req.stage.reaps:
                                outbox.reap(keep)
                            if w is not None and not w.done and not w.take_now():
                                src, tag = w.channel
                                w._finish((yield RecvWait(src, tag, None, src is None and ep.per_port, None, True)))
                        else:
                            has = inbox.has     # (able to run: every key posted or handed over, no ``gone`` one left)
                            if not all(map(has, keys)) or any(map(has, req.gone)):
                                raise ProtocolError(f"endpoint {rank}: no role of this call can run (a bug)")
                            if req.stage.reaps:
                                outbox.reap(keep)
                            value, _ = yield from self._take_keys(inbox, keys, req.any)
                    elif t is Flush:
                        settle(req.hold)
                    elif t is _roles.Post:
                        inbox.post(req.key, req.nbytes, req.src, req.tag)
                    elif t is _roles.Hand:
                        inbox.put(req.key, req.msg)
                    elif t is _roles.Poll:
                        pass                # (no other role to run)
                    elif t is _roles.RecvWithin:    # (the driver's waits, as the scheduler's driver performs them)
                        try:
                            value = yield from self._recv_process(req.buf, req.src, req.tag, req.timeout)
                        except FabricTimeout:
                            value = None
                    elif t is _roles.AwaitWithin:
                        w, value = work(req.key), True
                        if w is not None and not w.is_completed():
                            try:
                                yield from w.process(req.timeout)
                            except FabricTimeout:
                                value = False
                    elif t is _roles.Spawn:
                        return _resumed(req, role)
                    else:
                        raise ProtocolError(f"endpoint {rank}: a role asked for {req!r} (a bug)")
                    if value is not None:
                        break
                    step = None
                else:
                    return None
            except Exception as exc:
                if step is None:            # (raised by the role's own code)
                    _roles.note_role(exc, role, rank)
                raise

    def _take_keys(self, inbox: _roles.Inbox, keys: tuple, any_: bool) -> Generator:
        """The receives of ``keys`` that a role takes at once (a :class:`~.roles.WaitAll`'s), completed here first,
        in order; ``any_``: none if one is in already, else the first. Returns the key an ``any_`` role is resumed
        with (the first in, else the first; else ``None``) and the receives completed here (``None``: none was
        waited for, an ``any_`` key being in), for a wait set to be told of."""
        if any_:
            if type(keys) is not tuple:             # (a role's live dict view of its keys left: :class:`~.roles.Recv`)
                keys = tuple(keys)
            works = list(map(inbox.work, keys))
            try:
                done = list(map(_done, works))      # (no bytecode per key)
            except AttributeError:                  # (handed over: None; or a receive of another kind)
                done = [w is None or w.is_completed() for w in works]
            if True in done:                    # (one is in: the first)
                return keys[done.index(True)], None
            works, value = works[:1], keys[0]
        else:
            works, value = [w for w in map(inbox.work, keys) if w is not None], None
        for w in works:
            if not w.done and not w.take_now():
                yield from w.process(tried=True)
        return value, works

    def _unlist(self) -> None:
        """Take this endpoint's posted receives off its lists (:attr:`~.sim_network.Endpoint.posted`), the bytes
        written into their buffers moved to copies: after a drive that raised, whose receives may stay posted
        while their buffers (a transport's workspace) are posted again by the next call's, a send must not
        write into them. They complete as before, from copies."""
        ep = self._ep
        for q in ep.posted.values():
            for w in q:
                m = w.holds
                if m is not None:
                    m.data = w._args[0].clone()
                    m.into = w.holds = None
                w._posted = None
        ep.posted.clear()

    def _raise_if_failed(self) -> None:
        failure = self.world.failure
        if failure is not None and failure[0] != self.rank:
            eid, exc = failure
            raise PeerFailure(f"{self.world.endpoints[eid].name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    # --------------------------------------------------------------- services
    def service(self, name: str, main: Callable[[Fabric], None], *, bandwidth_gbps: float | None = None,
                latency_us: float | None = None, per_port: bool = False) -> int:
        """:meth:`.base.Fabric.service`; a ``main`` that is a generator function is a process of the world's
        loop (no thread), any other ``main`` runs on a thread of its own (:mod:`sparsecomm.fabric.sim_gate`).

        Args:
            name: the service's name (every worker asking for it gets the same endpoint).
            main: its body, called with the service's own fabric.
            bandwidth_gbps: its link's rate (default: the network's).
            latency_us: its link's latency (default: the network's).
            per_port: one NIC per peer (a switch's ports work in parallel).
        """
        world = self.world
        with world.gate.lock:
            if name in world.service_ids:
                return world.service_ids[name]
            net = world.network
            bw = (bandwidth_gbps if bandwidth_gbps is not None else net.bandwidth_gbps) * 1e9 / 8 * net.payload_fraction
            lat = (latency_us if latency_us is not None else net.latency_us) * 1e-6
            process = inspect.isgeneratorfunction(main)
            ep = world.add_endpoint(bw, lat, per_port, name, threaded=not process)
            world.service_ids[name] = ep.id
            fabric = SimFabric(world, ep.id)
            if process:
                world.spawn(ep, main(fabric))
            else:
                world.gate.start_service(ep.id, name, main, fabric)
            return ep.id

    def services(self) -> dict[str, int]:
        return dict(self.world.service_ids)
