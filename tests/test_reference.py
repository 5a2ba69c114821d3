"""The reference scan against independent code: a direct per-head loop written here from the math
in docs/recurrences.md (dense K x K transition matrices, not the IR), flash-linear-attention's naive
recurrences, and the properties every scan must have (varlen, grouped values, state hand-over,
gradients, input validation)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import lrdsl

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EPS = 1e-6  # l2norm: x * rsqrt(sum(x^2) + 1e-6); squash: log(P + 1e-6)


def rel(a, b) -> float:
    """Relative RMS error rms(a - b) / rms(b), in float64."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.fixture(scope="module")
def mixers():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = lrdsl.compile(EXAMPLES / f"{name}.lr", check_stability=False)
        return cache[name]
    return get


# ---- the models, written out by hand -------------------------------------------------------------
# inputs: name -> (heads "H" | "HV", channels None | "K" | "V", distribution)
#   "log": logsigmoid(normal) (a log-decay < 0), "gate": sigmoid(normal) in (0, 1),
#   "gate2": uniform in (0, 2), "unit": uniform in [0, 1]
# step(S, P, z) -> (S, P): one token of one value head; S [K, V], P [K] (the ATK state, or None);
#   z holds q, k (normalised when the model says so), v, the head index hv and every input's
#   value for this head and token.

def l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def squash(P, x=1.5, center=-0.2):
    r = torch.log(P + EPS) - center
    s = r / (1 + r.abs())
    return torch.exp(-math.log(x) * s)


def eye(z):
    return torch.eye(z["k"].numel(), dtype=torch.float64)


def step_linear(S, P, z):
    return S + torch.outer(z["k"], z["v"]), P


def step_retnet(S, P, z):
    gamma = 1 - 2.0 ** (-5 - z["hv"])
    return gamma * eye(z) @ S + torch.outer(z["k"], z["v"]), P


def step_mamba2(S, P, z):
    return torch.exp(z["g"]) * S + torch.outer(z["k"], z["v"]), P


def step_gla(S, P, z):
    return torch.diag(torch.exp(z["g"])) @ S + torch.outer(z["k"], z["v"]), P


def step_deltanet(S, P, z):
    k, b = z["k"], z["beta"]
    return (eye(z) - b * torch.outer(k, k)) @ S + b * torch.outer(k, z["v"]), P


def step_gdn(S, P, z):
    k, b = z["k"], z["beta"]
    M = torch.exp(z["g"]) * (eye(z) - b * torch.outer(k, k))
    return M @ S + b * torch.outer(k, z["v"]), P


def step_gdn_gates(S, P, z):
    """Gated DeltaNet with FLA's gates: per-token a, b and per-head params A_log, dt_bias."""
    g = -torch.exp(z["A_log"]) * torch.nn.functional.softplus(z["a"] + z["dt_bias"])
    k, b = z["k"], torch.sigmoid(z["b"])
    M = torch.exp(g) * (eye(z) - b * torch.outer(k, k))
    return M @ S + b * torch.outer(k, z["v"]), P


def step_kda(S, P, z):
    k, b = z["k"], z["beta"]
    M = (eye(z) - b * torch.outer(k, k)) @ torch.diag(torch.exp(z["g"]))
    return M @ S + b * torch.outer(k, z["v"]), P


def step_kda_after(S, P, z):
    k, b = z["k"], z["beta"]
    M = torch.diag(torch.exp(z["g"])) @ (eye(z) - b * torch.outer(k, k))
    return M @ S + b * torch.outer(k, z["v"]), P


def step_gdn2(S, P, z):
    k = z["k"]
    M = (eye(z) - torch.outer(k, z["b"] * k)) @ torch.diag(torch.exp(z["g"]))
    return M @ S + torch.outer(k, z["w"] * z["v"]), P


def step_channel_scalar(S, P, z):
    k = z["k"]
    M = torch.exp(z["g"]) * (eye(z) - torch.outer(k, z["b"] * k))
    return M @ S + torch.outer(k, z["w"] * z["v"]), P


def atk(P, z):
    """P = exp(g_atk) P + beta_atk k*k, then m = squash(P); returns (P, m*k)."""
    k = z["k"]
    P = torch.exp(z["g_atk"]) * P + z["beta_atk"] * k * k
    return P, squash(P) * k


