"""Importing this module initialises Numba's CPU target (its typing and target contexts), most of the cost
of the first Numba kernel call in a process, and loads the default path's kernels from Numba's on-disk cache
(:func:`load_cached` of :func:`sparsecomm.compressors._kernels.default_path_signatures`: error feedback with
top-k on float32), the rest of that cost.

The fork server of the spawning launch backends imports it (declared by the package's top through
:func:`sparsecomm.launch.base.preload`), so that every rank it forks inherits the initialised target and the
loaded kernels instead of setting up its own (a rank's first step then loads none). Nothing is compiled here:
a kernel the cache lacks is compiled by its first call in a rank, as without this module. Numba's default
threading layer starts no thread here, so forking after it is safe. Where Numba is missing or its
initialisation fails, nothing happens: a process then pays the initialisation at its first kernel call.
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


def load_cached(kernels) -> int:
    """Give each ``(dispatcher, argument types)`` of ``kernels`` that overload from Numba's on-disk cache, as
    the dispatcher's own first call would (the cache lookup of ``Dispatcher.compile``), compiling nothing: a
    signature the cache lacks is left to its first call. Returns how many the dispatchers now hold; never
    raises (a failed load is skipped)."""
    try:
        from numba.core.caching import FunctionCache
        from numba.core.compiler_lock import global_compiler_lock
    except Exception:  # noqa: BLE001 - as warm()
        return 0
    held = 0
    for disp, sig in kernels:
        try:
            with global_compiler_lock:
                if tuple(sig) not in disp.overloads:    # the dispatcher's cache (cache=True) reads the same files
                    cres = FunctionCache(disp.py_func).load_overload(tuple(sig), disp.targetctx)
                    if cres is None:
                        continue
                    disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
                    disp.add_overload(cres)
            held += 1
        except Exception:  # noqa: BLE001 - a stale or unreadable entry: the first call compiles, as before
            continue
    return held


def _load_default_path() -> int:
    try:
        from .compressors._kernels import default_path_signatures
    except ImportError:
        return 0
    return load_cached(default_path_signatures())


WARMED = warm()
#: how many of the default path's kernels this process holds from the cache since its import
LOADED = _load_default_path() if WARMED else 0
