"""A rack on one machine: n hosts in network namespaces, each with one shaped link to a top-of-rack
namespace that forwards IP between them. The kernel does all the networking (veth links, IP forwarding,
``htb`` shaping); nothing here touches a packet.

Layout of a netbed with prefix ``P`` (unique per netbed: the owner's pid and 4 random hex digits, so two
netbeds, or two test runs, never collide; every name lives in a namespace this netbed created)::

    namespace P-h<i>   : lo, eth0 = 10.77.<i>.2/24, default route via 10.77.<i>.1
    namespace P-tor    : lo, p<i> = 10.77.<i>.1/24 (one port per host), net.ipv4.ip_forward = 1

Each veth pair (``eth0`` in the host, ``p<i>`` in the top of rack) is created directly inside the two
namespaces, so no interface name ever exists in the root namespace. Both ends get a root ``htb``
qdisc with one class at ``bandwidth_gbps`` (rate = ceil), so every link is shaped in both directions.
``htb`` and not ``tbf``: a ``tbf`` root qdisc on veth links delays a small message's round trip, where
``htb`` keeps an unshaped link's (the honesty check, ``python -m sparsecomm.netbed check``; BENCHMARKS.md,
"Transports on the netbed"), and a delay per round trip would punish exactly the protocols with round
trips. ``htb`` counts the whole frame (Ethernet + IP + TCP
headers), so a TCP stream carries about 1448/1514 = 95.6% of the configured rate as payload, as a real
1500-MTU link does.

Each link's largest send burst is capped to :data:`GSO_BURST_S` of link time (:func:`gso_max_size`). The
kernel hands a veth whole GSO packets of up to 64 KiB, and TCP Small Queues lets a socket keep about two of
them in the ``htb`` queue; a connection's acknowledgements wait in that queue behind the other direction's
data. At 1 Gbit/s two 64 KiB bursts are ~1 ms of link time, but at 100 Mbit/s they are ~11 ms, the round
trip of every flow crossing it grows to that, and a congestion control whose window follows the minimum
round trip (BBR, a common default) cannot cover it: one direction of an exchange then falls below the
link rate (with and without the cap: BENCHMARKS.md, "SimFabric vs netbed"). A
real NIC sends a 64 KiB segmentation burst in 5-50 us at 10-100 Gbit/s; capping the burst to 0.5 ms of
link time keeps the emulated link in that regime (at 1 Gbit/s, 62500 bytes: about the kernel's own 64 KiB).

Each ``htb`` class may save up :data:`HTB_BURST_S` of link time (:func:`htb_burst`; ``burst`` = ``cburst``).
``tc``'s default on a kernel with high-resolution timers is one MTU, so a shaper whose dequeue timer fires
late loses the link time it overslept: on a virtual machine whose idle vCPUs wake 0.1-0.5 ms late (a 64-byte
round trip of 150-450 us on a quiet machine, 35-50 us on a busy one), a 100 Mbit/s stream then carried
0.80-0.96 of the link (median 0.905 of 19; elsewhere 0.76-0.81 five times in a row) where the saved-up 1 ms
carries 0.90-0.95 (median 0.935 of 11). The
price: after an idle link, a message's first :data:`HTB_BURST_S` of link time passes at once, so a message
sent on an idle link can finish up to that much sooner than its bytes / rate (a SimFabric models it with
``Network(burst_us=...)``; ``experiments/bench/netbed_vs_sim.py`` does).

Namespaces and links are created with pyroute2 (netlink); ``tc`` is run as a subprocess inside the
namespace (``ip netns exec P-h<i> tc ...``) because pyroute2's tc interface for htb classes is awkward
and version-dependent, while the ``tc`` command line is stable and its error text is the kernel's.

Names: every namespace gets ``/etc/netns/<ns>/hosts`` (the machine's ``/etc/hosts`` plus ``10.77.<i>.2
h<i>`` and ``10.77.<i>.1 tor-p<i>``), the file ``ip netns exec`` binds over ``/etc/hosts``; a process that
enters a namespace with ``setns`` instead (the launch backend) calls :func:`resolve_as` for the same view.
A reverse look-up of a rack address is then answered from that file: without it glibc asks the machine's
DNS server, which is unreachable from the namespace, and c10d's rendezvous store warns once per connection
("The hostname of the client socket cannot be retrieved").

``netem`` (delay, loss) is not available on these machines: asking for latency or loss raises
:class:`NetbedError` saying so; nothing is silently ignored.

Clean-up: :meth:`Netbed.close` deletes every namespace (which deletes its links and qdiscs) and its
``/etc/netns/<ns>`` folder, and is idempotent; :class:`Netbed` is a context manager, and
:func:`cleanup_stale` removes the namespaces of netbeds whose owner process is gone (``python -m
sparsecomm.netbed cleanup``).
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

from ..errors import InvalidValueError, NetbedError

NS_PREFIX = "scnb"
_NAME_RE = re.compile(rf"^{NS_PREFIX}(\d+)x([0-9a-f]{{4}})-(h\d+|tor)$")
NETNS_DIR = "/var/run/netns"
ETC_NETNS = "/etc/netns"
HOST_IFNAME = "eth0"
MAX_HOSTS = 250


#: the longest a single send burst (one GSO packet) may occupy a shaped link, in seconds
GSO_BURST_S = 0.5e-3
#: the kernel's cap on a GSO packet (and the smallest cap worth setting: two full frames)
GSO_MAX, GSO_MIN = 65536, 2 * 1514


def gso_max_size(bandwidth_gbps: float) -> int:
    """Bytes of the largest GSO packet for a link of ``bandwidth_gbps``: :data:`GSO_BURST_S` of link time,
    clamped to [two frames, 64 KiB] (module docstring: why the burst is capped)."""
    return max(GSO_MIN, min(GSO_MAX, int(bandwidth_gbps * 1e9 / 8 * GSO_BURST_S)))


#: link time an ``htb`` class may save up while its dequeue timer is late, in seconds (module docstring)
HTB_BURST_S = 1e-3


def htb_burst(bandwidth_gbps: float) -> int:
    """Bytes an ``htb`` class of ``bandwidth_gbps`` may save up: :data:`HTB_BURST_S` of link time, at least a
    largest GSO packet and a frame (module docstring: why a shaper needs it)."""
    return max(gso_max_size(bandwidth_gbps) + 1514, int(bandwidth_gbps * 1e9 / 8 * HTB_BURST_S))


def host_address(i: int) -> str:
    return f"10.77.{i}.2"


def tor_address(i: int) -> str:
    return f"10.77.{i}.1"


def check_privileges() -> None:
    """Raise :class:`NetbedError` naming what is missing to build a netbed here."""
    missing = []
    if os.geteuid() != 0:
        try:
            caps = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")), 16)
        except (OSError, StopIteration, ValueError):
            caps = 0
        if not caps & (1 << 12) or not caps & (1 << 21):   # CAP_NET_ADMIN, CAP_SYS_ADMIN (setns, mounts)
            missing.append("root (CAP_NET_ADMIN and CAP_SYS_ADMIN, to create network namespaces and links)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (iproute2)")
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        missing.append("the pyroute2 package (pip install pyroute2)")
    if missing:
        raise NetbedError("the netbed needs " + " and ".join(missing) + "; run as root on Linux, or use "
                          "backend='sim' (modelled network) or 'gloo' (loopback)")


def check_shaping(latency_us: float = 0.0, loss: float = 0.0) -> None:
    """Latency and loss would need the ``netem`` qdisc (or a ``prio`` qdisc with a filter, or nftables to
    drop packets), which these machines' kernel lacks: refuse them, naming the SimFabric, which models both."""
    if latency_us or loss:
        raise NetbedError(
            f"the netbed cannot emulate latency_us={latency_us:g} or loss={loss:g}: this kernel has no tc `netem` "
            f"qdisc (sch_netem), no `prio` qdisc and no nftables to delay or drop packets, so the netbed shapes "
            f"bandwidth only (htb) and adds no latency or loss of its own. The SimFabric models both: "
            f"sc.Network(latency_us=..., loss=...) with backend='sim', or --backend sim --latency-us ... --loss ... "
            f"in the studies (python -m experiments.convergence)")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetbedError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass
