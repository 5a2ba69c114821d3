"""Non-finite inputs in the backward (issue 42).

The forward keeps a non-finite input causal (common.jinja's nonfinite helpers): every output
before it is the reference's. A loss on those outputs (the later ones masked, as
torch.nan_to_num's gradient masks them) has gradients at the earlier tokens that do not depend on
the bad value at all, but a backward run on it gets nan there anyway: 0 * nan is nan, and every
reverse pass (the state gradient over chunks, the log-decays' reverse sums, the auxiliary states'
reverse scans) carries a product with the bad token's terms to the tokens before it. So the
backward runs on finite copies of the inputs: each entry that the kernels would take as non-finite
is replaced by a finite value inside its declared range, and its own gradient is nan (it has none).
Every other gradient is then that of the loss on the outputs the forward left finite. -inf in the
log-decay itself (a `log` input, or `g` of `exp(g)` whatever its range: resets) is a reset, not a
bad entry: the reference's exp(-inf) = 0 keeps every output and gradient finite.

Two ways to find the bad entries (MODE). "device", the default: every backward takes the finite copies,
made by one Triton pass over each input that also sets the input's flag on the device where it has a
nan or an infinite entry; what the forward kept for the backward (the solve's residual, the kept
intermediates) has its non-finite entries zeroed: they sit at or after a bad token, where the loss's
gradient is zero, so any finite value serves. The gradients get nan at the bad entries, and the
residual is zeroed, in place by Triton kernels that do nothing where the flags are clear. No wait for
the device: a training step can be captured in a CUDA graph, and the host queues the backward while
the forward runs. "host": one reduction per input and one wait for
the device per backward; only a batch with a bad entry pays for the masks and copies, and it recomputes
what the forward kept (the behaviour before 2026-12-06).

Since 2026-12-07 (issues 39 and 43) the staged backward of a module with FINITE_LOADS (codegen/finite.py)
takes no copy: device_flags' read-only pass sets the flags, and every load of an input in its kernels,
in the chain rule and in the twins of the forward's kernels that make its stages again
(_staged_states_finite) puts the copy's value in place (codegen/fills.py: the copies' rule, decided once from the spec).
The split's staged spec and a product's sub-mixer do too. The rest keep the copies: the general
kernels (K past the staged ones, their keep_intermediates), specs with auxiliary states (their scans
in PyTorch read the inputs), the value side, two-sided and offline-solve kernels, and every backward
with FINITE_AT_LOAD False.
"""
from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

from lrdsl.codegen.fills import bad_ends, fill_value, resets

MODE = "device"  # "device": no host synchronisation; "host": a check read back once per backward
# device mode, a module whose staged backward makes its loads of the inputs finite (codegen/finite.py):
# no copies for its kernels; False: every backward on the copies, as before 2026-12-07 (tests compare)
FINITE_AT_LOAD = True


def _bad(i, x: torch.Tensor, reset: bool) -> torch.Tensor:
    """Where the kernels take x as non-finite: nan; +inf or -inf where no clamp into the declared
    range makes it finite (-inf in a log-decay is a reset (`reset`: resets'), floored by the chunked
    kernels)."""
    pos, neg = bad_ends(i, reset)
    bad = torch.isnan(x)
    if pos:
        bad |= torch.isposinf(x)
    if neg:
        bad |= torch.isneginf(x)
    return bad


