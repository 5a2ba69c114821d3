"""The auxiliary states' scan in Triton (lrdsl/scan.py), which the chain rule of specs with
auxiliary states runs on CUDA tensors: against the token loop in float64, forward and gradients,
with one decay per head and one per channel, sequence starts (a = 0) and T not a multiple of the
kernels' chunk; then (slow) every auxiliary example's gradients against the float64 reference
with the Triton scan in the chain rule, also through whole initial and final states."""
import pytest
import torch

import lrdsl.autograd as ag
from lrdsl.fuzz import rms_ratio
from lrdsl.scan import first_order_scan_triton
import test_backward
import test_state


def _loop(a, b):
    p, rows = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        p = a[:, t] * p + b[:, t]
        rows.append(p)
    return torch.stack(rows, 1)


@pytest.mark.parametrize("per_head", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["per-head", "per-channel"])
def test_triton_scan_and_its_gradients_match_a_token_loop(per_head):
    gen = torch.Generator().manual_seed(7 + per_head)
    B, T, HV, D = 1, 77, 2, 40  # two chunks of 64, the second partial; two channel blocks of 32, the second partial
    a = torch.rand(B, T, HV, 1 if per_head else D, generator=gen, dtype=torch.float64)
    a[:, [0, 30, 64, 65]] = 0.0  # sequence starts, one on a chunk's first token
    b = torch.randn(B, T, HV, D, generator=gen, dtype=torch.float64)
    dp = torch.randn(B, T, HV, D, generator=gen, dtype=torch.float64)
    a64, b64 = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = _loop(a64, b64)
    ref_da, ref_db = torch.autograd.grad(ref, (a64, b64), dp)
    # through torch.func.vjp, as vector_chain_rule calls it
    dev = test_backward.DEVICE
    p, pullback = torch.func.vjp(first_order_scan_triton, a.float().to(dev), b.float().to(dev))
    da, db = pullback(dp.float().to(dev))
    assert p.dtype == torch.float32 and da.shape == a.shape and db.shape == b.shape
    errors = [rms_ratio(p, ref), rms_ratio(da, ref_da), rms_ratio(db, ref_db)]
    assert max(errors) < 1e-6, errors


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(test_backward.CASES))
@pytest.mark.parametrize("stem", ["precond_deltanet", "precond_kda", "gdn2_atk"])
def test_chain_rule_with_the_triton_scan_matches_reference(stem, case_id, compiled, monkeypatch):
    monkeypatch.setattr(ag, "TRITON_SCAN", True)
    mixer = compiled(test_backward.ROOT / "examples" / f"{stem}.lr")
    errors, failures = test_backward.compare(mixer, test_backward.CASES[case_id], True, 101)
    assert not failures, errors


@pytest.mark.slow
@pytest.mark.parametrize("name, start", [("precond_deltanet", "whole"), ("precond_deltanet", "S"), ("gdn2_atk", "whole"),
                                         ("precond_kda", "kept"), ("stored_lets", "whole")])
def test_whole_state_gradients_with_the_triton_scan(name, start, compiled, monkeypatch):
    monkeypatch.setattr(ag, "TRITON_SCAN", True)
    test_state.test_gradients_through_the_whole_state(name, start, compiled, monkeypatch)
