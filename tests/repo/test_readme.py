"""The README's Python examples: there are some, and a script that forgets the ``__main__`` guard gets an
error naming it (run in a fresh interpreter, as a user would). The blocks themselves (and the guides' under
``docs/``) run as written, gloo launches included, in ``tests/repo/test_docs.py::test_script_examples_run``
(the netbed one, in docs/netbed.md, under ``-m slow``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> list[str]:
    """The README's ```python blocks, except the netbed one: it needs root and creates network
    namespaces (tests/netbed/ runs the netbed, under the rules for who may create them)."""
    text = (ROOT / "README.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if 'backend="netbed"' not in b]


def _run(code: str, tmp_path: Path, name: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_readme_has_examples():
    assert len(_blocks()) >= 3


def test_every_example_prints_what_it_computes():
    """A reader who runs an example of the README or a guide (``docs/*.md``) sees its result
    (tests/repo/test_docs.py checks that each one prints when it runs); the netbed block too."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    silent = [b.splitlines()[0] for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "print(" not in b]
    assert not silent, f"README examples that print nothing (first lines): {silent}"


def test_missing_main_guard_reports_its_cause(tmp_path):
    """A script that launches spawned processes at module level fails at once with an error naming the
    guard, instead of ranks dying while bootstrapping ("exited with code 1")."""
    code = "import sparsecomm as sc\n\ndef fn(ctx):\n    return ctx.rank\n\nsc.launch(fn, world_size=2, backend='gloo')\n"
    r = _run(code, tmp_path, "noguard", timeout=120)
    assert r.returncode != 0
    assert 'if __name__ == "__main__":' in r.stderr and "line 6" in r.stderr, r.stderr[-2000:]
    # the guarded form runs: tests/repo/test_docs.py::test_script_examples_run and every gloo test
