"""The gate between the threads of user code and the SimFabric's single-threaded loop.

A simulated worker's training loop keeps its own thread (the launcher's, :mod:`sparsecomm.launch.sim_backend`)
up to the moment it communicates; a service whose ``main`` blocks (rather than being a process of the loop)
gets a thread here. Such a thread hands what it waits for to the world as a process
(:class:`~sparsecomm.fabric.sim.sim_world.Proc`) and parks on the gate; when every endpoint's thread has
parked or finished, the last one to park runs the world's loop (:meth:`~.sim.sim_world.World.run`) in
place, and every thread whose process is done is woken. The world itself is never touched by two threads
at once: this module's lock is held by whoever calls into it.

A process of the loop that blocks on a receive itself (rather than yielding its wait) would wait for its
own thread: it raises :class:`~sparsecomm.errors.ProtocolError` instead.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generator

from ..errors import EndpointCrashed, FabricTimeout, PeerFailure, ProtocolError, ServiceShutdown
from .sim.sim_world import World

__all__ = ["Gate"]


class Gate:
    """The lock of one simulated world and the threads parked on it (:mod:`this module <.sim_gate>`)."""

    def __init__(self, world) -> None:
        self.world = world
        self.lock = threading.RLock()
        self._cond = threading.Condition(self.lock)
        self._looper: threading.Thread | None = None
        self.runs = 0                       # runs of the loop finished, for the wall-time bound of a wait
        self.service_threads: list[threading.Thread] = []

    def call(self, ep, gen: Generator, what: str = "a message"):
        """Run the process ``gen`` of endpoint ``ep`` from this thread until it returns: its result, or
        its exception raised here.

        Raises :class:`~sparsecomm.errors.FabricTimeout` when the network's ``timeout_s`` of wall time pass
        with the loop idle: some endpoint's thread has not yet handed its call to the world (a worker
        stuck in its own code). Time in which the loop runs does not count: a simulation of many workers
        may take longer than ``timeout_s`` of wall time for one call, and its waits are bounded in modelled
        time by the loop itself."""
        world = self.world
        with self._cond:
            if self._looper is threading.current_thread():
                gen.close()
                raise ProtocolError(
                    f"{ep.name}: a process of the simulated world blocked on a wait itself; a protocol yields "
                    f"its waits to the fabric (sparsecomm.fabric.roles) rather than calling recv or wait")
            p = world.spawn(ep, gen, owner=True)
            world.park(ep)
            deadline, runs = time.monotonic() + world.network.timeout_s, self.runs
            try:
                ran = False
                while not p.done:
                    ending = world.closed or world.failure is not None   # (its wait raises at once)
                    if (world.running == 0 or ending) and self._looper is None and not ran:
                        self._run()         # (once per wake-up: a loop that stopped short waits for a thread)
                        ran = True
                        continue
                    if self.runs != runs:           # the loop ran meanwhile: the wait counts from its end
                        runs, deadline = self.runs, time.monotonic() + world.network.timeout_s
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise FabricTimeout(f"{ep.name}: waited {world.network.timeout_s:g} s (wall) for {what}")
                    self._cond.wait(min(remaining, 1.0))
                    ran = False
            except BaseException:
                if not p.done:
                    world.cancel(p)
                    world.unpark(ep)
                raise
        if p.error is not None:
            raise p.error
        return p.result

    def looping(self) -> bool:
        """Whether this thread is running the world's loop (the code of a process of the loop, whichever
        endpoint's thread lent it)."""
        return self._looper is threading.current_thread()

    def _run(self) -> None:
        """(lock held) Run the loop in this thread, then wake every parked thread to look at its process."""
        self._looper = threading.current_thread()
        try:
            self.world.run()
        finally:
            self._looper = None
            self.runs += 1
            self._cond.notify_all()

    def _kick(self, always: bool = False) -> None:
        """(lock held) Run the loop if no endpoint's thread runs (``always``: whatever runs, on the paths that
        end a run, where only the order of errors is at stake)."""
        if self._looper is None and (always or self.world.running == 0):
            self._run()

    def finished(self, eid: int) -> None:
        """Endpoint ``eid``'s thread has returned: it sends nothing more."""
        with self.lock:
            World.finished(self.world, eid)
            self._kick()

    def fail(self, eid: int, exc: BaseException) -> None:
        """Endpoint ``eid`` failed: every other endpoint's waits raise :class:`PeerFailure`."""
        with self.lock:
            World.fail(self.world, eid, exc)
            self._kick(always=True)

    def close(self) -> None:
        """End the run: the services still waiting leave; their threads are joined."""
        with self.lock:
            World.close(self.world)
            self._kick(always=True)
        for t in self.service_threads:
            t.join(timeout=self.world.network.timeout_s)

    def start_service(self, eid: int, name: str, main: Callable, fabric) -> None:
        """(lock held) Run the blocking service ``main(fabric)`` of endpoint ``eid`` on a thread of its own."""
        t = threading.Thread(target=self._serve, args=(eid, main, fabric), name=f"sparsecomm-{name}",
                             daemon=True)
        self.service_threads.append(t)
        t.start()

    def _serve(self, eid: int, main: Callable, fabric) -> None:
        try:
            main(fabric)
        except (ServiceShutdown, EndpointCrashed, PeerFailure):
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to every worker
            with self.lock:
                self.world.service_errors.append((eid, exc))
            self.fail(eid, exc)
            return
        self.finished(eid)
