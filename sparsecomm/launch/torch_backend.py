"""The ``gloo`` and ``nccl`` backends of :func:`sparsecomm.launch`: real processes over torch.distributed.

Real processes cannot run in a doctest (``fn`` must be importable by them), so this example is a script
(``tests/repo/test_docs.py`` runs it; the ``__main__`` guard is needed because the ranks are new processes)::

    import torch
    import sparsecomm as sc

    def fn(ctx):                                     # ranks 0..3; the switch service is rank 4
        t = sc.transports.get("switch", ctx.fabric)
        return t.allreduce(torch.full((1000,), float(ctx.rank)))[0].item()

    if __name__ == "__main__":
        assert sc.launch(fn, world_size=4, backend="gloo", services=("switch",), timeout_s=60) == [6.0] * 4

Two modes:

**Spawned locally** (the default). ``world_size`` worker processes plus one process per service spec are
started as fresh processes (``start_method="forkserver"`` by default where available: a server process,
started once per parent with torch preloaded, forks each rank, so a rank starts with a fork instead of a
torch import; the server also imports ``torch._dynamo``, which the first torch optimizer of a process
imports, and the modules the package's top declares (:func:`~.base.preload`: the optimizer stack, and
Numba's CPU target initialised with the default path's kernels loaded from its cache), paid once per parent
instead of once per rank (so what such a module reads from the environment at import, ``SPARSECOMM_KERNELS``
or Numba's ``NUMBA_*`` settings, is read when the server starts, at the parent's first launch);
``start_method="spawn"`` starts each rank from scratch). Nothing of the
parent's state is inherited except what ``fn`` carries. The ranks rendezvous through a TCPStore that the
parent hosts on a free port of 127.0.0.1, and form one process group: ranks ``0 .. world_size-1`` are workers, rank
``world_size + i`` serves ``services[i]`` by running ``sparsecomm.fabric.services.resolve(spec)(fabric)``
(after unpickling ``fn``, so that a service registered in ``fn``'s module is known there too).
Each worker runs ``fn(ctx)`` (with :func:`~sparsecomm.launch.set_context` installed process-wide) and
sends its pickled result to the parent, which returns them in rank order. ``fn`` must be picklable (a
module-level function or a ``functools.partial`` of one); so must the results. Children run with
``max(1, cores // ranks)`` OpenMP/torch threads each (:func:`~.base.threads_per_rank`; ``OMP_NUM_THREADS``
when set), and with nccl rank ``r`` uses GPU ``r``.

**Pinned ranks** (``pin_cores=True``; spawned ranks only: gloo, nccl, netbed). Rank ``r`` (workers first, then the
services) runs on core ``cores[r mod len(cores)]`` of the cores the parent may use (``os.sched_getaffinity``),
set when it starts, before any of its threads (gloo's, OpenMP's), which inherit it. Unpinned, the kernel's
scheduler places the ranks, and where ranks outnumber the cores it may run two workers that compute at the same
moments on one core while another core idles: their work then takes up to twice its CPU time, and whether it
does changes from call to call and from launch to launch (the sparse switch's workers take a wave's results at
the same moments while its switch waits for them; on 2 cores its call alternates between two speeds). Pinned,
the sharing is the same on every call, as a model of processes sharing cores
(:meth:`~sparsecomm.fabric.sim.sim_host.HostModel.sharing`) assumes. Under torchrun (in place) the option is
refused: the ranks are not this launch's to place.

**In place** under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) or when a
process group is already initialised: this process is one rank; the job must have
``world_size + len(services)`` ranks. Worker ranks run ``fn``, service ranks serve; then every rank gets
the list of all workers' results, so code after ``launch`` behaves the same on every rank. Results
cross ranks in a documented safe encoding, never pickled (unpickling what a peer sends runs its code):
``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples, dicts of those, CPU tensors and
numpy arrays and scalars of numeric dtypes (dtype, shape, raw bytes), as JSON plus the arrays' bytes
(:func:`~.results.encode_result` / :func:`~.results.decode_result`; at most 256 MiB per result, and the
limits of :mod:`.results`). A result of any other type is a ``TypeError`` on every rank; a malformed one
(crafted, or corrupted) is :class:`~sparsecomm.errors.MalformedMessage` on every rank; a rank that
raises in ``fn`` or dies while the others wait in the results gather gives them the fabric's error
naming it (its error class and message when it raised). A process group that ``launch`` initialised
is destroyed when it returns or raises; one the caller initialised is left initialised.

Trust. Spawned children report to their own parent over a multiprocessing pipe with pickle (the
parent started them with its own code: parent-trusts-child, as ``multiprocessing`` does); no rank ever
unpickles what another rank sends.

Shutdown protocol. A worker that returns from ``fn`` adds 1 to a counter in the rendezvous store
(``sparsecomm/.../workers_done``). Service ranks poll the counter while they wait for messages (every
50 ms) and end their loop (:class:`~sparsecomm.errors.ServiceShutdown`) once it reaches
``world_size``. Spawned workers stay alive until the counter is complete, so no rank closes its
connections while a peer may still talk to it; then every child exits.

Failures. A rank that raises, or dies without reporting, ends the run: the parent re-raises the root
failure, never a consequence of it (:mod:`.supervise`). Every wait on the fabric, and every
torch.distributed collective (the process group's timeout), is bounded by ``timeout_s`` (default 120 s).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Sequence

from ..errors import InvalidTypeError, InvalidValueError, ServiceShutdown
from .. import trace as _trace
from .base import backends, in_place, preloads, threads_per_rank
from .context import Context, set_context
from .results import gather_results
from .supervise import DONE_KEY, Reports, pack_error, reap, supervise

DEFAULT_TIMEOUT_S = 120.0
#: imported once by the fork server, so that each rank starts with a fork instead of importing torch;
#: ``torch._dynamo``: the first torch optimizer built in a process imports it (seconds), as every rank's
#: ``fn`` that trains does
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "sparsecomm.launch.torch_backend",
            "sparsecomm.fabric.torch.torch_fabric")
_OPTIONAL_PRELOAD = ("numpy", "numba")
_in_place_calls = 0


# ----------------------------------------------------------------------------- entry points
def _launch(backend: str, fn: Callable[[Context], Any], world_size: int, *, network=None,
            timeout_s: float | None = None, services: Sequence[str] = (), start_method: str | None = None,
            trace: str | None = None, pin_cores: bool = False, **options: Any) -> list[Any]:
    if options:
        raise InvalidTypeError(f"unexpected options for the {backend} backend: {sorted(options)}")
    if network is not None:
        raise InvalidTypeError(f"network= models the simulated network of backend='sim'; the {backend} backend "
                        f"runs on the real one")
    if isinstance(services, str):
        services = (services,)
    services = tuple(services)
    timeout_s = float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout_s <= 0:
        raise InvalidValueError(f"timeout_s must be positive, got {timeout_s}")
    if not isinstance(pin_cores, bool):
        raise InvalidTypeError(f"pin_cores must be a bool, got {pin_cores!r}")
    if in_place():
        if pin_cores:
            raise InvalidValueError("pin_cores=True places spawned ranks; under torchrun (in place) the ranks are "
                                    "started by someone else: pin them there (taskset, numactl)")
        with _rank_recording(trace):
            return _run_in_place(backend, fn, world_size, timeout_s, services)
    return spawn(backend, fn, world_size, timeout_s, services, start_method, trace=trace, pin_cores=pin_cores)


backends.register("gloo")(functools.partial(_launch, "gloo"))
backends.register("nccl")(functools.partial(_launch, "nccl"))


# ----------------------------------------------------------------------------- in place (torchrun)
def _rank_recording(trace: str | None):
    """Under torchrun, each rank records its own timeline, ``trace.rankR.json`` (merge them with ``python -m
    sparsecomm.trace merge``); nothing without ``trace``."""
    if trace is None:
        return contextlib.nullcontext()
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    return _trace.record(_trace.rank_path(trace, rank))


def _run_in_place(backend: str, fn: Callable, world_size: int, timeout_s: float,
                  services: tuple[str, ...]) -> list[Any]:
    import torch
    import torch.distributed as dist

    from ..fabric.torch.torch_fabric import TorchFabric

    global _in_place_calls
    owned = not dist.is_initialized()
    if owned:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    elif dist.get_backend() != backend:
        raise InvalidValueError(f"torch.distributed is initialised with backend {dist.get_backend()!r}, "
                         f"but launch asked for {backend!r}")
    total = dist.get_world_size()
    if total != world_size + len(services):
        raise InvalidValueError(f"the job has {total} ranks but launch asked for {world_size} workers + "
                         f"{len(services)} service rank(s) {list(services)}; start "
                         f"{world_size + len(services)} processes (torchrun --nproc-per-node ...)")
    _in_place_calls += 1
    key = f"{DONE_KEY}/{_in_place_calls}"
    store = dist.distributed_c10d._get_default_store()
    fabric = TorchFabric(world_size, services, timeout_s=timeout_s, store=store, shutdown_key=key)
    rank = dist.get_rank()
    result = None
    try:
        if rank < world_size:
            ctx = Context(rank, world_size, fabric, backend, fabric.device)
            set_context(ctx, process_wide=True)
            try:
                result = fn(ctx)
            finally:
                set_context(None, process_wide=True)
            store.add(key, 1)
        else:
            _serve(fabric, services[rank - world_size])
    except BaseException as exc:
        fabric.fail(exc)    # every other rank stops at once, naming this one (see TorchFabric)
        fabric.close()
        raise
    try:
        gathered = gather_results(result if rank < world_size else None, rank, total, fabric)
    finally:
        fabric.close()
        if owned:
            # Tear down what launch set up while every rank is here (also when the results could not be
            # gathered: every rank raises that alike): left to interpreter exit, gloo's destructors race
            # the fabric's waiter threads and abort ("terminate called ..."). After the last collective,
            # release ends the waits still posted (a service's receives from the workers), whose threads
            # would otherwise wake when a peer exits, maybe while this interpreter finalizes: an abort too.
            if fabric.failure is None:
                dist.barrier()
                fabric.release()
            dist.destroy_process_group()
    return gathered[:world_size]


def _serve(fabric, spec: str) -> None:
    """Run the service loop for ``spec`` until the workers are done."""
    from .. import transports  # noqa: F401  (the library's services register when it is imported)

    from ..fabric.services import resolve

    main = resolve(spec)
    try:
        main(fabric)
    except ServiceShutdown:
        return
    fabric.wait_for_shutdown()   # the loop returned early: keep the rank (and its sockets) until the end


# ----------------------------------------------------------------------------- spawned processes
@contextmanager
def _child_env(overrides: dict[str, str]):
    saved = {k: os.environ.get(k) for k in overrides}
    for k, v in overrides.items():
        if saved[k] is None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def _start_method(requested: str | None) -> str:
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if requested is None:
        return "forkserver" if "forkserver" in methods else "spawn"
    if requested not in ("forkserver", "spawn") or requested not in methods:
        raise InvalidValueError(f"start_method must be one of {[m for m in ('forkserver', 'spawn') if m in methods]}, "
                         f"got {requested!r}")
    return requested


def spawn(backend: str, fn: Callable, world_size: int, timeout_s: float,
          services: tuple[str, ...], start_method: str | None = None, *,
          make_store: Callable | None = None, master_addr: str = "127.0.0.1",
          prologue: Callable[[int], None] | None = None, trace: str | None = None,
          pin_cores: bool = False) -> list[Any]:
    """Start ``world_size`` workers and one rank per service spec as processes, supervise them
    (:func:`~.supervise.supervise`) and return the workers' results in rank order (the module docstring,
    "Spawned locally"). The netbed backend places them: ``make_store(total, timeout_s)`` returns the
    rendezvous store the children reach at ``master_addr``, and each child runs the picklable
    ``prologue(rank)`` first (entering its host's network namespace). ``trace``: each rank records its
    timeline to ``trace.rankR.json`` (:func:`~sparsecomm.trace.rank_path`), which are joined into
    ``trace`` when the ranks are done, also when the run failed (:func:`~sparsecomm.trace.merge`).
    ``pin_cores``: each rank on its core of :func:`rank_cores` (the module docstring, "Pinned ranks")."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    try:
        fn_bytes = pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        raise InvalidTypeError(f"launch(backend={backend!r}) runs fn in separate processes, so fn must be picklable "
                        f"(a module-level function, or a functools.partial of one); got {fn!r}: {exc}") from exc
    total = world_size + len(services)
    if backend == "nccl" and torch.cuda.device_count() < total:
        raise InvalidValueError(f"backend 'nccl' needs one GPU per rank: {total} ranks ({world_size} workers + "
                         f"{len(services)} services) but {torch.cuda.device_count()} GPU(s) visible")
    method = _start_method(start_method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # also the modules that a higher layer declared (base.preload: the optimizer stack) and the library's
        # packages the parent has already imported (so they are known to import cleanly; the fork server
        # survives only ImportErrors in its preload)
        ctx.set_forkserver_preload(list(_PRELOAD) + [m for m in _OPTIONAL_PRELOAD if m in sys.modules]
                                   + preloads() + _loaded_library_packages())
    store = make_store(total, timeout_s) if make_store is not None else dist.TCPStore(
        "127.0.0.1", 0, total, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    reports = Reports(ctx)
    cores = rank_cores(total) if pin_cores else [None] * total
    procs = []
    ok = False
    job = uuid.uuid4().hex        # the ranks' files are one job's: merged on the wall clock
    try:
        # the parent's OMP_NUM_THREADS now, else cores // ranks (a fork server keeps the environment it
        # started with, so the count travels as an argument)
        threads = int(os.environ.get("OMP_NUM_THREADS") or threads_per_rank(total))
        with _child_env({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}):
            for r in range(total):
                p = ctx.Process(target=_child_main, name=f"sparsecomm-{backend}-rank{r}",
                                args=(r, world_size, services, store.port, backend, timeout_s, fn_bytes,
                                      reports, master_addr, prologue, threads,
                                      None if trace is None else (_trace.rank_path(trace, r), job), cores[r]))
                p.start()
                procs.append(p)
        results = supervise(procs, reports, world_size, services, timeout_s, store)
        ok = True
        return results
    finally:
        reap(procs, grace_s=5.0 if ok else 0.0)
        reports.close()
        del store
        if trace is not None:
            _join_rank_traces(trace, total)


def rank_cores(total: int) -> list[int]:
    """The core of each of ``total`` ranks when pinned: the cores this process may use (``os.sched_getaffinity``),
    in increasing order, taken in turn (rank ``r`` on the ``r mod cores``-th)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[r % len(cores)] for r in range(total)]


def _join_rank_traces(path: str, total: int) -> None:
    """Merge the ranks' timelines (those written: a rank that died wrote none) into ``path``; remove them."""
    parts = [p for p in (_trace.rank_path(path, r) for r in range(total)) if os.path.exists(p)]
    if not parts:
        return
    try:
        _trace.merge(parts, path, align="none")
    except Exception as exc:  # noqa: BLE001 - a timeline must not hide the run's outcome; the parts stay
        import warnings

        warnings.warn(f"could not join the ranks' timelines {parts} into {path!r}: {exc}", RuntimeWarning)
        return
    for p in parts:
        os.remove(p)


def _loaded_library_packages() -> list[str]:
    """The library's sub-packages and modules (``sparsecomm.x``) that this process has imported, whichever
    layer they belong to (named by what is loaded, so that this layer names none above it)."""
    return sorted({".".join(m.split(".")[:2]) for m in list(sys.modules)
                   if m.startswith("sparsecomm.") and m.count(".") >= 1})


def _child_main(rank: int, world_size: int, services: tuple[str, ...], port: int, backend: str,
                timeout_s: float, fn_bytes: bytes, reports: Reports, master_addr: str = "127.0.0.1",
                prologue: Callable[[int], None] | None = None, threads: int = 1,
                trace: tuple[str, str] | None = None, core: int | None = None) -> None:
    """Entry point of a spawned rank (module level, so that spawn start-up stays cheap); ``trace``: the
    file this rank records its timeline to, and the job's name; ``core``: the core it runs on (``None``: where
    the scheduler puts it), set before it starts a thread."""
    code = 0
    if core is not None:
        os.sched_setaffinity(0, {core})
    fabric = None
    if trace is not None:
        _trace.start(trace[0], job=trace[1])
    try:
        if prologue is not None:
            prologue(rank)
        import torch
        import torch.distributed as dist

        from ..fabric.torch.torch_fabric import TorchFabric

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        total = world_size + len(services)
        store = dist.TCPStore(master_addr, port, total, is_master=False, timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=total,
                                 timeout=timedelta(seconds=timeout_s))
        fabric = TorchFabric(world_size, services, timeout_s=timeout_s, store=store, shutdown_key=DONE_KEY)
        fn = pickle.loads(fn_bytes)   # on service ranks too: services registered beside fn are then known
        if rank < world_size:
            ctx = Context(rank, world_size, fabric, backend, fabric.device)
            set_context(ctx, process_wide=True)
            result = fn(ctx)
            try:
                data = pickle.dumps(result)
            except Exception as exc:  # noqa: BLE001
                raise InvalidTypeError(f"the result of fn on worker {rank} cannot be pickled back to the parent: "
                                f"{exc}") from exc
            reports.put(("ok", rank, data))
            store.add(DONE_KEY, 1)
            parent = os.getppid()
            while int(store.add(DONE_KEY, 0)) < world_size and os.getppid() == parent:
                time.sleep(0.01)
        else:
            _serve(fabric, services[rank - world_size])
            reports.put(("ok", rank, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        if fabric is not None:
            try:
                fabric.fail(exc)    # every other rank stops at once, naming this one
            except BaseException:  # noqa: BLE001
                pass
        try:
            reports.put(("err", rank, pack_error(exc)))
        except BaseException:  # noqa: BLE001 - the parent is gone
            pass
    try:
        _trace.stop()       # before the exit below, which runs no finalizer
    except Exception as exc:  # noqa: BLE001 - a timeline must not change the run's outcome
        print(f"sparsecomm: rank {rank} could not write its timeline: {exc}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)   # skip interpreter and process-group teardown (nothing left to flush)
