"""The house rules on structure, checked on the source: layers import only the layers below them (no
upward load, also not inside a function), modules import no circle at import time, no layer asks for a
concrete fabric's class, and every module says at its top (its docstring) which concept it is.

Reads the files with :mod:`ast`; imports nothing of the library (fast, and a broken module cannot hide
an edge).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "sparsecomm"

#: the layers of sparsecomm, lowest first; a unit is a top-level module or sub-package of sparsecomm.
#: A unit may import units of *lower* rows only (not its own row: units on one row are independent).
#: ``sparsecomm/__init__.py`` is the package's top (the public facade) and may import anything.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_tree", "deprecation"),  # _tree: the source tree's theory/ etc. under sparsecomm. names;
                                       # deprecation: the one warning of a renamed name
    ("registry", "theory", "validate", "checkpoint"),  # theory/ (installed as sparsecomm.theory): the
                                       # closed forms; validate: the checks of user-given numbers;
                                       # checkpoint: files saved whole, and a truncated one named
    ("kernels", "fabric"),             # Numba helpers; point-to-point messages
    ("codec", "trace"),                # block kernels (scan, pack, fixed point); timelines (the switch, merging)
    ("payload",),                      # what a compressor produces and a transport carries
    ("compressors", "transports"),     # a compressor never talks to the network; a transport never
                                       # knows which compressor made its payload
    ("methods", "_numba_warm"),        # stateful wrappers of compressors; Numba's target initialised and the
                                       # default path's compressor kernels loaded on import (for the
                                       # launchers' fork server)
    ("launch",),                       # run fn on n workers (threads over SimFabric, or real processes)
    ("pipeline", "netbed"),            # bucket -> method -> transport -> method, by composition (states,
                                       # rounds, accounting, schedulers); an emulated rack (a launch backend)
    ("replicas", "ddp_wrapped"),       # the frontends: replica checks over a fabric, the DDP wrappers,
    ("optim", "ddp"),                  # the optimizer and the DDP comm hook
    ("integrations",),                 # where people train: loggers' scalars, Lightning's callback
]
LEVEL = {unit: i for i, row in enumerate(LAYERS) for unit in row}

#: names of concrete fabrics, which only the fabric layer (and the launchers that build them) may name
#: in code; everyone else asks a fabric for a capability (``modelled_time``, ``native_group``, ...)
CONCRETE_FABRICS = ("SimFabric", "TorchFabric")


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    # theory/ is sparsecomm.theory in the wheel (setup.py) and in the library's imports
    for root, path in sorted([(PKG, p) for p in PKG.rglob("*.py")]
                             + [(PKG.parent, p) for p in (PKG.parent / "theory").rglob("*.py")]):
        parts = ["sparsecomm", *path.relative_to(root).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The sparsecomm modules an import statement loads (the longest known prefix of each name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
        if node.level:
            base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("sparsecomm"):
            out.append(name)
    return out


_MODULE_NAME = re.compile(r"^sparsecomm(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _imports(mod: str, *, import_time_only: bool) -> set[str]:
    """The sparsecomm modules ``mod`` imports: everywhere (import statements, and module names written as
    strings, which ``importlib`` or a registry's ``provide`` load by name), or only at import time (import
    statements not inside a function, not under ``if TYPE_CHECKING:``)."""
    path, is_pkg = MODULES[mod]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if import_time_only:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                stack.extend(node.orelse)
                continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _targets(mod, is_pkg, node) if t != mod)
        if not import_time_only and isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _MODULE_NAME.match(node.value):
            name = node.value
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != mod:
                found.add(name)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dsts in sorted(edges.items()):
        a = _unit(src)
        if a == "__init__":
            continue
        for dst in sorted(dsts):
            b = _unit(dst)
            if b == a:
                continue
            if b == "__init__" or LEVEL[b] >= LEVEL[a]:
                bad.append(f"{src} imports {dst} ({a} is not above {b})")
    return bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


# ----------------------------------------------------------------------------- the checker itself
def test_the_checker_sees_upward_loads_and_circles():
    """The checks can fail: an upward edge, a same-row edge, a lazy import and a circle are all found."""
    assert _violations({"sparsecomm.fabric.sim": {"sparsecomm.transports.base"}})
    assert _violations({"sparsecomm.compressors.topk": {"sparsecomm.transports"}})      # same row
    assert _violations({"sparsecomm.codec.bits": {"sparsecomm"}})                       # the facade
    assert not _violations({"sparsecomm.transports.ring": {"sparsecomm.fabric.base", "sparsecomm.transports.base"}})
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # a module loaded by its name (importlib, a registry's provide) is an edge too
    assert "sparsecomm.transports" in _imports("sparsecomm.launch.torch_backend", import_time_only=False)
    # a lazy import inside a function is an edge for the layer check, not for the circle check
    src = PKG / "launch" / "torch_backend.py"
    lazy = "sparsecomm.fabric.torch.torch_fabric"
    assert lazy in _imports("sparsecomm.launch.torch_backend", import_time_only=False)
    assert lazy not in _imports("sparsecomm.launch.torch_backend", import_time_only=True)
    assert src.exists()


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES} - {"__init__"}
    assert sorted(units - set(LEVEL)) == [], "add the new module or package to LAYERS (in its layer)"
    assert sorted(set(LEVEL) - units) == [], "LAYERS names a unit that no longer exists"


# ----------------------------------------------------------------------------- the rules
def test_each_layer_imports_only_the_layers_below_it():
    edges = {m: _imports(m, import_time_only=False) for m in MODULES}
    assert _violations(edges) == []


def test_no_import_circle():
    edges = {m: _imports(m, import_time_only=True) for m in MODULES}
    assert _cycles(edges) == []


def _class_checks(mod: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass") and \
                len(node.args) > 1 and any(c in ast.unparse(node.args[1]) for c in CONCRETE_FABRICS):
            found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in CONCRETE_FABRICS or
                isinstance(c, ast.Name) and c.id in CONCRETE_FABRICS
                for c in [node.left, *node.comparators]):
            found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_layer_asks_for_a_concrete_fabric():
    """Outside the fabric layer, code does not ask which fabric it has (``isinstance(f, SimFabric)``,
    ``type(f).__name__ == "TorchFabric"``, ``type(f) is SimFabric``): it asks for a capability
    (``modelled_time``, ``in_process_services``, ``native_group``, ``serial_pairs``, ``device``). Building
    one (a launcher's, or the optimizer's default over torch.distributed) is fine."""
    probe = "isinstance(f, SimFabric)\ntype(f).__name__ == 'TorchFabric'\ntype(f) is SimFabric\n"
    assert len(_class_checks("x", ast.parse(probe + "isinstance(f, Fabric)\nf.modelled_time\n"))) == 3
    offenders = []
    for mod, (path, _) in MODULES.items():
        if _unit(mod) != "fabric":
            offenders += _class_checks(mod, ast.parse(path.read_text(encoding="utf-8")))
    assert offenders == []


def test_every_module_says_at_its_top_what_it_is():
    """A module is one concept, whatever its length: its docstring names it (no line cap)."""
    missing = [mod for mod, (path, _) in MODULES.items()
               if not (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()]
    assert missing == []


# ----------------------------------------------------------------------------- cohesion
#: modules in a circle of imports made inside functions, still to be restructured; the list only shrinks
CIRCLES_PENDING: set[str] = set()


def test_no_import_circle_even_inside_functions():
    """A lazy import inside a function hides a circle from the interpreter, not from the design: the
    modules of a circle are one concept split in two, or an arrow pointing the wrong way."""
    edges = {m: _imports(m, import_time_only=False) for m in MODULES}
    assert [c for c in _cycles(edges) if not set(c) <= CIRCLES_PENDING] == []


def test_the_pending_lists_only_shrink():
    """An entry of a pending list that no longer offends must leave it."""
    edges = {m: _imports(m, import_time_only=False) for m in MODULES}
    assert sorted(CIRCLES_PENDING - {m for c in _cycles(edges) for m in c}) == []
    clean = {m for m in PRIVATE_READS_PENDING if m not in MODULES or not _private_reads(
        m, ast.parse(MODULES[m][0].read_text(encoding="utf-8")))}
    assert sorted(clean) == []


#: underscore names that are public API (namedtuple's; ``os._exit``)
_PUBLIC_UNDERSCORE = {"_fields", "_replace", "_asdict", "_make", "_exit"}
#: other libraries' private names that have no public equivalent: torch.distributed's
#: ``distributed_c10d._get_default_store`` (the rendezvous store of a process group the caller
#: initialised, where a launch in place keeps its failure record and counters); torch.amp.GradScaler's
#: ``_found_inf_per_device`` / ``_check_inf_per_device``, what its protocol for an optimizer that handles the
#: scaling itself (``_step_supports_amp_scaling``) expects that optimizer to call (the inf check it records
#: for ``update()``, made on the averaged gradients)
_FOREIGN_NEEDED = {"_get_default_store", "_found_inf_per_device", "_check_inf_per_device"}


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines or assigns: functions, classes, variables, attributes, parameters."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)          # a dataclass field set by keyword is the module's own
    return out


def _imported_from(mod: str, tree: ast.AST) -> dict[str, str]:
    """Names this module imports from other sparsecomm modules -> the module defining them."""
    path, is_pkg = MODULES[mod]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = (".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
                    if node.level else (node.module or ""))
            for a in node.names:
                if base in MODULES:
                    out[a.asname or a.name] = base
    return out


def _ancestor_modules(mod: str, tree: ast.AST, cls: ast.ClassDef, seen=None) -> set[str]:
    """The modules defining ``cls``'s base classes, transitively (bases named by an import)."""
    seen = set() if seen is None else seen
    imported = _imported_from(mod, tree)
    out = set()
    for b in cls.bases:
        name = ast.unparse(b).split(".")[-1].split("[")[0]
        src = imported.get(name)
        if src is None or src in seen:
            continue
        seen.add(src)
        out.add(src)
        stree = ast.parse(MODULES[src][0].read_text(encoding="utf-8"))
        for node in ast.walk(stree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                out |= _ancestor_modules(src, stree, node, seen)
    return out


def _private_reads(mod: str, tree: ast.AST) -> list[str]:
    """Reads of another module's private names: ``from x import _name``; ``obj._name`` where this module
    defines no ``_name``; and ``self._name`` in a class where neither this module nor the module of one
    of its base classes defines it (a mixin reading its host's state, or a class reading a foreign
    object's). A base class's protected helpers (``self._compress`` in a method) are the class's own."""
    defined = _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{mod}:{node.lineno} from {'.' * node.level}{node.module} import {a.name}")
    owners: dict[int, ast.ClassDef] = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            owners.setdefault(id(node), cls)
    inherited: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and
                node.attr.startswith("_") and not node.attr.startswith("__") and
                node.attr not in _PUBLIC_UNDERSCORE | _FOREIGN_NEEDED and node.attr not in defined):
            continue
        cls = owners.get(id(node))
        if cls is not None and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            if cls.name not in inherited:
                inherited[cls.name] = set()
                for src in _ancestor_modules(mod, tree, cls):
                    inherited[cls.name] |= _defined(ast.parse(MODULES[src][0].read_text(encoding="utf-8")))
            if node.attr in inherited[cls.name]:
                continue
        found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_private_read_checker_sees_what_it_should():
    src = ("from .x import _secret\nclass A:\n    def f(self, o):\n        self._mine = 1\n"
           "        return o._theirs, self._mine, self._hosts\n")
    found = _private_reads("sparsecomm.optim", ast.parse(src))
    assert [f.split(" ", 1)[1] for f in found] == ["from .x import _secret", "o._theirs", "self._hosts"]
    # a base class's protected helper is the subclass's own
    diana = MODULES["sparsecomm.methods.diana"][0]
    assert not [f for f in _private_reads("sparsecomm.methods.diana", ast.parse(diana.read_text()))
                if "self._compress" in f]


