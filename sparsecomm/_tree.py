"""The repository's other top-level folders under the ``sparsecomm`` name, when running from the source tree.

The wheel installs ``theory/``, ``algorithms/`` and ``experiments/`` as ``sparsecomm.theory``,
``sparsecomm.algorithms`` and ``sparsecomm.experiments`` (``package_dir`` in ``setup.py``), so that it puts
no generic top-level name into site-packages. In the source tree they stay top-level folders, and the
tests, ``python -m experiments.demo`` and the reproductions import them by their folder names. Code that
must also run from the wheel (the library, ``algorithms/``, ``experiments/``) imports the ``sparsecomm.``
names; in the source tree this finder makes each such name the *same module object* as the folder's
(``sparsecomm.theory.rates is theory.rates``), so no module is ever loaded twice under two names.

It is installed only when ``sparsecomm/`` has no ``theory/`` beside its ``__init__.py`` (a source tree or
an editable install); from a wheel the sub-packages are real and nothing here runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

#: the repository's top-level folders that the wheel installs under ``sparsecomm.``
MAPPED = ("theory", "algorithms", "experiments")


class _SameModule(importlib.abc.Loader):
    """Loads ``sparsecomm.<name>[...]`` as the already imported ``<name>[...]`` (no second execution)."""

    def __init__(self, module) -> None:
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        return None


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "sparsecomm" or parts[1] not in MAPPED:
            return None
        try:
            module = importlib.import_module(".".join(parts[1:]))
        except ModuleNotFoundError as e:
            if e.name == ".".join(parts[1:2]):  # the folder is not importable here: let others try
                return None
            raise
        spec = importlib.machinery.ModuleSpec(fullname, _SameModule(module),
                                              is_package=hasattr(module, "__path__"))
        return spec


def install() -> None:
    """Add the finder (first, ahead of an editable install's own) if this is a source tree."""
    here = Path(__file__).resolve().parent
    if (here / "theory").is_dir() or not (here.parent / "theory" / "__init__.py").is_file():
        return
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder())
