"""Distributed finite-sum test problems with known constants (float64 throughout).

A :class:`FiniteSumProblem` holds the data of n workers and exposes what the theory of DIANA, EF21,
MARINA and friends needs:

- local functions f_i(x) = (1/N_i) sum_j loss(a_ij, b_ij; x) + (lam/2)||x||^2 + nc_lam sum_l x_l^2/(1+x_l^2),
  f = (1/n) sum_i f_i (every worker weighs equally, whatever its N_i);
- ``L_i`` (smoothness of f_i), ``L_max = max L_i``, ``L_tilde = sqrt(mean L_i^2)``, ``L`` (of f),
  ``mu`` (strong convexity of f; ``None`` with the non-convex regulariser), ``L_sample_max`` (the largest
  smoothness of one sample's loss plus the regularisers, for variance-reduced methods);
- ``x_star`` to ~1e-13 gradient norm (Newton from scipy's Newton-CG; exact solve for least squares),
  ``grads_star`` = the local gradients at x* (zero only when every worker's data fits x*: interpolation),
  ``sigma_star_sq`` = (1/n) sum_i ||grad f_i(x*)||^2 (the heterogeneity that makes DCGD stall);
- gradients vectorised over workers: ``grads(x) -> (n, d)`` in one batched matmul; ``sample_grads``
  for stochastic (mini-batch) local gradients; ``loss``, ``hessians``.

Losses
------
``logistic``: loss = log(1 + exp(-b a^T x)) with b in {-1, +1}. Since sigma'(t) <= 1/4 with equality at
t = 0, the Hessian of f_i is at most A_i^T A_i/(4 N_i) + lam I (+ 2 nc_lam I), attained at x = 0, so
``L_i = lambda_max(A_i^T A_i)/(4 N_i) + lam + 2 nc_lam`` is exact (as in the
EF21 code ``L_i = lambda_max(A_i^T A_i/(4N_i) + 2 lam I)`` with their regulariser). ``mu = lam`` is the
global strong-convexity constant (the local curvature at x*, ``mu_local``, is larger).

``least_squares``: loss = (1/2)(a^T x - b)^2; L_i = lambda_max(A_i^T A_i/N_i) + lam and
mu = lambda_min((1/n) sum_i A_i^T A_i/N_i) + lam, both exact.

Non-convex regulariser (EF21 paper's experiments, arXiv 2106.05203): r(x) = nc_lam sum_l x_l^2/(1+x_l^2),
phi(t) = t^2/(1+t^2) has phi'' = (2 - 6t^2)/(1+t^2)^3 in [-1/2, 2] (derived), so r adds 2 nc_lam to
every smoothness constant and makes f non-convex in general (``mu = None``, ``x_star = None``).

Data
----
``load_dataset``: scikit-learn's bundled sets (no download): ``breast_cancer`` (569 x 30), ``digits``
(1797 x 64, binary: digit >= 5; constant pixels dropped -> d = 61), ``wine`` (178 x 13, class 0 vs rest),
``diabetes`` (442 x 10, regression); features standardised (zero mean, unit variance), optional bias
column. ``synthetic_*`` builders give a chosen condition number.

Splits (, RR code ``data_preprocessing.py``): ``"iid"`` (random permutation) or
``"label"`` (heterogeneous: rows sorted by label/target, stable, cut into contiguous chunks); equal chunks
of N // n rows, the remainder to the last worker.

Example
-------
>>> from sparsecomm.theory import problems
>>> p = problems.logistic("breast_cancer", n_workers=10, split="label", lam=1e-2)
>>> G = p.grads(p.x_star)                 # (10, 30): heterogeneous, so the rows are not 0 ...
>>> float(G.mean(0).norm()) < 1e-10       # ... but their mean (grad f(x*)) is
True
"""

# Longer than 400 lines because the problems share one machinery (datasets, splits, the exact L_i, mu
# and x* of every loss), which a split would have to import back from each piece.

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsecomm.errors import InvalidValueError

DTYPE = torch.float64
DATASETS = ("breast_cancer", "digits", "wine", "diabetes")
SPLITS = ("iid", "label")
LOSSES = ("logistic", "least_squares")


