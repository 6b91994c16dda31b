"""The ``gloo`` and ``nccl`` backends of :func:`sparsecomm.launch`: real processes over torch.distributed.

Real processes cannot run in a doctest (``fn`` must be importable by them); ``tests/test_switch_gloo.py``
runs this::

    sc.launch(fn, world_size=4, backend="gloo", services=("switch",), timeout_s=60)

Two modes:

**Spawned locally** (the default). ``world_size`` worker processes plus one process per service spec are
started as fresh processes (``start_method="forkserver"`` by default where available: a server process,
started once per parent with torch preloaded, forks each rank, so a launch costs milliseconds instead of
one torch import per rank; ``start_method="spawn"`` starts each rank from scratch). Nothing of the
parent's state is inherited except what ``fn`` carries. The ranks rendezvous through a TCPStore that the
parent hosts on a free port of 127.0.0.1, and form one process group: ranks ``0 .. world_size-1`` are workers, rank
``world_size + i`` serves ``services[i]`` by running ``sparsecomm.fabric.services.resolve(spec)(fabric)``
(after unpickling ``fn``, so that a service registered in ``fn``'s module is known there too).
Each worker runs ``fn(ctx)`` (with :func:`~sparsecomm.launch.set_context` installed process-wide) and
sends its pickled result to the parent, which returns them in rank order. ``fn`` must be picklable (a
module-level function or a ``functools.partial`` of one); so must the results. Children run with one
OpenMP/torch thread (``OMP_NUM_THREADS=1`` unless set), and with nccl rank ``r`` uses GPU ``r``.

**In place** under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) or when a
process group is already initialised: this process is one rank; the job must have
``world_size + len(services)`` ranks. Worker ranks run ``fn``, service ranks serve; then every rank gets
the list of all workers' results, so code after ``launch`` behaves the same on every rank. Results
cross ranks in a documented safe encoding, never pickled (unpickling what a peer sends runs its code):
``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples, dicts of those and CPU tensors
(dtype, shape, raw bytes), as JSON plus the tensors' bytes (:func:`encode_result` /
:func:`decode_result`; at most 256 MiB per result). A result of any other type is a ``TypeError`` on
every rank. The process group is left initialised.

Trust. Spawned children report to their own parent over a multiprocessing pipe with pickle (the
parent started them with its own code: parent-trusts-child, as ``multiprocessing`` does); no rank ever
unpickles what another rank sends.

Shutdown protocol. A worker that returns from ``fn`` adds 1 to a counter in the rendezvous store
(``sparsecomm/.../workers_done``). Service ranks poll the counter while they wait for messages (every
50 ms) and end their loop (:class:`~sparsecomm.fabric.sim.ServiceShutdown`) once it reaches
``world_size``. Spawned workers stay alive until the counter is complete, so no rank closes its
connections while a peer may still talk to it; then every child exits.

Failures. A rank that raises reports its exception and traceback to the parent, which terminates every
other process and re-raises that exception (with the traceback text as a note). A rank that dies
without reporting (``os._exit``, a signal, a segfault) is a crash: the parent gives the survivors up to
``timeout_s`` + 2 s to notice it (their waits raise :class:`PeerFailure` when gloo sees the closed
connection, or :class:`FabricTimeout`), then terminates the rest and raises :class:`PeerFailure` naming
the dead rank, with the survivors' errors as notes. Every wait on the fabric, and every torch.distributed
collective (the process group's timeout), is bounded by ``timeout_s`` (default 120 s).
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Sequence

from .errors import FabricTimeout, PeerFailure, SparseCommError
from .launch import Context, backends, set_context

DEFAULT_TIMEOUT_S = 120.0
#: imported once by the fork server, so that each rank starts in milliseconds instead of importing torch
_PRELOAD = ("torch", "torch.distributed", "sparsecomm.launch_torch", "sparsecomm.fabric.torch_fabric")
_OPTIONAL_PRELOAD = ("sparsecomm.transports", "sparsecomm.compressors", "sparsecomm.methods", "sparsecomm.optim",
                     "numpy", "numba")
_DONE_KEY = "sparsecomm/workers_done"
_CRASH_GRACE_S = 2.0
_CONSEQUENCE_GRACE_S = 1.0
_in_place_calls = 0


class WorkerError(SparseCommError, RuntimeError):
    """A worker's exception that could not be pickled back to the parent (its type name and text)."""


