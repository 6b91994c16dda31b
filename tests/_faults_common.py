"""Shared pieces of the fault suite: a corrupting fabric wrapper and the address-space cap."""

from __future__ import annotations

import re
import time

import torch


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

    def isend(self, tensor, dst, tag=0, *, reliable=True):
        return self._inner.isend(self._sub(tensor, dst, tag), dst, tag, reliable=reliable)


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
