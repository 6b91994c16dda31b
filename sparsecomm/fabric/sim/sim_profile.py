"""Host profiles: a machine's measured :class:`~.sim_host.HostModel` as a JSON file.

Written by ``python -m sparsecomm.netbed calibrate --out host.json`` (:mod:`sparsecomm.netbed.calibrate`), loaded by
:meth:`sparsecomm.Network.from_profile`. The format (:data:`FORMAT`, version :data:`VERSION`)::

    {
      "format": "sparsecomm-host-profile",
      "version": 2,
      "date": "2026-11-29T13:50:00+00:00",                 # when it was measured (UTC, ISO 8601)
      "machine": {"platform": ..., "machine": ..., "processor": ..., "cpu_count": 2,
                  "python": ..., "torch": ..., "torch_threads": 1},
      "method": {"quick": false, "repeats": 15, ...},        # how it was measured (free-form)
      "host": {                                              # every rate of HostModel, with its unit
        "send_message_s": {"value": 1.1e-05, "unit": "s/message"},
        ...
        "sum_element_s": {"value": {"float32": 2.5e-10, ...}, "unit": "s/element"},
        "call_s": {"value": {"ring": 0.004, "omnireduce": 0.012, ...}, "unit": "s/call"}
      },
      "netbed": {"latency_s": {"value": 0.00021, "unit": "s"}, "gbps": 1.0, "hosts": 2},  # optional
      "by_share": {"2": {"native_byte_s": {"value": 3.1e-10, "unit": "s/byte"}, ...}}       # optional
    }

``host`` holds exactly the rates of :data:`~.sim_host.RATE_UNITS` (a missing or unknown one, a unit other
than its own, or a negative or non-finite value is refused, naming the key), but for those of
:data:`~.sim_host.OPTIONAL_RATES` (``span_block_s``, ``index_block_s``, the rates of a method's encode and
decode, :data:`~.sim_host.CODEC_RATES`, a fresh buffer's ``fresh_byte_s`` and ``fresh_min_bytes``, a block
copy's ``move_byte_s``, a finiteness guard's ``check_element_s`` and a zero block's ``scan_zero_element_s``: added
within version 2; a profile without them models them as 0, the times it modelled before they existed, so it
loads as it did; a fresh buffer advised as huge pages, ``fresh_advised_byte_s`` (:data:`~.sim_host.DERIVED_RATES`),
which a profile without it models as half of ``copy_byte_s``, the zeroing of its huge pages; and the sparse
switch's own rates, ``sparse_switch_packet_s``, ``sparse_switch_value_s``,
``sparse_switch_result_s`` and ``sparse_switch_message_s``, which a profile without them models as before they
existed, with the dense switch's rates per packet and per message and nothing per value packet or result, and
PowerSGD's estimate's ``matmul_outer_mac_s``, which a profile without it models with ``matmul_mac_s``, and the
sampled top-k's candidate pass's ``collect_element_s``, which a profile without it models as an elementwise pass:
:data:`~.sim_host.FALLBACK_RATES`; and the message costs by size, ``message_cpu_s`` and ``message_wait_s``
(:data:`~.sim_host.MESSAGE_TABLES`, both or neither, ``{"value": {"64": 6.1e-05, "4096": ..., ...}, "unit":
"s/message"}``, the sizes in bytes as decimal strings), which a profile without them models with the four linear
message rates, as before they existed); ``sum_element_s`` gives each of :data:`~.sim_host.SUM_DTYPES`, ``call_s`` a
rate per transport name (any names), and so does ``call_peer_s`` (optional, added within version 2: a call's cost
per other worker of it, ``{"value": {"omnireduce": 0.004, ...}, "unit": "s/peer"}``; a profile without it charges
``call_s`` alone, at any size of world, as before it existed); ``fresh_min_bytes`` (:data:`~.sim_host.SIZES`) is a
size, an integer of bytes (unit ``"byte"``), not a rate; the slowdown of a method's kernels with every core busy,
``codec_contention`` (optional, added within version 2: ``{"value": {"matmul": 1.2, "matmul_t": 1.8, ...}, "unit":
"factor"}``, operations of :data:`~.sim_host.CODEC_RATES` to factors of at least 1; a profile without it models
each rate alone, as before it existed); the wait of a call for its last worker on shared cores, ``sync_s``
(optional, added within version 2: ``{"value": 0.002, "unit": "s/call"}``; a profile without it waits nothing,
as before it existed), and the work per call of the loop it was measured on, ``sync_work_s`` (optional, unit
``"s"``: a call after less work since the previous one waits that fraction of it; a profile without it waits all of
it at every call, as before it existed; ``calibrate --calls-into`` adds it from the profile's ``method.sync_fit``); the cost of a message of the fabric's native collective (gloo's own ring all-reduce, C++:
``native_message_s``, unit ``s/message``, and ``native_byte_s``, unit ``s/byte``; optional, added within version 2,
:data:`~.sim_host.NATIVE_RATES`, both or neither: a profile without them charges those messages the model's own
message costs, the library's, as before they existed, on gloo's segments). ``date``, ``machine`` and
``method`` are recorded, not interpreted.

``netbed`` (optional, added within version 2; :func:`netbed_latency_s` reads it): this machine's netbed as
the model wants it beside the host rates, the one-way latency of a message between two of its hosts beyond the
hosts' own per-message costs (``latency_s``, seconds: the kernel's path through the namespaces' links, the top of
rack's forwarding and ``htb``, and the ranks' wake-ups across them), measured at ``gbps`` between ``hosts``
hosts; a model of the netbed takes it as its wire's latency (``Network(latency_us=...)``). It is not part of
the :class:`~.sim_host.HostModel` (:meth:`sparsecomm.Network.from_profile` does not read it): a network other
than this machine's netbed has a latency of its own.

``by_share`` (optional, added within version 2): rates fitted where the processes outnumbered the cores
(:attr:`~.sim_host.HostModel.by_share`, module docstring of :mod:`.sim_host`), per share of the cores, a decimal
string above 1 (``"2"``: two processes per core, 4 on 2 cores), each entry a subset of
:data:`~.sim_host.SHARED_RATES` written as ``host``'s rates are (``message_cpu_s`` and ``message_wait_s`` both or
neither, ``native_message_s`` and ``native_byte_s`` both or neither; ``call_s`` per transport). A profile without it
(every profile before it existed) models every share with its ``host`` rates stretched by the share, as before.

Versions: 2 added ``switch_message_s`` and ``call_s`` and measures ``switch_packet_s`` without the per-message
part. A version 1 profile is refused, saying to calibrate again: its ``switch_packet_s`` includes a
message's cost, and it has no per-call costs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ...errors import InvalidTypeError, InvalidValueError
from .sim_host import MESSAGE_TABLES, OPTIONAL_RATES, RATE_UNITS, SHARED_RATES, SIZES, SUM_DTYPES, HostModel

__all__ = ["FORMAT", "VERSION", "host_from_profile", "load_profile", "netbed_latency_s", "network_from_profile",
           "profile_dict"]

#: the ``format`` field of a host profile
FORMAT = "sparsecomm-host-profile"
#: the version this library writes and reads
VERSION = 2
#: the rates whose value is a mapping (dtype -> rate, transport -> rate, message size -> seconds)
MAPPED = ("sum_element_s", "call_s", "codec_contention", "call_peer_s", *MESSAGE_TABLES)
#: the top-level keys of a profile (the first three required)
KEYS = ("format", "version", "host", "date", "machine", "method", "netbed", "by_share")
#: the keys of a profile's ``netbed``
NETBED_KEYS = ("latency_s", "gbps", "hosts")


def profile_dict(host: HostModel, *, date: str, machine: dict, method: dict, netbed: dict | None = None) -> dict:
    """The profile of ``host`` (its rates, and its rates by share of the cores as ``by_share`` where it has any;
    its CPU shares are a run's setting and are not written; a rate of :data:`~.sim_host.FALLBACK_RATES` that is
    ``None`` is left out, as a profile without it); ``netbed``: ``{"latency_s": seconds, "gbps": ..., "hosts":
    ...}``, the netbed's latency (module docstring), or ``None`` for none."""
    rates = {}
    for name, unit in RATE_UNITS.items():
        value = getattr(host, name)
        if value is None or (name in (*MESSAGE_TABLES, "codec_contention", "call_peer_s") and not value):   # (its fallback: absent)
            continue
        rates[name] = _written(name, value)
    out = {"format": FORMAT, "version": VERSION, "date": date, "machine": dict(machine), "method": dict(method),
           "host": rates}
    if host.by_share:
        out["by_share"] = {f"{share:g}": {name: _written(name, value) for name, value in entry.items()}
                           for share, entry in host.by_share.items()}
    if netbed is not None:
        out["netbed"] = {"latency_s": {"value": float(netbed["latency_s"]), "unit": "s"},
                         "gbps": float(netbed["gbps"]), "hosts": int(netbed["hosts"])}
        _netbed(out, "profile_dict")
    return out