def step_gdn2_atk(S, P, z):
    P, mk = atk(P, z)
    k = z["k"]
    M = (eye(z) - torch.outer(mk, z["b"] * k)) @ torch.diag(torch.exp(z["g"]))
    return M @ S + torch.outer(mk, z["w"] * z["v"]), P


def step_precond_gdn(S, P, z):
    P, mk = atk(P, z)
    k, b = z["k"], z["beta"]
    M = torch.exp(z["g"]) * (eye(z) - b * torch.outer(mk, k))
    return M @ S + b * torch.outer(mk, z["v"]), P


def step_precond_kda(S, P, z):
    P, mk = atk(P, z)
    k, b = z["k"], z["beta"]
    M = (eye(z) - b * torch.outer(mk, k)) @ torch.diag(torch.exp(z["g"]))
    return M @ S + b * torch.outer(mk, z["v"]), P


def step_rwkv6(S, P, z):
    return torch.diag(torch.exp(z["w"])) @ S + torch.outer(z["k"], z["v"]), P


def read_rwkv6(S_prev, S, z, scale):
    """RWKV-6 reads the state before the token's write, plus the bonus u on its own key."""
    q = scale * z["q"]
    return S_prev.T @ q + (q * z["u"] * z["k"]).sum() * z["v"]


def step_rwkv7(S, P, z):
    kk = l2(z["kk"])
    M = torch.diag(torch.exp(z["w"])) - torch.outer(z["a"] * kk, kk)  # erase along kk, write along a*kk
    return M @ S + torch.outer(z["k"], z["v"]), P


def step_dplr(S, P, z):
    M = torch.diag(torch.exp(z["gk"])) + z["beta"] * torch.outer(l2(z["b"]), l2(z["a"]))
    return M @ S + torch.outer(z["k"], z["v"]), P


def step_iplr(S, P, z):
    kk = l2(z["kk"])
    M = eye(z) - torch.outer(z["a"] * kk, kk)
    return M @ S + torch.outer(z["k"], z["v"]), P


def step_comba(S, P, z):
    k, b = z["k"], z["beta"]
    M = torch.exp(z["g"]) * (eye(z) - b * torch.outer(k, l2(z["p"])))
    return M @ S + b * torch.outer(k, z["v"]), P


def step_oja(S, P, z):
    """The gated Oja rule: the transition multiplies S from the right, N = diag(exp(gv)) (I - beta v v^T)."""
    v = l2(z["v"])
    N = torch.diag(torch.exp(z["gv"])) @ (torch.eye(len(v), dtype=v.dtype) - z["beta"] * torch.outer(v, v))
    return S @ N + z["beta"] * torch.outer(z["k"], v), P


def step_delta_product(S, P, z):
    """DeltaProduct: the decay, then (I - b_j k_j k_j^T) S + b_j k_j v_j^T for each step j."""
    S = torch.exp(z["g"]) * S
    for j, (k, v, b) in enumerate(((z["k"], z["v"], z["b1"]), *((l2(z[f"k{j}"]), z[f"v{j}"], z[f"b{j}"])
                                                                 for j in (2, 3) if f"k{j}" in z))):
        S = (eye(z) - b * torch.outer(k, k)) @ S + b * torch.outer(k, v)
    return S, P


def _product_inputs(n, gain):
    out = {"g": ("HV", None, "log"), "b1": ("HV", None, gain)}
    for j in range(2, n + 1):
        out.update({f"k{j}": ("HV", "K", "normal"), f"v{j}": ("HV", "V", "normal"), f"b{j}": ("HV", None, gain)})
    return out


