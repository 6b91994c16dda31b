"""The method contract: a per-worker wrapper around any compressor, with explicit state (optax's
``init``/``update`` and torch's ``PowerSGDState`` as the models).

A Method object holds hyper-parameters only; everything the rounds of one flat bucket need lives in a
:class:`~sparsecomm.methods.state.MethodState` that :meth:`Method.init` builds and the caller holds and
passes in (the pipeline one per bucket, the simulated algorithms one per worker). One round on worker
i of n::

    st = method.init(d, dtype, device)                            # once per bucket: the typed state
    payload, st = method.encode(grad_i, st, generator, world_size=n)      # on the worker
    aggregate = transport.allreduce(payload)                      # sum over workers of payload.to_dense()
    estimate, st = method.decode(aggregate, n, st)                # the averaged gradient estimate

Every call returns its result and the state; the returned state replaces the one passed in (its
buffers are reused: the calls allocate nothing per round). ``encode`` leaves in the state what
``decode`` needs for this round (an exact round, DIANA's step): nothing is handed between the calls
through the object. Randomness comes only from the ``generator`` argument (the compressor holds
none); ``world_size`` is the number of workers whose messages are summed (DGC's local clipping
scales its threshold by it).

**Several rounds.** A method may need more than one aggregation per step (PowerSGD: the P factors,
then the Q factors computed from the orthogonalised sum of the Ps). After each round the caller asks
``next_round(aggregate, world_size, st)``: a Payload is the next round's message (aggregate it the
same way and ask again), ``None`` means ``aggregate`` was the last round's, to be handed to
``decode``::

    payload, st = method.encode(grad_i, st, generator, world_size=n)
    aggregate = transport.allreduce(payload)
    while (payload := method.next_round(aggregate, n, st)[0]) is not None:
        aggregate = transport.allreduce(payload)
    estimate, st = method.decode(aggregate, n, st)

One-round methods never override it (it returns ``None``). Every round's payload has the kind of the
method's declared compressor (the pair check at construction covers all rounds); the last aggregate
may be shorter than the bucket (the estimate always has the bucket's length). Each round is a
collective: every worker must run the same number of rounds for a bucket, which holds because the
decision is a function of the state and the (identical) aggregates.

**Shapes.** ``encode(..., shapes=[...])`` may tell the method the shapes of the tensors laid out in
the flat bucket (the optimizer and the DDP hook pass them); methods that set ``uses_shapes`` (PowerSGD
compresses each matrix separately) read them from the state (``ms.shapes_of(d)``); the others ignore
them.

``decode`` is deterministic given the aggregate and the state, so every worker's copy of any global
state (DIANA's h, EF21's g) stays identical without communication. The typed state (one small
dataclass per method: ``MethodState.state``) and the round count are what a checkpoint saves
(:func:`~sparsecomm.methods.state.states_to_dict` / :func:`~sparsecomm.methods.state.states_from_dict`
round-trip them exactly, tensors cloned), never a process group or the compressor. Hyper-parameters
(the compressor, DIANA's ``alpha``, the ``init`` rule) live on the method object, apart from the state,
as in ``PowerSGDState``. Wrappers compose: :class:`~sparsecomm.methods.warmup.Warmup` makes the first
rounds of every state exact.

**Exact rounds.** ``encode(..., exact=True)`` runs the same method with the identity operator in
place of the compressor (a dense payload of the full message). The optimizer uses it for its
``warmup_steps``; EF21 (and DIANA with ``init="grad"``) use it for the first round of a state. With
C = I every method's state stays consistent and is *warm-started*: EF's error is flushed to 0, EF21's
g_i becomes the gradient, DIANA's h_i becomes the gradient (DIANA's shift step is 1 on an exact
round: alpha <= 1/(omega+1) = 1 for omega = 0).

Every worker must call ``encode``/``decode`` for the same buckets, in the same order, with the same
``exact`` flags and the same bucket lengths (the optimizer and the DDP hook guarantee this).

**Memory.** By default both calls are pure with respect to their tensor arguments and return fresh
tensors. For large buckets the optimizer avoids fresh allocations (a fresh buffer is paged in at its
first touch): ``encode(..., inplace=True)`` lets the method overwrite ``grad`` (the caller's scratch), and
``decode(..., out=buf)`` writes the estimate into ``buf`` and returns it. Neither the payload nor the
returned estimate ever aliases the method's state (a payload may alias ``grad`` with ``inplace=True``).

**Host work.** :meth:`Method.work` declares what each call is about to cost a host, as counts of the host
model's operations (:data:`sparsecomm.fabric.sim.sim_host.CODEC_RATES`, and ``"check"``, a finiteness check's
read: top-k's of its input): the pipeline asks before each
``encode``, ``next_round`` and ``decode`` it makes and, on a fabric that charges host work (a SimFabric with a
host model: :attr:`~sparsecomm.fabric.base.Fabric.charges_host_work`), charges the counts to the worker's clock
(:meth:`sparsecomm.fabric.base.Fabric.host_work`); elsewhere it does not ask (a real fabric's calls take their
real time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import fields, is_dataclass

from typing import Any, ClassVar

import torch

from .. import compressors
from ..compressors._common import all_finite
from ..compressors.base import Compressor
from ..errors import HyperParameterError, IncompatibleError, InvalidTypeError, InvalidValueError, MismatchError, \
    NonFiniteError, SparseCommError
from ..payload import Payload
from .state import MethodState

__all__ = ["Method", "MethodState", "dense_payload", "resolve_compressor", "check_finite", "raise_input_nonfinite",
           "add_work",
           "HyperParameterError"]     # (HyperParameterError: its import path before sparsecomm.errors)


class Method(ABC):
    """Base class of the methods; subclasses are registered by name in ``sc.methods``.

    A Method object holds hyper-parameters only (the compressor, DIANA's ``alpha``, an ``init`` rule).
    Its state is explicit (:class:`~sparsecomm.methods.state.MethodState`), built by :meth:`init`::

        st = method.init(d, dtype, device)
        payload, st = method.encode(grad, st, generator, world_size=n)    # on the worker
        aggregate = transport.allreduce(payload)                          # the sum over workers
        estimate, st = method.decode(aggregate, n, st)                    # on every worker

    (a multi-round method asks ``nxt, st = method.next_round(aggregate, n, st)`` between them). The
    returned state is the given one updated in place (its buffers are reused: no fresh allocation per
    round); the caller keeps it (the pipeline holds one per bucket, the simulated algorithms one per
    worker) and a checkpoint is those states (:func:`~sparsecomm.methods.state.states_to_dict`).

    Subclasses define ``name``, ``default_compressor``, the ``State`` dataclass with :meth:`init_state`
    building it, and :meth:`_encode` / :meth:`_decode` (and :meth:`_next_round` for several rounds) over
    a :class:`~sparsecomm.methods.state.MethodState`.

    Args:
        compressor: a compressor name or object (default: the method's ``default_compressor``).
        **compressor_hyper: the compressor's keywords, with a name.
    """

    name: ClassVar[str] = ""
    #: the compressor built when none is given (a registered compressor name)
    default_compressor: ClassVar[str] = "identity"
    #: its hyper-parameters, used only when neither a compressor nor any hyper-parameter is given
    default_compressor_hyper: ClassVar[dict[str, Any]] = {}
    #: the per-bucket state dataclass (``None`` for a stateless method)
    State: ClassVar[type | None] = None
    #: whether the method's guarantees need an unbiased compressor (DIANA)
    needs_unbiased: ClassVar[bool] = False
    #: whether the method reads the bucket's tensor shapes (``encode(..., shapes=)``)
    uses_shapes: ClassVar[bool] = False
    #: whether a step may take several rounds (then ``decode`` requires ``next_round`` to have said None)
    multi_round: ClassVar[bool] = False
    #: whether ``decode`` also takes the sum of ``dense`` payloads' float16/bfloat16 values as summed (that
    #: dtype, not the estimate's), widening it exactly itself: the same estimate, bit for bit, as from the
    #: widened sum (the pipeline then hands it the narrow sum, and a pass is saved)
    decodes_narrow: ClassVar[bool] = False
    #: whether ``encode`` checks the input it compresses (what it forms from the gradient and its state: EF's
    #: ``g + e``, EF21's ``g - g_i``) for NaN/Inf and then raises :class:`~sparsecomm.errors.NonFiniteError`
    #: (:func:`raise_input_nonfinite`) *before* changing its state or drawing from its generator: that input is
    #: not finite whenever the gradient is not (the state is finite), so this check stands for the pipeline's
    #: check of the gradient and also finds a finite gradient whose sum with the state overflows, which the
    #: pipeline then tells every worker (:mod:`sparsecomm.pipeline.nonfinite`)
    checks_input: ClassVar[bool] = False

    compressor: Compressor

    def __init__(self, compressor: str | Compressor | None = None, **compressor_hyper: Any) -> None:
        if compressor is None and not compressor_hyper:
            compressor_hyper = dict(self.default_compressor_hyper)
        self.compressor = resolve_compressor(compressor, compressor_hyper, self.default_compressor,
                                             owner=f"method {self.name!r}")
        if self.needs_unbiased and not self.compressor.unbiased:
            raise IncompatibleError(
                f"method {self.name!r} needs an unbiased compressor (class U(omega)); "
                f"{self.compressor!r} is biased. Use an unbiased one (randk, qsgd, natural, ...) "
                f"or a method for contractive compressors: 'ef21' or 'ef'.")

    # ------------------------------------------------------------------ the explicit-state API
    def init(self, d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> MethodState:
        """A fresh state for a bucket of ``d`` elements of ``dtype`` on ``device``: its typed state
        (:meth:`init_state`) and no round yet."""
        d = int(d)
        return MethodState(state=self.init_state(d, dtype, torch.device(device)), length=d)

    def init_state(self, d: int, dtype: torch.dtype, device: torch.device) -> Any:
        """The typed state (an instance of ``State``) of a bucket of ``d`` elements before its first
        round; ``None`` for a stateless method.

        Args:
            d: the bucket's length.
            dtype: the bucket's dtype.
            device: the bucket's device.
        """
        return None

    def encode(self, grad: torch.Tensor, state: MethodState, generator: torch.Generator | None = None, *,
               world_size: int = 1, exact: bool = False, inplace: bool = False,
               shapes: Any = None) -> tuple[Payload, MethodState]:
        """The message this worker sends for ``grad`` (flat) and the updated state: ``(payload, state)``.

        ``generator``: the compressor's randomness (the only source). ``world_size``: the workers whose
        messages are summed. ``exact=True`` replaces the compressor by the identity for this round (see
        the module doc). ``inplace=True``: ``grad`` is scratch and may be overwritten (the payload may
        alias it). ``shapes``: the shapes of the tensors laid out in ``grad`` (their numels sum to its
        length).
        """
        if not isinstance(state, MethodState):
            raise InvalidTypeError(f"method {self.name!r}: encode takes the MethodState that "
                                   f"method.init(d, dtype, device) built, got {type(state).__name__}")
        ms = state
        if grad.dim() != 1:
            raise MismatchError(f"method {self.name!r} encodes flat buckets; got shape {tuple(grad.shape)}")
        d = grad.numel()
        if ms.state is None and self.State is not None:
            # a state restored from a checkpoint taken before its first round: built now
            ms.state = self.init_state(d, grad.dtype, grad.device)
        t = _first_tensor(ms.state) if ms.state is not None else None
        if t is not None and t.numel() != d:
            raise MismatchError(
                f"method {self.name!r}: the bucket has {d} elements but its state "
                f"has {t.numel()} (the bucket layout changed; build a new state or rebuild the optimizer)")
        if t is not None and (t.dtype != grad.dtype or t.device != grad.device):
            raise MismatchError(f"method {self.name!r}: the bucket is {grad.dtype} on {grad.device} but its "
                                f"state is {t.dtype} on {t.device} (init(d, dtype, device) of the bucket's)")
        # (the shapes of the last round again, on a bucket of the same length: checked then)
        if shapes is not None and self.uses_shapes and (ms.length != d or tuple(shapes) != ms.shapes):
            shapes = tuple(torch.Size(s) for s in shapes)
            if sum(s.numel() for s in shapes) != d:
                raise MismatchError(f"method {self.name!r}: shapes {[tuple(s) for s in shapes]} do not add "
                                    f"up to the bucket's {d} elements")
            ms.shapes = shapes
        ms.length = d
        ms.last_round = False
        payload = self._encode(grad if inplace else grad.clone(), ms, generator, exact, int(world_size))
        ms.started = True
        ms.rounds += 1
        return payload, ms

    def next_round(self, aggregate: torch.Tensor, world_size: int,
                   state: MethodState) -> tuple[Payload | None, MethodState]:
        """After a round's ``aggregate`` (the sum over workers): ``(payload, state)`` of the next round,
        or ``(None, state)`` when ``aggregate`` is the last round's (then call :meth:`decode` with it).
        See the module doc.

        Args:
            aggregate: the round's sum over workers.
            world_size: the number of workers summed.
            state: this bucket's state.
        """
        nxt = self._next_round(aggregate.reshape(-1), int(world_size), state)
        if nxt is None:
            state.last_round = True
        return nxt, state

    def decode(self, aggregate: torch.Tensor, world_size: int, state: MethodState, *,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, MethodState]:
        """The gradient estimate from the sum over workers of the decompressed (last-round) messages,
        and the updated state: ``(estimate, state)``.

        ``out`` (flat, the bucket's length, the aggregate's dtype; or wider, where :attr:`decodes_narrow` and the
        aggregate is float16/bfloat16): write the estimate there and return it.

        Args:
            aggregate: the last round's sum over workers.
            world_size: the number of workers summed (the divisor of the average).
            state: this bucket's state.
            out: see above.
        """
        agg, out = self._decode_args(aggregate, state, out)
        self._decode(agg, int(world_size), state, out)
        return out, state

    def decode_finite(self, aggregate: torch.Tensor, world_size: int, state: MethodState, *,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, MethodState, bool]:
        """:meth:`decode`, and whether every element of ``aggregate`` is finite: ``(estimate, state, finite)``.
        The check of a sum that a caller leaves to the decode (the pipeline's rounds chained on their collective,
        :meth:`CommPipeline.chain <sparsecomm.pipeline.core.CommPipeline.chain>`): a method whose decode reads
        every element once folds it into that pass (:meth:`_decode_finite`); otherwise it is a pass of its own,
        before the decode.

        Args:
            aggregate: as for :meth:`decode`.
            world_size: as for :meth:`decode`.
            state: as for :meth:`decode`.
            out: as for :meth:`decode`.
        """
        agg, out = self._decode_args(aggregate, state, out)
        finite = self._decode_finite(agg, int(world_size), state, out)
        if finite is None:
            finite = all_finite(agg)
            self._decode(agg, int(world_size), state, out)
        return out, state, finite

    def encode_direct(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                      world_size: int) -> Payload:
        """``encode(grad, ms, generator, world_size=world_size, inplace=True)[0]`` (not exact, no shapes), the same
        payload and state, without :meth:`encode`'s checks of its arguments, for a caller that guarantees them: ``grad``
        flat and this worker's scratch, ``ms`` the :class:`~sparsecomm.methods.state.MethodState` of this bucket (its
        length, dtype and device) with its typed state built (a stateless method's is ``None``), ``world_size`` an
        int. The pipeline's rounds chained on their collective (:meth:`CommPipeline.chain
        <sparsecomm.pipeline.core.CommPipeline.chain>`: a stateless one-round method around an elementwise
        compressor) call it on every bucket, so a method whose round is its compressor's alone (``none``) overrides
        it with the fewest calls. A compressor's error (``NonFiniteError``) leaves ``ms`` as :meth:`encode` does.

        Args:
            grad: the flat bucket (overwritten; the payload may alias it).
            ms: the bucket's state.
            generator: the compressor's randomness.
            world_size: the workers whose messages are summed.
        """
        ms.length = grad.numel()
        ms.last_round = False
        payload = self._encode(grad, ms, generator, False, world_size)
        ms.started = True
        ms.rounds += 1
        return payload

    def decode_direct(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> bool:
        """:meth:`decode_finite` into ``out`` (the same estimate, state and answer: whether every element of
        ``aggregate`` is finite) without :meth:`decode`'s checks of its arguments, for a caller that guarantees them
        (:meth:`encode_direct`'s, whose round this is): ``aggregate`` the flat sum of a one-round method's payloads,
        ``out`` flat of the bucket's length in the estimate's dtype (the aggregate's, or wider where
        :attr:`decodes_narrow`), ``world_size`` an int.

        Args:
            aggregate: the round's sum over workers.
            world_size: the number of workers summed.
            ms: the bucket's state.
            out: the estimate's buffer.
        """
        ms.last_round = False
        finite = self._decode_finite(aggregate, world_size, ms, out)
        if finite is None:
            finite = all_finite(aggregate)
            self._decode(aggregate, world_size, ms, out)
        return finite

    def _decode_args(self, aggregate: torch.Tensor, ms: MethodState,
                     out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode`'s checks: the flat aggregate and the estimate's buffer (``out``, or a new one)."""
        agg = aggregate.reshape(-1)
        if self.multi_round and not ms.last_round and ms.pending is not None:
            raise SparseCommError(f"method {self.name!r} takes several rounds per step: call next_round(aggregate, "
                                  f"world_size, state) after each round and decode only the aggregate of the "
                                  f"round after which it returned None")
        ms.last_round = False
        d = ms.length if ms.length is not None else agg.numel()
        if out is None:
            out = torch.empty(d, dtype=agg.dtype, device=agg.device)
        elif out.shape != (d,) or (out.dtype != agg.dtype and not (
                self.decodes_narrow and agg.dtype in (torch.float16, torch.bfloat16) and out.is_floating_point())):
            raise MismatchError(f"decode: out has shape {tuple(out.shape)} and dtype {out.dtype}, the "
                                f"estimate ({d},) and {agg.dtype}")
        return agg, out

    def work(self, phase: str, state: MethodState, d: int, *, exact: bool = False,
             shapes: Any = None) -> dict[str, int]:
        """The host work of the call ``phase`` (``"encode"``, ``"next_round"`` or ``"decode"``) about to run with
        ``state`` on a bucket of ``d`` elements (``exact`` and ``shapes``: encode's arguments), as counts of
        the host model's operations (:data:`sparsecomm.fabric.sim.sim_host.CODEC_RATES`; module doc, "Host
        work"). The default: an encode is the compressor's :meth:`~sparsecomm.compressors.base.Compressor.work`
        (nothing on an exact round: the bucket is the message) and a kernel call; a decode, one elementwise pass
        (the division by n) and a kernel call; no later round. A method whose calls do more says so.

        Args:
            phase: the call.
            state: the bucket's state as the call will get it.
            d: the bucket's length.
            exact: encode's ``exact``.
            shapes: encode's ``shapes``.
        """
        if phase == "encode":
            return {"kernel": 1} if exact else add_work(self.compress_work(d), {"kernel": 1})
        if phase == "decode":
            return {"elementwise": d, "kernel": 1}
        if phase == "next_round":
            return {}
        raise InvalidValueError(f"method {self.name!r}: work of phase {phase!r}; the phases are 'encode', "
                                f"'next_round' and 'decode'")

    def state_sizes(self, shapes: tuple[torch.Size, ...]) -> dict[str, list[int]]:
        """How the typed state of a bucket holding tensors of ``shapes`` (in order) splits into one
        piece per tensor: for a tensor field that is not per coordinate, how many of its values belong
        to each tensor (the field is their concatenation in that order). Every tensor field not named is
        per coordinate (``numel`` values per tensor): the default names none; a method whose state holds
        something per matrix (PowerSGD's warm-start Qs) names it. :func:`~sparsecomm.methods.state.split_state`
        and :func:`~sparsecomm.methods.state.join_state` read it to remap a state onto another bucket
        layout (the DDP hook after DDP's bucket rebuild, :meth:`sparsecomm.pipeline.states.StateStore.bind`)."""
        return {}

    def hyper(self) -> dict[str, Any]:
        """The method's hyper-parameters (not its state), for logging and ``repr``."""
        return {"compressor": self.compressor}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper().items())
        return f"{type(self).__name__}({args})"

    # --------------------------------------------------------------- for subclasses
    @abstractmethod
    def _encode(self, grad: torch.Tensor, ms: MethodState, generator: torch.Generator | None,
                exact: bool, world_size: int) -> Payload:
        """Encode; ``grad`` is the method's to overwrite (the base class cloned it if needed);
        ``ms.state`` is built (:meth:`init_state`) and ``ms.started`` says whether a round used it
        before; update ``ms.state`` and leave in ``ms.pending`` what decode needs."""

    @abstractmethod
    def _decode(self, aggregate: torch.Tensor, world_size: int, ms: MethodState, out: torch.Tensor) -> None:
        """Write the estimate into ``out`` (never alias state); ``aggregate`` must not be modified."""

    def _decode_finite(self, aggregate: torch.Tensor, world_size: int, ms: MethodState,
                       out: torch.Tensor) -> bool | None:
        """:meth:`_decode` and whether every element of ``aggregate`` is finite, from the same pass; ``None``
        (nothing done) where the method does not fold the check (the default): :meth:`decode_finite` then checks
        in a pass of its own."""
        return None

    def _next_round(self, aggregate: torch.Tensor, world_size: int, ms: MethodState) -> Payload | None:
        """The next round's payload, or ``None`` (one-round methods: always ``None``)."""
        return None

    def compress_work(self, d: int) -> dict[str, int]:
        """The host work of :meth:`_compress` on a compressed round of a length-``d`` bucket: the compressor's
        :meth:`~sparsecomm.compressors.base.Compressor.work`, or, for a method that :attr:`checks_input`, its
        :meth:`~sparsecomm.compressors.base.Compressor.finite_work` (its own finiteness read left out)."""
        c = self.compressor
        return c.finite_work(d) if self.checks_input else c.work(d)

    def _compress(self, x: torch.Tensor, generator: torch.Generator | None, exact: bool) -> Payload:
        """``C(x)``, or the identity's dense payload on an exact round; a method that :attr:`checks_input` calls it
        only on a finite ``x`` (:meth:`~sparsecomm.compressors.base.Compressor.compress_finite`)."""
        if exact:
            return dense_payload(x)
        if self.checks_input:       # (x checked already: a compressor's own pass over it left out)
            return self.compressor.compress_finite(x, generator)
        return self.compressor.compress(x, generator)

    def _add_decompressed(self, target: torch.Tensor, payload: Payload, alpha: float = 1.0) -> None:
        """``target += alpha * decompress(payload)`` in place, without densifying aligned/sparse payloads."""
        if payload.kind in ("aligned", "sparse") and type(self.compressor).decompress is Compressor.decompress:
            if payload.values.numel():
                vals = payload.values.reshape(-1).to(target.dtype)
                target.index_add_(0, payload.indices.reshape(-1), vals, alpha=alpha)
            return
        dec = (payload.to_dense() if payload.meta.get("exact")
               else self.compressor.decompress(payload).reshape(-1)).to(target.dtype)
        if alpha == 1.0:
            target.add_(dec)
        else:
            target.add_(dec, alpha=alpha)


# ---------------------------------------------------------------------- helpers
def _first_tensor(st: Any) -> torch.Tensor | None:
    """The first tensor field of a typed state (its length, dtype and device are the bucket's)."""
    names = _FIELD_NAMES.get(st.__class__)
    if names is None:
        names = _FIELD_NAMES[st.__class__] = tuple(f.name for f in fields(st)) if is_dataclass(st) else ()
    for name in names:
        v = getattr(st, name)
        if isinstance(v, torch.Tensor):
            return v
    return None


#: the field names of each typed-state class (a dataclass's fields are fixed by its class), read by _first_tensor
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def add_work(*works: dict[str, int]) -> dict[str, int]:
    """The sum of host-work counts (:meth:`Method.work`), operation by operation."""
    out: dict[str, int] = {}
    for w in works:
        for op, n in w.items():
            out[op] = out.get(op, 0) + int(n)
    return out


def dense_payload(x: torch.Tensor) -> Payload:
    """The identity's payload: ``x`` itself (flat), marked as an exact round."""
    flat = x.reshape(-1)
    return Payload(kind="dense", values=flat, shape=flat.shape, dtype=flat.dtype,
                   bits=8 * flat.numel() * flat.element_size(), meta={"exact": True})


def raise_input_nonfinite(method: str, formed: str) -> None:
    """:class:`~sparsecomm.errors.NonFiniteError`: the input that ``method`` compresses (``formed``: how it is formed
    from the gradient and the state) holds a NaN or Inf (:attr:`Method.checks_input`)."""
    raise NonFiniteError(f"method {method!r}: its compressed input {formed} holds NaN or Inf: a NaN/Inf gradient, or "
                         f"a finite gradient whose sum with the method's state overflowed (a state grown near the "
                         f"dtype's largest value); lower the learning rate, or resume from a checkpoint taken before the state grew")


def check_finite(x: torch.Tensor, who: str) -> None:
    """Raise :class:`~sparsecomm.errors.NonFiniteError` naming ``who`` when ``x`` holds a NaN or Inf."""
    if not all_finite(x):
        raise NonFiniteError(f"{who}: the input contains NaN or Inf; only finite tensors can be compressed")


def resolve_compressor(compressor: str | Compressor | None, hyper: dict[str, Any], default: str,
                       owner: str = "") -> Compressor:
    """A Compressor from a catalog name (+ hyper-parameters; a keyword the compressor does not take
    raises there, naming the ones it does) or an object (then ``hyper`` must be empty)."""
    if compressor is None:
        compressor = default
    if isinstance(compressor, Compressor):
        if hyper:
            raise InvalidTypeError(f"{owner}: hyper-parameters {sorted(hyper)} given with a compressor object "
                                   f"{compressor!r}; pass them to the compressor instead")
        return compressor
    if isinstance(compressor, str):
        return compressors.get(compressor, **hyper)   # unknown names raise, listing the valid ones
    raise InvalidTypeError(f"{owner}: compressor must be a registered name or a Compressor, got {compressor!r}")
