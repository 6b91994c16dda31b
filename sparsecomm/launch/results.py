"""Results that cross ranks under torchrun: a documented safe encoding, never pickled.

``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples, dicts of those and CPU tensors
(dtype, shape, raw bytes), as JSON plus the tensors' bytes (:func:`encode_result` / :func:`decode_result`;
at most 256 MiB per result); :func:`_gather_results` gives every rank every rank's result.
"""

from __future__ import annotations

from typing import Any

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

    from ..errors import MalformedMessage

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
