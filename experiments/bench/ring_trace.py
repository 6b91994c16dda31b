"""Trace the library's ring on the netbed: per rank, when each message is posted, waited for and done.

    python -m experiments.bench.ring_trace --workers 4 --size-mb 10 --gbps 1 --calls 8

Each rank runs ``--calls`` calls of native ``all_reduce`` and ``ring`` interleaved (in place, float32, one
barrier before each call, as ``netbed_vs_sim`` does); the fabric of the ring is wrapped so that every
``isend``/``irecv`` records its post time and every ``wait`` its start and end (``time.monotonic``, one
clock for every namespace of the machine). It prints each call's time (slowest rank), per rank the process
CPU per call (user and system: ``os.times``, which counts the rank's gloo threads) and the machine's
softirq time per call (``/proc/stat``: the kernel's forwarding and shaping, which no process is charged
for), and the last ring call's timeline, relative to the start of that call:

    rank  step  kind  bytes  posted  wait-start  done   (ms)

For a receive, ``done`` is when the main thread got it (it waits on it, so that is when it arrived unless the
main thread was busy); for a send, when its wait returned (the bytes were handed to the kernel). Needs root.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports)


class _Work:
    def __init__(self, log: list, rec: list, work) -> None:
        self._log, self._rec, self._work = log, rec, work

    def wait(self, timeout=None):
        if self._rec[4] is None:
            self._rec[4] = time.monotonic()
        out = self._work.wait(timeout)
        if self._rec[5] is None:
            self._rec[5] = time.monotonic()
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TracingFabric:
    """A proxy of a fabric recording ``[kind, peer, bytes, posted, wait_start, done]`` per message."""

    def __init__(self, fabric) -> None:
        self._f = fabric
        self.log: list = []

    def __getattr__(self, name):
        return getattr(self._f, name)

    def _wrap(self, kind: str, t: torch.Tensor, peer, work) -> _Work:
        rec = [kind, peer, t.numel() * t.element_size(), time.monotonic(), None, None]
        self.log.append(rec)
        return _Work(self.log, rec, work)

    def isend(self, tensor, dst, tag=0, **kw):
        return self._wrap("send", tensor, dst, self._f.isend(tensor, dst, tag, **kw))

    def irecv(self, tensor, src=None, tag=0):
        return self._wrap("recv", tensor, src, self._f.irecv(tensor, src, tag))


#: (name, struct format, offset) of the struct tcp_info fields read (linux/tcp.h)
_TCP_INFO = [("rtt_us", "I", 68), ("cwnd", "I", 80), ("total_retrans", "I", 100), ("pacing_Bps", "Q", 104),
             ("bytes_acked", "Q", 120), ("bytes_received", "Q", 128), ("notsent", "I", 144), ("min_rtt_us", "I", 148),
             ("delivery_Bps", "Q", 160), ("busy_us", "Q", 168), ("rwnd_limited_us", "Q", 176),
             ("sndbuf_limited_us", "Q", 184), ("bytes_sent", "Q", 200)]


def _tcp_sockets() -> dict:
    """This process's established IPv4 TCP sockets: ``{(local port, peer address, peer port): socket}``."""
    import socket

    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM:
                peer = s.getpeername()
                out[(s.getsockname()[1], peer[0], peer[1])] = s
                continue
        except OSError:
            pass
        s.close()      # the duplicate only
    return out


def _tcp_info(socks: dict) -> dict:
    import socket
    import struct

    out = {}
    for key, s in socks.items():
        raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        out[key] = {name: struct.unpack_from(fmt, raw, off)[0] for name, fmt, off in _TCP_INFO}
    return out


def _softirq_s() -> float:
    with open("/proc/stat") as fh:
        cols = fh.readline().split()
    return int(cols[7]) / os.sysconf("SC_CLK_TCK")     # cpu  user nice system idle iowait irq softirq


def _set_cc(cc: str) -> None:
    import socket

    for s in _tcp_sockets().values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        s.close()      # the duplicate only


