"""Packaging: the wheel installs only ``sparsecomm*`` top-level names, the library requires only what it
imports, and code that ships in the wheel never imports the source tree's top-level folder names."""

from __future__ import annotations

import ast
import configparser
import email
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the source tree's top-level folders that the wheel installs under ``sparsecomm.``
MAPPED = ("theory", "algorithms", "experiments")
#: where the wheel's code lives in the source tree
SHIPPED = ("sparsecomm", *MAPPED)
#: the library proper: what ``import sparsecomm`` and its sub-packages load (theory/: its constants)
LIBRARY = ("sparsecomm", "theory")
#: import names that differ from the distribution's name
DIST_OF = {"sklearn": "scikit-learn", "yaml": "pyyaml"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tree (no ``build/`` or egg-info left in the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "out", "*.egg-info", "build")
    for name in SHIPPED:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(src), "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = (tmp / "dist").glob("sparsecomm-*.whl")
    return whl


def _record(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        (rec,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        return [line.split(",")[0] for line in z.read(rec).decode().splitlines() if line]


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(meta))


def test_wheel_installs_only_sparsecomm_names(wheel):
    files = _record(wheel)
    tops = {f.split("/")[0] for f in files}
    assert tops == {"sparsecomm", f"sparsecomm-{wheel.name.split('-')[1]}.dist-info"}, sorted(tops)
    for need in ("sparsecomm/__init__.py", "sparsecomm/theory/compressors.py", "sparsecomm/algorithms/diana.py",
                 "sparsecomm/experiments/demo.py", "sparsecomm/experiments/common/train.py",
                 "sparsecomm/experiments/bench/transports.py", "sparsecomm/experiments/ablation.yaml"):
        assert need in files, need
    # every package of the tree is in the wheel, under its mapped name
    for top in SHIPPED:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            want = rel if top == "sparsecomm" else "sparsecomm/" + rel
            assert want in files, f"{rel} is missing from the wheel (as {want})"


def test_wheel_requires_only_the_library_dependencies(wheel):
    meta = _metadata(wheel)
    plain = {r.split(";")[0].strip().lower() for r in meta.get_all("Requires-Dist") if "extra ==" not in r}
    assert plain == _install_requires()
    assert plain.isdisjoint({"wandb", "matplotlib", "scikit-learn", "tqdm", "pyyaml", "pyroute2", "pytest",
                             "hypothesis"})
    extras = set(meta.get_all("Provides-Extra"))
    assert {"experiments", "netbed", "test", "lightning", "accelerate"} <= extras


# ----------------------------------------------------------------------------------- source checks
def _install_requires() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {line.strip().lower() for line in cfg["options"]["install_requires"].splitlines() if line.strip()}


def _extras() -> dict[str, set[str]]:
    """Each extra's distributions, by name (without their version ranges)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {k: {re.split(r"[<>=!~ ]", line.strip())[0].lower() for line in v.splitlines() if line.strip()}
            for k, v in cfg["options.extras_require"].items()}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute imported module names in ``path`` with their line, including imports inside functions."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
    return out


def _py_files(*tops: str):
    for top in tops:
        yield from sorted((ROOT / top).rglob("*.py"))


def _third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in sys.stdlib_module_names and top not in (*SHIPPED, "tests")


def test_library_imports_only_declared_dependencies():
    """What sparsecomm/ and theory/ import (at module level or inside functions) is in install_requires,
    or in the ``netbed`` extra for sparsecomm/netbed/, in ``lightning`` for its integration, or in
    ``experiments`` for theory/problems.py's datasets."""
    base = _install_requires()
    extras = _extras()
    missing = []
    for path in _py_files(*LIBRARY):
        rel = path.relative_to(ROOT).as_posix()
        allowed = set(base)
        if rel.startswith("sparsecomm/netbed/"):
            allowed |= extras["netbed"]
        if rel == "sparsecomm/integrations/lightning.py":
            allowed |= extras["lightning"]
        if rel == "theory/problems.py":
            allowed |= extras["experiments"]
        for name, line in _imports(path):
            if _third_party(name):
                dist = DIST_OF.get(name.split(".")[0], name.split(".")[0])
                if dist.lower() not in allowed:
                    missing.append(f"{rel}:{line} imports {name} ({dist} is not a dependency there)")
    assert not missing, "\n".join(missing)


def test_shipped_code_never_imports_the_folder_names():
    """In the wheel, theory/, algorithms/ and experiments/ are sparsecomm.theory etc.: code that ships must
    import them by those names (or relatively), never as ``theory``/``algorithms``/``experiments``."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _py_files(*SHIPPED)
           for name, line in _imports(p) if name.split(".")[0] in MAPPED]
    assert not bad, "use sparsecomm.<name> or a relative import:\n" + "\n".join(bad)


def test_source_tree_names_are_one_module():
    """In the source tree ``sparsecomm.theory.rates`` is ``theory.rates`` (never loaded twice)."""
    import sparsecomm  # noqa: F401

    for name in ("theory.rates", "theory.compressors", "algorithms.diana", "experiments.common.config"):
        assert importlib.import_module("sparsecomm." + name) is importlib.import_module(name), name
    topk = importlib.import_module("sparsecomm.compressors.topk")   # the module, not the factory

    assert topk.th is importlib.import_module("theory.compressors")


def test_no_default_output_inside_the_package():
    """Default output folders are relative to the working directory, never to a module's ``__file__``
    (which, installed, is site-packages)."""
    bad = []
    for path in _py_files(*SHIPPED):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Name) and node.id == "__file__":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    allowed = {"sparsecomm/_tree.py"}  # finds the source tree's folders; writes nothing
    bad = [b for b in bad if b.split(":")[0] not in allowed]
    assert not bad, "paths built from __file__:\n" + "\n".join(bad)



@pytest.mark.parametrize("module", ["experiments.convergence", "sparsecomm.experiments.convergence",
                                    "sparsecomm.experiments.bench.codec"])
def test_source_tree_runs_both_names_with_dash_m(module):
    """``python -m experiments.X`` and ``python -m sparsecomm.experiments.X`` both run from the source tree
    (runpy asks the finder's loader for the module's code), once, as ``__main__``, without runpy's warning
    about a module imported before it runs."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
    assert "Traceback" not in proc.stderr and "found in sys.modules" not in proc.stderr, proc.stderr[-2000:]


#: hides installed packages from a subprocess, as if they were not installed (``find_spec`` and ``import``
#: both fail with ModuleNotFoundError)
_HIDE = """
import importlib.abc, sys
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
"""


def _experiment_modules() -> list[str]:
    return sorted("sparsecomm." + ".".join(p.relative_to(ROOT).with_suffix("").parts).replace(".__init__", "")
                  for p in (ROOT / "experiments").rglob("*.py"))


def test_experiments_without_their_extra_name_it():
    """Without the ``experiments`` extra (here: matplotlib hidden), importing ``sparsecomm.experiments`` or any
    module under it raises one error that names the missing package and the install command; the library
    itself still imports and works."""
    code = _HIDE + """
import json
import sparsecomm as sc
from sparsecomm.errors import MissingExtraError
assert sc.compressors.get("topk", ratio=0.5).delta(4) == 0.5      # the library needs no extra
out = {}
for name in sys.argv[2:]:
    try:
        __import__(name)
        out[name] = None
    except ImportError as e:
        out[name] = [type(e).__name__, isinstance(e, MissingExtraError), e.name, str(e)]
print(json.dumps(out))
"""
    modules = _experiment_modules()
    assert "sparsecomm.experiments" in modules and "sparsecomm.experiments.demo" in modules
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, "matplotlib", *modules], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, err in json.loads(proc.stdout.splitlines()[-1]).items():
        assert err is not None, f"{name} imported without matplotlib"
        kind, ours, missing, text = err
        assert ours and missing == "matplotlib", (name, err)
        assert 'pip install "sparsecomm[experiments]"' in text and "matplotlib" in text, (name, text)


def test_experiments_extra_check_matches_setup_cfg():
    """The packages ``sparsecomm.experiments`` checks for are the ``experiments`` extra of setup.cfg."""
    import experiments

    assert {DIST_OF.get(m, m) for m in experiments.EXTRA} == _extras()["experiments"]


def test_lightning_integration_without_its_extra_names_it():
    """Without the ``lightning`` extra, importing ``sparsecomm.integrations.lightning`` raises one error
    naming the package and the install command; ``sparsecomm.integrations`` (the loggers' scalars) needs
    no extra."""
    code = _HIDE + """
import sparsecomm as sc
from sparsecomm.errors import MissingExtraError
assert sc.integrations.StatsLogger is not None
try:
    import sparsecomm.integrations.lightning
except MissingExtraError as e:
    print(e.name, "|", e)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, "lightning"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, _, text = proc.stdout.strip().partition(" | ")
    assert name == "lightning" and 'pip install "sparsecomm[lightning]"' in text, proc.stdout
