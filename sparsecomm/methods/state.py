"""The explicit state of a method (:class:`MethodState`) and its checkpoint form (the leaf of the
methods package: :mod:`.base` and the wrappers build on it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from ..errors import MismatchError, SparseCommError

if TYPE_CHECKING:
    from .base import Method


@dataclass
class MethodState:
    """Everything the rounds of one flat bucket need, explicit and typed (optax style): the method's
    own state dataclass (``state``: EF's error, DIANA's shifts; ``None`` before the first round and for
    stateless methods) plus the round in flight: what ``encode`` decided for ``decode`` and
    ``next_round`` (``pending``: an exact round, DIANA's step, PowerSGD's factors), the bucket's length
    and shapes. A checkpoint is the ``state`` fields; the round in flight is never saved (checkpoints
    are taken between steps)."""

    state: Any = None
    pending: Any = None
    length: int | None = None
    shapes: tuple | None = None
    last_round: bool = False
    #: rounds encoded so far, counting the caller's steps before the state's first round (the pipeline
    #: starts a state created at step ``s`` at ``s``); saved in checkpoints: :class:`Warmup` and
    #: PowerSGD's ``start_powerSGD_iter`` read it
    rounds: int = 0

    def take_pending(self, method: str = "") -> Any:
        """What ``encode`` left for the round (consumed: a second decode raises)."""
        if self.pending is None:
            raise SparseCommError(f"method {method!r}: decode without a preceding encode")
        p, self.pending = self.pending, None
        return p

    def shapes_of(self, d: int) -> tuple[torch.Size, ...]:
        """The shapes given for this bucket (``(d,)`` as one flat tensor when none were given)."""
        return self.shapes or (torch.Size([d]),)


#: the key of a state's round count in a checkpoint's bucket entry
ROUNDS = "__rounds__"


def states_to_dict(method: Method, states: dict[Hashable, MethodState]) -> dict[str, Any]:
    """A checkpoint of ``states`` (key -> :class:`MethodState`) of ``method``: the typed states' fields,
    tensors cloned, plus the compressor's own generators (see :meth:`Method.state_dict`)."""
    buckets = {}
    for key, ms in states.items():
        st = ms.state
        if st is not None or ms.rounds:
            buckets[key] = {} if st is None else {f.name: _clone(getattr(st, f.name)) for f in fields(st)}
            if ms.rounds:
                buckets[key][ROUNDS] = ms.rounds
    out = {"method": method.name, "buckets": buckets}
    gens = method.compressor.generator_state() if hasattr(method.compressor, "generator_state") else {}
    if gens:
        out["compressor_generators"] = gens
    return out


def states_from_dict(method: Method, state: dict[str, Any]) -> dict[Hashable, MethodState]:
    """The states :func:`states_to_dict` saved (``{}``: none), checked against ``method``."""
    if not state:
        return {}
    if state.get("method", method.name) != method.name:
        raise MismatchError(f"state of method {state.get('method')!r} cannot be loaded into "
                            f"method {method.name!r}")
    buckets = state.get("buckets", {})
    out = {}
    for key, fields_ in buckets.items():
        typed = {k: _clone(v) for k, v in fields_.items() if k != ROUNDS}
        if typed and method.State is None:
            raise MismatchError(f"method {method.name!r} is stateless but the state has fields {sorted(typed)}")
        out[key] = MethodState(state=method.State(**typed) if typed else None, rounds=int(fields_.get(ROUNDS, 0)))
    if hasattr(method.compressor, "load_generator_state"):  # absent: not used yet, restart from its seed
        method.compressor.load_generator_state(state.get("compressor_generators", {}))
    return out


def split_state(method: Method, state: Any, shapes: Sequence[torch.Size]) -> list[Any]:
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


def join_state(method: Method, pieces: Sequence[Any], shapes: Sequence[torch.Size]) -> Any:
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


def _sizes(method: Method, shapes: Sequence[torch.Size]) -> dict[str | None, list[int]]:
    """:meth:`Method.state_sizes`, plus the per-coordinate sizes under the key ``None``."""
    shapes = tuple(torch.Size(s) for s in shapes)
    return {**method.state_sizes(shapes), None: [int(s.numel()) for s in shapes]}


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _state_numel(st: Any) -> int | None:
    if is_dataclass(st):
        for f in fields(st):
            v = getattr(st, f.name)
            if isinstance(v, torch.Tensor):
                return v.numel()
    return None
