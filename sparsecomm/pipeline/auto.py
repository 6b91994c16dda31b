"""``transport="auto"``: the transport of every bucket chosen by a cost model, checked against the network
it runs on (:class:`Chooser`).

**Inputs.** For each bucket (its key and payload kind): its length, the payload's bytes, its *block
density* (the fraction of ``block_size``-element blocks holding a non-zero) on each worker and that of the
*sum* (the union of the workers' blocks), the number of workers ``n``, the services launched (a switch
program is a candidate only where its own program runs -- ``switch`` where the ``"switch"`` service does,
``sparse-switch`` where ``"sparse-switch"`` does: ``services=``, or the fabric's started services; the
``candidates=`` option restricts the catalog) and the
network's parameters measured on the fabric itself (:func:`sparsecomm.fabric.probe.link_parameters`:
latency ``alpha``, bandwidth ``B`` and the host's cost of a message).

**The decision.** Every candidate that can carry the bucket's payload kind (``can_carry``) and has a closed
form (:data:`sparsecomm.theory.costs.MODELS`) is predicted as

    T_t = a_t * C_t(n, bytes, d_w, d_u; alpha, B).time_s + c_t * C_t(...).messages

(``a_t = 1`` and ``c_t`` the probe's per-message cost until the model is refit, below) and the cheapest is
chosen. Step 1 runs on the default transport (the first of :data:`~sparsecomm.pipeline.resolve.AUTO_ORDER`
that carries the payload) and is not measured (its calls open connections and allocate). Then the
*exploration* (``explore=True``): every candidate carries every bucket for ``estimate_steps`` steps in
turn (the default transport first), so that each transport's model is checked against the machine (and refit) before anything is
chosen (``explore=False``: the default transport for ``estimate_steps`` steps). The first decision is
made at the start of the next step and the choice is revisited every ``period`` steps from the
``estimate_steps`` steps before: the tracked densities are exponential
averages (weight 1/2 per decision) and a bucket changes transport only if the new one is predicted
``margin`` (10 %) faster than the current one (hysteresis: a density that wavers does not flip the
choice). Each re-decision is logged (logger ``sparsecomm.pipeline.auto``, by worker 0) with its reason.

**Agreement.** Every worker must make the same choice, so every input is agreed before it is used: the
union density is read off the sum, which every worker receives alike; the per-worker densities, payload
bytes and measured times are averaged over the workers by one small all-reduce (on the default
transport) at each decision; the network's parameters are the probe's, which every worker receives alike.
Two workers whose own densities differ therefore choose the same transport.

**Learning.** At each decision the measured time of every (bucket, transport) of the window (the median
over the window's steps, averaged over the workers) is compared with its prediction; a prediction off by more than ``tolerance`` (25 %) is
logged as a warning (and counted in :attr:`Chooser.refits`); every transport measured in the window has its
``(a_t, c_t)`` refit by least squares (``a_t > 0``, ``c_t >= 0``) to all its buckets'
``(C.time_s, C.messages) -> measured`` of the window, so that the decision uses the machine's figures
(an error under the tolerance can still rank two transports wrongly).

**What a switch of transport keeps.** The method's states live in the pipeline's state store by bucket
key, its generators by worker: neither depends on the transport, so a bucket changing transport between
steps continues its method exactly. Each candidate transport is built once (on every worker at the same
decision) and keeps its own per-call state; calls are named by the pipeline's ``CallId`` whatever the
transport. The decision changes only between steps, so every round of a call (a method of several
rounds included) runs on one transport. Methods of several rounds keep the default transport.

:meth:`Chooser.table` is the decision table (per bucket: densities, predicted time of every candidate,
the chosen transport and its measured time), which ``compression_stats()["transport_decisions"]``
reports.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from ..codec.blocks import nonzero_blocks
from ..errors import InvalidTypeError, InvalidValueError
from ..fabric.probe import Link, link_parameters
from ..payload import Payload
from ..theory import costs
from ..transports.base import CallShape, Transport
from ..validate import check_int, check_real

log = logging.getLogger("sparsecomm.pipeline.auto")

#: the options of ``transport="auto"`` (its ``transport_kwargs``) and their defaults
OPTIONS: dict[str, Any] = {"estimate_steps": 2, "period": 50, "margin": 0.1, "tolerance": 0.25,
                           "explore": True, "services": None, "candidates": None, "block_size": 256}
#: transports that run on a switch program (a candidate only where the service of its name is launched)
SWITCH_TRANSPORTS = ("switch", "sparse-switch")


def options(kwargs: dict | None) -> dict[str, Any]:
    """The ``transport_kwargs`` of ``transport="auto"`` with defaults; an unknown name raises, listing
    the valid ones."""
    kw = dict(kwargs or {})
    bad = sorted(set(kw) - set(OPTIONS))
    if bad:
        raise InvalidTypeError(f"transport='auto' takes the options {', '.join(OPTIONS)} in transport_kwargs, "
                               f"not {', '.join(bad)} (to pass a transport's own options, name the transport)")
    out = {**OPTIONS, **kw}
    if out["candidates"] is not None:
        unknown = sorted(set(out["candidates"]) - set(costs.MODELS))
        if unknown or not out["candidates"]:
            raise InvalidValueError(f"transport='auto': candidates must name transports with a cost model "
                                    f"({', '.join(costs.MODELS)}), got {list(out['candidates'])!r}")
        out["candidates"] = tuple(out["candidates"])
    for k in ("estimate_steps", "period", "block_size"):
        out[k] = check_int(k, out[k], low=1, what="transport='auto' (transport_kwargs)")
    if out["period"] <= out["estimate_steps"]:
        raise InvalidValueError(f"transport='auto': period ({out['period']}) must exceed estimate_steps "
                                f"({out['estimate_steps']}), whose steps it measures")
    for k in ("margin", "tolerance"):
        out[k] = check_real(k, out[k], low=0.0, high=1.0, high_open=True, what="transport='auto' (transport_kwargs)")
    return out


def block_density(x: torch.Tensor | Payload, block: int) -> float:
    """The fraction of ``block``-element blocks of ``x`` (a flat tensor, or a payload: its indices, or its
    dense values) that hold a non-zero."""
    if isinstance(x, Payload):
        if x.indices is not None:
            nb = max(1, math.ceil(x.numel / block))
            return float(torch.unique(x.indices.reshape(-1) // block).numel()) / nb if x.indices.numel() else 0.0
        x = x.values
    if x.numel() == 0:
        return 0.0
    mask = nonzero_blocks(x, block)      # OmniReduce's own scan: the blocks it would send
    return int(mask.sum()) / mask.numel()


@dataclass
class Fit:
    """A transport's fitted model: ``measured = a * C.time_s + c * C.messages``."""

    a: float = 1.0
    c: float = 0.0

    def predict(self, cost: costs.Cost) -> float:
        return self.a * cost.time_s + self.c * cost.messages

    def refit(self, obs: list[tuple[float, float, float]]) -> None:
        """Least squares of ``y = a w + c m`` over ``(w, m, y)``, with ``a > 0`` and ``c >= 0``; with a
        single observation (or collinear ones) ``c`` stays and ``a`` absorbs the difference."""
        sww = sum(w * w for w, _, _ in obs)
        smm = sum(m * m for _, m, _ in obs)
        swm = sum(w * m for w, m, _ in obs)
        swy = sum(w * y for w, _, y in obs)
        smy = sum(m * y for _, m, y in obs)
        det = sww * smm - swm * swm
        if len(obs) >= 2 and det > 1e-12 * max(sww * smm, 1e-300):
            a = (swy * smm - smy * swm) / det
            c = (sww * smy - swm * swy) / det
            if a > 0 and c >= 0:
                self.a, self.c = a, c
                return
        # keep c (clipped at 0) and scale the rest
        c = max(0.0, self.c)
        rest = sum(w * (y - c * m) for w, m, y in obs)
        if sww > 0 and rest > 0:
            self.a, self.c = rest / sww, c
        elif smm > 0:
            self.a, self.c = 1.0, max(0.0, sum(m * (y - w) for w, m, y in obs) / smm)


