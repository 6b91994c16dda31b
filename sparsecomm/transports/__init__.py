"""Collectives built on a Fabric, resolved by name: ``sc.transports.get("ring", fabric)``."""

from ..registry import Registry
from .base import Transport, incompatible_message

registry: Registry[Transport] = Registry("transport")


def get(name: str, fabric, **hyper) -> Transport:
    """Build the transport ``name`` on ``fabric``; an unknown name raises listing the valid ones."""
    return registry.get(name, fabric, **hyper)


def available() -> list[str]:
    return registry.available()


# Importing the modules registers them (the list is in _load.py).
from . import _load  # noqa: E402,F401

__all__ = ["Transport", "get", "available", "registry", "incompatible_message"]
