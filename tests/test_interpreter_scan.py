"""conftest.py's faster scan for Triton's interpreter (tests/interpreter_scan.py) gives the same bits
as the interpreter's own element-by-element scan: first-order and non-commutative combine
functions, along either axis of a block, a 1-D block, forwards and reversed."""
from __future__ import annotations

import interpreter_scan
import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction as interpreted  # also where kernels compile


@interpreted
def _first_order(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@interpreted
def _left_heavy(a1, b1, a2, b2):
    # neither commutative nor linear: an order or pairing mistake changes the result
    return a1 - 0.5 * a2 + b1 * b2, tl.exp(-tl.abs(b1)) + a2 * b2


@interpreted
def scan_kernel(a_ptr, b_ptr, oa_ptr, ob_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr,
                REVERSE: tl.constexpr, ORDER: tl.constexpr):
    p = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    a, b = tl.load(a_ptr + p), tl.load(b_ptr + p)
    if ORDER:
        a, b = tl.associative_scan((a, b), AXIS, _first_order, reverse=REVERSE)
    else:
        a, b = tl.associative_scan((a, b), AXIS, _left_heavy, reverse=REVERSE)
    tl.store(oa_ptr + p, a)
    tl.store(ob_ptr + p, b)


@interpreted
def scan_1d_kernel(a_ptr, b_ptr, oa_ptr, ob_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    a, b = tl.associative_scan((tl.load(a_ptr + o), tl.load(b_ptr + o)), 0, _first_order)
    tl.store(oa_ptr + o, a)
    tl.store(ob_ptr + o, b)


def run(kernel, shape, **meta):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.rand(shape, generator=gen), torch.randn(shape, generator=gen)
    oa, ob = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    kernel[(1,)](a, b, oa, ob, *shape, **meta)
    return oa, ob


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("order", [True, False], ids=["first order", "left heavy"])
def test_sliced_scan_gives_the_interpreters_bits(axis, reverse, order, monkeypatch):
    from triton.runtime.interpreter import ScanOps
    assert interpreter_scan.install() and ScanOps.generic_scan is interpreter_scan.sliced_generic_scan
    fast = run(scan_kernel, (16, 8), AXIS=axis, REVERSE=reverse, ORDER=order)
    monkeypatch.setattr(ScanOps, "generic_scan", ScanOps.original_generic_scan)
    slow = run(scan_kernel, (16, 8), AXIS=axis, REVERSE=reverse, ORDER=order)
    for f, s in zip(fast, slow):
        assert not f.isnan().any() and torch.equal(f, s)


def test_sliced_scan_of_one_dimension(monkeypatch):
    from triton.runtime.interpreter import ScanOps
    fast = run(scan_1d_kernel, (32,))
    monkeypatch.setattr(ScanOps, "generic_scan", ScanOps.original_generic_scan)
    slow = run(scan_1d_kernel, (32,))
    for f, s in zip(fast, slow):
        assert not f.isnan().any() and torch.equal(f, s)
