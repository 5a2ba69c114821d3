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


def tiered(values, fast) -> list:
    """pytest params: those in `fast` in the default tier, the others under -m slow (pytest -q must
    stay under 5 minutes on 2 cores; the lead's full runs take -m slow too)."""
    return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]


GENERAL = dict(staged=False, staged_backward=False, staged_reason="test: the general kernels", rank2=False)


def sum_mixer(name: str, route: str = "default", **changes) -> Mixer:
    """The sum-order mixer of SPECS[name]. route "general": the general chunked kernels only (no
    staged kernels, no split); another route name: the plan's route (of the split spec where there
    is one) with `changes`, those that are not Route fields replacing plan fields."""
    key = (name, route)
    if key not in _MIXERS:
        m = sum_ir(name)
        if route == "default":
            mixer = Mixer(m)
        elif route == "general":
            mixer = Mixer(dataclasses.replace(m, name=f"{name}_general"))
            mixer._split = False
            mixer._kernels = _module(mixer.ir, GENERAL)
        else:
            mixer = Mixer(dataclasses.replace(m, name=f"{name}_{route}"))
            inner = mixer.split or mixer
            inner._kernels = _module(inner.ir, changes)
        _MIXERS[key] = mixer
    return _MIXERS[key]


def _module(m: ir.Mixer, changes: dict):
    """The module of m rendered from its plan with `changes` (Route fields to its route)."""
    from lrdsl.codegen import generate as generate_module
    from lrdsl.codegen.plan import Route
    from lrdsl.runtime import loader
    real = generate_module.plan
    route_fields = {f.name for f in dataclasses.fields(Route)}

    def changed(mm):
        p = real(mm)
        r = dataclasses.replace(p.route, **{k: v for k, v in changes.items() if k in route_fields})
        return dataclasses.replace(p, route=r, **{k: v for k, v in changes.items() if k not in route_fields})
    generate_module.plan = changed
    try:
        return loader.load(m)
    finally:
        generate_module.plan = real


def reference64(mixer, x, opts):
    h0 = opts["initial_state"]
    leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    o, s = mixer.reference(**leaves, **dict(opts, initial_state=None if h0 is None else h0.double()))
    return o, s, leaves


def against_reference(mixer, x, opts, impls=("chunk", "recurrent"), grad=True, absolute=()):
    """rms ratios of o and S of each path, and of chunk's gradient of every input (loss (o * do).sum()
    + (S * dS).sum(), do and dS random) against the float64 reference; of the inputs in `absolute`,
    rms(error) over the largest rms of q's, k's and v's gradients (theirs may be ~exp(-200))."""
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
            scale = max(ref_leaves[n].grad.pow(2).mean().sqrt().item() for n in ("q", "k", "v"))
            errs.update({"d" + n: (leaves[n].grad.double() - ref_leaves[n].grad).pow(2).mean().sqrt().item() / scale
                         for n in absolute})
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


@pytest.mark.parametrize("name, case_id", tiered([(n, c) for n in SPECS for c in CASES],
                                                  [("rwkv7", "varlen-T37-H2-HV4-h0")]))
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


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in ("rwkv7", "dplr_scalar", "gdn_sum", "kda_sum")
                                                   for s in STRONG], [("rwkv7", "block-inf")]))
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


# the staged routes a sum spec takes (the default of each spec) and their other forms
DENSE = dict(raw_key=None, raw_wy=(), raw_query=None, solve_wy_fused=False, raw_qk_output=False,
             output_dirty_branch=False, chain_in_dk=False, split_dr=False)
STAGED_ROUTES = {
    "rwkv7": ("rwkv7", {}),  # the split: a decay per key channel, the inverse in a launch of its own
    "dplr_scalar": ("dplr_scalar", {}),  # the split: a decay per head, dense WY, staged_de + staged_dk
    "kda_sum": ("kda_sum", {}),
    # raw tiles: the fused solve and WY (the backward's recompute: the raw WY stage), staged_de,
    # staged_dr, staged_dk
    "gdn_sum": ("gdn_sum", {}),
    "gdn_sum-dense": ("gdn_sum", DENSE),  # the dense WY stage, the solve by blocks
    "gdn_sum-one-dk": ("gdn_sum", dict(DENSE, split_dk=False)),  # stage 3 in one launch (decay.masked_da)
    "retnet_sum": ("retnet_sum", {}),  # a constant decay
    "retnet_sum-dense": ("retnet_sum", DENSE),
}


