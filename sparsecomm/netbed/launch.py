"""The ``netbed`` backend of :func:`sparsecomm.launch`: real gloo processes on an emulated rack.

A netbed needs root and real processes, so this example is a script (``tests/repo/test_docs.py`` runs it
under ``-m slow``)::

    import torch
    import sparsecomm as sc

    def fn(ctx):                                     # the same fn(ctx) as on "sim" and "gloo"
        t = sc.transports.get("switch", ctx.fabric)
        return t.allreduce(torch.full((1000,), float(ctx.rank)))[0].item()

    if __name__ == "__main__":
        assert sc.launch(fn, world_size=4, backend="netbed", network=sc.Network(bandwidth_gbps=1),
                         services=["switch"], timeout_s=60) == [6.0] * 4

A :class:`~sparsecomm.netbed.topology.Netbed` is built for the run and removed afterwards (on every exit
path: return, exception, Ctrl-C, SIGTERM). Placement follows the paper testbeds:

- worker rank ``r`` runs on host ``r`` (its own namespace and link);
- a service whose name ends in ``switch`` (``"switch"``, the SwitchML data plane) runs on the top-of-rack
  namespace, so each worker's link is one switch port;
- every other service (a dedicated OmniReduce aggregator ``"omnireduce-agg:i"``) gets a host of its own
  with its own link, after the workers.

The ranks are the same spawned processes as the ``gloo`` backend
(:func:`sparsecomm.launch.torch_backend.spawn`: forkserver children, supervision, failure reporting,
results back over a pipe from the parent's own children); each child first enters its namespace
(``setns``) and sets ``GLOO_SOCKET_IFNAME`` to its link, so every gloo byte crosses the shaped links and
the kernel's forwarding. The rendezvous TCPStore is hosted by the parent inside the top-of-rack
namespace (listening on all of its ports).

``network``: a :class:`~sparsecomm.fabric.sim.sim_network.Network`; only ``bandwidth_gbps`` applies (and
``timeout_s`` when ``timeout_s`` is not given). The netbed's latency is the kernel's own (nothing adds
delay), so ``latency_us`` must be left at its default (or 0); latency and loss other than that raise
:class:`~sparsecomm.errors.NetbedError` (the netbed has no ``netem``), and so do ``stragglers`` and
``crash`` (fault injection of the modelled network). ``bandwidth_gbps=None`` via
``netbed_unshaped=True`` runs on unshaped veth links.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Sequence

from ..errors import InvalidTypeError, InvalidValueError, NetbedError
from ..fabric.sim.sim_network import Network
from ..launch import Context, backends
from .topology import Netbed, check_shaping, resolve_as

_DEFAULT_LATENCY_US = Network.__dataclass_fields__["latency_us"].default


def is_in_network(spec: str) -> bool:
    """Does service ``spec`` run on the top of rack (a switch) rather than on a host of its own?"""
    return spec.partition(":")[0].endswith("switch")


def placement(world_size: int, services: Sequence[str]) -> tuple[int, list[int | None]]:
    """``(hosts, where)``: the number of hosts and, per rank, its host index (``None``: the top of rack)."""
    where: list[int | None] = list(range(world_size))
    hosts = world_size
    for spec in services:
        if is_in_network(spec):
            where.append(None)
        else:
            where.append(hosts)
            hosts += 1
    return hosts, where


def check_network(network: Network | None) -> float | None:
    """The bandwidth to shape to; :class:`NetbedError` for what the netbed cannot emulate."""
    if network is None:
        return Network().bandwidth_gbps
    latency = 0.0 if network.latency_us in (0.0, _DEFAULT_LATENCY_US) else network.latency_us
    check_shaping(latency, network.loss)
    if network.stragglers or network.crash:
        raise NetbedError(f"the netbed runs real processes: stragglers={network.stragglers} and "
                          f"crash={network.crash} are fault injections of backend='sim'; inject real "
                          f"faults (kill a process) instead")
    return network.bandwidth_gbps


def enter_namespace(namespaces: Sequence[str], ifnames: Sequence[str], rank: int) -> None:
    """Child prologue: move this process into rank ``rank``'s namespace (with its hosts file, as under
    ``ip netns exec``) and point gloo at its link."""
    from pyroute2 import netns

    netns.setns(namespaces[rank])
    resolve_as(namespaces[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = ifnames[rank]


def store_in(ns: str, addr: str, total: int, timeout_s: float, port: int = 0):
    """A master TCPStore listening inside namespace ``ns`` on ``port`` (0: a free one), created by a thread
    that enters ``ns`` and its hosts file: namespaces are per thread, so the caller's own stay as they are;
    the store's threads, started by that thread, resolve the ranks' addresses to their names. The store
    listens on every address of ``ns``; its own client connects to ``addr``, one of them."""
    import torch.distributed as dist
    from pyroute2 import netns

    out: dict[str, Any] = {}

    def make() -> None:
        try:
            netns.setns(ns)
            resolve_as(ns)
            out["store"] = dist.TCPStore(addr, port, total, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=timeout_s))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=make, name="sparsecomm-netbed-store")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["store"]


@contextmanager
def terminate_as_interrupt():
    """While inside, SIGTERM (and SIGHUP) raise KeyboardInterrupt in the main thread, so that every
    ``finally`` (process reaping, netbed removal) runs; outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            # a forked helper (pyroute2 forks to enter namespaces) inherits this handler: it must die as
            # it would have, not unwind into the parent's clean-up code (which would remove the netbed)
            os._exit(128 + signum)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _launch_netbed(fn: Callable[[Context], Any], world_size: int, *, network: Network | None = None,
                   timeout_s: float | None = None, services: Sequence[str] = (),
                   start_method: str | None = None, netbed_unshaped: bool = False,
                   on_netbed: Callable[[Netbed], None] | None = None, trace: str | None = None,
                   pin_cores: bool = False, **options: Any) -> list[Any]:
    """``on_netbed(netbed)`` (optional) is called once the netbed is up (tests use it to see the names);
    ``trace``: the run's timeline file, ``pin_cores``: every rank on a core of its own turn (both the gloo
    backend's, :func:`sparsecomm.launch`)."""
    from ..launch import torch_backend as lt

    if options:
        raise InvalidTypeError(f"unexpected options for the netbed backend: {sorted(options)}")
    if not isinstance(pin_cores, bool):
        raise InvalidTypeError(f"pin_cores must be a bool, got {pin_cores!r}")
    gbps = None if netbed_unshaped else check_network(network)
    if isinstance(services, str):
        services = (services,)
    services = tuple(services)
    if timeout_s is None:
        timeout_s = network.timeout_s if network is not None else lt.DEFAULT_TIMEOUT_S
    timeout_s = float(timeout_s)
    if timeout_s <= 0:
        raise InvalidValueError(f"timeout_s must be positive, got {timeout_s}")
    hosts, where = placement(world_size, services)
    with terminate_as_interrupt():
        bed = Netbed(hosts, gbps)
        try:
            if on_netbed is not None:
                on_netbed(bed)
            namespaces = [bed.tor_ns if h is None else bed.host_ns(h) for h in where]
            ifnames = [bed.ifname(ns) for ns in namespaces]
            return lt.spawn("gloo", fn, world_size, timeout_s, services, start_method,
                            make_store=functools.partial(store_in, bed.tor_ns, bed.tor_addr),
                            master_addr=bed.tor_addr,
                            prologue=functools.partial(enter_namespace, tuple(namespaces), tuple(ifnames)),
                            trace=trace, pin_cores=pin_cores)
        finally:
            bed.close()


backends.register("netbed")(_launch_netbed)
