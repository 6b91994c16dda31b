"""Renamed public names: the one warning a deprecated alias gives (a :class:`FutureWarning`, shown to
users by default, naming the replacement; ``CHANGELOG.md`` lists every rename)."""

from __future__ import annotations

import warnings


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a keyword, attribute or key, as the user wrote it) is deprecated in favour
    of ``new``."""
    warnings.warn(f"{old} is deprecated and will be removed: use {new} (CHANGELOG.md lists the renames)",
                  FutureWarning, stacklevel=stacklevel)
