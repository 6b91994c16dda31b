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

Backends are a registry: ``sim`` lives here; ``gloo`` and ``nccl`` (spawned processes, or the current
process under ``torchrun``) in :mod:`sparsecomm.launch_torch`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .errors import PeerFailure
from .fabric.base import Fabric
from .fabric.sim import EndpointCrashed, Network, SimWorld
from .registry import Registry

backends: Registry[Callable[..., list]] = Registry("launch backend")


@dataclass
class Context:
    """What ``fn`` receives on each worker."""

    rank: int
    world_size: int
    fabric: Fabric
    backend: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    network: Network | None = None


_local = threading.local()
_process_context: Context | None = None


def current_context() -> Context | None:
    """The :class:`Context` of the worker running this code, or ``None`` outside :func:`launch`."""
    return getattr(_local, "ctx", None) or _process_context


def set_context(ctx: Context | None, *, process_wide: bool = False) -> None:
    """Install ``ctx`` as the current context of this thread (or of the whole process)."""
    global _process_context
    if process_wide:
        _process_context = ctx
    else:
        _local.ctx = ctx


def launch(fn: Callable[[Context], Any], world_size: int, backend: str = "sim", *,
           network: Network | None = None, timeout_s: float | None = None,
           services: Sequence[str] = (), **options: Any) -> list[Any]:
    """Run ``fn(ctx)`` on ``world_size`` workers and return the per-rank results in rank order.

    ``backend``: ``"sim"`` (threads over a SimFabric with ``network``), ``"gloo"`` or ``"nccl"``
    (torch.distributed processes; ``services`` names the extra service ranks to start, e.g.
    ``["switch"]``). ``timeout_s`` bounds every wait.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in backends:
        from . import launch_torch  # noqa: F401  (registers gloo and nccl)
    if backend not in backends:
        from .netbed import launch as _netbed  # noqa: F401  (registers netbed)
    runner = backends.factory(backend)
    return runner(fn, world_size, network=network, timeout_s=timeout_s, services=services, **options)


@backends.register("sim")
def _launch_sim(fn: Callable[[Context], Any], world_size: int, *, network: Network | None = None,
                timeout_s: float | None = None, services: Sequence[str] = (), **options: Any) -> list[Any]:
    if options:
        raise TypeError(f"unexpected options for the sim backend: {sorted(options)}")
    network = network or Network()
    if timeout_s is not None:
        network = Network(**{**network.__dict__, "timeout_s": timeout_s})
    world = SimWorld(world_size, network)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException] | None] = [None] * world_size

    def run(rank: int) -> None:
        ctx = Context(rank, world_size, world.fabric(rank), "sim", torch.device("cpu"), network)
        set_context(ctx)
        try:
            results[rank] = fn(ctx)
            world.finished(rank)
        except EndpointCrashed as exc:
            errors[rank] = (rank, exc)
            world.finished(rank)  # a crash is silent: peers notice only by timing out
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = (rank, exc)
            world.fail(rank, exc)
        finally:
            set_context(None)

    threads = [threading.Thread(target=run, args=(r,), name=f"sparsecomm-worker{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    world.close()
    _raise_first(errors, world)
    return results


def _raise_first(errors: list[tuple[int, BaseException] | None], world: SimWorld | None = None) -> None:
    """Re-raise the root failure: the first error that is not a consequence of another rank's."""
    found = [e for e in errors if e is not None]
    if world is not None and world.service_errors:
        found = list(world.service_errors) + found
    if not found:
        return
    root = next((e for e in found if not isinstance(e[1], (PeerFailure, EndpointCrashed))), found[0])
    rank, exc = root
    if isinstance(exc, EndpointCrashed) and all(isinstance(e[1], EndpointCrashed) for e in found):
        # only crashed ranks failed and the survivors finished: nothing to report
        return
    exc.add_note(f"(raised on endpoint {rank} of {len(errors)} workers)")
    raise exc
