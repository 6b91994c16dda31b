"""Agreement handshake: check, before any data moves, that every worker passes the same description of
its input (length, dtype, payload kind, block size, ...), so that a mismatch is a clear
:class:`~sparsecomm.errors.MismatchError` on *every* worker instead of a hang, a wrong sum or (gloo) an
aborted process.

Usage, at the top of a transport's allreduce::

    from ._handshake import check_agreement, dtype_code
    check_agreement(fabric, "ring allreduce", numel=x.numel(), dtype=dtype_code(x.dtype))

``check_agreement`` is a *dissemination* all-reduce of the header (Bruck et al.): in round ``k`` worker
``r`` sends its running state to ``r + 2^k`` and merges what it receives from ``r - 2^k``; the state is the
fields of the lowest rank merged so far, the first disagreement seen (which word, two ranks and their
values) and, per ``info`` field, the maximum and its rank (every merge is idempotent, so overlaps for
non-powers of two are harmless). After ``ceil(log2 n)`` rounds every worker knows whether all agree and
raises if not; the error names two disagreeing workers and their values. Cost per worker: ``ceil(log2 n)``
messages of :data:`HEADER_BYTES` bytes sent and received, ``ceil(log2 n)`` latency steps (see
:func:`theory.costs.handshake`); they go through the fabric, so they are counted in ``CommStats``.
The rounds are a role (:func:`agreement_role`, :mod:`sparsecomm.fabric.roles`): :func:`check_agreement` has
the fabric run it alone (``Fabric.drive``), and a transport written as roles may run it first in its own
drive (``got = yield from agreement_role(...)``) with the same messages.

**Fixed-size header.** Every message has the same size whatever the transport and its fields
(``int64[HEADER_WORDS]``: ``[magic, transport code, layout code, field count, fields ..., reference
rank, disagreement record, info ranks, call identity, checksum]``), so workers that disagree on the transport, the payload
kind or the options never post receives of different sizes (gloo aborts the process on a message longer
than its receive): they exchange headers and all raise :class:`MismatchError` naming both sides. A header
that fails its checksum or names impossible ranks is :class:`MalformedMessage` (reported to the other
ranks through the fabric's ``fail`` capability, since only this worker may have seen it). ``info`` fields
travel in the same header but are not compared: each worker learns their maximum and who holds it
(non-finite flags, integer bounds) at no extra cost.

**The call's identity.** Every header carries the identity of the collective call it belongs to
(:class:`CallId`: the bucket, the step, the round of a method of several rounds), compared like a
field: two workers whose calls are paired by the fabric but are different calls (a worker a step ahead,
a bucket skipped, calls posted in another order) get a :class:`MismatchError` naming the part that
differs, never a sum of different tensors. The identity is the one of the call running on this thread
(:func:`calling`, which :meth:`Transport.run <sparsecomm.transports.base.Transport.run>` enters
for the call it is given); a call made without one (a plain ``allreduce``) carries ``-1`` words, so it
matches only calls made without one.

Fields are Python ints or 0-d integer tensors (e.g. a :func:`fingerprint`, computed on the fabric's
device without a host round trip). A field whose name ends in ``dtype`` is printed as a dtype name in
error messages (encode it with :func:`dtype_code`).

Transports that exchange per-worker headers anyway (allgather) send this header unmerged
(:func:`header_state`), read each peer's with :func:`read_header` and check agreement locally on the
gathered headers (:func:`same_call`, :func:`mismatch_error`), with no extra messages.

``native``, ``ring`` and ``omnireduce`` skip the handshake on repeated calls (real processes): every worker
predicts the call from the same record of completed calls and the data all-reduce checks the prediction (a
worker making another call joins it with NaN and runs this handshake; :mod:`._fold`). Every other
transport's call is told of a prediction by ``Transport.run`` before its first message, so this function
needs no change.
"""

from __future__ import annotations

import contextvars
import functools
import zlib
from dataclasses import dataclass, replace
from typing import Hashable, Sequence

import torch

from ..errors import InvalidValueError, MalformedMessage, MismatchError
from ..fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step
from ..payload import KINDS

