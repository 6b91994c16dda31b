"""Test scaffolding: one worker running a method, with the worker's explicit states kept by bucket key
(what the pipeline's state store does for the optimizer), so that a test can call
``w.encode(grad, key, generator)`` and read ``w.state(key)``."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from sparsecomm.methods.base import Method
from sparsecomm.methods.state import MethodState, states_from_dict, states_to_dict


class Worker:
    """``method`` with this worker's states by key (built by ``method.init`` at a key's first round)."""

    def __init__(self, method: Method, world_size: int = 1) -> None:
        self.method, self.world_size = method, world_size
        self.states: dict[Hashable, MethodState] = {}

    def __getattr__(self, name: str) -> Any:          # the method's hyper-parameters and traits
        return getattr(self.method, name)

    def encode(self, grad: torch.Tensor, key: Hashable = 0, generator: torch.Generator | None = None, **kw):
        st = self.states.get(key)
        if st is None:
            st = self.method.init(grad.numel(), grad.dtype, grad.device)
        p, self.states[key] = self.method.encode(grad, st, generator, world_size=self.world_size, **kw)
        return p

    def next_round(self, aggregate: torch.Tensor, world_size: int, key: Hashable = 0):
        p, self.states[key] = self.method.next_round(aggregate, world_size, self.states[key])
        return p

    def decode(self, aggregate: torch.Tensor, world_size: int, key: Hashable = 0, *, out=None) -> torch.Tensor:
        est, self.states[key] = self.method.decode(aggregate, world_size, self.states[key], out=out)
        return est

    def state(self, key: Hashable = 0) -> Any:
        ms = self.states.get(key)
        return None if ms is None else ms.state

    def state_dict(self) -> dict[str, Any]:
        return states_to_dict(self.method, self.states)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.states = states_from_dict(self.method, sd)
