"""The staged backward that reads the inputs themselves (codegen/finite.py; issues 39 and 43).

Its kernels put the finite copy's fill in place of each bad entry as they load an input, so the
device-mode backward hands them the inputs, not runtime/nonfinite.py's copies, and makes the
forward's stages again with twins of its kernels that do the same. Checked here: no copy is made;
the gradients, with a nan, an inf or a -inf planted in each kind of input, are the copy path's
(nonfinite.FINITE_AT_LOAD = False) and the float64 reference's before the bad token; the forward's
kernels keep their bytes.
"""
import math
import re

import pytest
import torch
from test_decode import Launches
from test_nonfinite import spec_path, spoil
from test_nonfinite_backward import gradients
from test_recurrent import DEVICE

import lrdsl
from lrdsl.codegen import finite
from lrdsl.runtime import nonfinite, product, sub_chunk
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

CASE = Case(B=1, T=90, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 90), initial_state=True, seed=4)
ROW = 20 + 37  # inside the second sequence's first 64-token chunk
# planted entry: (input, value, every head and channel of the row or one entry). k nan: a key tile;
# v +inf: a value entry; beta nan: one number per token; g -inf: a reset (comba's g is `log`);
# beta +inf: clamped into [0, 1], so finite; q -inf: an l2-normalised query
PLANTS = {"k-nan": ("k", math.nan, True), "v-inf": ("v", math.inf, False), "beta-nan": ("beta", math.nan, True),
          "g-reset": ("g", -math.inf, True), "beta-clamped-inf": ("beta", math.inf, True),
          "q-minus-inf": ("q", -math.inf, False)}
# delta_product2: runtime/product.py's sub-tokens; kda_decay_after_erase: the split's staged spec
SPECS = ("comba", "gated_deltanet", "kda", "delta_product2", "kda_decay_after_erase")
# by default comba's three plants that the others do not take, a key channel and a gain; every pair
# under -m slow (the split's in-place loads by default: test_sub_token_routes_make_no_copies)
DEFAULT = {("comba", p) for p in ("g-reset", "beta-clamped-inf", "q-minus-inf")} | {
    ("kda", "k-nan"), ("delta_product2", "beta-nan")}
GAINS = {"delta_product2": "b2"}  # the spec's beta (the second step's)
# delta_product2 with one value head per key head: the sub-token kernels on each step's own tensors
# (runtime/sub_chunk.py's SubTokenChunk), which grouped value heads leave for the interleaved copy
CASES = {"delta_product2": Case(B=1, T=90, H=2, HV=2, K=16, V=16, cu_seqlens=(0, 20, 90), initial_state=True, seed=4)}


def plant(x, name, value, whole, row=ROW):
    return spoil(x, name, value, whole, row)


def both_paths(mixer, x, opts, do, monkeypatch):
    """The gradients of (nan_to_num(o) * do).sum() by the backward that reads the inputs and by the
    one on the finite copies."""
    out = []
    for at_load in (True, False):
        monkeypatch.setattr(nonfinite, "FINITE_AT_LOAD", at_load)
        out.append(gradients(mixer.chunk, x, opts, torch.float32, do))
    return out


def matrix():
    for s in SPECS:
        for p in PLANTS:
            if s in ("kda", "kda_decay_after_erase") and p == "g-reset":
                continue  # kda's g[K] is `log` too: the same reset, per channel
            yield pytest.param(s, p, marks=() if (s, p) in DEFAULT else pytest.mark.slow, id=f"{s}-{p}")


