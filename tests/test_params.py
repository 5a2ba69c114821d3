"""Learned params in specs (`param A_log, dt_bias`): the IR and its printing, the checker's ranges,
errors with their place, the tensors a call takes, and the kernels (recurrent, chunk forward and
backward, decode) against the float64 reference on odd shapes and packed sequences, CPU interpreter.

Specs: examples/gated_deltanet_gates.lr (FLA's gates in the axis form: the staged kernels and the
generated chain rule) and, below, a per-channel decay with a [K] param, a decay after the erase
(the general kernels and the PyTorch chain rule), an auxiliary scan that reads params (the
prologue, the PyTorch chain rule), and params with declared ranges that clamp. Tolerances as tests/test_backward.py: rms ratio < 1e-4
for o, the state, dq, dk, dv, dh0; < 1e-3 for the other inputs and the params.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from specgen import default_first
from test_backward import ROOT, TOL_QKV, compare, describe, grad_cases

import lrdsl
from lrdsl.errors import InputError, SpecError
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.frontend.params import sample
from lrdsl.testing import Case, draw_inputs, rms_ratio

GATES = ROOT / "examples" / "gated_deltanet_gates.lr"
SPECS = {
    # a decay per key channel with a [K] param beside a per-head one (the generated chain rule
    # through the per-channel log-decay)
    "kda_gates": """mixer kda_gates
input q[K] l2norm, k[K] l2norm, v[V]
input a[K], b
param A_log, dt_bias[K]
let g = -exp(A_log) * softplus(a + dt_bias)
S = (I - sigmoid(b) k k^T) diag(exp(g)) S + sigmoid(b) k v^T
o = S^T q
""",
    # the decay after the erase: the general chunked kernels
    "right_gates": """mixer right_gates
input q[K] l2norm, k[K] l2norm, v[V]
input a[K], b
param A_log[K], dt_bias
let g = -exp(A_log) * softplus(a + dt_bias)
S = diag(exp(g)) (I - sigmoid(b) k k^T) S + sigmoid(b) k v^T
o = S^T q
""",
    # an auxiliary scan reading params: the prologue kernels
    "atk_gates": """mixer atk_gates
input q[K] l2norm, k[K] l2norm, v[V]
input a, b
param A_log, r[K] in [0, 1] init 0.5
state P[K] = exp(-exp(A_log) * softplus(a)) * P + r * k * k
let m = squash(P, x = 1.5, center = -0.2)
S = (I - sigmoid(b) (m*k) k^T) S + sigmoid(b) (m*k) v^T
o = S^T q
""",
    # params per value channel ([V]): a gain and a bias of the written value (the staged kernels and
    # the generated chain rule, which sums the value-channel terms over the tokens)
    "value_gates": """mixer value_gates
input q[K] l2norm, k[K] l2norm, v[V]
input a, b
param A_log, w[V] in (0, 2) init 1, vb[V]
let g = -exp(A_log) * softplus(a)
S = exp(g) (I - sigmoid(b) k k^T) S + sigmoid(b) k (w*v + vb)^T
o = S^T q
""",
    # a [V] param in a value-channel auxiliary scan, a decay after the erase: the general kernels and
    # the PyTorch chain rule
    "value_scan": """mixer value_scan
input q[K] l2norm, k[K] l2norm, v[V]
input a[K], b
param A_log, w[V] in [0, 1] init 0.5
state U[V] = exp(-exp(A_log)) * U + w * v
let g = -softplus(a)
S = diag(exp(g)) (I - sigmoid(b) k k^T) S + sigmoid(b) k U^T
o = S^T q
""",
    # declared ranges: values outside are clamped (and get no gradient), in the query and the erase
    "clamp_gates": """mixer clamp_gates
