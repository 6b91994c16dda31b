"""Results that cross ranks under torchrun: a documented safe encoding, never pickled.

``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples, dicts of those, CPU tensors and
numpy arrays and scalars of numeric dtypes (dtype, shape, raw bytes), as JSON plus the arrays' bytes
(:func:`encode_result` / :func:`decode_result`); :func:`gather_results` gives every rank every rank's
result. Limits, the same on both sides (what encodes decodes): at most 256 MiB per result, 64 levels of
nesting, 2^21 JSON lists (one per value, so about two million values outside arrays: return an array for
more), 64 dimensions per array.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidTypeError, InvalidValueError, MalformedMessage

_MAX_RESULT_BYTES = 256 << 20
_MAX_DEPTH = 64
_MAX_LISTS = 1 << 21        # JSON lists ("[") per result: bounds the objects json.loads builds
_MAX_DIMS = 64
_MAX_DIM = 2**63 - 1
_MAX_INT_DIGITS = 4300      # Python's default int <-> str limit (sys.get_int_max_str_digits)
_MAX_FLOAT_CHARS = 64       # repr(float) needs at most 24
_TORCH_DTYPES = None
_NUMPY_DTYPES = None


def _torch_dtypes() -> dict:
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        _TORCH_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                              torch.bool, torch.complex64, torch.complex128)}
    return _TORCH_DTYPES


def _numpy_dtypes() -> dict:
    """numpy's numeric dtypes, little endian, by their ``dtype.str`` (``'<f8'``, ``'|b1'``, ...)."""
    global _NUMPY_DTYPES
    if _NUMPY_DTYPES is None:
        import numpy as np

        kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                 np.float16, np.float32, np.float64, np.complex64, np.complex128)
        _NUMPY_DTYPES = {np.dtype(k).newbyteorder("<").str: np.dtype(k).newbyteorder("<") for k in kinds}
    return _NUMPY_DTYPES


def encode_result(obj: Any) -> bytes:
    """``obj`` as bytes in the safe encoding: ``len(json) (8 bytes, little endian) | json | array bytes``.

    JSON nodes are tagged lists: ``["n"]``, ``["b", v]``, ``["i", "digits"]``, ``["f", "repr"]``,
    ``["s", v]``, ``["y", hex]``, ``["l", [...]]``, ``["t", [...]]``, ``["d", [[k, v], ...]]``, and nodes
    whose bytes follow the JSON, one after another in the order the nodes appear (each ``offset`` is the
    sum of the ``nbytes`` before it; together they fill the message): a torch tensor
    ``["T", dtype, shape, offset, nbytes]`` (``str(dtype)``), a numpy array
    ``["A", dtype, shape, offset, nbytes]`` and a numpy scalar ``["a", dtype, offset, nbytes]``
    (little-endian ``dtype.str``, e.g. ``"<f8"``). Anything else, or past the module's limits, raises
    :class:`InvalidTypeError` / :class:`InvalidValueError`.
    """
    import json

    import numpy as np
    import torch

    blobs: list[bytes] = []
    size = [0]

    def blob(data: bytes) -> tuple[int, int]:
        blobs.append(data)
        size[0] += len(data)
        return size[0] - len(data), len(data)

    def dims(shape) -> list[int]:
        if len(shape) > _MAX_DIMS:
            raise InvalidValueError(f"a result array has {len(shape)} dimensions; at most {_MAX_DIMS} cross ranks")
        return [int(s) for s in shape]

    def numpy_dtype(dt) -> str:
        key = dt.newbyteorder("<").str if dt.kind in "biufc" else None
        if key not in _numpy_dtypes():
            raise InvalidTypeError(f"a numpy result of dtype {dt} cannot cross ranks: only numeric dtypes "
                                   f"({', '.join(sorted(_numpy_dtypes()))}) travel as plain data")
        return key

    def enc(o, depth):
        if depth > _MAX_DEPTH:
            raise InvalidTypeError(f"the result nests deeper than {_MAX_DEPTH} levels")
        if o is None:
            return ["n"]
        if isinstance(o, np.generic) and o.dtype.kind in "biufc":    # before float: np.float64 is one
            key = numpy_dtype(o.dtype)
            return ["a", key, *blob(np.asarray(o, dtype=_numpy_dtypes()[key]).tobytes())]
        if isinstance(o, bool):
            return ["b", o]
        if isinstance(o, int):
            try:
                return ["i", str(int(o))]
            except ValueError:
                raise InvalidValueError(f"a result integer has more than {_MAX_INT_DIGITS} digits") from None
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
        if isinstance(o, torch.Tensor) and str(o.dtype) in _torch_dtypes():
            t = o.detach().to("cpu").contiguous()
            shape = dims(t.shape)
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return ["T", str(t.dtype), shape, *blob(data)]
        if type(o) is np.ndarray:
            key = numpy_dtype(o.dtype)
            shape = dims(o.shape)
            return ["A", key, shape, *blob(np.ascontiguousarray(o, dtype=_numpy_dtypes()[key]).tobytes())]
        raise InvalidTypeError(f"a result of type {type(o).__name__} cannot cross ranks (in place under torchrun, "
                               f"results travel in a safe encoding, never pickled): return None, bool, int, "
                               f"float, str, bytes, tensors, numeric numpy arrays, or lists / tuples / dicts "
                               f"of them")

    doc = json.dumps(enc(obj, 0)).encode()
    if doc.count(b"[") > _MAX_LISTS:
        raise InvalidValueError(f"the result's JSON has more than {_MAX_LISTS} '[' (one per value outside "
                                f"arrays, and any in its strings); return a tensor or a numpy array for long "
                                f"sequences of numbers")
    return len(doc).to_bytes(8, "little") + doc + b"".join(blobs)


