"""Random specs of DeltaProduct's class (issue 40): a product of 2 to 4 rank-1 steps per token, each
with its own key, gain and write, no, a constant, a per-head or a per-key-channel decay on the first,
erases along the write key or along another direction (Comba's), a step without erase; against the
float64 reference on random shapes (packed sequences, grouped value heads, an initial state), with
strong decays (-1e4, -inf) on random tokens: recurrent and chunk forward, and chunk's gradient of
every input. Under -m slow: each case costs seconds in Triton's interpreter."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_backward import compare, describe, grad_cases, repro

import lrdsl
from lrdsl.testing import check_case

DECAYS = {"none": ("", ""), "constant": ("", "(1 - 2^(-3 - h)) "), "scalar": ("g log", "exp(g) "),
          "diagonal": ("g[K] log", "diag(exp(g)) ")}
# a step j's factor and write from its inputs: {j} is the step's number. A step without erase can
# only be the first (after another, its write would just add to the one before: a rank-2 write)
STEPS = {"delta": ("(I - b{j} k{j} k{j}^T)", "b{j} k{j} v{j}^T", ["b{j} in (0, 1)"]),
         "negative": ("(I - b{j} k{j} k{j}^T)", "b{j} k{j} v{j}^T", ["b{j} in (0, 2)"]),
         "comba": ("(I - b{j} k{j} p{j}^T)", "b{j} k{j} v{j}^T", ["b{j} in (0, 1)", "p{j}[K] l2norm"]),
         "write": ("", "k{j} v{j}^T", [])}


def spec_text(decay: str, steps: list) -> str:
    d_input, d_text = DECAYS[decay]
    inputs, update = ["q[K] l2norm"], ""
    for j, kind in enumerate(steps, 1):
        # the first step's key and value are k and v (every mixer has them), k2, v2, ... the others'
        sub = lambda t: t.replace("k{j}", "k" if j == 1 else f"k{j}").replace(  # noqa: E731
            "v{j}", "v" if j == 1 else f"v{j}").replace("{j}", str(j))
        factor, write, extra = sub(STEPS[kind][0]), sub(STEPS[kind][1]), [sub(e) for e in STEPS[kind][2]]
        inputs += [sub("k{j}[K] l2norm"), sub("v{j}[V]"), *extra]
        inner = f"{d_text}S" if j == 1 else f"({update})"
        update = f"{factor + ' ' if factor else ''}{inner} + {write}"
    inputs += [d_input] if d_input else []
    return "\n".join(["mixer product_class", "input " + ", ".join(inputs), f"S = {update}", "o = S^T q",
                      "allow unstable"]) + "\n"


@st.composite
def product_specs(draw):
    n = draw(st.integers(2, 4))
    erases = st.sampled_from(["comba", "delta", "negative"])
    steps = [draw(st.sampled_from(sorted(STEPS)))] + [draw(erases) for _ in range(n - 1)]
    return spec_text(draw(st.sampled_from(sorted(DECAYS))), steps)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(text=product_specs(), drawn=grad_cases(), strong=st.sampled_from([None, -1e4, -float("inf")]),
       where=st.integers(0, 69))
def test_random_product_specs_match_the_reference(text, drawn, strong, where):
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    assert mixer.ir.n_steps >= 2

    def edit(x):
        if strong is not None and "g" in x:
            x["g"][:, where % case.T] = strong
    out = check_case(mixer, case) if strong is None or "g" not in mixer.inputs else None
    assert out is None or out.ok, f"{out.message}\n{text}"
    errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1, edit=edit)
    how = repro(f"lrdsl.compile(text={text!r})", case, output_final_state, case.seed + 1)
    assert not failures, f"failing {describe(failures)}\nall: {describe(errors)}\nreproduce: {how}"


def test_the_generator_spans_the_class():
    """Every decay and step kind of the generator lowers to a product with that many steps, and
    prints back to the same IR."""
    from lrdsl.frontend import printer, spec_to_ir
    for decay in DECAYS:
        for steps in (["delta", "comba"], ["write", "comba", "negative"], ["comba", "delta", "negative", "delta"]):
            m = spec_to_ir(spec_text(decay, steps))
            assert m.n_steps == len(steps) and m.decay.kind == {"none": "identity"}.get(decay, decay)
            assert spec_to_ir(printer.explicit(m)) == m
            assert (m.delta is None) == (steps[0] == "write") and all(st.delta is not None for st in m.steps)
    e = None
    try:  # a step without erase after the first: its write joins the one before, a rank-2 write
        spec_to_ir(spec_text("scalar", ["delta", "write"]))
    except lrdsl.SpecError as err:
        e = err
    assert e is not None and "2 independent rank-1 terms" in str(e)
