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

Backends are a registry: ``sim`` lives here; ``gloo`` and ``nccl`` (spawned processes, or the current
process under ``torchrun``) in :mod:`sparsecomm.launch_torch`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

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
    if backend != "sim":
        check_main_guard()
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
            from .transports.base import drain   # lazily: importing sparsecomm stays light

            drain(ctx.fabric)     # calls started but never waited for finish before the endpoint retires
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


def check_main_guard() -> None:
    """Raise a clear error when ``launch`` (of a backend that spawns processes) is called from a script's
    module level outside ``if __name__ == "__main__":``: each spawned rank re-imports the script (Python's
    ``spawn``/``forkserver`` start methods), would call ``launch`` again and die while bootstrapping,
    and the parent would only see ranks exiting with code 1."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py"):
        return
    try:
        from .launch_torch import _in_place

        if _in_place():
            return                 # under torchrun (or an initialised process group): nothing spawns
    except Exception:  # noqa: BLE001 - the check is advisory
        pass
    import inspect

    line = None
    for info in inspect.stack(0):
        if info.frame.f_globals is main.__dict__ and info.function == "<module>":
            line = info.lineno
    if line is None:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    from .errors import SparseCommError

    raise SparseCommError(
        f"{path}, line {line}: sc.launch(...) with a backend that spawns processes must run under "
        f"`if __name__ == \"__main__\":` (each spawned rank re-imports this script and would launch "
        f"again); put the launch call (and code that should run once) inside that block")


def _is_main_test(test: Any) -> bool:
    import ast

    if not isinstance(test, ast.Compare) or len(test.comparators) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


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
