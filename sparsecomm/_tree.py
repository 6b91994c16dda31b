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
import importlib.util
import sys
from pathlib import Path

#: the repository's top-level folders that the wheel installs under ``sparsecomm.``
MAPPED = ("theory", "algorithms", "experiments")


class _SameModule(importlib.abc.InspectLoader):
    """Loads ``sparsecomm.<name>[...]`` as the module ``<name>[...]`` (imported under that name once: a
    second name, never a second execution).

    ``get_code``/``get_source``/``is_package`` answer for the folder's own module (``spec``), so that runpy
    can run it: ``python -m sparsecomm.experiments.demo`` executes ``experiments/demo.py`` as ``__main__``
    (with ``__package__`` ``sparsecomm.experiments``), as ``python -m experiments.demo`` does.
    """

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        self.spec = spec

    def create_module(self, spec):
        return importlib.import_module(self.spec.name)

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the import system set it to the alias's spec: the module keeps its own

    def get_code(self, fullname):
        return self.spec.loader.get_code(self.spec.name)

    def get_source(self, fullname):
        return self.spec.loader.get_source(self.spec.name)

    def is_package(self, fullname) -> bool:
        return self.spec.submodule_search_locations is not None


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "sparsecomm" or parts[1] not in MAPPED:
            return None
        name = ".".join(parts[1:])
        try:
            real = importlib.util.find_spec(name)  # imports the parents, not the module itself
        except ModuleNotFoundError as e:
            if e.name == parts[1]:  # the folder is not importable here: let others try
                return None
            raise
        if real is None or real.loader is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _SameModule(real), origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        spec.has_location = real.has_location
        return spec


def install() -> None:
    """Add the finder (first, ahead of an editable install's own) if this is a source tree."""
    here = Path(__file__).resolve().parent
    if (here / "theory").is_dir() or not (here.parent / "theory" / "__init__.py").is_file():
        return
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder())
