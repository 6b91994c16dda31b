"""The shape of the library's protocols, checked on the source: the SimFabric runs without threads of its
own, and protocol code does not block on a receive itself (it yields its receives as a role,
:mod:`sparsecomm.fabric.roles`, and a fabric runs it: ``Fabric.drive``).

Reads the files with :mod:`ast`; imports nothing of the library (fast, and a broken module cannot hide
a call). What is not converted yet is named in an allow-list with its reason; an entry that is no longer
needed fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "sparsecomm"

#: modules whose import means threads
THREAD_MODULES = ("threading", "_thread")
#: the fabric's methods that receive (or wait for receives): protocol code yields its receives instead
RECEIVES = ("recv", "irecv", "wait_any")
#: where protocol code lives: every module under these (relative to the package: folders or modules), but
#: ``native/``, whose transport is torch's own collectives
PROTOCOL_ROOTS = ("transports", "pipeline", "replicas.py")
NOT_PROTOCOL = ("transports/native/",)

#: protocol modules that still call a receive themselves: path (relative to the package) -> reason
ALLOWED: dict[str, str] = {
    "transports/switchml/service.py": "the switch's ports on a real fabric (threads per port, gloo's receives); "
                                      "on the SimFabric it is a role",
    "transports/omnireduce/reference.py": "a blocking reference by design",
    "transports/omnireduce/trace.py": "a Fabric wrapper (TraceFabric): it forwards the fabric's own "
                                      "receive methods to the fabric it wraps, and receives nothing itself",
}


def imported_modules(source: str) -> set[str]:
    """The top-level names of the modules ``source`` imports (anywhere: also inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def receive_calls(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of an attribute named as one of :data:`RECEIVES`, on anything
    (``fabric.recv(...)``, ``self._inner.wait_any(...)``, ``f.irecv(b, s, t).wait()``)."""
    return sorted((node.lineno, node.func.attr) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in RECEIVES)


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def _protocol_modules() -> list[Path]:
    return sorted(p for root in PROTOCOL_ROOTS
                  for p in ((PKG / root).rglob("*.py") if (PKG / root).is_dir() else [PKG / root])
                  if not _rel(p).startswith(NOT_PROTOCOL))


def test_the_checks_find_what_they_look_for():
    """The detectors themselves: each form they must catch is caught, and the roles' requests are not."""
    src = ("import threading as t\nfrom _thread import get_ident\n"
           "def f(fabric, inbox, b):\n"
           "    fabric.recv(b, 0, 1)\n"
           "    w = fabric.irecv(b, 0, 1).wait()\n"
           "    self._inner.wait_any([w])\n"
           "    inbox.take(1)\n"
           "    yield Recv((1,), Step())\n")
    assert imported_modules(src) >= {"threading", "_thread"}
    assert receive_calls(src) == [(4, "recv"), (5, "irecv"), (6, "wait_any")]
    assert imported_modules("from .sim_world import World\nimport heapq\n") == {"heapq"}


def test_the_simfabric_imports_no_threading():
    """No module under ``sparsecomm/fabric/sim/`` imports :mod:`threading` (one event loop in modelled time, no
    thread per endpoint or service)."""
    found = {_rel(p): sorted(imported_modules(p.read_text()) & set(THREAD_MODULES))
             for p in sorted((PKG / "fabric" / "sim").rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, "modules of the SimFabric that import threads"


def test_no_protocol_module_blocks_on_a_receive_itself():
    """No transport (but ``native``), pipeline or replica-check module calls ``recv``, ``irecv`` or ``wait_any``
    itself, but those in :data:`ALLOWED`; and every entry of :data:`ALLOWED` is still needed."""
    modules = _protocol_modules()
    assert len(modules) > 20 and PKG / "replicas.py" in modules, "the protocol modules were not found"
    calls = {_rel(p): receive_calls(p.read_text()) for p in modules}
    blocking = {path: found for path, found in calls.items() if found and path not in ALLOWED}
    assert not blocking, ("protocol modules that call a fabric's receive themselves (yield Post/PostInto and "
                          "Recv from a role that Fabric.drive runs instead):\n"
                          + "\n".join(f"  {p}: " + ", ".join(f"{name} at line {line}" for line, name in found)
                                      for p, found in blocking.items()))
    stale = sorted(path for path in ALLOWED if not calls.get(path))
    assert not stale, (f"allow-listed modules that no longer call a receive (or are gone): remove their "
                       f"entries from ALLOWED: {stale}")