@dataclass
class BucketRecord:
    """One bucket's (key, payload kind) measurements and decision."""

    key: Hashable
    kind: str
    numel: int
    elem_size: int
    chosen: str
    #: this worker's observations of the current window: (transport, own density, payload bytes, seconds),
    #: and the agreed union densities read off the sums
    own: list[tuple[str, float, float, float]] = field(default_factory=list)
    union: list[float] = field(default_factory=list)
    #: agreed, tracked figures (exponential averages over decisions)
    density: float | None = None
    union_density: float | None = None
    payload_bytes: float | None = None
    #: the last window's agreed seconds per transport measured, and the predictions made for them
    measured_s: dict[str, float] = field(default_factory=dict)
    measured_predicted_s: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    decisions: int = 0


class Chooser:
    """The per-bucket choice of ``transport="auto"`` (see the module doc).

    ``make(name)`` builds a transport of the catalog for this pipeline (the same options on every
    worker); ``default`` is the pipeline's transport, used until the first decision where nothing is
    explored and for the all-reduce that agrees the inputs; ``kind``/``shared_scale``: the method's
    payload; ``nonfinite``: the pipeline's rule (``"pass"`` and ``"skip"`` rule out the fixed-point switch
    transports)."""

    def __init__(self, default: Transport, make: Callable[[str], Transport], kind: str, shared_scale: bool,
                 *, multi_round: bool, nonfinite: str, opts: dict[str, Any]) -> None:
        self.default, self.make = default, make
        self.fabric = default.fabric
        self.n = int(self.fabric.world_size)
        self.kind, self.shared_scale, self.multi_round, self.nonfinite = kind, shared_scale, multi_round, nonfinite
        self.opts = opts
        self.block = int(opts["block_size"])
        self.built: dict[str, Transport] = {default.name: default}
        self.fits: dict[str, Fit] = {}
        self.link: Link | None = None
        self.records: dict[tuple[Hashable, str], BucketRecord] = {}
        self.step = 0
        #: refits of a transport's model that was off by more than ``tolerance``, so far
        self.refits = 0
        #: whether this worker logs (worker 0: the decisions are the same on every worker)
        self.speaks = self.fabric.rank == 0
        #: steps of the exploration (``estimate_steps`` on each candidate, in turn), before the first decision
        cands = max(len(self.candidates(kind)), len(self.candidates("dense")))
        self.explore_steps = opts["estimate_steps"] * (cands if opts["explore"] else 1)

    # ------------------------------------------------------------------ candidates
    def services(self) -> set[str]:
        """The services launched: the ``services`` option, else the fabric's started ones (by name, a
        spec's part before ``:``)."""
        given = self.opts["services"]
        if given is not None:
            return {str(s) for s in given}
        return {name.split(":")[0] for name in self.fabric.services()}

    def candidates(self, kind: str) -> list[str]:
        """The transports that can carry ``kind`` here and have a closed form (see the module doc)."""
        from .. import transports

        if self.multi_round:
            return [self.default.name]
        services = self.services()
        allowed = self.opts["candidates"]
        out = []
        for name in costs.MODELS:
            if name not in transports.registry or (allowed is not None and name not in allowed):
                continue
            tcls = transports.registry.factory(name)
            if not tcls.can_carry(kind, self.shared_scale if kind != "dense" else False):
                continue
            if name == "native" and self.fabric.native_group is None:
                continue
            if name in SWITCH_TRANSPORTS and (name not in services or self.nonfinite in ("pass", "skip")
                                              or self.n > 32):     # its own program must run
                continue
            out.append(name)
        return out or [self.default.name]

    def transport(self, name: str) -> Transport:
        t = self.built.get(name)
        if t is None:
            t = self.built[name] = self.make(name)
        return t

    # ------------------------------------------------------------------ the schedule
    def _phase(self) -> int:
        """Steps since the first measured one (step 2): negative for step 1."""
        return self.step - 2

    def exploring(self) -> str | None:
        """The transport every bucket of this step tries during the exploration, else None."""
        u = self._phase()
        if not self.opts["explore"] or not 0 <= u < self.explore_steps:
            return None
        return str(u // self.opts["estimate_steps"])

    def observing(self) -> bool:
        """Whether this step's calls are measured: the exploration, then the ``estimate_steps`` steps
        before each later decision (never step 1, whose calls open connections and allocate)."""
        u, x, p = self._phase(), self.explore_steps, self.opts["period"]
        if u < 0:
            return False
        return u < x or (u - x) % p >= p - self.opts["estimate_steps"]

    def deciding(self) -> bool:
        """Whether a decision is made at the start of this step."""
        u, x = self._phase(), self.explore_steps
        return u >= x and (u - x) % self.opts["period"] == 0

    # ------------------------------------------------------------------ per call
    def pick(self, key: Hashable, kind: str, flat: torch.Tensor) -> Transport:
        """The transport of bucket ``key``'s call of this step (payload ``kind``)."""
        rec = self.records.get((key, kind))
        if rec is None:
            rec = self.records[(key, kind)] = BucketRecord(key, kind, flat.numel(), flat.element_size(),
                                                           self.default.name)
        turn = self.exploring()
        if turn is not None:     # the default transport first, then the other candidates in turn
            cands = sorted(self.candidates(kind), key=lambda name: name != self.default.name)
            return self.transport(cands[int(turn) % len(cands)])
        return self.transport(rec.chosen)

    def observe(self, key: Hashable, kind: str, name: str, own_density: float, payload_bytes: int,
                agg: torch.Tensor, seconds: float) -> None:
        """A single-round call of bucket ``key`` on transport ``name`` in a measured step: this worker's
        message's block density and bytes, the sum ``agg`` (the same on every worker) and the call's
        ``seconds`` (on the communication thread)."""
        rec = self.records.get((key, kind))
        if rec is None:
            return
        rec.own.append((name, float(own_density), float(payload_bytes), float(seconds)))
        if agg.numel() == rec.numel:
            rec.union.append(block_density(agg, self.block))

    # ------------------------------------------------------------------ decisions
    def begin_step(self, step: int) -> None:
        """Step ``step`` begins (on every worker, nothing in flight): decide if it is a decision step."""
        self.step = step
        if self.deciding() and self.records:
            self.decide()

    def _agree(self) -> list[BucketRecord]:
        """Average every bucket's window over the workers (one all-reduce); returns the buckets measured
        on every worker. Per bucket the row holds the own density, payload bytes and union density (means
        over the window), then the median seconds over the window and a measured flag of every transport
        with a cost model."""
        recs = sorted(self.records.values(), key=lambda r: repr((r.key, r.kind)))
        names = list(costs.MODELS)
        width = 4 + 2 * len(names)
        rows = []
        for r in recs:
            k = len(r.own)
            row = [0.0] * width
            if k:
                row[0] = sum(x[1] for x in r.own) / k
                row[1] = sum(x[2] for x in r.own) / k
                row[3] = 1.0
            row[2] = sum(r.union) / len(r.union) if r.union else -1.0
            for i, name in enumerate(names):
                secs = [x[3] for x in r.own if x[0] == name]
                if secs:    # the median of the window: a step slowed by other load does not set the figure
                    row[4 + 2 * i], row[5 + 2 * i] = statistics.median(secs), 1.0
            rows.append(row)
        vec = torch.tensor(rows, dtype=torch.float64).reshape(-1)
        if self.n > 1:
            vec = self.default.allreduce(vec) / self.n
        out = []
        for r, row in zip(recs, vec.reshape(len(recs), width).tolist()):
            r.own, r.union = [], []
            if row[3] < 1.0:      # not measured on every worker this window
                continue
            own, pb, un = row[0], row[1], row[2]
            un = own if un < 0 else un
            w = 0.5 if r.decisions else 1.0
            r.density = own if r.density is None else (1 - w) * r.density + w * own
            r.union_density = un if r.union_density is None else (1 - w) * r.union_density + w * un
            r.payload_bytes = pb
            r.measured_s = {name: row[4 + 2 * i] for i, name in enumerate(names) if row[5 + 2 * i] >= 1.0}
            out.append(r)
        return out

    def cost(self, name: str, r: BucketRecord) -> costs.Cost:
        """The closed form of transport ``name`` for bucket ``r`` on the measured link."""
        assert self.link is not None
        net = {"bandwidth_gbps": min(self.link.bandwidth_Bps, 1e15) * 8 / 1e9,
               "latency_us": self.link.latency_s * 1e6}
        dw = min(1.0, max(r.density or 0.0, 0.0))
        du = min(1.0, max(r.union_density or 0.0, dw))
        call = CallShape(r.numel, r.elem_size, r.kind, int(r.payload_bytes or 0), dw, du)
        return self.transport(name).cost(call, **net)

    def predict(self, name: str, r: BucketRecord) -> float:
        """Transport ``name``'s predicted seconds for bucket ``r``: its fitted closed form."""
        assert self.link is not None
        return self.fits.setdefault(name, Fit(c=self.link.per_message_s)).predict(self.cost(name, r))

    def decide(self) -> None:
        """Agree the window's measurements, check the model against them (refit where it is off) and
        choose every measured bucket's transport."""
        if self.link is None:
            self.link = link_parameters(self.fabric)
        measured = self._agree()
        self._learn(measured)
        for r in measured:
            names = self.candidates(r.kind)
            pred = {name: self.predict(name, r) for name in names}
            r.predicted = pred
            best = min(pred, key=lambda k: (pred[k], names.index(k)))
            old = r.chosen
            first = r.decisions == 0
            r.decisions += 1
            if best == old:
                continue
            if not first and old in pred and pred[best] > (1.0 - self.opts["margin"]) * pred[old]:
                continue      # hysteresis: not enough faster to switch
            r.chosen = best
            if not self.speaks:
                continue
            why = (f"union block density {r.union_density:.4g}, own {r.density:.4g}, predicted "
                   + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in sorted(pred.items(), key=lambda kv: kv[1])))
            log.info("transport='auto' step %d: bucket %r (%s, %d elements) %s -> %s (%s)", self.step, r.key,
                     r.kind, r.numel, old, best, why)

    def _learn(self, measured: list[BucketRecord]) -> None:
        """Compare every measured (bucket, transport) time with its prediction (at the agreed densities),
        report those off by more than ``tolerance``, and refit every transport measured, from all its
        buckets of the window."""
        off = []
        for r in measured:
            r.measured_predicted_s = {}
            for name, sec in r.measured_s.items():
                p = self.predict(name, r)
                r.measured_predicted_s[name] = p
                if p > 0 and abs(sec / p - 1.0) > self.opts["tolerance"]:
                    if self.speaks:
                        log.warning("transport='auto' step %d: bucket %r on %s took %.4g ms, predicted %.4g ms "
                                    "(%+.0f%%): refitting %s's model", self.step, r.key, name, sec * 1e3,
                                    p * 1e3, 100 * (sec / p - 1.0), name)
                    if name not in off:
                        off.append(name)
        for name in dict.fromkeys(n for r in measured for n in r.measured_s):
            obs = [(c.time_s, c.messages, r.measured_s[name]) for r in measured if name in r.measured_s
                   for c in (self.cost(name, r),)]
            fit = self.fits[name]
            fit.refit(obs)
            if name not in off:
                continue
            self.refits += 1
            if self.speaks:
                log.info("transport='auto': %s refit: time = %.3g x model + %.3g us per message", name,
                         fit.a, fit.c * 1e6)

    # ------------------------------------------------------------------ figures
    def table(self) -> list[dict[str, Any]]:
        """Per bucket: key, payload kind, elements, densities (own mean over workers, union), predicted
        seconds of every candidate and the chosen transport; the last window's measured seconds per
        transport (median over the window, mean over the workers) and their predictions."""
        return [{"bucket": r.key, "kind": r.kind, "numel": r.numel, "density": r.density,
                 "union_density": r.union_density, "predicted_s": dict(r.predicted), "chosen": r.chosen,
                 "measured_s": dict(r.measured_s), "measured_predicted_s": dict(r.measured_predicted_s)}
                for r in sorted(self.records.values(), key=lambda r: repr((r.key, r.kind)))]