#: modules that read other modules' private names, still to be restructured; the list only shrinks
PRIVATE_READS_PENDING: set[str] = set()


def test_no_module_reads_another_modules_private_names():
    offenders = []
    for mod, (path, _) in sorted(MODULES.items()):
        if mod in PRIVATE_READS_PENDING:
            continue
        offenders += _private_reads(mod, ast.parse(path.read_text(encoding="utf-8")))
    assert offenders == []


# ----------------------------------------------------------------------------- declared contracts
def _guessed_reads(mod: str, tree: ast.AST) -> list[str]:
    """``getattr(x, "attr", default)`` and ``hasattr(x, "attr")`` with a literal name: a read of a part's
    attribute that the part's base class does not promise."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            continue
        if (node.func.id == "getattr" and len(node.args) == 3) or node.func.id == "hasattr":
            found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_guessed_read_checker_sees_what_it_should():
    src = 'getattr(c, "packed_values", False)\nhasattr(c, "sum_bits")\ngetattr(c, name)\nc.shared_scale\n'
    assert [f.split(" ", 1)[1] for f in _guessed_reads("x", ast.parse(src))] == [
        "getattr(c, 'packed_values', False)", "hasattr(c, 'sum_bits')"]


def test_what_the_pipeline_reads_from_a_part_is_declared_on_its_base_class():
    """The pipeline reads a compressor's, method's or transport's traits as the base classes declare them
    (``Compressor.shared_scale``, ``Transport.nonfinite``, ``Transport.cost``, ...), never by guessing
    with a default: a part that lacks one is a bug the base class catches, not a silent default."""
    offenders = []
    for mod, (path, _) in sorted(MODULES.items()):
        if _unit(mod) == "pipeline":
            offenders += _guessed_reads(mod, ast.parse(path.read_text(encoding="utf-8")))
    assert offenders == []
