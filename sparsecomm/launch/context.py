"""The worker's :class:`Context` and :func:`current_context`: what ``fn`` receives from
:func:`sparsecomm.launch`, and how library objects (the optimizer, transports) find their fabric without
being told. A leaf module: every backend and every layer that looks for the current worker imports it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from ..fabric.base import Fabric

if TYPE_CHECKING:
    from ..fabric.sim.sim_network import Network


@dataclass
class Context:
    """What ``fn`` receives on each worker.

    Args:
        rank: this worker's rank, ``0 .. world_size - 1``.
        world_size: the number of workers (service ranks, such as a switch, not counted).
        fabric: this worker's :class:`~sparsecomm.fabric.base.Fabric` (a ``SimFabric`` on ``sim``, a
            ``TorchFabric`` otherwise).
        backend: the backend ``launch`` ran: ``"sim"``, ``"gloo"``, ``"nccl"`` or ``"netbed"``.
        device: where this worker's tensors live (``cpu``, or its GPU on ``nccl``).
        network: the modelled :class:`~sparsecomm.fabric.sim.sim_network.Network` on ``sim``, else ``None``.
    """

    rank: int
    world_size: int
    fabric: Fabric
    backend: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    network: Network | None = None

    def generator(self, seed: int = 0) -> torch.Generator:
        """A new generator on ``device`` seeded ``seed`` (pass ``seed + rank`` for per-rank draws)."""
        return torch.Generator(device=self.device).manual_seed(int(seed))

    @contextlib.contextmanager
    def seeded(self, seed: int = 0) -> Iterator[None]:
        """Run the block with torch's global RNG seeded ``seed``, holding a process-wide lock (other
        workers' ``seeded`` blocks wait), and restore the RNG state afterwards: ``with
        ctx.seeded(0): model = make_model()`` builds the same model on every rank, also on the sim
        backend, where the workers are threads sharing the one global RNG."""
        with _rng_lock, torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            yield


_local = threading.local()
_rng_lock = threading.RLock()
_process_context: Context | None = None


def current_context() -> Context | None:
    """The :class:`Context` of the worker running this code, or ``None`` outside :func:`launch`."""
    return getattr(_local, "ctx", None) or _process_context


def set_context(ctx: Context | None, *, process_wide: bool = False) -> None:
    """Install ``ctx`` as the current context of this thread (or of the whole process).

    Args:
        ctx: the context to install (``None`` clears it).
        process_wide: install it for every thread of the process (the torch backends' ranks, one process
            each), not only this thread.
    """
    global _process_context
    if process_wide:
        _process_context = ctx
    else:
        _local.ctx = ctx