@pytest.mark.parametrize("route", tiered(list(STAGED_ROUTES), []))  # the examples' matrices take rwkv7's and dplr's
def test_staged_routes_match_the_reference(route):
    """Every staged route a sum spec takes, forward and every gradient, over two staged chunks."""
    name, changes = STAGED_ROUTES[route]
    mixer = sum_mixer(name, route, **changes) if changes else sum_mixer(name)
    inner = mixer.split or mixer
    assert hasattr(inner.kernels, "staged_fwd") and (mixer.split is not None) == (name in ("rwkv7", "dplr_scalar"))
    for case in (Case(B=2, T=70, H=1, HV=2, K=16, V=12, initial_state=True, seed=11),
                 Case(B=1, T=70, H=1, HV=2, K=16, V=12, cu_seqlens=(0, 5, 5, 70), initial_state=True, seed=12)):
        out = check_case(mixer, case, DEVICE, grad=True)
        assert out.ok, out.message


STAGED_STRONG = {  # two 64-token chunks: single tokens in both, a whole 16-token block in each
    "one-1e4": ((9, 30, 70), -1e4),
    "one-inf": ((9, 30, 70), -float("inf")),
    "block-inf": ([*range(16, 32), *range(64, 80)], -float("inf")),
}


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in ("rwkv7", "dplr_scalar", "gdn_sum", "kda_sum")
                                                   for s in STAGED_STRONG], [("rwkv7", "one-inf")]))
def test_staged_kernels_take_strong_decays(name, strength):
    """The default (staged) route with a log-decay of -1e4 or -inf on single tokens and on whole
    16-token blocks (a block past exp(-60) takes the exact diagonal path with a decay per key
    channel): chunk forward and gradients, and recurrent, match the float64 reference."""
    mixer = sum_mixer(name)
    x, opts = draw_inputs(mixer, Case(B=1, T=100, H=1, HV=2, K=16, V=8, initial_state=True, seed=9), DEVICE)
    where, value = STAGED_STRONG[strength]
    bad = failing(against_reference(mixer, strong(x, value, where), opts))
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("name, sub", [("rwkv7", 16), ("rwkv7", 64), ("kda_sum", 16), ("kda_sum", 64)])
def test_pair_stage_blocks_of_any_size_take_strong_decays(name, sub, monkeypatch):
    """The per-channel backward's pair stage with blocks of 16 and of 64 tokens (the module's
    STAGED_PAIR_SUB, 32 by default, which the test above takes): each block's reference points and
    its exact diagonal path under -1e4 and -inf on single tokens and on whole 16-token blocks."""
    mixer = sum_mixer(name)
    monkeypatch.setattr((mixer.split or mixer).kernels, "STAGED_PAIR_SUB", sub)
    x, opts = draw_inputs(mixer, Case(B=1, T=100, H=1, HV=2, K=16, V=8, initial_state=True, seed=9), DEVICE)
    for strength, (where, value) in STAGED_STRONG.items():
        bad = failing(against_reference(mixer, strong(x, value, where), opts, impls=("chunk",)))
        assert not bad, (strength, bad)


def _cp_worker(rank, world, jobs, out_dir):
    """test_cp's rank, with lrdsl.compile giving the sum-order mixer of a SPECS name."""
    import test_cp

    import lrdsl
    lrdsl.compile = lambda spec, **kw: sum_mixer(spec)
    test_cp.worker(rank, world, jobs, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rwkv7"])
def test_context_parallel_matches_the_reference(name, monkeypatch):
    """Context parallelism (two gloo ranks, a packed sequence across them) of a sum spec: o, final
    states and every gradient against the single-process chunk and the float64 reference (test_cp's
    check)."""
    import os
    import tempfile

    import test_cp
    import torch.multiprocessing as mp
    split = test_cp.SPLITS["w2-varlen"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_cp_worker, args=(2, [(name, split)], d), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(d, f"0.{r}.pt")) for r in range(2)]
    monkeypatch.setitem(test_cp.SPECS, name, name)
    test_cp.check(name, split, lambda spec, **kw: sum_mixer(spec), ranks=ranks)


def _negated_log_exponents(m: ir.Mixer) -> list:
    """The exponentials in m's per-token expressions (lets inlined) whose exponent decreases with a
    log-decay input: exp(-w) and the like, which overflow for a strong decay."""
    import sympy as sp
    logs = [i.symbol for i in m.inputs if i.log]
    out = []
    for e, _ in m.expressions():
        for node in sp.preorder_traversal(m.inline_lets(e)):
            if isinstance(node, sp.exp) and any(sp.diff(node.args[0], g).is_negative for g in logs):
                out.append(node)
    return out


