"""Service mains by name, so that a separate process (a torch.distributed rank started by the
launcher) can run the same service loop that a SimFabric runs as a thread.

A service spec is ``"name"`` or ``"name:arg"`` (e.g. ``"switch"``, ``"omnireduce-agg:2"``); a service
whose program is a dataclass of integer constants writes ``arg`` as ``field=value,...`` with the fields
that differ from their defaults (:func:`config_spec`, :func:`parse_config`). The module
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

from dataclasses import fields
from typing import Any, Callable

from ..errors import InvalidValueError, UnknownNameError
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


def config_spec(name: str, config: Any) -> str:
    """The spec naming the dataclass ``config`` as service ``name``: ``"name"`` at its defaults, else
    ``"name:field=value,..."`` for the fields that differ (booleans as 0/1)."""
    parts = [f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in fields(config)
             if (v := getattr(config, f.name)) != f.default]
    return name + (":" + ",".join(parts) if parts else "")


def parse_config(cls: type, name: str, arg: str | None, bare: str) -> Any:
    """Inverse of :func:`config_spec` for the part after ``name:``: comma-separated ``field=integer`` (a
    field whose default is a boolean takes 0/1), a bare integer standing for field ``bare``. An unknown
    field or a value that is not an integer is :class:`~sparsecomm.errors.InvalidValueError` naming the
    valid fields."""
    if not arg:
        return cls()
    flags = {f.name: isinstance(f.default, bool) for f in fields(cls)}
    kw: dict = {}
    for item in arg.split(","):
        key, eq, val = item.partition("=")
        if not eq:
            key, val = bare, key
        if key not in flags:
            raise InvalidValueError(f"unknown {name} option {key!r} in {arg!r}; valid: {', '.join(flags)}")
        try:
            kw[key] = bool(int(val)) if flags[key] else int(val)
        except ValueError:
            raise InvalidValueError(f"{name} option {key} needs an integer, got {val!r}") from None
    return cls(**kw)