def _rank(ctx, numel: int, calls: int, segment_bytes: int | None, ccs: tuple = (), segs: tuple = ()):
    f = ctx.fabric
    tf = TracingFabric(f)
    native = sc.transports.get("native", f, inplace=True)
    kw = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
    ring = sc.transports.get("ring", tf, inplace=True, **kw)
    x = torch.ones(numel)
    names = ["native", "ring"] + [f"ring/{cc}" for cc in ccs] + [f"ring/seg={b}" for b in segs]
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    soft = {k: [] for k in names}
    cases = [("native", native), ("ring", ring)] + [(f"ring/{cc}", ring) for cc in ccs]
    cases += [(f"ring/seg={b}", sc.transports.get("ring", f, inplace=True, segment_bytes=b)) for b in segs]
    t_start = 0.0
    socks, tcp0, tcp1 = {}, {}, {}
    for i in range(calls + 1):
        for name, t in cases:
            if ccs:
                f.barrier()
                _set_cc(name.partition("/")[2] if name.partition("/")[2] in ccs else "bbr")
            x.fill_(1.0)
            if name == "ring":
                tf.log.clear()
            f.barrier()
            if name == "ring" and i == calls:
                socks = _tcp_sockets()
                tcp0 = _tcp_info(socks)
            c0, s0, t0 = os.times(), _softirq_s(), time.monotonic()
            t.allreduce(x)
            t1 = time.monotonic()
            c1, s1 = os.times(), _softirq_s()
            if name == "ring" and i == calls:
                tcp1 = _tcp_info(socks)
            if name == "ring":
                t_start = t0
            if i:
                times[name].append((t0, t1))
                cpu[name].append((c1.user - c0.user, c1.system - c0.system))
                soft[name].append(s1 - s0)
            if not torch.equal(x, torch.full_like(x, float(ctx.world_size))):
                raise AssertionError(f"{name}: wrong sum")
    log = [[k, p, b] + [None if v is None else v - t_start for v in (a, w, d)] for k, p, b, a, w, d in tf.log]
    flows = []
    for key, a in tcp1.items():
        b = tcp0[key]
        if a["bytes_sent"] - b["bytes_sent"] > 100000:
            d = {k: a[k] - b[k] for k in ("busy_us", "rwnd_limited_us", "sndbuf_limited_us", "bytes_sent",
                                          "total_retrans")}
            d.update({k: a[k] for k in ("rtt_us", "min_rtt_us", "cwnd", "pacing_Bps", "delivery_Bps")})
            flows.append((key[1], d))
    for s in socks.values():
        s.close()      # the duplicate only
    return times, cpu, soft, log, flows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size-mb", type=float, default=10.0)
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--segment-bytes", type=int, default=None)
    ap.add_argument("--cc", nargs="*", default=[], help="also time the ring with these congestion controls "
                    "(set on every socket before the call; the other calls are set back to bbr)")
    ap.add_argument("--loopback", action="store_true", help="run on backend 'gloo' (loopback) instead")
    ap.add_argument("--segments", type=int, nargs="*", default=[],
                    help="also time the ring with these segment_bytes (alternated with the others)")
    a = ap.parse_args(argv)
    numel = int(a.size_mb * 1e6) // 4
    with open("/proc/loadavg") as fh:
        print("load average", " ".join(fh.read().split()[:3]))
    res = sc.launch(functools.partial(_rank, numel=numel, calls=a.calls, segment_bytes=a.segment_bytes,
                                      ccs=tuple(a.cc), segs=tuple(a.segments)),
                    a.workers, timeout_s=600,
                    **(dict(backend="gloo") if a.loopback else
                       dict(backend="netbed", network=sc.Network(bandwidth_gbps=a.gbps))))
    for name in res[0][0]:
        per_call = [max(r[0][name][i][1] - r[0][name][i][0] for r in res) for i in range(a.calls)]
        all_in = [max(r[0][name][i][1] for r in res) - max(r[0][name][i][0] for r in res) for i in range(a.calls)]
        skew = [max(r[0][name][i][0] for r in res) - min(r[0][name][i][0] for r in res) for i in range(a.calls)]
        print(f"{name:6s} ms", [round(1e3 * v, 1) for v in per_call], f"median {1e3 * statistics.median(per_call):.1f}; "
              f"from the last rank's start: median {1e3 * statistics.median(all_in):.1f} (start skew "
              f"median {1e3 * statistics.median(skew):.2f}, max {1e3 * max(skew):.2f})")
        print(f"{name:6s} CPU ms per call (user+sys, median) per rank",
              [f"{1e3 * statistics.median(u for u, _ in r[1][name]):.0f}+"
               f"{1e3 * statistics.median(s for _, s in r[1][name]):.0f}" for r in res],
              f"softirq (machine) {1e3 * statistics.median(res[0][2][name]):.0f}")
    with open("/proc/loadavg") as fh:
        print("load average", " ".join(fh.read().split()[:3]))
    print("last ring call, its sending TCP connections (deltas over the call; rtt, cwnd, rates at its end):")
    for rank, r in enumerate(res):
        for peer, d in r[4]:
            print(f"  {rank} -> {peer}: sent {d['bytes_sent']} B, retrans {d['total_retrans']}, busy "
                  f"{d['busy_us'] / 1e3:.1f} ms, rwnd-limited {d['rwnd_limited_us'] / 1e3:.1f} ms, sndbuf-limited "
                  f"{d['sndbuf_limited_us'] / 1e3:.1f} ms; rtt {d['rtt_us']} us (min {d['min_rtt_us']}), cwnd "
                  f"{d['cwnd']}, pacing {d['pacing_Bps'] / 1e6:.0f} MB/s, delivery {d['delivery_Bps'] / 1e6:.0f} MB/s")
    print("last ring call per step: transfer (left's send posted -> received) / gap (received -> own send "
          "posted), ms; link time of a chunk at the rate: "
          f"{(numel // a.workers) * 4 * 1514 / 1448 / (a.gbps * 1e9 / 8) * 1e3:.1f} ms")
    data = [([e for e in r[3] if e[0] == "send" and e[2] > 4096], [e for e in r[3] if e[0] == "recv" and e[2] > 4096])
            for r in res]
    n = a.workers
    for rank in range(n):
        sends_l, _ = data[(rank - 1) % n]
        sends, recvs = data[rank]
        k = max(1, len(recvs) // (2 * (n - 1)))       # segments per step
        cells = []
        for i in range(len(recvs)):
            xfer = recvs[i][5] - max(sends_l[i][3], recvs[i][3])
            gap = sends[i + k][3] - recvs[i][5] if i + k < len(sends) else float("nan")
            cells.append(("| " if i % k == 0 else "") + f"{1e3 * xfer:4.1f}/{1e3 * gap:3.1f}")
        print(f"  rank {rank}: data from {1e3 * sends[0][3]:.1f} to {1e3 * recvs[-1][5]:.1f}; " + " ".join(cells))
    print("last ring call, ms from its start:")
    print(" rank kind  peer     bytes   posted  wait-start    done")
    for rank, r in enumerate(res):
        for k, p, b, posted, w, d in r[3]:
            fmt = lambda v: "       -" if v is None else f"{1e3 * v:8.2f}"   # noqa: E731
            print(f"{rank:5d} {k:5s} {p!s:>4s} {b:9d} {fmt(posted)} {fmt(w)} {fmt(d)}")


if __name__ == "__main__":
    main()
