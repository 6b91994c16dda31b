"""Agreement handshake: check, before any data moves, that every worker passes the same description of
its input (length, dtype, payload kind, block size, ...), so that a mismatch is a clear
:class:`~sparsecomm.errors.MismatchError` on *every* worker instead of a hang, a wrong sum or (gloo) an
aborted process.

Usage, at the top of a transport's allreduce::

    from ._handshake import check_agreement, dtype_code
    check_agreement(fabric, "ring allreduce", numel=x.numel(), dtype=dtype_code(x.dtype))

``check_agreement`` is a *dissemination* min/max all-reduce of the field vector (Bruck et al.): in round
``k`` worker ``r`` sends its running (min, argmin, max, argmax) per field to ``r + 2^k`` and combines what
it receives from ``r - 2^k`` (min and max are idempotent, so overlaps for non-powers of two are harmless).
After ``ceil(log2 n)`` rounds every worker knows the global min and max of each field and raises if they
differ; the error names two disagreeing workers and their values. Cost per worker: ``ceil(log2 n)``
messages of :data:`HEADER_BYTES` bytes sent and received, ``ceil(log2 n)`` latency steps (see
:func:`theory.costs.handshake`); they go through the fabric, so they are counted in ``CommStats``.

**Fixed-size header.** Every message has the same size whatever the transport and its fields
(``int64[4, HEADER_WORDS]``: rows min, argmin, max, argmax of a word vector ``[magic, transport code,
layout code, field count, fields ..., checksum]``), so workers that disagree on the transport, the payload
kind or the options never post receives of different sizes (gloo aborts the process on a message longer
than its receive): they exchange headers and all raise :class:`MismatchError` naming both sides. A header
that fails its checksum or names impossible ranks is :class:`MalformedMessage` (reported to the other
ranks through the fabric's ``fail`` capability, since only this worker may have seen it). ``info`` fields
travel in the same header but are not compared: each worker learns their maximum and who holds it
(non-finite flags, integer bounds) at no extra cost.

Fields are Python ints or 0-d integer tensors (e.g. a :func:`fingerprint`, computed on the fabric's
device without a host round trip). A field whose name ends in ``dtype`` is printed as a dtype name in
error messages (encode it with :func:`dtype_code`).

Transports that exchange per-worker headers anyway (allgather) can check agreement locally on the
gathered headers and raise with :func:`mismatch_error`, with no extra messages.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from ..errors import MalformedMessage, MismatchError

#: tag of the handshake messages (kept apart from the transports' data tags)
HANDSHAKE_TAG = 0x5C00

#: first word of every agreement header ("SCHS", header version 2)
MAGIC = 0x53434853_0002
#: fields per header (transports use fewer; the rest are zero)
MAX_FIELDS = 16
_PRE = 4          # magic, transport code, layout code (field names), number of fields
#: int64 words per row: the preamble, the fields, and a checksum
HEADER_WORDS = _PRE + MAX_FIELDS + 1
#: bytes of every handshake message: rows (min, argmin, max, argmax) of HEADER_WORDS int64 words
HEADER_BYTES = 4 * 8 * HEADER_WORDS


def dtype_code(dtype: torch.dtype) -> int:
    """A stable non-negative integer naming ``dtype`` (the same on every process and machine)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _all_dtypes() -> dict[int, torch.dtype]:
    out = {}
    for name in dir(torch):
        v = getattr(torch, name, None)
        if isinstance(v, torch.dtype):
            out[dtype_code(v)] = v
    return out


_DTYPES: dict[int, torch.dtype] = _all_dtypes()


def dtype_from_code(code: int) -> torch.dtype:
    """The dtype that :func:`dtype_code` encoded as ``code``."""
    try:
        return _DTYPES[int(code)]
    except KeyError:
        raise MismatchError(f"unknown dtype code {code} (a worker runs another torch build?)") from None


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor | None) -> torch.Tensor:
    """A 0-d int64 checksum of ``t``'s length and exact bits (position-weighted), on ``t``'s device.

    Cheap (one pass) and meant to catch accidental disagreement (different seeds, different scales),
    not adversaries. ``None`` fingerprints as 0.
    """
    if t is None:
        return torch.zeros((), dtype=torch.int64)
    v = t.detach().reshape(-1)
    if v.dtype == torch.bool:
        v = v.to(torch.uint8)
    elif v.is_floating_point() or v.is_complex():
        v = v.contiguous().view(_INT_VIEW[v.element_size()] if not v.is_complex() else torch.int64)
    v = v.to(torch.int64)
    w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    # int64 arithmetic wraps around; that is fine for a checksum
    return (v * 0x9E3779B1 + w).mul(w).sum() + v.numel()