class Netbed:
    """A star of ``hosts`` namespaces behind a forwarding top-of-rack namespace, links at ``bandwidth_gbps``.

    ``bandwidth_gbps=None`` leaves the links unshaped (veth speed). Use as a context manager, or call
    :meth:`close` (idempotent). Netbeds whose owner died without closing them are removed by the next
    netbed built on the machine (:func:`cleanup_stale`).

    Args:
        hosts: the number of host namespaces.
        bandwidth_gbps: every link's rate, both directions (``None``: unshaped).
        latency_us: must be 0 (no ``netem``).
        loss: must be 0 (no ``netem``).
        prefix: the namespaces' name prefix (default: unique to this process).
    """

    hosts: int
    bandwidth_gbps: float | None = 1.0
    latency_us: float = 0.0
    loss: float = 0.0
    prefix: str = field(default="")
    _namespaces: list[str] = field(default_factory=list, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise InvalidValueError(f"hosts must be an integer in [1, {MAX_HOSTS}], got {self.hosts!r}")
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise InvalidValueError(f"bandwidth_gbps must be positive (or None: unshaped), got {self.bandwidth_gbps}")
        check_shaping(self.latency_us, self.loss)
        check_privileges()
        cleanup_stale()   # netbeds of owners killed without a chance to clean up (SIGKILL)
        if not self.prefix:
            self.prefix = f"{NS_PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- names
    def host_ns(self, i: int) -> str:
        """The namespace of host ``i``.

        Args:
            i: the host, ``0 .. hosts - 1``.
        """
        if not 0 <= i < self.hosts:
            raise InvalidValueError(f"no host {i} (the netbed has {self.hosts})")
        return f"{self.prefix}-h{i}"

    @property
    def tor_ns(self) -> str:
        """The top-of-rack namespace."""
        return f"{self.prefix}-tor"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace built so far (hosts and top of rack)."""
        return list(self._namespaces)

    def address(self, i: int) -> str:
        """Host ``i``'s address (reachable from every host and from the top of rack)."""
        self.host_ns(i)
        return host_address(i)

    @property
    def tor_addr(self) -> str:
        """An address of the top of rack (its port 0), reachable from every host through its own link."""
        return tor_address(0)

    def ifname(self, ns: str) -> str:
        """The interface gloo should use in namespace ``ns``."""
        return "p0" if ns == self.tor_ns else HOST_IFNAME

    # ----------------------------------------------------------------- set-up
    def hosts_text(self) -> str:
        """The namespaces' ``/etc/hosts``: the machine's own entries, then a name for every rack address."""
        try:
            with open("/etc/hosts") as f:
                machine = f.read()
        except FileNotFoundError:
            machine = "127.0.0.1 localhost\n"
        names = [(host_address(i), f"h{i}") for i in range(self.hosts)]
        names += [(tor_address(i), f"tor-p{i}") for i in range(self.hosts)]
        # and as IPv4-mapped IPv6 addresses: how a dual-stack socket (c10d's) reports an IPv4 peer
        rack = [f"{a} {n}" for a, n in names] + [f"::ffff:{a} {n}" for a, n in names]
        return machine.rstrip("\n") + "\n# the netbed's hosts and top-of-rack ports\n" + "\n".join(rack) + "\n"

    def _build(self) -> None:
        from pyroute2 import NetNS

        hosts = self.hosts_text()
        for ns in [self.tor_ns] + [self.host_ns(i) for i in range(self.hosts)]:
            self._namespaces.append(ns)
            _run(["ip", "netns", "add", ns])
            os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
            with open(hosts_file(ns), "w") as f:
                f.write(hosts)
        _run(["ip", "netns", "exec", self.tor_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        with NetNS(self.tor_ns, flags=0) as tor:
            tor.link("set", index=tor.link_lookup(ifname="lo")[0], state="up")
        for i in range(self.hosts):
            with NetNS(self.host_ns(i), flags=0) as h:
                h.link("set", index=h.link_lookup(ifname="lo")[0], state="up")
                h.link("add", ifname=HOST_IFNAME, kind="veth", peer={"ifname": f"p{i}", "net_ns_fd": self.tor_ns})
                idx = h.link_lookup(ifname=HOST_IFNAME)[0]
                h.addr("add", index=idx, address=host_address(i), prefixlen=24)
                h.link("set", index=idx, state="up")
            with NetNS(self.tor_ns, flags=0) as tor:
                idx = tor.link_lookup(ifname=f"p{i}")[0]
                tor.addr("add", index=idx, address=tor_address(i), prefixlen=24)
                tor.link("set", index=idx, state="up")
            with NetNS(self.host_ns(i), flags=0) as h:
                h.route("add", dst="0.0.0.0/0", gateway=tor_address(i))
            if self.bandwidth_gbps is not None:
                self._shape(self.host_ns(i), HOST_IFNAME)
                self._shape(self.tor_ns, f"p{i}")

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{int(round(self.bandwidth_gbps * 1e9))}bit"
        # quantum: bytes a class may send per round; r2q's default gives > 200000 at Gbit rates (a warning)
        quantum = str(min(200000, max(1514, int(self.bandwidth_gbps * 1e9 / 8 / 1000))))
        gso = gso_max_size(self.bandwidth_gbps)
        if gso < GSO_MAX:
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "dev", dev, "gso_max_size", str(gso)])
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
              "default", "1"])
        burst = str(htb_burst(self.bandwidth_gbps))
        _run(["ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
              "htb", "rate", rate, "ceil", rate, "quantum", quantum, "burst", burst, "cburst", burst])

    # ----------------------------------------------------------------- tear-down
    def close(self) -> None:
        """Delete every namespace of this netbed (links and qdiscs go with them). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            names, self._namespaces = list(self._namespaces), []
        errors = []
        for ns in names:
            try:
                _kill_all_in(ns)
                _delete_ns(ns)
            except Exception as exc:  # noqa: BLE001 - try every namespace, report at the end
                errors.append(f"{ns}: {exc}")
        if errors:
            raise NetbedError("could not remove netbed namespaces: " + "; ".join(errors))

    def __enter__(self) -> "Netbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hosts_file(ns: str) -> str:
    """Namespace ``ns``'s hosts file (what ``ip netns exec`` binds over ``/etc/hosts``)."""
    return os.path.join(ETC_NETNS, ns, "hosts")