ATK = {"g_atk": ("H", None, "log"), "beta_atk": ("H", None, "gate")}
MODELS = {  # example -> (l2norm q and k, inputs besides q k v, step, has an aux state)
    "linear_attention": (False, {}, step_linear, False),
    "retnet": (False, {}, step_retnet, False),
    "mamba2": (False, {"g": ("HV", None, "log")}, step_mamba2, False),
    "gla": (False, {"g": ("HV", "K", "log")}, step_gla, False),
    "deltanet": (True, {"beta": ("HV", None, "gate")}, step_deltanet, False),
    "gated_deltanet": (True, {"g": ("HV", None, "log"), "beta": ("HV", None, "gate")}, step_gdn, False),
    "gated_deltanet_negeig": (True, {"g": ("HV", None, "log"), "beta": ("HV", None, "gate2")}, step_gdn, False),
    "gated_deltanet_gates": (True, {"a": ("HV", None, "normal"), "b": ("HV", None, "normal"),
                                    "A_log": ("HV", None, "param"), "dt_bias": ("HV", None, "param")},
                             step_gdn_gates, False),  # "param": one value per head, [HV]
    "kda": (True, {"g": ("HV", "K", "log"), "beta": ("HV", None, "gate")}, step_kda, False),
    "kda_decay_after_erase": (True, {"g": ("HV", "K", "log"), "beta": ("HV", None, "gate")},
                              step_kda_after, False),
    "gdn2": (True, {"g": ("HV", "K", "log"), "b": ("HV", "K", "unit"), "w": ("HV", "V", "unit")},
             step_gdn2, False),
    "channel_gates_scalar_decay": (True, {"g": ("HV", None, "log"), "b": ("HV", "K", "unit"),
                                          "w": ("HV", "V", "unit")}, step_channel_scalar, False),
    "gdn2_atk": (True, {"g": ("HV", "K", "log"), "b": ("HV", "K", "unit"), "w": ("HV", "V", "unit"), **ATK},
                 step_gdn2_atk, True),
    "precond_deltanet": (True, {"g": ("HV", None, "log"), "beta": ("HV", None, "gate"), **ATK},
                         step_precond_gdn, True),
    "precond_kda": (True, {"g": ("HV", "K", "log"), "beta": ("HV", None, "gate"), **ATK},
                    step_precond_kda, True),
    "rwkv6": (False, {"w": ("HV", "K", "log"), "u": ("HV", "K", "param")}, step_rwkv6, False, read_rwkv6),
    "rwkv7": (False, {"w": ("HV", "K", "log"), "kk": ("HV", "K", "normal"), "a": ("HV", "K", "unit")},
              step_rwkv7, False),
    "dplr": (False, {"gk": ("HV", "K", "log"), "a": ("HV", "K", "normal"), "b": ("HV", "K", "normal"),
                     "beta": ("HV", None, "unit")}, step_dplr, False),
    "iplr": (False, {"kk": ("HV", "K", "normal"), "a": ("HV", "K", "unit")}, step_iplr, False),
    "oja": (False, {"gv": ("HV", "V", "log"), "beta": ("HV", None, "gate")}, step_oja, False),
    "comba": (True, {"p": ("HV", "K", "normal"), "g": ("HV", None, "log"), "beta": ("HV", None, "gate")},
              step_comba, False),
    "delta_product2": (True, _product_inputs(2, "gate"), step_delta_product, False),
    "delta_product3": (True, _product_inputs(3, "gate2"), step_delta_product, False),
}
AUX = sorted(n for n, m in MODELS.items() if m[3])
PLAIN = sorted(n for n, m in MODELS.items() if not m[3])


def test_every_example_has_a_hand_written_model():
    # the offline solve (Mesa) has its own hand-written loop in tests/test_mesa.py
    assert sorted(p.stem for p in EXAMPLES.glob("*.lr") if p.stem not in ("mesa", "mesa_retention")) == \
        sorted(MODELS)


