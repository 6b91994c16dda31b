"""Shared test fixtures."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Run a test with one intra-op torch thread: on tiny tensors it is faster, and immune to other
    jobs on the 2 CI cores. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ------------------------------------------------------------------ kernel paths
#: the two implementations of every codec kernel and operator (sparsecomm.kernels): the Numba kernels that
#: CPU users run and the torch ops that CUDA (and non-contiguous / half-precision) users run
KERNEL_PATHS = ("numba", "torch")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernel_paths(*paths): restrict the kernel paths a test of a kernel_path module runs on "
                   "(for tests of one path's internals)")


#: the lock every netbed case of this machine takes (any run, any xdist worker)
NETBED_LOCK = os.path.join(tempfile.gettempdir(), "sparsecomm-netbed-tests.lock")


@pytest.fixture(autouse=True)
def _netbed_one_at_a_time(request):
    """The netbed cases run one at a time on a machine, across xdist's workers (``make test`` runs two) and
    across test runs: they measure shaped links and check that no namespace or link is left behind, which a
    netbed built meanwhile elsewhere would break. An exclusive ``flock`` on :data:`NETBED_LOCK`, which the
    kernel releases when its holder ends, however it ends. (xdist's ``--dist loadgroup`` with an
    ``xdist_group`` mark would keep them on one worker, but under pytest 9.2 it loses the group and spreads
    them, and it would not order separate runs.)"""
    if request.node.get_closest_marker("netbed") is None:
        yield
        return
    with open(NETBED_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _busy_fraction(window_s: float) -> float:
    """The fraction of the machine's CPU time that was not idle over the next ``window_s`` (``/proc/stat``)."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]          # (total, idle + iowait)
    t0, i0 = sample()
    time.sleep(window_s)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


#: a ``timing`` case starts once the machine's CPU is at most this busy over a second, or after the wait below
QUIET_BUSY, QUIET_WAIT_S = 0.1, 60.0


@pytest.fixture(autouse=True)
def _timing_on_a_quiet_machine(request):
    """The ``timing`` cases (setup.cfg) measure the machine: each starts once its CPU has been at most
    :data:`QUIET_BUSY` busy over a second (the processes of the cases run before it wind down for a few seconds
    after they end: a shaped stream measured 0.74-0.89 of the link then, 0.93-0.956 on a quiet machine), or after
    :data:`QUIET_WAIT_S`, when it runs anyway (and may fail: a measurement on a busy machine)."""
    if request.node.get_closest_marker("timing") is not None and os.path.exists("/proc/stat"):
        deadline = time.monotonic() + QUIET_WAIT_S
        while _busy_fraction(1.0) > QUIET_BUSY and time.monotonic() < deadline:
            pass
    yield


def pytest_generate_tests(metafunc):
    """Tests that use the ``kernel_path`` fixture (codec and compressor modules opt in with
    ``pytestmark = pytest.mark.usefixtures("kernel_path")``) run once per kernel path, unless they already
    choose the path themselves through a ``backend`` parameter."""
    if "kernel_path" not in metafunc.fixturenames or "backend" in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("kernel_paths")
    metafunc.parametrize("kernel_path", mark.args if mark else KERNEL_PATHS, indirect=True)


@pytest.fixture
def kernel_path(request):
    """Run the test with ``sparsecomm.kernels.force(path)``: "auto" dispatches take that path."""
    from sparsecomm import kernels

    path = getattr(request, "param", "auto")
    with kernels.force(path):
        yield path
