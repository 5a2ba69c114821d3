"""The staged kernels reading the state before the token themselves (plan.readout_before, issue 39):
S_prev^T y, with RWKV-6's bonus (y^T b) z on the chunk's score matrix's diagonal, in one chunk pass
(codegen/readouts.py's fused). That the route is taken, where it is not, and that it agrees with
the float64 reference on every path, forward and backward: packed sequences (empty ones too), an
initial state, HV = 2 H, strong decays at single tokens and over whole 16-token blocks (the exact
paths of the solve and of stage 4)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from test_nonfinite import check_causal, check_earlier_dq, semantics, spoil  # noqa: F401 (semantics: a fixture)

import lrdsl
from lrdsl.codegen import schedule
from lrdsl.codegen.plan import plan
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HEAD = "mixer m\ninput q[K], k[K], v[V], w[K] log\nS = diag(exp(w)) S + k v^T\n"
ALONE = HEAD + "o = S_prev^T q\n"  # no bonus: P strictly causal, nothing on its diagonal
PLAIN_BONUS = HEAD + "o = S_prev^T q + (q^T k) v\n"  # a bonus without a param


@pytest.fixture(scope="module")
def rwkv6(compiled):
    return compiled(EXAMPLES / "rwkv6.lr")


def test_rwkv6_takes_the_fused_route(rwkv6):
    p = plan(rwkv6.ir)
    assert p.readout_before and p.staged and p.staged_backward
    assert re.fullmatch(r"\(?(b_k \* b_u|b_u \* b_k)\)?", p.bonus_key), p.bonus_key
    names = schedule.kernel_templates(p)
    assert "staged_solve_blocks_before.py.jinja" in names and "staged_bwd_pair_before.py.jinja" in names
    assert "staged_solve_blocks.py.jinja" not in names and "staged_bwd_pair.py.jinja" not in names
    assert [l.template for l in schedule.backward(p) if l.role == "pair"] == ["staged_bwd_pair_before.py.jinja"]


@pytest.mark.parametrize("text, bonus", [(ALONE, False), (PLAIN_BONUS, True)], ids=["alone", "plain bonus"])
def test_the_route_takes_s_prev_alone_and_any_bonus_key(text, bonus):
    p = plan(lrdsl.compile(text=text).ir)
    assert p.readout_before and bool(p.bonus_key) == bonus


@pytest.mark.parametrize("readout", [
    "S^T q + S_prev^T q",  # S^T x beside it
    "S_prev^T q + (q^T (u*k)) (2*v)",  # the bonus's value is not the written one
    "S_prev^T q + (k^T (u*k)) v",  # the bonus's key side is not the query's
    "S_prev^T q + (q^T k) v + (q^T (u*k)) v",  # two bonuses
])
def test_other_readouts_keep_the_parts(readout):
    m = lrdsl.compile(text=HEAD.replace("\nS =", "\nparam u[K]\nS =") + f"o = {readout}\n")
    assert not plan(m.ir).readout_before and not m._fused


def test_other_transitions_keep_the_parts(compiled):
    rwkv7 = compiled(EXAMPLES / "rwkv7.lr", check_stability=False)
    assert not plan(rwkv7.ir).readout_before
    scalar = lrdsl.compile(text=HEAD.replace("w[K] log", "w log").replace("diag(exp(w))", "exp(w)")
                           + "o = S_prev^T q\n")
    assert not scalar._fused


def test_chunk_runs_no_second_chunk_call(monkeypatch):
    m = lrdsl.compile(EXAMPLES / "rwkv6.lr")

    def refuse(*a, **kw):
        raise AssertionError("chunk went around the kernels (Mixer._with_before)")

    monkeypatch.setattr(type(m), "_with_before", refuse)
    x, opts = draw_inputs(m, Case(B=1, T=20, H=1, HV=1, K=16, V=16, seed=1))
    m.chunk(**x, **opts)


def test_no_kernel_takes_exp_of_a_negated_log_decay(rwkv6):
    """Every exponent of the module is a sum or a difference of cumulated log-decays (Gx, the decay
    before the token, as _cumsum_before's exclusive sums or the row before's G; G_end - G), never
    -gl alone: exp(-gl) overflows for the strong decays the reference takes."""
    src = open(rwkv6.kernels.__file__).read()
    code = "\n".join(line.split("#")[0] for line in src.splitlines())
    args = []
    for m in re.finditer(r"tl\.exp\(", code):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        args.append(re.sub(r"\s", "", code[m.end():i - 1]))
    assert args and any("_cumsum_before" in a for a in args)  # the shifted exponents are there
    assert not [a for a in args if a.startswith("-") or "(-" in a], args
    assert not re.search(r"/\s*tl\.exp\(", code)


def _against_reference(mixer, x, opts, tol=TOL):
    """o, the final state and every gradient (loss o . do + S . dS) of chunk against float64."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"]
    h0 = None if h0 is None else h0.clone().requires_grad_()
    o, S = mixer.chunk(**leaves, **dict(opts, initial_state=h0))
    gen = torch.Generator().manual_seed(11)
    do, dS = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    ((o * do).sum() + (S * dS).sum()).backward()
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    r0 = None if h0 is None else h0.detach().double().requires_grad_()
    ro, rS = mixer.reference(**ref, **dict(opts, initial_state=r0))
    ((ro * do.double()).sum() + (rS * dS.double()).sum()).backward()
    errs = {"o": rms_ratio(o, ro), "S": rms_ratio(S, rS)}
    errs.update({"d" + n: rms_ratio(leaves[n].grad, ref[n].grad) for n in x})
    if h0 is not None:
        errs["dh0"] = rms_ratio(h0.grad, r0.grad)
    bad = {n: e for n, e in errs.items() if not e < (tol if n in ("o", "S", "dq", "dk", "dv", "dh0") else 10 * tol)}
    assert not bad, bad