@pytest.mark.parametrize("stem,planted", matrix())
def test_gradients_are_the_copy_paths_and_the_references(stem, planted, compiled, monkeypatch):
    mixer = compiled(spec_path(stem), check_ranges=False)
    assert (mixer.product.kernels if mixer.product else mixer.split.kernels if mixer.split else mixer.kernels).FINITE_LOADS
    x, opts = draw_inputs(mixer, CASES.get(stem, CASE), DEVICE)
    steps = []
    real_run = sub_chunk.run  # the product's steps read in place (the split's route counts not)
    monkeypatch.setattr(sub_chunk, "run", lambda part, *a: (part is mixer.product and steps.append(1)) or real_run(part, *a))
    name, value, whole = PLANTS[planted]
    name = GAINS.get(stem, "beta") if name == "beta" else name
    spoiled = plant(x, name, value, whole)
    with torch.no_grad():
        ref_o = mixer.reference(**{n: t.double() for n, t in spoiled.items()},
                                **dict(opts, initial_state=opts["initial_state"].double()))[0]
    fin = torch.isfinite(ref_o)
    do = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    new, old = both_paths(mixer, spoiled, opts, do, monkeypatch)
    for n in old:
        assert torch.equal(torch.isnan(new[n]), torch.isnan(old[n])), f"d{n}: nan at other entries"
        f = torch.isfinite(old[n])
        assert torch.equal(f, torch.isfinite(new[n])), f"d{n}: inf at other entries"
        if f.any():
            assert rms_ratio(new[n][f], old[n][f]) < 1e-6, f"d{n} differs from the copy path's"
    assert bool(steps) == (stem in CASES)
    # and the float64 reference's (on the planted inputs, the loss masked to its finite outputs)
    # wherever that one is finite, before the planted row
    ref = gradients(mixer.reference, spoiled, opts, torch.float64, do * fin)
    for n, g in ref.items():
        a, b = (t if n == "h0" else t[0, :ROW] for t in (new[n], g))
        f = torch.isfinite(b)
        assert f.any() and torch.isfinite(a[f]).all(), f"d{n} not finite before the planted row"
        assert rms_ratio(a[f], b[f]) < 4 * TOL, f"d{n} against the reference"
    if planted not in ("g-reset", "beta-clamped-inf"):  # those are no bad entries: no nan anywhere
        at = new[name][0, ROW] if whole else new[name][0, ROW].reshape(-1)[3]
        assert torch.isnan(at).all(), "the planted entry's own gradient is not nan"
    else:
        assert all(torch.isfinite(g).all() for g in new.values())


def test_no_copies(compiled, monkeypatch):
    """No finite copy is made (nonfinite.device_copies, whose Triton pass writes one per input):
    the staged kernels, and the twins that make the forward's stages again, get the inputs
    themselves; nor where the forward kept its stages."""
    monkeypatch.setattr(nonfinite, "device_copies", lambda *a: pytest.fail("a finite copy was made"))
    mixer = compiled(spec_path("comba"), check_ranges=False)
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    x = plant(x, "k", math.nan, True)
    module = mixer.kernels
    seen = []
    real = module.chunk_bwd

    def spy(inputs, *a, **kw):
        seen.append((dict(inputs), a[5] if len(a) > 5 else kw.get("saved")))
        return real(inputs, *a, **kw)
    monkeypatch.setattr(module, "chunk_bwd", spy)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = mixer.chunk(**leaves, **opts)
    torch.nan_to_num(o).sum().backward()
    (inputs, st), = seen
    for n in module.INPUTS:  # the call's own tensors (contiguous already: no copy of them either)
        assert inputs[n].data_ptr() == leaves[n].data_ptr(), n
    n_in = len(module.INPUTS)
    assert [t.data_ptr() for t in st["args"][:n_in]] == [leaves[n].data_ptr() for n in module.INPUTS]
    assert torch.isnan(leaves["k"].grad[0, ROW]).all()

    # the forward kept its stages: a flag pass alone
    kept = compiled(spec_path("comba"), check_ranges=False, keep_intermediates=True)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = kept.chunk(**leaves, **opts)
    torch.nan_to_num(o).sum().backward()
    assert torch.isnan(leaves["k"].grad[0, ROW]).all() and torch.isfinite(leaves["k"].grad[0, :ROW]).all()


@pytest.mark.parametrize("stem", ["rwkv7", "delta_product2"])
def test_sub_token_routes_make_no_copies(stem, compiled, monkeypatch):
    """The split read in place and a product's steps read in place (runtime/sub_chunk.py) take the
    inputs themselves too: no interleaved copy, no finite copy; a planted nan's gradient is nan and
    the rows before it finite."""
    from lrdsl.codegen import split as codegen_split
    monkeypatch.setattr(nonfinite, "device_copies", lambda *a: pytest.fail("a finite copy was made"))
    monkeypatch.setattr(codegen_split, "interleave", lambda t: pytest.fail("the split interleaved"))
    monkeypatch.setattr(product, "sub_inputs", lambda *a: pytest.fail("the product interleaved"))
    mixer = compiled(spec_path(stem), check_ranges=False)
    case = CASES.get(stem, Case(B=1, T=90, H=2, HV=2, K=16, V=16, cu_seqlens=(0, 20, 90), initial_state=True, seed=7))
    x, opts = draw_inputs(mixer, case, DEVICE)
    x = plant(x, "k", math.nan, True)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = mixer.chunk(**leaves, **opts)
    torch.nan_to_num(o).sum().backward()
    assert torch.isnan(leaves["k"].grad[0, ROW]).all() and torch.isfinite(leaves["k"].grad[0, :ROW]).all()


