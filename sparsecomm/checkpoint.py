"""Checkpoint files: :func:`save` writes one so that it is never left truncated, :func:`load` reads one and
says which file is truncated or unreadable instead of torch's bare ``OSError: [Errno 22] Invalid argument``
or "failed finding central directory".

Every rank saves its own file (the optimizer's and the DDP hook state's ``state_dict()`` hold per-worker
method state)::

    from sparsecomm import checkpoint

    checkpoint.save(opt.state_dict(), f"ckpt/rank{ctx.rank}.pt")
    opt.load_state_dict(checkpoint.load(f"ckpt/rank{ctx.rank}.pt"))

:func:`save` is ``torch.save`` into a temporary file beside the target, flushed to disk, then renamed over
it (``os.replace``, atomic on POSIX), so a crash mid-save leaves the previous checkpoint whole. :func:`load`
is ``torch.load``; a file in torch's format (a zip archive) whose last bytes do not hold its whole
end-of-archive record was cut short (a save or a copy interrupted): it raises
:class:`~sparsecomm.errors.InvalidValueError` naming the file, its size and that it is truncated, and so
does any other failure to read the file (naming it, with torch's message).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .errors import InvalidValueError

#: the signature of a zip archive's end-of-central-directory record, and the most bytes from the end of
#: the file it may start at (its 22 bytes plus a comment of at most 65535)
_EOCD = b"PK\x05\x06"
_EOCD_SPAN = 22 + 65535
_ZIP_START = b"PK\x03\x04"


def save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path``, atomically: the file is written whole under a temporary name in
    the same folder, flushed to disk and renamed over ``path``.

    Args:
        obj: what to save (a ``state_dict()``).
        path: the file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _truncated(path: Path) -> int | None:
    """The file's size if it starts as a zip archive (torch's format) but its end-of-archive record is
    missing (cut short), else None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if head != _ZIP_START:
            return None if size else 0
        f.seek(max(0, size - _EOCD_SPAN))
        tail = f.read()
    at = tail.rfind(_EOCD)
    # the record is 22 bytes and its comment's length, the last 2 of them: the file must hold all of it
    whole = at >= 0 and at + 22 <= len(tail) and at + 22 + int.from_bytes(tail[at + 20:at + 22], "little") <= len(tail)
    return None if whole else size


def load(path: str | os.PathLike, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)``, or :class:`~sparsecomm.errors.InvalidValueError` naming the file
    when it is truncated (see the module doc) or cannot be read.

    Args:
        path: the file.
        **kwargs: passed to ``torch.load`` (``map_location=``, ``weights_only=``).
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidValueError(f"checkpoint file {str(path)!r} does not exist (or is not a file)")
    size = _truncated(path)
    if size is not None:
        raise InvalidValueError(
            f"checkpoint file {str(path)!r} is truncated: its {size} bytes end before the end-of-archive "
            f"record a file torch.save wrote ends with (a save or a copy was cut short); load an intact "
            f"copy (sparsecomm.checkpoint.save writes atomically, so a crash leaves the previous file whole)")
    try:
        return torch.load(path, **kwargs)
    except Exception as e:  # noqa: BLE001 - torch's errors name neither the file nor the cause
        raise InvalidValueError(f"checkpoint file {str(path)!r} ({path.stat().st_size} bytes) cannot be "
                                f"read: {type(e).__name__}: {e}") from e
