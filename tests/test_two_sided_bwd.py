"""The two-sided transition's backward kernel (templates/chunk_two_sided_bwd.py.jinja, issue 40):
the gradients of per_token's vectors (M's gk, ak, ck; N's g, alpha, gam; u, z, q) and of the
initial state against float64 autograd through a token loop over the same vectors, whose forward is
checked against the reference; each order of M beside each order of N (left, right, sum, none),
decay kinds on each side (none, per head, per channel); packed sequences with an empty one, grouped
value heads (HV = 2 H), h0 and dht, and log-decays of -1e4 and -inf on single tokens and whole
chunks on either side. End to end (the inputs' gradients through per_token) against the reference,
a non-finite input leaving the earlier tokens' gradients the reference's, chunk no longer running
the reference's token loop, and the written module's chunk (the token loop's forward)."""
from __future__ import annotations

import itertools
import re

import pytest
import torch
from test_dplr import against_reference, failing, tiered
from test_recurrent import DEVICE
from test_value_bwd import compare_vector_grads, earlier_gradients_match
from test_value_bwd import vectors64 as value_vectors64

import lrdsl
from lrdsl.runtime import reference, two_sided
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

# M's forms (left of S) and N's (right of S): name -> (as written, decay kind, order of the erase)
M_FORMS = {
    "left": ("(I - beta k k^T) diag(exp(g))", "diagonal", "left"),
    "right": ("diag(exp(g)) (I - beta k k^T)", "diagonal", "right"),
    "sum": ("(diag(exp(g)) - (a*kk) kk^T)", "diagonal", "sum"),
    "none": ("diag(exp(g))", "diagonal", None),
    "scalar": ("exp(s) (I - beta k k^T)", "scalar", "left"),
    "no_decay": ("(I - beta k k^T)", "identity", "left"),
}
N_FORMS = {
    "left": ("(I - beta v v^T) diag(exp(gv))", "diagonal", "left"),
    "right": ("diag(exp(gv)) (I - beta v v^T)", "diagonal", "right"),
    "sum": ("(diag(exp(gv)) - (b*vv) vv^T)", "diagonal", "sum"),
    "none": ("diag(exp(gv))", "diagonal", None),
    "no_decay": ("(I - beta v v^T)", "identity", "left"),
}
ORDERS = ("left", "right", "sum", "none")
INPUTS = {"g": "g[K] log", "s": "s log", "gv": "gv[V] log", "beta": "beta in (0, 1)",
          "a": "a[K] in [0, 1]", "kk": "kk[K] l2norm", "b": "b[V] in [0, 1]", "vv": "vv[V] l2norm"}
# packed sequences with an empty one, grouped value heads, K and V not powers of two
CASE = Case(B=1, T=53, H=1, HV=2, K=12, V=10, cu_seqlens=(0, 17, 17, 53), initial_state=True, seed=3)
BATCHED = Case(B=2, T=40, H=1, HV=2, K=16, V=8, initial_state=True, scale=0.6, seed=4)


def spec_text(m_form: str, n_form: str) -> str:
    body = f"{M_FORMS[m_form][0]} S {N_FORMS[n_form][0]}"
    used = [d for n, d in INPUTS.items() if n == "beta" or re.search(rf"\b{n}\b", body)]
    return (f"mixer tsb\ninput q[K], k[K] l2norm, v[V] l2norm, {', '.join(used)}\nS = {body} + beta k v^T\n"
            "o = S^T q\nallow unstable\n")


_MIXERS = {}


def mixer(m_form: str, n_form: str):
    key = (m_form, n_form)
    if key not in _MIXERS:
        m = lrdsl.compile(text=spec_text(*key), check_stability=False)
        assert m.ir.side == "both"
        assert (m.ir.decay.kind, m.ir.delta.order if m.ir.delta else None) == M_FORMS[m_form][1:]
        assert (m.ir.n_decay.kind, m.ir.n_delta.order if m.ir.n_delta else None) == N_FORMS[n_form][1:]
        _MIXERS[key] = m
    return _MIXERS[key]


