"""The pipeline's per-worker state, which checkpoints carry: one
:class:`~sparsecomm.methods.base.MethodState` per key (a bucket, or ``("param", name)``), the layout
of named parameter segments behind each key (so a state is reassembled exactly after a bucket
rebuild, :meth:`PipelineStates.bind`), and the generators (a mixin of
:class:`~sparsecomm.pipeline.CommPipeline`)."""

from __future__ import annotations

import math
from typing import Any, Hashable, Sequence

import torch

from .errors import MismatchError
from .methods.state import MethodState, join_state, split_state, states_from_dict, states_to_dict


class PipelineStates:
    """The state half of :class:`~sparsecomm.pipeline.CommPipeline`."""

    def _state_of(self, key: Hashable, like: torch.Tensor) -> MethodState:
        """The state of ``key``; a new one counts the steps begun before this one as its rounds
        (:attr:`MethodState.rounds` counts the frontend's steps, so that a schedule in rounds, such as
        ``warmup_steps`` or PowerSGD's ``start_powerSGD_iter``, means the same steps under the optimizer,
        whose first step is a round of the method, and under the DDP hook, whose first is not)."""
        ms = self.states.get(key)
        if ms is None:
            ms = self.states[key] = self.method.init(like.numel(), like.dtype, like.device)
            ms.rounds = max(0, self.step - 1)
        return ms

    def keys(self) -> list[Hashable]:
        """The keys (buckets, or ``("param", name)`` per parameter) that hold a method state."""
        return [k for k, ms in self.states.items() if ms.held]

    def state(self, key: Hashable) -> Any:
        """The method's typed state for ``key`` (``None`` before its first round)."""
        ms = self.states.get(key)
        return None if ms is None else ms.state

    def reset_states(self) -> None:
        """Forget every method state (a new layout, a world-size change)."""
        self.states = {}
        self._segments, self._owner, self._shapes = {}, {}, {}

    def bind(self, key: Hashable, segments: tuple[tuple[str, int], ...],
             shapes: Sequence[Sequence[int]] | None = None) -> None:
        """Declare that bucket ``key`` holds the named parameter segments ``(name, numel)`` in this
        order, before its round (``shapes``: those parameters' shapes, for a method whose state is not
        all per coordinate, :meth:`~sparsecomm.methods.base.Method.state_sizes`; flat by default). When
        the method's state for ``key`` is missing or stale (its segments now live in other keys' states,
        after a bucket rebuild or a restore onto another layout), it is reassembled exactly, parameter
        by parameter, from the keys that hold them (:func:`~sparsecomm.methods.state.split_state`,
        :func:`~sparsecomm.methods.state.join_state`); a bucket only partly covered by states raises
        :class:`~sparsecomm.errors.MismatchError`."""
        segments = tuple((str(n), int(k)) for n, k in segments)
        for (name, numel), shape in zip(segments, shapes if shapes is not None else [None] * len(segments)):
            shape = (numel,) if shape is None else tuple(int(x) for x in shape)
            if math.prod(shape) != numel:
                raise MismatchError(f"parameter {name!r}: shape {shape} for {numel} elements")
            self._shapes[name] = shape
        st = {k: ms.state for k, ms in self.states.items() if ms.held}
        names = [n for n, _ in segments]
        current = key in st and self._segments.get(key) == segments and \
            all(self._owner.get(n) == key for n in names)
        if not current:
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
                rounds[key] = max(self.states[k].rounds for k in sources)
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
                ms = self.states.get(k)
                new[k] = ms if ms is not None and ms.state is v else MethodState(state=v, rounds=rounds[k], started=True)
            self.states = new

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
        return {"method": states_to_dict(self.method, self.states),
                "segments": dict(self._segments), "owner": dict(self._owner),
                "shapes": {n: list(s) for n, s in self._shapes.items()},
                "generators": {str(d): g.get_state() for d, g in self._generators.items()},
                "param_generators": {(nm, str(d)): g.get_state() for (nm, d), g in self._param_generators.items()},
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "shared_randomness": self.shared_randomness, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a stateless method with shared (or no) randomness has nothing rank-specific
        rank_free = self.method.State is None and (self.shared_randomness or not (
            state.get("generators") or state.get("param_generators")))
        if state.get("world_size") != self.world_size or (state.get("rank") != self.rank and not rank_free):
            raise MismatchError(
                f"sparsecomm state saved on rank {state.get('rank')} of {state.get('world_size')} "
                f"cannot be loaded on rank {self.rank} of {self.world_size} (the method state is per "
                f"worker); delete the 'sparsecomm' entry to load only the inner optimizer's state")
        self.states = states_from_dict(self.method, state["method"])
        self.step = int(state.get("step", 0))
        self._segments = dict(state.get("segments", {}))
        self._owner = dict(state.get("owner", {}))
        self._shapes = {n: tuple(int(x) for x in s) for n, s in state.get("shapes", {}).items()}
        self._generators = {}
        for d, s in state.get("generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._generators[torch.device(d)] = g
        self._param_generators = {}
        for (nm, d), s in state.get("param_generators", {}).items():
            g = torch.Generator(device=torch.device(d))
            g.set_state(s)
            self._param_generators[(nm, torch.device(d))] = g
