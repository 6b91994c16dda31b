"""The studies: the demo, convergence runs, ablations, paper reproductions and benchmarks.

They need the ``experiments`` extra (``pip install "sparsecomm[experiments]"``): importing this package
without it raises :class:`sparsecomm.errors.MissingExtraError`, naming every missing package, instead of
the first module's bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util

from sparsecomm.errors import MissingExtraError

#: the import names of the ``experiments`` extra (setup.cfg) and their distributions
EXTRA = {"wandb": "wandb", "tqdm": "tqdm", "matplotlib": "matplotlib", "sklearn": "scikit-learn",
         "yaml": "pyyaml"}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_extra() -> None:
    missing = [m for m in EXTRA if not _installed(m)]
    if missing:
        raise MissingExtraError(
            f"sparsecomm.experiments needs the 'experiments' extra, which is not installed here (missing: "
            f"{', '.join(EXTRA[m] for m in missing)}); install it with: pip install \"sparsecomm[experiments]\" "
            f"(from the source tree: pip install -e \".[experiments]\")", name=missing[0])


_check_extra()
