"""The additive DPLR transition, order "sum": S_t = (D_t - a_t c_t^T) S_{t-1} + u_t z_t^T (RWKV-7,
FLA's chunk_dplr_delta_rule), on every path against the float64 reference, forward and backward.

The erase reads the state before this token's decay and its direction is written after it, so in
the chunk's decayed frame c carries the exclusive cumulated log-decay G - g and a the inclusive G:
no kernel divides by the decay, and strong decays (-1e4, -inf on one token or a whole block) give
the reference's answer. Until the frontend emits order "sum", the mixers are made at the IR level
from a left-order spec with the same a, c and D.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_recurrent import DEVICE

from lrdsl.api import Mixer
from lrdsl.frontend import ir, spec_to_ir
from lrdsl.testing import TOL, Case, check_case, draw_inputs, rms_ratio

# name -> the left-order spec whose (a, c, D) the sum-order mixer takes
SPECS = {
    # RWKV-7: D per key channel, erase direction kk, read a*kk, write key k (a != u: the split)
    "rwkv7": ("input q[K], k[K], v[V], w[K] log, kk[K] l2norm, a[K] in [0, 1]",
              "(I - kk (a*kk)^T) diag(exp(w))", "k v^T"),
    # one decay per head and token, a != u
    "dplr_scalar": ("input q[K], k[K], v[V], w log, kk[K] l2norm, a[K] in [0, 1]",
                    "(I - kk (a*kk)^T) exp(w)", "k v^T"),
    # a = u: exp(g) - beta k k^T, the erase along the write key (the staged kernels' own form)
    "gdn_sum": ("input q[K] l2norm, k[K] l2norm, v[V], w log, beta in (0, 1)",
                "(I - beta k k^T) exp(w)", "beta k v^T"),
    "kda_sum": ("input q[K] l2norm, k[K] l2norm, v[V], w[K] log, beta in (0, 1)",
                "(I - beta k k^T) diag(exp(w))", "beta k v^T"),
    # a constant decay per head
    "retnet_sum": ("input q[K] l2norm, k[K] l2norm, v[V], beta in (0, 1)",
                   "(I - beta k k^T) (1 - 2^(-5 - h))", "beta k v^T"),
}


def sum_ir(name: str) -> ir.Mixer:
    inputs, transition, write = SPECS[name]
    m = spec_to_ir(f"mixer {name}\n{inputs}\nS = {transition} S + {write}\no = S^T q\nallow unstable\n")
    assert m.delta.order == "left"
    return dataclasses.replace(m, delta=ir.Delta(m.delta.a, m.delta.c, "sum"))


_MIXERS: dict = {}


def sum_mixer(name: str, route: str = "default") -> Mixer:
    """The sum-order mixer of SPECS[name]; route "general": the general chunked kernels only (no
    staged kernels, no split)."""
    key = (name, route)
    if key not in _MIXERS:
        m = sum_ir(name)
        if route == "general":
            m = dataclasses.replace(m, name=name + "_general")
        mixer = Mixer(m)
        if route == "general":
            mixer._split = False
            mixer._kernels = _general_module(m)
        _MIXERS[key] = mixer
    return _MIXERS[key]


def _general_module(m: ir.Mixer):
    """The module of m rendered from a plan whose route takes no staged kernel."""
    from lrdsl.codegen import generate as generate_module
    from lrdsl.runtime import loader
    real = generate_module.plan

    def general(mm):
        p = real(mm)
        return dataclasses.replace(p, route=dataclasses.replace(
            p.route, staged=False, staged_backward=False, staged_reason="test: the general kernels", rank2=False))
    generate_module.plan = general
    try:
        return loader.load(m)
    finally:
        generate_module.plan = real


def reference64(mixer, x, opts):
    h0 = opts["initial_state"]
    leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    o, s = mixer.reference(**leaves, **dict(opts, initial_state=None if h0 is None else h0.double()))
    return o, s, leaves


def against_reference(mixer, x, opts, impls=("chunk", "recurrent"), grad=True):
    """rms ratios of o and S of each path, and of chunk's gradient of every input (loss (o * do).sum()
    + (S * dS).sum(), do and dS random) against the float64 reference."""
    ref_o, ref_s, ref_leaves = reference64(mixer, x, opts)
    do, dS = torch.randn_like(ref_o), torch.randn_like(ref_s)
    errs = {}
    for impl in impls:
        leaves = {n: t.clone().requires_grad_(grad and impl == "chunk") for n, t in x.items()}
        o, s = getattr(mixer, impl)(**leaves, **opts)
        errs[f"{impl} o"], errs[f"{impl} S"] = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
        if grad and impl == "chunk":
            ((o * do.float()).sum() + (s * dS.float()).sum()).backward()
            ((ref_o * do).sum() + (ref_s * dS).sum()).backward()
            errs.update({"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x})
    return errs


def failing(errs: dict) -> dict:
    """The ratios over their tolerance: TOL for o, S and q, k, v's gradients, 10 TOL for the others."""
    strict = ("dq", "dk", "dv")
    return {n: e for n, e in errs.items() if not e < (TOL if " " in n or n in strict else 10 * TOL)}


