"""Bucket -> round -> gradient: how :class:`~sparsecomm.optim.DistributedOptimizer` runs one
synchronisation over its buckets (a mixin of the optimizer; the rules are in :mod:`sparsecomm.optim`,
"Step", "Overlap" and "Sparse gradients"): the layout (rebuilt when the parameters change), the
agreement on the sparse-gradient parameters at the first synchronisation, the post-accumulate-grad
hooks that start each complete bucket in the one fixed order during backward, and
:meth:`BucketRounds.synchronize`, which starts what is left, waits and scatters the estimates into
``p.grad``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from .buckets import Bucket as _Bucket, layout as _layout
from .errors import MismatchError, SparseCommError


class BucketRounds:
    """The synchronisation half of :class:`~sparsecomm.optim.DistributedOptimizer`."""

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _layout(self) -> list[_Bucket]:
        params = self._trainable()
        ids = tuple(id(p) for p in params)
        if self._sc_buckets is None or ids != self._sc_param_ids:
            if self._sc_buckets is not None:
                warnings.warn("DistributedOptimizer: the parameters changed; the buckets are rebuilt and "
                              "the method state is reset", RuntimeWarning, stacklevel=3)
                self._sc_pipeline.reset_states()
                self._sc_sparse = None
            self._build_layout(params)
        return self._sc_buckets  # type: ignore[return-value]

    def _build_layout(self, params: list[torch.nn.Parameter]) -> None:
        self._sc_buckets = _layout(params, self._sc_cap_bytes, self._sc_min_compress,
                                   self._sc_sparse or frozenset())
        self._sc_param_ids = tuple(id(p) for p in params)
        self._sc_order = list(reversed(self._sc_buckets))
        self._sc_bucket_of = {id(p): b for b in self._sc_buckets for p in b.params}
        for h in self._sc_hooks:
            h.remove()
        self._sc_hooks = []
        if self._sc_overlap:
            for p in params:
                self._sc_hooks.append(p.register_post_accumulate_grad_hook(self._sc_grad_ready))

    def _agree_sparse(self) -> None:
        """First synchronisation: agree on the parameters with sparse gradients; rebuild the layout if
        there are any (each gets a bucket of its own)."""
        params = self._trainable()
        flags = torch.tensor([1.0 if p.grad is not None and p.grad.is_sparse else 0.0 for p in params],
                             dtype=torch.float32)
        if self._sc_pipeline.world_size > 1 and flags.numel():
            flags = self._sc_pipeline.transport.allreduce(flags)
        self._sc_sparse = frozenset(id(p) for p, f in zip(params, flags.tolist()) if f > 0)
        if self._sc_sparse:
            if self._sc_pipeline.keys():
                raise MismatchError("the method has state for a layout without the sparse-gradient "
                                    "buckets (a checkpoint loaded before the first step); load it after one step")
            self._build_layout(params)

    def _sc_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: start every bucket that is complete, in the fixed order."""
        if self._sc_sparse is None or self._sc_synced:
            return    # the first step (sparse gradients not agreed yet), or a backward after synchronize()
        n = self._sc_fired.get(id(p), 0) + 1
        self._sc_fired[id(p)] = n
        if n > self._sc_passes:
            raise SparseCommError(
                f"a gradient was accumulated {n} times before step() but backward_passes_per_step="
                f"{self._sc_passes}: its bucket was already started with the first gradient. Pass "
                f"backward_passes_per_step={n} (gradient accumulation) or overlap=False")
        if n != self._sc_passes:
            return
        b = self._sc_bucket_of.get(id(p))
        if b is None:
            return
        b.ready += 1
        with torch.no_grad():
            while self._sc_next < len(self._sc_order):
                nb = self._sc_order[self._sc_next]
                if nb.ready < len(nb.params):
                    break
                self._start_bucket(nb)

    def _start_bucket(self, b: _Bucket) -> None:
        pipe = self._sc_pipeline
        if not self._sc_in_step:
            pipe.begin_step()
            self._sc_in_step = True
        if b.sparse and self._sparse_payloads():
            p = b.params[0]
            work = pipe.start_sparse(p.grad, p.shape, b.key, p.dtype)
        else:
            work = pipe.start(b.gather(), b.key, compress=b.compress,
                              shapes=[p.shape for p in b.params])
        self._sc_works.append((b, work))
        self._sc_next += 1

    def _sparse_payloads(self) -> bool:
        return self._sc_pipeline._plain

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the gradients over workers now: start the buckets not started yet (in the fixed
        order) and wait for all of them."""
        if self._sc_sparse is None:
            self._layout()
            self._agree_sparse()
        self._layout()
        try:
            while self._sc_next < len(self._sc_order):
                self._start_bucket(self._sc_order[self._sc_next])
            sparse = self._sc_sparse or frozenset()
            for b, work in self._sc_works:
                est = work.wait()
                if b.sparse and self._sparse_payloads():
                    b.params[0].grad = est
                else:
                    b.scatter(est, sparse)
        finally:
            self._sc_reset_round()
        self._sc_steps += 1
        self._sc_synced = True

    def _sc_reset_round(self) -> None:
        for b in self._sc_order:
            b.ready = 0
        self._sc_works = []
        self._sc_next = 0
        self._sc_fired = {}
        self._sc_in_step = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's pattern: ``synchronize(); clip(...); with opt.skip_synchronize(): opt.step()``."""
        self._sc_skip = True
        try:
            yield
        finally:
            self._sc_skip = False