#: tag of the handshake messages (kept apart from the transports' data tags)
HANDSHAKE_TAG = 0x5C00

#: first word of every agreement header ("SCHS", header version 4: the call identity words)
MAGIC = 0x53434853_0004
#: fields per header (transports use fewer; the rest are zero); at most MAX_INFO of them ``info`` fields
MAX_FIELDS = 16
MAX_INFO = 4
_PRE = 4          # magic, transport code, layout code (field names), number of fields
_REF = _PRE + MAX_FIELDS          # the rank whose header the fields are (the lowest merged so far)
_DIS = _REF + 1                   # a disagreement seen: word index (-1: none), rank a, value a, rank b, value b
_ARG = _DIS + 5                   # the rank holding each info field's maximum
_CALL = _ARG + MAX_INFO           # the call identity: bucket code, step, round (compared as fields)
#: int64 words of every handshake message: preamble, fields, reference rank, disagreement, info ranks,
#: the call identity and a checksum
HEADER_WORDS = _CALL + 4
_CALL_NAMES = ("bucket", "step", "round")


@dataclass(frozen=True)
class CallId:
    """The identity of one collective call, which every worker must agree on: ``bucket`` (any
    hashable key with a stable ``repr``: a bucket index, a digest of its parameters' names), ``step``
    (the synchronisation the call belongs to) and ``round`` (0, then 1, 2, ... for the later rounds of
    a method of several rounds, such as PowerSGD's P and Q)."""

    bucket: Hashable
    step: int
    round: int = 0

    @functools.cached_property
    def words(self) -> tuple[int, int, int]:
        """The header words: a 31-bit code of the bucket's ``repr``, the step and the round (computed once
        per identity: a call's agreement, fold key and headers all read them)."""
        return (zlib.crc32(repr(self.bucket).encode()) & 0x7FFFFFFF, int(self.step), int(self.round))

    def next_round(self) -> "CallId":
        return replace(self, round=self.round + 1)

    def __str__(self) -> str:
        return f"round {self.round} of bucket {self.bucket!r} in step {self.step}"


#: the words of a call made without an identity
NO_CALL = (-1, -1, -1)
_current: contextvars.ContextVar[CallId | None] = contextvars.ContextVar("sparsecomm_call", default=None)
_THIS_THREAD = object()   # (call_mismatch's default: the call running on this thread)


class calling:
    """Make ``call`` the identity of the collective call this thread runs inside the ``with`` block (what
    its agreement headers and folded keys carry); ``None`` leaves the current one. (A class rather than a
    generator-based context manager: it is entered on every call of every transport.)"""

    __slots__ = ("_call", "_token")

    def __init__(self, call: CallId | None) -> None:
        self._call = call
        self._token = None

    def __enter__(self) -> None:
        if self._call is not None:
            self._token = _current.set(self._call)

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None


def current_call() -> CallId | None:
    """The identity of the call this thread runs (:func:`calling`), or None. A context variable: a process
    of the SimFabric's loop runs in the context of the thread that handed it over."""
    return _current.get()


def call_words() -> tuple[int, int, int]:
    """The header words of the call this thread runs (:data:`NO_CALL` for none)."""
    call = current_call()
    return NO_CALL if call is None else call.words


#: bytes of every handshake message
HEADER_BYTES = 8 * HEADER_WORDS


@functools.lru_cache(maxsize=64)    # (a pure function of the dtype, which every call of every transport asks)
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


#: payload kind -> the code a header field ``payload_kind`` carries (``sparsecomm.payload.KINDS`` order)
KIND_CODE = {k: i for i, k in enumerate(KINDS)}


def _fmt(name: str, value: int) -> str:
    if name.endswith("kind") and 0 <= int(value) < len(KINDS):
        return repr(KINDS[int(value)])
    if name.endswith("dtype"):
        d = _DTYPES.get(int(value))
        return str(d).replace("torch.", "") if d is not None else f"<dtype code {value}>"
    return str(value)


