"""Causality for non-finite inputs in the backward (issue 42): a nan or inf at token t leaves the
gradient of every input at every token before t (and of the initial state, and of every other
sequence) as the float64 reference has it.

The loss is torch.nan_to_num(o) * do summed: its gradient is zero at the outputs the forward left
non-finite, so it depends only on the finite ones. Its float64 reference is taken on the clean
inputs (the bad entry as drawn) with do masked to the outputs the reference leaves finite on the
spoiled ones: the gradient at a token before t does not depend on the value at t, and on the
spoiled inputs the reference's own autograd has 0 * nan at the bad token's terms, nan at every
earlier token for a bad decay, key or gain (where it is finite, it is the clean one: checked).
The kernels' gradient at the bad entry itself is nan (runtime/nonfinite.py).
"""
import math

import pytest
import torch
from test_nonfinite import BAD, semantics, spec_path, spoil  # noqa: F401 (semantics: a fixture)
from test_recurrent import DEVICE, general_kernels

import lrdsl
from lrdsl.testing import GATE_GRAD_FACTOR, TOL, Case, draw_inputs, rms_ratio

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

# mixer id: (spec, compile options); "-general": the general kernels (general_kernels)
MIXERS = {
    "gated_deltanet": ("gated_deltanet", {}),  # staged, an erase, a decay per token
    "kda": ("kda", {}),  # staged, a decay per key channel (stage 4's pairs)
    "gla": ("gla", {}),
    "mamba2": ("mamba2", {}),
    "gdn2_atk": ("gdn2_atk", {}),  # an auxiliary state: its reverse scan in the chain rule
    "kda_decay_after_erase": ("kda_decay_after_erase", {}),  # the split
    "gated_deltanet-general": ("gated_deltanet", {"keep_intermediates": True}),
    "mesa": ("mesa", {}),  # the offline solve's own backward
}
ALL_BAD = dict(BAD, **{"q-nan": ("q", math.nan, True), "beta-nan": ("beta", math.nan, True)})
# pytest -q: a bad decay or key through the staged, general and offline-solve backwards; -m slow
# the rest (a bad query through an auxiliary state's reverse scan among them)
DEFAULT = {("gated_deltanet", "g-nan"), ("gated_deltanet-general", "k-nan"), ("mesa", "g-nan")}
CASE = Case(B=1, T=90, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 90), initial_state=True, seed=4)
ROW = 20 + 37  # inside the second sequence's first 64-token chunk


def matrix():
    for m, (stem, _) in MIXERS.items():
        for b, (name, _, _) in ALL_BAD.items():
            if name == "beta" and stem in ("gla", "mamba2", "gdn2_atk"):
                continue  # no such input
            yield pytest.param(m, b, marks=() if (m, b) in DEFAULT else pytest.mark.slow, id=f"{m}-{b}")


def gradients(fn, x, opts, dtype, do):
    """Every input's gradient and the initial state's, of (nan_to_num(o) * do).sum()."""
    leaves = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"].detach().to(dtype).clone().requires_grad_()
    o, _ = fn(**leaves, **dict(opts, initial_state=h0))
    (torch.nan_to_num(o, nan=0.0, posinf=0.0, neginf=0.0) * do.to(dtype)).sum().backward()
    return {**{n: t.grad for n, t in leaves.items()}, "h0": h0.grad}


def earlier(name, g):
    """The entries of input `name`'s gradient at every token of the first sequence and at the
    tokens of the second before the bad one (the initial state's: whole)."""
    return g if name == "h0" else g[0, :ROW]