# ----------------------------------------------------------------------------- entry points
def _launch(backend: str, fn: Callable[[Context], Any], world_size: int, *, network=None,
            timeout_s: float | None = None, services: Sequence[str] = (), start_method: str | None = None,
            **options: Any) -> list[Any]:
    if options:
        raise TypeError(f"unexpected options for the {backend} backend: {sorted(options)}")
    if network is not None:
        raise TypeError(f"network= models the simulated network of backend='sim'; the {backend} backend "
                        f"runs on the real one")
    if isinstance(services, str):
        services = (services,)
    services = tuple(services)
    timeout_s = float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if _in_place():
        return _run_in_place(backend, fn, world_size, timeout_s, services)
    return _spawn(backend, fn, world_size, timeout_s, services, start_method)


backends.register("gloo")(functools.partial(_launch, "gloo"))
backends.register("nccl")(functools.partial(_launch, "nccl"))


def _in_place() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# ----------------------------------------------------------------------------- in place (torchrun)
def _run_in_place(backend: str, fn: Callable, world_size: int, timeout_s: float,
                  services: tuple[str, ...]) -> list[Any]:
    import torch
    import torch.distributed as dist

    from .fabric.torch_fabric import TorchFabric

    global _in_place_calls
    owned = not dist.is_initialized()
    if owned:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    elif dist.get_backend() != backend:
        raise ValueError(f"torch.distributed is initialised with backend {dist.get_backend()!r}, "
                         f"but launch asked for {backend!r}")
    total = dist.get_world_size()
    if total != world_size + len(services):
        raise ValueError(f"the job has {total} ranks but launch asked for {world_size} workers + "
                         f"{len(services)} service rank(s) {list(services)}; start "
                         f"{world_size + len(services)} processes (torchrun --nproc-per-node ...)")
    _in_place_calls += 1
    key = f"{_DONE_KEY}/{_in_place_calls}"
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
        gathered = _gather_results(result if rank < world_size else None, rank, total)
    finally:
        fabric.close()
        if owned:
            # Tear down what we set up while every rank is here (also when the results could not be
            # gathered: every rank raises that alike): left to interpreter exit, gloo's destructors race
            # the fabric's waiter threads and abort ("terminate called ...").
            if fabric.failure is None:
                dist.barrier()
            dist.destroy_process_group()
    return gathered[:world_size]


# ----------------------------------------------------------------------------- safe result encoding
_MAX_RESULT_BYTES = 256 << 20
_MAX_DEPTH = 64
_SAFE_DTYPES = None


def _safe_dtypes() -> dict:
    global _SAFE_DTYPES
    if _SAFE_DTYPES is None:
        import torch

        _SAFE_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                             torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                             torch.bool, torch.complex64, torch.complex128)}
    return _SAFE_DTYPES


def encode_result(obj: Any) -> bytes:
    """``obj`` as bytes in the safe encoding: ``len(json) (8 bytes, little endian) | json | tensor bytes``.

    JSON nodes are tagged lists: ``["n"]``, ``["b", v]``, ``["i", "digits"]``, ``["f", "repr"]``,
    ``["s", v]``, ``["y", hex]``, ``["l", [...]]``, ``["t", [...]]``, ``["d", [[k, v], ...]]``,
    ``["T", dtype, shape, offset, nbytes]``. Raises ``TypeError`` for anything else.
    """
    import json

    import torch

    blobs: list[bytes] = []
    size = [0]

    def enc(o, depth):
        if depth > _MAX_DEPTH:
            raise TypeError("the result nests deeper than 64 levels")
        if o is None:
            return ["n"]
        if isinstance(o, bool):
            return ["b", o]
        if isinstance(o, int):
            return ["i", str(int(o))]
        if isinstance(o, float):
            return ["f", repr(float(o))]
        if isinstance(o, str):
            return ["s", o]
        if isinstance(o, (bytes, bytearray)):
            return ["y", bytes(o).hex()]
        if isinstance(o, list):
            return ["l", [enc(v, depth + 1) for v in o]]
        if isinstance(o, tuple):
            return ["t", [enc(v, depth + 1) for v in o]]
        if isinstance(o, dict):
            return ["d", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in o.items()]]
        if isinstance(o, torch.Tensor) and str(o.dtype) in _safe_dtypes():
            t = o.detach().to("cpu").contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            node = ["T", str(t.dtype), list(t.shape), size[0], len(data)]
            blobs.append(data)
            size[0] += len(data)
            return node
        raise TypeError(f"a result of type {type(o).__name__} cannot cross ranks (in place under torchrun, "
                        f"results travel in a safe encoding, never pickled): return None, bool, int, float, "
                        f"str, bytes, tensors, or lists / tuples / dicts of them")

    doc = json.dumps(enc(obj, 0)).encode()
    return len(doc).to_bytes(8, "little") + doc + b"".join(blobs)


