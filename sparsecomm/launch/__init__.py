"""Run a function on n workers: simulated (threads over a SimFabric) or real (torch.distributed).

>>> import sparsecomm as sc
>>> def fn(ctx):
...     return ctx.rank * 10
>>> sc.launch(fn, world_size=3, backend="sim")
[0, 10, 20]

``fn(ctx)`` runs on every worker with a :class:`Context` (``rank``, ``world_size``, ``fabric``,
``backend``, ``device``) and the per-rank return values come back in rank order. A failure on one
rank ends every rank: the others' waits raise :class:`~sparsecomm.errors.PeerFailure` and ``launch``
re-raises the failing rank's own error. Inside ``fn``, :func:`current_context` returns the context,
so that library objects (the optimizer, transports) find their fabric without being told.

**Randomness on the sim backend.** Simulated workers are threads of one process, and torch has one
global RNG per process (it cannot be forked per thread): ``torch.manual_seed(0); make_model()`` in
every worker interleaves the threads' draws, so the ranks' initial weights differ from run to run.
:class:`~sparsecomm.DistributedOptimizer` broadcasts rank 0's parameters and buffers at construction
(as DDP does), so the replicas start identical anyway; to build identical models deterministically
yourself, seed through the context: ``with ctx.seeded(0): model = make_model()`` runs the block
holding a process-wide lock with the global RNG seeded and restores the RNG afterwards (the same
draws on every rank, backend-independent), and ``ctx.generator(seed)`` is a fresh generator of this
worker's own for explicit draws (``torch.randn(..., generator=g)``).

Backends are a registry (:data:`backends`): ``sim`` in :mod:`.sim_backend`; ``gloo`` and ``nccl``
(spawned processes, or the current process under ``torchrun``) in :mod:`.torch_backend`, with the
supervision of spawned ranks in :mod:`.supervise` and the safe result encoding in :mod:`.results`;
``netbed`` in :mod:`sparsecomm.netbed.launch` (provided by the package's top, imported on first use).
The worker's :class:`Context` lives in the leaf module :mod:`.context`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from .. import trace as _trace
from ..fabric.sim.sim_network import Network
from .base import backends, check_main_guard
from .context import Context, current_context, set_context
from . import sim_backend  # noqa: F401  (registers "sim")
from ..validate import check_int, check_real

__all__ = ["launch", "Context", "current_context", "set_context", "backends", "check_main_guard"]

backends.provide("gloo", "sparsecomm.launch.torch_backend")
backends.provide("nccl", "sparsecomm.launch.torch_backend")


def launch(fn: Callable[[Context], Any], world_size: int, backend: str = "sim", *,
           network: Network | None = None, timeout_s: float | None = None,
           services: Sequence[str] = (), trace: str | os.PathLike | None = None, **options: Any) -> list[Any]:
    """Run ``fn(ctx)`` on ``world_size`` workers and return the per-rank results in rank order.

    ``backend``: ``"sim"`` (threads over a SimFabric with ``network``), ``"gloo"`` or ``"nccl"``
    (torch.distributed processes; ``services`` names the extra service ranks to start, e.g.
    ``["switch"]``). ``timeout_s`` bounds every wait. ``trace``: record the run's timeline
    (:mod:`sparsecomm.trace`) to that JSON file, every rank and service a process of it (real
    processes record ``trace.rankR.json`` each, joined into ``trace`` once they are done; under torchrun
    each rank keeps its own file); without it, the environment variable ``SPARSECOMM_TIMELINE`` names the
    file, unless a recording is open in this process already.

    Args:
        fn: runs on every worker with its :class:`Context`; its return value is that rank's result.
        world_size: the number of workers.
        backend: ``"sim"``, ``"gloo"``, ``"nccl"`` or ``"netbed"``.
        network: the modelled :class:`~sparsecomm.fabric.sim.sim_network.Network` (``sim``) or the links' rate
            (``netbed``).
        timeout_s: bound of every wait, seconds.
        services: service ranks to start beside the workers (``["switch"]``, ``["omnireduce-agg:0"]``).
        trace: the timeline file to write (default: ``$SPARSECOMM_TIMELINE``, else none).
        **options: backend options: ``start_method`` (gloo, nccl, netbed), ``pin_cores`` (gloo, nccl, netbed:
            each spawned rank on one core, in turn, :mod:`.torch_backend`), ``netbed_unshaped`` and
            ``on_netbed`` (netbed); an option the backend does not take raises.
    """
    world_size = check_int("world_size", world_size, low=1, what="sparsecomm.launch")
    if timeout_s is not None:
        timeout_s = check_real("timeout_s", timeout_s, low=0.0, low_open=True, what="sparsecomm.launch")
    runner = backends.factory(backend)
    if backend != "sim":
        check_main_guard()
    if trace is None and _trace.active() is None:
        trace = os.environ.get(_trace.ENV) or None
    if trace is not None:
        options["trace"] = os.fspath(trace)
    return runner(fn, world_size, network=network, timeout_s=timeout_s, services=services, **options)