_CLONE_NEWNS, _MS_REC, _MS_SLAVE, _MS_BIND = 0x20000, 0x4000, 1 << 19, 0x1000


def resolve_as(ns: str) -> None:
    """Make the calling thread, and the threads it starts afterwards, read ``ns``'s hosts file as
    ``/etc/hosts``, as a process under ``ip netns exec <ns>`` does: a mount namespace of their own
    (``unshare(CLONE_NEWNS)``, mounts made slaves of the machine's) with the file bound over ``/etc/hosts``.
    The process's other threads keep the machine's view. :class:`NetbedError` if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = (("unshare(CLONE_NEWNS)", lambda: libc.unshare(_CLONE_NEWNS)),
             ("mount --make-rslave /", lambda: libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None)),
             (f"mount --bind {hosts_file(ns)} /etc/hosts",
              lambda: libc.mount(hosts_file(ns).encode(), b"/etc/hosts", None, _MS_BIND, None)))
    for what, call in steps:
        if call() != 0:
            err = ctypes.get_errno()
            raise NetbedError(f"cannot give namespace {ns} its hosts file: {what} failed ({os.strerror(err)})")


def _delete_ns(ns: str) -> None:
    from pyroute2 import netns

    try:   # first: a namespace whose folder is left is found again by list_netbed_namespaces
        os.remove(hosts_file(ns))
    except FileNotFoundError:
        pass
    try:
        os.rmdir(os.path.join(ETC_NETNS, ns))
    except FileNotFoundError:
        pass
    if os.path.exists(os.path.join(NETNS_DIR, ns)):
        netns.remove(ns)


def _kill_all_in(ns: str) -> None:
    """SIGKILL what still runs in ``ns``: only this netbed's own processes can be in its namespaces."""
    import signal
    import time

    for _ in range(50):
        pids = [p for p in pids_in(ns) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def list_netbed_namespaces() -> list[str]:
    """Every namespace on this machine that a netbed created (any owner), including one of which only the
    ``/etc/netns`` folder is left."""
    names: set[str] = set()
    for where in (NETNS_DIR, ETC_NETNS):
        try:
            names.update(os.listdir(where))
        except FileNotFoundError:
            pass
    return sorted(n for n in names if _NAME_RE.match(n))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove the namespaces of netbeds whose owner process no longer exists; returns their names."""
    removed = []
    for ns in list_netbed_namespaces():
        pid = int(_NAME_RE.match(ns).group(1))
        if not _alive(pid):
            _kill_all_in(ns)
            _delete_ns(ns)
            removed.append(ns)
    return removed


def pids_in(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (what `ip netns pids` reports)."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []
