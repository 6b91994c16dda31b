"""The same pipeline as a DDP communication hook, so compressors run under stock DistributedDataParallel.

>>> state = sc.ddp.CommHookState(compressor="topk", method="ef", ratio=0.01)       # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, sc.ddp.comm_hook)                           # doctest: +SKIP

``comm_hook(state, bucket) -> Future[Tensor]`` has the signature ``register_comm_hook`` expects. DDP
hands the hook each bucket's *local* gradients, flat and not divided by the world size; the hook
returns the *average* over workers: ``method.encode -> transport.allreduce -> method.decode``, the
method's ``decode`` dividing the aggregate by the world size (as ``allreduce_hook`` divides). The
transport call is synchronous, so the returned future is already completed (no overlap with the rest
of the backward pass).

:class:`CommHookState` follows ``PowerSGDState``: hyper-parameters (compressor, method, transport,
``warmup_steps``, ``min_compress_size``, ``seed``) apart from internal state (the method's per-bucket
state keyed by ``bucket.index()``, the generator, the iteration counter). DDP rebuilds its buckets
after the first iteration, so iteration 0 is always averaged uncompressed and bypasses the method
(no state is keyed by a pre-rebuild index); compression starts at iteration ``max(1, warmup_steps)``
and iterations ``1 .. warmup_steps - 1`` are exact rounds of the method (warm-starting its state).
Buckets with fewer than ``min_compress_size`` elements are averaged uncompressed (per bucket: a DDP
bucket mixes tensors). The process group, fabric and transport are never pickled (``__getstate__``);
unpickling rebinds to the default process group. ``state_dict()``/``load_state_dict()`` checkpoint the
internal state.

The fabric is the current :func:`sparsecomm.launch` worker's ``TorchFabric``, else a new ``TorchFabric``
over the default process group (only the default group is supported); the default transport
``"auto"`` is then ``native`` (``torch.distributed.all_reduce``) for dense payloads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .fabric.stats import CommStats
from .pipeline import CommPipeline

_HYPER = ("compressor", "transport", "method", "transport_kwargs", "warmup_steps", "min_compress_size",
          "seed", "hyper")


def _torch_fabric(process_group: Any) -> Any:
    """The fabric of the current :func:`sparsecomm.launch` worker, else a new TorchFabric over the
    default process group (a collective call: every rank builds its hook state)."""
    from .fabric.torch_fabric import TorchFabric
    from .launch import current_context

    if process_group is not None and process_group is not dist.group.WORLD and \
            process_group != dist.distributed_c10d._get_default_group():
        raise NotImplementedError("sparsecomm's DDP hook runs over the default process group only "
                                  "(TorchFabric); pass process_group=None")
    ctx = current_context()
    if ctx is not None and isinstance(ctx.fabric, TorchFabric):
        return ctx.fabric
    return TorchFabric()


class CommHookState:
    """Per-worker state of :func:`comm_hook` (see the module doc).

    ``CommHookState(process_group=None, compressor="none", transport="auto", *, method=None,
    transport_kwargs=None, warmup_steps=0, min_compress_size=0, seed=0, **hyper)``; ``compressor``,
    ``method``, ``transport`` and ``**hyper`` as for :class:`~sparsecomm.DistributedOptimizer`
    (objects are accepted but then the state cannot be pickled and rebuilt).
    """

    def __init__(self, process_group: Any = None, compressor: Any = "none", transport: Any = "auto", *,
                 method: str | None = None, transport_kwargs: dict | None = None, warmup_steps: int = 0,
                 min_compress_size: int = 0, seed: int = 0, **hyper: Any) -> None:
        if warmup_steps < 0 or min_compress_size < 0:
            raise ValueError("warmup_steps and min_compress_size must be non-negative")
        # hyper-parameters
        self.compressor = compressor
        self.transport = transport
        self.method = method
        self.transport_kwargs = dict(transport_kwargs or {})
        self.warmup_steps = int(warmup_steps)
        self.min_compress_size = int(min_compress_size)
        self.seed = int(seed)
        self.hyper = dict(hyper)
        # binding (never pickled)
        self.process_group = process_group
        self.pipeline = self._build()
        # internal state
        self.iter = 0
        self._iter_started = False

    def _build(self) -> CommPipeline:
        return CommPipeline(self.compressor, self.transport, method=self.method,
                            transport_kwargs=self.transport_kwargs or None,
                            fabric=_torch_fabric(self.process_group), seed=self.seed, **self.hyper)

    # ---------------------------------------------------------------- accessors
    @property
    def last_stats(self) -> CommStats:
        """The last iteration's CommStats summed over buckets (so far, during an iteration)."""
        return self.pipeline.last_stats

    def compression_stats(self) -> dict[str, float]:
        """Cumulative bytes before/after compression, their ratio (declared), and the transport's
        counters with the ratio measured on the wire (``ratio_sent``, ``sent_over_declared``)."""
        d = self.pipeline.totals().as_dict()
        d["iterations"] = self.iter
        return d

    # ---------------------------------------------------------------- hook body
    def reduce_bucket(self, buffer: torch.Tensor, index: int, is_last: bool) -> torch.Tensor:
        if not self._iter_started:
            self.pipeline.begin_step()
            self._iter_started = True
        flat = buffer.reshape(-1)
        compress = self.iter >= 1 and flat.numel() >= self.min_compress_size
        exact = self.iter < self.warmup_steps
        out = self.pipeline.reduce(flat, index, exact=exact, compress=compress)
        if is_last:
            self.iter += 1
            self._iter_started = False
        return out.to(buffer.dtype).reshape(buffer.shape)

    # ---------------------------------------------------------------- checkpoints / pickling
    def state_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline.state_dict(), "iter": self.iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(state["pipeline"])
        self.iter = int(state["iter"])
        self._iter_started = False

    def __getstate__(self) -> dict[str, Any]:
        return {"hyper": {k: getattr(self, k) for k in _HYPER}, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        for k, v in d["hyper"].items():
            setattr(self, k, v)
        self.process_group = None          # rebinds to the default process group
        self.pipeline = self._build()
        self.load_state_dict(d["state"])


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A ``register_comm_hook`` hook: the bucket's gradients averaged through the method and transport."""
    out = state.reduce_bucket(bucket.buffer(), bucket.index(), bucket.is_last())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut


# DDP validates the hook's annotations as objects (this module's are strings under PEP 563)
comm_hook.__annotations__.update(state=CommHookState, bucket=dist.GradBucket,
                                 **{"return": torch.futures.Future[torch.Tensor]})


def register(model: torch.nn.parallel.DistributedDataParallel, process_group: Any = None,
             **options: Any) -> CommHookState:
    """``model.register_comm_hook(CommHookState(process_group, **options), comm_hook)``; returns the state."""
    state = CommHookState(process_group, **options)
    model.register_comm_hook(state, comm_hook)
    return state
