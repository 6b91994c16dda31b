"""Shared pieces of the fault suite: a corrupting fabric wrapper and the address-space cap."""

from __future__ import annotations

import re
import time

import torch

from sparsecomm.fabric.base import Fabric


class CorruptingFabric:
    """A peer that rewrites what it puts on the wire: ``rewrite(tensor, dst, tag)`` returns the tensor
    to send instead (or ``None`` to send the original). Everything else is the wrapped fabric's."""

    def __init__(self, inner, rewrite) -> None:
        self._inner = inner
        self._rewrite = rewrite

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _sub(self, tensor, dst, tag):
        out = self._rewrite(tensor, dst, tag)
        return tensor if out is None else out

    def send(self, tensor, dst, tag=0, *, reliable=True):
        return self._inner.send(self._sub(tensor, dst, tag), dst, tag, reliable=reliable)

    def isend(self, tensor, dst, tag=0, *, reliable=True, stable=False):
        return self._inner.isend(self._sub(tensor, dst, tag), dst, tag, reliable=reliable, stable=stable)

    isend_each = Fabric.isend_each      # (each send through isend above, rewritten; not the inner fabric's)


def switch_corruption(words: int):
    """A :class:`CorruptingFabric` rewrite: the first ``words`` int32 words of every message to a switch
    (``switch`` or ``sparse-switch``) become 0x7fffffff."""
    from sparsecomm.transports.switchml.sparse import dataplane as sdp
    from sparsecomm.transports.switchml import dataplane as dp

    def rw(t, dst, tag):
        if tag in (dp.TAG_UP, sdp.TAG_UP, sdp.TAG_SKIP) and t.dtype == torch.int32:
            out = t.detach().clone()
            out.view(-1)[:words] = 0x7FFFFFFF
            return out
    return rw


def cap_address_space(extra_bytes: int = 3 << 30) -> int:
    """Cap this process's address space at its current size plus ``extra_bytes`` (RLIMIT_AS), so that a
    peer-sized allocation fails here instead of exhausting the machine; returns the cap."""
    import resource

    status = open("/proc/self/status").read()
    vm = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    cap = vm + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def outcome(call) -> tuple[str | None, str, float]:
    """``(error class name or None, message, seconds)`` of ``call()``."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class is what the tests check
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def flip_word(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    """A copy of an int64 tensor with flat word ``index`` set to ``value``."""
    out = t.detach().clone()
    out.view(-1)[index] = value
    return out


def run_in_place(script, n: int, cwd, args=(), torchrun: bool = True, timeout: float = 120.0) -> list[int]:
    """Run ``script`` as ``n`` ranks of one job in place (``sc.launch`` then runs in the calling process, as
    under torchrun): under ``torchrun --standalone`` (its agent stops every rank when one dies), or, with
    ``torchrun=False``, as ``n`` processes given torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and no agent, so that the survivors of a killed rank run on. Every
    process started here is gone on return; returns the exit codes (torchrun: its own, once)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    if torchrun:
        cmds = [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                  str(script), *args], env)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmds = [([sys.executable, str(script), *args],
                 dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))) for r in range(n)]
    procs = []
    try:
        for i, (cmd, e) in enumerate(cmds):
            with open(Path(cwd) / f"log{i}.txt", "w") as log:     # the child keeps its own copy
                procs.append(subprocess.Popen(cmd, env=e, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()              # torchrun passes it on to its ranks
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
