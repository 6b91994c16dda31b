"""The methods' name -> factory catalog (a leaf module: the method modules register into it)."""

from ..registry import Registry

registry: Registry = Registry("method")
