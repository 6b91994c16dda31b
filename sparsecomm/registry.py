"""Name -> factory catalogs (no ``if/elif`` factories anywhere in the library).

Typed factories (``sc.compressors.randk(ratio=0.01)``, ``sc.methods.diana(...)``) are the API; a
registry is the catalog that maps the names used on command lines and in configs to them. A bad
keyword given by name is reported here, once, naming the factory's parameters (:meth:`Registry.check`,
:func:`bad_keywords`); this module is the only place that reads a factory's signature.

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
import inspect
from typing import Any, Callable, Generic, TypeVar

from .errors import HyperParameterError, InvalidValueError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to factories (classes or functions) of one kind of component."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._providers: dict[str, str] = {}
        self._products: dict[str, type] = {}

    def register(self, name: str, product: type | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory`` under ``name``; a duplicate name is a programming error.
        ``product``: the class a factory function builds (its declared traits, :meth:`product`)."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise InvalidValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            if product is not None:
                self._products[name] = product
            return factory

        return deco

    def provide(self, name: str, module: str) -> None:
        """Declare that importing ``module`` registers ``name`` (imported on the first lookup)."""
        if name in self._factories or self._providers.get(name, module) != module:
            raise InvalidValueError(f"{self.kind} {name!r} is registered twice")
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

    def product(self, name: str) -> Any:
        """The class that ``name``'s factory builds (its class-level traits: ``payload_kind``, ...), read
        without building one; the factory itself when it is a class."""
        factory = self.factory(name)
        return self._products.get(name, factory)

    def parameters(self, name: str) -> list[str] | None:
        """The keyword parameters of ``name``'s factory (``None``: it takes any keyword)."""
        return parameters(self.factory(name))

    def check(self, name: str, kwargs: Any, *, also: dict[str, list[str]] | None = None) -> None:
        """Raise :class:`HyperParameterError` (the one message, :func:`bad_keywords`) when ``name``'s
        factory does not take some of ``kwargs``; ``also``: other parameter lists the keywords could
        have gone to (a method's compressor), named in the message."""
        accepted = self.parameters(name)
        if accepted is None:
            return
        bad = sorted(set(kwargs) - set(accepted))
        if bad:
            raise HyperParameterError(bad_keywords(f"{self.kind} {name!r}", bad, {f"{self.kind} {name!r}": accepted,
                                                                                  **(also or {})}))

    def get(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Build the component registered under ``name`` with the given hyper-parameters (a keyword
        its factory does not take raises :class:`HyperParameterError` naming the ones it does).

        Args:
            name: a registered name.
            *args: positional arguments of its factory (a transport's fabric).
            **kwargs: its hyper-parameters.
        """
        factory = self.factory(name)
        self.check(name, kwargs)
        return factory(*args, **kwargs)


def parameters(factory: Callable[..., Any]) -> list[str] | None:
    """The keyword parameters of a factory (a function or a class), in order; ``None`` when it takes
    ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def bad_keywords(what: str, bad: list[str], accepted: dict[str, list[str]]) -> str:
    """The one message for keywords nothing takes: ``what`` does not take ``bad``; the parameters of
    each component they could have gone to.

    Args:
        what: the component refusing them.
        bad: the keywords.
        accepted: component name -> the parameters it takes.
    """
    lists = "; ".join(f"{who} takes: {', '.join(names) or 'none'}" for who, names in accepted.items())
    return f"{what} does not take {', '.join(map(repr, bad))} ({lists})"
