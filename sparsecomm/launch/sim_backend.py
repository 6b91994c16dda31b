"""The ``sim`` backend of :func:`sparsecomm.launch`: workers as threads over one simulated world."""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ..errors import EndpointCrashed, InvalidTypeError, PeerFailure
from ..fabric.engine import drain
from ..trace import record
from ..fabric.sim.sim import SimWorld
from ..fabric.sim.sim_network import Network
from .base import backends
from .context import Context, set_context


@backends.register("sim")
def _launch_sim(fn: Callable[[Context], Any], world_size: int, *, network: Network | None = None,
                timeout_s: float | None = None, services: Sequence[str] = (), trace: str | None = None,
                **options: Any) -> list[Any]:
    if options:
        raise InvalidTypeError(f"unexpected options for the sim backend: {sorted(options)}")
    if trace is not None:     # the simulated world is this process: one file, every endpoint a process of it
        with record(trace):
            return _launch_sim(fn, world_size, network=network, timeout_s=timeout_s, services=services)
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
