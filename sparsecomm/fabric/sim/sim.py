"""SimFabric: n endpoints as threads in one process, over a modelled network.

The Fabric API of the simulation: each worker's :class:`SimFabric` (sends, receives, ``wait_any``,
services) and its :class:`~sparsecomm.fabric.base.Work` handles. The world it runs in is modelled
elsewhere: the links, NICs and message timing in :mod:`.sim_network` (:class:`~.sim_network.Network`),
the scheduler that decides in modelled time which blocked endpoint proceeds (timeouts by quiescence,
ordered any-source receives, deadlock detection, faults) in :mod:`.sim_world`; the state of an open
``wait_any``, kept per arrival, in :mod:`.sim_wait`. :class:`SimWorld` is
that world with a :meth:`SimWorld.fabric` per rank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from ...errors import (EndpointCrashed, FabricTimeout, InvalidTypeError, InvalidValueError, MismatchError,
                       PeerFailure, ServiceShutdown)
from ..base import Fabric, Work
from ..stats import CommStats
from .sim_network import Msg, Network
from .sim_wait import OrderedWait
from .sim_world import World

__all__ = ["SimFabric", "SimWorld"]


class SimWorld(World):
    """Shared state of one simulated run (:class:`~.sim_world.World`): the endpoints,
    their mailboxes and the network model; :meth:`fabric` is rank ``r``'s endpoint."""

    def fabric(self, rank: int) -> "SimFabric":
        return SimFabric(self, rank)


class _DoneWork(Work):
    def __init__(self, result: int | None = None, on_wait: Callable[[], None] | None = None) -> None:
        self._result = result
        self._on_wait = on_wait

    def wait(self, timeout: float | None = None) -> int | None:
        if self._on_wait is not None:
            self._on_wait()
            self._on_wait = None
        return self._result

    def is_completed(self) -> bool:
        return True


class _RecvWork(Work):
    def __init__(self, fabric: "SimFabric", tensor: torch.Tensor, src: int | None, tag: int) -> None:
        self._args = (tensor, src, tag)
        self._fabric = fabric
        self._result: int | None = None
        self._done = False

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._done:
            self._result = self._fabric.recv(*self._args, timeout=timeout)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done