def decode_result(data: bytes) -> Any:
    """Inverse of :func:`encode_result`; a pure parser (nothing is executed), every offset and size
    checked against the message; a malformed message is :class:`MalformedMessage`."""
    import json

    import torch

    from .errors import MalformedMessage

    def bad(why: str):
        return MalformedMessage(f"a result from another rank is malformed: {why}")

    if len(data) < 8:
        raise bad("shorter than its length prefix")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise bad("its JSON length exceeds the message")
    try:
        doc = json.loads(data[8:8 + n].decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad(f"invalid JSON ({exc})") from None
    blob = memoryview(data)[8 + n:]

    def dec(node, depth):
        if depth > _MAX_DEPTH or not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise bad("an invalid node")
        tag = node[0]
        try:
            if tag == "n":
                return None
            if tag == "b":
                return bool(node[1])
            if tag == "i":
                if not isinstance(node[1], str) or len(node[1]) > 5000:
                    raise bad("an invalid integer")
                return int(node[1])
            if tag == "f":
                return float(node[1])
            if tag == "s":
                if not isinstance(node[1], str):
                    raise bad("an invalid string")
                return node[1]
            if tag == "y":
                return bytes.fromhex(node[1])
            if tag in ("l", "t"):
                items = [dec(v, depth + 1) for v in node[1]]
                return items if tag == "l" else tuple(items)
            if tag == "d":
                out = {}
                for k, v in node[1]:
                    key = dec(k, depth + 1)
                    try:
                        hash(key)
                    except TypeError:
                        raise bad("an unhashable dict key") from None
                    out[key] = dec(v, depth + 1)
                return out
            if tag == "T":
                _, dt, shape, off, nbytes = node
                dtype = _safe_dtypes().get(dt)
                if dtype is None or not isinstance(shape, list) or not all(
                        isinstance(s, int) and 0 <= s for s in shape):
                    raise bad("an invalid tensor header")
                count = 1
                for s_ in shape:
                    count *= s_
                item = torch.empty((), dtype=dtype).element_size()
                if not (isinstance(off, int) and isinstance(nbytes, int) and nbytes == count * item
                        and 0 <= off and off + nbytes <= len(blob)):
                    raise bad("a tensor whose size or offset does not fit the message")
                raw = bytearray(blob[off:off + nbytes])
                t = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
                return t.view(dtype).reshape(shape).clone()
        except (IndexError, TypeError, ValueError) as exc:
            if isinstance(exc, MalformedMessage):
                raise
            raise bad(f"an invalid {tag!r} node ({exc})") from None
        raise bad(f"an unknown node tag {tag!r}")

    return dec(doc, 0)


def _gather_results(result: Any, rank: int, total: int) -> list[Any]:
    """Every rank's result on every rank, in the safe encoding: the lengths first (one int64 each), then
    the encodings padded to the longest, with ``all_gather`` of tensors (sizes agreed before)."""
    import torch
    import torch.distributed as dist

    try:
        data, err = encode_result(result), ""
    except TypeError as exc:
        data, err = b"", str(exc)
    flag = 1 if err else 0
    meta = torch.tensor([len(data), flag], dtype=torch.int64)
    metas = [torch.zeros(2, dtype=torch.int64) for _ in range(total)]
    dist.all_gather(metas, meta)
    lengths = [int(m[0]) for m in metas]
    bad = [r for r in range(total) if int(metas[r][1])]
    longest = max(lengths)
    if bad or longest > _MAX_RESULT_BYTES or min(lengths) < 0:
        if err:
            raise TypeError(f"worker {rank}: {err}")
        if bad:
            raise TypeError(f"the result of worker {bad[0]} cannot cross ranks (see its error; only None, "
                            f"bool, int, float, str, bytes, tensors and lists / tuples / dicts of them can)")
        raise ValueError(f"a result of {longest} bytes exceeds the {_MAX_RESULT_BYTES} bytes that launch "
                         f"gathers under torchrun; return less, or save it to a file")
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(total)]
    dist.all_gather(bufs, buf)
    return [result if r == rank else decode_result(bufs[r][:lengths[r]].numpy().tobytes())
            for r in range(total)]