def _written(name: str, value) -> dict:
    """The profile's entry of rate ``name`` of value ``value``: ``{"value": ..., "unit": ...}``."""
    if name in MESSAGE_TABLES:      # (JSON's keys are strings: the sizes in decimal)
        value = {str(n): v for n, v in value.items()}
    return {"value": dict(value) if name in MAPPED else value, "unit": RATE_UNITS[name]}


def _netbed(profile: dict, source: str) -> float | None:
    """The checked ``netbed`` latency of ``profile`` (seconds), ``None`` without one."""
    if "netbed" not in profile:
        return None
    nb = profile["netbed"]
    where = f"{source}: netbed"
    if not isinstance(nb, dict) or set(nb) != set(NETBED_KEYS):
        raise InvalidValueError(f"{where} must be {{'latency_s': {{'value': ..., 'unit': 's'}}, 'gbps': ..., "
                                f"'hosts': ...}}, got {nb!r}")
    entry = nb["latency_s"]
    if not isinstance(entry, dict) or set(entry) != {"value", "unit"} or entry["unit"] != "s":
        raise InvalidValueError(f"{where}.latency_s must be {{'value': ..., 'unit': 's'}}, got {entry!r}")
    _rate(f"{where}.gbps", nb["gbps"])
    if nb["gbps"] <= 0:
        raise InvalidValueError(f"{where}.gbps must be > 0, got {nb['gbps']!r}")
    if _size(f"{where}.hosts", nb["hosts"]) < 2:
        raise InvalidValueError(f"{where}.hosts must be at least 2, got {nb['hosts']!r}")
    return _rate(f"{where}.latency_s.value", entry["value"])


