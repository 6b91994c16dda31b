"""The compressors' name -> factory catalog (a leaf module: filled in by the package's ``__init__``)."""

from ..registry import Registry

registry: Registry = Registry("compressor")
