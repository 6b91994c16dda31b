"""Collectives built on a Fabric, resolved by name: ``sc.transports.get("ring", fabric)``."""

from .base import Transport, incompatible_message, registry


def get(name: str, fabric, **hyper) -> Transport:
    """Build the transport ``name`` on ``fabric``; an unknown name raises listing the valid ones.

    Args:
        name: a name of :func:`available`.
        fabric: the fabric it runs over.
        **hyper: the transport's keywords.
    """
    return registry.get(name, fabric, **hyper)


def available() -> list[str]:
    """The registered transport names."""
    return registry.available()


# Importing the modules registers them (into ``base.registry``, so that no module imports this package).
from . import _load  # noqa: E402,F401

__all__ = ["Transport", "get", "available", "registry", "incompatible_message"]