def make_inputs(name, B=2, T=7, H=2, HV=4, K=5, V=3, seed=0, dtype=torch.float64):
    """Fresh random q, k, v and gate inputs (never zeros) for the example `name`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    heads = {"H": H, "HV": HV}
    chans = {None: (), "K": (K,), "V": (V,)}
    out = {}
    for inp, (h, c, dist) in MODELS[name][1].items():
        shape = (heads[h], *chans[c]) if dist == "param" else (B, T, heads[h], *chans[c])
        if dist in ("param", "normal"):
            x = randn(*shape)
        elif dist == "log":
            x = torch.nn.functional.logsigmoid(randn(*shape))
        elif dist == "gate":
            x = torch.sigmoid(randn(*shape))
        elif dist == "gate2":
            x = 2 * torch.rand(*shape, generator=gen, dtype=torch.float64).clamp(1e-3, 1 - 1e-3)
        else:
            x = torch.rand(*shape, generator=gen, dtype=torch.float64).clamp(1e-3, 1 - 1e-3)
        out[inp] = x.to(dtype)
    q, k, v = randn(B, T, H, K).to(dtype), randn(B, T, H, K).to(dtype), randn(B, T, HV, V).to(dtype)
    return q, k, v, out


def direct(name, q, k, v, inputs, scale=None, h0=None, P0=None):
    """The model's recurrence, one value head at a time. Returns o [B, T, HV, V], S [B, HV, K, V], P."""
    norm, decl, step, _, *read = MODELS[name]
    read = read[0] if read else (lambda S_prev, S, z, scale: S.T @ (scale * z["q"]))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    S_out = torch.zeros(B, HV, K, V, dtype=torch.float64)
    P_out = torch.zeros(B, HV, K, dtype=torch.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv // G  # the key head this value head reads
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[b, hv].double()
            P = torch.zeros(K, dtype=torch.float64) if P0 is None else P0[b, hv].double()
            for t in range(T):
                qt, kt = q[b, t, h].double(), k[b, t, h].double()
                if norm:
                    qt, kt = l2(qt), l2(kt)
                z = {"q": qt, "k": kt, "v": v[b, t, hv].double(), "hv": hv}
                for nm, (heads, _, dist) in decl.items():
                    x = inputs[nm] if dist == "param" else inputs[nm][b, t]
                    z[nm] = x[h if heads == "H" else hv].double()
                S_prev = S
                S, P = step(S, P, z)
                o[b, t, hv] = read(S_prev, S, z, scale)
            S_out[b, hv], P_out[b, hv] = S, P
    return o, S_out, P_out


def tokens(inputs, sl):
    """The inputs of the tokens sl ([B, T, ...] cut along T); params ([HV]) stay whole."""
    return {nm: x[:, sl] if x.dim() >= 3 else x for nm, x in inputs.items()}


def parts(state):
    """A final state as a tuple: S, then the auxiliary states of a whole state."""
    return (state.S, *state.aux.values()) if isinstance(state, lrdsl.MixerState) else (state,)


# ---- 1. the reference against the direct loop ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reference_matches_direct_loop(mixers, name):
    m = mixers(name)
    q, k, v, inputs = make_inputs(name, seed=1)
    h0 = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o, S = m.reference(q, k, v, initial_state=h0, output_final_state=True, **inputs)
    o_ref, S_ref, P_ref = direct(name, q, k, v, inputs, h0=h0)
    if m.ir.aux:  # the whole state: S and the ATK state P
        assert isinstance(S, lrdsl.MixerState) and len(S.aux) == 1
        P = next(iter(S.aux.values()))
        assert P.shape == P_ref.shape and rel(P, P_ref) < 1e-10, rel(P, P_ref)
        S = S.S
    assert o.shape == (2, 7, 4, 3) and o.dtype == torch.float64
    assert S.shape == (2, 4, 5, 3) and S.dtype == torch.float64
    assert rel(o, o_ref) < 1e-10, rel(o, o_ref)
    assert rel(S, S_ref) < 1e-10, rel(S, S_ref)


@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "precond_kda"])
def test_reference_explicit_scale_and_no_state(mixers, name):
    m = mixers(name)
    q, k, v, inputs = make_inputs(name, B=1, T=6, H=1, HV=3, K=4, V=2, seed=3)
    o, S = m.reference(q, k, v, scale=0.7, **inputs)
    assert S is None
    o_ref, _, _ = direct(name, q, k, v, inputs, scale=0.7)
    assert rel(o, o_ref) < 1e-10
    o_default, _ = m.reference(q, k, v, **inputs)
    assert rel(o_default, o_ref) > 1e-3  # the scale is not ignored: 0.7 is not 4^-0.5


def test_direct_loop_is_not_trivially_equal():
    """The direct loops distinguish neighbouring models (decay before vs after the erase)."""
    q, k, v, inputs = make_inputs("kda", seed=4)
    a, _, _ = direct("kda", q, k, v, inputs)
    b, _, _ = direct("kda_decay_after_erase", q, k, v, inputs)
    assert rel(a, b) > 1e-3


# ---- 2. against flash-linear-attention's naive recurrences -------------------------------------------


def bhtd(x):
    return x.transpose(1, 2).contiguous()


def f32(*xs):
    return [x.float() for x in xs]


def _fla_linear_attention(q, k, v, x, h0):
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    return naive_recurrent_linear_attn(*f32(q, k, v), initial_state=h0.float(), output_final_state=True)


def _fla_retnet(q, k, v, x, h0):
    from fla.ops.retention.naive import naive_retention
    o = naive_retention(*(bhtd(t) for t in f32(q, k, v)))
    return bhtd(o), None


def _fla_mamba2(q, k, v, x, h0):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    return naive_recurrent_simple_gla(*f32(q, k, v, x["g"]), initial_state=h0.float(), output_final_state=True)