def mismatch_error(what: str, name: str, values: Sequence[int], rank: int) -> MismatchError:
    """The error for workers disagreeing on ``name``; ``values[j]`` is worker ``j``'s value."""
    vals = list(values)
    lo = min(range(len(vals)), key=lambda j: (vals[j], j))
    hi = max(range(len(vals)), key=lambda j: (vals[j], -j))
    return pair_mismatch(what, name, vals[lo], lo, vals[hi], hi, vals[rank], rank)


def pair_mismatch(what: str, name: str, vmin: int, rmin: int, vmax: int, rmax: int, mine: int,
                  rank: int) -> MismatchError:
    """The error for workers disagreeing on ``name``, from two of them: worker ``rmin`` has ``vmin``, worker
    ``rmax`` has ``vmax``; this worker, ``rank``, has ``mine``."""
    name = name.replace("_", " ")
    return MismatchError(
        f"{what}: workers disagree on the {name}: worker {rmin} has {_fmt(name, vmin)}, worker {rmax} "
        f"has {_fmt(name, vmax)} (this is worker {rank}, with {_fmt(name, mine)}); every worker must "
        f"pass the same {name}")


def call_mismatch(what: str, part: str, va: int, ra: int, vb: int, rb: int, rank: int, *,
                  here: "CallId | None | object" = _THIS_THREAD) -> MismatchError:
    """The error for two workers whose paired calls are different calls (their identities differ in
    ``part``: ``bucket``, ``step`` or ``round``); ``here``: this worker's call (default: the one running on
    this thread, :func:`current_call`)."""
    def show(v: int) -> str:
        if v == -1:
            return "a call without identity (a plain allreduce)"
        return f"bucket code {v}" if part == "bucket" else f"{part} {v}"

    if here is _THIS_THREAD:
        here = current_call()
    return MismatchError(
        f"{what}: workers are making different collective calls: worker {ra} is at {show(va)}, worker "
        f"{rb} at {show(vb)} (this is worker {rank}, at "
        f"{here if here is not None else 'a call without identity'}); every worker must make the same "
        f"calls in the same order: the same buckets, rounds and steps (a worker that skipped or repeated "
        f"a step or a bucket, or calls started from several threads in an order that differs between "
        f"workers)")


def same_call(what: str, calls: Sequence[Sequence[int]], rank: int) -> None:
    """Raise :func:`call_mismatch` (the first part that differs) unless every worker's call identity
    words (``calls[j]``: worker ``j``'s, as :func:`call_words`) are equal; for transports that hold every
    worker's header (allgather)."""
    for part, name in enumerate(_CALL_NAMES):
        col = [c[part] for c in calls]
        if min(col) != max(col):
            a, b = col.index(min(col)), col.index(max(col))
            raise call_mismatch(what, name, col[a], a, col[b], b, rank)


#: transport code -> name, of every name :func:`transport_code` encoded in this process (every
#: :class:`~sparsecomm.transports.base.Transport` subclass encodes its name when it is defined)
_NAMES: dict[int, str] = {}


def transport_code(name: str) -> int:
    """A stable non-negative integer naming the transport ``name`` (the agreement header's word 1)."""
    code = zlib.crc32(("transport:" + name).encode()) & 0x7FFFFFFF
    _NAMES.setdefault(code, name)
    return code


def transport_name(code: int) -> str:
    """The name that :func:`transport_code` encoded as ``code``, quoted (for an error message): any
    transport defined in this process; else ``<transport code N>``."""
    name = _NAMES.get(int(code))
    return repr(name) if name is not None else f"<transport code {code}>"


def _layout_code(names: Sequence[str], info: Sequence[str]) -> int:
    return zlib.crc32(("|".join(names) + "#" + "|".join(info)).encode()) & 0x7FFFFFFF