input q[K] l2norm, k[K] l2norm, v[V]
input b
param w[K] in [0, 1] init 0.5, c in (-1, 1), lam in [0.5, 2] init 1
let beta = sigmoid(b + c)
S = exp(-lam * softplus(b)) (I - beta k (w*k)^T) S + beta k v^T
o = S^T (w*q)
""",
}
# odd shapes (T 37, K 20, V 12, two value heads per key head, a non-default scale, an initial
# state) and four packed sequences, one of them empty
CASES = {
    "T37-H1-HV2-K20-V12": Case(B=2, T=37, H=1, HV=2, K=20, V=12, initial_state=True, scale=0.7, seed=21),
    "varlen-5,0,25,7": Case(B=1, T=37, H=1, HV=2, K=20, V=12, cu_seqlens=(0, 5, 5, 30, 37), initial_state=True,
                            seed=22),
}


def mixer_of(compiled, name):
    return compiled(GATES) if name == "gated_deltanet_gates" else compiled_text(name)


_TEXTS = {}


def compiled_text(name):
    if name not in _TEXTS:
        # clamp_gates feeds the reference params outside their ranges on purpose: no range assertion
        _TEXTS[name] = lrdsl.compile(text=SPECS[name], check_ranges=False)
    return _TEXTS[name]


def clamp_edit(x):
    """For clamp_gates: of each param, one head inside its range and one outside (HV = 2)."""
    x["w"] = torch.tensor([[0.3, -0.4, 1.6, 0.9] * 5, [0.7, 0.1, 0.5, 2.0] * 5])
    x["c"] = torch.tensor([0.4, -1.8])
    x["lam"] = torch.tensor([0.1, 1.3])


# ---- spec text, IR, printing ---------------------------------------------------------------------
def test_params_are_in_the_ir_with_their_shape_range_and_init():
    m = spec_to_ir(SPECS["clamp_gates"])
    w, c, lam = m.params
    assert (w.name, w.kind, float(w.lo), float(w.hi), w.lo_open, w.hi_open) == ("w", "K", 0.0, 1.0, False, False)
    assert (c.kind, c.lo_open, c.hi_open) == ("scalar", True, True)
    assert lam.init == ("number", 1) and w.init == ("number", 0.5)
    assert [i.name for i in m.inputs] == ["q", "k", "v", "b"] and m.tensor_names[-3:] == ("w", "c", "lam")
    gates = spec_to_ir(GATES.read_text())
    a_log, dt_bias = gates.params
    assert printer.param_decl(a_log) == "A_log init log(uniform(1, 16))"  # Mamba-2's, by name
    assert printer.param_decl(dt_bias) == "dt_bias init softplus_inv(log_uniform(0.001, 0.1))"
    assert spec_to_ir("mixer m\ndecay scalar g\nparam z in (1, 3)\n").params[0].init == ("number", 2)


@pytest.mark.parametrize("name", ["gated_deltanet_gates", *SPECS])
def test_explicit_form_with_params_round_trips(name):
    m = spec_to_ir(GATES.read_text() if name == "gated_deltanet_gates" else SPECS[name])
    text = printer.explicit(m)
    assert "\nparam " in text
    m2 = spec_to_ir(text)
    assert m2 == m and printer.explicit(m2) == text


def test_the_axis_form_takes_gates_from_lets_and_params():
    """decay scalar g / gain scalar beta naming lets: the same IR as the explicit spec."""
    explicit = spec_to_ir("""mixer gated_deltanet_gates