def _serve(fabric, spec: str) -> None:
    """Run the service loop for ``spec`` until the workers are done."""
    from .fabric.services import resolve
    from .fabric.sim import ServiceShutdown

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
        raise ValueError(f"start_method must be one of {[m for m in ('forkserver', 'spawn') if m in methods]}, "
                         f"got {requested!r}")
    return requested


def _spawn(backend: str, fn: Callable, world_size: int, timeout_s: float,
           services: tuple[str, ...], start_method: str | None = None, *,
           make_store: Callable | None = None, master_addr: str = "127.0.0.1",
           prologue: Callable[[int], None] | None = None) -> list[Any]:
    """Start and supervise the ranks. The netbed backend places them: ``make_store(total, timeout_s)``
    returns the rendezvous store the children reach at ``master_addr``, and each child runs the
    picklable ``prologue(rank)`` first (entering its host's network namespace)."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    try:
        fn_bytes = pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        raise TypeError(f"launch(backend={backend!r}) runs fn in separate processes, so fn must be picklable "
                        f"(a module-level function, or a functools.partial of one); got {fn!r}: {exc}") from exc
    total = world_size + len(services)
    if backend == "nccl" and torch.cuda.device_count() < total:
        raise ValueError(f"backend 'nccl' needs one GPU per rank: {total} ranks ({world_size} workers + "
                         f"{len(services)} services) but {torch.cuda.device_count()} GPU(s) visible")
    method = _start_method(start_method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # also the library's packages the parent has already imported (so they are known to import cleanly;
        # the fork server survives only ImportErrors in its preload)
        ctx.set_forkserver_preload(list(_PRELOAD) + [m for m in _OPTIONAL_PRELOAD if m in sys.modules])
    store = make_store(total, timeout_s) if make_store is not None else dist.TCPStore(
        "127.0.0.1", 0, total, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    queue = ctx.SimpleQueue()
    procs = []
    ok = False
    try:
        with _child_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}):
            for r in range(total):
                p = ctx.Process(target=_child_main, name=f"sparsecomm-{backend}-rank{r}",
                                args=(r, world_size, services, store.port, backend, timeout_s, fn_bytes, queue,
                                      master_addr, prologue))
                p.start()
                procs.append(p)
        results = _supervise(procs, queue, world_size, services, timeout_s, store)
        ok = True
        return results
    finally:
        _reap(procs, grace_s=5.0 if ok else 0.0)
        queue.close()
        del store


def _child_main(rank: int, world_size: int, services: tuple[str, ...], port: int, backend: str,
                timeout_s: float, fn_bytes: bytes, queue, master_addr: str = "127.0.0.1",
                prologue: Callable[[int], None] | None = None) -> None:
    """Entry point of a spawned rank (module level, so that spawn start-up stays cheap)."""
    code = 0
    fabric = None
    try:
        if prologue is not None:
            prologue(rank)
        import torch
        import torch.distributed as dist

        from .fabric.torch_fabric import TorchFabric

        torch.set_num_threads(1)
        total = world_size + len(services)
        store = dist.TCPStore(master_addr, port, total, is_master=False, timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=total,
                                 timeout=timedelta(seconds=timeout_s))
        fabric = TorchFabric(world_size, services, timeout_s=timeout_s, store=store, shutdown_key=_DONE_KEY)
        fn = pickle.loads(fn_bytes)   # on service ranks too: services registered beside fn are then known
        if rank < world_size:
            ctx = Context(rank, world_size, fabric, backend, fabric.device)
            set_context(ctx, process_wide=True)
            result = fn(ctx)
            try:
                data = pickle.dumps(result)
            except Exception as exc:  # noqa: BLE001
                raise TypeError(f"the result of fn on worker {rank} cannot be pickled back to the parent: "
                                f"{exc}") from exc
            queue.put(("ok", rank, data))
            store.add(_DONE_KEY, 1)
            parent = os.getppid()
            while int(store.add(_DONE_KEY, 0)) < world_size and os.getppid() == parent:
                time.sleep(0.01)
        else:
            _serve(fabric, services[rank - world_size])
            queue.put(("ok", rank, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        if fabric is not None:
            try:
                fabric.fail(exc)    # every other rank stops at once, naming this one
            except BaseException:  # noqa: BLE001
                pass
        try:
            queue.put(("err", rank, _pack_error(exc)))
        except BaseException:  # noqa: BLE001 - the parent is gone
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)   # skip interpreter and process-group teardown (nothing left to flush)


def _pack_error(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - not round-trippable: send the text only
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb


def _unpack_error(packed: tuple[bytes | None, str, str, str]) -> tuple[BaseException, str]:
    blob, typename, text, tb = packed
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = WorkerError(f"{typename}: {text}")
    return exc, tb


_PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "caused pair closure")


def _is_consequence(exc: BaseException, rank: int | None = None) -> bool:
    """True for errors that are (usually) the effect of another rank's failure."""
    origin = getattr(exc, "sparsecomm_origin", None)
    if origin is not None and origin != rank:
        return True
    if isinstance(exc, (PeerFailure, FabricTimeout)):
        return True
    msg = str(exc)
    # gloo's words for a peer that went away; "caused pair closure" is what a wait reports when a failing
    # peer closes its connections on purpose (see the failure record), which can reach the parent first
    return isinstance(exc, RuntimeError) and any(s in msg for s in _PEER_GONE)


