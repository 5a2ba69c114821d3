"""A value-side transition's chunked forward on the key side's staged kernels (issue 40; math in
lrdsl/codegen/value_key.py): stages 1 to 3 of the transposed mixer, then the readout kernel
(templates/chunk_value_out.py.jinja), against the float64 reference. The token loop forward
(templates/chunk_value.py.jinja) and the value side's backward kernel (chunk_value_bwd.py.jinja)
are made to raise, so a pass is the staged forward's and the backward through the transposed
sub-mixer read with do as its query (runtime/value_key.py's grads)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dplr import against_reference, failing, tiered
from test_oja import spec_text
from test_recurrent import DEVICE, PoisonTorch
from torch.utils._python_dispatch import TorchDispatchMode

import lrdsl
from lrdsl import cli
from lrdsl.codegen import value_key
from lrdsl.runtime import value_key as runtime_vk
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _no_token_loop(*args, **kwargs):
    raise AssertionError("the token loop forward or the value side's backward kernel ran")


@pytest.fixture
def staged(monkeypatch):
    """A value-side mixer whose token loop forward and backward kernel raise, and whose staged
    forward's modules allocate every buffer poisoned with nan (an element never written shows)."""
    def get(text=None, path=None, **options):
        m = lrdsl.compile(path, text=text, check_stability=False, **options)
        monkeypatch.setattr(m.kernels, "value_chunk_fwd", _no_token_loop)
        monkeypatch.setattr(m.kernels, "value_chunk_bwd", _no_token_loop)
        poison = PoisonTorch()
        for module in runtime_vk.modules(m.value_transposed):
            monkeypatch.setattr(module, "torch", poison)
        return m
    return get


def test_oja_takes_the_staged_forward():
    """examples/oja.lr: codegen/value_key.py takes it, lrdsl show says so, the mixer has the route;
    the erase before a per-channel decay and the additive form keep the token loop."""
    m = lrdsl.compile(EXAMPLES / "oja.lr")
    assert value_key.eligible(m.ir) is None and m.value_route is not None
    assert "templates/chunk_value_out.py.jinja" in cli.kernels_text(m.ir)  # lrdsl show (test_show.py too)
    for name in ("erase_first", "additive"):
        other = lrdsl.compile(text=spec_text(name), check_stability=False, load_kernels=False)
        assert value_key.eligible(other.ir) is not None and other.value_route is None
        assert "not the key side's staged kernels" in " ".join(cli.kernels_text(other.ir).split())
    scalar = lrdsl.compile(text=spec_text("scalar_decay"), check_stability=False, load_kernels=False)
    assert value_key.eligible(scalar.ir) is None
    # oja's direct form (the sub-mixer KDA on the raw inputs); a decay per head keeps the vectors
    assert value_key.direct(m.ir) == value_key.Direct("q", "v", "k", "beta", "gv")
    assert m.value_route.forward.func is runtime_vk.direct_forward
    assert "KDA on the raw inputs" in " ".join(cli.kernels_text(m.ir).split())
    assert value_key.direct(scalar.ir) is None and scalar.value_route.forward.func is runtime_vk.forward
    assert "per-token vectors" in " ".join(cli.kernels_text(scalar.ir).split())
    for text in (spec_text("oja").replace("beta k v^T", "beta (k + q) v^T"),  # a write key of two inputs
                 spec_text("oja").replace("v[V] l2norm", "v[V]")):  # c not normalised
        assert value_key.direct(lrdsl.compile(text=text, check_stability=False, load_kernels=False).ir) is None


CASES = {  # two 64-token chunks and a partial third, packed with an empty sequence, HV = 2 H, h0
    "packed-HV2": Case(B=1, T=70, H=1, HV=2, K=16, V=32, cu_seqlens=(0, 3, 3, 70), initial_state=True, seed=4),
    "B2-h0": Case(B=2, T=66, H=2, HV=2, K=32, V=16, initial_state=True, scale=0.7, seed=5),
}


@pytest.mark.parametrize("case_id", tiered(list(CASES), ["packed-HV2"]))
def test_oja_forward_and_gradients(staged, case_id):
    """o and the final state against the float64 reference, and chunk's gradients of every input and
    of the initial state (through the transposed sub-mixer). The drawn log-decays are
    scaled by 1/100: the state carried from block to block and from chunk to chunk still counts."""
    m = staged(path=EXAMPLES / "oja.lr")
    x, opts = draw_inputs(m, CASES[case_id], DEVICE)
    x["gv"] = x["gv"] / 100
    bad = failing(against_reference(m, x, opts, impls=("chunk",)))
    assert not bad, bad