def check_earlier_gradients(mixer, x, opts, bad, label):
    name, value, whole = ALL_BAD[bad]
    spoiled = spoil(x, name, value, whole, ROW)
    with torch.no_grad():
        ref_o = mixer.reference(**{n: t.double() for n, t in spoiled.items()},
                                **dict(opts, initial_state=opts["initial_state"].double()))[0]
    fin = torch.isfinite(ref_o)
    assert fin[0, :ROW].all() and not fin[0, ROW:].all(), label
    do = torch.randn(ref_o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    ref = gradients(mixer.reference, x, opts, torch.float64, do * fin)
    got = gradients(mixer.chunk, spoiled, opts, torch.float32, do)
    # the target is the reference's on the spoiled inputs wherever that one is finite
    ref_spoiled = gradients(mixer.reference, spoiled, opts, torch.float64, do)
    for n, g in ref.items():
        a, b = earlier(n, ref_spoiled[n]), earlier(n, g)
        f = torch.isfinite(a)
        assert torch.allclose(a[f], b[f], rtol=1e-9, atol=1e-12), f"{label}: d{n} of the two references"
    for n, g in ref.items():
        mine = earlier(n, got[n])
        assert torch.isfinite(mine).all(), f"{label}: d{n} not finite before the bad token"
        err = rms_ratio(mine, earlier(n, g))
        limit = TOL if n in ("q", "k", "v", "h0") else GATE_GRAD_FACTOR * TOL
        assert err < limit, f"{label}: d{n} rms ratio {err:.3g} before the bad token"
    at = got[name][0, ROW] if whole else got[name][0, ROW].reshape(-1)[3]
    assert torch.isnan(at).all(), f"{label}: the bad entry's own gradient is not nan"


@pytest.mark.parametrize("mixer_id,bad", matrix())
def test_nonfinite_input_leaves_every_earlier_gradient(mixer_id, bad, compiled, monkeypatch):
    stem, options = MIXERS[mixer_id]
    mixer = compiled(spec_path(stem), check_ranges=False, **options)
    if mixer_id.endswith("-general"):
        general_kernels(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    check_earlier_gradients(mixer, x, opts, bad, f"{mixer_id} {bad}")


# the general backward's gradients of a pairwise sum's rows (dq: r's) are products over the key
# tokens, causal as the forward's: a key that overflows fp32 inside the kernels (exp(a) k at
# a = 100, finite inputs) at token t leaves them exact before t. A decay per token (tensor-core
# products) and per key channel (sums by key channel).
OVERFLOWING_KEY = {
    "scalar": "mixer key_exp\ninput q[K], k[K], v[V], g log, a[K]\nS = exp(g) S + (exp(a) * k) v^T\no = S^T q\n",
    "diagonal": "mixer key_exp_diag\ninput q[K], k[K], v[V], g[K] log, a[K]\n"
                "S = diag(exp(g)) S + (exp(a) * k) v^T\no = S^T q\n",
}


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
@pytest.mark.parametrize("decay", list(OVERFLOWING_KEY))
def test_overflowing_key_leaves_earlier_dq_of_the_general_backward(decay, semantics, monkeypatch):
    from test_nonfinite import check_earlier_dq
    mixer = general_kernels(lrdsl.compile(text=OVERFLOWING_KEY[decay], check_ranges=False,
                                          keep_intermediates=True), monkeypatch)
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, seed=4)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x = spoil(x, "a", 100.0, True, 37)
    check_earlier_dq(mixer, x, opts, case, 37, f"an overflowing key, a {decay} decay")


# The staged backward's like test, where stage 3 splits (plan.split_dr): the gain exp(a) b
# overflows fp32 at token 37 (a = 100, finite inputs), so u there is infinite and its chunk is
# flagged dirty; staged_dr's dirty branch (_causal_dot) keeps r's gradient exact before it (a plain
# product gives 0 * inf = nan there)
OVERFLOWING_GAIN = ("mixer gain_exp\ninput q[K] l2norm, k[K] l2norm, v[V], g log, b in [0, 1], a\nallow unstable\n"
                    "S = exp(g) (I - (b * exp(a)) k k^T) S + (b * exp(a)) k v^T\no = S^T q\n")


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
def test_overflowing_gain_leaves_earlier_dq_of_the_split_staged_backward(semantics, compiled):
    from test_nonfinite import check_earlier_dq

    from lrdsl.codegen.plan import plan
    mixer = compiled(None, text=OVERFLOWING_GAIN, check_ranges=False)
    assert plan(mixer.ir).split_dr and hasattr(mixer.kernels, "staged_dr_kernel")
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, seed=4)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x = spoil(x, "a", 100.0, True, 37)
    check_earlier_dq(mixer, x, opts, case, 37, "an overflowing gain, the split staged backward")


def test_a_clean_batch_takes_the_backward_as_given(monkeypatch):
    """The host-checked guard (MODE "host"): no non-finite entry, so the backward runs on the call's
    own tensors and the forward's kept intermediates (no copies), one check of the inputs."""
    from lrdsl.runtime import nonfinite
    monkeypatch.setattr(nonfinite, "MODE", "host")
    calls = []
    monkeypatch.setattr(nonfinite, "finite_copies", lambda *a: calls.append(a))
    mixer = lrdsl.compile(spec_path("gated_deltanet"), keep_intermediates=True)
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=1, K=16, V=16, initial_state=True, seed=3), DEVICE)
    x["g"][0, 5] = -math.inf  # a reset, floored by the kernels: not a bad entry
    x["beta"][0, 6] = math.inf  # clamped into (0, 1)
    g = gradients(mixer.chunk, x, opts, torch.float32, torch.ones(1, 20, 1, 16, device=DEVICE))
    assert not calls and all(torch.isfinite(t).all() for t in g.values())


