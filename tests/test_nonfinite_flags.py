"""The non-finite guard at no cost in clean chunks (common.jinja's nonfinite_helpers): the staged
kernels take plain products over every chunk, and a second, causal launch only over the chunks
flagged dirty. These cases mix clean and dirty chunks in one launch, and let finite inputs overflow
inside the kernels; a chunk before the first bad one must stay clean (else the fast path is lost
without any test failing) and every chunk from it on must be flagged.
"""
import functools

import pytest
import test_nonfinite
import torch
from test_nonfinite import (  # noqa: F401 (semantics: a fixture)
    check_causal,
    check_earlier_dq,
    semantics,
    spec_path,
    spoil,
)
from test_recurrent import DEVICE, general_kernels

import lrdsl
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

pytestmark = test_nonfinite.pytestmark + [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

BT = 64  # the staged chunk (codegen/plan.py's staged_chunk)
# a clean sequence of one chunk, then one of three; the bad token in the second one's second chunk
MIX = Case(B=1, T=242, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 50, 242), initial_state=True, seed=11)
MIX_ROW = 50 + BT + 21
MIX_CHUNKS = (2, 3)  # its chunk and the one after it, numbered over both sequences (4 in all)
# (mixer id, spec, compile options, bad input): the staged scalar and per-channel forwards with and
# without an erase, and ("-general") the general kernels (general_kernels), keeping their intermediates
MIXED = [("gated_deltanet-k-nan", "gated_deltanet", {}, "k-nan"),
         ("gated_deltanet-v-inf", "gated_deltanet", {}, "v-inf"),
         ("kda-g-nan", "kda", {}, "g-nan"),
         ("gla-v-inf", "gla", {}, "v-inf"),
         ("mamba2-k-nan", "mamba2", {}, "k-nan"),
         ("gated_deltanet-general-v-inf", "gated_deltanet", {"keep_intermediates": True}, "v-inf")]
SLOW_MIXED = {"gated_deltanet-v-inf", "mamba2-k-nan", "gated_deltanet-general-v-inf"}

# finite inputs whose write value overflows fp32 inside the kernels: exp(a) * v at a = 100 (the
# float64 reference stays finite, about 1e43)
OVERFLOW = {
    "gdn_exp": """mixer gdn_exp
input q[K] l2norm, k[K] l2norm, v[V]
input g log
input beta in (0, 1)
input a[V]
S = exp(g) (I - beta k k^T) S + beta k (exp(a) * v)^T
o = S^T q
""",
    "kda_exp": """mixer kda_exp
input q[K] l2norm, k[K] l2norm, v[V]
input g[K] log
input beta in (0, 1)
input a[V]
S = (I - beta k k^T) diag(exp(g)) S + beta k (exp(a) * v)^T
o = S^T q
""",
    "gla_exp": """mixer gla_exp
input q[K], k[K], v[V]
input g[K] log
input a[V]
S = diag(exp(g)) S + k (exp(a) * v)^T
o = S^T q
""",
    # the key overflows: reaches the backward's causal product over keys (dq)
    "linear_exp_key": """mixer linear_exp_key
input q[K], k[K], v[V]
input g log
input a[K]
S = exp(g) S + (exp(a) * k) v^T
o = S^T q
""",
}
OVER = Case(B=1, T=150, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 40, 150), initial_state=True, seed=12)
OVER_ROW = 40 + BT + 27  # inside the second sequence's second chunk
OVER_CHUNKS = (2,)  # its chunk, the sequence's last
# {"keep_intermediates": True}: the general kernels (general_kernels), keeping their intermediates
OVERFLOWED = [("gdn_exp", {}), ("kda_exp", {}), ("gla_exp", {}), ("gdn_exp", {"keep_intermediates": True})]


@functools.lru_cache(maxsize=None)
def _compiled_text(name, keep):
    return lrdsl.compile(text=OVERFLOW[name], check_ranges=False, keep_intermediates=keep)


class FlagSpy(test_nonfinite.FinitePoison):
    """FinitePoison that keeps each int32 matrix the module zeroes: the staged kernels' dirty flags
    [chunks, HV]."""
    made = []

    def zeros(self, *args, **kwargs):
        t = torch.zeros(*args, **kwargs)
        if t.dtype == torch.int32 and t.dim() == 2:
            FlagSpy.made.append(t)
        return t


def flags_of(monkeypatch):
    """FlagSpy in check_causal's place of FinitePoison; returns the list of flags it fills."""
    FlagSpy.made = []
    monkeypatch.setattr(test_nonfinite, "FinitePoison", FlagSpy)
    return FlagSpy.made


def expected_flags(n_chunks, HV, chunks, heads):
    want = torch.zeros(n_chunks, HV, dtype=torch.int32)
    for c in chunks:
        want[c, list(heads)] = 1
    return want


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
@pytest.mark.parametrize("mixer_id,stem,options,bad", [
    pytest.param(*m, marks=pytest.mark.slow if m[0] in SLOW_MIXED else (), id=m[0]) for m in MIXED])
