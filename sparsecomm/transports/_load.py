"""Import every transport module so that each registers itself (a broken module fails loudly)."""

from . import allgather, native, omnireduce, ring, sparse_switch, switch  # noqa: F401