@pytest.mark.parametrize("keep", [False, True])
def test_the_device_guard_leaves_a_clean_batch_as_the_host_guard(keep, monkeypatch):
    """The guard on the device (MODE "device", the default: finite copies, the kept intermediates'
    non-finite entries zeroed, nan put back) gives a clean batch, resets and clamped infinities among
    it, the very gradients the host-checked one gives (which takes the call's own tensors)."""
    from lrdsl.runtime import nonfinite
    mixer = lrdsl.compile(spec_path("gated_deltanet"), keep_intermediates=keep)
    x, opts = draw_inputs(mixer, Case(B=1, T=70, H=1, HV=1, K=16, V=16, initial_state=True, seed=8), DEVICE)
    x["g"][0, 5] = -math.inf  # a reset, floored by the kernels: not a bad entry
    x["beta"][0, 66] = math.inf  # clamped into (0, 1)
    do = torch.randn(1, 70, 1, 16, device=DEVICE)
    got = {}
    for mode in ("host", "device"):
        monkeypatch.setattr(nonfinite, "MODE", mode)
        got[mode] = gradients(mixer.chunk, x, opts, torch.float32, do)
    for n, g in got["host"].items():
        assert torch.isfinite(g).all() and torch.equal(got["device"][n], g), n


@pytest.mark.parametrize("mixer_id", ["gated_deltanet-general", pytest.param("mesa", marks=pytest.mark.slow)])
def test_general_and_offline_kernels_take_causal_products_only_in_a_bad_chunk(mixer_id, monkeypatch):
    """The general and offline-solve forwards take plain products over the chunk's tokens, and the
    causal ones (_causal_dot) only where a plain one is not finite (common.jinja's _guarded_dot): none
    for clean inputs, and some with a nan key, which leave the tokens before it as the reference."""
    from test_nonfinite import check_causal
    stem, options = MIXERS[mixer_id]
    mixer = lrdsl.compile(spec_path(stem), check_ranges=False, **options)
    if mixer_id.endswith("-general"):
        general_kernels(mixer, monkeypatch)
    calls = []
    causal = mixer.kernels._causal_dot

    def counted(*args):
        calls.append(1)
        return causal(*args)
    monkeypatch.setattr(mixer.kernels, "_causal_dot", counted)
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, initial_state=True, seed=6)
    x, opts = draw_inputs(mixer, case, DEVICE)
    with torch.no_grad():
        mixer.chunk(**x, **opts)
    assert not calls, f"{mixer_id}: {len(calls)} causal products for clean inputs"
    check_causal(mixer, spoil(x, "k", math.nan, True, 70), opts, 70, monkeypatch, mixer_id)
    assert calls, f"{mixer_id}: no causal product with a nan key"


def test_device_copies_flags_and_nan_at(compiled):
    """The device guard's kernels on gated_deltanet's inputs: q (no range: any non-finite entry is
    bad), g (a log-decay: -inf is a reset), beta (clamped into (0, 1): +-inf is clamped); the copy
    has the range's fill at the bad entries only, each input's flag says whether it has any
    non-finite entry, and the gradients get nan at the bad entries only."""
    from lrdsl.runtime import nonfinite
    mixer = compiled(spec_path("gated_deltanet"))
    inf, nan = math.inf, math.nan
    q = torch.tensor([1.0, nan, -inf, 2.0], dtype=torch.bfloat16, device=DEVICE)
    g = torch.tensor([-1.0, -inf, nan, 0.0], device=DEVICE)
    beta = torch.tensor([0.5, inf, -inf, 0.25], dtype=torch.bfloat16, device=DEVICE)
    v = torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16, device=DEVICE)
    names, tensors = ["q", "g", "beta", "v"], [q, g, beta, v]
    copies, flags = nonfinite.device_copies(mixer.ir, names, tensors)
    fill_g = -1.0  # a log-decay's range is (-inf, 0]: hi - 1
    want = [[1.0, 0.0, 0.0, 2.0], [-1.0, -inf, fill_g, 0.0], [0.5, inf, -inf, 0.25], [3.0, 4.0, 5.0, 6.0]]
    for n, c, w, t in zip(names, copies, want, tensors):
        assert c.dtype == t.dtype and c.tolist() == w, n
    assert [int(f) for f in flags] == [1, 1, 1, 0]
    grads = nonfinite.device_nan_at(mixer.ir, names, tensors, [torch.ones_like(t) for t in tensors], flags)
    isnan = [[False, True, True, False], [False, False, True, False], [False] * 4, [False] * 4]
    for n, gr, w in zip(names, grads, isnan):
        assert torch.isnan(gr.float()).tolist() == w, n