#: payload kind codes, as the transports encode them (``sparsecomm.payload.KINDS`` order)
_KINDS = ("dense", "aligned", "sparse", "quantized")


def _fmt(name: str, value: int) -> str:
    if name.endswith("kind") and 0 <= int(value) < len(_KINDS):
        return repr(_KINDS[int(value)])
    if name.endswith("dtype"):
        d = _DTYPES.get(int(value))
        return str(d).replace("torch.", "") if d is not None else f"<dtype code {value}>"
    return str(value)


def mismatch_error(what: str, name: str, values: Sequence[int], rank: int) -> MismatchError:
    """The error for workers disagreeing on ``name``; ``values[j]`` is worker ``j``'s value."""
    vals = list(values)
    lo = min(range(len(vals)), key=lambda j: (vals[j], j))
    hi = max(range(len(vals)), key=lambda j: (vals[j], -j))
    return _error(what, name, vals[lo], lo, vals[hi], hi, vals[rank], rank)


def _error(what: str, name: str, vmin: int, rmin: int, vmax: int, rmax: int, mine: int,
           rank: int) -> MismatchError:
    name = name.replace("_", " ")
    return MismatchError(
        f"{what}: workers disagree on the {name}: worker {rmin} has {_fmt(name, vmin)}, worker {rmax} "
        f"has {_fmt(name, vmax)} (this is worker {rank}, with {_fmt(name, mine)}); every worker must "
        f"pass the same {name}")


def transport_code(name: str) -> int:
    """A stable non-negative integer naming the transport ``name`` (the agreement header's word 1)."""
    return zlib.crc32(("transport:" + name).encode()) & 0x7FFFFFFF


def _transport_name(code: int) -> str:
    try:
        from . import registry

        names = list(registry.available())
    except Exception:  # noqa: BLE001 - only for the message
        names = []
    for nm in names + ["allgather", "ring", "native", "omnireduce", "switch"]:
        if transport_code(nm) == code:
            return repr(nm)
    return f"<transport code {code}>"


def _layout_code(names: Sequence[str], info: Sequence[str]) -> int:
    return zlib.crc32(("|".join(names) + "#" + "|".join(info)).encode()) & 0x7FFFFFFF


