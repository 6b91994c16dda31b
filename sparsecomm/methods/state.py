"""The explicit state of a method (:class:`MethodState`), its checkpoint form and its remapping onto
another bucket layout (the leaf of the methods package: it imports none of its modules; a method is
anything with the traits of :class:`MethodTraits`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Hashable, Protocol, Sequence

import torch

from ..errors import MismatchError, SparseCommError


class MethodTraits(Protocol):
    """What the functions of this module read of a method: its name, its typed-state class and how that
    state splits per tensor (:meth:`sparsecomm.methods.base.Method.state_sizes`)."""

    name: str
    State: type | None

    def state_sizes(self, shapes: tuple[torch.Size, ...]) -> dict[str, list[int]]: ...


@dataclass
class MethodState:
    """Everything the rounds of one flat bucket need, explicit and typed (optax style): the method's
    own state dataclass (``state``: EF's error, DIANA's shifts; built by ``Method.init(d, dtype,
    device)``, ``None`` for a stateless method), the rounds encoded so far, and the round in flight:
    what ``encode`` decided for ``decode`` and ``next_round`` (``pending``: an exact round, DIANA's
    step, PowerSGD's factors), the bucket's length and shapes, and the method's constants for that
    length. A checkpoint is the ``state`` fields and ``rounds``; the round in flight and the constants
    are never saved (checkpoints are taken between steps).

    The caller owns it: ``encode``/``next_round``/``decode`` take it and return it updated (its buffers
    are reused: no fresh allocation per round), and the caller keeps the returned one.

    Args:
        state: the method's typed state (``None`` for a stateless method).
        rounds: rounds encoded so far.
        started: whether a round was encoded with this state.
        pending: what ``encode`` left for ``decode``.
        length: the bucket's length.
        shapes: the bucket's tensor shapes (for methods that read them).
        last_round: whether ``next_round`` said the step's rounds are over.
        constants: what the method derives once per length (never saved).
        scratch: buffers reused from step to step (never saved).
    """

    state: Any = None
    #: rounds encoded so far, counting the caller's steps before the state's first round (the pipeline
    #: starts a state at the number of steps it began before that round); saved in checkpoints:
    #: :class:`~sparsecomm.methods.warmup.Warmup` and PowerSGD's ``start_powerSGD_iter`` read it
    rounds: int = 0
    #: whether a round was encoded with this state (a method's ``init`` rule reads it: DIANA's and EF21's
    #: ``init="grad"`` send the first round exact); a checkpoint holds the typed state of started ones
    started: bool = False
    pending: Any = None
    length: int | None = None
    shapes: tuple | None = None
    last_round: bool = False
    #: what the method derives once from its hyper-parameters and the bucket's length (DIANA's
    #: alpha(d)), set at the first round that needs it; never saved (rebuilt after a restore)
    constants: Any = None
    #: buffers the method reuses from step to step instead of allocating them in every round (PowerSGD's
    #: aligned residual matrices); their contents never outlive a step, so a copy of the state may share
    #: them and they are never saved
    scratch: Any = None

    @property
    def held(self) -> bool:
        """Whether this state carries a typed state a checkpoint saves (a started stateful method's)."""
        return self.started and self.state is not None

    def take_pending(self, method: str = "") -> Any:
        """What ``encode`` left for the round (consumed: a second decode raises).

        Args:
            method: the method's name, for the error.
        """
        if self.pending is None:
            raise SparseCommError(f"method {method!r}: decode without a preceding encode")
        p, self.pending = self.pending, None
        return p

    def shapes_of(self, d: int) -> tuple[torch.Size, ...]:
        """The shapes given for this bucket (``(d,)`` as one flat tensor when none were given)."""
        return self.shapes or (torch.Size([d]),)


#: the key of a state's round count in a checkpoint's bucket entry
ROUNDS = "__rounds__"


def states_to_dict(method: MethodTraits, states: dict[Hashable, MethodState]) -> dict[str, Any]:
    """A checkpoint of ``states`` (key -> :class:`MethodState`) of ``method``: the typed states' fields
    (tensors cloned) of the started states, and every state's round count."""
    buckets = {}
    for key, ms in states.items():
        if ms.held or ms.rounds:
            st = ms.state if ms.held else None
            buckets[key] = {} if st is None else {f.name: clone(getattr(st, f.name)) for f in fields(st)}
            if ms.rounds:
                buckets[key][ROUNDS] = ms.rounds
    return {"method": method.name, "buckets": buckets}


def states_from_dict(method: MethodTraits, state: dict[str, Any]) -> dict[Hashable, MethodState]:
    """The states :func:`states_to_dict` saved (``{}``: none), checked against ``method``. A state saved
    with typed fields is started; one saved with its round count only has its typed state built at its
    next round (``Method.encode``)."""
    if not state:
        return {}
    if state.get("method", method.name) != method.name:
        raise MismatchError(f"state of method {state.get('method')!r} cannot be loaded into "
                            f"method {method.name!r}")
    buckets = state.get("buckets", {})
    out = {}
    for key, fields_ in buckets.items():
        typed = {k: clone(v) for k, v in fields_.items() if k != ROUNDS}
        if typed and method.State is None:
            raise MismatchError(f"method {method.name!r} is stateless but the state has fields {sorted(typed)}")
        out[key] = MethodState(state=method.State(**typed) if typed else None,
                               rounds=int(fields_.get(ROUNDS, 0)), started=bool(typed))
    return out


def split_state(method: MethodTraits, state: Any, shapes: Sequence[torch.Size]) -> list[Any]:
    """``state`` (the typed state of a bucket holding tensors of ``shapes``) as one state per tensor,
    cut where :meth:`Method.state_sizes <sparsecomm.methods.base.Method.state_sizes>` says (per
    coordinate by default): tensor fields sliced (views), ``None`` fields ``None`` in every piece, other
    fields (counts) copied into every piece. A tensor field whose length is not the sum of its sizes
    raises :class:`~sparsecomm.errors.MismatchError`."""
    sizes = _sizes(method, shapes)
    per: dict[str, list[Any]] = {}
    for f in fields(state):
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor):
            cut = sizes.get(f.name, sizes[None])
            if v.dim() != 1 or v.numel() != sum(cut):
                raise MismatchError(
                    f"method {method.name!r}: its state field {f.name!r} has shape {tuple(v.shape)}, not the "
                    f"{sum(cut)} values its tensors {[tuple(s) for s in shapes]} account for, so it cannot be "
                    f"remapped onto another bucket layout (a checkpoint of another model?)")
            per[f.name] = list(torch.split(v, cut))
        else:
            per[f.name] = [v] * len(sizes[None])
    return [type(state)(**{k: vals[i] for k, vals in per.items()}) for i in range(len(sizes[None]))]


def join_state(method: MethodTraits, pieces: Sequence[Any], shapes: Sequence[torch.Size]) -> Any:
    """The state of a bucket holding tensors of ``shapes`` from one piece per tensor
    (:func:`split_state`'s pieces, possibly from several buckets): tensor fields concatenated; a field
    that is ``None`` in a piece whose tensor has values in it is ``None`` in the result (the method
    starts it afresh: PowerSGD draws new Qs); other fields must agree."""
    sizes = _sizes(method, shapes)
    if len(pieces) != len(sizes[None]) or not pieces:
        raise MismatchError(f"method {method.name!r}: {len(pieces)} state pieces for {len(shapes)} tensors")
    cls = type(pieces[0])
    out: dict[str, Any] = {}
    for f in fields(cls):
        vals = [getattr(p, f.name) for p in pieces]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        want = sizes.get(f.name, sizes[None])
        if tensors:
            if any(v is None and k for v, k in zip(vals, want)):
                out[f.name] = None
            else:
                out[f.name] = torch.cat([tensors[0].new_empty(0) if v is None else v for v in vals])
        elif any(v != vals[0] for v in vals):
            raise MismatchError(f"method {method.name!r}: the pieces of the state disagree on {f.name!r} "
                                f"({sorted(set(map(repr, vals)))}): they are not states of the same run")
        else:
            out[f.name] = vals[0]
    return cls(**out)


def _sizes(method: MethodTraits, shapes: Sequence[torch.Size]) -> dict[str | None, list[int]]:
    """:meth:`Method.state_sizes`, plus the per-coordinate sizes under the key ``None``."""
    shapes = tuple(torch.Size(s) for s in shapes)
    return {**method.state_sizes(shapes), None: [int(s.numel()) for s in shapes]}


def clone(v: Any) -> Any:
    """``v`` detached and copied if it is a tensor, else ``v`` (a checkpoint never aliases a state)."""
    return v.detach().clone() if isinstance(v, torch.Tensor) else v