def test_flag_gated_kernels_stride_over_every_block(compiled, monkeypatch):
    """nan_at and the residual's zeroing run a bounded grid that strides (nonfinite._flag_grid):
    with two programs over five blocks and a partial sixth, bad entries in the first, fourth and
    last block get nan in the gradient (zero in the residual) and nothing else changes; with the
    flags clear nothing is written at all."""
    from lrdsl.runtime import nonfinite
    monkeypatch.setattr(nonfinite, "FLAG_PROGRAMS", 2)
    mixer = compiled(spec_path("gated_deltanet"))
    n = 5 * nonfinite.BLOCK + 37
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, generator=gen).to(DEVICE)
    where = [5, 3 * nonfinite.BLOCK + 1, n - 1]
    q[where] = math.nan
    _, flags = nonfinite.device_copies(mixer.ir, ["q"], [q])
    assert int(flags[0]) == 1
    grad = torch.randn(n, generator=gen).to(DEVICE)
    want = grad.clone()
    want[where] = math.nan
    got, = nonfinite.device_nan_at(mixer.ir, ["q"], [q], [grad.clone()], flags)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got[~torch.isnan(want)], want[~torch.isnan(want)])
    residual = q.clone()
    zeroed = nonfinite.zero_nonfinite_(residual, flags[0])
    assert torch.equal(zeroed, torch.nan_to_num(q, nan=0.0))
    clean = torch.zeros((), dtype=torch.int32, device=DEVICE)
    untouched = nonfinite.device_nan_at(mixer.ir, ["q"], [q], [grad.clone()], [clean])[0]
    assert torch.equal(untouched, grad)
    kept = q.clone()
    assert torch.equal(torch.isnan(nonfinite.zero_nonfinite_(kept, clean)), torch.isnan(q))


# -inf in an input that is a log-decay itself but not declared `log` (no range, or (-inf, 0]):
# exp(-inf) = 0 is a reset, and the float64 reference's gradients are finite everywhere. The guard
# took it for a bad entry and ran the backward on a finite fill (a decay near 1, not 0): every
# gradient came out finite and wrong (rms ratio 0.04 to 1.3) and the decay's own nan (measured
# 2026-12-06, before runtime/nonfinite.resets)
UNDECLARED_DECAY = {
    "scalar": "mixer s\nallow unstable\ninput q[K] l2norm, k[K] l2norm, v[V], b in (0, 1), g\n"
              "S = (I - b k k^T) exp(g) S + b k v^T\no = S^T q\n",
    "scalar-nonpositive": "mixer s\ninput q[K] l2norm, k[K] l2norm, v[V], b in (0, 1), g in (-inf, 0]\n"
                          "S = (I - b k k^T) exp(g) S + b k v^T\no = S^T q\n",
    "diagonal": "mixer d\nallow unstable\ninput q[K], k[K], v[V], g[K]\nS = diag(exp(g)) S + k v^T\no = S^T q\n",
    # an auxiliary state's decay (gdn2_atk's preconditioner, its g declared (-inf, 0], not log)
    "auxiliary": "mixer a\ninput q[K] l2norm, k[K] l2norm, v[V], d[K] log, g shared in (-inf, 0], c shared in (0, 1)\n"
                 "state p[K] = c*k^2 + p*exp(g)\nlet m = squash(p, x = 3/2, center = -1/5)\n"
                 "S = (I - (k*m) k^T) diag(exp(d)) S + (k*m) v^T\no = S^T q\n",
}
# (T, the rows at -inf): one token inside a 16-token block; a whole 16-token block inside a chunk
RESET_ROWS = {"token": (40, [13]), "block": (80, list(range(16, 32)))}


# mode: the guard's ("device", "host"), or "general": the general kernels (keep_intermediates)
@pytest.mark.parametrize("mode", ["device", pytest.param("host", marks=pytest.mark.slow),
                                  pytest.param("general", marks=pytest.mark.slow)])