def decode_result(data: bytes) -> Any:
    """Inverse of :func:`encode_result`; a pure parser (nothing is executed). Every length, count, depth,
    dimension, offset and size in the message is checked against the message and the module's limits
    before anything is allocated from it, parsed or recursed into; the array bytes are used once each (no
    node can claim bytes another one holds). A malformed message is :class:`MalformedMessage`."""
    import json

    import numpy as np
    import torch

    def bad(why: str):
        return MalformedMessage(f"a result from another rank is malformed: {why}")

    if len(data) < 8:
        raise bad("shorter than its length prefix")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise bad("its JSON length exceeds the message")
    text = data[8:8 + n]
    if text.count(b"[") > _MAX_LISTS:
        raise bad(f"more than {_MAX_LISTS} JSON lists")
    try:
        doc = json.loads(text.decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad(f"invalid JSON ({exc})") from None
    blob = memoryview(data)[8 + n:]
    pos = [0]                                      # the next array's bytes start here

    def take(off, nbytes, shape, item: int) -> memoryview:
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(
                type(s) is int and 0 <= s <= _MAX_DIM for s in shape)):
            raise bad(f"an invalid array shape (at most {_MAX_DIMS} dimensions, each in [0, 2^63))")
        count = 0 if 0 in shape else 1
        for s in shape if count else ():     # every factor >= 1: stops before the product grows past the message
            count *= s
            if count * item > len(blob):
                raise bad("an array larger than the message")
        if not (type(off) is int and type(nbytes) is int and off == pos[0] and nbytes == count * item
                and off + nbytes <= len(blob)):
            raise bad("an array whose size or offset does not fit the message")
        pos[0] += nbytes
        return blob[off:off + nbytes]

    def dec(node, depth):
        if depth > _MAX_DEPTH or not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise bad("an invalid node")
        tag, args = node[0], node[1:]
        one_str = len(args) == 1 and isinstance(args[0], str)
        try:
            if tag == "n" and not args:
                return None
            if tag == "b" and len(args) == 1 and isinstance(args[0], bool):
                return args[0]
            if tag == "i" and one_str and len(args[0]) <= _MAX_INT_DIGITS + 1:
                return int(args[0])
            if tag == "f" and one_str and len(args[0]) <= _MAX_FLOAT_CHARS:
                return float(args[0])
            if tag == "s" and one_str:
                return args[0]
            if tag == "y" and one_str:
                return bytes.fromhex(args[0])
            if tag in ("l", "t") and len(args) == 1 and isinstance(args[0], list):
                items = [dec(v, depth + 1) for v in args[0]]
                return items if tag == "l" else tuple(items)
            if tag == "d" and len(args) == 1 and isinstance(args[0], list):
                out = {}
                for pair in args[0]:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise bad("an invalid dict entry")
                    key = dec(pair[0], depth + 1)
                    try:
                        hash(key)
                    except TypeError:
                        raise bad("an unhashable dict key") from None
                    out[key] = dec(pair[1], depth + 1)
                return out
            if tag == "T" and len(args) == 4 and isinstance(args[0], str) and args[0] in _torch_dtypes():
                dtype = _torch_dtypes()[args[0]]
                raw = take(args[2], args[3], args[1], dtype.itemsize)
                t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw)
                     else torch.empty(0, dtype=torch.uint8))
                return t.view(dtype).reshape(args[1]).clone()
            if tag == "A" and len(args) == 4 and isinstance(args[0], str) and args[0] in _numpy_dtypes():
                dtype = _numpy_dtypes()[args[0]]
                raw = take(args[2], args[3], args[1], dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).reshape(args[1]).astype(dtype.newbyteorder("="))
            if tag == "a" and len(args) == 3 and isinstance(args[0], str) and args[0] in _numpy_dtypes():
                dtype = _numpy_dtypes()[args[0]]
                raw = take(args[1], args[2], [], dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))[0]
        except (IndexError, TypeError, ValueError, RuntimeError) as exc:
            if isinstance(exc, MalformedMessage):
                raise
            raise bad(f"an invalid {tag!r} node ({exc})") from None
        raise bad(f"an invalid or unknown {tag!r} node")

    out = dec(doc, 0)
    if pos[0] != len(blob):
        raise bad(f"{len(blob) - pos[0]} bytes after its last array")
    return out


