"""Honesty checks of the emulation: small-message round trip and bulk rate between two hosts of a netbed.

Both run over plain TCP sockets opened by threads that enter the hosts' namespaces (``setns`` is per
thread), so they measure the kernel path a gloo rank uses: veth, the top of rack's forwarding, ``htb``.

- :func:`round_trip_s`: median of ``count`` ping-pongs of ``size`` bytes (TCP_NODELAY).
- :func:`transfer_rate_bps`: payload bits per second of one ``nbytes`` TCP stream, timed from the first
  byte sent to the receiver's acknowledgement that all arrived. ``htb`` shapes whole frames, so on a
  1500-byte MTU the payload rate tops out at 1448/1514 = 0.956 of the configured rate (plus the shaper's
  saved-up millisecond of link time, :data:`~sparsecomm.netbed.topology.HTB_BURST_S`, once per stream).

and, run by every worker of a launch on any fabric (the netbed's ranks, or the SimFabric's):

- :func:`sparsecomm.fabric.probe.fabric_latency_s`: the one-way latency of a small message *as a transport sees it*: the kernel's
  path plus gloo's rendezvous and the wake-ups of the ranks' threads, which on a shared host can be most
  of it. This is the ``alpha`` of the alpha-beta model that
  :class:`~sparsecomm.fabric.sim.sim_network.Network`'s ``latency_us`` stands for (on the SimFabric it
  gives back ``latency_us`` plus the message's serialisation; ``tests/netbed/test_netbed_probe.py``).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

from .topology import Netbed

_PORT = 47000


def _in_ns(ns: str, target, *args):
    """Run ``target(*args)`` on a thread inside namespace ``ns``; return its result (or raise its error)."""
    from pyroute2 import netns

    out: dict = {}

    def run() -> None:
        try:
            netns.setns(ns)
            out["value"] = target(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _result(t: threading.Thread, out: dict, timeout: float):
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError("netbed probe did not finish")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _listener(ready: threading.Event, port: int, serve):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    s.settimeout(30)
    ready.set()
    try:
        c, _ = s.accept()
        c.settimeout(60)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            return serve(c)
    finally:
        s.close()


def _recv_exact(c: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        d = c.recv(n - got)
        if not d:
            raise ConnectionError("peer closed")
        got += len(d)


def _pair(bed: Netbed, a: int, b: int, serve, client, port: int, timeout: float):
    ready = threading.Event()
    ts, outs = _in_ns(bed.host_ns(b), _listener, ready, port, serve)
    if not ready.wait(10):
        _result(ts, outs, 1)
        raise TimeoutError("netbed probe listener did not start")
    addr = bed.address(b)

    def connect():
        c = socket.create_connection((addr, port), timeout=30)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            return client(c)

    tc, outc = _in_ns(bed.host_ns(a), connect)
    value = _result(tc, outc, timeout)
    _result(ts, outs, timeout)
    return value


def round_trip_s(bed: Netbed, a: int = 0, b: int = 1, *, size: int = 64, count: int = 400,
                 port: int = _PORT) -> float:
    """Median round trip of a ``size``-byte message from host ``a`` to host ``b`` and back."""
    msg = b"\x01" * size

    def serve(c):
        for _ in range(count):
            _recv_exact(c, size)
            c.sendall(msg)

    def client(c):
        rtts = []
        for _ in range(count):
            t = time.perf_counter()
            c.sendall(msg)
            _recv_exact(c, size)
            rtts.append(time.perf_counter() - t)
        return statistics.median(rtts)

    return _pair(bed, a, b, serve, client, port, 60)


def transfer_rate_bps(bed: Netbed, a: int = 0, b: int = 1, *, nbytes: int = 20 * 2**20,
                      port: int = _PORT + 1) -> float:
    """Payload rate (bits/s) of one ``nbytes`` TCP transfer from host ``a`` to host ``b``."""
    chunk = b"\x00" * (1 << 20)

    def serve(c):
        _recv_exact(c, nbytes)
        c.sendall(b"k")

    def client(c):
        t = time.perf_counter()
        left = nbytes
        while left:
            n = min(left, len(chunk))
            c.sendall(chunk[:n])
            left -= n
        _recv_exact(c, 1)
        return nbytes * 8 / (time.perf_counter() - t)

    return _pair(bed, a, b, serve, client, port, 600)
