"""The agreement folded into the data: a repeated ``native`` call skips its handshake, safely.

Every transport call starts with the agreement handshake (:mod:`._handshake`): ``ceil(log2 n)`` latency
steps of a fixed-size header before the data (:func:`theory.costs.handshake`), more than a small
bucket's all-reduce takes (BENCHMARKS.md, "Training step"). Training repeats the same calls in the same
order every step, so the workers *predict* the next call and let the data collective check the
prediction.

**Record.** Each worker keeps, per fabric (:func:`schedule`), a record of its completed collective
calls: the last one's key (the transport and, for ``native``, every field its handshake compares:
length, dtype, payload kind, ..., and the call's identity, :class:`~._handshake.CallId`: its bucket,
its round and how many steps it is past the previous call, :meth:`Schedule.call_key`) and how many
times in a row it came, and for each *context* the call that followed it and how many times in a row. A context is a key with its run length (exact) or
without (general); the exact one is asked first, the general one for a run length never seen before, or for
one seen fewer than :data:`CONFIRMATIONS` times with the successor the general one confirms (a call repeated in
one run of a loop and then in another, e.g. the same bucket's call from two frontends in turn, meets each run
length of the first run once, which must not hide the general context the second run confirms). So a run of equal buckets, ``K K K K`` then ``L``, predicts ``K`` inside the run and ``L`` at
its end, and an endless ``K K K ...`` is predicted by ``K`` alone. Every worker completes the same
calls in the same order, or all raise the same error (which clears the record on each), so every
worker holds the same record.

**Prediction.** When the call that followed the last context did so :data:`CONFIRMATIONS` times in a
row and is *foldable* (a ``native`` all-reduce of a float vector of at most ``fold_max_bytes``, a
``native`` gather, :mod:`.native.gather`, or a ``ring`` or ``omnireduce`` all-reduce of a float vector of at
most :data:`FOLD_MAX_BYTES`, whose predicted call runs its steps without the handshake), the next call is
predicted to be it: the same prediction on every worker, a function of the same record.

**The next call**, on each worker:

- the predicted call (its key equals the prediction's): the worker all-reduces its data at once;
- any other call (another length, dtype, kind or transport, a gather): the worker *deviates*: it joins
  the predicted all-reduce with a vector of the predicted length and dtype filled with NaN, then runs
  the handshake describing its own call (once the call completes, its record replaces the
  mispredicted successor, which must be confirmed anew).

A sum that a deviator joined is NaN in every element. A worker that took the fast path tests for it
(the non-finite check it runs anyway, or element 0 with ``nonfinite="pass"``) and, on NaN, runs the
handshake with its own fields. If some worker deviated, the handshakes meet (one fixed-size header on
one tag), the deviator's key differs from the prediction, so the workers disagree: the handshake's
:class:`~sparsecomm.errors.MismatchError` on every worker, naming the field and two workers, as without
the fold. If every worker deviated alike (the pattern changed everywhere), their handshakes agree and
the call runs as an unfolded one. If none did, the NaN is the data's and the non-finite rules of
:mod:`._guards` apply.

**Identity.** A worker whose call is another bucket or round than the prediction, or that is a step
ahead or behind (a step skipped or repeated), deviates like any other: the step enters the key as the
number of steps since the previous call (0 inside a step, 1 at its first call in steady training), so
a stable training loop keeps being predicted while a worker whose step count jumps deviates at once,
and its handshake names the step.

What stays true: in the folded all-reduce every worker posts the predicted length and dtype, and in a
handshake one fixed-size header, so no worker receives a message longer than it posted (gloo aborts
on that); workers that disagree get a MismatchError on every worker, never a wrong sum.
What it costs: nothing extra on a predicted call; a mispredicted one costs one all-reduce of at most
``fold_max_bytes`` (:data:`FOLD_MAX_BYTES` by default) before its handshake, on every worker.
Fabrics without ``native_group`` (SimFabric) keep no record: nothing changes there.

**Notes.** A transport may also note in the record something of a completed call that every worker knows alike
(:meth:`Schedule.note`: OmniReduce notes the blocks of each call's union, which decide the channels of its next
occurrence), so that the workers decide alike without an exchange; an error clears the notes with the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from ._handshake import current_call

#: a successor must have followed this many times in a row before it is predicted
CONFIRMATIONS = 2
#: contexts remembered per fabric (oldest forgotten first, alike on every worker)
MAX_KEYS = 4096
#: a context is the last call's key and how many times in a row it came, up to this many
MAX_RUN = 1024
#: largest foldable all-reduce (bytes): what a misprediction may cost each worker, once
FOLD_MAX_BYTES = 16 << 20

_SCRATCH = "transports/fold_schedule"


@dataclass(frozen=True)
class Fold:
    """A foldable call: its key, the length and dtype of the vector it all-reduces, and how a
    deviator joins that all-reduce (``join(vector)``)."""

    key: Hashable
    numel: int
    dtype: torch.dtype
    device: torch.device
    join: Callable[[torch.Tensor], Any]


class Schedule:
    """One fabric's record of completed calls and the prediction drawn from it (module docstring)."""

    def __init__(self) -> None:
        self._last: Hashable | None = None
        self._run = 0                      # times in a row ``_last`` was called
        # context -> [successor key, its Fold or None, times in a row]
        self._next: OrderedDict[Hashable, list] = OrderedDict()
        #: calls that took the fast path / deviated from a prediction (for tests and benchmarks)
        self.folded = 0
        self.deviated = 0
        #: folded calls posted at once on the calling thread (``Native.start``, :meth:`CommEngine.post`)
        self.posted = 0
        #: posted calls among them whose completion is chained on the collective's own future
        #: (``Native.chain``, :meth:`CommEngine.chain`)
        self.chained = 0
        self._step: int | None = None      # the step of the last recorded call that had an identity
        # what a transport noted of a completed call, by a key of its own (:meth:`note`)
        self._notes: OrderedDict[Hashable, Any] = OrderedDict()

    def call_key(self, call=None) -> tuple:
        """The part of a key that names the call running on this thread (:func:`current_call`), or
        ``call`` (a :class:`~.base.CallId`) if given: its bucket code, its round and its step relative to
        the previous recorded call's."""
        if call is None:
            call = current_call()
        if call is None:
            return ()
        bucket, step, rnd = call.words
        return self.key_of(bucket, step, rnd)

    def key_of(self, code: int, step: int, rnd: int) -> tuple:
        """:meth:`call_key` of a call given by its words: ``code`` (its bucket's, ``CallId.words[0]``, which a
        caller making the same bucket's calls every step computes once), ``step`` and ``rnd``."""
        return (("call", code, rnd, None if self._step is None else step - self._step),)

    def predicted(self) -> Fold | None:
        """The predicted next call, or None."""
        last = self._last
        if last is None:
            return None
        e = self._successor(last)
        return e[1] if e is not None and e[2] >= CONFIRMATIONS else None

    def _successor(self, last: Hashable) -> list | None:
        """The entry of the context that predicts what follows ``last`` (module docstring): the exact one, unless
        it is not confirmed and names the successor the general one confirms (an exact context seen fewer times,
        e.g. once in an earlier run of the same call, does not hide the general one confirmed since; one that names
        another successor, a run's end, still does), or there is none: then the general one."""
        nxt = self._next
        e = nxt.get((last, min(self._run, MAX_RUN)))
        if e is None:
            return nxt.get((last, None))
        if e[2] < CONFIRMATIONS:
            g = nxt.get((last, None))
            if g is not None and g[2] >= CONFIRMATIONS and g[0] == e[0]:
                return g
        return e

    def predicts(self, prefix: tuple, code: int, step: int, rnd: int) -> tuple[tuple, Fold] | None:
        """``(key, fold)`` when the call whose key is ``prefix + key_of(code, step, rnd)`` is the predicted one
        (:meth:`predicted`, whose key it is), else None: :meth:`predicted` and :meth:`key_of` in one call, for
        a caller that then makes the call and records it (:meth:`record`)."""
        last = self._last
        if last is None:
            return None
        e = self._successor(last)
        if e is None or e[2] < CONFIRMATIONS or e[1] is None:
            return None
        fold = e[1]
        key = prefix + (("call", code, rnd, None if self._step is None else step - self._step),)
        return (key, fold) if fold.key == key else None

    def take(self, prefix: tuple, code: int, step: int, rnd: int) -> Hashable | None:
        """:meth:`predicts` and, when the call is the predicted one, its :meth:`record` (with its ``step``), for a
        caller about to make it (:meth:`Native.chain <sparsecomm.transports.native.Native.chain>`, under the
        engine's lock): its key, or None (nothing recorded). A caller whose call then fails to be made must
        :meth:`reset`."""
        got = self.predicts(prefix, code, step, rnd)
        if got is None:
            return None
        self.record(*got, step=step)
        return got[0]

    def record(self, key: Hashable, fold: Fold | None = None, step: int | None = None) -> None:
        """A call with ``key`` completed on every worker (``fold``: it is foldable); made on the thread
        that ran the call, inside its :func:`~._handshake.calling` block, or given the step of its
        identity (``step``) where it is made outside one."""
        if step is None:
            call = current_call()
            step = None if call is None else call.step
        if step is not None:
            self._step = int(step)
        last, nxt = self._last, self._next
        if last is not None:
            for ctx in ((last, min(self._run, MAX_RUN)), (last, None)):
                e = nxt.get(ctx)
                if e is None:
                    nxt[ctx] = [key, fold, 1]
                elif e[0] == key:
                    e[1], e[2] = fold, e[2] + 1     # the same call; its fold may carry a new size (a gather's)
                else:
                    e[0], e[1], e[2] = key, fold, 1
                nxt.move_to_end(ctx)
            while len(nxt) > MAX_KEYS:
                nxt.popitem(last=False)
        self._run = self._run + 1 if key == last else 1
        self._last = key

    def deviate(self, fold: Fold) -> None:
        """Join the predicted all-reduce ``fold`` with NaN. The caller then runs the handshake describing
        its own call and, once it completed, records it (which replaces the mispredicted successor)."""
        self.deviated += 1
        fold.join(torch.full((fold.numel,), float("nan"), dtype=fold.dtype, device=fold.device))

    def note(self, key: Hashable, value: Any) -> None:
        """Remember ``value`` of a call that completed on every worker, under ``key`` (a transport's own: e.g. the
        call's shape and identity, :meth:`call_key`), for the next call of that key to read (:meth:`noted`).
        ``value`` must be the same on every worker (a function of the call's result, which every worker shares),
        so that every worker's record stays the same; the oldest of more than :data:`MAX_KEYS` notes is forgotten
        first, alike on every worker, and :meth:`reset` forgets them all."""
        notes = self._notes
        notes[key] = value
        notes.move_to_end(key)
        while len(notes) > MAX_KEYS:
            notes.popitem(last=False)

    def noted(self, key: Hashable, default: Any = None) -> Any:
        """What :meth:`note` remembered under ``key``, or ``default``."""
        return self._notes.get(key, default)

    def reset(self) -> None:
        """Forget everything (after an error raised on every worker): the calls and the notes."""
        self._last, self._run = None, 0
        self._step = None
        self._next.clear()
        self._notes.clear()


