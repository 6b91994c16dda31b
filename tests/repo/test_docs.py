"""Docs that cannot rot: every example in a docstring runs (doctest, on the sim backend), none is skipped,
and no docstring or comment cites a file that is not in the repository or the history of the work.

Examples that need real processes (gloo, DDP, the netbed) are scripts with an ``if __name__ ==
"__main__":`` guard: every Python block of the README and of the guides (``docs/*.md``) and every literal
(``::``) block of a module
docstring that has the guard is written to a file and run as ``__main__`` (:func:`runpy.run_path`, in
this process, so the fork server of the gloo backend is shared with the other multiprocess tests); the
netbed ones need root and run under ``-m slow``. A README block that is a script for a launcher (its first
line ``# <file>.py, run with: <command>``) is run with that command by its own test (``tests/_scripts.py``).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
import runpy
import textwrap
from pathlib import Path

import pytest

from tests._scripts import LAUNCHED

ROOT = Path(__file__).resolve().parents[2]
#: code whose docstrings are checked (the shipped code and the tests)
CHECKED = ("sparsecomm", "theory", "algorithms", "experiments", "tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules_with_examples() -> list[str]:
    return [_module_name(p) for top in ("sparsecomm", "theory", "algorithms")
            for p in sorted((ROOT / top).rglob("*.py")) if ">>> " in p.read_text()]


EXAMPLES = _modules_with_examples()


def test_examples_are_found():
    assert {"sparsecomm", "sparsecomm.launch", "sparsecomm.optim", "sparsecomm.registry",
            "sparsecomm.transports.omnireduce", "theory.problems"} <= set(EXAMPLES), EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=flags)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name}: '>>> ' in the source but no doctest found"
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"


#: an example that runs as a script
GUARD = 'if __name__ == "__main__":'
README_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _literal_blocks(doc: str) -> list[str]:
    """The literal blocks of a docstring: the indented lines after a paragraph ending in ``::``."""
    out, lines, i = [], doc.splitlines(), 0
    while i < len(lines):
        if lines[i].rstrip().endswith("::"):
            j, block = i + 1, []
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                block.append(lines[j])
                j += 1
            out.append(textwrap.dedent("\n".join(block)).strip() + "\n")
            i = j
        else:
            i += 1
    return out


#: the Markdown whose Python blocks run: the README and the guides of the documentation site
GUIDES = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))


def _script_examples() -> list:
    found = [(f"{page}#{i}", code) for page in GUIDES
             for i, code in enumerate(README_BLOCK.findall((ROOT / page).read_text()))
             if not LAUNCHED.match(code)]     # scripts for a launcher: tests/_scripts.py runs them
    for path in sorted((ROOT / "sparsecomm").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        for i, code in enumerate(_literal_blocks(doc or "")):
            if GUARD in code:
                found.append((f"{path.relative_to(ROOT).as_posix()}#{i}", code))
    return [pytest.param(code, id=name, marks=[pytest.mark.slow] if 'backend="netbed"' in code else [])
            for name, code in found]


SCRIPTS = _script_examples()


def test_script_examples_are_found():
    ids = {p.id for p in SCRIPTS}
    assert {"sparsecomm/ddp.py#0", "sparsecomm/launch/torch_backend.py#0", "sparsecomm/netbed/launch.py#0"} <= ids
    readme = [p for p in SCRIPTS if p.id.startswith("README.md")]
    assert len(readme) >= 3 and sum('backend="gloo"' in p.values[0] for p in readme) >= 2
    assert "docs/netbed.md#0" in ids
    assert _literal_blocks("Run this::\n\n    a = 1\n    b = 2\n\nText.\n") == ["a = 1\nb = 2\n"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("code", SCRIPTS)
def test_script_examples_run(code, tmp_path, request, capsys):
    """Every Python block of the README and the guides and every guarded docstring script runs as
    ``__main__`` (a failing assertion or error in the example fails here); a Markdown block prints what it
    computes."""
    path = tmp_path / "example.py"
    path.write_text(code)
    runpy.run_path(str(path), run_name="__main__")
    if request.node.callspec.id.split("#")[0] in GUIDES:
        assert capsys.readouterr().out.strip(), "the example prints nothing"


def _sources():
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name != "test_docs.py":
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_skipped_examples():
    bad = [f"{rel}:{i}" for rel, text in _sources() for i, line in enumerate(text.splitlines(), 1)
           if "doctest: +SKIP" in line]
    assert not bad, "make the example run (sim backend) or turn it into a literal '::' block:\n" + "\n".join(bad)


#: history and plans do not belong in the code: they rot the day the work is merged
HISTORY = re.compile(r"\bissue\s*#?\d+|\bthe issue that\b|\buntil \w+ lands\b|\bbefore its module lands\b"
                     r"|\bwill be added\b|\bnot implemented yet\b", re.IGNORECASE)
#: a file name a docstring cites (``name.md``, ``path/name.md``)
CITED_MD = re.compile(r"(?<![\w/.-])([\w./-]+\.md)\b")


def test_no_history_in_docstrings_and_comments():
    bad = [f"{rel}:{i}: {line.strip()}" for rel, text in _sources()
           for i, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    assert not bad, "\n".join(bad)


def test_cited_documents_exist():
    bad = []
    for rel, text in _sources():
        for i, line in enumerate(text.splitlines(), 1):
            for name in CITED_MD.findall(line):
                if not (ROOT / name).is_file() and not (ROOT / rel).parent.joinpath(name).is_file():
                    bad.append(f"{rel}:{i} cites {name}, which is not in the repository")
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail():
    assert HISTORY.search("Each module is added by the issue that builds it.")
    assert HISTORY.search("# pragma: no cover - until TorchFabric lands")
    assert CITED_MD.findall('(DESIGN.md, "Contracts")') == ["DESIGN.md"]
    assert not (ROOT / "DESIGN.md").exists()
