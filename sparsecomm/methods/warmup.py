"""``warmup``: a wrapper that makes the first rounds of every state exact (uncompressed)."""

from __future__ import annotations

from typing import Any

from .base import Method
from .state import MethodState
from ..errors import InvalidValueError


class Warmup(Method):
    """``inner`` whose first ``steps`` rounds of every state are *exact* (the identity in place of the
    compressor: uncompressed, warm-starting the state; see :mod:`sparsecomm.methods.base`). A wrapper,
    so it composes with any method and is written once (the optimizer's ``warmup_steps`` and the DDP
    hook's use it); the round count lives in the state (:attr:`MethodState.rounds`), so a checkpoint
    resumes it. Name, compressor, state and traits are ``inner``'s."""

    def __init__(self, inner: Method, steps: int) -> None:
        if int(steps) != steps or steps < 0:
            raise InvalidValueError(f"warmup: steps must be a non-negative integer, got {steps!r}")
        self.inner, self.steps = inner, int(steps)
        self.compressor = inner.compressor
        self.name, self.State = inner.name, inner.State
        self.needs_unbiased, self.uses_shapes, self.multi_round, self.checks_input = \
            inner.needs_unbiased, inner.uses_shapes, inner.multi_round, inner.checks_input

    def hyper(self) -> dict[str, Any]:
        return {"inner": self.inner, "steps": self.steps}

    def state_sizes(self, shapes):
        return self.inner.state_sizes(shapes)

    def init_state(self, d, dtype, device):
        return self.inner.init_state(d, dtype, device)

    def encode(self, grad, state: MethodState, generator=None, *, world_size=1, exact=False, inplace=False,
               shapes=None):
        return self.inner.encode(grad, state, generator, world_size=world_size,
                                 exact=exact or (isinstance(state, MethodState) and state.rounds < self.steps),
                                 inplace=inplace, shapes=shapes)

    def work(self, phase, state, d, *, exact=False, shapes=None):
        return self.inner.work(phase, state, d, shapes=shapes,
                               exact=exact or (phase == "encode" and state.rounds < self.steps))

    def next_round(self, aggregate, world_size, state):
        return self.inner.next_round(aggregate, world_size, state)

    def decode(self, aggregate, world_size, state, *, out=None):
        return self.inner.decode(aggregate, world_size, state, out=out)

    def _encode(self, grad, ms, generator, exact, world_size):  # pragma: no cover - encode delegates
        raise NotImplementedError

    def _decode(self, aggregate, world_size, ms, out):  # pragma: no cover - decode delegates
        raise NotImplementedError


def warmup(inner: Method, steps: int) -> Method:
    """``inner`` with its first ``steps`` rounds exact (:class:`Warmup`); ``steps=0`` returns ``inner``."""
    return inner if int(steps) == 0 else Warmup(inner, steps)
