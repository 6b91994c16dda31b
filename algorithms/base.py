"""Shared machinery of the simulated distributed optimizers (one process, n workers).

Every algorithm in ``algorithms/`` is a :class:`torch.optim.Optimizer` over the parameter x (one tensor or
several, treated as one flat vector of length d) that simulates n workers in this process:

- ``step(closure)``: ``closure()`` returns the **(n, d) matrix of local gradients** at the current x
  (row i = grad f_i(x)); if the optimizer was built with ``problem=`` (anything with
  ``grads(x) -> (n, d)``, e.g. :class:`theory.problems.FiniteSumProblem`) the closure may be omitted.
  ``step`` returns that gradient matrix.
- per-worker compression goes through one of the library's :mod:`sparsecomm.methods` (hyper-parameters
  only) and one explicit state per worker (``states[i] = method.init(d, dtype)``):
  ``payload_i, states[i] = method.encode(g_i, states[i], generator_i, world_size=n)``;
  ``aggregate = sum_i payload_i.to_dense()``; ``estimate, states[i] = method.decode(aggregate, n, states[i])``
  on every worker (their copies of the global state stay identical);
- default step sizes come from :mod:`theory.rates` given the problem constants (``problem=`` or
  ``constants=``: an object or dict with ``L``, ``L_max``, ``L_tilde``, ``mu``) and the compressor's
  declared ``omega(d)`` / ``delta(d)``;
- randomness: worker i draws from its own ``torch.Generator`` (seeded from ``seed`` and i), so the
  compressors are **independent** across workers, which is what the omega/n in the theory assumes. With
  ``independent=False`` all workers share each round's seed (shared-seed rand-k: the aggregate stays
  compact, but averaging no longer divides the variance by n; the theory defaults then use n = 1 in the
  variance terms);
- accounting: ``bits_sent`` (total over workers, each message's declared ``payload.bits``: values at the
  width of x's dtype, so 64 bits per value for the float64 problems; an uncompressed round costs
  64 d per worker),
  ``rounds``, ``grad_evals`` (local gradient evaluations per worker, in samples for stochastic methods).

Example (DIANA at its theoretical step on heterogeneous logistic regression)::

    import torch
    from sparsecomm.theory import problems
    from sparsecomm.algorithms import DIANA

    prob = problems.logistic("digits", n_workers=20, split="label", lam=1e-2)
    x = torch.zeros(prob.d, dtype=torch.float64)
    opt = DIANA([x], n_workers=prob.n, compressor="randk", ratio=0.02, problem=prob)
    for _ in range(5000):
        opt.step()                              # or opt.step(lambda: prob.grads(x))
    print(float((x - prob.x_star).square().sum()), opt.bits_sent)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch

from sparsecomm.compressors.base import Compressor
from sparsecomm.errors import ConfigError, MismatchError, SparseCommError  # noqa: F401 (ConfigError: re-exported)
from sparsecomm.methods.base import Method, resolve_compressor
from sparsecomm.methods.state import MethodState, states_from_dict, states_to_dict
from sparsecomm.payload import Payload


def dense_bits(d: int, dtype: torch.dtype) -> int:
    """Wire bits of an uncompressed length-d message of ``dtype`` (as the methods' exact payloads)."""
    return torch.finfo(dtype).bits * int(d)


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


class Constants:
    """Problem constants for the theory defaults, read from a problem object or a mapping."""

    NAMES = ("L", "L_max", "L_tilde", "mu", "L_sample_max")

    def __init__(self, source: Any = None) -> None:
        self._src = source

    def get(self, name: str, owner: str = "") -> float:
        src = self._src
        val = None
        if isinstance(src, Mapping):
            val = src.get(name)
        elif src is not None:
            val = getattr(src, name, None)
        if val is None:
            raise SparseCommError(
                f"{owner}: the theoretical step size needs the problem constant {name!r}; pass lr= "
                f"explicitly, or problem=/constants= with {name} (e.g. a theory.problems.FiniteSumProblem)")
        return float(val)

    def has(self, name: str) -> bool:
        src = self._src
        if isinstance(src, Mapping):
            return src.get(name) is not None
        return src is not None and getattr(src, name, None) is not None


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class: parameter flattening, the per-worker generators, gradient retrieval, accounting.

    Subclasses implement :meth:`_estimate` (from the (n, d) local gradients to the step direction) and
    :meth:`theory_lr` (the default step size).
    """

    #: the compressor used when none is given
    default_compressor: str = "identity"
    #: algorithm-specific attributes saved by :meth:`state_dict` (tensors cloned)
    _state_attrs: tuple[str, ...] = ()

    def __init__(self, params: Iterable[torch.Tensor] | torch.Tensor, *, n_workers: int | None = None,
                 compressor: str | Compressor | None = None, lr: float | None = None,
                 problem: Any = None, constants: Any = None, seed: int = 0, independent: bool = True,
                 **compressor_hyper: Any) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        if n_workers is None:
            n_workers = getattr(problem, "n", None)
        if n_workers is None or int(n_workers) != n_workers or n_workers < 1:
            raise ConfigError(f"{type(self).__name__}: n_workers must be a positive integer "
                             f"(or pass problem= with .n), got {n_workers!r}")
        self.n = int(n_workers)
        self.problem = problem
        self.constants = Constants(constants if constants is not None else problem)
        self.compressor = resolve_compressor(compressor, dict(compressor_hyper), self.default_compressor,
                                             owner=type(self).__name__)
        self.independent = bool(independent)
        self.seed = int(seed)
        super().__init__(params, {"lr": lr})
        self._params = [p for g in self.param_groups for p in g["params"]]
        if len(self.param_groups) != 1:
            raise ConfigError(f"{type(self).__name__} takes one parameter group (x is one flat vector)")
        self.d = sum(p.numel() for p in self._params)
        self.dtype = self._params[0].dtype
        self._gens = [torch.Generator().manual_seed(self._worker_seed(i)) for i in range(self.n)]
        self._server_gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 999_983)
        self.bits_sent = 0
        self.rounds = 0
        self.grad_evals = 0.0
        if lr is None:
            self.param_groups[0]["lr"] = float(self.theory_lr())
        if not self.param_groups[0]["lr"] > 0:
            raise ConfigError(f"{type(self).__name__}: lr must be > 0, got {self.param_groups[0]['lr']!r}")

    # ------------------------------------------------------------------------------ helpers
    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def n_eff(self) -> int:
        """The n that divides the compression variance: n for independent compressors, 1 for shared seeds."""
        return self.n if (self.independent or not self.compressor.shared_randomness) else 1

    def _worker_seed(self, i: int) -> int:
        return self.seed * 1_000_003 + 7919 * (i + 1)

    def generators(self) -> list[torch.Generator]:
        """This round's generator of each worker: own streams, or one shared seed per round."""
        if self.independent or not self.compressor.shared_randomness:
            return self._gens
        s = int(torch.randint(0, 2 ** 62, (1,), generator=self._server_gen))
        return [torch.Generator().manual_seed(s) for _ in range(self.n)]

    def omega(self) -> float:
        """The compressor's declared variance constant for a length-d message."""
        w = float(self.compressor.omega(self.d))
        if not math.isfinite(w):
            raise SparseCommError(f"{type(self).__name__}: {self.compressor!r} is not unbiased "
                                  f"(omega = inf); this method needs a compressor in U(omega)")
        return w

    def delta(self) -> float:
        """The compressor's declared contraction constant for a length-d message."""
        dl = float(self.compressor.delta(self.d))
        if not dl > 0:
            raise SparseCommError(f"{type(self).__name__}: {self.compressor!r} declares delta = {dl}; "
                                  f"this method needs a contractive compressor (class B(delta))")
        return dl

    def flat_params(self) -> torch.Tensor:
        """x as one flat vector (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    @torch.no_grad()
    def _apply(self, direction: torch.Tensor, lr: float | None = None) -> None:
        """x -= lr * direction (flat)."""
        lr = self.lr if lr is None else lr
        off = 0
        for p in self._params:
            k = p.numel()
            p.add_(direction[off:off + k].reshape(p.shape).to(p.dtype), alpha=-lr)
            off += k

    def _local_grads(self, closure: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        if closure is not None:
            with torch.enable_grad():
                G = closure()
        elif self.problem is not None:
            G = self.problem.grads(self.flat_params())
        else:
            raise SparseCommError(f"{type(self).__name__}.step needs a closure returning the (n, d) local "
                                  f"gradients, or problem= at construction")
        G = torch.as_tensor(G)
        if G.shape != (self.n, self.d):
            raise MismatchError(f"{type(self).__name__}: expected ({self.n}, {self.d}) local gradients "
                                f"(n_workers, numel of x), got {tuple(G.shape)}")
        if not torch.isfinite(G).all():
            raise SparseCommError(f"{type(self).__name__}: non-finite local gradients (diverged? lr={self.lr:g})")
        self.grad_evals += 1.0
        return G.detach().to(self.dtype)

    def payload_bits(self, payload: Payload) -> int:
        """Wire bits of one message, as the payload declares them."""
        return int(payload.bits)

    def use_method(self, method: Method) -> None:
        """Drive the workers through ``method`` (hyper-parameters only), one fresh state per worker."""
        self.method = method
        self.states: list[MethodState] = [method.init(self.d, self.dtype) for _ in range(self.n)]

    def run_methods(self, method: Method, G: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """One round through the library's Method with every worker's state: encode on every worker, sum
        the decompressed payloads (what every transport returns), decode on every worker; returns the
        estimate."""
        gens = self.generators()
        states = self.states
        payloads = []
        for i in range(self.n):
            p, states[i] = method.encode(G[i], states[i], gens[i], world_size=self.n, exact=exact)
            payloads.append(p)
        aggregate = sum(p.to_dense() for p in payloads)
        while method.multi_round:
            nxt = []
            for i in range(self.n):
                q, states[i] = method.next_round(aggregate, self.n, states[i])
                nxt.append(q)
            if nxt[0] is None:
                break
            self.bits_sent += sum(self.payload_bits(p) for p in payloads)   # methods of several rounds
            payloads, aggregate = nxt, sum(p.to_dense() for p in nxt)
        est = None
        for i in range(self.n):
            e, states[i] = method.decode(aggregate, self.n, states[i])
            if est is None:
                est = e
        self.bits_sent += sum(self.payload_bits(p) for p in payloads)
        self.last_payloads = payloads
        return est

    # ------------------------------------------------------------------------------ API
    def theory_lr(self) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def _estimate(self, G: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """One round: local gradients at x (from ``closure()`` or ``problem``), compressed messages,
        aggregate, x -= lr * estimate. Returns the (n, d) local gradients."""
        G = self._local_grads(closure)
        direction = self._estimate(G)
        self._apply(direction)
        self.rounds += 1
        return G

    # ------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the simulation's: every worker's method state, the generators,
        the counters and the algorithm's own attributes. Loading it into a fresh optimizer built the same
        way continues the run exactly."""
        sd = super().state_dict()
        extra: dict[str, Any] = {
            "bits_sent": self.bits_sent, "rounds": self.rounds, "grad_evals": self.grad_evals,
            "generators": [g.get_state() for g in self._gens], "server_generator": self._server_gen.get_state(),
            "attrs": {a: _clone(getattr(self, a)) for a in self._state_attrs},
        }
        if hasattr(self, "states"):
            extra["methods"] = [states_to_dict(self.method, {0: st}) for st in self.states]
        sd["sparsecomm"] = extra
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("sparsecomm", None)
        super().load_state_dict(state_dict)
        if extra is None:
            return
        if len(extra["generators"]) != self.n:
            raise MismatchError(f"{type(self).__name__}: checkpoint of {len(extra['generators'])} workers, "
                                f"this optimizer has {self.n}")
        self.bits_sent, self.rounds, self.grad_evals = extra["bits_sent"], extra["rounds"], extra["grad_evals"]
        for g, st in zip(self._gens, extra["generators"]):
            g.set_state(st)
        self._server_gen.set_state(extra["server_generator"])
        for a, v in extra["attrs"].items():
            setattr(self, a, _clone(v))
        if "methods" in extra and hasattr(self, "states"):
            self.states = [states_from_dict(self.method, st).get(0) or self.method.init(self.d, self.dtype)
                           for st in extra["methods"]]

    def extra_repr(self) -> str:
        return f"n={self.n}, d={self.d}, compressor={self.compressor!r}, lr={self.lr:.4g}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
