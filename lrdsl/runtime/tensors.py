"""Validation of the tensors handed to a mixer, shared by the reference and the kernels.

Layouts follow flash-linear-attention: q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H);
per-head inputs [B, T, HV] (or [B, T, H] when `shared`); key-channel inputs [B, T, HV, K]; value
channel inputs [B, T, HV, V]; states [N, HV, K, V]; with cu_seqlens ([N + 1], int) B is 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from lrdsl.errors import InputError
from lrdsl.frontend import ir

if TYPE_CHECKING:
    import torch  # imported lazily: `lrdsl show` and `lrdsl check` need no torch (1 s of start-up)

L2NORM_EPS = 1e-6
API_KEYWORDS = ("scale", "initial_state", "output_final_state", "cu_seqlens")


class MixerState(NamedTuple):
    """The whole recurrent state of a mixer with auxiliary states (the ATK preconditioner's P,
    for instance) or an offline solve: S [N, HV, K, V] and each auxiliary state by its spec name,
    [N, HV, K] or [N, HV, V], and the offline solve's Gram state as "G", [N, HV, K, K]; float32.
    Other mixers take and return the plain S tensor."""
    S: torch.Tensor
    aux: dict


@dataclass(frozen=True)
class Batch:
    """Validated inputs: every declared input by name, plus the sizes and options of the call."""
    tensors: dict
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    cu_seqlens: torch.Tensor | None
    initial_aux: tuple | None = None  # the auxiliary states to start from, in the spec's order
    initial_gram: torch.Tensor | None = None  # the offline solve's Gram state G [N, HV, K, K]

    @property
    def N(self) -> int:
        return self.B if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    def sequences(self) -> list:
        """(batch index, start, end) of every sequence."""
        if self.cu_seqlens is None:
            return [(b, 0, self.T) for b in range(self.B)]
        c = self.cu_seqlens.tolist()
        return [(0, c[i], c[i + 1]) for i in range(len(c) - 1)]


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def expected_shape(inp: ir.Input, B, T, H, HV, K, V) -> tuple:
    heads = H if inp.shared else HV
    if inp.kind == "scalar":
        return (B, T, heads)
    return (B, T, heads, K if inp.kind == "K" else V)


def _layout(inp: ir.Input) -> str:
    heads = "H" if inp.shared else "HV"
    return f"[B, T, {heads}]" if inp.kind == "scalar" else f"[B, T, {heads}, {inp.kind}]"


def check_cu_seqlens(cu_seqlens) -> None:
    """The type of cu_seqlens: a 1-D integer tensor holding data."""
    import torch
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool):
        raise InputError("cu_seqlens must be a 1-D integer tensor [N + 1]")
    if cu_seqlens.is_meta:
        raise InputError("cu_seqlens is a meta tensor (shape only, no data); pass the offsets as a real "
                         "integer tensor")


def check_offsets(cu_seqlens, T: int) -> None:
    """The values of cu_seqlens (checked by check_cu_seqlens, or a list of them): from 0 to T, never
    decreasing."""
    c = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if len(c) < 2 or c[0] != 0 or c[-1] != T or any(b < a for a, b in zip(c, c[1:])):
        raise InputError(f"cu_seqlens must start at 0, never decrease and end at T={T}, got {c}")


def validate(mixer: ir.Mixer, q, k, v, inputs: dict, scale=None, initial_state=None,
             output_final_state=False, cu_seqlens=None, offsets=None) -> Batch:
    """The call's inputs checked (one InputError each) into a Batch. offsets: cu_seqlens's values as a
    list of ints, known on the host: checked instead of reading cu_seqlens back (torch.compile)."""
    import torch
    given = dict(inputs)
    given.update(q=q, k=k, v=v)
    declared = {i.name: i for i in mixer.inputs}
    params = {n: given.pop(n) for n in [p.name for p in mixer.params] if n in given}
    unknown = sorted(set(given) - set(declared))
    if unknown:
        also = f" and params {', '.join(p.name for p in mixer.params)}" if mixer.params else ""
        raise InputError(f"mixer '{mixer.name}' has no input named {unknown[0]!r}; its inputs are "
                         f"{', '.join(declared)}{also}")
    missing = [n for n in declared if given.get(n) is None]
    if missing:
        inp = declared[missing[0]]
        raise InputError(f"mixer '{mixer.name}' needs the input {missing[0]!r} with shape {_layout(inp)}")
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"input {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_meta:
            raise InputError(f"input {name!r} is a meta tensor (shape only, no data); the mixers compute "
                             "on real tensors")
        if not t.is_floating_point():
            raise InputError(f"input {name!r} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise InputError(f"input {name!r} is on {t.device} but q is on {q.device}; put all inputs on "
                             "one device")
    if q.dim() != 4:
        raise InputError(f"input 'q' must have shape [B, T, H, K], got {_shape(q)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise InputError(f"input 'v' must have shape [B, T, HV, V] = [{B}, {T}, HV, V], got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise InputError(f"v has {HV} heads, which is not a multiple of the {H} heads of q and k")
    if min(K, V) < 1:
        raise InputError(f"K and V must be at least 1, got K={K}, V={V}")
    if B < 1:
        raise InputError("the batch is empty (B = 0); give at least one sequence")
    for name, t in given.items():
        want = expected_shape(declared[name], B, T, H, HV, K, V)
        if tuple(t.shape) != want:
            raise InputError(f"input {name!r} must have shape {_layout(declared[name])} = "
                             f"[{', '.join(map(str, want))}], got {_shape(t)}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens)
        if B != 1:
            raise InputError(f"with cu_seqlens the sequences are packed along T, so B must be 1, got B={B}")
        if offsets is not None and len(offsets) != cu_seqlens.numel():
            raise InputError(f"cu_seqlens_cpu has {len(offsets)} offsets but cu_seqlens has {cu_seqlens.numel()}: "
                             "pass the same offsets twice (cu_seqlens_cpu=cu_seqlens.tolist())")
        check_offsets(cu_seqlens if offsets is None else offsets, T)
    from lrdsl.frontend.params import check_tensors
    given.update(check_tensors(mixer, params, HV, K, V, q.device))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    initial_aux = initial_gram = None
    if isinstance(initial_state, MixerState):
        aux = initial_state.aux
        if mixer.solve_lam is not None:
            aux, initial_gram = _gram_of(mixer, aux, N, HV, K, q.device)
        initial_state, initial_aux = initial_state.S, _aux_of(mixer, aux, N, HV, K, V, q.device)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (N, HV, K, V):
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise InputError(f"initial_state must have shape [N, HV, K, V] = [{N}, {HV}, {K}, {V}], got {got}")
        if not initial_state.is_floating_point():
            raise InputError(f"initial_state must be a floating-point tensor, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise InputError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    if scale is None:
        scale = K ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InputError(f"scale must be a number or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise InputError(f"scale must be a finite number, got {scale}")
    return Batch(given, B, T, H, HV, K, V, float(scale), initial_state, bool(output_final_state), cu_seqlens,
                 initial_aux, initial_gram)


def _gram_of(mixer: ir.Mixer, aux, N, HV, K, device) -> tuple:
    """(the other parts, the Gram state) of an offline-solve mixer's MixerState.aux, checked."""
    import torch
    if not isinstance(aux, dict) or "G" not in aux:
        raise InputError(f"mixer '{mixer.name}' reads its state through an offline solve: MixerState.aux "
                         "must hold its Gram state as \"G\", a tensor [N, HV, K, K] (mixer.zero_state(...) "
                         "to start)")
    g = aux["G"]
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != (N, HV, K, K) or not g.is_floating_point():
        got = _shape(g) if isinstance(g, torch.Tensor) else type(g).__name__
        raise InputError(f"the Gram state 'G' must be a floating-point tensor [N, HV, K, K] = "
                         f"[{N}, {HV}, {K}, {K}], got {got}")
    if g.device != device:
        raise InputError(f"the Gram state 'G' is on {g.device} but q is on {device}")
    return {n: t for n, t in aux.items() if n != "G"}, g