def gather_results(result: Any, rank: int, total: int, fabric) -> list[Any]:
    """Every rank's result on every rank, in the safe encoding, over the default group: the lengths first
    (one int64 each, with a flag for a result that cannot be encoded), then the encodings padded to the
    longest, then each rank's verdict on the others' (so that a malformed result is
    :class:`MalformedMessage` on every rank). A collective that fails (a rank raised in ``fn`` or died)
    is the fabric's error (:meth:`~sparsecomm.fabric.torch.torch_fabric.TorchFabric.collective_error`), naming
    the rank that failed first."""
    import torch
    import torch.distributed as dist

    from ..fabric.torch.torch_waiters import retain

    def all_gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(total)]
        try:
            dist.all_gather(out, t)
        except RuntimeError as exc:
            raise fabric.collective_error(exc, f"all_gather of the results ({what})") from exc
        retain(out, t)
        return out

    try:
        data, err = encode_result(result), None
    except Exception as exc:  # noqa: BLE001 - every rank must learn that this one has nothing to send
        data, err = b"", exc
    metas = all_gather(torch.tensor([len(data), 1 if err else 0], dtype=torch.int64), "lengths")
    lengths = [int(m[0]) for m in metas]
    bad = [r for r in range(total) if int(metas[r][1])]
    longest = max(lengths)
    if bad or longest > _MAX_RESULT_BYTES or min(lengths) < 0:
        if err is not None:
            cls = InvalidValueError if isinstance(err, ValueError) else InvalidTypeError
            raise cls(f"worker {rank}: {err}") from err
        if bad:
            raise InvalidTypeError(f"the result of worker {bad[0]} cannot cross ranks (see its error; only None, "
                                   f"bool, int, float, str, bytes, tensors, numeric numpy arrays and lists / "
                                   f"tuples / dicts of them can)")
        raise InvalidValueError(f"a result of {longest} bytes exceeds the {_MAX_RESULT_BYTES} bytes that launch "
                                f"gathers under torchrun; return less, or save it to a file")
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = all_gather(buf, "encodings")
    out, malformed = [], None
    for r in range(total):
        if r == rank:
            out.append(result)
            continue
        try:
            out.append(decode_result(bufs[r][:lengths[r]].numpy().tobytes()))
        except MalformedMessage as exc:
            malformed = malformed or (r, exc)
            out.append(None)
    verdicts = all_gather(torch.tensor([malformed[0] if malformed else -1], dtype=torch.int64), "verdicts")
    seen = [(int(v[0]), j) for j, v in enumerate(verdicts) if int(v[0]) >= 0]
    if malformed is not None:
        raise MalformedMessage(f"rank {rank}: {malformed[1]} (the result of rank {malformed[0]})")
    if seen:
        sender, by = seen[0]
        raise MalformedMessage(f"rank {rank}: rank {by} found the result of rank {sender} malformed "
                               f"(see its error)")
    return out