def _fla_gla(q, k, v, x, h0):
    from fla.ops.gla.naive import naive_recurrent_gla
    return naive_recurrent_gla(*f32(q, k, v, x["g"]), initial_state=h0.float(), output_final_state=True)


def _fla_deltanet(q, k, v, x, h0):
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    q, k = l2(q), l2(k)  # the naive delta rule does not normalise
    o, S = delta_rule_recurrence(*(bhtd(t) for t in f32(q, k, v, x["beta"])), initial_state=h0.float(),
                                 output_final_state=True)
    return bhtd(o), S


def _fla_gdn(q, k, v, x, h0):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return naive_recurrent_gated_delta_rule(*f32(l2(q), l2(k), v, x["beta"], x["g"]), initial_state=h0.float(),
                                            output_final_state=True)


def _fla_kda(q, k, v, x, h0):
    from fla.ops.kda.naive import naive_recurrent_kda
    return naive_recurrent_kda(*f32(l2(q), l2(k), v, x["g"], x["beta"]), initial_state=h0.float(),
                               output_final_state=True)


def _fla_gdn2(q, k, v, x, h0):
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    return naive_recurrent_gdn2(*f32(l2(q), l2(k), v, x["g"], x["b"], x["w"]), initial_state=h0.float(),
                                output_final_state=True)


def _fla_channel_scalar(q, k, v, x, h0):
    """GDN-2 with its per-channel decay set to one value per head."""
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    g = x["g"].unsqueeze(-1).expand(*x["g"].shape, q.shape[-1])
    return naive_recurrent_gdn2(*f32(l2(q), l2(k), v, g, x["b"], x["w"]), initial_state=h0.float(),
                                output_final_state=True)


def _fla_precond_gdn(q, k, v, x, h0):
    from fla.ops.precond_gated_delta_rule.naive import naive_recurrent_precond_gated_delta_rule
    o, S, _ = naive_recurrent_precond_gated_delta_rule(  # normalises q and k itself (F.normalize)
        *f32(q, k, v, x["g_atk"], x["g"], x["beta_atk"], x["beta"]), initial_state=h0.float(),
        output_final_state=True, x=1.5, log_atk_scale=-0.2)
    return o, S


def _fla_precond_kda(q, k, v, x, h0):
    from fla.ops.precond_kda.naive import naive_recurrent_precond_kda
    o, S, _ = naive_recurrent_precond_kda(*f32(l2(q), l2(k), v, x["g"], x["g_atk"], x["beta_atk"], x["beta"]),
                                          initial_state=h0.float(), output_final_state=True, x=1.5,
                                          log_atk_scale=-0.2)
    return o, S


FLA = {  # example -> (FLA naive function, grouped values supported by it)
    "linear_attention": (_fla_linear_attention, False),
    "retnet": (_fla_retnet, False),
    "mamba2": (_fla_mamba2, False),
    "gla": (_fla_gla, False),
    "deltanet": (_fla_deltanet, False),
    "gated_deltanet": (_fla_gdn, False),
    "gated_deltanet_negeig": (_fla_gdn, False),
    "kda": (_fla_kda, True),
    "gdn2": (_fla_gdn2, False),
    "channel_gates_scalar_decay": (_fla_channel_scalar, False),
    "precond_deltanet": (_fla_precond_gdn, True),
    "precond_kda": (_fla_precond_kda, False),
}


