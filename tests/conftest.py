"""Shared test fixtures."""

from __future__ import annotations

import fcntl
import os
import tempfile

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
