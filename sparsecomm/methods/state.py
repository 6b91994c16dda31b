"""The explicit state of a method (:class:`MethodState`) and its checkpoint form (the leaf of the
methods package: :mod:`.base` and the wrappers build on it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Hashable

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


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _state_numel(st: Any) -> int | None:
    if is_dataclass(st):
        for f in fields(st):
            v = getattr(st, f.name)
            if isinstance(v, torch.Tensor):
                return v.numel()
    return None