@pytest.mark.parametrize("name", ["rwkv7", "dplr_scalar", "kda_sum"])
def test_no_kernel_exponentiates_a_negated_log_decay(name):
    """Read from the IR and the generated source of a sum spec and of its split: no per-token
    expression holds exp(-w), and no kernel takes exp or exp2 of a negated quantity (the chunked
    kernels' exponents are differences G_t - G_s, G - g or G_end - G). The same reading flags
    the rewriting into D (I - D^-1 a c^T) that the sum order replaces (c = a*kk*exp(-w))."""
    import re

    from lrdsl.codegen.generate import generate
    from lrdsl.codegen.split import split_ir
    m = sum_ir(name)
    negated = re.compile(r"\bexp2?\(\s*-")
    for mm in filter(None, (m, split_ir(m))):
        assert not _negated_log_exponents(mm), mm.name
        source = re.sub(r"#.*", "", generate(mm))  # comments say exp(-SPAN)
        assert "tl.exp" in source and not negated.search(source), negated.search(source)
    w = m.input("w").symbol
    rewritten = dataclasses.replace(m, delta=ir.Delta(m.delta.a, m.delta.c * ir.sp.exp(-w), "left"))
    assert _negated_log_exponents(rewritten)


@pytest.mark.parametrize("name, route", tiered([(n, r) for n in ("rwkv7", "gdn_sum") for r in ("general", "staged")],
                                               [("rwkv7", "staged")]))
def test_log_decays_past_fp32s_exp_range_without_the_floor(name, route):
    """With the kernels' floor of the log-decay removed (plan.log_decay_floor), every token at
    w = -200: exp(200) overflows fp32, so an exp(-g) of an input anywhere in the forward or the
    backward would give inf or nan. chunk's o, state and gradients match the float64 reference."""
    changes = dict(log_decay_floor=-1e30)
    if route == "general":
        changes.update(GENERAL)
    mixer = sum_mixer(name, f"nofloor_{route}", **changes)
    if route == "general":
        mixer._split = False
    assert hasattr((mixer.split or mixer).kernels, "staged_fwd") == (route == "staged")
    x, opts = draw_inputs(mixer, Case(B=1, T=70, H=1, HV=2, K=16, V=8, initial_state=True, seed=13), DEVICE)
    x["w"] = torch.full_like(x["w"], -200.0)
    errs = against_reference(mixer, x, opts, impls=("chunk",), absolute=("w",))
    bad = failing(errs)
    assert not bad, bad


def test_the_strong_decay_test_catches_a_negated_exponent():
    """test_log_decays_past_fp32s_exp_range_without_the_floor can fail: the rewriting that the sum
    order replaces, (I - kk (a*kk*exp(-w))^T) diag(exp(w)) (the same transition in exact arithmetic),
    gives nan there."""
    m = sum_ir("rwkv7")
    w = m.input("w").symbol
    m = dataclasses.replace(m, name="rwkv7_negated", delta=ir.Delta(m.delta.a, m.delta.c * ir.sp.exp(-w), "left"))
    mixer = Mixer(m)
    mixer._split = False
    mixer._kernels = _module(m, dict(GENERAL, log_decay_floor=-1e30))
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=1, K=16, V=8, initial_state=True, seed=13), DEVICE)
    x["w"] = torch.full_like(x["w"], -200.0)
    with torch.no_grad():
        o, _ = mixer.chunk(**x, **opts)
    assert not torch.isfinite(o).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["rwkv7", "dplr_scalar", "gdn_sum", "kda_sum"])
def test_sum_order_bf16_with_strong_decays_gpu(name):
    """On the GPU (bf16 inputs, fp32 log-decays, K = V = 128): the default route's chunk forward and
    backward and recurrent against the float64 reference, with w at -1e8 and -inf on single tokens
    and -30 on a 4-token run (a 16-token block past exp(-60): the exact diagonal path); test_gpu's
    limits."""
    from test_gpu import GATE_TOL, QKV_TOL, draw
    mixer = sum_mixer(name)
    B, T, H, K, V = 1, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    x["w"] = x["w"].float()
    x["w"][0, 100] = -1e8
    x["w"][0, 555] = float("-inf")
    x["w"][0, 706:710] = -30.0
    do = torch.randn(B, T, H, V, generator=gen, device="cuda")
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = mixer.reference(**ref_leaves, output_final_state=True)
    (ref_o * do.double()).sum().backward()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, output_final_state=True)
    (o.double() * do.double()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s),
            **{"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x}}
    with torch.no_grad():
        o_r, s_r = mixer.recurrent(**x, output_final_state=True)
    errs.update({"recurrent o": rms_ratio(o_r, ref_o), "recurrent S": rms_ratio(s_r, ref_s)})
    bad = {n: e for n, e in errs.items()
           if not e < (5e-3 if n in ("o", "S") or " " in n else QKV_TOL if n in ("dq", "dk", "dv") else GATE_TOL)}
    assert not bad, (name, bad)
