"""Name -> factory registries (no ``if/elif`` factories anywhere in the library).

>>> reg = Registry("compressor")
>>> @reg.register("identity")
... class Identity: ...
>>> reg.available()
['identity']

A name can also be *provided* by a module that registers it when imported (``reg.provide("netbed",
"sparsecomm.netbed.launch")``): the module is imported on the first lookup of the name, so that a lower
layer can list a component of a higher one without importing it (the higher layer, or the package's
top, declares the provider).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, TypeVar

from .errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to factories (classes or functions) of one kind of component."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._providers: dict[str, str] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory`` under ``name``; a duplicate name is a programming error."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return deco

    def provide(self, name: str, module: str) -> None:
        """Declare that importing ``module`` registers ``name`` (imported on the first lookup)."""
        if name in self._factories or self._providers.get(name, module) != module:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._providers[name] = module

    def available(self) -> list[str]:
        """The registered (and provided) names, sorted."""
        return sorted(set(self._factories) | set(self._providers))

    def __contains__(self, name: object) -> bool:
        return name in self._factories or name in self._providers

    def factory(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name``; an unknown name raises listing the valid ones."""
        if isinstance(name, str) and name not in self._factories and name in self._providers:
            importlib.import_module(self._providers[name])
        try:
            return self._factories[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.available())}"
            ) from None

    def get(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Build the component registered under ``name`` with the given hyper-parameters."""
        return self.factory(name)(*args, **kwargs)
