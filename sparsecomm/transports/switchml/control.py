"""SwitchML control round: before a job's data, every worker sends one packet on the control slot (slot 0)
with its validity flags and the values the workers must agree on, and the switch's integer sum of them
tells every worker the same verdict (see :mod:`sparsecomm.transports.switchml`, "Control round").

Layout of the control packet's vector (``V_*``): non-finite flag, too-large flag, a count of 1, the
largest magnitude (two 16-bit halves, integer jobs), then each agreement word as 4 bytes ``b`` and their
squares: the sum over ``n`` workers agrees exactly when ``n * sum(b^2) == sum(b)^2`` for every byte
(Cauchy-Schwarz with equality only for equal bytes). The workers' agreement header
(:func:`.._handshake.check_agreement`) goes first, so that a worker running another transport is told so
instead of waiting for the switch.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import IncompatibleError, InvalidValueError, MismatchError, NonFiniteError, OverflowError_

CONTROL_SLOT = 0
MODE_FLOAT, MODE_INT = 1, 2
#: dtype codes of the control word (both switches)
DTYPES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int8: 5,
          torch.int16: 6, torch.int32: 7, torch.int64: 8, torch.uint8: 9}
#: payload kind and rounding codes of the switch's control word
KINDS = {"tensor": 1, "dense": 1, "aligned": 2, "quantized": 3}
ROUNDING = {"nearest": 0, "stochastic": 1}

#: values of magnitude >= 2^DEFAULT_MAX_EXPONENT are a fixed-point overflow on both switches (``max_exponent``)
DEFAULT_MAX_EXPONENT = 64

# validity vector layout (payload of the control packet)
V_NONFINITE, V_TOOLARGE, V_COUNT, V_CAP_HI, V_CAP_LO, V_WORDS = range(6)
#: what each agreement word of the switch's control round is, for its MismatchError
AGREE = ("numel (low word)", "numel (high word)", "dtype / payload kind / rounding", "pool_size",
         "slot_elems", "scale or index fingerprint")


def max_exponent_option(value, lo: int, hi: int) -> int:
    """``max_exponent`` checked: an integer in ``[lo, hi]`` (the exponents the switch's scale can take)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidValueError(f"max_exponent must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def too_large_text(max_exponent: int, scope: str) -> str:
    """What a worker's too-large flag means (the control round's :class:`OverflowError_`): a magnitude
    ``>= 2^max_exponent``, past which the fixed-point quantum ``n 2^(e-31)`` of the ``scope`` it sets the
    exponent of (the switch: its chunk; the sparse switch: the whole job) would round every ordinary value
    of that scope to zero."""
    return (f"a magnitude >= 2^{max_exponent} (max_exponent), past which the {scope}'s fixed-point quantum "
            f"(n 2^(e-31)) would round every ordinary value of the {scope} to zero")


def narrowed(out: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """The sum ``out`` (in the job's working precision, float32 or float64) as the input's ``dtype``. A sum
    beyond a narrower dtype's range (float16: 65504) is :class:`OverflowError_`, never an ``inf``: every
    worker holds the same integer sums and scale, hence the same ``out``, so every worker raises alike
    without a message, and the transport stays usable."""
    y = out.to(dtype)
    if y.dtype != out.dtype and y.is_floating_point() and y.numel():
        bad = ~torch.isfinite(y)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise OverflowError_(f"{name} allreduce: the sum at element {i}, {float(out.reshape(-1)[i])!r}, is "
                                 f"beyond the range of the inputs' dtype {dtype} (largest "
                                 f"{torch.finfo(dtype).max!r}); sum in a wider dtype")
    return y


def control_vector(words: list[int], k: int, *, nonfinite: bool, too_large: bool, cap: int) -> np.ndarray:
    """The control packet's payload (``k`` int32 values): the flags, the cap in two 16-bit halves, then
    each agreement word's 4 bytes as ``(byte, byte^2)`` pairs. Summed over ``n`` workers, a word is
    shared iff ``n * sum(byte^2) == sum(byte)^2`` for each of its bytes (equality case of
    Cauchy-Schwarz), so one summing round checks agreement."""
    vec = np.zeros(k, dtype=np.int32)
    vec[V_NONFINITE], vec[V_TOOLARGE], vec[V_COUNT] = int(nonfinite), int(too_large), 1
    vec[V_CAP_HI], vec[V_CAP_LO] = cap >> 16, cap & 0xFFFF
    b = np.array([[(w >> (8 * i)) & 0xFF for i in range(4)] for w in words], dtype=np.int64).reshape(-1)
    enc = np.stack([b, b * b], axis=1).reshape(-1)
    vec[V_WORDS:V_WORDS + enc.size] = enc
    return vec


def check_control(a: np.ndarray, n_words: int, n: int, name: str, agree: tuple[str, ...], *, mode: int,
                  limit: int, too_large: str, settings: str) -> None:
    """Read the summed control vector ``a`` (see :func:`control_vector`) and raise, on every worker
    alike, what it shows: a wrong worker count or a disagreement (MismatchError), NaN/Inf
    (NonFiniteError), a value too large (OverflowError_; ``too_large`` says what, for floats) or an
    integer sum bound past ``limit``."""
    if a[V_COUNT] != n:
        raise MismatchError(f"{name} control round counted {a[V_COUNT]} workers, expected {n}")
    s = a[V_WORDS:V_WORDS + 8 * n_words].reshape(n_words, 4, 2)
    differ = [agree[i] for i in range(n_words) if any(n * s[i, j, 1] != s[i, j, 0] ** 2 for j in range(4))]
    if differ:
        raise MismatchError(f"{name} allreduce: workers disagree on {', '.join(differ)}; every worker must "
                            f"pass {settings}")
    if a[V_NONFINITE]:
        raise NonFiniteError(f"{name} allreduce: {a[V_NONFINITE]} of {n} workers hold NaN or Inf values; the "
                             f"switch sums fixed-point integers and cannot carry them")
    if a[V_TOOLARGE]:
        what = too_large if mode == MODE_FLOAT else "an integer that does not fit in int32"
        raise OverflowError_(f"{name} allreduce: {a[V_TOOLARGE]} of {n} workers hold {what}")
    total = int(a[V_CAP_HI]) * 65536 + int(a[V_CAP_LO])
    if mode == MODE_INT and total > limit:
        raise OverflowError_(f"{name} allreduce: the workers' largest |values| add up to {total} > {limit}; "
                             f"the switch's integer sum could overflow (it would wrap), so nothing was sent")


def started_program(fabric, config_cls, elems: int | None, slots: int | None, burst: int | None,
                    audit: bool, workers: int | None = None):
    """The switch program a transport talks to and its service's name (both switches; ``config_cls`` is the
    program's constants, :class:`.dataplane.SwitchConfig` or its sparse twin, with ``NAME``,
    ``parse``, ``spec`` and ``on(fabric)``; ``workers``: the switch's bitmap width, only that program has
    it). ``None``: not asked.

    In-process services (SimFabric): the program asked for, the fabric's defaults for the rest
    (:mod:`..defaults`), named by what was asked (``"switch"`` when nothing was). Otherwise the launcher
    started it (``services=["switch..."]``): of the started programs of this kind, resolved on this
    fabric, the one whose constants equal every one asked for; so a transport asking for none takes the
    started one, and a constant that no started program has is an :class:`IncompatibleError` naming them
    (gloo cannot check message sizes: a mismatch would garble the stream)."""
    asked = {k: v for k, v in (("elems", elems), ("slots", slots), ("burst", burst)) if v is not None}
    if audit:
        asked["audit"] = True
    if workers is not None:
        asked["workers"] = workers
    cfg = config_cls(**asked)            # checks the values asked for
    name = config_cls.NAME
    if fabric.in_process_services:
        return cfg.on(fabric), cfg.spec()
    started = [sp for sp in fabric.services() if sp.partition(":")[0] == name]
    programs = [(config_cls.parse(sp.partition(":")[2] or None).on(fabric), sp) for sp in started]
    fits = [(c, sp) for c, sp in programs if all(getattr(c, k) == v for k, v in asked.items())]
    if len(fits) == 1:
        return fits[0]
    if not started:
        fabric.service(cfg.spec())   # raises ServiceNotStarted: how to start it, or why this fabric has none
    mine = ", ".join(f"slot_elems={c.elems}, switch_slots={c.slots}, burst={c.burst}" for c, _ in programs)
    raise IncompatibleError(
        f"transport {name!r} asked for a switch program with {asked} but the launcher started {started} "
        f"({mine} on this fabric); pass slot_elems / burst / switch_slots matching one of them (or none: "
        f"the started switch's)" + (" -- several match" if len(fits) > 1 else ""))
