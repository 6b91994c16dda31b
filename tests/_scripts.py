"""The README's launched scripts: a Python block whose first line is ``# <file>.py, run with: <command>``
is a whole script that a launcher starts (``python train_lightning.py``, ``accelerate launch ...``), not
one that runs as it is (``tests/repo/test_docs.py`` leaves these to the tests that call
:func:`run_readme_script`). The command runs as written, in a fresh folder, with this tree on the path; the
whole process group it starts is killed when it ends or times out."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the first line of a launched script: its file name and the command that runs it
LAUNCHED = re.compile(r"\A# (?P<file>[\w.-]+\.py), run with: (?P<command>.+)\n")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def readme_script(file: str) -> tuple[str, str]:
    """The README block that is ``file`` and the command on its first line."""
    found = [(b, m["command"]) for b in _BLOCK.findall((ROOT / "README.md").read_text())
             if (m := LAUNCHED.match(b)) and m["file"] == file]
    assert len(found) == 1, f"the README has {len(found)} blocks starting '# {file}, run with: ...'"
    return found[0]


def run_readme_script(file: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Write the README's ``file`` into ``cwd`` and run its command there (its program taken from this
    interpreter's environment, one torch thread per process)."""
    code, command = readme_script(file)
    (cwd / file).write_text(code)
    argv = shlex.split(command)
    argv[0] = sys.executable if argv[0] == "python" else str(Path(sys.executable).parent / argv[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{command} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        try:                                    # the ranks it started, if any outlived it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