def _aux_of(mixer: ir.Mixer, aux, N, HV, K, V, device) -> tuple:
    """The auxiliary states of a MixerState, checked, in the spec's order."""
    import torch
    names = [a.name for a in mixer.aux]
    if not names and mixer.solve_lam is not None and isinstance(aux, dict) and not aux:
        return None  # an offline solve's MixerState with its Gram state only
    if not names:
        raise InputError(f"mixer '{mixer.name}' has no auxiliary states: pass initial_state as the "
                         "[N, HV, K, V] tensor S, not a MixerState")
    if not isinstance(aux, dict) or sorted(aux) != sorted(names):
        got = sorted(aux) if isinstance(aux, dict) else type(aux).__name__
        raise InputError(f"MixerState.aux must map each auxiliary state of '{mixer.name}' "
                         f"({', '.join(names)}) to a tensor, got {got}")
    out = []
    for a in mixer.aux:
        t, want = aux[a.name], (N, HV, a.width(K, V))
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.is_floating_point():
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"auxiliary state {a.name!r} must be a floating-point tensor "
                             f"[N, HV, {a.kind}] = [{', '.join(map(str, want))}], got {got}")
        if t.device != device:
            raise InputError(f"auxiliary state {a.name!r} is on {t.device} but q is on {device}")
        out.append(t)
    return tuple(out)


def compute_dtype(b: Batch) -> torch.dtype:
    import torch
    return torch.float64 if b.tensors["q"].dtype == torch.float64 else torch.float32


def regulariser_inputs(mixer: ir.Mixer) -> set:
    """The names of the inputs and params the offline solve's regulariser reads (none without one)."""
    if mixer.solve_lam is None:
        return set()
    return {s.name for s in mixer.inline_lets(mixer.solve_lam).free_symbols}


def assert_in_ranges(mixer: ir.Mixer, b: Batch) -> None:
    """Every input inside its declared range (nan aside). On a GPU a device-side assert, which costs
    no host synchronisation (a violation fails the next synchronising call); on a CPU an InputError."""
    import torch
    strict = regulariser_inputs(mixer)
    for i in (*mixer.inputs, *mixer.params):
        if not i.clamped:
            continue
        x = b.tensors[i.name]
        ok = torch.ones_like(x, dtype=torch.bool)
        # An open finite end is excluded where the math breaks at it: the offline solve's regulariser
        # (lamb = 0 in (0, inf) makes the solve singular). Elsewhere the end itself is admitted: the
        # checker's bounds hold there by continuity, and low precision rounds onto it (sigmoid(6) is
        # exactly 1.0 in bf16, for a gain declared in (0, 1)). An infinite end admits +-inf, the
        # limits (g = -inf: a hard reset).
        lo_open, hi_open = i.lo_open and i.name in strict, i.hi_open and i.name in strict
        lo, hi = float(i.lo), float(i.hi)
        if i.lo.is_finite:
            ok &= ~(x <= lo) if lo_open else ~(x < lo)
        if i.hi.is_finite:
            ok &= ~(x >= hi) if hi_open else ~(x > hi)
        what = (f"{'param' if isinstance(i, ir.Param) else 'input'} {i.name!r} has values outside its declared "
                f"range {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}: pass values "
                "inside it, or compile with check_ranges=False to have them clamped into it without a check")
        if x.device.type == "cpu":
            if not bool(ok.all()):
                raise InputError(what)
        else:
            torch._assert_async(ok.all(), what)

