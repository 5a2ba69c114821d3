"""Value-side transitions, S_t = S_{t-1} N_t + u_t z_t^T with N_t [V, V] diagonal plus rank 1 (the
gated Oja rule, FLA's chunk_gated_oja_rule; issue 40 part 2), on every path against the float64
reference, forward and backward: packed sequences, grouped value heads (HV = 2 H), an initial
state, strong decays (-1e4 and -inf on single tokens and on a whole 16-token block).

The chunked path of these specs is the generated chunked forward and backward (runtime/valueside.py;
its kernels' own tests: test_value_bwd.py); recurrent and step are the generated value-side token loop."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_backward import compare, describe, grad_cases
from test_dplr import against_reference, failing, reference64, strong, tiered
from test_recurrent import DEVICE

import lrdsl
from lrdsl.errors import InputError, SpecError
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.testing import TOL, Case, check_case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# name -> (the inputs besides q, k, v, beta; transition N as written after S; the order the frontend gives it)
SPECS = {
    "oja": ("w[V] log", "diag(exp(w)) (I - beta v v^T)", "right"),  # the erase reads the decayed rows
    "erase_first": ("w[V] log", "(I - beta v v^T) diag(exp(w))", "left"),
    "additive": ("w[V] log, kk[V] l2norm, a[V] in [0, 1]", "(diag(exp(w)) - (a*kk) kk^T)", "sum"),  # RWKV-7's form
    "scalar_decay": ("s log", "exp(s) (I - beta v v^T)", "left"),  # one decay per head and token
    "decay_only": ("w[V] log", "diag(exp(w))", None),
}


def spec_text(name: str) -> str:
    inputs, n, _ = SPECS[name]
    return (f"mixer vs_{name}\ninput q[K], k[K], v[V] l2norm, beta in (0, 1), {inputs}\n"
            f"S = S {n} + beta k v^T\no = S^T q\nallow unstable\n")


@pytest.fixture(scope="module")
def mixer():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = lrdsl.compile(text=spec_text(name), check_stability=False)
        return cache[name]
    return get


def dense_n(name, x, t, h):
    """N_t of head h as a dense [V, V] matrix, built from the inputs by hand."""
    unit = lambda u: u * torch.rsqrt((u * u).sum() + 1e-6)
    v = unit(x["v"][0, t, h])
    erase = torch.eye(len(v), dtype=v.dtype) - x["beta"][0, t, h] * torch.outer(v, v)
    if name == "scalar_decay":
        return x["s"][0, t, h].exp() * erase
    D = torch.diag(x["w"][0, t, h].exp())
    if name == "additive":
        kk = unit(x["kk"][0, t, h])
        return D - torch.outer(x["a"][0, t, h] * kk, kk)
    return {"oja": D @ erase, "erase_first": erase @ D, "decay_only": D}[name]


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_is_the_value_side_transition(mixer, name):
    """The reference against a loop over dense matrices, S = S N + beta k v^T, and the order the
    frontend records for each way of writing N."""
    m = mixer(name)
    assert m.ir.side == "right" and (m.ir.delta.order if m.ir.delta else None) == SPECS[name][2]
    case = Case(B=1, T=9, H=1, HV=2, K=5, V=4, initial_state=True, seed=1)
    x, opts = draw_inputs(m, case)
    x = {n: t.double() for n, t in x.items()}
    S0 = opts["initial_state"].double()
    o, s = m.reference(**x, initial_state=S0, output_final_state=True)
    for h in range(2):
        S = S0[0, h]
        unit = x["v"][0, :, h] * torch.rsqrt((x["v"][0, :, h] ** 2).sum(-1, keepdim=True) + 1e-6)
        for t in range(case.T):
            S = S @ dense_n(name, x, t, h) + x["beta"][0, t, h] * torch.outer(x["k"][0, t, 0], unit[t])
            assert torch.allclose(o[0, t, h], S.T @ (x["q"][0, t, 0] * case.K ** -0.5), rtol=1e-9, atol=1e-12)
        assert torch.allclose(s[0, h], S, rtol=1e-9, atol=1e-12)


CASES = {
    "B2-T37-HV2-h0": Case(B=2, T=37, H=1, HV=2, K=12, V=8, initial_state=True, scale=0.7, seed=1),
    "varlen-H2-HV4-h0": Case(B=1, T=37, H=2, HV=4, K=8, V=12, cu_seqlens=(0, 5, 5, 37), initial_state=True, seed=2),
}


@pytest.mark.parametrize("name, case_id", tiered([(n, c) for n in SPECS for c in CASES],
                                                  [("additive", "B2-T37-HV2-h0")]))
def test_paths_match_the_reference(mixer, name, case_id):
    """recurrent and chunk forward, and chunk's gradient of every input and of the initial state
    (check_case: packed sequences with an empty one, grouped value heads, an initial state)."""
    out = check_case(mixer(name), CASES[case_id], DEVICE, impls=("recurrent", "chunk"), grad=True)
    assert out.ok, out.message


STRONG = {  # where, value: one token at -1e4 and at -inf in two chunks, a whole 16-token block at -inf
    "one-1e4": ((9, 30), -1e4),
    "one-inf": ((9, 30), -float("inf")),
    "block-inf": (slice(16, 32), -float("inf")),
}


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in ("oja", "erase_first", "additive", "decay_only")
                                                   for s in STRONG], [("additive", "one-1e4")]))
def test_strong_decays(mixer, name, strength):
    """A log-decay of -1e4 or -inf (exact zeros in the reference) on single tokens and on a whole
    16-token block: recurrent and chunk forward and chunk's gradients match the float64 reference
    (a difference of prefix sums, -inf - -inf, or an exp(-w) would give nan or inf)."""
    m = mixer(name)
    x, opts = draw_inputs(m, Case(B=1, T=40, H=1, HV=2, K=8, V=8, initial_state=True, seed=7), DEVICE)
    where, value = STRONG[strength]
    bad = failing(against_reference(m, strong(x, value, where), opts))
    assert not bad, bad


def test_strong_scalar_decay(mixer):
    """The same for one decay per head and token (s at -inf on a whole block)."""
    m = mixer("scalar_decay")
    x, opts = draw_inputs(m, Case(B=1, T=40, H=1, HV=2, K=8, V=8, initial_state=True, seed=8), DEVICE)
    x["s"] = x["s"].clone()
    x["s"][:, 16:32] = -float("inf")
    bad = failing(against_reference(m, x, opts))
    assert not bad, bad


def test_step_matches_the_reference(mixer):
    """The decode step, token by token from a state updated in place, with a -inf decay."""
    m = mixer("oja")
    x, opts = draw_inputs(m, Case(B=2, T=5, H=1, HV=2, K=8, V=8, initial_state=True, seed=3), DEVICE)
    x = strong(x, -float("inf"), (2,))
    state = opts["initial_state"].clone().contiguous()
    with torch.no_grad():
        outs = [m.step(**{n: t[:, i:i + 1] for n, t in x.items()}, state=state) for i in range(5)]
    ref_o, ref_s, _ = reference64(m, x, opts)
    assert rms_ratio(torch.cat(outs, 1), ref_o) < TOL and rms_ratio(state, ref_s) < TOL


def test_example_and_printer_round_trip():
    """examples/oja.lr: the value side in the IR, its explicit form parses back to the same IR, and
    the canonical form names N's side; the checker proves N a contraction (bounded state)."""
    m = lrdsl.compile(EXAMPLES / "oja.lr")
    assert m.ir.side == "right" and m.ir.decay.kind == "diagonal" and m.ir.delta.order == "right"
    text = printer.explicit(m.ir)
    assert "S = S diag(exp(gv)) (I - (beta*v) v^T)" in text
    assert spec_to_ir(text) == m.ir
    assert "side    value" in printer.canonical(m.ir)
    facts = m.check()
    assert facts["bounded_state"] == "proved" and facts["spectral_norm_le_1"] == "proved"
    assert "value side" in facts["notes"][0]