@pytest.mark.parametrize("name", sorted(FLA))
def test_reference_matches_fla_naive(mixers, name):
    pytest.importorskip("fla")
    fn, grouped = FLA[name]
    H, HV = (2, 4) if grouped else (3, 3)
    q, k, v, inputs = make_inputs(name, B=2, T=11, H=H, HV=HV, K=6, V=5, seed=5)
    h0 = 0.5 * torch.randn(2, HV, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    if name == "retnet":
        h0 = None  # naive_retention starts from zero
    o, S = mixers(name).reference(q, k, v, initial_state=h0, output_final_state=True, **inputs)
    S = S.S if isinstance(S, lrdsl.MixerState) else S  # FLA's naive ops return S alone
    o_fla, S_fla = fn(q, k, v, inputs, h0 if h0 is not None else torch.zeros(2, HV, 6, 5))
    assert o_fla.shape == o.shape
    assert rel(o, o_fla) < 1e-5, rel(o, o_fla)
    if S_fla is not None:
        assert rel(S, S_fla) < 1e-5, rel(S, S_fla)


# ---- 3. varlen, grouped values, state hand-over ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_varlen_equals_per_sequence_runs(mixers, name):
    m = mixers(name)
    cu = [0, 3, 3, 4, 9]  # lengths 3, 0, 1, 5
    q, k, v, inputs = make_inputs(name, B=1, T=9, H=2, HV=4, K=3, V=2, seed=7)
    N = len(cu) - 1
    h0 = torch.randn(N, 4, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    o, S = m.reference(q, k, v, initial_state=h0, output_final_state=True,
                       cu_seqlens=torch.tensor(cu, dtype=torch.long), **inputs)
    P = None
    if isinstance(S, lrdsl.MixerState):  # the whole state: the ATK state P beside S
        (P,), S = S.aux.values(), S.S
    assert o.shape == (1, 9, 4, 2) and S.shape == (N, 4, 3, 2)
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        if bos == eos:
            assert torch.equal(S[n], h0[n])  # an empty sequence leaves its state alone
            continue
        sl = tokens(inputs, slice(bos, eos))
        o_n, S_n = m.reference(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], initial_state=h0[n:n + 1],
                               output_final_state=True, **sl)
        P_n = None
        if isinstance(S_n, lrdsl.MixerState):
            (P_n,), S_n = S_n.aux.values(), S_n.S
        assert rel(o[:, bos:eos], o_n) < 1e-12
        assert rel(S[n:n + 1], S_n) < 1e-12
        o_d, S_d, P_d = direct(name, q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], sl, h0=h0[n:n + 1])
        assert rel(o_n, o_d) < 1e-10 and rel(S_n, S_d) < 1e-10
        if P is not None:
            assert rel(P[n:n + 1], P_n) < 1e-12 and rel(P_n, P_d) < 1e-10


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grouped_values_equal_repeated_heads(mixers, name):
    m = mixers(name)
    q, k, v, inputs = make_inputs(name, B=2, T=5, H=2, HV=4, K=3, V=2, seed=9)
    o, S = m.reference(q, k, v, output_final_state=True, **inputs)
    rep = {nm: (x.repeat_interleave(2, dim=2) if MODELS[name][1][nm][0] == "H" else x)
           for nm, x in inputs.items()}
    o2, S2 = m.reference(q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v,
                         output_final_state=True, **rep)
    assert rel(o, o2) < 1e-13 and all(rel(a, b) < 1e-13 for a, b in zip(parts(S), parts(S2)))
    # and value heads 2i and 2i+1 do read the same key head: swapping the key heads changes the output
    o3, _ = m.reference(q.flip(2), k.flip(2), v, **{nm: (x.flip(2) if MODELS[name][1][nm][0] == "H" else x)
                                                   for nm, x in inputs.items()})
    assert rel(o3, o) > 1e-3