class FullSize(TorchDispatchMode):
    """Records the PyTorch ops (neither kernels nor allocations nor views) that make an fp32 tensor
    of `numel` elements: the per-token vectors' size."""
    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        skip = ("empty", "fill_", "set_", "view", "expand", "detach", "lrdsl.")  # fill_: the poison
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() in self.numel
                    and not any(w in name for w in skip)):
                self.ops.append(name)
        return out


def test_direct_form_clamps_and_makes_no_vectors(staged, monkeypatch):
    """oja's direct form: beta out of its declared range (clamped by the sub-mixer's kernels as the
    reference clamps it) in a packed batch with an empty sequence, o, S and every gradient against
    the reference; and no per-token vectors: sub_inputs never runs, and the ops of that size PyTorch
    makes are the readout's three (b l2norm(v), the floored g, the scaled query) and the backward's two
    (do's query gradient q scale and q's o' scale), where the vector path makes dozens."""
    monkeypatch.setattr(runtime_vk, "sub_inputs", _no_token_loop)
    m = staged(path=EXAMPLES / "oja.lr", check_ranges=False)
    case = Case(B=1, T=40, H=2, HV=2, K=16, V=16, cu_seqlens=(0, 0, 23, 40), initial_state=True, seed=11)
    x, opts = draw_inputs(m, case, DEVICE)
    x["gv"] = x["gv"] / 100
    x["beta"][:, 3] = 1.7
    x["beta"][:, 30] = -0.4
    bad = failing(against_reference(m, x, opts, impls=("chunk",)))
    assert not bad, bad
    count = FullSize({case.B * case.T * case.HV * w for w in (case.K, case.V)})
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    do, dS = torch.randn(1, 40, 2, 16, device=DEVICE), torch.randn(3, 2, 16, 16, device=DEVICE)
    with count:
        o, s = m.chunk(**leaves, **opts)
        torch.autograd.backward([o, s], [do, dS])
    assert len(count.ops) <= 5, count.ops


LOG_DECAY = {"oja": "w", "scalar_decay": "s"}
STRONG = {  # one token at -1e4 and at -inf in two chunks, a whole 16-token block at -inf, a whole chunk
    "one-1e4": ((9, 66), -1e4),
    "one-inf": ((9, 66), -float("inf")),
    "block-inf": (slice(16, 32), -float("inf")),
    "chunk-inf": (slice(0, 64), -float("inf")),
}


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in ("oja", "scalar_decay") for s in STRONG],
                                                  [("oja", "block-inf")]))
def test_strong_decays(staged, name, strength):
    """A log-decay of -1e4 or -inf (exact zeros in the reference), weak decays elsewhere: o, S and
    every gradient match (no nan from -inf - -inf, no inf from exp of a negated log-decay); the diagonal
    decay per value channel (oja) and one per head (the erase and the decay then commute)."""
    m = staged(text=spec_text(name))
    x, opts = draw_inputs(m, Case(B=1, T=70, H=1, HV=2, K=16, V=16, initial_state=True, seed=7), DEVICE)
    where, value = STRONG[strength]
    log = LOG_DECAY[name]
    x[log] = x[log] / 100  # weak elsewhere: what crosses the strong tokens would count
    x[log][:, where] = value
    bad = failing(against_reference(m, x, opts, impls=("chunk",)))
    assert not bad, bad


@pytest.mark.slow
def test_same_as_the_token_loop(monkeypatch):
    """The staged forward and the token loop forward (LRDSL_VALUE_STAGED=0) give the same o."""
    case = Case(B=1, T=70, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 40, 70), initial_state=True, seed=9)
    new = lrdsl.compile(EXAMPLES / "oja.lr")
    x, opts = draw_inputs(new, case, DEVICE)
    o1, s1 = new.chunk(**x, **opts)
    monkeypatch.setenv(value_key.SWITCH, "0")
    old = lrdsl.compile(EXAMPLES / "oja.lr")
    assert old.value_route is None
    o0, s0 = old.chunk(**x, **opts)
    assert rms_ratio(o1, o0) < TOL and rms_ratio(s1, s0) < TOL