# "packed" (the richest) in pytest -q, the others under -m slow
CASES = {
    "plain": Case(B=2, T=40, H=1, HV=1, K=16, V=16, seed=1),
    # empty sequences first and in the middle; 2 value heads per key head; an initial state
    "packed": Case(B=1, T=90, H=1, HV=2, K=32, V=16, cu_seqlens=(0, 0, 7, 7, 70, 90), initial_state=True, seed=2),
    "wide": Case(B=1, T=70, H=2, HV=4, K=16, V=32, initial_state=True, seed=3),
}


@pytest.mark.parametrize("name", [n if n == "packed" else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_rwkv6_against_the_reference(rwkv6, name):
    x, opts = draw_inputs(rwkv6, CASES[name])
    _against_reference(rwkv6, x, opts)


@pytest.mark.parametrize("text", [ALONE, pytest.param(PLAIN_BONUS, marks=pytest.mark.slow)], ids=["alone", "plain bonus"])
def test_other_fused_readouts_against_the_reference(text):
    m = lrdsl.compile(text=text)
    x, opts = draw_inputs(m, CASES["packed"])
    _against_reference(m, x, opts)


@pytest.mark.parametrize("value", [pytest.param(-1e4, marks=pytest.mark.slow), float("-inf")], ids=["-1e4", "-inf"])
def test_strong_decay_at_single_tokens(rwkv6, value):
    x, opts = draw_inputs(rwkv6, Case(B=1, T=100, H=1, HV=2, K=16, V=16, initial_state=True, seed=5))
    x["w"][0, 30] = value  # mid-chunk, a 16-token block's first token, and a chunk's first
    x["w"][0, 48] = value
    x["w"][0, 64] = value
    _against_reference(rwkv6, x, opts)


def test_strong_decay_over_16_token_blocks(rwkv6):
    """Blocks that decay past exp(-SPAN) in some channels take the exact paths (the solve's second
    launch, stage 4's column-by-column diagonal); packed, so that a sequence starts inside one."""
    case = Case(B=1, T=100, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 21, 100), initial_state=True, seed=6)
    x, opts = draw_inputs(rwkv6, case)
    x["w"][0, 16:48, :, :8] = -5.0  # -80 over each of two blocks, half of the channels
    x["w"][0, 70:78, :, 3] = -9.0
    _against_reference(rwkv6, x, opts)


@pytest.mark.slow
def test_the_pytorch_chain_rule_reads_the_fused_vectors(monkeypatch):
    """Where no generated chain rule runs (module.HAS_CHAIN_RULE off), PyTorch's takes the vector
    gradients to the inputs through the same vectors: r from y, c the bonus's key."""
    m = lrdsl.compile(EXAMPLES / "rwkv6.lr")
    monkeypatch.setattr(m.kernels, "HAS_CHAIN_RULE", False)
    x, opts = draw_inputs(m, CASES["packed"])
    _against_reference(m, x, opts)


# nan in the decay (every channel of the token, or one), or in a key: the readout before the token
# reads the state before it, so a bad decay spoils the tokens after it only (Gx at its own row is
# finite: _cumsum_before), a bad key its own token too (the bonus). Inside a chunk and at a chunk's
# first token; the interpreter's min / max as a GPU's ("gpu") and as numpy's. -m slow: all but one
NONFINITE = [pytest.param(bad, where, sem, marks=() if (bad, where, sem) == ("w-nan", 37, "gpu") else pytest.mark.slow,
                          id=f"{bad}-t{where}-{sem}")
             for bad in ("w-nan", "w-nan-channel", "k-nan") for where in (37, 64) for sem in ("gpu", "numpy")]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bad,where,semantics", NONFINITE, indirect=["semantics"])
def test_nonfinite_input_reaches_no_earlier_token(bad, where, semantics, compiled, monkeypatch):
    mixer = compiled(EXAMPLES / "rwkv6.lr", check_ranges=False)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=9)
    x, opts = draw_inputs(mixer, case)
    row = 20 + where
    x = spoil(x, bad[0], math.nan, not bad.endswith("channel"), row)
    check_causal(mixer, x, opts, row + 1 if bad.startswith("w") else row, monkeypatch, bad)


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)  # the GPU's minnum on a CPU
@pytest.mark.parametrize("bad", ["w", "k"])
def test_nonfinite_input_leaves_earlier_dq(bad, semantics, compiled):
    """A nan key at token t leaves dq of the tokens before it as the reference has them, a nan decay
    those up to t (o_t reads the state before the decay); the backward runs on finite copies of the
    inputs (runtime/nonfinite.py), so this guards that hand-over for the fused route."""
    mixer = compiled(EXAMPLES / "rwkv6.lr", check_ranges=False)
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, seed=4)
    x, opts = draw_inputs(mixer, case)
    check_earlier_dq(mixer, spoil(x, bad, math.nan, True, 37), opts, case, 38 if bad == "w" else 37, f"rwkv6 {bad}")
