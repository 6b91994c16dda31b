"""Service mains by name, so that a separate process (a torch.distributed rank started by the
launcher) can run the same service loop that a SimFabric runs as a thread.

A service spec is ``"name"`` or ``"name:arg"`` (e.g. ``"switch"``, ``"omnireduce-agg:2"``). The module
that implements a service registers a factory ``factory(arg: str | None) -> main`` where
``main(fabric)`` is the service loop; it must return (or let :class:`ServiceShutdown` propagate) when
the run ends. On SimFabric a transport passes ``main`` to ``fabric.service(spec, main)`` directly; on
TorchFabric the launcher starts one extra rank per spec in ``launch(..., services=[...])`` and that
rank runs ``resolve(spec)(fabric)``.

The registry is filled from above: a module registers its services when it is imported (the transports
do), and whoever resolves a spec (the launcher, which sits above the transports) imports the providers
first. This module never imports a higher layer.
"""

from __future__ import annotations

from typing import Callable

from ..errors import UnknownNameError
from ..registry import Registry

registry: Registry[Callable] = Registry("service")


def resolve(spec: str) -> Callable:
    """The service loop ``main(fabric)`` for ``spec`` (its provider must have been imported)."""
    name, _, arg = spec.partition(":")
    try:
        return registry.get(name, arg or None)
    except UnknownNameError as exc:
        exc.add_note("a service is registered when the module that provides it is imported (the library's "
                     "own: import sparsecomm.transports; the launcher does so before it resolves a spec)")
        raise