class SimFabric(Fabric):
    """One endpoint of a :class:`SimWorld`; the same interface as ``TorchFabric``.

    Args:
        world: the simulated job (:class:`~sparsecomm.fabric.sim.sim.SimWorld`) this endpoint belongs to.
        rank: this endpoint's id in it.
    """

    modelled_time = True
    in_process_services = True
    message_bytes = None      # a message is one datagram of the model

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout_s = world.network.timeout_s
        self._ep = world.endpoints[rank]

    @property
    def stats(self) -> CommStats:
        """This endpoint's :class:`~sparsecomm.fabric.stats.CommStats` (the fabric's ledger)."""
        return self._ep.stats

    @property
    def world_scratch(self) -> dict:
        return self.world.scratch

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
        self._ep.clock += seconds * factor

    # --------------------------------------------------------------- sending
    def _post(self, tensor: torch.Tensor, dst: int, tag: int, reliable: bool) -> float:
        world, ep = self.world, self._ep
        if not 0 <= dst < len(world.endpoints):
            raise InvalidValueError(f"{ep.name}: no endpoint {dst} (world has {len(world.endpoints)})")
        if dst == self.rank:
            raise InvalidValueError(f"{ep.name}: cannot send to itself")
        data = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = data.numel() * data.element_size()
        with world.lock:
            self._raise_if_failed()
            if ep.crashed:
                raise EndpointCrashed(f"{ep.name} has crashed")
            dst_ep = world.endpoints[dst]
            start, tx_end = ep.transmit(dst, nbytes)
            latency = (ep.latency + dst_ep.latency) / 2   # each end's link contributes half: symmetric
            ep.stats.record_send(self.rank, dst, nbytes)
            dropped = False
            if not reliable and world.network.loss > 0.0:
                rng = ep.loss_rng.get(dst)
                if rng is None:
                    rng = ep.loss_rng[dst] = np.random.default_rng([world.network.seed, self.rank, dst])
                dropped = bool(rng.random() < world.network.loss)
            if not dropped and not dst_ep.crashed:
                msg = Msg(self.rank, tag, data, nbytes, start, start + latency, tx_end)
                dst_ep.mailbox.setdefault((self.rank, tag), deque()).append(msg)
                world.arrived(dst_ep, msg, dst_ep.schedule(msg))
            ep.sends += 1
            limit = world.network.crash.get(self.rank)
            if limit is not None and ep.sends >= limit:
                ep.crashed = True
                raise EndpointCrashed(f"{ep.name} crashed after {ep.sends} sends (fault injection)")
        return tx_end

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> None:
        tx_end = self._post(tensor, dst, tag, reliable)
        self._ep.clock = max(self._ep.clock, tx_end)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *, reliable: bool = True) -> Work:
        tx_end = self._post(tensor, dst, tag, reliable)
        ep = self._ep

        def done() -> None:
            ep.clock = max(ep.clock, tx_end)

        return _DoneWork(None, done)

    # ------------------------------------------------------------- receiving
    def _match(self, src: int | None, tag: int) -> Msg | None:
        box = self._ep.mailbox
        if src is not None:
            q = box.get((src, tag))
            return q[0] if q else None
        best = None
        for (s, t), q in box.items():
            if t == tag and q and (best is None or (q[0].head, s) < (best.head, best.src)):
                best = q[0]
        return best

    @staticmethod
    def _delivery(msg: Msg) -> tuple[float, float]:
        return msg.delivered, msg.rx_end

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, *,
             timeout: float | None = None) -> int:
        world, ep = self.world, self._ep
        wall_deadline = time.monotonic() + self.timeout_s
        with world.lock:
            deadline = None if timeout is None else ep.clock + timeout
            while True:
                self._raise_if_failed()
                if ep.crashed:
                    raise EndpointCrashed(f"{ep.name} has crashed")
                msg = self._match(src, tag)
                ep.event = None
                if msg is not None:
                    delivered, rx_end = self._delivery(msg)
                    if deadline is None or delivered <= deadline:
                        if (src is not None or not ep.per_port or ep.fire_event
                                or world.may_take(ep, delivered)):
                            ep.fire_timeout = ep.fire_event = False
                            break
                        ep.event = delivered    # ordered: wait until it is the earliest event
                if ep.fire_timeout:
                    ep.fire_timeout = False
                    ep.clock = max(ep.clock, deadline)
                    raise FabricTimeout(
                        f"{ep.name}: no message from "
                        f"{'any endpoint' if src is None else world.endpoints[src].name} (tag {tag}) "
                        f"within {timeout:.6g} modelled seconds")
                self._raise_if_stuck()
                remaining = wall_deadline - time.monotonic()
                if remaining <= 0:
                    raise FabricTimeout(
                        f"{ep.name}: waited {self.timeout_s:g} s (wall) for "
                        f"{'any endpoint' if src is None else world.endpoints[src].name} (tag {tag})")
                self._park(deadline, (src, tag), remaining,
                           self._candidate(src, tag, deadline) if src is None and ep.per_port else None)
            ep.mailbox[(msg.src, msg.tag)].popleft()
            ep.taken(msg)
            ep.clock = max(ep.clock, delivered)
            ep.stats.record_recv(msg.src, self.rank, msg.nbytes)
        if msg.data.numel() != tensor.numel() or msg.data.dtype != tensor.dtype:
            raise MismatchError(
                f"{ep.name} expected {tensor.numel()} x {tensor.dtype} from "
                f"{world.endpoints[msg.src].name} (tag {tag}) but received "
                f"{msg.data.numel()} x {msg.data.dtype}: workers disagree on the message's length "
                f"or dtype")
        with torch.no_grad():
            tensor.copy_(msg.data.reshape(tensor.shape))
        return msg.src

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        return _RecvWork(self, tensor, src, tag)

    def wait_any(self, works) -> int:
        """The first element of ``works`` (in list order) that is in by the time the first of them is,
        in modelled time; an element is a receive or a list of receives (in once all of them are).
        Its receives are completed (in arrival order); an already completed element (e.g. a send) is
        returned at once. A caller lists the elements in order of preference: that order holds while
        the messages are there, and whichever arrives first is served when none is.

        Ordered, like a ``per_port`` endpoint's any-source receive: unless the first element is in by
        this endpoint's clock already, the choice is made only once every other live endpoint is
        blocked and no earlier deadline or event is pending, so a message that a thread behind in wall
        time has yet to send cannot be overtaken, and the choice is deterministic. This NIC serialises
        the messages in their arrival order, not in the order a fixed loop would have asked for them.
        """
        if not works:
            raise InvalidValueError("wait_any needs at least one operation")
        world, ep = self.world, self._ep
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
                    raise InvalidValueError(f"{ep.name}: wait_any was given two receives on (source, tag) {key};"
                                            f" only the next one posted on a channel may be waited for")
                seen.add(key)
                gk.append(key)
            groups.append(pend)
            keys.append(gk)
        wall_deadline = time.monotonic() + self.timeout_s
        with world.lock:
            watch = OrderedWait(ep, keys)
            best = watch.first(clock_only=True)
            if best is None:
                watch.recompute()
                ep.watch = watch
                try:
                    best = self._wait_first(watch, wall_deadline, len(works))
                finally:
                    ep.watch = None
            g = groups[best[1]]
            heads = sorted(range(len(g)), key=lambda j: self._match(g[j]._args[1], g[j]._args[2]).head)
        for j in heads:      # each the head of its (source, tag) queue: taken at once, in arrival order
            g[j].wait()
        return best[1]

    def _wait_first(self, watch: OrderedWait, wall_deadline: float, nworks: int) -> tuple[float, int]:
        """(lock held) :meth:`wait_any`'s ordered wait: ``(t, i)`` once group ``i`` may be taken."""
        world, ep = self.world, self._ep
        while True:
            self._raise_if_failed()
            if ep.crashed:
                raise EndpointCrashed(f"{ep.name} has crashed")
            first = watch.first()
            ep.event = None
            if first is not None:
                if ep.fire_event or world.may_take(ep, first[0]):
                    ep.fire_event = False
                    return first
                ep.event = first[0]
            self._raise_if_stuck()
            remaining = wall_deadline - time.monotonic()
            if remaining <= 0:
                raise FabricTimeout(f"{ep.name}: waited {self.timeout_s:g} s (wall) for any of "
                                    f"{nworks} receives")
            self._park(None, watch.keys[0][0], remaining, watch.event)

    def _raise_if_stuck(self) -> None:
        """(lock held) Raise if the run is over or every endpoint waits with nothing in flight."""
        world = self.world
        if world.closed:
            raise ServiceShutdown("the run is over")
        if world.deadlocked:
            raise FabricTimeout(f"{self._ep.name}: deadlock, every endpoint is waiting and none can make "
                                f"progress ({world.deadlock_info})")

    def _candidate(self, src: int | None, tag: int, deadline: float | None) -> Callable[[], float | None]:
        """An ordered receive's candidate event: when its first matching message is delivered, if by
        ``deadline``."""
        def when() -> float | None:
            msg = self._match(src, tag)
            if msg is None or (deadline is not None and msg.delivered > deadline):
                return None
            return msg.delivered
        return when

    def _park(self, deadline: float | None, waiting_for: tuple, remaining: float,
              candidate: Callable[[], float | None] | None = None) -> None:
        """(lock held) Block this endpoint until a message it waits for, a modelled timeout or an ordered
        event wakes it (or a second of wall time passes: the caller loops). ``candidate``: an ordered
        wait's event (:meth:`~.sim_world.World.arrived`), kept up to date while it is parked."""
        ep, world = self._ep, self.world
        world.block(ep, deadline, waiting_for, candidate)
        try:
            if ep.blocked:
                ep.cond.wait(timeout=min(remaining, 1.0))
        finally:
            world.wake(ep)
            ep.deadline, ep.waiting_for, ep.event, ep.candidate = None, None, None, None

    def _raise_if_failed(self) -> None:
        failure = self.world.failure
        if failure is not None and failure[0] != self.rank:
            eid, exc = failure
            raise PeerFailure(f"{self.world.endpoints[eid].name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    # --------------------------------------------------------------- services
    def service(self, name: str, main: Callable[[Fabric], None], *, bandwidth_gbps: float | None = None,
                latency_us: float | None = None, per_port: bool = False) -> int:
        world = self.world
        with world.lock:
            if name in world.service_ids:
                return world.service_ids[name]
            net = world.network
            bw = (bandwidth_gbps if bandwidth_gbps is not None else net.bandwidth_gbps) * 1e9 / 8 * net.payload_fraction
            lat = (latency_us if latency_us is not None else net.latency_us) * 1e-6
            eid = world.add_endpoint(bw, lat, per_port, name).id
            world.service_ids[name] = eid
            fabric = SimFabric(world, eid)
            t = threading.Thread(target=_run_service, args=(world, eid, main, fabric),
                                 name=f"sparsecomm-{name}", daemon=True)
            world.service_threads.append(t)
        t.start()
        return eid

    def services(self) -> dict[str, int]:
        return dict(self.world.service_ids)


def _run_service(world: SimWorld, eid: int, main: Callable[[Fabric], None], fabric: SimFabric) -> None:
    try:
        main(fabric)
    except (ServiceShutdown, EndpointCrashed):
        pass
    except PeerFailure:
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to every worker
        world.service_errors.append((eid, exc))
        world.fail(eid, exc)
        return
    world.finished(eid)
