"""What an OmniReduce role waits for: the :class:`Phase` of the protocol and the :class:`Stage` of a wait,
which the endpoint's scheduler (:func:`sparsecomm.fabric.roles.drive`, run by ``Fabric.drive``) orders the roles
by and reads :attr:`Stage.sure` and :attr:`Stage.reaps` of. The phases, the rules that use them and why together
they cannot deadlock: ``docs/omnireduce-scheduler.md``.
"""

from __future__ import annotations

from enum import IntEnum
from functools import partial
from typing import NamedTuple

from ...errors import InvalidValueError

__all__ = ["Phase", "Stage"]


class Phase(IntEnum):
    """What a role waits for; the scheduler prefers an earlier phase (``docs/omnireduce-scheduler.md``,
    rule R2). The first five are an aggregator's admission of a call, one role, in the order it meets
    them; round-0 data (every worker sends it before its first wait) are :data:`FIRSTS`, :data:`DRAIN`
    and round 0 of :data:`AGGREGATE`."""

    HEADERS = 0     #: aggregator: the workers' round-0 headers
    FIRSTS = 1      #: aggregator: a worker's first look-aheads
    MANIFESTS = 2   #: aggregator, after a verdict that is not OK: the workers' manifests
    DRAIN = 3       #: aggregator, after a verdict that is not OK: a round-0 message a manifest lists
    GO = 4          #: colocated aggregator: its host has taken the verdict (a hand-over)
    VERDICT = 5     #: worker: an aggregator's verdict
    AGGREGATE = 6   #: aggregator: a lane round's blocks from their holders
    LAND = 7        #: worker: a lane round's sums


class _Fields(NamedTuple):
    phase: Phase
    round: int
    slot: int
    visit: int
    sure: bool
    reaps: bool


class Stage(_Fields):
    """What a wait is for: its :class:`Phase` and, in a lane, the round, the channel's slot and the
    aggregator's place in the worker's visit order. Stages compare as tuples (phase, round, slot,
    visit; the two flags below follow from those): the scheduler resumes the smallest of the roles able
    to run (a :class:`sparsecomm.fabric.roles.Stage`). ``Stage(phase, round=0, slot=0, visit=0)``.

    ``sure``: does it wait for round-0 data (sent by every worker before its first wait: :data:`Phase.FIRSTS`,
    :data:`Phase.DRAIN`, round 0 of :data:`Phase.AGGREGATE`)? ``reaps``: is it a lane round's wait (before
    which this endpoint's sends may be reaped: :data:`Phase.AGGREGATE`, :data:`Phase.LAND`)? Both are fields,
    set at construction: the scheduler reads them per wait without a call."""

    __slots__ = ()

    def __new__(cls, phase: Phase, round: int = 0, slot: int = 0, visit: int = 0) -> "Stage":
        sure = phase == _FIRSTS or phase == _DRAIN or (phase == _AGGREGATE and round == 0)
        return tuple.__new__(cls, (phase, round, slot, visit, sure, phase >= _AGGREGATE))

    def __repr__(self) -> str:
        return f"Stage({self.phase!r}, round={self.round}, slot={self.slot}, visit={self.visit})"

    def _replace(self, **kw) -> "Stage":
        """A stage with some of ``phase``, ``round``, ``slot``, ``visit`` replaced, its flags derived again (a
        named tuple's own ``_replace`` would copy them)."""
        names = ("phase", "round", "slot", "visit")
        if not set(kw) <= set(names):
            raise InvalidValueError(f"Stage._replace: only {', '.join(names)} can be replaced, got {sorted(kw)}")
        return Stage(*(kw.get(f, v) for f, v in zip(names, self)))


_FIRSTS, _DRAIN, _AGGREGATE = int(Phase.FIRSTS), int(Phase.DRAIN), int(Phase.AGGREGATE)

#: ``Stage.new((phase, round, slot, visit, sure, reaps))``: the stage of those fields, its flags given as
#: :class:`Stage` derives them (``tuple.__new__`` bound to the class: one C call, for the stages a role builds per
#: message; ``Stage(phase, ...)`` is a Python call and a C call)
Stage.new = partial(tuple.__new__, Stage)