def _describe(rank: int, world_size: int, services: tuple[str, ...]) -> str:
    return f"worker {rank}" if rank < world_size else f"service {services[rank - world_size]!r} (rank {rank})"


def _supervise(procs, queue, world_size: int, services: tuple[str, ...], timeout_s: float,
               store=None) -> list[Any]:
    total = len(procs)
    results: list[Any] = [None] * world_size
    done: set[int] = set()                                     # ranks that reported success
    errors: dict[int, tuple[BaseException, str]] = {}          # rank -> (exception, traceback text)
    order: list[int] = []                                      # ranks in order of failure
    deaths: dict[int, int] = {}                                # rank -> exit code, without a report
    fail_since: float | None = None
    reader = queue._reader

    def drain() -> None:
        while reader.poll():
            kind, rank, data = queue.get()
            if kind == "ok":
                done.add(rank)
                if rank < world_size:
                    results[rank] = pickle.loads(data)
            else:
                errors[rank] = _unpack_error(data)
                order.append(rank)

    while True:
        drain()
        for r, p in enumerate(procs):
            if p.exitcode is not None and r not in done and r not in errors and r not in deaths:
                drain()   # its report may have just arrived
                if r not in done and r not in errors:
                    deaths[r] = p.exitcode
                    order.append(r)
                    _record_death(store, r, p.exitcode, world_size, services)
        if all(r in done for r in range(world_size)):
            return results
        if any(not _is_consequence(errors[r][0], r) for r in errors):
            break
        if errors or deaths:
            now = time.monotonic()
            if fail_since is None:
                fail_since = now
            accounted = all(r in done or r in errors or r in deaths for r in range(total))
            grace = (timeout_s + _CRASH_GRACE_S) if deaths and not errors else _CONSEQUENCE_GRACE_S
            if accounted or now - fail_since > grace:
                break
        _mp_wait([reader] + [p.sentinel for r, p in enumerate(procs) if r not in deaths], timeout=0.25)

    # pick the root failure: a real error first, then a crash, then the first consequence
    root = next((r for r in order if r in errors and not _is_consequence(errors[r][0], r)), None)
    if root is None:
        root = next((r for r in order if r in deaths), None)
    if root is None:
        root = order[0]
    if root in errors:
        exc, tb = errors[root]
        exc.add_note(f"(raised on {_describe(root, world_size, services)} of {world_size} workers; its "
                     f"traceback:\n{tb.rstrip()})")
    else:
        exc = PeerFailure(f"{_describe(root, world_size, services)} exited with code {deaths[root]} without "
                          f"reporting a result (it crashed or was killed)")
    for r in order:
        if r == root:
            continue
        if r in errors:
            e = errors[r][0]
            exc.add_note(f"{_describe(r, world_size, services)}: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        else:
            exc.add_note(f"{_describe(r, world_size, services)}: exited with code {deaths[r]} without a report")
    raise exc


def _record_death(store, rank: int, code: int, world_size: int, services: tuple[str, ...]) -> None:
    """Tell the surviving ranks (through the store's failure record, which their watchdogs poll) that
    ``rank`` died without a report, so that they stop at once, naming it."""
    if store is None:
        return
    from .fabric.torch_fabric import encode_failure

    what = "killed by signal " + str(-code) if code is not None and code < 0 else f"exit code {code}"
    text = f"{_describe(rank, world_size, services)} died without reporting ({what})"
    try:
        store.compare_set(_DONE_KEY + "/failed", "", encode_failure(text, rank, "PeerFailure"))
    except Exception:  # noqa: BLE001 - the store is gone
        pass


def _reap(procs, grace_s: float) -> None:
    """Give the children ``grace_s`` to exit on their own, then terminate (and if need be kill) the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.is_alive():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
