"""The value side's backward kernel (templates/chunk_value_bwd.py.jinja, issue 40): the gradients of
per_token's vectors (g, alpha, gam, u, z, q) and of the initial state against float64 autograd
through a token loop over the same vectors, whose forward is checked against the reference; every
order of N (left, right, sum, none) and decay kind (none, per head, per head and token, per value
channel); packed sequences with an empty one, grouped value heads (HV = 2 H), h0 and dht, key
tiles that do not divide K, and log-decays of -1e4 and -inf on single tokens and whole chunks.
End to end (the inputs' gradients through per_token) against the reference, and the backward no
longer going through torch_chunk."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dplr import against_reference, failing, tiered
from test_recurrent import DEVICE, PoisonTorch

import lrdsl
from lrdsl.runtime import valueside
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# name -> (the inputs besides q, k, v, beta; N as written after S; decay kind; order of its erase)
SPECS = {
    "oja": ("w[V] log", "diag(exp(w)) (I - beta v v^T)", "diagonal", "right"),
    "erase_first": ("w[V] log", "(I - beta v v^T) diag(exp(w))", "diagonal", "left"),
    "additive": ("w[V] log, kk[V] l2norm, a[V] in [0, 1]", "(diag(exp(w)) - (a*kk) kk^T)", "diagonal", "sum"),
    "decay_only": ("w[V] log", "diag(exp(w))", "diagonal", None),
    "scalar": ("s log", "exp(s) (I - beta v v^T)", "scalar", "left"),
    "scalar_sum": ("s log", "(exp(s) I - (beta*v) v^T)", "scalar", "sum"),
    "constant": ("", "(1 - 2^(-3 - h)) (I - beta v v^T)", "constant", "left"),
    "no_decay": ("", "(I - beta v v^T)", "identity", "left"),
}
# packed sequences with an empty one, grouped value heads, K = 20 over key tiles of 8 (the last one partial)
CASE = Case(B=1, T=53, H=1, HV=2, K=20, V=16, cu_seqlens=(0, 17, 17, 53), initial_state=True, seed=3)
BATCHED = Case(B=2, T=40, H=1, HV=2, K=16, V=16, initial_state=True, scale=0.6, seed=4)


def spec_text(name: str) -> str:
    inputs, n, _, _ = SPECS[name]
    return (f"mixer vb_{name}\ninput q[K], k[K], v[V] l2norm, beta in (0, 1){', ' + inputs if inputs else ''}\n"
            f"S = S {n} + beta k v^T\no = S^T q\nallow unstable\n")


_MIXERS = {}


def mixer(name):
    if name not in _MIXERS:
        _MIXERS[name] = (lrdsl.compile(EXAMPLES / "oja.lr", check_ranges=False) if name == "oja_example" else
                         lrdsl.compile(text=spec_text(name), check_stability=False))
    return _MIXERS[name]


def vectors64(m, x, opts, per_token=valueside.per_token):
    """per_token's vectors of inputs x in float64, and the batch they were made from."""
    h0 = opts["initial_state"]
    x64 = {n: t.double() for n, t in x.items()}
    q, k, v = x64.pop("q"), x64.pop("k"), x64.pop("v")
    b = m._validate(q, k, v, x64, opts.get("scale"), None if h0 is None else h0.double(), True,
                    opts.get("cu_seqlens"))
    return {n: t.detach().contiguous() for n, t in per_token(m.ir, b, torch.float64).items()}, b


def loop64(p, h0, sequences):
    """The float64 oracle: S_t = S_{t-1} D_t - (S_{t-1} alpha_t) gam_t^T + u_t z_t^T, o_t = S_t^T q_t,
    token by token over p's vectors [B, T, HV, w] (B = 1 where packed); o and the final states."""
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(sequences):
        S = h0[n]  # [HV, K, V]
        for t in range(bos, eos):
            at = {k: v[b, t] for k, v in p.items()}
            y = torch.einsum("hkv,hv->hk", S, at["alpha"])
            S = (S * at["g"].exp()[:, None, :] - y[:, :, None] * at["gam"][:, None, :]
                 + at["u"][:, :, None] * at["z"][:, None, :])
            outs.append(torch.einsum("hkv,hk->hv", S, at["q"]))
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


def check_vectors(m, x, opts, BK=8, BT=16, with_dht=True):
    """value_chunk_bwd's vector gradients against float64 autograd through loop64."""
    return compare_vector_grads(m, x, opts, vectors64, loop64, with_dht, 8,
                                lambda k, *a: k.value_chunk_bwd(*a, BK=BK, BT=BT))


