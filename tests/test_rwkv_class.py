"""Random specs of the RWKV side's class (issue 39): additive transitions D - x y^T computed as written
(order "sum"), readouts of the state before the write and dot-product terms, against the float64
reference, forward and every gradient, on random shapes (packed sequences, grouped value heads, an
initial state). Under -m slow: each case costs seconds in Triton's interpreter."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_backward import compare, describe, grad_cases, repro

import lrdsl

DECAYS = {"none": ("", "I"), "constant": ("", "0.9 I"), "scalar": ("g log", "exp(g) I"),
          "diagonal": ("g[K] log", "diag(exp(g))")}
# (x, y) of the rank-1 part x y^T, the inputs they read; one of x_i y_i's sign is the stable case
ERASES = {"rwkv7": ("(a*kk) kk^T", ["kk[K] l2norm", "a[K] in [0, 1]"]),
          "scalar": ("(beta*kk) kk^T", ["kk[K] l2norm", "beta in (0, 1)"]),
          "write_key": ("(beta*k) k^T", ["beta in (0, 1)"]),
          "own": ("(beta*kk) p^T", ["kk[K] l2norm", "p[K] l2norm", "beta in (0, 1)"])}
READOUTS = {"S": ("S^T q", []), "S_prev": ("S_prev^T q", []),
            "rwkv6": ("S_prev^T q + (q^T (u*k)) v", ["u"]),
            "every": ("S^T q + S_prev^T (r*sigmoid(r)) + 1/2 * (v^T v) (beta2 * v)", ["r", "beta2"])}


def spec_text(decay: str, erase: str, readout: str) -> str:
    d_input, d_text = DECAYS[decay]
    e_text, e_inputs = ERASES[erase]
    r_text, r_names = READOUTS[readout]
    norm = " l2norm" if erase == "write_key" else ""
    inputs = [f"q[K]{norm}", f"k[K]{norm}", "v[V]", *([d_input] if d_input else []), *e_inputs]
    inputs += [{"r": "r[K]", "beta2": "beta2 in (0, 1)"}[n] for n in r_names if n != "u"]
    lines = ["mixer rwkv_class", "input " + ", ".join(inputs)] + (["param u[K]"] if "u" in r_names else [])
    write = "(beta*k) v^T" if erase == "write_key" else "k v^T"
    lines += [f"S = ({d_text} - {e_text}) S + {write}", f"o = {r_text}", "allow unstable"]
    return "\n".join(lines) + "\n"


@st.composite
def rwkv_specs(draw):
    return spec_text(*(draw(st.sampled_from(sorted(t))) for t in (DECAYS, ERASES, READOUTS)))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(text=rwkv_specs(), drawn=grad_cases())
def test_random_rwkv_class_specs_match_the_reference(text, drawn):
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1)
    how = repro(f"lrdsl.compile(text={text!r})", case, output_final_state, case.seed + 1)
    assert not failures, f"failing {describe(failures)}\nall: {describe(errors)}\nreproduce: {how}"


def test_the_generator_spans_the_class():
    """Every decay, erase and readout of the generator compiles; a diagonal decay keeps the additive
    form (a product form would need the decay's inverse), and the readout reads before the update
    wherever it has S_prev or a dot product."""
    from lrdsl.frontend import spec_to_ir
    for decay in DECAYS:
        for erase in ERASES:
            for readout in READOUTS:
                m = spec_to_ir(spec_text(decay, erase, readout))
                assert m.reads_before == (readout != "S")
                if decay in ("scalar", "diagonal") and erase != "write_key":
                    assert m.delta.order == "sum", (decay, erase)
