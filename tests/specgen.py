"""Random axis-form spec texts for Hypothesis (decay x gain x precond x normalize), shared by the
kernel tests."""
import functools

from hypothesis import strategies as st

DECAYS = ("none", "constant", "scalar", "diagonal")
CONSTANTS = ("1 - 2^(-5 - h)", "0.9", "exp(-1/(h + 2))")
GAINS = ("none", "scalar (0, 1)", "scalar (0, 2)", "channelwise")
NAMES = ("g", "alpha", "gk", "beta", "b", "w", "gate", "a2", "g_atk", "beta_atk", "lam", "eta")


@st.composite
def axis_specs(draw):
    """Axis-form spec text: decay x gain x precond x normalize, with random (valid) input names."""
    decay = draw(st.sampled_from(DECAYS))
    gain = draw(st.sampled_from(GAINS))
    precond = draw(st.sampled_from(("none", "atk", "atq")))
    if precond == "atk" and gain == "scalar (0, 2)":  # m k up to 1.5 k: unstable (refused)
        gain = "scalar (0, 1)"
    normalize = draw(st.sampled_from(("", "q, k", "q, k, v")))
    names = iter(draw(st.permutations(NAMES)))
    lines = ["mixer fuzzed"]
    if decay == "constant":
        lines.append(f"decay constant {draw(st.sampled_from(CONSTANTS))}")
    elif decay == "none":
        lines.append("decay none")
    else:
        lines.append(f"decay {decay} {next(names)}")
    if gain == "none":
        lines.append("gain none")
    elif gain.startswith("scalar"):
        lines.append(f"gain scalar {next(names)} in {gain.split(' ', 1)[1]}")
    else:
        w_range = draw(st.sampled_from(("", " in [0, 1]", " in (0, 2)")))
        lines.append(f"gain channelwise {next(names)}, {next(names)}{w_range}")
    if precond != "none":
        opts = draw(st.sampled_from(("", ", x = 2, center = 0.5", ", x = 1.25")))
        lines.append(f"precond diagonal {precond}({next(names)}, {next(names)}{opts})")
    if normalize:
        lines.append(f"normalize {normalize}")
    return "\n".join(lines) + "\n"


@functools.cache  # six test modules ask at import: parse the examples once
def kernel_examples() -> tuple:
    """examples/*.lr of the general kernels (the offline solve's have their own: tests/test_mesa.py)."""
    from pathlib import Path

    from lrdsl.frontend import spec_to_ir
    root = Path(__file__).resolve().parent.parent / "examples"
    return tuple(sorted(p for p in root.glob("*.lr") if spec_to_ir(p.read_text()).solve_lam is None))


def rendered_ir(path):
    """The IR whose kernels a spec runs: a product of steps runs its one-step sub-mixer's."""
    import lrdsl
    m = lrdsl.compile(path, load_kernels=False)
    return m.product.ir if m.ir.steps else m.ir


def default_first(case_ids, default):
    """pytest params of a matrix of cases: `default` (the richest: packed sequences, grouped value
    heads, an initial state) runs in `pytest -q`, the others under `-m slow`, which CI also runs,
    so that every example (but REPEATED_KERNELS) meets every kernel in the default suite and every
    shape in CI."""
    import pytest
    assert default in case_ids
    return [pytest.param(c, marks=() if c == default else pytest.mark.slow) for c in case_ids]


# examples whose kernels are another example's but for a constant (gated_deltanet_negeig: gated_deltanet's
# with beta clamped at 2 instead of 1): their rows of the kernel matrices run under -m slow
REPEATED_KERNELS = {"gated_deltanet_negeig"}


def example_params(paths):
    """pytest params of the example specs of a kernel matrix, one id per stem: those in
    REPEATED_KERNELS under -m slow, the others in pytest -q."""
    import pytest
    return [pytest.param(p, id=p.stem, marks=pytest.mark.slow if p.stem in REPEATED_KERNELS else ())
            for p in paths]