def compare_vector_grads(m, x, opts, make_vectors, loop, with_dht, min_poisoned, run):
    """A backward kernel's vector gradients and dh0 (run(kernels, vectors, do, h0, dht, cu)) against
    float64 autograd through loop(vectors, h0, sequences), itself checked against m.reference (do and
    dht random; without an initial state, the kernel starts from zeros): the failing ones, by name.
    tests/test_two_sided_bwd.py checks its kernel with it too."""
    p64, b = make_vectors(m, x, opts)
    given_h0 = b.initial_state is not None
    N = b.B if b.cu_seqlens is None else b.cu_seqlens.numel() - 1
    h0 = b.initial_state.double() if given_h0 else torch.zeros(N, b.HV, b.K, b.V, dtype=torch.float64)
    seqs = [(i, 0, b.T) for i in range(b.B)] if b.cu_seqlens is None else [(0, bos, eos) for _, bos, eos in b.sequences()]
    o_rows = torch.cat([torch.arange(b.T) + i * b.T for i in range(b.B)]) if b.cu_seqlens is None else torch.arange(b.T)
    leaves = {n: t.clone().requires_grad_() for n, t in p64.items()}
    h0l = h0.clone().requires_grad_()
    o, S = loop(leaves, h0l, seqs)  # o [rows, HV, V] in (sequence, token) order
    ref_o, ref_S = m.reference(**{n: t.double() for n, t in x.items()}, **dict(opts, initial_state=h0,
                                                                               output_final_state=True))
    assert rms_ratio(o, ref_o.reshape(-1, b.HV, b.V)[o_rows]) < 1e-10 and rms_ratio(S, ref_S) < 1e-10
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(b.B, b.T, b.HV, b.V, generator=gen, dtype=torch.float64)
    dht = torch.randn(S.shape, generator=gen, dtype=torch.float64)
    ((o * do.reshape(-1, b.HV, b.V)[o_rows]).sum() + (S * dht).sum() * with_dht).backward()
    ref = {n: t.grad for n, t in leaves.items()} | {"h0": h0l.grad}
    cu = None if b.cu_seqlens is None else b.cu_seqlens.to(torch.int64)
    kernels = m.kernels
    poison = PoisonTorch()
    real = kernels.torch
    kernels.torch = poison  # every buffer the host function allocates starts as nan
    try:
        got, dh0 = run(kernels, {n: t.float().contiguous() for n, t in p64.items()}, do.float(),
                       h0.float().contiguous() if given_h0 else None,
                       dht.float().contiguous() if with_dht else None, cu)
    finally:
        kernels.torch = real
    assert poison.poisoned >= min_poisoned
    got = dict(got, h0=dh0)
    assert set(got) == set(ref)
    bad = {}
    for n, r in ref.items():
        if not r.abs().max() > 0:  # an erase's directions without an erase: exactly zero both
            ok = torch.equal(got[n], torch.zeros_like(got[n]))
        else:
            ok = rms_ratio(got[n], r) < TOL
        if not ok:
            bad[n] = rms_ratio(got[n], r)
    return bad


@pytest.mark.parametrize("name", tiered(list(SPECS), ["additive"]))
def test_vector_gradients(name):
    """Every order and decay kind, packed with an empty sequence, HV = 2 H, h0 and dht, K over 3 tiles."""
    m = mixer(name)
    assert m.ir.side == "right" and m.ir.decay.kind == SPECS[name][2]
    assert (m.ir.delta.order if m.ir.delta else None) == SPECS[name][3]
    x, opts = draw_inputs(m, CASE, DEVICE)
    bad = check_vectors(m, x, opts)
    assert not bad, bad


@pytest.mark.parametrize("BK, BT", tiered([(8, 16), (16, 32), (32, 64)], []))
def test_vector_gradients_batched(BK, BT):
    """Equal-length sequences, a scale, one key tile or two, a checkpoint spacing longer than T."""
    m = mixer("oja")
    x, opts = draw_inputs(m, BATCHED, DEVICE)
    bad = check_vectors(m, x, opts, BK=BK, BT=BT)
    assert not bad, bad


EDGES = {  # case, key tile, checkpoint spacing, dht given
    "T1": (Case(B=2, T=1, H=1, HV=1, K=8, V=8, initial_state=True, seed=8), 8, 16, True),
    "K4-V4-no-h0": (Case(B=2, T=32, H=1, HV=2, K=4, V=4, seed=9), 32, 16, True),
    "whole-chunks-no-dht": (Case(B=1, T=48, H=1, HV=1, K=16, V=8, cu_seqlens=(0, 16, 48), initial_state=True,
                                 seed=10), 16, 16, False),
    "V12-BT8": (Case(B=1, T=30, H=2, HV=2, K=12, V=12, cu_seqlens=(0, 0, 30), seed=11), 4, 8, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("edge", list(EDGES))
def test_vector_gradients_edge_shapes(edge):
    """One token, tiny K and V without h0, sequences of whole chunks without dht, V not a power of
    two over key tiles of 4 with an empty first sequence."""
    case, BK, BT, with_dht = EDGES[edge]
    m = mixer("oja")
    x, opts = draw_inputs(m, case, DEVICE)
    bad = check_vectors(m, x, opts, BK=BK, BT=BT, with_dht=with_dht)
    assert not bad, bad


STRONG = {  # where (tokens of the packed batch), value
    "one-1e4": ((9, 30), -1e4),
    "one-inf": ((9, 30), -float("inf")),
    "block-inf": (slice(33, 49), -float("inf")),  # a whole 16-token chunk of the third sequence
    "first-inf": ((0, 17), -float("inf")),  # each sequence's first token (the initial state wiped)
}


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in ("oja", "scalar_sum") for s in STRONG],
                                                  []))
