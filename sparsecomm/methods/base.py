"""The method contract: a stateful per-worker wrapper around any compressor (optax-style explicit state).

One round, for bucket ``key`` on worker i::

    payload   = method.encode(grad_i, key, generator)        # on the worker (may update worker state)
    aggregate = transport.allreduce(payload)                 # sum over workers of payload.to_dense()
    estimate  = method.decode(aggregate, world_size, key)    # the averaged gradient estimate

**Several rounds.** A method may need more than one aggregation per step (PowerSGD: the P factors,
then the Q factors computed from the orthogonalised sum of the Ps). After each round the caller asks
``next_round(aggregate, world_size, key)``: a Payload is the next round's message (aggregate it the
same way and ask again), ``None`` means ``aggregate`` was the last round's, to be handed to
``decode``::

    payload = method.encode(grad_i, key, generator)
    aggregate = transport.allreduce(payload)
    while (payload := method.next_round(aggregate, world_size, key)) is not None:
        aggregate = transport.allreduce(payload)
    estimate = method.decode(aggregate, world_size, key)

One-round methods never override it (it returns ``None``). Every round's payload has the kind of the
method's declared compressor (the pair check at construction covers all rounds); the last aggregate
may be shorter than the bucket (the estimate always has the bucket's length). Each round is a
collective: every worker must run the same number of rounds for a key, which holds because the
decision is a function of the state and the (identical) aggregates.

**Shapes.** ``encode(..., shapes=[...])`` may tell the method the shapes of the tensors laid out in
the flat bucket (the optimizer and the DDP hook pass them); methods that set ``uses_shapes`` (PowerSGD
compresses each matrix separately) read them with ``self._shapes_of(key, d)``; the others ignore them.

``decode`` is deterministic given the aggregate and the state, so every worker's copy of any global
state (DIANA's h, EF21's g) stays identical without communication. State is per ``key`` (one flat
bucket each), explicit and typed (one small dataclass per key); ``state_dict()`` /
``load_state_dict()`` round-trip it exactly (tensors cloned) and never hold a process group or the
compressor. Hyper-parameters (the compressor, DIANA's ``alpha``, the ``init`` rule) live on the
method object, apart from the state, as in ``PowerSGDState``.

**Exact rounds.** ``encode(..., exact=True)`` runs the same method with the identity operator in
place of the compressor (a dense payload of the full message). The optimizer uses it for its
``warmup_steps``; EF21 (and DIANA with ``init="grad"``) use it for the first round of a bucket. With
C = I every method's state stays consistent and is *warm-started*: EF's error is flushed to 0, EF21's
g_i becomes the gradient, DIANA's h_i becomes the gradient (DIANA's shift step is 1 on an exact
round: alpha <= 1/(omega+1) = 1 for omega = 0).

Every worker must call ``encode``/``decode`` for the same keys, in the same order, with the same
``exact`` flags and the same bucket lengths (the optimizer and the DDP hook guarantee this).

**Memory.** By default both calls are pure with respect to their arguments and return fresh
tensors. For large buckets the optimizer avoids fresh allocations (page faults dominate on some
hosts): ``encode(..., inplace=True)`` lets the method overwrite ``grad`` (the caller's scratch), and
``decode(..., out=buf)`` writes the estimate into ``buf`` and returns it. The returned estimate never
aliases the method's state.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar, Hashable

import torch

from ..compressors.base import Compressor
from ..errors import HyperParameterError, MismatchError, SparseCommError  # noqa: F401 (re-exported)
from ..payload import Payload


class Method(ABC):
    """Base class of the stateful methods; subclasses are registered by name in ``sc.methods``.

    Subclasses define ``name``, ``default_compressor``, the per-key ``State`` dataclass, and
    :meth:`_encode` / :meth:`_decode`.
    """

    name: ClassVar[str] = ""
    #: the compressor built when none is given (a registered compressor name)
    default_compressor: ClassVar[str] = "identity"
    #: its hyper-parameters, used only when neither a compressor nor any hyper-parameter is given
    default_compressor_hyper: ClassVar[dict[str, Any]] = {}
    #: the per-key state dataclass (``None`` for a stateless method)
    State: ClassVar[type | None] = None
    #: whether the method's guarantees need an unbiased compressor (DIANA)
    needs_unbiased: ClassVar[bool] = False
    #: whether the method reads the bucket's tensor shapes (``encode(..., shapes=)``)
    uses_shapes: ClassVar[bool] = False
    #: whether a step may take several rounds (then ``decode`` requires ``next_round`` to have said None)
    multi_round: ClassVar[bool] = False

    compressor: Compressor
    #: the number of workers, set by the pipeline before the first round (DGC's local clipping reads it)
    world_size: int | None = None

    def __init__(self, compressor: str | Compressor | None = None, **compressor_hyper: Any) -> None:
        if compressor is None and not compressor_hyper:
            compressor_hyper = dict(self.default_compressor_hyper)
        try:
            self.compressor = resolve_compressor(compressor, compressor_hyper, self.default_compressor,
                                                 owner=f"method {self.name!r}")
        except HyperParameterError as e:
            own = [n for n in inspect.signature(type(self).__init__).parameters
                   if n not in ("self", "compressor", "compressor_hyper")]
            raise HyperParameterError(
                f"{e} (method {self.name!r} itself takes: {', '.join(['compressor'] + own)}; other keyword "
                f"arguments go to its compressor)") from None
        if self.needs_unbiased and not getattr(self.compressor, "unbiased", False):
            from ..errors import IncompatibleError

            raise IncompatibleError(
                f"method {self.name!r} needs an unbiased compressor (class U(omega)); "
                f"{self.compressor!r} is biased. Use an unbiased one (randk, qsgd, natural, ...) "
                f"or a method for contractive compressors: 'ef21' or 'ef'.")
        self._state: dict[Hashable, Any] = {}
        # what encode decided for a key (exact round, effective step), consumed by decode
        self._pending: dict[Hashable, Any] = {}
        # per key: the bucket's length (the estimate's) and, for ``uses_shapes`` methods, its shapes
        self._lengths: dict[Hashable, int] = {}
        self._shapes: dict[Hashable, tuple[torch.Size, ...]] = {}
        self._last_round: dict[Hashable, bool] = {}     # multi-round: next_round returned None

    # ------------------------------------------------------------------ public
    def encode(self, grad: torch.Tensor, key: Hashable = 0, generator: torch.Generator | None = None,
               *, exact: bool = False, inplace: bool = False, shapes: Any = None) -> Payload:
        """The message this worker sends for ``grad`` (flat) of bucket ``key`` (its first round's).

        ``exact=True`` replaces the compressor by the identity for this round (see the module doc).
        ``inplace=True``: ``grad`` is scratch and may be overwritten (the payload may alias it).
        ``shapes``: the shapes of the tensors laid out in ``grad`` (their numels sum to its length).
        """
        if grad.dim() != 1:
            raise MismatchError(f"method {self.name!r} encodes flat buckets; got shape {tuple(grad.shape)}")
        st = self._state.get(key)
        if st is not None:
            n = _state_numel(st)
            if n is not None and n != grad.numel():
                raise MismatchError(
                    f"method {self.name!r}: bucket {key!r} has {grad.numel()} elements but its state "
                    f"has {n} (the bucket layout changed; call reset() or rebuild the optimizer)")
        if shapes is not None and self.uses_shapes:
            shapes = tuple(torch.Size(s) for s in shapes)
            if sum(s.numel() for s in shapes) != grad.numel():
                raise MismatchError(f"method {self.name!r}: shapes {[tuple(s) for s in shapes]} do not add "
                                    f"up to the bucket's {grad.numel()} elements")
            self._shapes[key] = shapes
        self._lengths[key] = grad.numel()
        self._last_round.pop(key, None)
        return self._encode(grad if inplace else grad.clone(), key, generator, exact)

    def next_round(self, aggregate: torch.Tensor, world_size: int, key: Hashable = 0) -> Payload | None:
        """After a round's ``aggregate`` (the sum over workers): the next round's payload, or ``None``
        when ``aggregate`` is the last round's (then call :meth:`decode` with it). See the module doc."""
        nxt = self._next_round(aggregate.reshape(-1), int(world_size), key)
        if nxt is None:
            self._last_round[key] = True
        return nxt

    def decode(self, aggregate: torch.Tensor, world_size: int, key: Hashable = 0, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient estimate from the sum over workers of the decompressed (last-round) messages.

        ``out`` (flat, the bucket's length, the aggregate's dtype): write the estimate there and return it.
        """
        agg = aggregate.reshape(-1)
        if self.multi_round and not self._last_round.pop(key, False) and key in self._pending:
            raise SparseCommError(f"method {self.name!r} takes several rounds per step: call next_round(aggregate, "
                                  f"world_size, key) after each round and decode only the aggregate of the "
                                  f"round after which it returned None")
        d = self._lengths.get(key, agg.numel())
        if out is None:
            out = torch.empty(d, dtype=agg.dtype, device=agg.device)
        elif out.shape != (d,) or out.dtype != agg.dtype:
            raise MismatchError(f"decode: out has shape {tuple(out.shape)} and dtype {out.dtype}, the "
                                f"estimate ({d},) and {agg.dtype}")
        self._decode(agg, int(world_size), key, out)
        return out

    def hyper(self) -> dict[str, Any]:
        """The method's hyper-parameters (not its state), for logging and ``repr``."""
        return {"compressor": self.compressor}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper().items())
        return f"{type(self).__name__}({args})"

    def state(self, key: Hashable = 0) -> Any:
        """The typed state of bucket ``key`` (``None`` before its first round); read-only by convention."""
        return self._state.get(key)

    def keys(self) -> list[Hashable]:
        return list(self._state)

    def state_dict(self) -> dict[str, Any]:
        """All internal state (tensors cloned), keyed by bucket; no process groups, no compressors. A
        compressor's own generators (one built with ``seed=`` and called without a generator) are part of
        the run's state: their states are saved under ``"compressor_generators"`` (once used), and loading a
        state without them restarts those generators from the compressor's seed."""
        buckets = {}
        for key, st in self._state.items():
            buckets[key] = {f.name: _clone(getattr(st, f.name)) for f in fields(st)}
        out = {"method": self.name, "buckets": buckets}
        gens = self.compressor.generator_state() if hasattr(self.compressor, "generator_state") else {}
        if gens:
            out["compressor_generators"] = gens
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly what :meth:`state_dict` returned (``{}`` resets)."""
        self._pending.clear()
        self._lengths.clear()
        self._last_round.clear()
        if not state:
            self._state = {}
            return
        if state.get("method", self.name) != self.name:
            raise MismatchError(f"state of method {state.get('method')!r} cannot be loaded into "
                                f"method {self.name!r}")
        buckets = state.get("buckets", {})
        if buckets and self.State is None:
            raise MismatchError(f"method {self.name!r} is stateless but the state has buckets")
        self._state = {key: self.State(**{k: _clone(v) for k, v in fields_.items()})
                       for key, fields_ in buckets.items()}
        if hasattr(self.compressor, "load_generator_state"):  # absent: not used yet, restart from its seed
            self.compressor.load_generator_state(state.get("compressor_generators", {}))

    def reset(self) -> None:
        """Forget all state (e.g. after a world-size change)."""
        self.load_state_dict({})

    # --------------------------------------------------------------- for subclasses
    @abstractmethod
    def _encode(self, grad: torch.Tensor, key: Hashable, generator: torch.Generator | None,
                exact: bool) -> Payload:
        """Encode; ``grad`` is the method's to overwrite (the base class cloned it if needed)."""

    @abstractmethod
    def _decode(self, aggregate: torch.Tensor, world_size: int, key: Hashable, out: torch.Tensor) -> None:
        """Write the estimate into ``out`` (never alias state); ``aggregate`` must not be modified."""

    def _next_round(self, aggregate: torch.Tensor, world_size: int, key: Hashable) -> Payload | None:
        """The next round's payload, or ``None`` (one-round methods: always ``None``)."""
        return None

    def _shapes_of(self, key: Hashable, d: int) -> tuple[torch.Size, ...]:
        """The shapes given for bucket ``key`` (``(d,)`` as one flat tensor when none were given)."""
        return self._shapes.get(key) or (torch.Size([d]),)

    def _compress(self, x: torch.Tensor, generator: torch.Generator | None, exact: bool) -> Payload:
        """``C(x)``, or the identity's dense payload on an exact round."""
        if exact:
            return dense_payload(x)
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

    def _take_pending(self, key: Hashable) -> Any:
        try:
            return self._pending.pop(key)
        except KeyError:
            raise SparseCommError(f"method {self.name!r}: decode for bucket {key!r} without a "
                                  f"preceding encode") from None


# ---------------------------------------------------------------------- helpers
def dense_payload(x: torch.Tensor) -> Payload:
    """The identity's payload: ``x`` itself (flat), marked as an exact round."""
    flat = x.reshape(-1)
    return Payload(kind="dense", values=flat, shape=flat.shape, dtype=flat.dtype,
                   bits=8 * flat.numel() * flat.element_size(), meta={"exact": True})


def resolve_compressor(compressor: str | Compressor | None, hyper: dict[str, Any], default: str,
                       owner: str = "") -> Compressor:
    """A Compressor from a name (+ hyper-parameters) or an object (then ``hyper`` must be empty)."""
    from .. import compressors

    if compressor is None:
        compressor = default
    if isinstance(compressor, Compressor):
        if hyper:
            raise TypeError(f"{owner}: hyper-parameters {sorted(hyper)} given with a compressor object "
                            f"{compressor!r}; pass them to the compressor instead")
        return compressor
    if isinstance(compressor, str):
        factory = compressors.registry.factory(compressor)  # unknown names raise, listing the valid ones
        check_kwargs(factory, hyper, f"compressor {compressor!r}")
        return factory(**hyper)
    raise TypeError(f"{owner}: compressor must be a registered name or a Compressor, got {compressor!r}")


def check_kwargs(factory: Any, kwargs: dict[str, Any], what: str) -> None:
    """Raise :class:`HyperParameterError` when ``factory`` does not accept some of ``kwargs``."""
    if not kwargs:
        return
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                and n != "self"]
    bad = sorted(set(kwargs) - set(accepted))
    if bad:
        raise HyperParameterError(f"{what} does not take {', '.join(map(repr, bad))}; "
                                  f"its hyper-parameters: {', '.join(accepted) or 'none'}")


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _state_numel(st: Any) -> int | None:
    if is_dataclass(st):
        for f in fields(st):
            v = getattr(st, f.name)
            if isinstance(v, torch.Tensor):
                return v.numel()
    return None
