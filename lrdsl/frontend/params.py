"""Learned parameters declared in a spec (`param A_log, dt_bias[K] in (-inf, inf) init ...`).

A param is one number per value head ([HV]), per head and key channel ([HV, K]) or per head and
value channel ([HV, V]), the same for every token. Per-token expressions read it like an input; the kernels load it once per head where
they load the inputs, and its gradient is the sum over tokens of the per-token chain rule. Here:
lowering the declarations (shape, range, initialisation), printing an initialisation, checking
the tensors a call passes, and drawing initial values for lrdsl.nn.Layer.
"""
from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import sympy as sp

from lrdsl.errors import InputError, SpecError
from lrdsl.frontend import ir

# Mamba-2's initialisation (what FLA's layers do): A = exp(A_log) uniform in [1, 16] per head,
# dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]. Any other param starts at 0.
DEFAULT_INITS = {
    "A_log": ("log", ("uniform", Fraction(1), Fraction(16))),
    "dt_bias": ("softplus_inv", ("log_uniform", Fraction(1, 1000), Fraction(1, 10))),
}


def declared_range(d):
    """(lo, hi, lo_open, hi_open) of a declaration's written range (an input's or a param's),
    exact; SpecError at the range when it is empty."""
    r = d.range
    lo = -sp.oo if r.lo is None else sp.Rational(r.lo.numerator, r.lo.denominator)
    hi = sp.oo if r.hi is None else sp.Rational(r.hi.numerator, r.hi.denominator)
    lo_open, hi_open = r.lo_open or r.lo is None, r.hi_open or r.hi is None
    if lo > hi or (lo == hi and (lo_open or hi_open)):
        raise SpecError(f"the range of '{d.name}' is empty", r.span)
    return lo, hi, lo_open, hi_open


def lower_params(lw, st) -> list:
    """The ir.Param of each declaration of a `param` line, declared in the lowerer's names."""
    out = []
    for d in st.decls:
        kind = "scalar"
        if d.shape is not None:
            kind, kspan = d.shape
            if kind not in ("K", "V"):
                raise SpecError(f"a param is one number per head (`param {d.name}`), one per head and key "
                                f"channel (`param {d.name}[K]`) or one per head and value channel "
                                f"(`param {d.name}[V]`), not one per [{kind}] channel", kspan)
        lw.declare(d.name, kind, d.span, "param name")
        lo, hi, lo_open, hi_open = declared_range(d) if d.range is not None else (-sp.oo, sp.oo, True, True)
        init = d.init if d.init is not None else _default(d.name, lo, hi, lo_open, hi_open)
        a, b = _init_range(init, d)
        flo, fhi = float(lo), float(hi)  # sympy's Integer(0) == 0.0 is False: compare floats
        inside = (a > flo or (a == flo and not lo_open)) and (b < fhi or (b == fhi and not hi_open))
        if not inside:
            raise SpecError(f"the init of '{d.name}' draws values in [{a:.6g}, {b:.6g}], outside its declared "
                            f"range; give an init inside it, e.g. `init {decimal_text(_middle(lo, hi))}`", d.span)
        out.append(ir.Param(d.name, kind, lo, hi, lo_open, hi_open, init, d.span))
    return out


def _middle(lo, hi) -> Fraction:
    if lo.is_finite and hi.is_finite:
        return Fraction(str((lo + hi) / 2)) if ((lo + hi) / 2).is_Rational else Fraction(0)
    if lo.is_finite:
        return Fraction(str(lo + 1))
    if hi.is_finite:
        return Fraction(str(hi - 1))
    return Fraction(0)


def _default(name, lo, hi, lo_open, hi_open) -> tuple:
    """Mamba-2's for A_log and dt_bias; else 0, or the middle of the range when 0 is outside it."""
    if name in DEFAULT_INITS:
        return DEFAULT_INITS[name]
    zero_inside = (lo < 0 or (lo == 0 and not lo_open)) and (hi > 0 or (hi == 0 and not hi_open))
    return ("number", Fraction(0) if zero_inside else _middle(lo, hi))