def schedule(fabric) -> Schedule | None:
    """The fabric's :class:`Schedule`; None where calls cannot fold (no ``native_group``, one worker)."""
    if fabric.native_group is None or fabric.world_size <= 1 or not fabric.is_worker:
        return None
    s = fabric.scratch.get(_SCRATCH)
    if s is None:
        s = fabric.scratch[_SCRATCH] = Schedule()
    return s


def enter(fabric, transport: str, what: str, **fields) -> Schedule | None:
    """Begin a call that does not fold (every transport's but ``native``'s all-reduce): if a call is
    predicted, deviate from it and run a handshake naming ``transport`` with ``fields`` (it meets the
    handshakes of the workers that took the fast path, or of the other deviators; fields named as the
    predicted call's make the error name the one that differs). Returns the schedule to :func:`leave`
    (``record``) or ``reset`` with."""
    s = schedule(fabric)
    if s is not None:
        fold = s.predicted()
        if fold is not None:
            from ._handshake import check_agreement

            s.deviate(fold)
            try:
                check_agreement(fabric, what, transport=transport, **fields)
            except BaseException:
                s.reset()
                raise
    return s


def leave(s: Schedule | None, transport: str) -> None:
    """End a call begun with :func:`enter`: record it (its key is the transport's name)."""
    if s is not None:
        s.record(("call", transport) + s.call_key())