def vectors64(m, x, opts):
    """two_sided.per_token's vectors of inputs x in float64, and the batch they were made from."""
    return value_vectors64(m, x, opts, two_sided.per_token)


def loop64(p, h0, sequences):
    """The float64 oracle, token by token over p's vectors [B, T, HV, w] (B = 1 where packed):
    Y = X D - (X alpha) gam^T, S_t = E Y - ak (ck^T Y) + u z^T, o_t = S_t^T q_t; o and the final states."""
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(sequences):
        S = h0[n]  # [HV, K, V]
        for t in range(bos, eos):
            at = {k: v[b, t] for k, v in p.items()}
            Y = S * at["g"].exp()[:, None, :] - torch.einsum("hkv,hv->hk", S, at["alpha"])[:, :, None] * at["gam"][:, None, :]
            S = (Y * at["gk"].exp()[:, :, None] - at["ak"][:, :, None] * torch.einsum("hkv,hk->hv", Y, at["ck"])[:, None, :]
                 + at["u"][:, :, None] * at["z"][:, None, :])
            outs.append(torch.einsum("hkv,hk->hv", S, at["q"]))
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


def check_vectors(m, x, opts, BT=16, with_dht=True):
    """two_sided_chunk_bwd's vector gradients against float64 autograd through loop64."""
    return compare_vector_grads(m, x, opts, vectors64, loop64, with_dht, 12,
                                lambda k, *a: k.two_sided_chunk_bwd(*a, BT=BT))


PAIRS = list(itertools.product(ORDERS, ORDERS))


@pytest.mark.parametrize("m_form, n_form", tiered(PAIRS, [("left", "right"), ("sum", "sum")]))
def test_vector_gradients_every_order(m_form, n_form):
    """Each order of M beside each order of N, packed with an empty sequence, HV = 2 H, h0 and dht."""
    m = mixer(m_form, n_form)
    x, opts = draw_inputs(m, CASE, DEVICE)
    bad = check_vectors(m, x, opts)
    assert not bad, bad


@pytest.mark.parametrize("m_form, n_form", tiered([("scalar", "no_decay"), ("no_decay", "none"), ("none", "no_decay"),
                                                   ("scalar", "sum"), ("no_decay", "no_decay")],
                                                  [("scalar", "no_decay")]))
def test_vector_gradients_decay_kinds(m_form, n_form):
    """A decay of one number per head (M's, wherever it is written: it commutes), per channel on one
    side and none on the other, or none at all."""
    m = mixer(m_form, n_form)
    x, opts = draw_inputs(m, CASE, DEVICE)
    bad = check_vectors(m, x, opts)
    assert not bad, bad


@pytest.mark.parametrize("BT, with_dht", tiered([(16, True), (8, False), (64, True)], []))
def test_vector_gradients_batched(BT, with_dht):
    """Equal-length sequences, a scale, checkpoints every 8 or 16 tokens or fewer than one per
    sequence, without dht."""
    m = mixer("left", "right")
    x, opts = draw_inputs(m, BATCHED, DEVICE)
    bad = check_vectors(m, x, opts, BT=BT, with_dht=with_dht)
    assert not bad, bad


def test_vector_gradients_without_h0():
    m = mixer("sum", "left")
    x, opts = draw_inputs(m, Case(B=2, T=20, H=1, HV=2, K=8, V=8, seed=9), DEVICE)
    bad = check_vectors(m, x, opts)
    assert not bad, bad


STRONG = {  # where (tokens of the packed batch), value
    "one-1e4": ((9, 30), -1e4),
    "one-inf": ((9, 30), -float("inf")),
    "block-inf": (slice(33, 49), -float("inf")),  # a whole 16-token chunk of the third sequence
    "first-inf": ((0, 17), -float("inf")),  # each sequence's first token (the initial state wiped)
}