def _init_range(init, d) -> tuple:
    """[lo, hi] of the values an init draws (floats); a SpecError where it is not defined."""
    kind = init[0]
    if kind == "number":
        return float(init[1]), float(init[1])
    if kind in ("uniform", "log_uniform"):
        a, b = init[1], init[2]
        if not a < b:
            raise SpecError(f"{kind}(lo, hi) needs lo < hi; got {decimal_text(a)}, {decimal_text(b)}", d.span)
        if kind == "log_uniform" and a <= 0:
            raise SpecError(f"log_uniform(lo, hi) draws exp(uniform(log lo, log hi)), so lo must be above 0; "
                            f"got {decimal_text(a)}", d.span)
        return float(a), float(b)
    a, b = _init_range(init[1], d)
    if a <= 0:
        raise SpecError(f"{kind}(...) takes positive values, but its argument draws down to {a:.6g}; draw from "
                        "a positive range, e.g. uniform(1, 16)", d.span)
    if kind == "log":
        return math.log(a), math.log(b)
    return _softplus_inv(a), _softplus_inv(b)


def _softplus_inv(y: float) -> float:
    return y + math.log(-math.expm1(-y))  # log(exp(y) - 1), without overflow for large y


def decimal_text(x: Fraction) -> str:
    """A number as the spec writes it: exact (the literals a spec can hold are finite decimals)."""
    with localcontext() as ctx:
        ctx.prec = 400
        d = (Decimal(x.numerator) / Decimal(x.denominator)).normalize()
    plain = format(d, "f")
    return plain if len(plain) <= 24 else str(d)


def init_text(init: tuple) -> str:
    """An init as spec text: `0.5`, `uniform(1, 16)`, `log(uniform(1, 16))`."""
    if init[0] == "number":
        return decimal_text(init[1])
    if init[0] in ("uniform", "log_uniform"):
        return f"{init[0]}({decimal_text(init[1])}, {decimal_text(init[2])})"
    return f"{init[0]}({init_text(init[1])})"


def sample(init: tuple, shape, generator=None):
    """Values drawn by an init, a float32 tensor of the given shape."""
    import torch
    kind = init[0]
    if kind == "number":
        return torch.full(shape, float(init[1]))
    if kind == "uniform":
        return torch.empty(shape).uniform_(float(init[1]), float(init[2]), generator=generator)
    if kind == "log_uniform":
        lo, hi = math.log(float(init[1])), math.log(float(init[2]))
        return torch.empty(shape).uniform_(lo, hi, generator=generator).exp()
    x = sample(init[1], shape, generator)
    if kind == "log":
        return x.log()
    return x + torch.log(-torch.expm1(-x))  # softplus_inv


def param_shape(p: ir.Param, HV: int, K: int, V: int) -> tuple:
    """[HV], [HV, K] or [HV, V]: one value per value head (and key or value channel)."""
    return (HV,) if p.kind == "scalar" else (HV, K if p.kind == "K" else V)


def layout(p: ir.Param) -> str:
    return "[HV]" if p.kind == "scalar" else f"[HV, {p.kind}]"


_PER = {"scalar": "value head", "K": "value head and key channel", "V": "value head and value channel"}


def check_tensors(mixer: ir.Mixer, given: dict, HV: int, K: int, V: int, device) -> dict:
    """The params of a call, checked against the spec: each a floating-point tensor [HV], [HV, K]
    or [HV, V] on the inputs' device. Returns them by name."""
    import torch
    out = {}
    for p in mixer.params:
        t = given.get(p.name)
        want = param_shape(p, HV, K, V)
        if t is None:
            raise InputError(f"mixer '{mixer.name}' needs the param {p.name!r}, a tensor {layout(p)} = "
                             f"{list(want)} (one value per {_PER[p.kind]})")
        if not isinstance(t, torch.Tensor):
            raise InputError(f"param {p.name!r} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise InputError(f"param {p.name!r} must be a floating-point tensor, got {t.dtype}")
        if t.is_meta:
            raise InputError(f"param {p.name!r} is a meta tensor (shape only, no data); the mixers compute "
                             "on real tensors")
        if tuple(t.shape) != want:
            raise InputError(f"param {p.name!r} must have shape {layout(p)} = {list(want)} (one value per "
                             f"{_PER[p.kind]}, the same for every token), got {list(t.shape)}")
        if t.device != device:
            raise InputError(f"param {p.name!r} is on {t.device} but q is on {device}; put all tensors on one "
                             "device")
        out[p.name] = t
    return out