def netbed_latency_s(path: str | Path) -> float | None:
    """The netbed's per-message latency (seconds, module docstring) of the profile at ``path`` (checked as
    :func:`host_from_profile` checks the rest), ``None`` when it has none (calibrated without a netbed, or
    before profiles recorded it)."""
    profile = load_profile(path)
    host_from_profile(profile, f"host profile {str(path)!r}")
    return _netbed(profile, f"host profile {str(path)!r}")


def _rate(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{where} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise InvalidValueError(f"{where} must be a finite rate >= 0, got {value!r}")
    return float(value)


def _size(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{where} must be an integer (bytes), got {type(value).__name__}")
    if value < 0:
        raise InvalidValueError(f"{where} must be a size >= 0, got {value!r}")
    return value


def host_from_profile(profile: dict, source: str = "host profile") -> HostModel:
    """The :class:`~.sim_host.HostModel` of a parsed profile, checked (module docstring); ``source`` names it
    in errors."""
    if not isinstance(profile, dict):
        raise InvalidTypeError(f"{source}: a profile is a JSON object, got {type(profile).__name__}")
    unknown = sorted(set(profile) - set(KEYS))
    if unknown:
        raise InvalidValueError(f"{source}: unknown key(s) {unknown}; a profile has {', '.join(KEYS)}")
    for key in KEYS[:3]:
        if key not in profile:
            raise InvalidValueError(f"{source}: no {key!r} (written by python -m sparsecomm.netbed calibrate?)")
    if profile["format"] != FORMAT:
        raise InvalidValueError(f"{source}: format is {profile['format']!r}, expected {FORMAT!r}")
    if profile["version"] == 1:
        raise InvalidValueError(f"{source}: version 1 is not supported any more: its switch_packet_s includes "
                                f"a message's cost and it has no switch_message_s or call_s (this library reads "
                                f"version {VERSION}); calibrate again: python -m sparsecomm.netbed calibrate")
    if profile["version"] != VERSION:
        raise InvalidValueError(f"{source}: version {profile['version']!r} is not supported (this library reads "
                                f"version {VERSION}; calibrate again)")
    _netbed(profile, source)
    host = profile["host"]
    if not isinstance(host, dict):
        raise InvalidTypeError(f"{source}: 'host' is a JSON object of rates, got {type(host).__name__}")
    unknown = sorted(set(host) - set(RATE_UNITS))
    if unknown:
        raise InvalidValueError(f"{source}: unknown rate(s) {unknown} in 'host'; the rates are "
                                f"{', '.join(RATE_UNITS)}")
    missing = [k for k in RATE_UNITS if k not in host and k not in OPTIONAL_RATES]
    if missing:
        raise InvalidValueError(f"{source}: 'host' lacks the rate(s) {missing}")
    kw = {name: _parsed(name, host[name], f"{source}: host.{name}") for name in RATE_UNITS if name in host}
    kw["by_share"] = _shares(profile.get("by_share", {}), source)
    try:
        return HostModel(**kw)
    except (InvalidValueError, InvalidTypeError) as exc:
        raise type(exc)(f"{source}: {exc}") from None


def _shares(table, source: str) -> dict:
    """The checked ``by_share`` of a profile (module docstring): share -> rate name -> value."""
    if not isinstance(table, dict):
        raise InvalidTypeError(f"{source}: 'by_share' is a JSON object of shares, got {type(table).__name__}")
    out = {}
    for key, rates in table.items():
        try:
            share = float(key)
        except ValueError:
            share = math.nan
        if not (math.isfinite(share) and share > 1):
            raise InvalidValueError(f"{source}: by_share has key {key!r}; its keys are shares of the cores above 1 "
                                    f"(processes per core, e.g. '2')")
        if not isinstance(rates, dict):
            raise InvalidTypeError(f"{source}: by_share[{key!r}] is a JSON object of rates, got "
                                   f"{type(rates).__name__}")
        unknown = sorted(set(rates) - set(SHARED_RATES))
        if unknown:
            raise InvalidValueError(f"{source}: unknown rate(s) {unknown} in by_share[{key!r}]; the rates a share may "
                                    f"give are {', '.join(SHARED_RATES)}")
        out[share] = {name: _parsed(name, entry, f"{source}: by_share[{key!r}].{name}") for name, entry in rates.items()}
    return out


def _parsed(name: str, entry, where: str):
    """The checked value of the profile's entry ``entry`` of rate ``name`` (``where`` names it in errors)."""
    unit = RATE_UNITS[name]
    if not isinstance(entry, dict) or set(entry) != {"value", "unit"}:
        raise InvalidValueError(f"{where} must be {{'value': ..., 'unit': {unit!r}}}, got {entry!r}")
    if entry["unit"] != unit:
        raise InvalidValueError(f"{where} has unit {entry['unit']!r}, expected {unit!r}")
    value = entry["value"]
    if name == "sum_element_s":
        if not isinstance(value, dict):
            raise InvalidTypeError(f"{where}.value maps dtype names to rates, got {type(value).__name__}")
        missing = [d for d in SUM_DTYPES if d not in value]
        if missing:
            raise InvalidValueError(f"{where}.value lacks the dtype(s) {missing}")
        return {d: _rate(f"{where}.value[{d!r}]", v) for d, v in value.items()}
    if name in ("call_s", "call_peer_s"):
        if not isinstance(value, dict):
            raise InvalidTypeError(f"{where}.value maps transport names to rates, got {type(value).__name__}")
        return {t: _rate(f"{where}.value[{t!r}]", v) for t, v in value.items()}
    if name == "codec_contention":
        if not isinstance(value, dict):
            raise InvalidTypeError(f"{where}.value maps operations to factors, got {type(value).__name__}")
        return {op: _rate(f"{where}.value[{op!r}]", v) for op, v in value.items()}
    if name in MESSAGE_TABLES:
        if not isinstance(value, dict) or not value:
            raise InvalidTypeError(f"{where}.value maps message sizes (bytes, decimal strings) to seconds, got "
                                   f"{value!r}")
        table = {}
        for n, v in value.items():
            if not (isinstance(n, str) and n.isdigit() and int(n) > 0):
                raise InvalidValueError(f"{where}.value has key {n!r}; its keys are message sizes in bytes")
            table[int(n)] = _rate(f"{where}.value[{n!r}]", v)
        return table
    if name in SIZES:
        return _size(f"{where}.value", value)
    return _rate(f"{where}.value", value)


def load_profile(path: str | Path) -> dict:
    """The parsed JSON of the profile at ``path`` (unchecked: :func:`host_from_profile` checks)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidValueError(f"host profile {str(path)!r} cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidValueError(f"host profile {str(path)!r} is not JSON: {exc}") from None


def network_from_profile(cls, path: str | Path, overrides: dict):
    """:meth:`sparsecomm.Network.from_profile`: ``cls(host=the profile's HostModel)``, with ``overrides``
    split between the Network's fields and the HostModel's (an unknown one raises, naming both sets)."""
    host = host_from_profile(load_profile(path), f"host profile {str(path)!r}")
    net_fields = {f.name for f in dataclasses.fields(cls)} - {"host"}
    host_fields = {f.name for f in dataclasses.fields(HostModel)}
    unknown = sorted(set(overrides) - net_fields - host_fields)
    if unknown:
        raise InvalidValueError(f"Network.from_profile: unknown override(s) {unknown}; the Network's are "
                                f"{', '.join(sorted(net_fields))}; the HostModel's "
                                f"{', '.join(sorted(host_fields))}")
    host = dataclasses.replace(host, **{k: v for k, v in overrides.items() if k in host_fields})
    return cls(host=host, **{k: v for k, v in overrides.items() if k in net_fields})
