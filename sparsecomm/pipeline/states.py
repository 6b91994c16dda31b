"""The per-worker state of a pipeline, which checkpoints carry.

:class:`StateStore`: one :class:`~sparsecomm.methods.state.MethodState` per key (a bucket, or
``("param", name)`` for parameter-wise rounds) and the layout of the named parameter segments behind
each key, so that a state is reassembled exactly after a bucket rebuild (:meth:`StateStore.bind`).

:class:`Generators`: the compressor's generators, the only randomness the rounds draw (a compressor
holds none): one per device for bucket-wide rounds, seeded ``seed`` on every worker when the method's
compressor shares its randomness (shared-seed rand-k draws the same coordinates everywhere) and
``seed + rank`` otherwise; and one per parameter and device for parameter-wise rounds, seeded from
``seed``, the parameter's name (and the rank, unless shared) so that its draws depend neither on the
other parameters nor on the bucket layout.

**Transactions** (``nonfinite="skip"``, :mod:`sparsecomm.pipeline.nonfinite`): between ``begin()`` and
``commit()`` / ``rollback()`` both journal what a step changes: :class:`StateStore` copies each state before
the step's first use of it (and keeps the layout it had), :class:`Generators` the state of each generator
before its first draw; ``rollback()`` puts everything back as it was before the step (the states and
generators the step created are forgotten), ``commit()`` keeps the step's. The copies go into buffers kept
from the previous step, so a steady run allocates nothing per step.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import fields, replace
from typing import Any, Hashable, Sequence

import torch

from ..errors import MismatchError
from ..methods.base import Method
from ..methods.state import MethodState, join_state, split_state, states_from_dict, states_to_dict


class StateStore:
    """The states of ``method`` by key (:attr:`by_key`), created at a key's first round."""

    def __init__(self, method: Method) -> None:
        self.method = method
        #: key -> :class:`~sparsecomm.methods.state.MethodState` (the method object holds none)
        self.by_key: dict[Hashable, MethodState] = {}
        # the (name, numel) segments of each parameter-keyed state, the key holding the current state of
        # each named segment, and each named segment's shape (bind)
        self._segments: dict[Hashable, tuple[tuple[str, int], ...]] = {}
        self._owner: dict[str, Hashable] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        # the journal of the step in progress (begin): key -> (the state the step found, its copy) or None
        # for a state the step created, the states and the layout before the step; None: not journaling
        self._undo: dict[Hashable, tuple[MethodState, MethodState] | None] | None = None
        self._before: tuple[dict, dict, dict, dict] | None = None
        # states no longer live, whose buffers the next copies reuse
        self._spare: dict[Hashable, MethodState] = {}
        # the layout's version (bumped wherever the segments, their owners or the states are replaced other than by
        # get()) and, per key, the bind() found current: (its segments and shapes arguments, the state, the version)
        self._version = 0
        self._current: dict[Hashable, tuple[Any, Any, MethodState, int]] = {}

    # ------------------------------------------------------------------ transactions
    def begin(self) -> None:
        """Journal the step that begins (see the module doc); an open journal is committed first."""
        self.commit()
        self._undo = {}
        self._before = (dict(self.by_key), dict(self._segments), dict(self._owner), dict(self._shapes))

    def commit(self) -> None:
        """Keep what the step changed and close the journal (nothing when none is open)."""
        if self._undo is None:
            return
        for key, entry in self._undo.items():
            if entry is not None:
                self._spare[key] = entry[1]
        self._undo, self._before = None, None

    def rollback(self) -> None:
        """Put every state and the layout back as they were at :meth:`begin` and close the journal."""
        if self._undo is None or self._before is None:
            return
        by_key, self._segments, self._owner, self._shapes = self._before
        self._version += 1
        for key, entry in self._undo.items():
            ms = self.by_key.get(key)
            if entry is not None and by_key.get(key) is entry[0]:
                by_key[key] = entry[1]
            if ms is not None and ms is not by_key.get(key):
                self._spare[key] = ms
        self.by_key = by_key
        self._undo, self._before = None, None

    def _journal(self, key: Hashable, ms: MethodState | None) -> None:
        """Before the step's first use of ``key``'s state ``ms`` (None: a state the step creates)."""
        if self._undo is not None and key not in self._undo:
            self._undo[key] = None if ms is None else (ms, copy_state(ms, self._spare.pop(key, None)))

    def get(self, key: Hashable, like: torch.Tensor, steps_before: int) -> MethodState:
        """The state of ``key``, for a round on ``like`` (a new one: ``method.init`` of its length, dtype
        and device). A new state counts the ``steps_before`` its first round as rounds
        (:attr:`MethodState.rounds` counts the frontend's steps, so that a schedule in rounds, such as
        ``warmup_steps`` or PowerSGD's ``start_powerSGD_iter``, means the same steps under the optimizer,
        whose first step is a round of the method, and under the DDP hook, whose first is not)."""
        ms = self.by_key.get(key)
        if self._undo is not None:          # (journaling: a step under nonfinite="skip")
            self._journal(key, ms)
        if ms is None:
            ms = self.by_key[key] = self.method.init(like.numel(), like.dtype, like.device)
            ms.rounds = steps_before
        return ms

    def __getitem__(self, key: Hashable) -> MethodState:
        return self.by_key[key]

    def keys(self) -> list[Hashable]:
        """The keys (buckets, or ``("param", name)`` per parameter) that hold a method state."""
        return [k for k, ms in self.by_key.items() if ms.held]

    def state(self, key: Hashable) -> Any:
        """The method's typed state for ``key`` (``None`` before its first round)."""
        ms = self.by_key.get(key)
        return None if ms is None or not ms.held else ms.state

    def keyed_by_names(self) -> bool:
        """Whether some state is keyed by parameter names (a bound bucket, or a parameter-wise key)."""
        return bool(self._segments) or any(isinstance(k, tuple) and k[:1] == ("param",) for k in self.keys())

    def reset(self) -> None:
        """Forget every method state (a new layout, a world-size change); closes a journal (committed)."""
        self.commit()
        self.by_key = {}
        self._segments, self._owner, self._shapes = {}, {}, {}
        self._spare = {}
        self._version += 1

    def bind(self, key: Hashable, segments: tuple[tuple[str, int], ...],
             shapes: Sequence[Sequence[int]] | None = None) -> None:
        """Declare that bucket ``key`` holds the named parameter segments ``(name, numel)`` in this
        order, before its round (``shapes``: those parameters' shapes, for a method whose state is not
        all per coordinate, :meth:`~sparsecomm.methods.base.Method.state_sizes`; flat by default). When
        the method's state for ``key`` is missing or stale (its segments now live in other keys' states,
        after a bucket rebuild or a restore onto another layout), it is reassembled exactly, parameter
        by parameter, from the keys that hold them (:func:`~sparsecomm.methods.state.split_state`,
        :func:`~sparsecomm.methods.state.join_state`); a bucket only partly covered by states raises
        :class:`~sparsecomm.errors.MismatchError`. A bind of a key with the very same (immutable: tuple)
        ``segments`` and ``shapes`` objects as a bind that found it current, with nothing replaced since (the
        DDP hook's steady state), returns at once: it would change nothing."""
        seen = self._current.get(key)
        if seen is not None and seen[0] is segments and seen[1] is shapes and seen[3] == self._version and \
                self.by_key.get(key) is seen[2] and seen[2].state is not None:
            return
        given = (segments, shapes)
        segments = tuple((str(n), int(k)) for n, k in segments)
        for (name, numel), shape in zip(segments, shapes if shapes is not None else [None] * len(segments)):
            shape = (numel,) if shape is None else tuple(int(x) for x in shape)
            if math.prod(shape) != numel:
                raise MismatchError(f"parameter {name!r}: shape {shape} for {numel} elements")
            self._shapes[name] = shape
        st = {k: ms.state for k, ms in self.by_key.items() if ms.held}
        names = [n for n, _ in segments]
        current = key in st and self._segments.get(key) == segments and \
            all(self._owner.get(n) == key for n in names)
        if current and given[0].__class__ is tuple and (given[1] is None or given[1].__class__ is tuple):
            self._current[key] = (*given, self.by_key[key], self._version)
        if not current:
            self._version += 1
            owned = [n for n in names if n in self._owner and self._owner[n] in st]
            if owned and len(owned) != len(names):
                missing = sorted(set(names) - set(owned))
                raise MismatchError(f"cannot restore the method state of a bucket holding "
                                    f"{names}: no state for {missing} while the others have one "
                                    f"(a checkpoint of another model or parameter set)")
            rounds = {}
            if owned:
                # the rebuilt state continues its sources' round count (not that of a state already
                # advanced in this step)
                sources = {self._owner[n] for n in names}
                rounds[key] = max(self.by_key[k].rounds for k in sources)
                st[key] = self._assemble(segments, st)
            else:
                st.pop(key, None)    # a fresh bucket (or stale state of nothing current)
            self._segments[key] = segments
            for n in names:
                self._owner[n] = key
            # drop states none of whose segments they own any more
            live = set(self._owner.values())
            for k in [k for k in list(st) if k not in live and k in self._segments]:
                del st[k]
                self._segments.pop(k, None)
            new: dict[Hashable, MethodState] = {}
            for k, v in st.items():
                ms = self.by_key.get(k)
                new[k] = ms if ms is not None and ms.state is v else MethodState(state=v, rounds=rounds[k], started=True)
            self.by_key = new

    def _shapes_of(self, segments: tuple[tuple[str, int], ...]) -> list[tuple[int, ...]]:
        return [self._shapes.get(name, (numel,)) for name, numel in segments]

    def _assemble(self, segments: tuple[tuple[str, int], ...], st: dict[Hashable, Any]) -> Any:
        """The state of a bucket of ``segments`` from the pieces of the states (``st``) that hold them."""
        pieces: dict[Hashable, dict[str, Any]] = {}
        out = []
        for name, numel in segments:
            k = self._owner[name]
            layout = self._segments[k]
            if dict(layout)[name] != numel:
                raise MismatchError(f"parameter {name!r} has {numel} elements but {dict(layout)[name]} in "
                                    f"the saved method state")
            if k not in pieces:
                parts = split_state(self.method, st[k], self._shapes_of(layout))
                pieces[k] = {n: p for (n, _), p in zip(layout, parts)}
            out.append(pieces[k][name])
        return join_state(self.method, out, self._shapes_of(segments))

    def state_dict(self) -> dict[str, Any]:
        """The states (:func:`~sparsecomm.methods.state.states_to_dict`) and the parameter layout."""
        return {"method": states_to_dict(self.method, self.by_key),
                "segments": dict(self._segments), "owner": dict(self._owner),
                "shapes": {n: list(s) for n, s in self._shapes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a journal in progress is closed)."""
        self.commit()
        self._spare = {}
        self.by_key = states_from_dict(self.method, state["method"])
        self._segments = dict(state.get("segments", {}))
        self._owner = dict(state.get("owner", {}))
        self._shapes = {n: tuple(int(x) for x in s) for n, s in state.get("shapes", {}).items()}
        self._version += 1


class Generators:
    """This worker's compressor generators (see the module doc), created at first use."""

    def __init__(self, seed: int, rank: int, shared: bool) -> None:
        self.seed, self.rank, self.shared = int(seed), int(rank), bool(shared)
        self._bucket: dict[torch.device, torch.Generator] = {}
        self._param: dict[tuple[str, torch.device], torch.Generator] = {}
        # the journal of the step in progress (begin): generator -> its state before the step's first
        # draw, and the generators the step created; None: not journaling
        self._undo: dict[Hashable, torch.Tensor | None] | None = None
        self._created: list[Hashable] = []

    def begin(self) -> None:
        """Journal the step that begins (see the module doc); an open journal is committed first."""
        self._undo, self._created = {}, []

    def commit(self) -> None:
        """Keep the step's draws and close the journal."""
        self._undo, self._created = None, []

    def rollback(self) -> None:
        """Put every generator back as it was at :meth:`begin` (those the step created are forgotten, so
        they start afresh at their next use) and close the journal."""
        if self._undo is None:
            return
        for key in self._created:
            if isinstance(key, torch.device):
                self._bucket.pop(key, None)
            else:
                self._param.pop(key, None)
        for key, st in self._undo.items():
            g = self._bucket.get(key) if isinstance(key, torch.device) else self._param.get(key)
            if g is not None and st is not None:
                g.set_state(st)
        self.commit()

    def _journal(self, key: Hashable, g: torch.Generator | None) -> None:
        if self._undo is not None and key not in self._undo:
            if g is None:
                self._created.append(key)
                self._undo[key] = None      # (created: nothing to restore)
            else:
                self._undo[key] = g.get_state()

    def bucket(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of bucket-wide rounds on ``device``."""
        device = torch.device(device)
        g = self._bucket.get(device)
        if self._undo is not None:          # (journaling: a step under nonfinite="skip")
            self._journal(device, g)
        if g is None:
            g = self._bucket[device] = torch.Generator(device=device)
            g.manual_seed(self.seed if self.shared else self.seed + self.rank)
        return g

    def param(self, name: str, device: torch.device | str = "cpu") -> torch.Generator:
        """The generator of parameter ``name``'s rounds on ``device``."""
        device = torch.device(device)
        g = self._param.get((name, device))
        self._journal((name, device), g)
        if g is None:
            g = self._param[(name, device)] = torch.Generator(device=device)
            g.manual_seed(name_seed(self.seed, name, None if self.shared else self.rank))
        return g

    def state_dict(self) -> dict[str, Any]:
        return {"generators": {str(d): g.get_state() for d, g in self._bucket.items()},
                "param_generators": {(nm, str(d)): g.get_state() for (nm, d), g in self._param.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s generators exactly (those absent start afresh at first use); a
        journal in progress is closed."""
        self.commit()
        self._bucket = {torch.device(d): _restored(d, s) for d, s in state.get("generators", {}).items()}
        self._param = {(nm, torch.device(d)): _restored(d, s)
                       for (nm, d), s in state.get("param_generators", {}).items()}


def copy_state(ms: MethodState, spare: MethodState | None = None) -> MethodState:
    """A copy of ``ms`` that shares no tensor with it: its typed state's tensor fields copied into
    ``spare``'s (a state no longer live) where they fit, else cloned; every other field as it is (the
    round in flight, ``pending``, is not copied: a copy is taken between rounds)."""
    st = ms.state
    if st is not None:
        old = spare.state if spare is not None and type(spare.state) is type(st) else None
        vals = {}
        for f in fields(st):
            v = getattr(st, f.name)
            if isinstance(v, torch.Tensor):
                w = getattr(old, f.name, None)
                fits = isinstance(w, torch.Tensor) and w is not v and w.shape == v.shape and \
                    w.dtype == v.dtype and w.device == v.device
                vals[f.name] = w.copy_(v) if fits else v.detach().clone()
            else:
                vals[f.name] = v
        st = type(st)(**vals)
    return replace(ms, state=st, pending=None)


def _restored(device: str, st: torch.Tensor) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.set_state(st)
    return g


def name_seed(seed: int, name: str, rank: int | None) -> int:
    """A 63-bit seed from ``(seed, name[, rank])`` (blake2b: stable across processes and runs)."""
    msg = f"{int(seed)}\x00{name}\x00{'' if rank is None else int(rank)}".encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") & ((1 << 63) - 1)
