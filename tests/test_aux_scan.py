"""The auxiliary states' scan in Triton (lrdsl/scan.py), which the chain rule of specs with
auxiliary states runs on CUDA tensors: against the token loop in float64, forward and gradients,
with one decay per head and one per channel, sequence starts (a = 0) and T not a multiple of the
kernels' chunk; then (slow) every auxiliary example's gradients against the float64 reference
with the Triton scan in the PyTorch chain rule, also through whole initial and final states; and
the generated chain rule of key-channel auxiliary states (autograd.aux_chain_rule): which specs
get it, and (slow) the same comparisons with the PyTorch chain rule made to fail if called, and
that it makes no token-sized tensor on the host."""
import pytest
import test_backward
import test_state
import torch

import lrdsl.runtime.autograd as ag
from lrdsl.runtime.scan import first_order_scan_triton
from lrdsl.testing import rms_ratio


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
    monkeypatch.setattr(ag, "GENERATED_AUX_CHAIN", False)
    mixer = compiled(test_backward.ROOT / "examples" / f"{stem}.lr")
    errors, failures = test_backward.compare(mixer, test_backward.CASES[case_id], True, 101)
    assert not failures, errors


@pytest.mark.slow
@pytest.mark.parametrize("name, start", [("precond_deltanet", "whole"), ("precond_deltanet", "S"), ("gdn2_atk", "whole"),
                                         ("precond_kda", "kept"), ("precond_kda", "general"), ("stored_lets", "whole")])
def test_whole_state_gradients_with_the_triton_scan(name, start, compiled, monkeypatch):
    monkeypatch.setattr(ag, "TRITON_SCAN", True)
    monkeypatch.setattr(ag, "GENERATED_AUX_CHAIN", False)
    test_state.test_gradients_through_the_whole_state(name, start, compiled, monkeypatch)


def test_key_channel_aux_states_get_the_generated_chain_rule():
    """The aux examples' states are operands of the generated chain rule (their write and decay two
    more vectors); a value-channel state keeps the PyTorch chain rule."""
    from lrdsl.codegen.chain import chain
    from lrdsl.frontend import spec_to_ir
    for stem in ("precond_deltanet", "precond_kda", "gdn2_atk"):
        m = spec_to_ir((test_backward.ROOT / "examples" / f"{stem}.lr").read_text())
        ch = chain(m)
        (name, terms), = ch.aux
        assert ch.extra == ("aw_" + name,) and [v for v, _ in terms] == ["u"], stem
        # beta_atk reaches the vectors through the write only, g_atk through the decay only
        writes = {n: [v for v, _ in g.k_terms] for n, g in zip([i.name for i in m.inputs], ch.grads)}
        assert writes["beta_atk"] == ["aw_" + name] and writes["g_atk"] == ["ad_" + name], writes
    assert chain(spec_to_ir(test_state.STORED_LETS)) is None  # P2 is a value-channel state


def _no_pytorch_chain_rule(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch chain rule ran")
    monkeypatch.setattr(ag, "vector_chain_rule", refuse)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(test_backward.CASES))
@pytest.mark.parametrize("stem", ["precond_deltanet", "precond_kda", "gdn2_atk"])
def test_generated_aux_chain_rule_matches_reference(stem, case_id, compiled, monkeypatch):
    _no_pytorch_chain_rule(monkeypatch)
    mixer = compiled(test_backward.ROOT / "examples" / f"{stem}.lr")
    errors, failures = test_backward.compare(mixer, test_backward.CASES[case_id], True, 101)
    assert not failures, errors


@pytest.mark.slow
# (not "general", the general kernels: their backward is not the staged one, so the PyTorch chain rule runs)
@pytest.mark.parametrize("name, start", [("precond_deltanet", "whole"), ("precond_kda", "whole"), ("gdn2_atk", "whole"),
                                         ("gdn2_atk", "S"), ("precond_kda", "kept")])
def test_whole_state_gradients_with_the_generated_aux_chain_rule(name, start, compiled, monkeypatch):
    _no_pytorch_chain_rule(monkeypatch)
    test_state.test_gradients_through_the_whole_state(name, start, compiled, monkeypatch)


@pytest.mark.slow
def test_generated_aux_chain_rule_makes_no_token_sized_tensor_on_the_host(compiled, monkeypatch):
    """aux_chain_rule leaves every [B, T, HV, K] pass to the kernels (the states from the staged
    backward's scan, the write and the decay's gradient in the chain kernel): no aten op outside
    a kernel launch makes a tensor of B*T*HV*K elements (allocations for the kernels aside), while
    the gradients still match the reference."""
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    from lrdsl.testing import Case
    case = Case(B=2, T=40, H=2, HV=2, K=16, V=16, initial_state=True, seed=5)
    full = case.B * case.T * case.HV * case.K
    made, inside, on, calls = [], [0], [False], []
    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):  # the interpreter's own copies are a kernel's, not the host's
        inside[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if on[0] and not inside[0] and "empty" not in str(func):
                ins = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
                made.extend(str(func) for t in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(t, torch.Tensor) and t.numel() >= full
                            and t.untyped_storage().data_ptr() not in ins)
            return out

    original = ag.aux_chain_rule

    def logged(*args, **kwargs):
        calls.append(1)
        on[0] = True
        try:
            with Log():
                return original(*args, **kwargs)
        finally:
            on[0] = False

    monkeypatch.setattr(interp.InterpretedFunction, "run", counted)
    monkeypatch.setattr(ag, "aux_chain_rule", logged)
    _no_pytorch_chain_rule(monkeypatch)
    mixer = compiled(test_backward.ROOT / "examples" / "precond_kda.lr")
    errors, failures = test_backward.compare(mixer, case, True, 3)
    assert not failures, errors
    assert calls and not made, made