def test_reference_is_the_additive_transition():
    """The reference's sum order against a loop over dense matrices: S = (diag(exp(w)) - kk (a*kk)^T) S + k v^T."""
    mixer = sum_mixer("rwkv7")
    case = Case(B=1, T=9, H=1, HV=1, K=5, V=3, initial_state=True, seed=1)
    x, opts = draw_inputs(mixer, case, "cpu")
    x = {n: t.double() for n, t in x.items()}
    S = opts["initial_state"].double()[0, 0]
    o, s = mixer.reference(**x, **dict(opts, initial_state=S[None, None]))
    kk = torch.nn.functional.normalize(x["kk"][0, :, 0], dim=-1, eps=0)  # the mixer's l2norm (eps 1e-6 in rsqrt)
    for t in range(case.T):
        M = torch.diag(x["w"][0, t, 0].exp()) - torch.outer(kk[t], x["a"][0, t, 0] * kk[t])
        S = M @ S + torch.outer(x["k"][0, t, 0], x["v"][0, t, 0])
        q = x["q"][0, t, 0] * case.K ** -0.5
        assert torch.allclose(o[0, t, 0], S.T @ q, rtol=1e-5, atol=1e-6)
    assert torch.allclose(s[0, 0], S, rtol=1e-5, atol=1e-6)


CASES = {
    "B2-T37-HV2-h0": Case(B=2, T=37, H=1, HV=2, K=16, V=12, initial_state=True, scale=0.7, seed=1),
    "varlen-T37-H2-HV4-h0": Case(B=1, T=37, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 5, 5, 37), initial_state=True,
                                 seed=2),
}


@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("name", list(SPECS))
def test_general_kernels_match_the_reference(name, case_id):
    """recurrent and the general chunked kernels, forward and every gradient (check_case: packed
    sequences, grouped value heads, an initial state)."""
    out = check_case(sum_mixer(name, "general"), CASES[case_id], DEVICE, grad=True)
    assert out.ok, out.message


def strong(x, value, where):
    """x with the log-decay w at `value` on the tokens `where` (every key channel)."""
    w = x["w"].clone()
    w[:, where] = value
    return dict(x, w=w)


STRONG = {  # where, value: one token at -1e4 and at -inf in two chunks, a whole 16-token block at -inf
    "one-1e4": ((9, 30), -1e4),
    "one-inf": ((9, 30), -float("inf")),
    "block-inf": (slice(16, 32), -float("inf")),
}


@pytest.mark.parametrize("strength", list(STRONG))
@pytest.mark.parametrize("name", ["rwkv7", "dplr_scalar", "gdn_sum", "kda_sum"])
def test_general_kernels_take_strong_decays(name, strength):
    """A log-decay of -1e4 or -inf (floored in the kernels, exact in the reference) on single tokens
    and on a whole 16-token block: recurrent and chunk forward, and chunk's gradients, match the
    float64 reference (an exp(-g) anywhere would give inf and nan)."""
    mixer = sum_mixer(name, "general")
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=2, K=16, V=8, initial_state=True, seed=7), DEVICE)
    where, value = STRONG[strength]
    bad = failing(against_reference(mixer, strong(x, value, where), opts))
    assert not bad, bad


def test_step_matches_the_reference():
    """The decode step, token by token from a state, against the reference."""
    mixer = sum_mixer("rwkv7")
    x, opts = draw_inputs(mixer, Case(B=2, T=5, H=1, HV=2, K=16, V=8, initial_state=True, seed=3), DEVICE)
    x = strong(x, -float("inf"), (2,))
    state = opts["initial_state"].clone().contiguous()
    with torch.no_grad():
        outs = [mixer.step(**{n: t[:, i:i + 1] for n, t in x.items()}, state=state) for i in range(5)]
    ref_o, ref_s, _ = reference64(mixer, x, opts)
    assert rms_ratio(torch.cat(outs, 1), ref_o) < TOL and rms_ratio(state, ref_s) < TOL