def test_one_dirty_chunk_among_clean_ones(mixer_id, stem, options, bad, semantics, compiled, monkeypatch):
    mixer = compiled(spec_path(stem), check_ranges=False, **options)
    if "-general" in mixer_id:
        general_kernels(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, MIX, DEVICE)
    name, value, whole = test_nonfinite.BAD[bad]
    made = flags_of(monkeypatch)
    check_causal(mixer, spoil(x, name, value, whole, MIX_ROW), opts, MIX_ROW, monkeypatch, mixer_id)
    if "-general" in mixer_id:  # no flags: the general kernels check their products (_guarded_dot)
        assert not made
        return
    assert len(made) == 1, f"{mixer_id}: {len(made)} flag matrices"
    # a whole bad token reaches both value heads (one key head); one bad entry of v its own head
    heads = (0, 1) if whole or x[name].shape[2] != MIX.HV else (0,)
    want = expected_flags(4, MIX.HV, MIX_CHUNKS, heads)
    assert torch.equal(made[0].cpu(), want), f"{mixer_id}: flags {made[0].tolist()}, not {want.tolist()}"


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
@pytest.mark.parametrize("name,options", OVERFLOWED,
                         ids=[n + ("-general" if o else "") for n, o in OVERFLOWED])
def test_overflow_of_finite_inputs_reaches_no_earlier_token(name, options, semantics, monkeypatch):
    """a = 100 in one value channel of one token: exp(a) v is inf in fp32 there (finite inputs). The
    tokens before it match the float64 reference; from it on the kernels overflowed."""
    mixer = _compiled_text(name, bool(options))
    if options:
        general_kernels(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, OVER, DEVICE)
    x = spoil(x, "a", 100.0, False, OVER_ROW)
    made = flags_of(monkeypatch)
    poison = FlagSpy()
    monkeypatch.setattr(mixer.kernels, "torch", poison)
    with torch.no_grad():
        o, _ = mixer.chunk(**x, **opts)
    h0 = opts["initial_state"]
    ref_o, _ = mixer.reference(**{n: t.double() for n, t in x.items()}, **dict(opts, initial_state=h0.double()))
    assert torch.isfinite(ref_o).all()
    assert not torch.isfinite(o[0, OVER_ROW:]).all(), f"{name}: nothing overflowed"
    before = o[0, :OVER_ROW]
    assert torch.isfinite(before).all(), f"{name}: the overflow reached a token before it"
    err = rms_ratio(before, ref_o[0, :OVER_ROW])
    assert err < TOL, f"{name}: rms ratio {err:.3g} before the overflow"
    if options:
        assert not made
        return
    assert len(made) == 1 and torch.equal(made[0].cpu(), expected_flags(3, OVER.HV, OVER_CHUNKS, (0,))), \
        f"{name}: flags {[m.tolist() for m in made]}"


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
def test_overflowing_key_leaves_earlier_dq(semantics):
    """The staged backward's dq is causal in the keys: a key that overflows fp32 (exp(a) k, a = 100)
    at token t leaves dq of the tokens before it as the float64 reference has them."""
    mixer = _compiled_text("linear_exp_key", False)
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, seed=4)
    x, opts = draw_inputs(mixer, case, DEVICE)
    row = 37
    x = spoil(x, "a", 100.0, True, row)
    check_earlier_dq(mixer, x, opts, case, row, "an overflowing key")


@pytest.mark.parametrize("semantics", ["gpu"], indirect=True)
def test_dirty_chunk_of_a_later_batch_row(semantics, compiled, monkeypatch):
    """Without packed sequences, inf in v of the second sequence's second chunk (one head): the
    output stage's causal launch finds that (chunk, head) pair among all (sequence-major) and
    leaves the chunk's tokens before it, and every other sequence and head, as the reference."""
    mixer = compiled(spec_path("gated_deltanet"), check_ranges=False)
    x, opts = draw_inputs(mixer, Case(B=2, T=150, H=1, HV=2, K=16, V=16, initial_state=True, seed=13), DEVICE)
    v = x["v"].clone()
    v[1, BT + 21, 1, 3] = float("inf")
    x = dict(x, v=v)
    monkeypatch.setattr(mixer.kernels, "torch", test_nonfinite.FinitePoison())
    with torch.no_grad():
        o, _ = mixer.chunk(**x, **opts)
    h0 = opts["initial_state"]
    ref_o, _ = mixer.reference(**{n: t.double() for n, t in x.items()}, **dict(opts, initial_state=h0.double()))
    fin = torch.isfinite(ref_o)
    assert torch.isfinite(ref_o[1, :BT + 21]).all() and not fin[1, BT + 21:, 1].all()
    assert torch.equal(torch.isfinite(o), fin), f"finite at {(torch.isfinite(o) != fin).nonzero()[:4].tolist()}"
    err = rms_ratio(o[fin], ref_o[fin])
    assert err < TOL, f"rms ratio {err:.3g} over the finite entries"