def _maybe_bad(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the device: x has a nan or an infinite entry (one pass; min and max keep nan)."""
    if not x.numel():
        return torch.zeros((), dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def bad_entries(mixer_ir, names, tensors) -> list | None:
    """For each input (by name; tensors in the same order), a bool mask of its entries the kernels
    would take as non-finite, or None when there is none at all (the common case: one reduction per
    input and one wait for the device)."""
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats or not bool(torch.stack([_maybe_bad(t) for t in floats]).any()):
        return None
    spec = {i.name: i for i in (*mixer_ir.inputs, *mixer_ir.params)}
    rs = resets(mixer_ir)
    masks = [_bad(spec[n], t, n in rs) if n in spec and t.is_floating_point() else None for n, t in zip(names, tensors)]
    if not any(m is not None and bool(m.any()) for m in masks):  # +-inf a clamp makes finite, resets
        return None
    return masks


def finite_copies(mixer_ir, names, tensors, masks) -> list:
    """The inputs with every bad entry (masks: bad_entries') replaced by a finite value in range."""
    spec = {i.name: i for i in (*mixer_ir.inputs, *mixer_ir.params)}
    return [t if m is None else torch.where(m, torch.full((), fill_value(spec[n]), dtype=t.dtype, device=t.device), t)
            for n, t, m in zip(names, tensors, masks)]


def nan_at(grads, masks) -> list:
    """The inputs' gradients (None where not asked for) with nan at each bad entry."""
    return [g if g is None or m is None else g.masked_fill(m, math.nan) for g, m in zip(grads, masks)]


def device_copies(mixer_ir, names, tensors) -> tuple:
    """(the inputs with every bad entry replaced by a finite value in range, a 0-dim int32 flag per
    input on the device, 1 where it has a nan or an infinite entry (None for one not floating
    point)): one pass over each input that copies and flags it, nothing read back."""
    spec = {i.name: i for i in (*mixer_ir.inputs, *mixer_ir.params)}
    rs = resets(mixer_ir)
    live = [j for j, (n, t) in enumerate(zip(names, tensors)) if n in spec and t.is_floating_point()]
    if not live:
        return list(tensors), [None] * len(tensors)
    buf = torch.zeros(len(live), dtype=torch.int32, device=tensors[live[0]].device)
    out, flags_ = list(tensors), [None] * len(tensors)
    for slot, j in enumerate(live):
        t, i = tensors[j], spec[names[j]]
        fill = fill_value(i)
        pos, neg = bad_ends(i, names[j] in rs)
        flags_[j] = buf[slot]
        if t.dtype == torch.float64 or not t.numel():  # (the kernel computes in fp32)
            out[j] = torch.nan_to_num(t, nan=fill, posinf=fill if pos else math.inf, neginf=fill if neg else -math.inf)
            buf[slot] = _maybe_bad(t).to(torch.int32)
            continue
        x = t.detach().contiguous()
        out[j] = torch.empty_like(x)
        _finite_copy_kernel[_launch_blocks(x.numel())](x, out[j], buf, slot, x.numel(), fill, POS=pos, NEG=neg,
                                                       BLOCK=BLOCK)
    return out, flags_


def device_flags(mixer_ir, names, tensors) -> list:
    """device_copies' flags alone: one read-only pass over each input, no copy (the staged backward
    whose loads make the inputs finite themselves, codegen/finite.py). Up to GROUP inputs, of any
    sizes, share a launch (_flags_kernel: their blocks one after the other on one axis)."""
    spec = {i.name: i for i in (*mixer_ir.inputs, *mixer_ir.params)}
    live = [j for j, (n, t) in enumerate(zip(names, tensors)) if n in spec and t.is_floating_point()]
    if not live:
        return [None] * len(tensors)
    buf = torch.zeros(len(live), dtype=torch.int32, device=tensors[live[0]].device)
    flags_ = [None] * len(tensors)
    todo = []
    for slot, j in enumerate(live):
        t = tensors[j]
        flags_[j] = buf[slot]
        if t.dtype == torch.float64 or not t.numel():
            buf[slot] = _maybe_bad(t).to(torch.int32)
            continue
        todo.append((t.detach().contiguous(), slot))
    for part in _groups(todo):
        xs, slots = zip(*part)
        ns = [x.numel() for x in xs]
        ends = list(itertools.accumulate(_launch_blocks(n)[0] for n in ns))
        _flags_kernel[(ends[-1],)](*_padded(xs, None), *_padded(slots, 0), *_padded(ns, 0), *_padded(ends, ends[-1]),
                                   buf, COUNT=len(part), BLOCK=BLOCK)
    return flags_


GROUP = 8  # tensors per launch of the grouped kernels (_flags_kernel, _fill_bad_group_kernel)


def _groups(items: list) -> list:
    return [items[i:i + GROUP] for i in range(0, len(items), GROUP)]


def _padded(values, pad) -> list:
    return list(values) + [pad] * (GROUP - len(values))


BLOCK = 1024  # elements per program of the kernels below


@triton.jit
def _flag_block(x_ptr, flags_ptr, slot, n, block, BLOCK: tl.constexpr):
    # flags[slot] = 1 where the block-th block of x has a nan or an infinite entry
    # (_finite_copy_kernel's flag, no copy)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if tl.max(((x != x) | (x == float("inf")) | (x == float("-inf"))).to(tl.int32), 0) > 0:
        tl.atomic_max(flags_ptr + slot, 1)


@triton.jit
def _flag_part(x_ptr, flags_ptr, slot, n, p, start, end, BLOCK: tl.constexpr):
    # program p takes block p - start of x where start <= p < end (x's blocks on the grid)
    if (p >= start) & (p < end):
        _flag_block(x_ptr, flags_ptr, slot, n, p - start, BLOCK)


@triton.jit
def _flags_kernel(x0, x1, x2, x3, x4, x5, x6, x7, s0, s1, s2, s3, s4, s5, s6, s7,
                  n0, n1, n2, n3, n4, n5, n6, n7, e0, e1, e2, e3, e4, e5, e6, e7, flags_ptr,
                  COUNT: tl.constexpr, BLOCK: tl.constexpr):
    # _flag_block over COUNT tensors of their own sizes n: the blocks of tensor 0, then of tensor 1,
    # ... along the grid's one axis (tensor j's end at e_j), so that every program has a block to
    # read (a [blocks, COUNT] grid sized by the largest would start empty programs for the others)
    p = tl.program_id(0)
    _flag_part(x0, flags_ptr, s0, n0, p, 0, e0, BLOCK)
    if COUNT > 1:
        _flag_part(x1, flags_ptr, s1, n1, p, e0, e1, BLOCK)
    if COUNT > 2:
        _flag_part(x2, flags_ptr, s2, n2, p, e1, e2, BLOCK)
    if COUNT > 3:
        _flag_part(x3, flags_ptr, s3, n3, p, e2, e3, BLOCK)
    if COUNT > 4:
        _flag_part(x4, flags_ptr, s4, n4, p, e3, e4, BLOCK)
    if COUNT > 5:
        _flag_part(x5, flags_ptr, s5, n5, p, e4, e5, BLOCK)
    if COUNT > 6:
        _flag_part(x6, flags_ptr, s6, n6, p, e5, e6, BLOCK)
    if COUNT > 7:
        _flag_part(x7, flags_ptr, s7, n7, p, e6, e7, BLOCK)


@triton.jit
def _finite_copy_kernel(x_ptr, y_ptr, flags_ptr, slot, n, fill, POS: tl.constexpr, NEG: tl.constexpr,
                        BLOCK: tl.constexpr):
    # y = x with fill at the bad entries (nan; +inf with POS; -inf with NEG); flags[slot] = 1 where
    # x has a nan or an infinite entry at all (the other kernels skip a clean input)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    inf = (x == float("inf")) | (x == float("-inf"))
    bad = x != x
    if POS:
        bad = bad | (x == float("inf"))
    if NEG:
        bad = bad | (x == float("-inf"))
    tl.store(y_ptr + offs, tl.where(bad, fill, x).to(y_ptr.dtype.element_ty), mask=m)
    if tl.max(((x != x) | inf).to(tl.int32), 0) > 0:
        tl.atomic_max(flags_ptr + slot, 1)


@triton.jit
def _fill_bad_part(g_ptr, x_ptr, flag_ptr, n, value, pos, neg, BLOCK: tl.constexpr):
    # in place: g = value where x is bad (nan; +inf where pos; -inf where neg); nothing read or
    # written where the flag says there is no non-finite entry. A bounded grid strides over x
    # (_flag_grid): a clean input, the common case, costs one load of the flag per program. The
    # gradients' nan at a bad input (device_nan_at) and the kept intermediates' zeros
    # (zero_nonfinite_, g_ptr = x_ptr)
    if tl.load(flag_ptr) != 0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            bad = (x != x) | ((x == float("inf")) & (pos != 0)) | ((x == float("-inf")) & (neg != 0))
            tl.store(g_ptr + offs, (tl.zeros([BLOCK], tl.float32) + value).to(g_ptr.dtype.element_ty), mask=m & bad)


@triton.jit
def _fill_bad_group_kernel(g0, g1, g2, g3, g4, g5, g6, g7, x0, x1, x2, x3, x4, x5, x6, x7,
                           f0, f1, f2, f3, f4, f5, f6, f7, n0, n1, n2, n3, n4, n5, n6, n7, ends, value,
                           COUNT: tl.constexpr, BLOCK: tl.constexpr):
    # _fill_bad_part over COUNT tensors: program (i, j) strides over tensor j; ends holds each
    # tensor's POS + 2 NEG in its bits
    j = tl.program_id(1)
    if j == 0:
        _fill_bad_part(g0, x0, f0, n0, value, ends & 1, ends & 2, BLOCK)
    if COUNT > 1:
        if j == 1:
            _fill_bad_part(g1, x1, f1, n1, value, ends & 4, ends & 8, BLOCK)
    if COUNT > 2:
        if j == 2:
            _fill_bad_part(g2, x2, f2, n2, value, ends & 16, ends & 32, BLOCK)
    if COUNT > 3:
        if j == 3:
            _fill_bad_part(g3, x3, f3, n3, value, ends & 64, ends & 128, BLOCK)
    if COUNT > 4:
        if j == 4:
            _fill_bad_part(g4, x4, f4, n4, value, ends & 256, ends & 512, BLOCK)
    if COUNT > 5:
        if j == 5:
            _fill_bad_part(g5, x5, f5, n5, value, ends & 1024, ends & 2048, BLOCK)
    if COUNT > 6:
        if j == 6:
            _fill_bad_part(g6, x6, f6, n6, value, ends & 4096, ends & 8192, BLOCK)
    if COUNT > 7:
        if j == 7:
            _fill_bad_part(g7, x7, f7, n7, value, ends & 16384, ends & 32768, BLOCK)


def _launch_blocks(n: int) -> tuple:
    return (max(1, triton.cdiv(n, BLOCK)),)


FLAG_PROGRAMS = 1024  # the most programs of the flag-gated kernels (about eight per SM of an H100)


def _flag_grid(n: int) -> tuple:
    """The flag-gated kernels' grid: one program per block up to FLAG_PROGRAMS, which then stride.
    With the flag clear each program exits after one load, so the launch costs what its programs
    cost to start (a block per program made tens of thousands at the benchmark's shapes: about
    16 us a launch on an H100 for nothing, 2026-12-06)."""
    return (max(1, min(triton.cdiv(n, BLOCK), FLAG_PROGRAMS)),)


def device_nan_at(mixer_ir, names, tensors, grads, bad_flags) -> list:
    """The gradients (None where not asked for) with nan at each bad entry of their input, on the device
    (in place: they are this backward's own); bad_flags: device_copies' flags."""
    spec = {i.name: i for i in (*mixer_ir.inputs, *mixer_ir.params)}
    rs = resets(mixer_ir)
    out, group = [], []
    for n, t, g, f in zip(names, tensors, grads, bad_flags):
        out.append(g)
        if g is None or n not in spec or f is None:
            continue
        pos, neg = bad_ends(spec[n], n in rs)
        if g.shape != t.shape or not g.is_contiguous() or not g.numel():
            out[-1] = g.masked_fill(_bad(spec[n], t, n in rs), math.nan)
            continue
        group.append((g, t.contiguous(), f, g.numel(), int(pos) + 2 * int(neg)))
    _fill_bad(group, math.nan)
    return out


def _fill_bad(items: list, value) -> None:
    """g = value at x's bad entries, in place, where x's flag is set, for each (g, x, flag, n, ends)
    (ends: 1 where +inf is bad, + 2 where -inf is): one launch per GROUP of them."""
    for part in _groups(items):
        gs, xs, fs, ns, ends = zip(*part)
        _fill_bad_group_kernel[(_flag_grid(max(ns))[0], len(part))](
            *_padded(gs, None), *_padded(xs, None), *_padded(fs, None), *_padded(ns, 0),
            sum(e << (2 * j) for j, e in enumerate(ends)), value, COUNT=len(part), BLOCK=BLOCK)


def any_flag(bad: list):
    """One 0-dim int32 flag, set where any of bad's is (device_copies' or device_flags' flags, None
    for an input without one), or None where no input has a flag."""
    flags = [f for f in bad if f is not None]
    if not flags:
        return None
    base = flags[0]._base  # device_flags' and device_copies' flags: the entries of one buffer
    if base is not None and base.dim() == 1 and len(flags) == base.numel() and all(f._base is base for f in flags):
        return base.amax()  # (one launch: no stack)
    return torch.stack(flags).amax()


def zero_nonfinite_(x, flag):
    """x (a contiguous tensor this backward owns, or None) with its non-finite entries zeroed in place
    where flag (0-dim int32) is set; returned."""
    if x is not None and x.numel():
        _fill_bad([(x, x, flag, x.numel(), 3)], 0.0)  # ends 3: +inf and -inf are bad too
    return x


def finite_kept(x, copies=None):
    """What the forward kept for the backward, its non-finite entries zeroed (None stays None). The
    staged forward's "args" begin with the raw inputs (module.INPUTS order), where an infinity may be
    meant (a reset, a clamp): those are given instead as `copies` (device_copies', in that order)."""
    if isinstance(x, dict) and "args" in x and copies is None:
        return None  # the raw inputs cannot be told from the rest: the backward recomputes it all
    if isinstance(x, dict) and "args" in x:
        args = list(x["args"])
        args[:len(copies)] = [c.contiguous() for c in copies]
        args[len(copies):] = finite_kept(args[len(copies):])
        return dict(finite_kept({k: v for k, v in x.items() if k != "args"}), args=args)
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: finite_kept(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(finite_kept(v) for v in x)
    return x
