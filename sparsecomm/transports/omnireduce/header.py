"""OmniReduce's round-0 admission messages: a worker's call and its header, the checks of the headers
at an aggregator and its verdict, the verdict's meaning at the workers, and the manifest a worker sends
after a verdict that is not OK. The field layouts are :mod:`.wire`'s.

A worker describes its call (:class:`CallSpec`) in a header sealed with a checksum (:func:`seal`). An
aggregator checks each header, before anything is planned, allocated or received by it, against the
world size, its own index, the protocol's limits and the checksum (:func:`validate_header`), then the
headers' agreement (:func:`check_headers`); :func:`verdict` is both. After a verdict that is not OK the
aggregator receives nothing by any header (the wrong one may be any): each remote worker sends a manifest
of the round-0 messages it actually sent (:func:`manifest`), and the aggregator consumes exactly those
(:func:`read_manifest`, each message at most :data:`DRAIN_MAX_BYTES`). A checksum catches a message
changed on the way, not a peer that lies (it can recompute it); a liar's header that disagrees with the
others' is a disagreement like any other, consumed by its manifest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
import torch

from ...errors import MalformedMessage, OverflowError_
from .._handshake import pair_mismatch
from .wire import (AGREE, F_ABSMAX, F_AGGS, F_BLOCK, F_CHANNELS, F_CHECK, F_DTYPE, F_K0, F_KIND, F_LANES,
                   F_MAGIC, F_NUMEL, F_SUM, F_WORLD, FIELD_NAMES, HDR, KINDS, MAGIC, MAN, MAX_CHANNELS, MALFORMED,
                   MISMATCH, OK, OTHER_NAMES, OVERFLOW, R_DOWN_DTYPE, R_FIELD, R_STATUS, R_VMAX, R_VMIN,
                   R_WMAX, R_WMIN, WHAT, block_bytes, code_dtype, down_dtype, dtype_code, firsts_bytes, plan, short_end)

#: the headers remembered by the checks made per aggregator index (:func:`validate_words`, :func:`round0_sizes_of_words`):
#: a call's headers are a few distinct words per aggregator, so a call of ``n`` colocated aggregators needs a few
#: ``n`` of them (an LRU smaller than that misses every header at ``n`` = 1024: its accesses cycle)
_PER_INDEX = 1 << 13

# protocol limits a header is checked against before anything is planned, allocated or looped over
MAX_AGGREGATORS = 4096
MAX_BLOCK = 1 << 20
MAX_LANES = 1 << 24
MAX_NUMEL = 1 << 48
#: the largest round-0 message an aggregator drains after a verdict that is not OK (:func:`read_manifest`):
#: a manifest announcing more ends the job (the message cannot be consumed, so the fabric cannot be
#: cleaned), and no peer makes an aggregator allocate more than this for a call it rejected
DRAIN_MAX_BYTES = 64 << 20


@dataclass
class CallSpec:
    """What a worker tells the aggregators about its call (the round-0 header)."""

    numel: int
    up: torch.dtype
    block_size: int
    num_aggregators: int
    channels: int
    lanes: int
    kind: int
    check: int = 0
    absmax: int = 0

    def header(self, world: int, k0: dict[int, int] | None = None) -> torch.Tensor:
        """The round-0 header, sealed (:func:`seal`); ``k0[slot]``: this worker's position-0 blocks in
        that channel. A fresh tensor; without ``k0`` its words are remembered for the last few calls (a
        repeated call's header is the same words: built and sealed once)."""
        if not k0:
            return torch.from_numpy(np.frombuffer(_base_header(self._words(world)), dtype=np.int64).copy())
        h = np.zeros(HDR, dtype=np.int64)
        for g, k in k0.items():
            h[F_K0 + g] = k
        h[_SPEC_FIELDS] = self._words(world)
        seal(h)
        return torch.from_numpy(h)

    def _words(self, world: int) -> tuple:
        """The header's words that the call sets (:data:`_SPEC_FIELDS`' order)."""
        return (MAGIC, self.numel, dtype_code(self.up), self.block_size, self.num_aggregators, self.channels,
                self.lanes, self.kind, self.check, world, self.absmax)


@functools.lru_cache(maxsize=64)
def _base_header(words: tuple) -> bytes:
    """The sealed header (no position-0 blocks) whose :data:`_SPEC_FIELDS` are ``words``, as bytes."""
    h = np.zeros(HDR, dtype=np.int64)
    h[_SPEC_FIELDS] = words
    seal(h)
    return h.tobytes()


_second = itemgetter(1)     # a ``(slot, blocks)`` pair's blocks


def with_k0(base: np.ndarray, k0: list[tuple[int, int]]) -> np.ndarray:
    """A copy of the sealed header ``base`` (:meth:`CallSpec.header` without position-0 blocks) with ``k0``'s
    ``(slot, blocks)`` position-0 counts, resealed where any is non-zero: the words of ``CallSpec.header(world,
    dict(k0))``, without building them again (nor sealing them again: the last few are remembered)."""
    if not any(map(_second, k0)):         # (no bytecode per slot)
        return base.copy()
    return np.frombuffer(_with_k0(base.tobytes(), tuple(k0)), dtype=np.int64).copy()


@functools.lru_cache(maxsize=1024)
def _with_k0(base: bytes, k0: tuple[tuple[int, int], ...]) -> bytes:
    """:func:`with_k0`'s words of the sealed header whose int64 words are ``base``."""
    h = np.frombuffer(base, dtype=np.int64).copy()
    for g, k in k0:
        h[F_K0 + g] = k
    seal(h)
    return h.tobytes()


#: the header words :meth:`CallSpec.header` sets from the call, in its order
_SPEC_FIELDS = [F_MAGIC, F_NUMEL, F_DTYPE, F_BLOCK, F_AGGS, F_CHANNELS, F_LANES, F_KIND, F_CHECK, F_WORLD, F_ABSMAX]


@functools.lru_cache(maxsize=8)     # (headers and manifests: two lengths)
def _weights(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The checksum's weights of ``size`` words, ``w = 1, 2, ...`` and ``w * 0x5851F42D4C957F2D`` (uint64,
    read-only)."""
    w = np.arange(1, size + 1, dtype=np.uint64)
    wk = w * np.uint64(0x5851F42D4C957F2D)
    w.flags.writeable = wk.flags.writeable = False
    return w, wk


def checksum(words: np.ndarray, skip: int) -> int:
    """A position-weighted 64-bit checksum of int64 ``words`` but word ``skip`` (where it is stored):
    it catches a message changed on the way, not a peer that lies (who can recompute it)."""
    v = np.asarray(words, dtype=np.int64).astype(np.uint64)
    v[skip] = 0
    w, wk = _weights(v.size)
    s = int(((v ^ wk) * np.uint64(0x9E3779B1) + w).sum(dtype=np.uint64))
    return s - (1 << 64) if s >> 63 else s       # (the uint64 read as int64)


def seal(h: np.ndarray) -> None:
    """Store the header's checksum in it (its last step, after every field is set)."""
    h[F_SUM] = checksum(h, F_SUM)


def validate_header(h: np.ndarray, n: int, index: int, colocated: bool) -> tuple[int, str] | None:
    """``(field, reason)`` if a worker's round-0 header is not one this aggregator can serve (checked
    against the world size, its own index and the protocol limits; then its checksum: a header changed
    on the way sizes no receive), else ``None``. A function of the header's words and the arguments alone,
    remembered for the last few (a repeated call's headers, every aggregator's of the same workers' call, are
    the same words: checked once)."""
    return validate_words(np.ascontiguousarray(h, dtype=np.int64).tobytes(), n, index, colocated)


@functools.lru_cache(maxsize=1024)
def agrees(words: bytes, ref: bytes) -> bool:
    """Does the (validated) header whose int64 words are ``words`` agree with the header ``ref`` (its words) in
    every field of :data:`.wire.AGREE`? Remembered for the last few (a call's headers are a few distinct words)."""
    mine, theirs = np.frombuffer(words, dtype=np.int64), np.frombuffer(ref, dtype=np.int64)
    return bool((mine[_AGREE_AT] == theirs[_AGREE_AT]).all())


_AGREE_AT = np.asarray(AGREE, dtype=np.int64)


@functools.lru_cache(maxsize=_PER_INDEX)
def validate_words(words: bytes, n: int, index: int, colocated: bool) -> tuple[int, str] | None:
    """:func:`validate_header` of the header whose int64 words are ``words`` (a header taken as bytes: no array
    made to check it; remembered for the last few)."""
    h = np.frombuffer(words, dtype=np.int64)
    v = h.tolist()           # (the words as Python ints, read once)
    if v[F_MAGIC] != MAGIC:
        return F_MAGIC, f"wire version {v[F_MAGIC]:#x}, expected {MAGIC:#x}"
    if v[F_WORLD] != n:
        return F_WORLD, f"world size {v[F_WORLD]}, the job has {n} workers"
    try:
        code_dtype(v[F_DTYPE])
    except MalformedMessage:
        return F_DTYPE, f"dtype code {v[F_DTYPE]}, not a dtype the protocol carries"
    A = v[F_AGGS]
    if not (1 <= A <= MAX_AGGREGATORS and index < A and (not colocated or A == n)):
        return F_AGGS, (f"num_aggregators {A}; aggregator {index} allows {index + 1}..{MAX_AGGREGATORS}"
                        + (f" (colocated: exactly {n})" if colocated else ""))
    for f, lo, hi, name in _LIMITS:
        if not lo <= v[f] <= hi:
            return f, f"{name} {v[f]}, outside [{lo}, {hi}]"
    chans = {c.slot: c for c in plan(v[F_NUMEL], v[F_BLOCK], v[F_AGGS], v[F_CHANNELS], v[F_LANES])[index]}
    for g in range(MAX_CHANNELS):
        k0 = v[F_K0 + g]
        limit = chans[g].lanes if g in chans else 0
        if not 0 <= k0 <= limit:
            return F_K0 + g, f"{k0} position-0 blocks in channel {g}, which has {limit} lanes here"
    if v[F_SUM] != checksum(h, F_SUM):
        return F_SUM, "the checksum does not match the header's words"
    return None


#: the header's fields checked against a range: ``(field, low, high, name)``
_LIMITS = ((F_BLOCK, 1, MAX_BLOCK, "block_size"), (F_CHANNELS, 1, MAX_CHANNELS, "channels"),
           (F_LANES, 1, MAX_LANES, "lanes"), (F_KIND, 0, len(KINDS) - 1, "payload kind"),
           (F_NUMEL, 0, MAX_NUMEL, "numel"), (F_ABSMAX, 0, 2**62, "integer bound"))


def round0_sizes(h: np.ndarray, index: int) -> tuple[int, dict[int, int]]:
    """The round-0 messages a worker's (validated) header announces to aggregator ``index``: the bytes of
    its first look-aheads (0: none) and of its position-0 blocks per slot (only slots with some). A function
    of the header's words and ``index``, remembered for the last few (as :func:`validate_header`)."""
    firsts, blocks = round0_sizes_of_words(np.ascontiguousarray(h, dtype=np.int64).tobytes(), index)
    return firsts, dict(blocks)


@functools.lru_cache(maxsize=_PER_INDEX)
def round0_sizes_of_words(words: bytes, index: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """:func:`round0_sizes` of the header whose int64 words are ``words``, the blocks' sizes as ``(slot,
    bytes)`` pairs (immutable: shared by the calls that remember it; a header taken as bytes: no array made)."""
    v = np.frombuffer(words, dtype=np.int64).tolist()     # (the words as Python ints, read once)
    up = code_dtype(v[F_DTYPE])
    chans = plan(v[F_NUMEL], v[F_BLOCK], v[F_AGGS], v[F_CHANNELS], v[F_LANES])[index]
    blocks = {ch.slot: block_bytes(v[F_K0 + ch.slot], v[F_BLOCK], up.itemsize, meta=not ch.single,
                                   short=short_end(ch, v[F_NUMEL], v[F_BLOCK]) if v[F_K0 + ch.slot] == ch.size else 0)
              for ch in chans if v[F_K0 + ch.slot]}
    return firsts_bytes(chans), tuple(blocks.items())


def manifest(h: np.ndarray, index: int) -> torch.Tensor:
    """A worker's manifest for aggregator ``index`` (``int64[MAN]``, from the header it built, not the one
    that arrived): the bytes of each round-0 message it sent there (:func:`round0_sizes`), checksummed.
    Sent after a verdict that is not OK, so that the aggregator consumes exactly those messages."""
    firsts, blocks = round0_sizes(h, index)
    m = np.zeros(MAN, dtype=np.int64)
    m[0] = firsts
    for g, nbytes in blocks.items():
        m[1 + g] = nbytes
    m[-1] = checksum(m, MAN - 1)
    return torch.from_numpy(m)


def read_manifest(m: np.ndarray, worker: int) -> tuple[int, dict[int, int]]:
    """``(first look-aheads' bytes, {slot: blocks' bytes})`` of a worker's manifest; raises
    :class:`~sparsecomm.errors.MalformedMessage` if it was changed on the way or announces a message over
    :data:`DRAIN_MAX_BYTES` (which the aggregator could not consume)."""
    if int(m[-1]) != checksum(m, MAN - 1):
        raise MalformedMessage(f"{WHAT}: worker {worker}'s round-0 manifest does not match its checksum")
    sizes = [int(v) for v in m[:-1]]
    if not all(0 <= v <= DRAIN_MAX_BYTES for v in sizes):
        raise MalformedMessage(f"{WHAT}: worker {worker}'s round-0 manifest announces a message of "
                               f"{max(sizes, key=abs)} bytes, outside [0, {DRAIN_MAX_BYTES}]")
    return sizes[0], {g: v for g, v in enumerate(sizes[1:]) if v}


def verdict(headers: list[np.ndarray] | np.ndarray, order: list[int], index: int, colocated: bool,
            valid: frozenset | set = frozenset()) -> np.ndarray:
    """Aggregator ``index``'s verdict on every worker's header (``headers[w]``), the reply header:
    ``MALFORMED`` naming the first worker in ``order`` whose header :func:`validate_header` rejects
    (the field and its value), else :func:`check_headers`'. ``valid``: workers whose headers (these very
    arrays, unchanged since) this aggregator has validated already, with the same ``index`` and ``colocated``
    (an early header, :meth:`.aggregator.AggCall.take_early`): not validated again."""
    for w in order:
        if w in valid:
            continue
        why = validate_header(headers[w], len(headers), index, colocated)
        if why is not None:
            reply = np.zeros(HDR, dtype=np.int64)
            reply[[R_STATUS, R_FIELD, R_WMIN, R_VMIN]] = [MALFORMED, why[0], w, int(headers[w][why[0]])]
            return reply
    return check_headers(headers)


def check_headers(headers: list[np.ndarray] | np.ndarray) -> np.ndarray:
    """Validate the workers' headers; returns the reply header (status, down dtype, detail), a fresh array. A
    function of the headers' words alone, remembered for the last few (a repeated call's headers are the same
    words: compared once)."""
    table = np.concatenate(headers) if len(headers) else np.empty(0, dtype=np.int64)   # (a list, or a table)
    if table.dtype == np.int64 and table.size == HDR * len(headers):    # (one join: no call per header)
        words = table.tobytes()
    else:
        words = b"".join(np.ascontiguousarray(h, dtype=np.int64).tobytes() for h in headers)
    return np.frombuffer(_check_headers(words, len(headers)), dtype=np.int64).copy()


@functools.lru_cache(maxsize=64)
def _check_headers(words: bytes, n: int) -> bytes:
    """:func:`check_headers` of the ``n`` headers whose int64 words, one after the other, are ``words``. A few
    entries: a process's aggregators see a repeated call's headers again, and its keys are ``n`` headers each
    (at most 64 x n x 224 bytes held, 15 MB for 1024 simulated workers)."""
    reply = np.zeros(HDR, dtype=np.int64)
    table = np.frombuffer(words, dtype=np.int64).reshape(n, -1)     # (worker, word)
    h0 = table[0]
    agree = table[:, AGREE]
    differ = (agree != agree[0]).any(axis=0).nonzero()[0]     # (every field at once: the first that differs)
    for f in [AGREE[int(differ[0])]] if differ.size else ():
        col = table[:, f]
        if col.min() != col.max():
            vals = col.tolist()
            lo = min(range(len(vals)), key=lambda j: (vals[j], j))
            hi = max(range(len(vals)), key=lambda j: (vals[j], -j))
            reply[[R_STATUS, R_FIELD, R_WMIN, R_VMIN, R_WMAX, R_VMAX]] = [MISMATCH, f, lo, vals[lo], hi, vals[hi]]
            return reply.tobytes()
    up = code_dtype(h0[F_DTYPE])
    bound = sum(table[:, F_ABSMAX].tolist())
    if not up.is_floating_point and bound > torch.iinfo(torch.int64).max:
        reply[R_STATUS] = OVERFLOW
        return reply.tobytes()
    reply[R_DOWN_DTYPE] = dtype_code(down_dtype(up, bound))
    return reply.tobytes()


def raise_for_reply(reply: np.ndarray, header: np.ndarray, rank: int) -> None:
    """Raise the error a non-OK round-0 reply describes (on every worker; the agreement handshake's
    wording, :func:`sparsecomm.transports._handshake.mismatch_error`)."""
    status = int(reply[R_STATUS])
    if status == OK:
        return
    if status == MALFORMED:
        f = int(reply[R_FIELD])
        raise MalformedMessage(f"{WHAT}: the aggregator rejected worker {int(reply[R_WMIN])}'s round-0 header "
                               f"(field {FIELD_NAMES.get(f) or OTHER_NAMES.get(f, f)!s} = {int(reply[R_VMIN])}: "
                               f"out of range for this job, or changed on the way; this is worker {rank})")
    if status not in (MISMATCH, OVERFLOW):
        raise MalformedMessage(f"{WHAT}: an aggregator replied with unknown status {status} (this is worker {rank})")
    if status == OVERFLOW:
        raise OverflowError_(f"{WHAT}: the sum of the workers' integer codes can exceed int64 (this is "
                             f"worker {rank}); use fewer quantisation levels or fewer workers")
    f = int(reply[R_FIELD])
    raise pair_mismatch(WHAT, FIELD_NAMES.get(f, str(f)), int(reply[R_VMIN]), int(reply[R_WMIN]),
                    int(reply[R_VMAX]), int(reply[R_WMAX]), int(header[f]), rank)