def test_the_copy_path_still_copies(compiled, monkeypatch):
    """nonfinite.FINITE_AT_LOAD = False keeps the copies for the kernels (the path the gradients
    above are compared with is that one)."""
    mixer = compiled(spec_path("comba"), check_ranges=False)
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    seen = []
    real = mixer.kernels.chunk_bwd
    monkeypatch.setattr(mixer.kernels, "chunk_bwd", lambda inputs, *a, **kw: seen.append(dict(inputs)) or real(inputs, *a, **kw))
    monkeypatch.setattr(nonfinite, "FINITE_AT_LOAD", False)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = mixer.chunk(**leaves, **opts)
    o.sum().backward()
    assert all(seen[0][n].data_ptr() != leaves[n].data_ptr() for n in mixer.kernels.INPUTS)


@pytest.mark.parametrize("stem", ["comba", "gated_deltanet", "kda", "gla", "mamba2", "dplr", "rwkv7", "oja"])
def test_forward_functions_keep_their_bytes(stem):
    """Every function but the backward's own is the same text with the finite loads or without
    them (the twins, `<name>_finite`, are new); a staged backward has them."""
    from lrdsl.codegen import plan, render
    m = lrdsl.compile(spec_path(stem)).ir
    if m.steps:
        pytest.skip("a product: its sub-mixer's module")
    p = plan.plan(m)
    before, after = render.render(p, "v"), render.render(p, "v", finite.rules(m))
    old, new = finite._blocks(before), finite._blocks(after)
    backward = render.backward_functions(p, "v") if p.staged_backward else set()
    assert set(old) <= set(new)
    for n, (a, b) in old.items():
        if n not in backward:
            assert before[a:b] == after[new[n][0]:new[n][1]], f"{stem}: {n} changed"
    if p.staged_backward:
        assert "FINITE_LOADS = True" in after and "def _staged_states_finite(" in after
        # every load of an input in the backward's functions and in the twins is made finite
        made = [n for n in new if n in backward or n.endswith("_finite")]
        lines = "".join(after[new[n][0]:new[n][1]] for n in made).splitlines() + [""]
        loads = [i for i, ln in enumerate(lines) if "tl.load(in_" in ln]
        assert loads
        for i in loads:
            whole = re.match(r"\s*(\w+) = tl\.load\((in_\w+)", lines[i])
            assert "_finite_input(tl.load(in_" in lines[i] or (
                whole and re.match(rf"\s*{whole[1]} = _finite_input\({whole[1]}, {whole[2]}, ", lines[i + 1])), lines[i]
    else:
        assert after == before


def test_flags_and_fills_take_one_launch_per_group(compiled, monkeypatch):
    """The backward's read-only flag pass launches once for all five inputs of their two sizes
    (gated_deltanet: q, k, v of [B, T, H, K|V]; g, beta of [B, T, H]; once per size until
    2026-12-07) and the gradients' nan fill once for all five (after the solve's residual's zeroing,
    one more launch of the same kernel), where a launch per input made 11 of the backward's 23
    launches; a planted nan still gets its gradient's nan, and the token before it a finite one."""
    mixer = compiled(spec_path("gated_deltanet"))
    flags = Launches(nonfinite._flags_kernel, "COUNT")
    fills = Launches(nonfinite._fill_bad_group_kernel, "COUNT")
    monkeypatch.setattr(nonfinite, "_flags_kernel", flags)
    monkeypatch.setattr(nonfinite, "_fill_bad_group_kernel", fills)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=16, seed=9), DEVICE)
    with torch.no_grad():
        x["k"][0, 7, 0, 3] = math.nan
    for t in x.values():
        t.requires_grad_()
    o, _ = mixer.chunk(**x, **opts)
    torch.nan_to_num(o).sum().backward()
    assert flags.seen == [5] and fills.seen == [1, 5], (flags.seen, fills.seen)
    assert x["k"].grad[0, 7, 0, 3].isnan() and x["k"].grad[0, 6].isfinite().all()
