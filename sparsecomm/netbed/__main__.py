"""Command line of the netbed.

``python -m sparsecomm.netbed run --hosts N --gbps G -- CMD ...``: build an N-host netbed, run CMD once
on every host (in its namespace) with the torch.distributed environment set, wait for all, remove the
netbed, exit with the first non-zero status. The environment of host ``i``: ``RANK=i``, ``NODE_RANK=i``,
``LOCAL_RANK=0``, ``WORLD_SIZE=N``, ``MASTER_ADDR`` (host 0's address), ``MASTER_PORT`` (``--port``),
``GLOO_SOCKET_IFNAME`` (the host's link), ``NETBED_HOST_ADDR``. The same names in braces in CMD are
replaced per host (``{rank}``, ``{world_size}``, ``{master_addr}``, ``{master_port}``, ``{host_addr}``,
``{ifname}``, ``{store_addr}``, ``{store_port}``), which is how one torchrun per host is started (the
"beyond one machine" recipe)::

    python -m sparsecomm.netbed run --hosts 2 --gbps 1 -- \\
        torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-id netbed \\
                 --rdzv-endpoint {store_addr}:{store_port} --rdzv-conf is_host=false \\
                 --local-addr {host_addr} train.py

**The rendezvous store** of such a job: when CMD names ``{store_addr}`` or ``{store_port}``, ``run`` hosts a
TCPStore on the top of rack (``store_addr``, every host reaches it; ``--store-port``, default ``--port`` + 1)
from before the first command starts until every command has ended. torchrun's agents (``--rdzv-conf
is_host=false``: none hosts a store) rendezvous and meet at their exit barrier there. With the store
hosted by an agent (``--master-addr``/``--master-port``, or c10d's ``is_host`` on host 0), that agent
exits as soon as it has passed the barrier, taking the store with it, while another agent may still be
waiting on it: that one logs torch-elastic's "Error waiting on exit barrier" with the store's C++ stack
trace (the job's status is still 0; pytorch/pytorch#69520).

Every host shares this machine's cores: unless ``OMP_NUM_THREADS`` is set, each host's command gets
``OMP_NUM_THREADS = max(1, cores // hosts)`` (torch reads it at start-up; torchrun does the same for
several processes per node), and ``run`` says so on stderr: with torch's default of one thread per core
in every host, the hosts oversubscribe the cores and every protocol figure is slower.

Each host's command runs under ``ip netns exec`` in a session of its own; when one fails, the others
are terminated (after ``--grace`` seconds), and on exit, Ctrl-C, SIGTERM or ``--timeout`` every process
group is killed and the namespaces are removed.

The netbed shapes bandwidth only: latency and loss need the ``netem`` qdisc (or ``prio`` with a filter,
or nftables), which this kernel lacks, so ``run`` offers neither (``--latency-us`` or ``--loss`` other
than 0 is refused, naming the SimFabric, which models both: ``--backend sim`` in the studies).

``python -m sparsecomm.netbed check --gbps G``: the honesty check (round trip shaped vs unshaped, bulk
rate vs configured). ``python -m sparsecomm.netbed calibrate --out host.json [--quick]``: this machine's
host costs as a profile for ``sc.Network.from_profile`` (:mod:`sparsecomm.netbed.calibrate`; run as root, it
also builds a 2-host netbed for a moment to measure its per-message latency, ``--no-netbed`` to skip). ``python -m sparsecomm.netbed list`` / ``cleanup``: the netbeds on this machine /
remove those whose owner is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from ..errors import InvalidValueError, NetbedError
from ..launch.base import threads_per_rank

from .launch import store_in, terminate_as_interrupt
from .topology import Netbed, check_shaping, cleanup_stale, list_netbed_namespaces


def host_env(bed: Netbed, rank: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "NODE_RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(bed.hosts),
            "MASTER_ADDR": bed.address(0), "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0",
            "NETBED_HOST_ADDR": bed.address(rank)}


#: the fields of CMD that make ``run`` host the rendezvous store (module docstring)
STORE_FIELDS = ("{store_addr}", "{store_port}")


def host_command(cmd: list[str], bed: Netbed, rank: int, port: int, store_port: int | None = None) -> list[str]:
    fields = {"rank": rank, "world_size": bed.hosts, "master_addr": bed.address(0), "master_port": port,
              "host_addr": bed.address(rank), "ifname": "eth0", "store_addr": bed.tor_addr,
              "store_port": port + 1 if store_port is None else store_port}
    out = []
    for arg in cmd:
        for k, v in fields.items():
            arg = arg.replace("{" + k + "}", str(v))
        out.append(arg)
    return out


def run(cmd: list[str], hosts: int, gbps: float | None, *, port: int = 29500, timeout_s: float | None = None,
        grace_s: float = 5.0, env: dict[str, str] | None = None, store_port: int | None = None) -> int:
    """Run ``cmd`` on every host of a fresh netbed; the first non-zero exit status (0 if all succeed). A
    ``cmd`` that names ``{store_addr}`` or ``{store_port}`` gets the rendezvous store on the top of rack
    (``store_port``, default ``port + 1``), up until every host's command has ended (module docstring)."""
    if not cmd:
        raise InvalidValueError("no command given (python -m sparsecomm.netbed run --hosts N -- CMD ...)")
    threads = {}
    if "OMP_NUM_THREADS" not in {**os.environ, **(env or {})}:
        k = threads_per_rank(hosts)
        threads = {"OMP_NUM_THREADS": str(k)}
        print(f"netbed: OMP_NUM_THREADS={k} on each of the {hosts} hosts (cores // hosts; set "
              f"OMP_NUM_THREADS to choose)", file=sys.stderr)
    store_port = port + 1 if store_port is None else store_port
    with terminate_as_interrupt():
        bed = Netbed(hosts, gbps)
        procs: list[subprocess.Popen] = []
        store = None
        try:
            if any(f in arg for arg in cmd for f in STORE_FIELDS):
                store = store_in(bed.tor_ns, bed.tor_addr, hosts, timeout_s or 300.0, store_port)
            for r in range(hosts):
                penv = {**os.environ, **threads, **(env or {}), **host_env(bed, r, port)}
                procs.append(subprocess.Popen(["ip", "netns", "exec", bed.host_ns(r)] +
                                              host_command(cmd, bed, r, port, store_port), env=penv,
                                              start_new_session=True))
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            failed_at = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    return next((c for c in codes if c != 0), 0)
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = time.monotonic()
                now = time.monotonic()
                if failed_at is not None and now - failed_at > grace_s:
                    return next(c for c in codes if c not in (None, 0))
                if deadline is not None and now > deadline:
                    print(f"netbed: timeout after {timeout_s:g} s; terminating every host's command",
                          file=sys.stderr)
                    return 124
                time.sleep(0.05)
        finally:
            _stop(procs)
            del store          # after every command has ended: no agent is left to wait on it
            bed.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate each command's whole process group (it runs in a session of its own), then kill."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        live = []
        for p in procs:
            try:
                os.killpg(p.pid, sig)
                live.append(p)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs) and sig == signal.SIGTERM:
            # the leaders are gone; their groups may not be: one SIGKILL pass clears them
            continue


