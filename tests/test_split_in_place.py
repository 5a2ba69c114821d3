"""The split's in-place route (lrdsl/runtime/split.py, added 2026-12-07): its staged kernels read both
sub-tokens of each token from the spec's own [B, T, ...] tensors (plan.sub_reads), the phase from a
constant [2, H] tensor, store o and read dO at phase 1's rows alone. Checked against the float64
reference forward and backward with no interleaved copy made (split.interleave refuses), at odd
lengths, packed, from an initial state, and with strong and infinite log-decays."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_backward import compare, describe, grad_cases
from test_recurrent import EXAMPLES, PoisonTorch

import lrdsl
from lrdsl.codegen import split as codegen_split
from lrdsl.codegen.plan import plan
from lrdsl.testing import Case

SPLIT = ("rwkv7", "dplr", "iplr", "kda_decay_after_erase")
DECAYED = ("rwkv7", "dplr", "kda_decay_after_erase")  # iplr has no decay
LOG_DECAY = {"rwkv7": "w", "dplr": "gk", "kda_decay_after_erase": "g"}


def _mixer(name):
    return lrdsl.compile(next(p for p in EXAMPLES if p.stem == name))


@pytest.fixture
def no_copies(monkeypatch):
    """chunk may not interleave: the in-place route must serve the call."""
    def refuse(t):
        raise AssertionError("the split interleaved its inputs")
    monkeypatch.setattr(codegen_split, "interleave", refuse)


@pytest.mark.parametrize("name", SPLIT)
def test_every_split_example_reads_in_place(name):
    m = _mixer(name)
    p = plan(m.split.ir)
    assert p.sub_tokens == 2 and p.sub_steps == (m.split.ir.split_phase,)
    assert set(p.sub_reads) == {i.name for i in m.ir.inputs}


CASES = [Case(B=2, T=37, H=2, HV=2, K=16, V=16, initial_state=True, seed=1),
         Case(B=1, T=70, H=2, HV=2, K=16, V=16, cu_seqlens=(0, 19, 20, 70), initial_state=True, seed=2),
         Case(B=2, T=70, H=1, HV=2, K=16, V=16, seed=3),
         Case(B=2, T=1, H=1, HV=1, K=16, V=16, initial_state=True, seed=6)]


def _latin(rows, cols, row_ids, col_ids):
    """(row, col) params, each row with one col in the default run and the rest under `slow` (row i
    with col i mod len(cols)): every row and every col runs by default, all pairs under -m slow (the
    default suite's five minutes)."""
    return [pytest.param(r, c, id=f"{ri}-{ci}", marks=() if i % len(cols) == j else pytest.mark.slow)
            for i, (r, ri) in enumerate(zip(rows, row_ids)) for j, (c, ci) in enumerate(zip(cols, col_ids))]


@pytest.mark.parametrize("name, case", _latin(SPLIT, CASES, SPLIT, ["T37_h0", "packed", "grouped", "T1"]))
def test_in_place_route_matches_the_reference(name, case, no_copies, monkeypatch):
    """Forward and backward; every buffer the split's module allocates starts as NaN (o, the
    gradients stored at their tokens: an element no kernel writes fails the comparison)."""
    mixer = _mixer(name)
    poison = PoisonTorch()
    monkeypatch.setattr(mixer.split.kernels, "torch", poison)
    errors, failures = compare(mixer, case, seed=case.seed)
    assert poison.poisoned >= 2 and not failures, describe(errors)


def _strong(name, value, block):
    def edit(x):
        g = x[LOG_DECAY[name]]
        if block:
            g[:, 16:32] = value  # a whole 16-token block
        else:
            g[:, 5] = value
            g[:, 23, :, :3] = value
    return edit


STRONG = [(-1e4, False), (-float("inf"), True), (-float("inf"), False), (-1e4, True)]


@pytest.mark.parametrize("name, strong", _latin(DECAYED, STRONG, DECAYED, ["-1e4-tokens", "-inf-block", "-inf-tokens", "-1e4-block"]))
def test_strong_decays_in_place(name, strong, no_copies):
    value, block = strong
    case = Case(B=2, T=37, H=2, HV=2, K=16, V=16, initial_state=True, seed=5)
    errors, failures = compare(_mixer(name), case, seed=5, edit=_strong(name, value, block))
    assert not failures, describe(errors)


def test_no_gradient_asked_for_runs_in_place(no_copies):
    m = _mixer("rwkv7")
    torch.manual_seed(0)
    B, T, H, K = 2, 37, 2, 16
    x = {i.name: torch.randn(B, T, H, K) for i in m.ir.inputs}
    x["w"] = torch.nn.functional.logsigmoid(x["w"])
    x["a"] = torch.rand(B, T, H, K)
    o, S = m.chunk(**x, output_final_state=True)
    o2, S2 = m.reference(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert o.shape == (B, T, H, K) and o.is_contiguous()
    err = ((o.double() - o2).pow(2).mean().sqrt() / o2.pow(2).mean().sqrt()).item()
    assert err < 1e-5 and ((S.double() - S2).norm() / S2.norm()).item() < 1e-5


def test_keep_intermediates_takes_the_interleaved_route(monkeypatch):
    """keep_intermediates (and torch.compile's custom op) keep the interleaved copies: counted."""
    m = lrdsl.compile(next(p for p in EXAMPLES if p.stem == "rwkv7"), keep_intermediates=True)
    calls = []
    real = codegen_split.interleave
    monkeypatch.setattr(codegen_split, "interleave", lambda t: calls.append(1) or real(t))
    case = Case(B=2, T=37, H=2, HV=2, K=16, V=16, initial_state=True, seed=4)
    errors, failures = compare(m, case, seed=4)
    assert calls and not failures, describe(errors)


@st.composite
def split_specs(draw):
    """Spec texts that run split: a decay after the erase, an erase direction of its own, or the
    additive D - a c^T with a != u; a decay per token, per key channel or none (where the form
    still splits)."""
    form = draw(st.sampled_from(("after", "other", "sum")))
    # a decay per token commutes with the erase: after it, only a decay per key channel splits
    decay = draw(st.sampled_from(("scalar", "diagonal", "none") if form == "other" else ("diagonal", "none")))
    if form == "after":
        decay = "diagonal"
    d_input = {"scalar": "g log", "diagonal": "g[K] log", "none": ""}[decay]
    d_text = {"scalar": "exp(g) ", "diagonal": "diag(exp(g)) ", "none": ""}[decay]
    norm = draw(st.sampled_from(("", " l2norm")))
    lines = ["mixer drawn", f"input q[K], k[K]{norm}, v[V]"]
    if form == "after":
        lines += [f"input {d_input}, beta in (0, 1)", f"S = {d_text}(I - beta k k^T) S + beta k v^T"]
    elif form == "other":
        lines += [f"input {d_input + ', ' if d_input else ''}a[K] l2norm, beta in (0, 1)",
                  f"S = (I - beta a k^T) {d_text}S + k v^T"]
    else:
        lines += [f"input {d_input + ', ' if d_input else ''}a[K] l2norm, b[K] in [0, 1]",
                  f"S = ({d_text or 'I '}- (b*a) a^T) S + k v^T"]
    return "\n".join(lines + ["o = S^T q", "allow unstable"]) + "\n"


@pytest.mark.slow
@settings(max_examples=12, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(text=split_specs(), drawn=grad_cases())
def test_random_split_specs_in_place_match_the_reference(text, drawn):
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    assert mixer.split is not None, text
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codegen_split, "interleave", lambda t: pytest.fail("the split interleaved its inputs"))
        errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1)
    assert not failures, f"{text}{case}: {describe(errors)}"


@pytest.mark.parametrize("name, once", [
    ("rwkv7", {"q": 1, "k": 1, "v": 1, "w": 0, "kk": 0, "a": 0}),
    ("dplr", {"q": 1, "k": 1, "v": 1, "gk": 0, "a": 0, "b": 0, "beta": 0}),
    ("iplr", {"q": 1, "k": 1, "v": 1, "kk": 0, "a": 0}),
    ("kda_decay_after_erase", {"q": 1, "v": 1, "g": 1})])  # k and beta: both phases
def test_gradients_of_one_phase_are_stored_at_their_tokens(name, once):
    """codegen/split.py's grad_phases (sympy, the phase substituted): the inputs whose gradient is
    zero in one phase; the chain kernel stores theirs at their token from the other phase's rows."""
    assert dict(plan(_mixer(name).split.ir).sub_once) == once


@pytest.mark.parametrize("name", ["rwkv7", "dplr", "iplr", "kda_decay_after_erase"])
def test_the_chain_rule_sums_no_unread_value_gradient(name):
    """The split's host chain rule adds each token's two sub-token rows of dz only where an input's
    gradient is dz itself (Chain.v_given): here none is (the write's value carries the phase), so
    no [B, 2T, HV, V] sum is made that nothing reads (0.149 ms of rwkv7's forward + backward at
    B=4 T=4096 H=16 on an H100, 2026-12-07)."""
    from lrdsl.codegen.chain import chain
    from lrdsl.codegen.generate import generate
    ir = _mixer(name).split.ir
    assert chain(ir).v_given == ()
    source = generate(ir)
    assert "dz.view(B, T, per" not in source
    assert "g.view(B, T, per, *g.shape[2:]).sum(2)" in source  # the inputs' own sums stay