def _checksum(state: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 checksum of a header state's words (all but the last column)."""
    v = state[:, :-1].reshape(-1)
    w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    return ((v ^ (w * 0x5851F42D4C957F2D)) * 0x9E3779B1 + w).sum()


def _fail(fabric, exc: BaseException) -> BaseException:
    """Tell the other ranks about an error only this rank may have seen (a malformed message), so that
    their waits end at once instead of at the timeout (a fabric capability: ``fail``)."""
    fail = getattr(fabric, "fail", None)
    if fail is not None:
        try:
            fail(exc)
        except Exception:  # noqa: BLE001 - reporting must not mask the error
            pass
    return exc


def header_state(rank: int, transport: str, names: Sequence[str], info: Sequence[str],
                 values: Sequence[int | torch.Tensor], device) -> torch.Tensor:
    """This worker's agreement header as a one-worker (min, argmin, max, argmax) state:
    ``int64[4, HEADER_WORDS]``, the same size for every transport and every call."""
    if len(values) > MAX_FIELDS:
        raise ValueError(f"the agreement header holds at most {MAX_FIELDS} fields, got {len(values)}")
    pre = [MAGIC, transport_code(transport), _layout_code(names, info), len(values)]
    words = [torch.as_tensor(v, dtype=torch.int64).reshape(()).to(device) for v in pre]
    words += [torch.as_tensor(v, dtype=torch.int64).reshape(()).to(device) for v in values]
    words += [torch.zeros((), dtype=torch.int64, device=device)] * (HEADER_WORDS - len(words))
    vals = torch.stack(words)
    ranks = torch.full_like(vals, rank)
    state = torch.stack([vals, ranks, vals, ranks])
    state[:, -1] = 0
    state[0, -1] = _checksum(state)
    return state


def validate_state(buf: torch.Tensor, src: int, what: str, rank: int, n: int) -> None:
    """Raise :class:`MalformedMessage` unless ``buf`` is a well-formed agreement header state."""
    if int(buf[0, -1]) != int(_checksum(buf)):
        raise MalformedMessage(f"{what}: the agreement header from worker {src} fails its checksum "
                               f"(corrupted on the wire, or not a sparsecomm header); this is worker {rank}")
    ranks = buf[[1, 3], :-1]
    if int(buf[0, 0]) != MAGIC or int(buf[2, 0]) != MAGIC:
        raise MalformedMessage(f"{what}: worker {src} sent an agreement header of another protocol version "
                               f"(magic {int(buf[0, 0]):#x}, expected {MAGIC:#x}); this is worker {rank}")
    if bool(((ranks < 0) | (ranks >= n)).any()):
        raise MalformedMessage(f"{what}: the agreement header from worker {src} names ranks outside "
                               f"0..{n - 1}; this is worker {rank}")


def check_agreement(fabric, what: str, *, tag: int = HANDSHAKE_TAG, transport: str | None = None,
                    info: dict | None = None, **fields: int | torch.Tensor) -> dict[str, tuple[int, int]]:
    """Raise :class:`MismatchError` on every worker unless all workers pass equal ``fields``.

    ``what`` names the operation in the message (e.g. ``"ring allreduce"``); ``transport`` (default: its
    first word) is part of the header, so workers running different transports get a MismatchError
    naming both. ``info`` fields are not compared: the result maps each to ``(max over workers, the
    lowest worker holding it)`` (flags, bounds). Must be called by every worker (not by services) in
    the same order relative to other traffic on ``tag``. Every message is one fixed-size header state
    (:data:`HEADER_BYTES`), whatever the transport and the fields, so a worker never receives a
    message of another size than it posted; a malformed one raises :class:`MalformedMessage`.
    """
    n, rank = fabric.world_size, fabric.rank
    info = dict(info or {})
    if n <= 1:
        return {k: (int(torch.as_tensor(v)), rank) for k, v in info.items()}
    if rank >= n:
        raise RuntimeError("check_agreement is for workers only")
    transport = transport or what.split()[0]
    names, inames = list(fields), list(info)
    state = header_state(rank, transport, names, inames, list(fields.values()) + list(info.values()),
                         fabric.device)
    mine = state[0].tolist()
    buf = torch.empty_like(state)
    k = 1
    while k < n:
        src = (rank - k) % n
        work = fabric.isend(state, (rank + k) % n, tag)
        fabric.recv(buf, src, tag)
        work.wait()
        try:
            validate_state(buf, src, what, rank, n)
        except MalformedMessage as exc:
            raise _fail(fabric, exc) from None
        state = _combine(state, buf)
        state[0, -1] = _checksum(state)
        k *= 2
    fabric.stats.rounds += (n - 1).bit_length()
    vmin, rmin, vmax, rmax = state.tolist()
    if vmin[1] != vmax[1]:
        # transports that disagree may not even agree on who sends what to whom: some worker may be left
        # waiting for a message that never comes, so the other ranks are told (fail-stop)
        raise _fail(fabric, MismatchError(
            f"{what}: workers disagree on the transport: worker {rmin[1]} runs {_transport_name(vmin[1])}, "
            f"worker {rmax[1]} runs {_transport_name(vmax[1])} (this is worker {rank}, running {transport!r}); "
            f"every worker must call the same transport in the same order")) from None
    off = _PRE
    for i, name in enumerate(names):
        j = off + i
        if vmin[j] != vmax[j]:
            raise _error(what, name, vmin[j], rmin[j], vmax[j], rmax[j], mine[j], rank)
    if vmin[2] != vmax[2] or vmin[3] != vmax[3]:
        raise MismatchError(
            f"{what}: workers {rmin[2]} and {rmax[2]} describe their calls with different fields (another "
            f"payload kind, dtype class or transport option; this is worker {rank}); every worker must "
            f"pass the same kind of input with the same options")
    return {nm: (vmax[off + len(names) + i], rmax[off + len(names) + i]) for i, nm in enumerate(inames)}


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Merge two (min, argmin, max, argmax) states; ties go to the lower rank."""
    lo = (b[0] < a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
    hi = (b[2] > a[2]) | ((b[2] == a[2]) & (b[3] < a[3]))
    return torch.stack([torch.where(lo, b[0], a[0]), torch.where(lo, b[1], a[1]),
                        torch.where(hi, b[2], a[2]), torch.where(hi, b[3], a[3])])


def handshake_bytes(nfields: int | None = None) -> int:
    """Bytes of one handshake message: the fixed-size header state, whatever the number of fields."""
    return HEADER_BYTES