def check(gbps: float) -> dict[str, float]:
    """Round trip (shaped vs unshaped) and bulk rate on ``gbps`` links; returns the figures."""
    from .probe import round_trip_s, transfer_rate_bps

    with Netbed(2, gbps) as shaped, Netbed(2, None) as free:
        rtt_free = round_trip_s(free)
        rtt_shaped = round_trip_s(shaped)
        rate = transfer_rate_bps(shaped, nbytes=max(2 * 2**20, int(gbps * 1e9 / 8 * 1.0)))
    return {"rtt_unshaped_us": rtt_free * 1e6, "rtt_shaped_us": rtt_shaped * 1e6,
            "rtt_ratio": rtt_shaped / rtt_free, "payload_rate_gbps": rate / 1e9,
            "rate_ratio": rate / (gbps * 1e9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsecomm.netbed", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run a command on every host of a fresh netbed (OMP_NUM_THREADS = "
                                   "max(1, cores // hosts) per host unless set)")
    r.add_argument("--hosts", type=int, required=True)
    r.add_argument("--gbps", type=float, default=1.0, help="link rate; 0 = unshaped")
    # not offered (absent from --help): this kernel has no netem, prio or nftables; given, they are refused
    # with the reason and the SimFabric alternative (check_shaping)
    r.add_argument("--latency-us", type=float, default=0.0, help=argparse.SUPPRESS)
    r.add_argument("--loss", type=float, default=0.0, help=argparse.SUPPRESS)
    r.add_argument("--port", type=int, default=29500, help="MASTER_PORT")
    r.add_argument("--store-port", type=int, default=None,
                   help="port of the rendezvous store on the top of rack, {store_port} (default: --port + 1)")
    r.add_argument("--timeout", type=float, default=None, help="seconds before every command is terminated")
    r.add_argument("--grace", type=float, default=5.0,
                   help="seconds the other hosts' commands get to end after one fails")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS ...")
    c = sub.add_parser("check", help="measure the emulation's round trip and rate")
    c.add_argument("--gbps", type=float, default=1.0)
    from . import calibrate as _calibrate

    _calibrate.add_arguments(sub.add_parser("calibrate", help="measure this machine's host costs and write a "
                                                              "profile for sc.Network.from_profile"))
    sub.add_parser("list", help="netbed namespaces on this machine")
    sub.add_parser("cleanup", help="remove namespaces of netbeds whose owner process is gone")
    a = p.parse_args(argv)
    try:
        if a.what == "run":
            check_shaping(a.latency_us, a.loss)
            cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
            return run(cmd, a.hosts, a.gbps or None, port=a.port, timeout_s=a.timeout, grace_s=a.grace,
                       store_port=a.store_port)
        if a.what == "check":
            for k, v in check(a.gbps).items():
                print(f"{k}: {v:.4g}")
            return 0
        if a.what == "calibrate":
            return _calibrate.run(a)
        if a.what == "list":
            print("\n".join(list_netbed_namespaces()))
            return 0
        for ns in cleanup_stale():
            print(f"removed {ns}")
        return 0
    except NetbedError as exc:
        print(f"netbed: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
