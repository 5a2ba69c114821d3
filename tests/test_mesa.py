"""The offline solve (the Mesa layer): S = exp(g) S + beta k v^T with the Gram state
G = exp(g) G + beta k k^T and the readout o = S^T (G + diag(lamb))^-1 (scale q). lrdsl has its
exact reference scan and refuses to generate kernels for it with a clear error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lrdsl
from lrdsl.fuzz import rms_ratio

SPEC = Path(__file__).resolve().parent.parent / "examples" / "mesa.lr"


def draw(B=2, T=9, H=2, HV=4, K=5, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=F.logsigmoid(r(B, T, HV) + 1),
                beta=torch.sigmoid(r(B, T, HV)), lamb=0.1 + torch.rand(B, T, HV, K, generator=gen,
                                                                        dtype=torch.float64))


def hand_loop(x, scale, h0=None):
    """Written from the math, not from the IR: two [K, V] / [K, K] states per value head."""
    q, k, v, g, beta, lamb = (x[n] for n in ("q", "k", "v", "g", "beta", "lamb"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    S_all = torch.zeros(B, HV, K, V, dtype=torch.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[b, hv].clone()
            G = torch.zeros(K, K, dtype=torch.float64)
            for t in range(T):
                kt, qt = l2(k[b, t, h]), l2(q[b, t, h]) * scale
                a, bt = torch.exp(g[b, t, hv]), beta[b, t, hv]
                S = a * S + bt * torch.outer(kt, v[b, t, hv])
                G = a * G + bt * torch.outer(kt, kt)
                o[b, t, hv] = S.T @ torch.linalg.solve(G + torch.diag(lamb[b, t, hv]), qt)
            S_all[b, hv] = S
    return o, S_all


def test_reference_matches_a_hand_written_loop():
    mixer = lrdsl.compile(SPEC)
    x = draw()
    h0 = torch.randn(2, 4, 5, 3, dtype=torch.float64)
    o, S = mixer.reference(**x, initial_state=h0, output_final_state=True, scale=0.7)
    ref_o, ref_S = hand_loop(x, 0.7, h0)
    assert rms_ratio(o, ref_o) < 1e-10 and rms_ratio(S, ref_S) < 1e-10


def test_reference_matches_flash_linear_attention_exact_mesa():
    from fla.ops.mesa_net.naive import naive_mesa_net_exact
    mixer = lrdsl.compile(SPEC)
    x = draw(B=2, T=11, H=3, HV=3, K=6, V=6, seed=1)
    lamb = 0.5 + torch.rand(3, 6, dtype=torch.float64)  # FLA: one regulariser per head and channel
    x["lamb"] = lamb.expand(2, 11, 3, 6).contiguous()
    o, S = mixer.reference(**x, scale=1.0, output_final_state=True)
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    fo, _, fS = naive_mesa_net_exact(l2(x["q"]), l2(x["k"]), x["v"], x["g"], lamb, x["beta"])
    assert rms_ratio(o, fo) < 1e-5 and rms_ratio(S, fS) < 1e-5


def test_reference_gradcheck():
    mixer = lrdsl.compile(SPEC)
    x = {n: t.requires_grad_() for n, t in draw(B=1, T=3, H=1, HV=1, K=3, V=2, seed=2).items()}
    names = list(x)
    assert torch.autograd.gradcheck(
        lambda *ts: mixer.reference(**dict(zip(names, ts)))[0], tuple(x[n] for n in names))


def test_show_round_trips_and_check_proves_the_solve_well_posed():
    mixer = lrdsl.compile(SPEC)
    again = lrdsl.compile(text=mixer.explicit())
    assert again.ir == mixer.ir and "(G + diag(lamb))^-1" in mixer.explicit()
    facts = mixer.check()
    assert facts["stable"] and facts["solve_well_posed"] is True


def test_an_unbounded_regulariser_is_refused_at_the_readout():
    text = "mixer m\ninput q[K], k[K], v[V], g log, lamb[K]\nS = exp(g) S + k v^T\no = S^T (G + diag(lamb))^-1 q\n"
    with pytest.raises(lrdsl.SpecError, match="not proved well posed") as e:
        lrdsl.compile(text=text)
    assert str(e.value).startswith("<spec>:4:1: error:")


@pytest.mark.parametrize("text, words", [
    ("mixer m\ndecay scalar g\ngain channelwise b, w\nsolve offline lamb\n", "gain none"),
    ("mixer m\ndecay scalar g\nsolve offline\n", "names its regulariser"),
    ("mixer m\ninput q[K], k[K] unit, v[V], beta in (0, 1), lamb[K] in (0, inf)\n"
     "S = (I - beta k k^T) S + beta k v^T\no = S^T (G + diag(lamb))^-1 q\n", "without erase"),
    ("mixer m\ninput q[K], k[K], v[V], lamb[K] in (0, inf)\nS = S + k v^T\no = S^T G q\n", "G"),
])
def test_malformed_offline_specs(text, words):
    with pytest.raises(lrdsl.SpecError, match=words):
        lrdsl.compile(text=text)


def test_kernels_are_refused_clearly(tmp_path):
    mixer = lrdsl.compile(SPEC)
    x = {n: t.float() for n, t in draw().items()}
    for call in (mixer.chunk, mixer.recurrent):
        with pytest.raises(lrdsl.LrdslError, match="no kernels"):
            call(**x)
    out = subprocess.run([sys.executable, "-m", "lrdsl.cli", "compile", str(SPEC), "-o", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "no kernels" in out.stderr and "Traceback" not in out.stderr