def test_checker_refuses_an_expanding_value_side_transition():
    """N's facts decide as M's do: beta up to 3 gives the erase eigenvalue 1 - 3 = -2, refused
    with the usual sentence unless `allow unstable`."""
    text = ("mixer grow\ninput q[K], k[K], v[V] l2norm, gv[V] log, beta in (0, 3)\n"
            "S = S diag(exp(gv)) (I - beta v v^T) + beta k v^T\no = S^T q\n")
    with pytest.raises(SpecError, match="eigenvalues of the transition"):
        lrdsl.compile(text=text)
    assert lrdsl.compile(text=text + "allow unstable\n").check()["stable"] is False


ERRORS = {
    "sum_with_two_sided": ("S = (I - beta k k^T) S diag(exp(w)) + S diag(exp(w)) + k v^T",
                           "a sum of transitions with a two-sided one"),
    "write_inside_two_sided": ("S = (I - beta k k^T) (S diag(exp(w)) + k v^T)", "write M S N + k v^T"),
    "v_matrix_on_the_left": ("S = diag(exp(w)) S + k v^T", "cannot multiply S ([K, V]) from the left"),
    "k_matrix_on_the_right": ("S = S (I - beta k k^T) + k v^T", "a factor on its right is a [V, V] matrix"),
    "write_times_n": ("S = (S + k v^T) diag(exp(w))", "the write is added after the transition"),
    "sum_of_sides": ("S = S diag(exp(w)) + (I - beta k k^T) S + k v^T", "one of the two forms"),
    "mixed_matrix": ("S = S (diag(exp(w)) - beta k k^T) + k v^T", "cannot combine a [K, K] and a [V, V]"),
    "key_decay_on_the_right": ("S = S (I - beta v v^T) exp(g) + k v^T", "[V, V] factors from the right (S N)"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_unsupported_value_side_forms_are_refused_where_they_are(case):
    """One sentence naming the form and a fix, located on the update line."""
    update, words = ERRORS[case]
    text = ("mixer bad\ninput q[K], k[K], v[V] l2norm, w[V] log, g[K] log, beta in (0, 1)\n"
            f"{update}\no = S^T q\n")
    with pytest.raises(SpecError, match=r"<spec>:3:\d+: error: ") as e:
        spec_to_ir(text)
    assert words in str(e.value) and "Traceback" not in str(e.value)


def test_aux_states_and_prev_readouts_are_refused():
    base = "mixer bad\ninput q[K], k[K], v[V] l2norm, w[V] log, beta in (0, 1)\n"
    with pytest.raises(SpecError, match="auxiliary states with a value-side transition"):
        spec_to_ir(base + "state P[V] = 0.5 * P + v\nS = S diag(exp(w)) + k P^T\no = S^T q\n")
    with pytest.raises(SpecError, match="reads out as o = S\\^T x alone"):
        spec_to_ir(base + "S = S diag(exp(w)) + k v^T\no = S_prev^T q\n")


def test_context_parallelism_refuses_clearly(mixer):
    m = mixer("oja")
    x, opts = draw_inputs(m, Case(B=1, T=4, H=1, HV=1, K=4, V=4))
    with pytest.raises(InputError, match="context parallelism does not support"):
        m.chunk(**x, cp_group=object())


def test_no_kernel_exponentiates_a_negated_log_decay(mixer):
    """The generated value-side module and the chunked PyTorch path take no exp of a negated
    quantity (their exponents are in-chunk sums over (s, t], never -G)."""
    import inspect
    import re

    from lrdsl.codegen.generate import generate
    from lrdsl.runtime import valueside
    negated = re.compile(r"\bexp2?\(\s*-")
    for name in SPECS:
        source = re.sub(r"#.*", "", generate(mixer(name).ir))
        assert "def recurrent_value_kernel" in source and not negated.search(source), name
    code = re.sub(r'#.*|"""[^"]*"""', "", inspect.getsource(valueside))  # comments and docstrings say exp(-g)
    assert not negated.search(code) and not re.search(r"exp\(\s*-\s*\w", code)


def test_layer_trains_and_decodes(mixer):
    """lrdsl.nn.Layer over the value-side example: a packed prefill through chunk, gradients to every
    parameter, and a decode step continuing the prefill's state equals the whole pass."""
    from lrdsl.nn import Layer
    torch.manual_seed(0)
    layer = Layer(lrdsl.compile(EXAMPLES / "oja.lr"), 16, 2, 8)
    xs = torch.randn(1, 7, 16)
    y, _ = layer(xs)
    y.pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters() if p.requires_grad)
    with torch.no_grad():
        head, cache = layer(xs[:, :6], use_cache=True)
        tail, _ = layer(xs[:, 6:], cache=cache)
        assert rms_ratio(torch.cat([head, tail], 1), y) < TOL


# ---- slow: random value-side specs -----------------------------------------------------------------
V_DECAYS = {"none": ("", ""), "constant": ("", "(1 - 2^(-3 - h)) I"), "scalar": ("s log", "exp(s) I"),
            "diagonal": ("w[V] log", "diag(exp(w))")}
# the erase (I - x y^T) or, additive, D - x y^T over value channels, and the inputs it reads
V_ERASES = {"none": ("", []), "oja": ("(beta*v) v^T", []), "own": ("(beta*kk) kk^T", ["kk[V] l2norm"]),
            "channel": ("(a*kk) kk^T", ["kk[V] l2norm", "a[V] in [0, 1]"])}
V_FORMS = ("decay_first", "erase_first", "additive")


def value_side_text(decay: str, erase: str, form: str, write: str) -> str:
    if erase == "none":  # without an erase only a decay per value channel is of the value side (a
        decay = "diagonal"  # number per head times I commutes with S: the frontend keeps it M S)
    d_input, d_text = V_DECAYS[decay]
    e_text, e_inputs = V_ERASES[erase]
    inputs = ["q[K]", "k[K]", "v[V] l2norm", *([d_input] if d_input else []), *e_inputs]
    inputs += ["beta in (0, 1)"] if "beta" in e_text + write else []  # every input read (gradients)
    if e_text == "":
        n = d_text or "I"
    elif form == "additive":
        n = f"({d_text or 'I'} - {e_text})"
    else:
        parts = [d_text, f"(I - {e_text})"] if form == "decay_first" else [f"(I - {e_text})", d_text]
        n = " ".join(p for p in parts if p)
    return (f"mixer vs_random\ninput {', '.join(inputs)}\nS = S {n} + {write}\no = S^T q\nallow unstable\n")


@st.composite
def value_side_specs(draw):
    return value_side_text(draw(st.sampled_from(sorted(V_DECAYS))), draw(st.sampled_from(sorted(V_ERASES))),
                           draw(st.sampled_from(V_FORMS)), draw(st.sampled_from(["beta k v^T", "k v^T"])))


@pytest.mark.slow
@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(text=value_side_specs(), drawn=grad_cases())
def test_random_value_side_specs_match_the_reference(text, drawn):
    """Random decays (none, per head, per token, per value channel), erases (v's own, another unit
    direction, per-channel gains) in every order, on random shapes (packed sequences with empty ones,
    grouped value heads, initial state, final state or not): recurrent's forward, and chunk's forward
    and every gradient, against the float64 reference."""
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    assert mixer.ir.side == "right"
    out = check_case(mixer, case, DEVICE, impls=("recurrent",))
    assert out.ok, f"{text}{case}: {out.message}"
    errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1)
    assert not failures, f"{text}{case}: failing {describe(failures)}\nall: {describe(errors)}"


