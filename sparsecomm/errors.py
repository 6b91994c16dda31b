"""Exceptions shared by every layer: every error class of the library is defined here.

Every error the library raises on bad input derives from :class:`SparseCommError`, so a caller (or a
launcher collecting failures from many ranks) can tell a user mistake from a bug. Each class also derives
from the builtin a caller would catch without knowing the library (``ValueError``, ``TypeError``,
``KeyError``, ...), so ``except ValueError`` keeps working. Never raise a bare ``ValueError`` or
``TypeError`` from the library: :class:`InvalidValueError` and :class:`InvalidTypeError` are the general
cases (``tests/repo/test_errors.py`` fails on a new bare one).
"""

from __future__ import annotations


class SparseCommError(Exception):
    """Base class of all sparsecomm errors."""


class UnknownNameError(SparseCommError, KeyError):
    """A registry lookup for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its argument; this shows the plain sentence
        return str(self.args[0]) if self.args else ""


class IncompatibleError(SparseCommError, ValueError):
    """An invalid combination (compressor x transport, payload kind x transport, fabric x transport)."""


class MismatchError(SparseCommError, ValueError):
    """Workers disagree on something they must share: tensor length, dtype, scale, block size."""


class NonFiniteError(SparseCommError, ValueError):
    """A NaN or Inf where only finite values can be carried (fixed point, quantisation)."""


class SumOverflowError(SparseCommError, OverflowError):
    """A value or a sum that cannot be represented in the target format (an integer or fixed-point
    code, an fp16 sum past 65504): never wrapped or saturated silently."""


#: the former name of :class:`SumOverflowError` (deprecated; CHANGELOG.md)
OverflowError_ = SumOverflowError


class FabricTimeout(SparseCommError, TimeoutError):
    """A point-to-point operation or collective waited longer than its timeout (e.g. a crashed peer)."""


class PeerFailure(SparseCommError, RuntimeError):
    """Another rank failed; raised on every surviving rank with the failing rank's error."""


class MalformedMessage(SparseCommError, ValueError):
    """A message that is not a valid message of the protocol: a bad magic number, version or checksum,
    or a size, count or code outside what the receiving rank allows (its world size, its own tensor,
    the protocol's limits). Raised before anything is allocated or looped over from that message."""


class InvalidValueError(SparseCommError, ValueError):
    """An argument with the right type but a value the function does not accept (the message names the
    argument, the value and what is valid)."""


class InvalidTypeError(SparseCommError, TypeError):
    """An argument of a type the function does not accept (the message names the accepted types)."""


class UnsupportedDtypeError(InvalidTypeError, IncompatibleError):
    """A tensor of a dtype a transport cannot sum into a result of that dtype (``bool`` on every transport,
    complex on the block and switch transports): the message names the dtype, the dtypes the transport sums
    and what to do. Both an :class:`InvalidTypeError` and an :class:`IncompatibleError`."""


class HyperParameterError(SparseCommError, TypeError):
    """A keyword argument that the component it was passed to does not take."""


class ConfigError(SparseCommError, ValueError):
    """A configuration that cannot run: an algorithm's hyper-parameter (step size, probability, worker
    count, block layout) or an experiment's settings (the message says why and what is valid)."""


class ProtocolError(SparseCommError, RuntimeError):
    """A message or state the protocol cannot have produced: an internal invariant of a stream broke, or
    a packet was forged or corrupted on the way."""


class NetbedError(SparseCommError, RuntimeError):
    """The netbed cannot be set up (missing privilege, tool or kernel feature) or was misused."""


class MissingExtraError(SparseCommError, ModuleNotFoundError):
    """A part of the project that needs an optional extra was imported without it; ``name`` is the first
    missing package, the message names every missing one and the ``pip install "sparsecomm[<extra>]"``
    that provides them."""


#: the error classes a rank may name when it reports a failure to the others (through the rendezvous
#: store, as text: nothing a peer sends is unpickled); any other class is reported as PeerFailure
REPORTABLE = {c.__name__: c for c in (UnknownNameError, IncompatibleError, MismatchError, NonFiniteError,
                                      SumOverflowError, FabricTimeout, PeerFailure, MalformedMessage,
                                      ProtocolError)}


class CodecError(SparseCommError, ValueError):
    """Invalid arguments to a codec kernel: block size, dtype, mask length, device, index range."""


class CompressorConfigError(SparseCommError, ValueError):
    """A compressor was built with an invalid hyper-parameter (or an invalid combination)."""


class CompressorInputError(SparseCommError, TypeError):
    """``compress`` got something that is not a floating-point tensor of a supported dtype."""


class GeneratorRequiredError(SparseCommError, ValueError):
    """A random compressor was called without a generator and was built without ``seed``."""


class UnderflowError(SparseCommError, ValueError):
    """A rounding cast's input lies so far below the target's normal range that the declared
    contraction ``delta`` does not hold for it."""


class ServiceShutdown(SparseCommError):
    """Raised inside a service endpoint when the run is over (its loop ends quietly)."""


class ServiceNotStarted(IncompatibleError):
    """A transport asked for a service that the launcher did not start as a rank."""


class EndpointCrashed(SparseCommError):
    """Raised inside an endpoint that the network model crashed (the launcher swallows it)."""


class KernelPathError(SparseCommError, ValueError):
    """An unknown kernel path (valid: auto, numba, torch)."""


class WorkerError(SparseCommError, RuntimeError):
    """A worker's exception that could not be pickled back to the parent (its type name and text)."""


class WireFormatError(SparseCommError, ValueError):
    """Wire data that does not match its announced layout (size, encoding, bitmap count)."""
