"""Importing this module initialises Numba's CPU target (its typing and target contexts), most of the cost
of the first Numba kernel call in a process (the kernels' own compiled code then loads from the on-disk
cache in milliseconds each).

The fork server of the spawning launch backends imports it (declared by the package's top through
:func:`sparsecomm.launch.base.preload`), so that every rank it forks inherits the initialised target
instead of initialising its own. Numba's default threading layer starts no thread here, so forking after
it is safe. Where Numba is missing or its initialisation fails, nothing happens: a process then pays the
initialisation at its first kernel call, as without this module.
"""

from __future__ import annotations


def warm() -> bool:
    """Initialise Numba's CPU target in this process; returns whether it did (False: Numba unavailable or
    its initialisation failed, which is left to the first kernel call to report)."""
    try:
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()
        cpu_target.typing_context.refresh()
    except Exception:  # noqa: BLE001 - a warm-up must never fail the importer (a fork server dies of it)
        return False
    return True


WARMED = warm()
