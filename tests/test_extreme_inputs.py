"""Extreme but legal inputs: log-decays of -1e4, -1e8 and -inf (a hard reset) at single tokens.

The chunked kernels cumulate log-decays in fp32 within a chunk; without care one token at -1e8
swamps the differences of the tokens after it (rms error ~1 against the reference) and -inf turns
the rest of the sequence into nan. Forward and backward must match the float64 reference.
"""
import pytest
import torch

from lrdsl.fuzz import TOL, Case, draw_inputs, rms_ratio
from test_recurrent import DEVICE, EXAMPLES

MIXERS = ["gated_deltanet", "mamba2", "gla", "kda", "precond_deltanet"]


@pytest.mark.parametrize("value", [-1e4, -1e8, float("-inf")], ids=["-1e4", "-1e8", "-inf"])
@pytest.mark.parametrize("name", MIXERS)
def test_strong_decay_at_one_token(name, value, compiled):
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    case = Case(B=1, T=100, H=2, HV=2, K=16, V=16, initial_state=True, seed=5)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x["g"][0, 30] = value  # inside the first chunk, and in the second of the 64-token chunks
    x["g"][0, 70] = value
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, **opts)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = mixer.reference(**ref_leaves, **dict(opts, initial_state=opts["initial_state"].double()))
    (ref_o * do.double()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s)}
    errs.update({"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x})
    limit = {"o": TOL, "S": TOL, "dq": TOL, "dk": TOL, "dv": TOL}
    bad = {n: e for n, e in errs.items() if not e < limit.get(n, 10 * TOL)}
    assert not bad, f"{name} g={value}: {bad}"