@pytest.mark.parametrize("name", PLAIN)
def test_state_hand_over(mixers, name):
    m = mixers(name)
    q, k, v, inputs = make_inputs(name, B=2, T=9, H=1, HV=2, K=4, V=3, seed=10)
    h0 = torch.randn(2, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    o, S = m.reference(q, k, v, initial_state=h0, output_final_state=True, **inputs)
    T1 = 4
    first, second = tokens(inputs, slice(None, T1)), tokens(inputs, slice(T1, None))
    o1, S1 = m.reference(q[:, :T1], k[:, :T1], v[:, :T1], initial_state=h0, output_final_state=True, **first)
    o2, S2 = m.reference(q[:, T1:], k[:, T1:], v[:, T1:], initial_state=S1, output_final_state=True, **second)
    assert rel(torch.cat([o1, o2], dim=1), o) < 1e-12
    assert rel(S2, S) < 1e-12


@pytest.mark.parametrize("name", AUX)
def test_state_hand_over_with_aux_state(mixers, name):
    """The whole state (S and the ATK state P) handed over reproduces the unsplit run; S alone
    restarts P at zero: then the second run is the direct loop from (S1, P = 0), which differs."""
    m = mixers(name)
    q, k, v, inputs = make_inputs(name, B=2, T=9, H=1, HV=2, K=4, V=3, seed=12)
    o, whole = m.reference(q, k, v, output_final_state=True, **inputs)
    T1 = 4
    first, second = tokens(inputs, slice(None, T1)), tokens(inputs, slice(T1, None))
    o1, st1 = m.reference(q[:, :T1], k[:, :T1], v[:, :T1], output_final_state=True, **first)
    assert rel(o1, o[:, :T1]) < 1e-12
    _, S1_d, P1_d = direct(name, q[:, :T1], k[:, :T1], v[:, :T1], first)
    assert rel(st1.S, S1_d) < 1e-10 and rel(next(iter(st1.aux.values())), P1_d) < 1e-10
    o2, st2 = m.reference(q[:, T1:], k[:, T1:], v[:, T1:], initial_state=st1, output_final_state=True, **second)
    assert rel(o2, o[:, T1:]) < 1e-10
    assert all(rel(a, b) < 1e-10 for a, b in zip(parts(st2), parts(whole)))
    o2_s, st2_s = m.reference(q[:, T1:], k[:, T1:], v[:, T1:], initial_state=st1.S, output_final_state=True,
                              **second)
    o2_d, S2_d, _ = direct(name, q[:, T1:], k[:, T1:], v[:, T1:], second, h0=st1.S)
    assert rel(o2_s, o2_d) < 1e-10 and rel(st2_s.S, S2_d) < 1e-10
    assert rel(o2_s, o[:, T1:]) > 1e-6  # P lost


# ---- 4. gradients -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradcheck(mixers, name):
    m = mixers(name)
    K = 3 if name in ("deltanet", "gdn2", "precond_deltanet", "gla") else 2
    q, k, v, inputs = make_inputs(name, B=1, T=3, H=1, HV=1, K=K, V=2, seed=13)
    h0 = torch.randn(1, 1, K, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    names = list(inputs)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, h0, *inputs.values())]

    if m.ir.aux:  # the whole state in and out: gradients reach the ATK state's start too
        leaves.append(torch.rand(1, 1, K, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
                      .requires_grad_(True))

    def f(q, k, v, h0, *xs):
        state = lrdsl.MixerState(h0, {m.ir.aux[0].name: xs[-1]}) if m.ir.aux else h0
        xs = xs[:-1] if m.ir.aux else xs
        o, S = m.reference(q, k, v, initial_state=state, output_final_state=True, **dict(zip(names, xs)))
        return (o, *parts(S))

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)
    sum(t.sum() for t in f(*leaves)).backward()
    for t in leaves:  # every input reaches the output
        assert t.grad is not None and t.grad.abs().sum() > 0


# ---- 5. bad tensors -------------------------------------------------------------------------------------
@pytest.fixture
def gdn(mixers):
    m = mixers("gated_deltanet")
    q, k, v, x = make_inputs("gated_deltanet", B=2, T=7, H=2, HV=4, K=5, V=3, seed=15)
    return m, q, k, v, x


def _raises(fn, *words):
    with pytest.raises(lrdsl.InputError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_good_call_passes(gdn):
    m, q, k, v, x = gdn
    o, _ = m.reference(q, k, v, **x)
    assert o.shape == (2, 7, 4, 3)


def test_missing_input(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, g=x["g"]), "'beta'", "[B, T, HV]")


def test_missing_input_given_as_none(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, g=x["g"], beta=None), "'beta'", "[B, T, HV]")


def test_unknown_keyword(gdn):
    m, q, k, v, x = gdn
    msg = _raises(lambda: m.reference(q, k, v, gamma=x["g"], **x), "'gamma'")
    assert "beta" in msg and "g" in msg  # lists the inputs it does have


def test_api_keyword_typo(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, initial_states=None, **x), "'initial_states'")


@pytest.mark.parametrize("which,shape,words", [
    ("g", (2, 7, 2), ["'g'", "[B, T, HV]", "[2, 7, 4]", "[2, 7, 2]"]),
    ("beta", (2, 7, 4, 1), ["'beta'", "[2, 7, 4]", "[2, 7, 4, 1]"]),
    ("k", (2, 7, 2, 4), ["'k'", "[2, 7, 2, 5]", "[2, 7, 2, 4]"]),
    ("k", (2, 6, 2, 5), ["'k'", "[2, 7, 2, 5]"]),
])
def test_wrong_shape(gdn, which, shape, words):
    m, q, k, v, x = gdn
    t = {"q": q, "k": k, "v": v, **x}
    t[which] = torch.rand(*shape, dtype=torch.float64) + 0.1
    _raises(lambda: m.reference(t.pop("q"), t.pop("k"), t.pop("v"), **t), *words)


def test_wrong_shape_of_q_and_v(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q[0], k, v, **x), "'q'", "[B, T, H, K]")
    _raises(lambda: m.reference(q, k, v[:, :5], **x), "'v'", "[B, T, HV, V]")


