"""The registry of launch backends, whether this process already is a rank of a job (nothing to spawn),
the check that spawning backends run under a main guard, the threads each rank gets by default, and the
modules a fork server imports before it forks the ranks (:func:`preload`)."""

from __future__ import annotations

import os
from typing import Any, Callable

from ..registry import Registry

#: name -> ``runner(fn, world_size, *, network, timeout_s, services, **options) -> list``
backends: Registry[Callable[..., list]] = Registry("launch backend")


#: modules that a higher layer declared for the fork server to import before it forks the ranks (in order)
_preloads: list[str] = []


def preload(*modules: str) -> None:
    """Declare modules that the fork server of the spawning backends (``start_method="forkserver"``) imports
    once, before it forks the ranks, so that each rank starts with them loaded instead of importing them
    (the package's top declares its optimizer stack, a higher layer than this one). A module whose import
    raises ``ImportError`` is skipped by the server; any other error of its import ends the server, so a
    declared module must not raise one. Declaring a module twice keeps one entry."""
    for m in modules:
        if not isinstance(m, str) or not m:
            from ..errors import InvalidTypeError

            raise InvalidTypeError(f"preload takes module names (non-empty str), got {m!r}")
        if m not in _preloads:
            _preloads.append(m)


def preloads() -> list[str]:
    """The modules declared with :func:`preload`, in order."""
    return list(_preloads)


def threads_per_rank(ranks: int) -> int:
    """The torch/OpenMP threads each of ``ranks`` processes sharing this machine gets by default:
    ``max(1, cores // ranks)`` (torchrun gives 1 to each of several processes per node), so that the
    ranks do not oversubscribe the cores; ``OMP_NUM_THREADS``, when set, is the user's choice."""
    return max(1, (os.cpu_count() or 1) // max(1, int(ranks)))


def in_place() -> bool:
    """Is this process already one rank of a torch.distributed job: a process group is initialised, or
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) is set? Then the
    torch backends run ``fn`` here instead of spawning ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_main_guard() -> None:
    """Raise a clear error when ``launch`` (of a backend that spawns processes) is called from a script's
    module level outside ``if __name__ == "__main__":``: each spawned rank re-imports the script (Python's
    ``spawn``/``forkserver`` start methods), would call ``launch`` again and die while bootstrapping,
    and the parent would only see ranks exiting with code 1."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py"):
        return
    try:
        if in_place():
            return                 # under torchrun (or an initialised process group): nothing spawns
    except Exception:  # noqa: BLE001 - the check is advisory
        pass
    import inspect

    line = None
    for info in inspect.stack(0):
        if info.frame.f_globals is main.__dict__ and info.function == "<module>":
            line = info.lineno
    if line is None:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    from ..errors import SparseCommError

    raise SparseCommError(
        f"{path}, line {line}: sc.launch(...) with a backend that spawns processes must run under "
        f"`if __name__ == \"__main__\":` (each spawned rank re-imports this script and would launch "
        f"again); put the launch call (and code that should run once) inside that block")


def _is_main_test(test: Any) -> bool:
    import ast

    if not isinstance(test, ast.Compare) or len(test.comparators) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1
