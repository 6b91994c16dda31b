"""The API reference (``make docs``, mkdocs.yml) renders the docstrings of the public names: every public
name has a docstring, and every parameter of a public function, method or class constructor is named in it,
in an ``Args:`` section (Google style, as mkdocs.yml's ``docstring_style``) or in the text, as a word
or in code (``ratio``, ``**hyper``, "omega = d/k - 1").

The public names are those the API pages render: ``sparsecomm.__all__`` (what ``import sparsecomm as sc``
gives), the ``__all__`` of the sub-packages and modules below (``tests/repo/test_api_names.py`` checks the
facade), or, for a module without one, the names it defines that do not start with ``_``; of a public
class, its constructor and the methods and properties its own body defines (an override without a
docstring has its base class's, as ``help()`` shows).
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

import sparsecomm as sc

ROOT = Path(__file__).resolve().parents[2]
#: the modules of the API pages (docs/api/*.md)
MODULES = ("sparsecomm", "sparsecomm.optim", "sparsecomm.ddp", "sparsecomm.compressors", "sparsecomm.methods",
           "sparsecomm.transports", "sparsecomm.launch", "sparsecomm.netbed", "sparsecomm.errors",
           "sparsecomm.codec", "sparsecomm.registry", "sparsecomm.kernels", "sparsecomm.fabric.base",
           "sparsecomm.fabric.roles", "sparsecomm.fabric.engine",
           "theory.compressors", "theory.rates", "theory.costs",
           "theory.problems", "theory.bits", "theory.method_operators")

SECTION = re.compile(r"^(Args|Arguments|Parameters|Keyword Args|Other Parameters):\s*$")
CODE = re.compile(r"``(.+?)``|`([^`]+)`", re.S)


def public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
    return list(names)


def documented_names(doc: str) -> set[str]:
    """The names a docstring documents: the entries of its ``Args:`` sections, the identifiers in its
    code spans and the words of its text (a name followed by ``(`` is a call, not the parameter)."""
    names, lines, i = set(), doc.splitlines(), 0
    while i < len(lines):
        if SECTION.match(lines[i].strip()):
            indent = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                m = re.match(r"\s*\*{0,2}(\w+)(?:\s*\([^)]*\))?:", lines[i])
                if m:
                    names.add(m.group(1))
                i += 1
            continue
        i += 1
    for m in CODE.finditer(doc):
        names |= set(re.findall(r"\w+", m.group(1) or m.group(2)))
    return names | set(re.findall(r"(?<![\w.])(\w+)(?![\w(])", CODE.sub(" ", doc)))


def _parameters(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [n for n in sig.parameters if n not in ("self", "cls")]


def _check(where: str, fn, doc: str | None, problems: list[str]) -> None:
    if not (doc or "").strip():
        problems.append(f"{where}: no docstring")
        return
    missing = [p for p in _parameters(fn) if p not in documented_names(doc)]
    if missing:
        problems.append(f"{where}: parameters not documented: {', '.join(missing)}")


def _check_class(where: str, cls: type, problems: list[str]) -> None:
    doc = cls.__dict__.get("__doc__") or ""
    init = cls.__dict__.get("__init__")
    if init is not None and not issubclass(cls, BaseException):
        _check(where, init, doc + "\n" + (init.__doc__ or ""), problems)
    elif not doc.strip():
        problems.append(f"{where}: no docstring")
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        # an override without a docstring of its own has its base class's (inspect.getdoc, as help() shows)
        if isinstance(member, property):
            if not (inspect.getdoc(member) or "").strip():
                problems.append(f"{where}.{name}: no docstring")
            continue
        fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if inspect.isfunction(fn):
            _check(f"{where}.{name}", fn, inspect.getdoc(getattr(cls, name)), problems)


def undocumented() -> list[str]:
    problems, seen = [], set()
    for modname in MODULES:
        module = importlib.import_module(modname)
        if not (module.__doc__ or "").strip():
            problems.append(f"{modname}: no module docstring")
        for name in public_names(module):
            value = getattr(module, name)
            if isinstance(value, types.ModuleType) or id(value) in seen:
                continue
            seen.add(id(value))
            where = f"{modname}.{name}"
            if inspect.isclass(value):
                _check_class(where, value, problems)
            elif inspect.isfunction(value) or inspect.isbuiltin(value):
                _check(where, value, value.__doc__, problems)
    return problems


def test_every_public_name_documents_its_parameters():
    problems = undocumented()
    assert not problems, f"{len(problems)} public names lack a docstring or parameters in it:\n" + "\n".join(problems)


def test_the_check_can_fail():
    def f(ratio, *, k=None, **hyper):
        """Keeps ``ratio`` of the coordinates, calls hyper(x).

        Args:
            k: how many instead.
        """
    assert {"ratio", "k", "x", "of"} <= documented_names(f.__doc__) and "hyper" not in documented_names(f.__doc__)
    problems = []
    _check("f", f, f.__doc__, problems)
    assert problems == ["f: parameters not documented: hyper"]
    _check("g", lambda x: x, None, problems)
    assert problems[-1] == "g: no docstring"


def test_the_api_pages_cover_the_modules():
    """Every module checked above is rendered by an API page (a ``::: module`` or ``::: module.Name``
    line), and the public sub-packages of ``sparsecomm`` have a page."""
    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    rendered = set(re.findall(r"^::: ([\w.]+)", pages, flags=re.M))
    for modname in MODULES:
        assert any(r == modname or r.startswith(modname + ".") for r in rendered), modname
    for name in sc.__all__:
        if isinstance(getattr(sc, name), types.ModuleType):
            assert any(r == f"sparsecomm.{name}" or r.startswith(f"sparsecomm.{name}.") for r in rendered), name


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` and CI run) succeeds, and the API pages show the
    docstrings' reStructuredText as Markdown: no Sphinx role or ``::`` marker is left in the HTML, and a
    role whose target has a page is a link (docs/hooks/rst_docstrings.py)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    pages = {p.name: p.read_text() for p in (tmp_path / "api").glob("*.html")}
    assert {f"{Path(p).stem}.html" for p in (ROOT / "docs" / "api").glob("*.md")} == set(pages)
    leftovers = [name for name, html in pages.items() if re.search(r":(class|func|meth|mod|attr|data):`|::</p>", html)]
    assert not leftovers, leftovers
    # :class:`~sparsecomm.errors.MismatchError` in the ddp module docstring links to the errors page
    assert re.search(r'href="errors\.html#sparsecomm\.errors\.MismatchError"', pages["ddp.html"])