def _checksum(state: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 checksum of a header's words (all but the last)."""
    v = state[:-1].to(torch.int64)
    w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    return ((v ^ (w * 0x5851F42D4C957F2D)) * 0x9E3779B1 + w).sum()


def fail_stop(fabric, exc: BaseException, rank: int | None = None) -> BaseException:
    """Tell the other ranks about an error only this rank may have seen (a malformed message), so that
    their waits end at once instead of at the timeout (a fabric capability: ``fail``); ``rank``: the rank
    it names as the one that failed first (default: this one)."""
    fail = getattr(fabric, "fail", None)
    if fail is not None:
        try:
            fail(exc, rank)
        except Exception:  # noqa: BLE001 - reporting must not mask the error
            pass
    return exc


def header_state(rank: int, transport: str, names: Sequence[str], info: Sequence[str],
                 values: Sequence[int | torch.Tensor], device) -> torch.Tensor:
    """This worker's agreement header, ``int64[HEADER_WORDS]``: the same size for every transport and call."""
    if len(values) > MAX_FIELDS or len(info) > MAX_INFO:
        raise InvalidValueError(f"the agreement header holds at most {MAX_FIELDS} fields ({MAX_INFO} info fields)")
    words = [MAGIC, transport_code(transport), _layout_code(names, info), len(values)]
    words += [int(torch.as_tensor(v).reshape(()).item()) if isinstance(v, torch.Tensor) else int(v)
              for v in values]
    words += [0] * (_REF - len(words))
    words += [rank, -1, 0, 0, 0, 0] + [rank] * MAX_INFO + list(call_words()) + [0]
    state = torch.tensor(words, dtype=torch.int64, device=device)
    state[-1] = _checksum(state)
    return state


def validate_state(buf: torch.Tensor, src: int, what: str, rank: int, n: int) -> None:
    """Raise :class:`MalformedMessage` unless ``buf`` is a well-formed agreement header."""
    if int(buf[-1]) != int(_checksum(buf)):
        raise MalformedMessage(f"{what}: the agreement header from worker {src} fails its checksum "
                               f"(corrupted on the wire, or not a sparsecomm header); this is worker {rank}")
    w = buf.tolist()
    if w[0] != MAGIC:
        raise MalformedMessage(f"{what}: worker {src} sent an agreement header of another protocol version "
                               f"(magic {w[0]:#x}, expected {MAGIC:#x}); this is worker {rank}")
    ranks = [w[_REF]] + w[_ARG:_ARG + MAX_INFO] + ([w[_DIS + 1], w[_DIS + 3]] if w[_DIS] >= 0 else [])
    if not all(0 <= x < n for x in ranks) or not (-1 <= w[_DIS] < _REF or _CALL <= w[_DIS] < _CALL + 3) or not 0 <= w[3] <= MAX_FIELDS:
        raise MalformedMessage(f"{what}: the agreement header from worker {src} names ranks outside "
                               f"0..{n - 1} or words outside the header; this is worker {rank}")


def header_fields(words: Sequence[int], nfields: int) -> list[int]:
    """A header's ``nfields`` fields, then its call identity's three words (:class:`CallId`)."""
    return list(words[_PRE:_PRE + nfields]) + list(words[_CALL:_CALL + 3])


def read_header(buf: torch.Tensor, src: int, what: str, transport: str, nfields: int, rank: int,
                n: int) -> list[int]:
    """Worker ``src``'s own header (exchanged as it is, not merged: :func:`header_state`), checked, as
    :func:`header_fields`. :class:`MalformedMessage` unless it is well-formed (:func:`validate_state`) and
    holds ``nfields`` fields of ``src``; :class:`MismatchError` naming both transports unless ``src`` runs
    ``transport`` too. Either may have been seen by this worker only: the caller reports it
    (:func:`fail_stop`)."""
    validate_state(buf, src, what, rank, n)
    w = buf.tolist()
    mine = transport_code(transport)
    if w[1] != mine or w[_DIS] >= 0:
        theirs = w[1] if w[1] != mine else w[_DIS + 4]
        raise MismatchError(f"{what}: workers disagree on the transport: worker {src} runs "
                            f"{transport_name(theirs)}, this worker ({rank}) runs {transport!r}; every worker "
                            f"must call the same transport in the same order")
    if w[3] != nfields or w[_REF] != src:
        raise MalformedMessage(f"{what}: worker {src}'s header has {w[3]} fields for worker {w[_REF]}, "
                               f"expected {nfields} for worker {src}; this is worker {rank}")
    return header_fields(w, nfields)


def _combine(a: list[int], b: list[int], compared: list[int], info: range) -> list[int]:
    """Merge two header states (see :func:`check_agreement`)."""
    lo, hi = (a, b) if a[_REF] <= b[_REF] else (b, a)
    out = list(lo)
    if lo[_DIS] < 0:
        if hi[_DIS] >= 0:
            out[_DIS:_DIS + 5] = hi[_DIS:_DIS + 5]
        else:
            j = next((j for j in compared if lo[j] != hi[j]), None)
            if j is not None:
                out[_DIS:_DIS + 5] = [j, lo[_REF], lo[j], hi[_REF], hi[j]]
    for i, j in enumerate(info):
        if b[j] > a[j] or (b[j] == a[j] and b[_ARG + i] < a[_ARG + i]):
            out[j], out[_ARG + i] = b[j], b[_ARG + i]
        else:
            out[j], out[_ARG + i] = a[j], a[_ARG + i]
    return out


def agreement_role(fabric, inbox, what: str, *, tag: int = HANDSHAKE_TAG, transport: str | None = None,
                   info: dict | None = None, stage=None, **fields: int | torch.Tensor):
    """The agreement of :func:`check_agreement` on this worker as a role (:mod:`sparsecomm.fabric.roles`): a
    generator that yields, per round of the dissemination, its send (held under ``("agreement", tag, k)``),
    the receive it posts into its own buffer, a wait for it (:class:`~sparsecomm.fabric.roles.Recv` at
    ``stage``, default a plain :class:`~sparsecomm.fabric.roles.Step`), then takes the header from ``inbox``
    and waits for its own send (:class:`~sparsecomm.fabric.roles.Flush`) before the next round; it returns
    what :func:`check_agreement` returns and raises what it raises. A role that runs the agreement first
    writes ``got = yield from agreement_role(fabric, inbox, ...)`` in the same drive as its data. Its inbox keys
    are ``("agreement", tag, k)``: two agreements on one tag in one drive must run one after the other.

    This worker's header (the fields, and the identity of the call running on this thread,
    :func:`calling`) is built when this function is called, not when the role first runs, so a fabric may
    run the role on another thread. ``fabric`` is read for its rank, world size, device and ``stats``, and
    told of an error only this worker may have seen (:func:`fail_stop`); ``inbox`` is the endpoint's inbox
    of the drive that runs the role. The arguments are :func:`check_agreement`'s; with one worker the role
    yields nothing."""
    n, rank = fabric.world_size, fabric.rank
    info = dict(info or {})
    if n <= 1:
        return _returns({k: (int(torch.as_tensor(v)), rank) for k, v in info.items()})
    if rank >= n:
        raise RuntimeError("check_agreement is for workers only")
    transport = transport or what.split()[0]
    names, inames = list(fields), list(info)
    state = header_state(rank, transport, names, inames, list(fields.values()) + list(info.values()),
                         fabric.device)
    return _disseminate(fabric, inbox, what, tag, transport, names, inames, state, current_call(),
                        Step() if stage is None else stage)


def _returns(value):
    """A role that yields nothing and returns ``value``."""
    return value
    yield  # noqa: unreachable - makes this a generator


def _disseminate(fabric, inbox, what: str, tag: int, transport: str, names: list[str], inames: list[str],
                 state: torch.Tensor, here: CallId | None, stage):
    """:func:`agreement_role`'s rounds, from this worker's header ``state``; ``here``: the identity of the
    call (for the error of a call mismatch)."""
    n, rank = fabric.world_size, fabric.rank
    mine = state.tolist()
    compared = [0, 1] + list(range(_PRE, _PRE + len(names))) + [2, 3] + list(range(_CALL, _CALL + 3))
    info_words = range(_PRE + len(names), _PRE + len(names) + len(inames))
    cur = mine
    buf = torch.empty_like(state)
    k = 1
    while k < n:
        src = (rank - k) % n
        key = ("agreement", tag, k)
        yield Send(state, (rank + k) % n, tag, hold=key)
        yield PostInto(key, buf, src, tag)
        yield Recv((key,), stage)
        inbox.take(key)
        yield Flush(key)
        try:
            validate_state(buf, src, what, rank, n)
        except MalformedMessage as exc:
            raise fail_stop(fabric, exc) from None
        cur = _combine(cur, buf.tolist(), compared, info_words)
        state = torch.tensor(cur, dtype=torch.int64, device=fabric.device)
        state[-1] = _checksum(state)
        k *= 2
    fabric.stats.rounds += (n - 1).bit_length()
    j = cur[_DIS]
    if j >= 0:
        ra, va, rb, vb = cur[_DIS + 1:_DIS + 5]
        if j == 1:
            # transports that disagree may not even agree on who sends what to whom: some worker may be
            # left waiting for a message that never comes, so the other ranks are told (fail-stop)
            raise fail_stop(fabric, MismatchError(
                f"{what}: workers disagree on the transport: worker {ra} runs {transport_name(va)}, "
                f"worker {rb} runs {transport_name(vb)} (this is worker {rank}, running {transport!r}); "
                f"every worker must call the same transport in the same order")) from None
        if _CALL <= j < _CALL + 3:
            raise call_mismatch(what, _CALL_NAMES[j - _CALL], va, ra, vb, rb, rank, here=here)
        if j in (0, 2, 3):
            raise MismatchError(
                f"{what}: workers {ra} and {rb} describe their calls with different fields (another "
                f"payload kind, dtype class, transport option or library version; this is worker {rank}); "
                f"every worker must pass the same kind of input with the same options")
        (vmin, rmin), (vmax, rmax) = sorted([(va, ra), (vb, rb)])
        raise pair_mismatch(what, names[j - _PRE], vmin, rmin, vmax, rmax, mine[j], rank)
    return {nm: (cur[_PRE + len(names) + i], cur[_ARG + i]) for i, nm in enumerate(inames)}


def check_agreement(fabric, what: str, *, tag: int = HANDSHAKE_TAG, transport: str | None = None,
                    info: dict | None = None, **fields: int | torch.Tensor) -> dict[str, tuple[int, int]]:
    """Raise :class:`MismatchError` on every worker unless all workers pass equal ``fields``.

    ``what`` names the operation in the message (e.g. ``"ring allreduce"``); ``transport`` (default: its
    first word) is part of the header, so workers running different transports get a MismatchError
    naming both (and, since their message patterns may differ, the failure is reported to every rank:
    the job stops). ``info`` fields (at most :data:`MAX_INFO`) are not compared: the result maps each to
    ``(max over workers, the lowest worker holding it)``. Must be called by every worker (not by
    services) in the same order relative to other traffic on ``tag``. Every message is one fixed-size
    header (:data:`HEADER_BYTES`), whatever the transport and the fields, so a worker never receives a
    message of another size than it posted; a malformed one raises :class:`MalformedMessage`.

    State merged by the dissemination: the fields of the lowest rank merged so far, the first
    disagreement seen (word, two ranks, their values), and each info field's maximum and its rank. A
    merged set of workers holds a disagreement record exactly when two of its members' headers differ
    (by induction over the merges), so after ``ceil(log2 n)`` rounds every worker knows whether all
    agree, and names two that do not.

    The rounds are one role (:func:`agreement_role`) that ``fabric.drive`` runs, with an inbox and outbox
    of their own; every send has completed when this returns.
    """
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    role = agreement_role(fabric, inbox, what, tag=tag, transport=transport, info=info, **fields)
    if fabric.world_size <= 1:
        return _value(role)
    out: dict = {}

    def into():
        out["got"] = yield from role

    fabric.drive([into()], inbox, outbox)
    outbox.finish()
    return out["got"]


def _value(role):
    """What a role that yields nothing returns."""
    try:
        req = next(role)
    except StopIteration as stop:
        return stop.value
    raise AssertionError(f"a one-worker agreement asked for {req!r}")


def handshake_bytes(nfields: int | None = None) -> int:
    """Bytes of one handshake message: the fixed-size header state, whatever the number of fields."""
    return HEADER_BYTES