@pytest.mark.parametrize("which", ["g", "gv"])
@pytest.mark.parametrize("strength", tiered(list(STRONG), ["block-inf"]))
def test_vector_gradients_strong_decays(which, strength):
    """Log-decays of -1e4 and -inf in M's or N's (a factor of 0 exactly, its gradient 0 there)."""
    m = mixer("left", "right")
    x, opts = draw_inputs(m, CASE, DEVICE)
    where, value = STRONG[strength]
    x[which] = x[which].clone()
    x[which][:, where] = value
    bad = check_vectors(m, x, opts)
    assert not bad, bad


@pytest.mark.parametrize("m_form, n_form", tiered([("left", "right"), ("sum", "none"), ("scalar", "sum"),
                                                   ("right", "no_decay")], [("left", "right")]))
def test_inputs_gradients_end_to_end(m_form, n_form):
    """chunk's output, final state and gradients of every input and of h0 (o's and the final
    state's losses) through the kernels and per_token's chain rule, against the float64 reference."""
    m = mixer(m_form, n_form)
    x, opts = draw_inputs(m, CASE, DEVICE)
    bad = failing(against_reference(m, x, dict(opts, output_final_state=True), impls=("chunk",)))
    assert not bad, bad


@pytest.mark.parametrize("which", tiered(["g", "gv"], []))
def test_inputs_gradients_strong_decays_end_to_end(which):
    """-inf on a whole chunk and on single tokens of M's or N's log-decay, through the chain rule."""
    m = mixer("left", "right")
    x, opts = draw_inputs(m, CASE, DEVICE)
    x[which] = x[which].clone()
    x[which][:, (9, 30)] = -float("inf")
    x[which][:, 33:49] = -float("inf")
    bad = failing(against_reference(m, x, dict(opts, output_final_state=True), impls=("chunk",)))
    assert not bad, bad


def test_chunk_does_not_run_the_reference(monkeypatch):
    """chunk's forward and backward are the kernels': reference.scan (the token loop) is never called."""
    def refuse(*args, **kwargs):
        raise AssertionError("reference.scan called")
    m = mixer("left", "right")
    x, opts = draw_inputs(m, Case(B=1, T=20, H=1, HV=1, K=8, V=8, initial_state=True, seed=5), DEVICE)
    monkeypatch.setattr(reference, "scan", refuse)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"].clone().requires_grad_()
    o, s = m.chunk(**leaves, **dict(opts, initial_state=h0, output_final_state=True))
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (*leaves.values(), h0))


def test_written_module_chunk_is_the_token_loop(tmp_path):
    """The module `lrdsl compile` writes: its chunk of a two-sided spec is the token loop's forward."""
    import importlib.util

    from lrdsl.codegen.generate import generate
    m = mixer("right", "sum")
    path = tmp_path / "written_two_sided.py"
    path.write_text(generate(m.ir))
    spec = importlib.util.spec_from_file_location("written_two_sided", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x, opts = draw_inputs(m, CASE, DEVICE)
    ref_o, ref_s = m.reference(**{n: t.double() for n, t in x.items()},
                               **dict(opts, initial_state=opts["initial_state"].double(), output_final_state=True))
    o, s = mod.chunk(**x, **dict(opts, output_final_state=True))
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.parametrize("bad", tiered(["beta-nan", "g-nan", "gv-nan", "v-inf"], ["beta-nan"]))
def test_nonfinite_input_leaves_earlier_gradients(bad):
    """A nan or inf in one input at token 37: every input's gradient at the tokens before it, of a
    loss on the outputs before it, is the float64 reference's on those tokens alone (the backward
    runs on finite copies, valueside.ChunkFunction's), nan at the bad entry."""
    m = mixer("left", "right")
    row = 37
    name, value = {"beta-nan": ("beta", float("nan")), "g-nan": ("g", float("nan")),
                   "gv-nan": ("gv", float("nan")), "v-inf": ("v", float("inf"))}[bad]
    leaves = earlier_gradients_match(m, 50, name, value, row, bad)
    assert torch.isnan(leaves[name].grad[0, row]).all()
