"""The split (lrdsl/codegen/split.py): a transition whose erase is not along the write key, run as one whose
erase is, on two tokens per token. Its reference on the interleaved tokens is the original's (float64,
resets and nan included); chunk through it matches the original's reference forward and backward;
the general kernels still serve where the split does not (keys wider than the staged kernels')."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backward import compare
from test_recurrent import DEVICE, EXAMPLES

import lrdsl
from lrdsl.codegen.split import interleave, phases, split_ir
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

SPECS = Path(__file__).resolve().parent / "specs"  # erase_other.lr, right_scalar.lr: a != u
OTHER_DIRECTION = (SPECS / "erase_other.lr").read_text()


def _mixer(name):
    if name in ("erase_other", "right_scalar"):
        return lrdsl.compile(SPECS / f"{name}.lr")
    return lrdsl.compile(next(p for p in EXAMPLES if p.stem == name))


def test_only_specs_without_staged_kernels_split():
    split = {p.stem for p in EXAMPLES if split_ir(lrdsl.compile(p, load_kernels=False).ir) is not None}
    # a decay after the erase, or an erase whose direction is not the write key (RWKV-7's kk against k)
    assert split == {"kda_decay_after_erase", "rwkv7", "dplr", "iplr"}
    m = lrdsl.compile(text=OTHER_DIRECTION, load_kernels=False).ir
    s = split_ir(m)
    assert s is not None and s.delta.order == "left" and s.delta.a == s.write.key
    assert [i.name for i in s.inputs] == [*(i.name for i in m.inputs), "phase"]


def test_the_phase_input_takes_a_free_name():
    text = OTHER_DIRECTION.replace("beta in (0, 1)", "beta in (0, 1), phase in (0, 1)").replace(
        "+ k v^T", "+ k (phase*v)^T")
    s = split_ir(lrdsl.compile(text=text, load_kernels=False).ir)
    assert s.inputs[-1].name == "phase_1" and "phase" in [i.name for i in s.inputs[:-1]]


@pytest.mark.parametrize("name", ["kda_decay_after_erase", "erase_other", "right_scalar"])
@pytest.mark.parametrize("spoil", [None, -float("inf"), float("nan")])
def test_split_reference_is_the_original(name, spoil):
    """float64: the split's states after each second token are the original's (a reset, -inf in
    the log-decay, stays a reset; nan stays nan from its token on)."""
    mixer = _mixer(name)
    case = Case(B=2, T=41, H=2, HV=2, K=8, V=6, initial_state=True, seed=3)
    x, opts = draw_inputs(mixer, case, "cpu")
    x = {n: t.double() for n, t in x.items()}
    if spoil is not None:
        x["g"][0, 17] = spoil
    h0 = opts["initial_state"].double()
    o, s = mixer.reference(**x, initial_state=h0, output_final_state=True)
    twice = {n: interleave(t) for n, t in x.items()}
    p = phases(case.B, case.T, case.H, x["q"])
    o2, s2 = mixer.split.reference(**twice, phase=p, initial_state=h0, output_final_state=True)
    assert torch.equal(o.isnan(), o2[:, 1::2].isnan()) and torch.equal(s.isnan(), s2.isnan())
    fin = ~o.isnan()
    assert (o2[:, 1::2][fin] - o[fin]).abs().max() < 1e-12
    if spoil is None or spoil < 0:
        assert (s2 - s).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["erase_other", pytest.param("right_scalar", marks=pytest.mark.slow)])
def test_split_chunk_gradients_match_the_reference(name):
    mixer = _mixer(name)
    assert mixer.split is not None and hasattr(mixer.split.kernels, "staged_fwd")
    errors, failures = compare(mixer, Case(B=1, T=70, H=1, HV=2, K=16, V=8, initial_state=True, seed=4))
    assert not failures, errors


def test_the_general_kernels_still_serve_the_original():
    """K above the staged kernels' limit: the original module's general kernels."""
    mixer = _mixer("kda_decay_after_erase")
    assert not hasattr(mixer.kernels, "staged_fwd")
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=8, initial_state=True, seed=5), DEVICE)
    with torch.no_grad():
        split_o, _ = mixer.chunk(**x, **opts)
        mixer._split = False  # what a call with K > STAGED_MAX_K takes
        o, s = mixer.chunk(**x, **opts)
    h0 = opts["initial_state"]
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()},
                                   **dict(opts, initial_state=h0.double()))
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL and rms_ratio(split_o, ref_o) < TOL


def test_keep_intermediates_keeps_the_splits_staged_intermediates(monkeypatch):
    """keep_intermediates=True: the split mixer inherits it, so chunk runs the split's staged kernels
    (not the original's general kernels on half the tokens), and their backward reads what their
    forward kept: one pass of stages 1 to 3 (_staged_states) in all. Gradients as the reference's."""
    mixer = lrdsl.compile(next(p for p in EXAMPLES if p.stem == "kda_decay_after_erase"), keep_intermediates=True)
    assert mixer.split is not None and mixer.split.keep_intermediates
    monkeypatch.setattr(mixer.kernels, "chunk_fwd", lambda *a, **k: pytest.fail("the original's kernels ran"))
    calls, states = [], mixer.split.kernels._staged_states
    monkeypatch.setattr(mixer.split.kernels, "_staged_states", lambda *a, **k: calls.append(1) or states(*a, **k))
    errors, failures = compare(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=8, cu_seqlens=(0, 13, 40),
                                           initial_state=True, seed=6))
    assert not failures, errors
    assert len(calls) == 1, f"{len(calls)} passes of stages 1 to 3 for one forward and backward"


def test_bench_twin_of_the_decay_after_erase_is_the_same_transition():
    """`lrdsl bench` times kda_decay_after_erase beside FLA's generalized delta rule (chunk_dplr_delta_rule)
    on arguments made from the spec's inputs; FLA's naive recurrence of that rule (a test-only oracle),
    fed those arguments, is the spec's float64 reference to fp32's precision (plain and with q, k normalised beforehand)."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    from lrdsl.bench import PRENORMALISED, TWINS
    name, args = TWINS["kda_decay_after_erase"]
    assert name == "generalized_delta_rule.chunk_dplr_delta_rule"
    mixer = _mixer("kda_decay_after_erase")
    case = Case(B=2, T=37, H=3, HV=3, K=8, V=6, initial_state=True, seed=8)
    x, opts = draw_inputs(mixer, case, "cpu")
    x = {n: t.double() for n, t in x.items()}
    h0 = opts["initial_state"].double()
    ref_o, ref_s = mixer.reference(**x, scale=case.K ** -0.5, initial_state=h0, output_final_state=True)
    unit = {n: torch.nn.functional.normalize(x[n], dim=-1) for n in ("q", "k")}
    for given, prenormalised in ((x, False), (dict(x, **unit), True)):
        kw = args(dict(given, **{PRENORMALISED: prenormalised}))
        # the naive recurrence computes in fp32 whatever it is given
        heads_first = [kw[n].transpose(1, 2).float() for n in ("q", "k", "v", "a", "b", "gk")]
        o, s = dplr_recurrence(*heads_first, initial_state=h0.float(), output_final_state=True)
        assert rms_ratio(o.transpose(1, 2), ref_o) < 1e-5 and rms_ratio(s, ref_s) < 1e-5
