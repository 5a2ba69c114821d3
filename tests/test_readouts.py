"""Readouts beside S^T x: S_prev^T y (the state before the token's update) and dot-product terms
(x^T y) z (lrdsl/codegen/readouts.py, lrdsl/runtime/readouts.py). The example matrices run rwkv6 on
every path; here a readout with every kind of term at once, decoding, the layer, and the errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import lrdsl
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

# every kind of readout term: S^T x, S_prev^T y with y read through a let, and dot products over
# key and value channels; an erase, so both parts run the staged delta-rule kernels
MIXED = """mixer mixed
input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1), r[K]
param u[K]
let y = r * sigmoid(g + 1)
S = (I - beta k k^T) exp(g) S + beta k v^T
o = S^T q + S_prev^T y + (q^T (u*k)) v + 1/2 * (v^T v) (beta * v)
"""
# empty sequences first and in the middle (a leading one once made the shift read a token's own query)
CASE = Case(B=1, T=45, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 0, 7, 7, 30, 45), initial_state=True, seed=3)


@pytest.fixture(scope="module")
def mixed():
    return lrdsl.compile(text=MIXED)


@pytest.mark.parametrize("cu", [None, (0, 4, 9), (0, 0, 3, 3, 9), (0, 1, 9), (0, 9, 9)])
def test_shift_next_moves_each_token_to_the_next_within_its_sequence(cu):
    """Token t holds token t + 1's value; the last token of each sequence keeps its own, also the
    batch's last (once set by an index written from the host, refused in a CUDA graph's capture)."""
    from lrdsl.runtime.readouts import shift_next
    x = torch.randn(2, 9, 3, 4, generator=torch.Generator().manual_seed(len(cu or ())))
    ends = [9] if cu is None else [e for s, e in zip(cu, cu[1:]) if e > s]
    want = torch.stack([x[:, t + 1] if t + 1 not in ends else x[:, t] for t in range(9)], 1)
    got = shift_next(x, None if cu is None else torch.tensor(cu, dtype=torch.int32))
    assert torch.equal(got, want)


def test_the_readout_lowers_and_prints_back():
    m = spec_to_ir(MIXED)
    assert m.reads_before and m.query != 0 and m.query_prev != 0 and len(m.bonus) == 2
    assert {b.kind for b in m.bonus} == {"K", "V"}
    assert spec_to_ir(printer.explicit(m)) == m


def _reference(mixer, x, opts):
    x64 = {n: t.double() for n, t in x.items()}
    o64 = dict(opts, initial_state=opts["initial_state"].double())
    return mixer.reference(**x64, **o64)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_every_term_on_packed_sequences(mixed, impl):
    x, opts = draw_inputs(mixed, CASE)
    ref_o, ref_S = _reference(mixed, x, opts)
    host = {"cu_seqlens_cpu": list(CASE.cu_seqlens)} if impl == "chunk" else {}  # what torch.compile needs
    o, S = getattr(mixed, impl)(**x, **opts, **host)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(S, ref_S) < TOL


def test_gradients_of_every_term(mixed):
    x, opts = draw_inputs(mixed, CASE)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"].clone().requires_grad_()
    o, S = mixed.chunk(**leaves, **dict(opts, initial_state=h0))
    do, dS = torch.randn_like(o), torch.randn_like(S)
    ((o * do).sum() + (S * dS).sum()).backward()
    ref = {n: t.double().clone().requires_grad_() for n, t in x.items()}
    h64 = h0.detach().double().requires_grad_()
    o64, S64 = mixed.reference(**ref, **dict(opts, initial_state=h64))
    ((o64 * do.double()).sum() + (S64 * dS.double()).sum()).backward()
    errs = {n: rms_ratio(leaves[n].grad, ref[n].grad) for n in x}
    errs["h0"] = rms_ratio(h0.grad, h64.grad)
    assert all(e < 10 * TOL for e in errs.values()), errs


def test_step_one_token_and_several(mixed):
    """Decoding reads S_prev^T y from the state before the kernel updates it in place; several
    tokens at once agree with one token at a time and with the reference."""
    case = Case(B=2, T=9, H=1, HV=2, K=16, V=16, initial_state=True, seed=4)
    x, opts = draw_inputs(mixed, case)
    ref_o, ref_S = _reference(mixed, x, opts)
    tok = lambda a, b: {n: (t[:, a:b] if t.dim() >= 3 else t) for n, t in x.items()}  # noqa: E731
    with torch.no_grad():
        one = opts["initial_state"].clone()
        outs = [mixed.step(**tok(t, t + 1), state=one) for t in range(case.T)]
        many = opts["initial_state"].clone()
        parts = [mixed.step(**tok(0, 4), state=many), mixed.step(**tok(4, 9), state=many)]
    assert rms_ratio(torch.cat(outs, 1), ref_o) < TOL and rms_ratio(one, ref_S) < TOL
    assert rms_ratio(torch.cat(parts, 1), ref_o) < TOL and rms_ratio(many, ref_S) < TOL


def test_layer_prefill_then_decode_equals_one_pass():
    from lrdsl.nn import Layer
    torch.manual_seed(0)
    L = Layer(lrdsl.compile("examples/rwkv6.lr"), 32, 2, 16)
    with torch.no_grad():
        L.u.normal_()  # a bonus that is not zero
        x = torch.randn(2, 20, 32)
        whole, _ = L(x)
        first, cache = L(x[:, :11], use_cache=True)
        outs = [first] + [L(x[:, t:t + 1], cache)[0] for t in range(11, 20)]
    assert rms_ratio(torch.cat(outs, 1), whole) < 1e-5


@pytest.mark.parametrize("readout,what", [
    ("o = S_prev^T q + (q^T k) q", "as a factor of a [V] vector"),
    ("o = (q^T k) v", "the readout must read the state"),
    ("o = S^T q + (q^T v) v", "two vectors of one length"),
    ("o = S_prev^T v", "reads a [K] vector"),
])
def test_readout_mistakes_are_one_clear_error(readout, what):
    text = f"mixer m\ninput q[K], k[K], v[V], w[K] log\nS = diag(exp(w)) S + k v^T\n{readout}\n"
    with pytest.raises(lrdsl.SpecError, match="error: .*" + what.replace("[", r"\[").replace("]", r"\]")) as e:
        lrdsl.compile(text=text, load_kernels=False)
    assert str(e.value).startswith("<spec>:4:")


def test_s_prev_in_the_update_and_auxiliary_states_in_the_readout_are_refused():
    text = "mixer m\ninput q[K], k[K], v[V], w[K] log\nS = diag(exp(w)) S_prev + k v^T\no = S^T q\n"
    with pytest.raises(lrdsl.SpecError, match="read only by the readout"):
        lrdsl.compile(text=text, load_kernels=False)
    text = ("mixer m\ninput q[K], k[K], v[V], w[K] log\nstate P[K] = exp(w) * P + k * k\n"
            "S = diag(exp(w)) S + k v^T\no = S_prev^T (P*q)\n")
    with pytest.raises(lrdsl.SpecError, match="may not read an auxiliary state") as e:
        lrdsl.compile(text=text, load_kernels=False)
    assert str(e.value).startswith("<spec>:5:1")


def test_lrdsl_compile_to_a_module_refuses_the_readout(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lrdsl.cli", "compile", "examples/rwkv6.lr", "-o", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "use lrdsl.compile(spec) in Python" in run.stderr and not list(tmp_path.iterdir())
