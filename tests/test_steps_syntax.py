"""Several update lines in a row (issue 40): the steps of a product written one after another,

    S = (I - b1 k k^T) exp(g) S + b1 k v^T
    S = (I - b2 k2 k2^T) S + b2 k2 v2^T

mean the nested form (each later line's S is the line above's result): the same IR, `lrdsl show`
prints the nested form, the kernels match the reference; every misuse is one error on its line."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_recurrent import DEVICE

import lrdsl
from lrdsl.errors import SpecError
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.testing import Case, check_case

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FIRST = "S = (I - b1 k k^T) exp(g) S + b1 k v^T"
LATER = ["S = (I - b2 k2 k2^T) S + b2 k2 v2^T", "S = (I - b3 k3 k3^T) S + b3 k3 v3^T"]


def sequential(name: str) -> str:
    """The example's spec with its nested update replaced by one line per step."""
    lines = (EXAMPLES / f"{name}.lr").read_text().splitlines()
    n = int(name[-1])
    head = [line for line in lines if not line.startswith(("S = ", "o = ", "#"))]
    assert len(head) < len(lines) - 1  # the example has its update and readout
    return "\n".join([*head, FIRST, *LATER[:n - 1], "o = S^T q"]) + "\n"


@pytest.mark.parametrize("name", ["delta_product2", "delta_product3"])
def test_sequential_lines_equal_the_nested_form(name, capsys):
    nested = (EXAMPLES / f"{name}.lr").read_text()
    text = sequential(name)
    assert text.count("\nS = ") == int(name[-1])
    m, want = spec_to_ir(text), spec_to_ir(nested)
    assert m == want and m.n_steps == int(name[-1])
    assert printer.explicit(m) == printer.explicit(want)
    assert printer.explicit(m).count("\nS = ") == 1  # printed back nested, on one line


def test_show_prints_the_nested_form(tmp_path, capsys):
    from lrdsl.cli import main
    path = tmp_path / "delta_product2.lr"
    path.write_text(sequential("delta_product2"))
    outs = []
    for p in (path, EXAMPLES / "delta_product2.lr"):
        assert main(["show", str(p)]) == 0
        outs.append(capsys.readouterr().out)
    explicit = outs[0].split("\n\n")[0]
    assert explicit == outs[1].split("\n\n")[0] and explicit.count("\nS = ") == 1
    assert "S = (I - (b2*k2) k2^T) ((I - (b1*k) k^T) exp(g) S" in explicit


def test_order_matters():
    """The lines apply in order: swapping the two steps (the decay stays on the first line) is a
    different mixer."""
    base = sequential("delta_product2")
    swapped = base.replace(FIRST + "\n" + LATER[0], "S = (I - b2 k2 k2^T) exp(g) S + b2 k2 v2^T\n"
                                                    "S = (I - b1 k k^T) S + b1 k v^T")
    assert swapped != base and spec_to_ir(swapped) != spec_to_ir(base)


def test_chunk_and_gradients_match_the_reference():
    """The sequential spelling compiled: chunk forward and every gradient against the float64
    reference, a tiny shape with an initial state."""
    mixer = lrdsl.compile(text=sequential("delta_product3").replace("delta_product3", "steps3"))
    assert mixer.ir.n_steps == 3
    out = check_case(mixer, Case(B=1, T=10, H=1, HV=1, K=16, V=8, initial_state=True, seed=11), DEVICE,
                     impls=["chunk"], grad=True)
    assert out.ok, out.message


# ---- errors: one sentence, on the line at fault ---------------------------------------------------
HEAD = ("mixer m\ninput q[K] l2norm, k[K] l2norm, k2[K] l2norm, v[V], v2[V], b1 in (0, 1), b2 in (0, 1), "
        "g log, gv[V] log\n")


@pytest.mark.parametrize("lines, line, words", [
    # a line after the readout, or apart from the others
    ([FIRST, "o = S^T q", LATER[0]], 5, "after the readout"),
    ([FIRST, "let z = 2 * b1", LATER[0], "o = S^T q"], 5, "stand in a row"),
    # S not used exactly once, or not linearly
    ([FIRST, "S = b2 k2 v2^T", "o = S^T q"], 4, "does not use S"),
    ([FIRST, "S = (I - b2 k2 k2^T) S + S + b2 k2 v2^T", "o = S^T q"], 4, "uses S 2 times"),
    ([FIRST, "S = S^T q", "o = S^T q"], 4, "not linear in S"),
    # a decay on a later line (one decay per token, on the first step), with or without an erase
    ([FIRST, "S = (I - b2 k2 k2^T) exp(g) S + b2 k2 v2^T", "o = S^T q"], 4, "step 2 of the product has a decay"),
    ([FIRST, "S = exp(g) S + b2 k2 v2^T", "o = S^T q"], 4, "step 2 of the product has a decay"),
    ([FIRST, LATER[0], "S = (I - b1 k k^T) exp(g) S + b1 k v^T", "o = S^T q"], 5, "step 3 of the product has a decay"),
    # not a step: no erase (a plain second update), no write, a value-side transition
    ([FIRST, "S = S + b2 k2 v2^T", "o = S^T q"], 4, "updated twice"),
    ([FIRST, "S = (I - b2 k2 k2^T) S", "o = S^T q"], 4, "step 2 of the product has no write"),
    ([FIRST, "S = S diag(exp(gv)) + b2 k2 v2^T", "o = S^T q"], 4, "value-side transition"),
    # an auxiliary state beside a product
    (["state P[K] = 0.5 * P + k", FIRST, LATER[0], "o = S^T (q * P)"], 5, "auxiliary states"),
])
def test_misuse_is_one_clear_error(lines, line, words):
    text = HEAD + "\n".join(lines) + "\n"
    with pytest.raises(SpecError) as e:
        spec_to_ir(text)
    err = e.value
    assert words in str(err) and err.span is not None and (err.span.line, err.span.column) == (line, 1), str(err)
    assert "\n" not in str(err)
    shown, caret = err.context().splitlines()
    assert shown.strip() == text.splitlines()[line - 1] and caret.strip().startswith("^")
