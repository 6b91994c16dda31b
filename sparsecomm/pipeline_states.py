"""The pipeline's per-worker state, which checkpoints carry: one
:class:`~sparsecomm.methods.base.MethodState` per key (a bucket, or ``("param", name)``), the layout
of named parameter segments behind each key (so a state is reassembled exactly after a bucket
rebuild, :meth:`PipelineStates.bind`), and the generators (a mixin of
:class:`~sparsecomm.pipeline.CommPipeline`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Hashable

import torch

from .errors import MismatchError
from .methods.base import MethodState, states_from_dict, states_to_dict


class PipelineStates:
    """The state half of :class:`~sparsecomm.pipeline.CommPipeline`."""

    def _state_of(self, key: Hashable) -> MethodState:
        """The state of ``key``; a new one counts the steps begun before this one as its rounds
        (:attr:`MethodState.rounds` counts the frontend's steps, so that a schedule in rounds, such as
        ``warmup_steps`` or PowerSGD's ``start_powerSGD_iter``, means the same steps under the optimizer,
        whose first step is a round of the method, and under the DDP hook, whose first is not)."""
        ms = self.states.get(key)
        if ms is None:
            ms = self.states[key] = self.method.init()
            ms.rounds = max(0, self.step - 1)
        return ms

    def keys(self) -> list[Hashable]:
        """The keys (buckets, or ``("param", name)`` per parameter) that hold a method state."""
        return [k for k, ms in self.states.items() if ms.state is not None]

    def state(self, key: Hashable) -> Any:
        """The method's typed state for ``key`` (``None`` before its first round)."""
        ms = self.states.get(key)
        return None if ms is None else ms.state

    def reset_states(self) -> None:
        """Forget every method state (a new layout, a world-size change)."""
        self.states = {}
        self._segments, self._owner = {}, {}

    def bind(self, key: Hashable, segments: tuple[tuple[str, int], ...]) -> None:
        """Declare that bucket ``key`` holds the named parameter segments ``(name, numel)`` in this
        order, before its round. When the method's state for ``key`` is missing or stale (its
        segments now live in other keys' states, after a bucket rebuild or a restore onto another
        layout), it is reassembled exactly, segment by segment, from the keys that hold them; a
        method state that is not per coordinate cannot be split and raises
        :class:`~sparsecomm.errors.MismatchError`, as does a bucket only partly covered by states."""
        segments = tuple((str(n), int(k)) for n, k in segments)
        st = {k: ms.state for k, ms in self.states.items() if ms.state is not None}
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
            if owned:
                st[key] = self._assemble(segments)
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
            rounds = max((ms.rounds for ms in self.states.values()), default=0)
            new: dict[Hashable, MethodState] = {}
            for k, v in st.items():
                ms = self.states.get(k)
                new[k] = ms if ms is not None and ms.state is v else MethodState(state=v, rounds=rounds)
            self.states = new

    def _assemble(self, segments: tuple[tuple[str, int], ...]) -> Any:
        st = {k: ms.state for k, ms in self.states.items() if ms.state is not None}
        pieces: dict[str, list[torch.Tensor]] = {}
        cls = None
        for name, numel in segments:
            k = self._owner[name]
            src = st[k]
            cls = type(src)
            layout = self._segments[k]
            off = 0
            for n2, k2 in layout:
                if n2 == name:
                    break
                off += k2
            total = sum(k2 for _, k2 in layout)
            if dict(layout)[name] != numel:
                raise MismatchError(f"parameter {name!r} has {numel} elements but {dict(layout)[name]} in "
                                    f"the saved method state")
            for f in fields(src):
                v = getattr(src, f.name)
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() != total:
                    raise MismatchError(
                        f"method {self.method.name!r}: its state field {f.name!r} is not one value per "
                        f"coordinate, so it cannot be remapped onto another bucket layout; restore onto "
                        f"the same layout (DDP rebuilds its buckets after the first iteration)")
                pieces.setdefault(f.name, []).append(v[off:off + numel])
        return cls(**{n: torch.cat(v) for n, v in pieces.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"method": states_to_dict(self.method, self.states),
                "segments": dict(self._segments), "owner": dict(self._owner),
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