def test_the_generator_spans_the_orders():
    """The generator's forms reach every order of N (and none), each decay kind on the value side."""
    orders, kinds = set(), set()
    for d in V_DECAYS:
        for e in V_ERASES:
            for f in V_FORMS:
                m = spec_to_ir(value_side_text(d, e, f, "k v^T"))
                assert m.side == "right"
                orders.add(m.delta.order if m.delta else None)
                kinds.add(m.decay.kind)
    assert orders == {None, "left", "right", "sum"} and kinds == {"identity", "constant", "scalar", "diagonal"}


@pytest.mark.parametrize("bad", ["gv-nan", "v-inf", "k-nan"])
def test_nonfinite_input_reaches_no_earlier_token(compiled, bad, monkeypatch):
    """A nan or inf at token 37 of the second of two packed sequences (inside a 16-token chunk) leaves
    every token before it as the float64 reference has them (test_nonfinite's check: chunk's o and
    final state, finite exactly where the reference's are)."""
    from test_nonfinite import check_causal, spoil
    m = compiled(EXAMPLES / "oja.lr")
    name, value, whole = {"gv-nan": ("gv", float("nan"), True), "v-inf": ("v", float("inf"), False),
                          "k-nan": ("k", float("nan"), True)}[bad]
    x, opts = draw_inputs(m, Case(B=1, T=60, H=1, HV=1, K=8, V=8, cu_seqlens=(0, 20, 60), initial_state=True,
                                  seed=9), DEVICE)
    check_causal(m, spoil(x, name, value, whole, 37), opts, 37, monkeypatch, bad)