input q[K] l2norm, k[K] l2norm, v[V]
input a, b
param A_log, dt_bias
let g = -exp(A_log) * softplus(a + dt_bias)
let beta = sigmoid(b)
S = exp(g) (I - beta k k^T) S + beta k v^T
o = S^T q
""")
    assert spec_to_ir(GATES.read_text()) == explicit


def test_the_checker_proves_the_gates_in_range():
    r = lrdsl.compile(GATES, load_kernels=False).check()
    assert r["facts"]["stable"] == "proved" and r["eigenvalues"] == {"min": 0.0, "max": 1.0, "proved": True}
    # an unbounded param that can make the decay grow is refused, and the fix names it
    with pytest.raises(SpecError, match="narrow the declared range of A"):
        lrdsl.compile(text="mixer m\ninput a\nparam A\nlet g = A * softplus(a)\ndecay scalar g\n", load_kernels=False)
    lrdsl.compile(text="mixer m\ninput a\nparam A in (-inf, 0]\nlet g = A * softplus(a)\ndecay scalar g\n",
                  load_kernels=False)


def test_witnesses_hold_a_param_for_the_whole_sequence():
    """The numeric search draws per-token inputs anew at every token but a param once."""
    import numpy as np

    from lrdsl.checks import witness
    num = witness.numeric(spec_to_ir(SPECS["atk_gates"]))
    rng = np.random.default_rng(0)
    for s in (witness._sample(rng, num, 50, 3, 3), witness._perturb(rng, num, witness._sample(rng, num, 50, 3, 3), 0.3)):
        for tok in (s.prefix, *s.steps):
            for name in ("A_log", "r"):
                assert np.array_equal(tok[name], s.steps[0][name])
        assert not np.array_equal(s.steps[0]["a"], s.steps[1]["a"])


ERRORS = {  # spec text -> (line, column, words of the message)
    "mixer m\ninput q[K], k[K], v[V]\nlet g = -exp(A_log)\nS = exp(g) S + k v^T\no = S^T q\n":
        (3, 14, ["unknown name 'A_log'", "`param A_log`"]),
    "mixer m\nparam w, w\ndecay scalar g\n": (2, 10, ["'w' is already defined (line 2)"]),
    "mixer m\ninput a\nparam a\ndecay scalar g\n": (3, 7, ["'a' is already defined (line 2)"]),
    "mixer m\nparam w[T]\ndecay scalar g\n": (2, 9, ["one per head and key channel (`param w[K]`)",
                                                  "value channel (`param w[V]`)", "[T]"]),
    "mixer m\nparam w in (1, 1)\ndecay scalar g\n": (2, 9, ["range of 'w' is empty"]),
    "mixer m\nparam w init log(uniform(-1, 2))\ndecay scalar g\n": (2, 7, ["log(...) takes positive values"]),
    "mixer m\nparam w init uniform(2, 1)\ndecay scalar g\n": (2, 7, ["needs lo < hi"]),
    "mixer m\nparam w in (0, 1) init uniform(-1, 0.5)\ndecay scalar g\n": (2, 7, ["outside its declared range",
                                                                               "init 0.5"]),
    "mixer m\nparam scale\ndecay scalar g\n": (2, 7, ["'scale' is reserved"]),
    "mixer m\ninput param\ndecay scalar g\n": (2, 7, ["param"]),
    "mixer m\nparam w init normal(0, 1)\ndecay scalar g\n": (2, 14, ["uniform or log_uniform"]),
    "mixer m\ninput b\nlet beta = sigmoid(b)\ngain scalar beta in (0, 1)\n": (4, 18, ["defined in the spec",
                                                                                   "drop the range"]),
    "mixer m\ndecay scalar g\nparam w\nS = S + k v^T\n": (4, 1, ["explicit update", "params and lets"]),
}


@pytest.mark.parametrize("text", list(ERRORS), ids=range(len(ERRORS)))
def test_param_mistakes_name_their_place(text):
    line, col, words = ERRORS[text]
    with pytest.raises(SpecError) as e:
        spec_to_ir(text)
    assert (e.value.span.line, e.value.span.column) == (line, col), str(e.value)
    for w in words:
        assert w in e.value.message, e.value.message


# ---- tensors -------------------------------------------------------------------------------------
def test_reference_equals_gated_deltanet_with_the_gates_computed_outside():
    """FLA's layer computes g and beta in PyTorch; here the spec does: the same float64 scan."""
    gates = lrdsl.compile(GATES, load_kernels=False)
    plain = lrdsl.compile(ROOT / "examples" / "gated_deltanet.lr", load_kernels=False)
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 11, 3, 8, 6
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    a, b = torch.randn(B, T, H, generator=gen, dtype=torch.float64), torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    A_log, dt_bias = torch.rand(H, generator=gen, dtype=torch.float64) * 2.7, torch.randn(H, generator=gen, dtype=torch.float64)
    o, S = gates.reference(q, k, v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    o2, S2 = plain.reference(q, k, v, g=g, beta=torch.sigmoid(b), output_final_state=True)
    assert rms_ratio(o, o2) < 1e-12 and rms_ratio(S, S2) < 1e-12


def test_params_are_checked_with_clear_errors():
    m = lrdsl.compile(GATES, load_kernels=False)
    x, _ = draw_inputs(m, Case(B=1, T=4, H=2, HV=2, K=8, V=8))
    cases = [
        (dict(A_log=x["A_log"][:1]), "'A_log' must have shape [HV] = [2]"),
        (dict(A_log=x["A_log"].expand(4, 2)), "'A_log' must have shape [HV] = [2]"),
        (dict(dt_bias=x["dt_bias"].long()), "'dt_bias' must be a floating-point tensor"),
        (dict(dt_bias=[0.0, 1.0]), "'dt_bias' must be a torch.Tensor"),
        (dict(A_log=x["A_log"].to("meta")), "meta tensor"),
        (dict(A_log=None), "needs the param 'A_log', a tensor [HV] = [2]"),
        (dict(A_logg=x["A_log"]), "no input named 'A_logg'; its inputs are q, k, v, a, b and params A_log, dt_bias"),
    ]
    for change, words in cases:
        y = dict(x, **change)
        if y.get("A_log") is None:
            y.pop("A_log")
        with pytest.raises(InputError) as e:
            m.reference(**y)
        assert words in str(e.value), str(e.value)
    checked = lrdsl.compile(text=SPECS["clamp_gates"], load_kernels=False, check_ranges=True)
    y, _ = draw_inputs(checked, Case(B=1, T=3, H=1, HV=1, K=4, V=4))
    with pytest.raises(InputError, match="param 'lam' has values outside its declared range"):
        checked.reference(**dict(y, lam=torch.tensor([3.0])))


def test_value_channel_params_are_hv_by_v_tensors():
    """A param per value channel is a tensor [HV, V]: clear errors for another shape or none, and
    lrdsl.nn.Layer makes it an nn.Parameter [num_v_heads, head_v_dim] drawn by its init."""
    m = lrdsl.compile(text=SPECS["value_gates"], load_kernels=False)
    x, _ = draw_inputs(m, Case(B=1, T=4, H=1, HV=2, K=8, V=6))
    assert x["vb"].shape == x["w"].shape == (2, 6)
    for bad, words in ((x["vb"][:, :4], "param 'vb' must have shape [HV, V] = [2, 6] (one value per value head "
                                        "and value channel"),
                       (None, "needs the param 'vb', a tensor [HV, V] = [2, 6] (one value per value head and value")):
        y = dict(x, vb=bad)
        if bad is None:
            y.pop("vb")
        with pytest.raises(InputError) as e:
            m.reference(**y)
        assert words in str(e.value), str(e.value)
    from lrdsl.nn import Layer
    layer = Layer(m, hidden_size=16, num_heads=2, head_dim=8, num_v_heads=4, head_v_dim=6)
    assert layer.w.shape == layer.vb.shape == (4, 6) and layer.A_log.shape == (4,)
    assert torch.equal(layer.w, torch.ones(4, 6)) and torch.equal(layer.vb, torch.zeros(4, 6))  # their inits


def test_kernels_load_params_once_per_head():
    """The params reach the kernels as [HV] tensors, loaded at the head's offset where the gates are
    evaluated: no [B, T, HV] copy is made before the launch."""
    from lrdsl.runtime import loader as runtime
    src = runtime.generate(spec_to_ir(GATES.read_text()))
    assert 'PARAMS = ("A_log", "dt_bias", )' in src
    assert "b_A_log = tl.load(in_A_log + i_hv).to(tl.float32)" in src  # the recurrent kernel
    assert "b_A_log = tl.where(m_t, tl.load(in_A_log + i_hv).to(tl.float32), 0.0)[:, None]" in src  # chunks
    src = runtime.generate(spec_to_ir(SPECS["kda_gates"]))
    assert "b_dt_bias = tl.load(in_dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)" in src
    src = runtime.generate(spec_to_ir(SPECS["value_gates"]))
    assert "b_vb = tl.load(in_vb + i_hv * V + o_v, mask=m_v, other=0).to(tl.float32)" in src


# ---- kernels against the reference ---------------------------------------------------------------
# every spec on the default case in pytest -q but right_gates, atk_gates, value_scan and value_gates (-m slow: the
# default tier is at its 5-minute limit), every spec on every case under -m slow
@pytest.mark.parametrize("case_id", default_first(list(CASES), "varlen-5,0,25,7"))
@pytest.mark.parametrize("name", [n if n not in ("right_gates", "atk_gates", "value_scan", "value_gates") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ["gated_deltanet_gates", *SPECS]])
def test_forward_and_gradients_match_the_reference(name, case_id, compiled):
    mixer = mixer_of(compiled, name)
    case = CASES[case_id]
    edit = clamp_edit if name == "clamp_gates" else None
    x, opts = draw_inputs(mixer, case)
    if edit:
        edit(x)
    with torch.no_grad():
        o, S = mixer.recurrent(**x, **opts)
    ref_o, ref_S = mixer.reference(**{n: t.double() for n, t in x.items()},
                                   **dict(opts, initial_state=opts["initial_state"].double()))
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(S, ref_S)
    assert e_o < TOL_QKV and e_s < TOL_QKV, f"{name} recurrent: o {e_o:.3g}, state {e_s:.3g}"
    errors, failures = compare(mixer, case, output_final_state=True, seed=5, edit=edit)
    assert not failures, f"{name} {case_id}: {describe(failures)}; all: {describe(errors)}"
    assert {"d" + p for p in mixer.params} <= set(errors), "the params' gradients were not compared"


def test_param_gradients_are_not_vacuous(compiled):
    """The params' gradients are sums over every token of both sequences: nonzero, and a change of
    one token's input moves them (so no token is left out of the sum)."""
    mixer = compiled(GATES)
    case = CASES["varlen-5,0,25,7"]
    x, opts = draw_inputs(mixer, case)
    h0 = opts.pop("initial_state")

    def grads(x):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = mixer.chunk(**leaves, initial_state=h0, **dict(opts, output_final_state=False))
        return torch.autograd.grad(o.pow(2).sum(), [leaves["A_log"], leaves["dt_bias"]])

    base = grads(x)
    assert all(g.abs().min() > 0 for g in base)
    y = dict(x, a=x["a"].clone())
    y["a"][0, -1, 1] += 1.0  # the last token of the last sequence, value head 1
    moved = grads(y)
    assert (moved[0] - base[0]).abs()[1] > 0 and (moved[0] - base[0]).abs()[0] == 0


def test_generated_chain_rule_takes_the_params(compiled, monkeypatch):
    """gated_deltanet_gates has the staged backward and its generated chain rule: the params'
    gradients come from that kernel (summed over tokens by the host), not from PyTorch."""
    mixer = compiled(GATES)
    assert mixer.kernels.HAS_CHAIN_RULE
    calls = []
    original = mixer.kernels.chain_rule
    monkeypatch.setattr(mixer.kernels, "chain_rule", lambda *a: calls.append(1) or original(*a))
    errors, failures = compare(mixer, CASES["T37-H1-HV2-K20-V12"], seed=6)
    assert calls and not failures, describe(errors)


def test_prefill_then_decode_with_params(compiled):
    """chunk over a prompt, then step token by token: one reference pass over the whole."""
    for mixer in (compiled(GATES), compiled_text("atk_gates")):
        case = Case(B=2, T=19, H=1, HV=2, K=16, V=12, seed=7)
        x, _ = draw_inputs(mixer, case)
        per_token = {n: t for n, t in x.items() if n not in mixer.params}
        params = {n: x[n] for n in mixer.params}
        ref_o, _ = mixer.reference(**{n: t.double() for n, t in x.items()})
        with torch.no_grad():
            o1, state = mixer.chunk(**{n: t[:, :11] for n, t in per_token.items()}, **params, output_final_state=True)
            outs = [o1]
            for t in range(11, 19):
                outs.append(mixer.step(**{n: u[:, t:t + 1] for n, u in per_token.items()}, state=state, **params))
        err = rms_ratio(torch.cat(outs, 1), ref_o)
        assert err < TOL_QKV, f"{mixer.name}: {err:.3g}"


def test_equal_gradients_of_two_inputs_do_not_alias(compiled):
    """`a + dt_bias` (and `x + y` of two inputs) give one gradient tensor for both in PyTorch's chain
    rule; the custom op must hand out separate tensors (it refused before)."""
    mixer = lrdsl.compile(text="""mixer sum_gates
input q[K] l2norm, k[K] l2norm, v[V], x[K], y[K]
param dt[K]
let g = -softplus(x + y + dt)
S = diag(exp(g)) S + k v^T
o = S^T q
""")
    errors, failures = compare(mixer, Case(B=1, T=1, H=1, HV=1, K=16, V=16, seed=8), seed=9)
    assert not failures, describe(errors)


def test_standalone_module_takes_params(tmp_path):
    """`lrdsl compile -o`: the written module checks and reads the params like the Mixer."""
    import importlib.util

    from lrdsl.cli import main
    assert main(["compile", str(GATES), "-o", str(tmp_path)]) == 0
    path = next(tmp_path.glob("gated_deltanet_gates*.py"))
    spec = importlib.util.spec_from_file_location("standalone_gates", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mixer = lrdsl.compile(GATES, load_kernels=False)
    x, opts = draw_inputs(mixer, Case(B=1, T=9, H=1, HV=1, K=16, V=16, seed=10))
    ref_o, _ = mixer.reference(**{n: t.double() for n, t in x.items()})
    o, _ = mod.chunk(**x)
    o2, _ = mod.recurrent(**x)
    assert rms_ratio(o, ref_o) < TOL_QKV and rms_ratio(o2, ref_o) < TOL_QKV
    with pytest.raises(ValueError, match=r"A_log must be \[1\] \(HV\)"):
        mod.chunk(**dict(x, A_log=x["A_log"].expand(9, 1)))


def test_init_draws_what_it_says():
    gen = torch.Generator().manual_seed(0)
    a_log = sample(("log", ("uniform", 1, 16)), (10000,), gen)
    assert math.log(1) <= a_log.min() and a_log.max() <= math.log(16)
    dt = F.softplus(sample(("softplus_inv", ("log_uniform", 0.001, 0.1)), (10000,), gen))
    assert 0.001 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5)
    assert abs(dt.log().mean().item() - (math.log(0.001) + math.log(0.1)) / 2) < 0.05  # log-uniform
    assert torch.equal(sample(("number", 0.5), (3,)), torch.full((3,), 0.5))


def test_params_with_the_offline_solve():
    """A Mesa spec whose decay reads a param: forward and gradients (the param's too)."""
    mixer = lrdsl.compile(text="""mixer mesa_gates
input a, beta in (0, 1), lamb[K] in [0.01, 10]
param A_log
let g = -exp(A_log) * softplus(a)
decay scalar g
gain scalar beta
solve offline lamb
normalize q, k
""")
    errors, failures = compare(mixer, Case(B=1, T=9, H=1, HV=2, K=16, V=16, seed=3), seed=4)
    assert not failures and "dA_log" in errors, describe(errors)


# ---- random placements -----------------------------------------------------------------------------
@st.composite
def param_specs(draw):
    """A param in any place a gate can read one: the decay (per head, or per key channel through a
    [K] param), the erase gain, the write key and the query, with or without a declared range."""
    decay = draw(st.sampled_from(["none", "scalar", "diagonal"]))
    erase, write, query = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    after = erase and decay == "diagonal" and draw(st.booleans())
    inputs, params, lets = ["a"] if decay != "none" else [], [], []
    inputs += ["b"] if erase else []
    if decay != "none":
        params += ["A_log", "dt_bias[K]" if decay == "diagonal" else "dt_bias"]
        lets.append("let g = -exp(A_log) * softplus(a + dt_bias)")
    params += ["c in (-2, 2)"] if erase else []
    params += ["w[K] in [0, 1] init 0.5"] if write else []
    params += ["s"] if query else []
    beta = "sigmoid(b + c)" if erase else "1"
    key = "(w*k)" if write else "k"
    d = {"none": "", "scalar": "exp(g) ", "diagonal": "diag(exp(g)) "}[decay]
    trans = (f"{d}(I - {beta} k k^T) " if after else f"(I - {beta} k k^T) {d}") if erase else d
    lines = ["mixer random_params", ", ".join(["input q[K] l2norm, k[K] l2norm, v[V]", *inputs])]
    lines += ["param " + ", ".join(params)] if params else []
    lines += lets + [f"S = {trans}S + {beta} {key} v^T", f"o = S^T {'(s*q)' if query else 'q'}"]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@settings(max_examples=12, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(text=param_specs(), drawn=grad_cases())
def test_random_param_placements_match_the_reference(text, drawn):
    case, _ = drawn
    mixer = lrdsl.compile(text=text, check_ranges=False)
    errors, failures = compare(mixer, case, seed=case.seed % 1000)
    assert not failures, f"{describe(failures)}\nspec:\n{text}case: {case}"