def test_wrong_shape_of_shared_input(mixers):
    m = mixers("precond_kda")
    q, k, v, x = make_inputs("precond_kda", B=1, T=4, H=2, HV=4, K=3, V=2, seed=16)
    x["g_atk"] = torch.nn.functional.logsigmoid(torch.randn(1, 4, 4, dtype=torch.float64))  # HV, not H
    _raises(lambda: m.reference(q, k, v, **x), "'g_atk'", "[B, T, H]", "[1, 4, 2]")


@pytest.mark.parametrize("which", ["q", "v", "beta"])
def test_integer_dtype(gdn, which):
    m, q, k, v, x = gdn
    t = {"q": q, "k": k, "v": v, **x}
    t[which] = (t[which] * 10).long() + 1
    _raises(lambda: m.reference(t.pop("q"), t.pop("k"), t.pop("v"), **t), f"'{which}'", "floating")


def test_not_a_tensor(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, g=x["g"], beta=[0.5] * 7), "'beta'", "Tensor")


def test_value_heads_not_a_multiple(gdn):
    m, q, k, v, x = gdn
    v3 = torch.randn(2, 7, 3, 3, dtype=torch.float64)
    g3, b3 = x["g"][:, :, :3], x["beta"][:, :, :3]
    _raises(lambda: m.reference(q, k, v3, g=g3, beta=b3), "v has 3 heads", "multiple", "2 heads")


@pytest.mark.parametrize("cu,words", [
    ([1, 3, 7], ["start at 0"]),
    ([0, 5, 3, 7], ["never decrease"]),
    ([0, 3, 6], ["end at T=7"]),
    ([0], ["cu_seqlens"]),
])
def test_bad_cu_seqlens_values(mixers, cu, words):
    m = mixers("gated_deltanet")
    q, k, v, x = make_inputs("gated_deltanet", B=1, T=7, H=2, HV=4, K=5, V=3, seed=17)
    _raises(lambda: m.reference(q, k, v, cu_seqlens=torch.tensor(cu), **x), *words)


def test_bad_cu_seqlens_type(mixers):
    m = mixers("gated_deltanet")
    q, k, v, x = make_inputs("gated_deltanet", B=1, T=7, H=2, HV=4, K=5, V=3, seed=18)
    _raises(lambda: m.reference(q, k, v, cu_seqlens=torch.tensor([0.0, 3.0, 7.0]), **x), "cu_seqlens", "integer")
    _raises(lambda: m.reference(q, k, v, cu_seqlens=torch.tensor([[0, 3, 7]]), **x), "cu_seqlens", "1-D")
    _raises(lambda: m.reference(q, k, v, cu_seqlens=[0, 3, 7], **x), "cu_seqlens")


def test_cu_seqlens_with_batch(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, cu_seqlens=torch.tensor([0, 3, 7]), **x), "B must be 1", "B=2")


@pytest.mark.parametrize("shape", [(2, 4, 5), (1, 4, 5, 3), (2, 2, 5, 3), (2, 4, 3, 5)])
def test_wrong_initial_state_shape(gdn, shape):
    m, q, k, v, x = gdn
    h0 = torch.randn(*shape, dtype=torch.float64)
    _raises(lambda: m.reference(q, k, v, initial_state=h0, **x), "initial_state", "[N, HV, K, V]", "[2, 4, 5, 3]")


def test_initial_state_shape_with_cu_seqlens(mixers):
    m = mixers("gated_deltanet")
    q, k, v, x = make_inputs("gated_deltanet", B=1, T=7, H=2, HV=4, K=5, V=3, seed=19)
    h0 = torch.randn(1, 4, 5, 3, dtype=torch.float64)  # N = 2 sequences, not B = 1
    _raises(lambda: m.reference(q, k, v, initial_state=h0, cu_seqlens=torch.tensor([0, 3, 7]), **x),
            "initial_state", "[2, 4, 5, 3]")


def test_initial_state_integer_dtype(gdn):
    m, q, k, v, x = gdn
    h0 = torch.ones(2, 4, 5, 3, dtype=torch.long)
    _raises(lambda: m.reference(q, k, v, initial_state=h0, **x), "initial_state", "floating")


def test_bad_scale(gdn):
    m, q, k, v, x = gdn
    _raises(lambda: m.reference(q, k, v, scale="0.5", **x), "scale")
