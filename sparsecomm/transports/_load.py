"""Import every transport module so that each registers itself (a broken module fails loudly)."""

from . import allgather, native, omnireduce, ring, switchml  # noqa: F401
from .switchml import sparse  # noqa: F401