@pytest.mark.parametrize("rows", list(RESET_ROWS))
@pytest.mark.parametrize("decay", list(UNDECLARED_DECAY))
def test_minus_inf_in_an_undeclared_log_decay_is_a_reset(decay, rows, mode, monkeypatch):
    from lrdsl.runtime import nonfinite
    monkeypatch.setattr(nonfinite, "MODE", "host" if mode == "host" else "device")
    mixer = lrdsl.compile(text=UNDECLARED_DECAY[decay], check_ranges=False, keep_intermediates=mode == "general")
    if mode == "general":
        general_kernels(mixer, monkeypatch)
    T, at = RESET_ROWS[rows]
    x, opts = draw_inputs(mixer, Case(B=1, T=T, H=1, HV=1, K=16, V=16, initial_state=True, seed=11), DEVICE)
    gen = torch.Generator().manual_seed(12)
    g = -torch.nn.functional.softplus(torch.randn(x["g"].shape, generator=gen)) - 0.05  # decays in (0, 0.95)
    if "d" in x:
        x["d"] = -torch.nn.functional.softplus(torch.randn(x["d"].shape, generator=gen)).to(DEVICE)
    g[0, at] = -math.inf
    x["g"] = g.to(DEVICE)
    do = torch.randn(1, T, 1, 16, generator=gen, dtype=torch.float64).to(DEVICE)
    ref = gradients(mixer.reference, x, opts, torch.float64, do)
    assert all(torch.isfinite(t).all() for t in ref.values())  # nothing for the guard to spoil
    got = gradients(mixer.chunk, x, opts, torch.float32, do)
    for n, t in ref.items():
        assert torch.isfinite(got[n]).all(), f"{decay} {rows}: d{n} not finite"
        err = rms_ratio(got[n], t)
        limit = TOL if n in ("q", "k", "v", "h0") else GATE_GRAD_FACTOR * TOL
        assert err < limit, f"{decay} {rows}: d{n} rms ratio {err:.3g}"


@pytest.mark.parametrize("bad_at", ["none", "first", "last", "every_other"])
def test_device_flags_of_inputs_of_many_sizes_in_one_launch(bad_at, compiled, monkeypatch):
    """nonfinite.device_flags puts inputs of any sizes in one launch (their blocks one after the
    other on the grid), eight at most: ten inputs of sizes across block boundaries (1 entry up to
    two blocks and a part) take two launches, and each flag is set exactly where its input has a
    nan or an infinite entry, wherever that entry sits in the input's blocks (its first entry, or
    its last, in the block the grid reaches last for it)."""
    from test_decode import Launches

    from lrdsl.runtime import nonfinite
    mixer = compiled(spec_path("gated_deltanet"))
    launches = Launches(nonfinite._flags_kernel, "COUNT")
    monkeypatch.setattr(nonfinite, "_flags_kernel", launches)
    B = nonfinite.BLOCK
    sizes = [1, B - 1, B, B + 1, 2 * B + 37, 3, 17, B // 2, 2 * B, 5]
    gen = torch.Generator().manual_seed(len(bad_at))
    tensors = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]
    bad = {"none": [], "first": [0, 3, 9], "last": [1, 4, 8], "every_other": list(range(0, 10, 2))}[bad_at]
    for i in bad:
        t = tensors[i]
        t[0 if bad_at == "first" else -1] = [math.nan, math.inf, -math.inf][i % 3]
    names = ["q"] * len(tensors)
    flags = nonfinite.device_flags(mixer.ir, names, tensors)
    assert launches.seen == [8, 2]
    assert [int(f) for f in flags] == [int(i in bad) for i in range(len(tensors))]


def test_any_flag_of_one_buffers_entries_and_of_separate_flags():
    """nonfinite.any_flag: set where any flag is, for the entries of one buffer (device_flags'; read
    as the buffer's own maximum) and for separate 0-dim flags; None without flags."""
    from lrdsl.runtime import nonfinite
    for set_at in (None, 0, 2):
        buf = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        if set_at is not None:
            buf[set_at] = 1
        views = [buf[0], None, buf[1], buf[2]]
        separate = [v.clone() for v in views if v is not None]
        want = int(set_at is not None)
        assert int(nonfinite.any_flag(views)) == want and int(nonfinite.any_flag(separate)) == want
        assert int(nonfinite.any_flag([buf[0], buf[1]])) == int(set_at == 0)  # a part of the buffer
    assert nonfinite.any_flag([None, None]) is None
