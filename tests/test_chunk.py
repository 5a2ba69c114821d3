"""The chunked forward kernels against the float64 reference: every example on odd shapes with the
outputs poisoned (NaN) before the launch, edge shapes and strong decays, the decode step, and a
Hypothesis test over random axis-form specs.

Tolerance: rms(kernel - reference) / rms(reference) < 1e-4 for o and the final state (fp32 inputs).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from specgen import axis_specs, default_first, example_params
from test_recurrent import CASES, DEVICE, EXAMPLES, PoisonTorch, chunk_modules, small_cases, state_parts

import lrdsl
from lrdsl.testing import TOL, Case, check_case, draw_inputs, rms_ratio


def reference(mixer, x, opts):
    h0 = opts["initial_state"]
    return mixer.reference(**{n: t.double() for n, t in x.items()},
                           **dict(opts, initial_state=None if h0 is None else h0.double()))


# pytest -q: every other example (test_backward's per-example case compares every example's o and
# final state, with gradients, by default); every example under -m slow
HALF = [pytest.param(*p.values, id=p.id, marks=p.marks or (pytest.mark.slow if i % 2 else ()))
        for i, p in enumerate(example_params(EXAMPLES))]


@pytest.mark.parametrize("case_id", default_first(list(CASES), "varlen-T37-H2-HV4-K20-V12-h0"))
@pytest.mark.parametrize("spec", HALF)
def test_example_chunk_matches_reference(spec, case_id, compiled, monkeypatch):
    mixer = compiled(spec)
    poison = PoisonTorch()
    for module in chunk_modules(mixer):  # o, the state and every buffer start as NaN
        monkeypatch.setattr(module, "torch", poison)
    x, opts = draw_inputs(mixer, CASES[case_id], DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert poison.poisoned >= 2
    ref_o, ref_s = reference(mixer, x, opts)
    assert not o.isnan().any() and not any(t.isnan().any() for t in state_parts(s).values())
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{spec.stem} {case_id}: rms ratio o {e_o:.3g}, state {e_s:.3g}"


EDGE = {
    "T1": Case(B=2, T=1, H=1, HV=1, K=16, V=16, initial_state=True, seed=3),
    "T63-K24-V40": Case(B=1, T=63, H=1, HV=1, K=24, V=40, seed=4),
    "T65-HV3": Case(B=1, T=65, H=1, HV=3, K=16, V=16, initial_state=True, seed=5),
}


@pytest.mark.parametrize("name", ["deltanet", "gla", "precond_kda", "kda_decay_after_erase"])
@pytest.mark.parametrize("edge", list(EDGE))
def test_edge_shapes(name, edge, compiled):
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    x, opts = draw_inputs(mixer, EDGE[edge], DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.parametrize("name", ["gla", "kda", "gdn2", "mamba2", "gated_deltanet"])
def test_strong_decay_does_not_overflow(name, compiled):
    """g down to -20 per token: cumulated exponents reach -1300 in a chunk; rebased, they stay <= 0."""
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    x, opts = draw_inputs(mixer, Case(B=1, T=70, H=1, HV=1, K=16, V=16, initial_state=True, seed=6), DEVICE)
    gen = torch.Generator().manual_seed(7)
    x["g"] = (-20.0 * torch.rand(x["g"].shape, generator=gen)).to(x["g"].device)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.parametrize("decay", ["exp(g) S", "0.9 S", "S"], ids=["per-token", "constant", "none"])
def test_raw_operands_with_per_token_factors(decay):
    """The raw-operand path (plan.raw) with a per-token factor on the write and on the query: the
    state pass scales k^T's columns (a decay per token) or the value tile's rows (a constant decay
    or none), the output stage the products' rows and columns."""
    from lrdsl.codegen.plan import plan
    mixer = lrdsl.compile(text="mixer raw_factors\ninput q[K] shared, k[K] shared, v[V], b in (0, 1), g log\n"
                               f"S = {decay} + k (b * v)^T\no = S^T (2 * q)\n")
    p = plan(mixer.ir)
    assert [r.factor for r in p.raw] == ["b_b", "1.0", "2.0"]
    assert p.decay_kind == {"exp(g) S": "scalar", "0.9 S": "constant", "S": "identity"}[decay]
    # K = 72: the output stage's key loop takes two steps of 64 channels, the second mostly masked
    case = Case(B=1, T=150, H=2, HV=4, K=72, V=12, cu_seqlens=(0, 70, 150), initial_state=True, scale=0.7, seed=11)
    x, opts = draw_inputs(mixer, case, DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


def test_fp16_inputs(compiled):
    check_fp16(compiled(next(p for p in EXAMPLES if p.stem == "gated_deltanet")),
               Case(B=1, T=40, H=2, HV=2, K=16, V=16, seed=8))


def check_fp16(mixer, case):
    """fp16 inputs: fp32 intermediates (as the staged kernels keep them) and state, o in fp16."""
    x, opts = draw_inputs(mixer, case, DEVICE)
    x16 = {n: t.half() for n, t in x.items()}
    with torch.no_grad():
        o, s = mixer.chunk(**x16, **opts)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    ref_o, ref_s = reference(mixer, {n: t.float() for n, t in x16.items()}, opts)
    assert rms_ratio(o, ref_o) < 2e-3 and rms_ratio(s, ref_s) < 1e-4


def test_bf16_inputs_on_the_cpu(compiled):
    # Triton's interpreter gets tl.dot on bf16 operands wrong (triton#11584): chunk runs the CPU's
    # kernels on fp32 copies, so bf16 callers get bf16 results and gradients, not garbage
    mixer = compiled(next(p for p in EXAMPLES if p.stem == "gated_deltanet"))
    x, opts = draw_inputs(mixer, Case(B=1, T=70, H=2, HV=2, K=32, V=16, seed=9), "cpu")
    xb = {n: t.bfloat16().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**xb, **opts)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    xf = {n: t.detach().float().requires_grad_() for n, t in xb.items()}
    ref_o, ref_s = reference(mixer, {n: t.detach() for n, t in xf.items()}, opts)
    assert rms_ratio(o, ref_o) < 1e-2 and rms_ratio(s, ref_s) < 1e-4
    do = torch.randn_like(ref_o)
    o.float().backward(do)
    mixer.chunk(**xf, **opts)[0].backward(do)
    for n, t in xb.items():
        assert t.grad.dtype == torch.bfloat16, n
        assert rms_ratio(t.grad, xf[n].grad) < 1e-2, n


@pytest.mark.parametrize("name", ["gated_deltanet", "precond_deltanet"])
def test_decode_step_updates_the_state_in_place(name, compiled):
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    case = Case(B=2, T=6, H=1, HV=2, K=16, V=20, initial_state=True, seed=9)
    x, opts = draw_inputs(mixer, case, DEVICE)
    ref_o, ref_s = reference(mixer, x, opts)
    state = opts["initial_state"].clone()
    if mixer.ir.aux:  # the whole state: auxiliary states from zero, as reference starts them
        state = lrdsl.MixerState(state, mixer.zero_state(case.N, case.HV, case.K, case.V).aux)
    ptr = state_parts(state)["S"].data_ptr()
    with torch.no_grad():
        outs = [mixer.step(**{n: t[:, i:i + 1] for n, t in x.items()}, state=state, scale=opts["scale"])
                for i in range(case.T)]
    assert state_parts(state)["S"].data_ptr() == ptr
    assert rms_ratio(torch.cat(outs, 1), ref_o) < TOL and rms_ratio(state, ref_s) < TOL


def test_decode_step_refuses_a_non_fp32_state(compiled):
    mixer = compiled(next(p for p in EXAMPLES if p.stem == "deltanet"))
    x, opts = draw_inputs(mixer, Case(B=1, T=2, H=1, HV=1, K=16, V=16, seed=10), DEVICE)
    with pytest.raises(lrdsl.InputError, match="float32"):
        mixer.step(**x, state=torch.zeros(1, 1, 16, 16, dtype=torch.float64))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(text=axis_specs(), case=small_cases())
def test_random_axis_spec_chunk_matches_reference(text, case):
    mixer = lrdsl.compile(text=text)
    out = check_case(mixer, case, DEVICE, impls=("chunk",))
    assert out.ok, f"{out.message}\nspec:\n{text}case: {case}"


NOVEL = Path(__file__).resolve().parent / "specs" / "novel_test_only.lr"


@pytest.mark.parametrize("case_id", default_first(list(CASES), "varlen-T37-H2-HV4-K20-V12-h0"))
def test_novel_spec_written_for_the_tests(case_id, compiled):
    """A transition that no library ships and that is not in examples/: forward, recurrent and
    gradients against the float64 reference."""
    mixer = compiled(NOVEL)
    out = check_case(mixer, CASES[case_id], DEVICE, impls=("chunk", "recurrent"), grad=True)
    assert out.ok, out.message


# strong=True has both kinds of blocks (one takes the exact path, the others tensor cores): pytest -q;
# strong=False (tensor cores only) under -m slow
@pytest.mark.parametrize("strong", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tensor-core blocks", "exact blocks"])
@pytest.mark.parametrize("name", ["kda", "gla", "precond_kda"])
def test_staged_forward_for_per_channel_decays(name, strong, compiled):
    """The staged forward with a decay per key channel builds each 16-token diagonal block on
    tensor cores through the block's start, unless the block decays past exp(-SPAN) in some
    channel (exp(SPAN) would overflow): then column by column. strong=True puts four tokens of
    log-decay -30 (floored at -20 each) into one channel of one block, so that block takes the
    exact path while the others do not."""
    from lrdsl.codegen.plan import Plan, plan
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    assert plan(mixer.ir).staged
    case = Case(B=1, T=150, H=2, HV=2, K=32, V=24, cu_seqlens=(0, 37, 150), initial_state=True, seed=31)
    x, opts = draw_inputs(mixer, case, DEVICE)
    if strong:
        assert 4 * -Plan.log_decay_floor > Plan.diagonal_block_span
        x["g"][0, 70:74, 1, 5] = -30.0  # rows 70..73: one 16-token block (69..84) of the second sequence
    r = mixer.kernels.staged_fwd({n: t.contiguous() for n, t in x.items()}, case.K ** -0.5,
                                 opts["initial_state"], True, opts["cu_seqlens"])
    o, s = r.o, r.final_state
    ref_o, ref_s = reference(mixer, x, dict(opts, scale=case.K ** -0.5))
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, state_parts(ref_s)["S"])  # the kernels' S
    assert e_o < TOL and e_s < TOL, f"{name}: rms ratio o {e_o:.3g}, state {e_s:.3g}"



@pytest.mark.slow
@pytest.mark.parametrize("name,early", [("kda", True), ("kda", False), ("gated_deltanet", None)],
                         ids=["kda-early", "kda-in-loop", "gated_deltanet-raw"])
def test_wy_stage_value_tiles_past_the_first(name, early, compiled, monkeypatch):
    """The WY stage's value tiles after the first (V > BV): kda's first one loaded beside the key
    side's tiles (EARLY) or in the loop with the others; gated_deltanet's WY stage on raw tiles
    (plan.raw_wy), which has no EARLY, and whose forward makes U in staged_solve_wy (plan.solve_wy_fused).
    The interpreter runs each tuning space's first config, whose tile covers the other tests' values;
    this one takes 16-wide tiles."""
    import triton

    from lrdsl.codegen.plan import plan
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    assert bool(plan(mixer.ir).raw_wy) == (early is None) == plan(mixer.ir).solve_wy_fused
    monkeypatch.setattr(mixer.kernels, "torch", PoisonTorch())  # U's tiles start as NaN
    tuners = [mixer.kernels.staged_wy] + ([mixer.kernels.staged_solve_wy] if early is None else [])
    kept = [(t.configs, dict(t.cache)) for t in tuners]
    tile = {"BV": 16} if early is None else {"BV": 16, "EARLY": early}
    for tuner in tuners:
        tuner.configs = [triton.Config(tile, num_warps=4, num_stages=1)]
        tuner.cache.clear()
    try:
        case = Case(B=1, T=70, H=1, HV=2, K=16, V=40, cu_seqlens=(0, 23, 70), initial_state=True, seed=7)
        x, opts = draw_inputs(mixer, case, DEVICE)
        with torch.no_grad():
            o, s = mixer.chunk(**x, **opts)
    finally:
        for tuner, (configs, cache) in zip(tuners, kept):
            tuner.configs = configs
            tuner.cache.clear()
            tuner.cache.update(cache)
    ref_o, ref_s = reference(mixer, x, opts)
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{name} early={early}: rms ratio o {e_o:.3g}, state {e_s:.3g}"


def test_packed_sequences_changed_in_place(compiled):
    """The chunk pairs of packed sequences are kept for the next call with the same cu_seqlens
    tensor (the backward's); changing that tensor in place between calls gives the new split."""
    mixer = compiled(next(p for p in EXAMPLES if p.stem == "gated_deltanet"))
    case = Case(B=1, T=150, H=1, HV=1, K=16, V=16, cu_seqlens=(0, 30, 150), seed=9)
    x, opts = draw_inputs(mixer, case, DEVICE)
    cu = opts["cu_seqlens"].to(torch.int64)
    for cut in (30, 100):
        cu[1] = cut
        with torch.no_grad():
            o, _ = mixer.chunk(**x, **dict(opts, cu_seqlens=cu))
        ref_o, _ = reference(mixer, x, dict(opts, cu_seqlens=cu.clone()))
        assert rms_ratio(o, ref_o) < TOL, f"cut at {cut}: rms ratio {rms_ratio(o, ref_o):.3g}"

NAMES_LIKE_THE_KERNELS = """
mixer names_like_the_kernels
input q[K] l2norm, k[K] l2norm, v[V], gl log, u in (0, 1), c[K] in [0, 1], r[K] in [0, 1]
S = (I - (u*k) (r*k)^T) exp(gl) S + (u*k) v^T
o = S^T (c*q)
"""


def test_spec_names_like_the_kernels_own_variables():
    """Inputs named as the generated helpers' results (u, c, r, gl) must not be overwritten by them."""
    mixer = lrdsl.compile(text=NAMES_LIKE_THE_KERNELS)
    x, opts = draw_inputs(mixer, Case(B=1, T=70, H=1, HV=2, K=16, V=16, initial_state=True, seed=12), DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.parametrize("name", ["linear_attention", "retnet", "mamba2", "gla"])
def test_state_pass_split_over_key_channels(name, compiled):
    """Without an erase the state pass may split the state's rows over programs (plan.state_split_k):
    three slices of 16 key channels, the last one partial, give the reference's outputs and state."""
    import triton

    from lrdsl.codegen.plan import plan
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    assert plan(mixer.ir).state_split_k
    tuner = mixer.kernels.staged_state
    saved = tuner.configs
    tuner.configs = [triton.Config({"BV": 16, "BKS": 16}, num_warps=4, num_stages=1)]
    tuner.cache.clear()
    try:
        x, opts = draw_inputs(mixer, Case(B=1, T=150, H=2, HV=2, K=40, V=24, initial_state=True,
                                          cu_seqlens=(0, 70, 150), seed=8), DEVICE)
        with torch.no_grad():
            o, s = mixer.chunk(**x, **opts)
    finally:
        tuner.configs = saved
        tuner.cache.clear()
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


def test_no_split_of_key_channels_where_they_mix():
    """An erase (delta rule) or an L2 norm of a key-side input ties the state's rows together."""
    from lrdsl.codegen.plan import plan
    for name in ("gated_deltanet", "deltanet"):
        assert not plan(lrdsl.compile(next(p for p in EXAMPLES if p.stem == name)).ir).state_split_k
    normed = lrdsl.compile(text="mixer normed_la\ninput q[K], k[K] l2norm, v[V]\nS = S + k v^T\no = S^T q\n")
    assert not plan(normed.ir).state_split_k


@triton.jit
def _inverse_tile_kernel(a_ptr, x_ptr, inverse, BT: tl.constexpr, BS: tl.constexpr):
    o_t = tl.arange(0, BT)
    b_A = tl.load(a_ptr + o_t[:, None] * BT + o_t[None, :])
    tl.store(x_ptr + o_t[:, None] * BT + o_t[None, :], inverse(b_A, BT, BS))


@pytest.mark.parametrize("coupling", [0.3, 0.9])
def test_unit_lower_inverse_tile_of_a_whole_chunk(coupling, compiled):
    """staged_solve_wy's (I + A)^-1 of a strictly lower 64 x 64 tile (plan.solve_wy_fused) against
    float64's, with keys close enough (coupling: their shared part) that the products across three
    diagonal blocks (block 3 from block 0) count; zero above the diagonal blocks."""
    mixer = compiled(next(p for p in EXAMPLES if p.stem == "gated_deltanet"))
    BT, BS = 64, 16
    g = torch.Generator().manual_seed(5)
    k = coupling * torch.randn(1, 16, generator=g) + (1 - coupling) * torch.randn(BT, 16, generator=g)
    k = k / k.norm(dim=1, keepdim=True)
    beta = torch.rand(BT, generator=g)
    a = torch.tril(beta[:, None] * (k @ k.T), -1)
    x = torch.full((BT, BT), float("nan"))
    _inverse_tile_kernel[(1,)](a, x, mixer.kernels._unit_lower_inverse_tile, BT=BT, BS=BS)
    ref = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + a.double())
    blocks = torch.arange(BT)[:, None] // BS - torch.arange(BT)[None, :] // BS
    d = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + torch.where(blocks == 0, a, 0).double())
    m = d @ torch.where(blocks > 0, a, 0).double()
    tol = 1e-4 * ref.abs().max()
    assert (m @ m @ m @ d).abs().max() > 10 * tol  # the last term of the merge, block 3 from block 0, counts
    assert (x - ref).abs().max() < tol
    assert (x.triu(1)[torch.arange(BT)[:, None] // BS < torch.arange(BT)[None, :] // BS] == 0).all()


@pytest.mark.parametrize("name", ["gated_deltanet", "channel_gates_scalar_decay"])
def test_output_factors_stored_by_the_wy_stage(name, compiled):
    """plan.output_factors: the WY stage (staged_solve_wy, or staged_wy for channel_gates_scalar_decay)
    stores per token the write key's number beta / ||k|| (the norm with the reference's epsilon,
    over key heads shared by grouped value heads), which the output stage takes instead of a norm of
    its own; float64 from the same inputs, packed sequences, a nan in one token's key that reaches
    that token's number alone."""
    from lrdsl.codegen.plan import plan
    from lrdsl.runtime.reference import L2NORM_EPS
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    assert plan(mixer.ir).output_factors == ("key",)
    case = Case(B=1, T=100, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 37, 100), seed=13)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x["k"][0, 50, 1, 3] = float("nan")
    st = mixer.kernels._staged_states({n: t.contiguous() for n, t in x.items()}, case.K ** -0.5, None, False, opts["cu_seqlens"])
    fo = st["fo"].double()
    inv = lambda t: torch.rsqrt((t.double() ** 2).sum(-1) + L2NORM_EPS).repeat_interleave(case.HV // case.H, dim=2)
    key = inv(x["k"]) * (x["beta"].double() if "beta" in x else 1.0)
    assert fo.isnan().sum() == 2 and fo[0, 50, 2:].isnan().all()  # token 50, key head 1
    ok = ~key.isnan()
    assert torch.allclose(fo[ok], key[ok], rtol=1e-5)


@pytest.mark.parametrize("name", ["gated_deltanet", "deltanet"])
def test_output_stage_key_loop_of_two_steps(name, compiled):
    """plan.raw_qk_output's key loop (plan.raw_output_bk channels a step) over K = 128: two steps,
    whose products (and, where the loop makes it, ||q||^2) add up; the other tests' K is one step."""
    from lrdsl.codegen.plan import plan
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    assert plan(mixer.ir).raw_qk_output and 128 // plan(mixer.ir).raw_output_bk == 2
    case = Case(B=1, T=70, H=1, HV=2, K=128, V=16, cu_seqlens=(0, 23, 70), initial_state=True, seed=17)
    x, opts = draw_inputs(mixer, case, DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    ref_o, ref_s = reference(mixer, x, opts)
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{name}: rms ratio o {e_o:.3g}, state {e_s:.3g}"
