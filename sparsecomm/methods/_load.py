"""Import every module of this package so that each registers itself."""

import importlib
import pkgutil

_pkg = importlib.import_module(__package__)
for _info in pkgutil.iter_modules(_pkg.__path__):
    if not _info.name.startswith("_") and _info.name not in ("base", "state", "warmup"):
        importlib.import_module(f"{__package__}.{_info.name}")