# ----------------------------------------------------------------------------------------- data
def load_dataset(name: str, *, bias: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Features (standardised, float64) and labels of a dataset bundled with scikit-learn.

    Classification sets return labels in {-1, +1}; ``diabetes`` returns the (standardised) target.
    Zero-variance columns are dropped before standardising; ``bias`` appends a column of ones.

    Args:
        name: ``"breast_cancer"``, ``"digits"``, ``"wine"`` or ``"diabetes"``.
        bias: see above.
    """
    from sklearn import datasets as skd

    if name == "breast_cancer":
        X, t = skd.load_breast_cancer(return_X_y=True)
        y = np.where(t == 1, 1.0, -1.0)
    elif name == "digits":
        X, t = skd.load_digits(return_X_y=True)
        y = np.where(t >= 5, 1.0, -1.0)
    elif name == "wine":
        X, t = skd.load_wine(return_X_y=True)
        y = np.where(t == 0, 1.0, -1.0)
    elif name == "diabetes":
        X, t = skd.load_diabetes(return_X_y=True)
        y = (t - t.mean()) / t.std()
    else:
        raise InvalidValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    return standardise(np.asarray(X, dtype=np.float64), bias=bias), np.asarray(y, dtype=np.float64)


def standardise(X: np.ndarray, *, bias: bool = False) -> np.ndarray:
    """Zero-mean, unit-variance columns (constant columns dropped); optionally a bias column.

    Args:
        X: the data matrix (rows are samples).
        bias: append a column of ones.
    """
    std = X.std(axis=0)
    keep = std > 1e-12 * max(1.0, float(np.abs(X).max()))
    X = (X[:, keep] - X[:, keep].mean(axis=0)) / std[keep]
    if bias:
        X = np.hstack([X, np.ones((X.shape[0], 1))])
    return X


def split_rows(y: np.ndarray, n_workers: int, split: str = "iid", seed: int = 0) -> list[np.ndarray]:
    """Row indices of each worker: equal contiguous chunks (N // n rows, remainder to the last worker)
    of a random permutation (``"iid"``) or of the rows stably sorted by label (``"label"``).

    Args:
        y: the labels (one per row).
        n_workers: workers.
        split: ``"iid"`` or ``"label"``.
        seed: seeds the ``"iid"`` permutation.
    """
    N = len(y)
    if not 1 <= n_workers <= N:
        raise InvalidValueError(f"need 1 <= n_workers <= number of rows ({N}), got {n_workers}")
    if split == "iid":
        order = np.random.default_rng(seed).permutation(N)
    elif split == "label":
        order = np.argsort(y, kind="stable")
    else:
        raise InvalidValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    size = N // n_workers
    return [order[i * size:(i + 1) * size] if i < n_workers - 1 else order[i * size:]
            for i in range(n_workers)]


# -------------------------------------------------------------------------------------- problem
@dataclass
class FiniteSumProblem:
    """n workers, worker i holding rows ``A_i`` (N_i x d) and labels/targets ``b_i``; see module doc.

    Data is stored padded, ``A`` (n, M, d) with M = max N_i and per-row weights ``w`` (n, M) equal to
    1/N_i on real rows and 0 on padding, so every per-worker quantity is one batched tensor op.

    Args:
        A_blocks: each worker's rows A_i, (N_i, d).
        b_blocks: each worker's labels or targets b_i, (N_i,).
        loss_name: ``"logistic"`` or ``"least_squares"``.
        lam: the l2 weight (>= 0).
        nc_lam: the non-convex regulariser's weight (>= 0; module doc).
        name: a label for tables and plots.
    """

    A_blocks: list[torch.Tensor]
    b_blocks: list[torch.Tensor]
    loss_name: str = "logistic"
    lam: float = 0.0
    nc_lam: float = 0.0
    name: str = ""
    A: torch.Tensor = field(init=False, repr=False)
    b: torch.Tensor = field(init=False, repr=False)
    w: torch.Tensor = field(init=False, repr=False)
    counts: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.loss_name not in LOSSES:
            raise InvalidValueError(f"unknown loss {self.loss_name!r}; valid: {', '.join(LOSSES)}")
        if self.lam < 0 or self.nc_lam < 0:
            raise InvalidValueError("lam and nc_lam must be >= 0")
        n = len(self.A_blocks)
        d = self.A_blocks[0].shape[1]
        M = max(a.shape[0] for a in self.A_blocks)
        self.A = torch.zeros(n, M, d, dtype=DTYPE)
        self.b = torch.zeros(n, M, dtype=DTYPE)
        self.w = torch.zeros(n, M, dtype=DTYPE)
        for i, (a, y) in enumerate(zip(self.A_blocks, self.b_blocks)):
            self.A[i, : a.shape[0]] = a
            self.b[i, : a.shape[0]] = y
            self.w[i, : a.shape[0]] = 1.0 / a.shape[0]
        self.counts = torch.tensor([a.shape[0] for a in self.A_blocks], dtype=torch.long)
        self._constants()
        self.x_star, self.f_star = (self._solve() if self.convex else (None, None))
        if self.x_star is not None:
            self.grads_star = self.grads(self.x_star)
            self.sigma_star_sq = float((self.grads_star ** 2).sum(1).mean())
            self.mu_local = float(torch.linalg.eigvalsh(self.hessian(self.x_star))[0])
        else:
            self.grads_star, self.sigma_star_sq, self.mu_local = None, None, None

    # ---------------------------------------------------------------------------- sizes
    @property
    def n(self) -> int:
        """Number of workers."""
        return self.A.shape[0]

    @property
    def d(self) -> int:
        """Dimension of x."""
        return self.A.shape[2]

    @property
    def N(self) -> int:
        """Total number of rows."""
        return int(self.counts.sum())

    @property
    def convex(self) -> bool:
        """Whether f is convex (no non-convex regulariser)."""
        return self.nc_lam == 0.0

    @property
    def kappa(self) -> float:
        """L / mu."""
        return self.L / self.mu

    @property
    def kappa_max(self) -> float:
        """L_max / mu (the condition number DIANA's theory uses)."""
        return self.L_max / self.mu

    # ------------------------------------------------------------------------ constants
    def _curvature_scale(self) -> float:
        return 0.25 if self.loss_name == "logistic" else 1.0

    def _constants(self) -> None:
        c = self._curvature_scale()
        reg = self.lam + 2.0 * self.nc_lam
        # (n, d, d) weighted Gram matrices A_i^T A_i / N_i
        grams = torch.einsum("nmd,nm,nme->nde", self.A, self.w, self.A)
        ev = torch.linalg.eigvalsh(grams)
        self.L_i = (c * ev[:, -1] + reg).clone()
        self.L_max = float(self.L_i.max())
        self.L_tilde = float(torch.sqrt((self.L_i ** 2).mean()))
        gbar = grams.mean(0)
        evf = torch.linalg.eigvalsh(gbar)
        self.L = float(c * evf[-1] + reg)
        if self.convex:
            self.mu = float((evf[0] if self.loss_name == "least_squares" else 0.0) + self.lam)
            if self.mu <= 0:
                self.mu = None
        else:
            self.mu = None
        row_sq = (self.A ** 2).sum(2)                                  # (n, M) ||a_ij||^2
        self.L_sample_max = float(c * row_sq.max() + reg)

    # --------------------------------------------------------------------- evaluation
    def _X(self, x: torch.Tensor) -> torch.Tensor:
        """x as (n, d): a single point broadcast to every worker, or one point per worker."""
        x = torch.as_tensor(x, dtype=DTYPE)
        if x.dim() == 1:
            if x.numel() != self.d:
                raise InvalidValueError(f"x has {x.numel()} entries, the problem has d = {self.d}")
            return x.unsqueeze(0).expand(self.n, -1)
        if x.shape != (self.n, self.d):
            raise InvalidValueError(f"x must be ({self.d},) or ({self.n}, {self.d}), got {tuple(x.shape)}")
        return x

    def _margins(self, X: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nmd,nd->nm", A, X)

    def _loss_terms(self, z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.loss_name == "logistic":
            return torch.nn.functional.softplus(-b * z)
        return 0.5 * (z - b) ** 2

    def _dloss(self, z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """d loss / d margin."""
        if self.loss_name == "logistic":
            return -b * torch.sigmoid(-b * z)
        return z - b

    def _reg_value(self, X: torch.Tensor) -> torch.Tensor:
        val = 0.5 * self.lam * (X ** 2).sum(-1)
        if self.nc_lam:
            val = val + self.nc_lam * (X ** 2 / (1 + X ** 2)).sum(-1)
        return val

    def _reg_grad(self, X: torch.Tensor) -> torch.Tensor:
        g = self.lam * X
        if self.nc_lam:
            g = g + self.nc_lam * 2 * X / (1 + X ** 2) ** 2
        return g

    def local_losses(self, x: torch.Tensor) -> torch.Tensor:
        """(n,) the values f_i(x) (or f_i(x_i) for a per-worker (n, d) input)."""
        X = self._X(x)
        z = self._margins(X, self.A)
        return (self.w * self._loss_terms(z, self.b)).sum(1) + self._reg_value(X)

    def loss(self, x: torch.Tensor) -> float:
        """f(x) = (1/n) sum_i f_i(x)."""
        return float(self.local_losses(x).mean())

    def grads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) local gradients grad f_i(x) (row i at x[i] for an (n, d) input), one batched op."""
        X = self._X(x)
        z = self._margins(X, self.A)
        coef = self.w * self._dloss(z, self.b)                          # (n, M)
        return torch.einsum("nm,nmd->nd", coef, self.A) + self._reg_grad(X)

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        """(d,) the gradient of f.

        Args:
            x: the point, (d,).
        """
        return self.grads(x).mean(0)

    def grad_norm_sq(self, x: torch.Tensor) -> float:
        """||grad f(x)||^2."""
        return float((self.grad(x) ** 2).sum())

    def sample_indices(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n, batch_size) row indices drawn uniformly with replacement from each worker's own rows.

        Args:
            batch_size: rows per worker.
            generator: the randomness.
        """
        u = torch.rand(self.n, batch_size, generator=generator, dtype=DTYPE)
        return torch.minimum((u * self.counts.unsqueeze(1)).long(), (self.counts - 1).unsqueeze(1))

    def sample_grads(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(n, d) mini-batch local gradients: row i is the mean over j in ``idx[i]`` of
        grad f_ij(x) = grad loss(a_ij; x) + regulariser gradient (an unbiased estimate of grad f_i)."""
        X = self._X(x)
        Ab = torch.gather(self.A, 1, idx.unsqueeze(-1).expand(-1, -1, self.d))   # (n, b, d)
        bb = torch.gather(self.b, 1, idx)
        z = self._margins(X, Ab)
        coef = self._dloss(z, bb) / idx.shape[1]
        return torch.einsum("nb,nbd->nd", coef, Ab) + self._reg_grad(X)

    def hessians(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d, d) local Hessians at x."""
        X = self._X(x)
        z = self._margins(X, self.A)
        if self.loss_name == "logistic":
            s = torch.sigmoid(z)
            curv = s * (1 - s)
        else:
            curv = torch.ones_like(z)
        H = torch.einsum("nmd,nm,nme->nde", self.A, self.w * curv, self.A)
        diag = torch.full_like(X, self.lam)
        if self.nc_lam:
            diag = diag + self.nc_lam * (2 - 6 * X ** 2) / (1 + X ** 2) ** 3
        return H + torch.diag_embed(diag)

    def hessian(self, x: torch.Tensor) -> torch.Tensor:
        """(d, d) Hessian of f.

        Args:
            x: the point, (d,).
        """
        return self.hessians(x).mean(0)

    # --------------------------------------------------------------------------- x*
    def _solve(self) -> tuple[torch.Tensor | None, float | None]:
        """x* = argmin f to ~machine precision: exact normal equations for least squares, otherwise
        scipy Newton-CG followed by full Newton steps until the gradient norm stops decreasing."""
        if self.mu is None:
            return None, None
        if self.loss_name == "least_squares":
            H = self.hessian(torch.zeros(self.d, dtype=DTYPE))
            rhs = -self.grad(torch.zeros(self.d, dtype=DTYPE))
            x = torch.linalg.solve(H, rhs)
        else:
            from scipy.optimize import minimize

            res = minimize(lambda v: self.loss(torch.from_numpy(v)), np.zeros(self.d),
                           jac=lambda v: self.grad(torch.from_numpy(v)).numpy(),
                           hess=lambda v: self.hessian(torch.from_numpy(v)).numpy(),
                           method="Newton-CG", options={"xtol": 1e-14, "maxiter": 500})
            x = torch.from_numpy(np.asarray(res.x, dtype=np.float64))
        best = float(self.grad(x).norm())
        for _ in range(20):  # Newton polish (quadratic convergence from close by)
            step = torch.linalg.solve(self.hessian(x), self.grad(x))
            x_new = x - step
            gn = float(self.grad(x_new).norm())
            if not gn < best:
                break
            x, best = x_new, gn
        return x, self.loss(x)

    def __repr__(self) -> str:
        mu = "None" if self.mu is None else f"{self.mu:.3g}"
        return (f"FiniteSumProblem({self.name or self.loss_name}, n={self.n}, d={self.d}, N={self.N}, "
                f"L={self.L:.3g}, L_max={self.L_max:.3g}, L_tilde={self.L_tilde:.3g}, mu={mu})")


# ------------------------------------------------------------------------------------ builders
def from_arrays(X: np.ndarray, y: np.ndarray, *, loss: str = "logistic", n_workers: int = 10,
                split: str = "iid", lam: float | None = None, kappa: float | None = None,
                nc_lam: float = 0.0, seed: int = 0, name: str = "") -> FiniteSumProblem:
    """A problem from a data matrix: split the rows over ``n_workers`` and pick the l2 weight.

    Exactly one of ``lam`` and ``kappa`` may be given; ``kappa`` sets lam so that L/mu = kappa, i.e.
    lam = L0/(kappa - 1) with L0 the smoothness of the unregularised f (and, for least squares, its
    smallest curvature taken into account). Neither: lam = 0 (then mu may be None).

    Args:
        X: the data matrix.
        y: labels in {-1, +1} (logistic) or targets.
        loss: ``"logistic"`` or ``"least_squares"``.
        n_workers: workers.
        split: as for :func:`split_rows`.
        lam: see above.
        kappa: see above.
        nc_lam: the non-convex regulariser's weight.
        seed: seeds the split.
        name: a label.
    """
    if lam is not None and kappa is not None:
        raise InvalidValueError("give lam or kappa, not both")
    parts = split_rows(y, n_workers, split, seed)
    A_blocks = [torch.from_numpy(np.ascontiguousarray(X[p])) for p in parts]
    b_blocks = [torch.from_numpy(np.ascontiguousarray(y[p])) for p in parts]
    if kappa is not None:
        if kappa <= 1:
            raise InvalidValueError(f"kappa must be > 1, got {kappa}")
        c = 0.25 if loss == "logistic" else 1.0
        grams = [a.T @ a / a.shape[0] for a in A_blocks]
        ev = torch.linalg.eigvalsh(torch.stack(grams).mean(0))
        L0, m0 = c * float(ev[-1]), (float(ev[0]) if loss == "least_squares" else 0.0)
        # (L0 + lam) / (m0 + lam) = kappa
        lam = max((L0 - kappa * m0) / (kappa - 1), 0.0)
        if lam == 0.0:
            raise InvalidValueError(f"the data alone is better conditioned than kappa={kappa}")
    return FiniteSumProblem(A_blocks, b_blocks, loss, float(lam or 0.0), float(nc_lam), name)


def logistic(dataset: str = "breast_cancer", *, n_workers: int = 10, split: str = "iid",
             lam: float | None = None, kappa: float | None = None, nc_lam: float = 0.0,
             bias: bool = False, seed: int = 0) -> FiniteSumProblem:
    """l2-regularised logistic regression on a bundled scikit-learn dataset (see module doc).

    Args:
        dataset: a name of :func:`load_dataset`.
        n_workers: workers.
        split: as for :func:`split_rows`.
        lam: as for :func:`from_arrays`.
        kappa: as for :func:`from_arrays`.
        nc_lam: the non-convex regulariser's weight.
        bias: append a bias column.
        seed: seeds the split.
    """
    X, y = load_dataset(dataset, bias=bias)
    return from_arrays(X, y, loss="logistic", n_workers=n_workers, split=split, lam=lam, kappa=kappa,
                       nc_lam=nc_lam, seed=seed, name=f"logistic/{dataset}/{split}")


def least_squares(dataset: str = "diabetes", *, n_workers: int = 10, split: str = "iid",
                  lam: float | None = None, kappa: float | None = None, nc_lam: float = 0.0,
                  bias: bool = False, seed: int = 0) -> FiniteSumProblem:
    """(l2-regularised) least squares on a bundled dataset; classification sets regress the +-1 labels.
    ``dataset``, ``n_workers``, ``split``, ``lam``, ``kappa``, ``nc_lam``, ``bias`` and ``seed`` as for
    :func:`logistic`."""
    X, y = load_dataset(dataset, bias=bias)
    return from_arrays(X, y, loss="least_squares", n_workers=n_workers, split=split, lam=lam,
                       kappa=kappa, nc_lam=nc_lam, seed=seed, name=f"least_squares/{dataset}/{split}")


def _spectrum_matrix(N: int, d: int, eig: np.ndarray, rng: np.random.Generator,
                     V: np.ndarray | None = None) -> np.ndarray:
    """An N x d matrix with A^T A / N = V diag(eig) V^T exactly (V random orthogonal unless given)."""
    if N < d:
        raise InvalidValueError(f"need at least d = {d} rows, got {N}")
    Q, _ = np.linalg.qr(rng.standard_normal((N, d)))          # Q^T Q = I
    if V is None:
        V, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return math.sqrt(N) * Q @ np.diag(np.sqrt(eig)) @ V.T


def synthetic_logistic(*, n_workers: int = 20, rows_per_worker: int = 50, d: int = 100,
                       kappa: float = 1e3, split: str = "label", noise: float = 0.1,
                       nc_lam: float = 0.0, seed: int = 0) -> FiniteSumProblem:
    """Logistic regression on Gaussian features with a decaying spectrum (eigenvalues of A^T A/N
    geometric from 1 to 1e-2), labels sign(a^T x_true) flipped with probability ``noise``, and lam
    chosen so that L/mu = kappa exactly (mu = lam).

    Args:
        n_workers: workers.
        rows_per_worker: rows each.
        d: features.
        kappa: L/mu.
        split: as for :func:`split_rows`.
        noise: see above.
        nc_lam: the non-convex regulariser's weight.
        seed: seeds the data and the split.
    """
    rng = np.random.default_rng(seed)
    N = n_workers * rows_per_worker
    eig = np.geomspace(1.0, 1e-2, d)
    X = _spectrum_matrix(N, d, eig, rng)
    x_true = rng.standard_normal(d)
    y = np.sign(X @ x_true + 1e-12)
    flip = rng.random(N) < noise
    y[flip] = -y[flip]
    return from_arrays(X, y, loss="logistic", n_workers=n_workers, split=split, kappa=kappa,
                       nc_lam=nc_lam, seed=seed, name=f"logistic/synthetic(d={d},kappa={kappa:g})/{split}")


def synthetic_least_squares(*, n_workers: int = 10, rows_per_worker: int = 50, d: int = 40,
                            kappa: float = 10.0, split: str = "iid", interpolate: bool = True,
                            homogeneous: bool = False, noise: float = 1.0, lam: float = 0.0,
                            seed: int = 0) -> FiniteSumProblem:
    """Least squares whose f has condition number exactly ``kappa`` (lam = 0): A^T A/N has eigenvalues
    geometric from 1 to 1/kappa.

    ``interpolate``: b = A x_true, so grad f_i(x*) = 0 on every worker (the regime of the "99%" paper's
    IS-SGD); otherwise Gaussian noise of scale ``noise`` is added to b. ``homogeneous``: every worker gets
    its own rows but the same Gram matrix, A_i^T A_i/N_i = A^T A/N (needs rows_per_worker >= d), so
    L_i = L_max = L_tilde = L and the "99%" prediction kappa (1 + omega/n) holds with one kappa; ``split`` is
    then ignored (each worker's block is generated in place).

    Args:
        n_workers: workers.
        rows_per_worker: rows each.
        d: features.
        kappa: see above.
        split: as for :func:`split_rows`.
        interpolate: see above.
        homogeneous: see above.
        noise: see above.
        lam: the l2 weight.
        seed: seeds the data and the split.
    """
    rng = np.random.default_rng(seed)
    N = n_workers * rows_per_worker
    eig = np.geomspace(1.0, 1.0 / kappa, d)
    x_true = rng.standard_normal(d)
    tag = f"least_squares/synthetic(d={d},kappa={kappa:g}{',homogeneous' if homogeneous else ''})"
    if homogeneous:
        V, _ = np.linalg.qr(rng.standard_normal((d, d)))
        blocks = [_spectrum_matrix(rows_per_worker, d, eig, rng, V) for _ in range(n_workers)]
        targets = [a @ x_true + (0.0 if interpolate else noise * rng.standard_normal(rows_per_worker))
                   for a in blocks]
        return FiniteSumProblem([torch.from_numpy(a) for a in blocks], [torch.from_numpy(t) for t in targets],
                                "least_squares", float(lam), 0.0, tag)
    X = _spectrum_matrix(N, d, eig, rng)
    y = X @ x_true
    if not interpolate:
        y = y + noise * rng.standard_normal(N)
    return from_arrays(X, y, loss="least_squares", n_workers=n_workers, split=split, lam=lam,
                       seed=seed, name=f"{tag}/{split}")