def test_vector_gradients_strong_decays(name, strength):
    """Log-decays of -1e4 and -inf (d = 0 exactly, dg = 0 there as exp's derivative has it)."""
    m = mixer(name)
    x, opts = draw_inputs(m, CASE, DEVICE)
    key = "w" if "w" in x else "s"
    where, value = STRONG[strength]
    x[key] = x[key].clone()
    x[key][:, where] = value
    bad = check_vectors(m, x, opts)
    assert not bad, bad


@pytest.mark.parametrize("name", tiered(["scalar_sum", "constant", "no_decay", "decay_only"], ["constant"]))
def test_inputs_gradients_end_to_end(name):
    """chunk's gradients of every input and of h0 (o's and the final state's losses) through the
    kernel and per_token's chain rule, against the float64 reference (test_oja covers the other orders)."""
    m = mixer(name)
    x, opts = draw_inputs(m, CASE, DEVICE)
    bad = failing(against_reference(m, x, dict(opts, output_final_state=True), impls=("chunk",)))
    assert not bad, bad


def test_backward_does_not_run_torch_chunk(monkeypatch):
    """The backward is the kernel's: torch_chunk (the PyTorch chunked form) is never called."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch_chunk called")
    monkeypatch.setattr(valueside, "torch_chunk", refuse)
    m = mixer("oja")
    x, opts = draw_inputs(m, Case(B=1, T=20, H=1, HV=1, K=8, V=8, initial_state=True, seed=5), DEVICE)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"].clone().requires_grad_()
    o, s = m.chunk(**leaves, **dict(opts, initial_state=h0, output_final_state=True))
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (*leaves.values(), h0))


@pytest.mark.parametrize("bad", tiered(["gv-nan", "beta-nan", "v-inf", "k-nan"], ["gv-nan"]))
def test_nonfinite_input_leaves_earlier_gradients(bad):
    """A nan or inf in one input at token 37 (inside a chunk): every input's gradient at the tokens
    before it, of a loss on the outputs before it, is the float64 reference's on those tokens alone
    (the backward runs on finite copies: a bad decay or erase at token 37 would otherwise carry nan
    to every earlier token through the state's gradient)."""
    m = mixer("oja_example")
    row = 37
    name, value = {"gv-nan": ("gv", float("nan")), "beta-nan": ("beta", float("nan")),
                   "v-inf": ("v", float("inf")), "k-nan": ("k", float("nan"))}[bad]
    leaves = earlier_gradients_match(m, 60, name, value, row, bad)
    assert torch.isnan(leaves[name].grad[0, row]).all()


def earlier_gradients_match(m, T, name, value, row, label):
    """Input `name` set to `value` at token `row` of one sequence of T tokens: every input's
    gradient before `row`, of a loss on the outputs before it, is finite and the float64
    reference's on those tokens alone. Returns the leaves (their .grad), for checks at `row`.
    tests/test_two_sided_bwd.py checks M S N with it too."""
    x, opts = draw_inputs(m, Case(B=1, T=T, H=1, HV=1, K=8, V=8, initial_state=True, seed=6), DEVICE)
    x[name] = x[name].clone()
    x[name][0, row] = value
    do = torch.randn(1, row, 1, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = m.chunk(**leaves, **opts)
    (torch.nan_to_num(o[:, :row], nan=0.0, posinf=0.0, neginf=0.0) * do.float()).sum().backward()
    early = {n: t[:, :row].double().requires_grad_() for n, t in x.items()}
    ref_o, _ = m.reference(**early, **dict(opts, initial_state=opts["initial_state"].double()))
    (ref_o * do).sum().backward()
    for n in x:
        got, ref = leaves[n].grad[:, :row], early[n].grad
        assert torch.isfinite(got).all(), f"{label}: d{n} not finite before token {row}"
        assert rms_ratio(got, ref) < (TOL if n in ("q", "k", "v") else 10 * TOL), (label, n, rms_ratio(got, ref))
    return leaves
