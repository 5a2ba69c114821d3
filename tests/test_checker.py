"""Tests of lrdsl.checker: the stated facts per spec, and a numeric cross-check of every claim.

The numeric side builds M here, channel by channel, from the IR's sympy expressions (with its own
squash formula), independently of the checker's own batched evaluator.
"""
import json
import math

import numpy as np
import pytest
import sympy as sp

from lrdsl.checks.checker import check, explain, stability_error
from lrdsl.frontend import spec_to_ir

SPECS = {
    "deltanet": """mixer deltanet
input q[K], k[K] l2norm, v[V], beta in (0, 1)
S = (I - beta k k^T) S + beta k v^T
o = S^T q
""",
    "gdn_negeig": """mixer gdn_negeig
input q[K], k[K] l2norm, v[V], g log, beta in (0, 2)
S = exp(g) (I - beta k k^T) S + beta k v^T
o = S^T q
""",
    "gdn2": """mixer gdn2
input q[K], k[K] l2norm, v[V], g[K] log, b[K] in [0, 1], w[V] in [0, 1]
S = (I - k (b*k)^T) diag(exp(g)) S + k (w*v)^T
o = S^T q
""",
    "precond_deltanet": """mixer precond_deltanet
decay scalar g
gain scalar beta in (0, 1)
precond diagonal atk(g_atk, beta_atk, x = 1.5, center = -0.2)
normalize q, k
""",
    "kda": """mixer kda
input q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 1)
S = (I - beta k k^T) diag(exp(g)) S + beta k v^T
o = S^T q
""",
    "kda_right": """mixer kda_right
input q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 2)
S = diag(exp(g)) (I - beta k k^T) S + beta k v^T
o = S^T q
""",
    "precond_kda": """mixer precond_kda
input q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 1)
input g_atk log shared, beta_atk in (0, 1) shared
state P[K] = exp(g_atk) * P + beta_atk * k * k
let m = squash(P, x = 1.5, center = -0.2)
S = (I - beta (m*k) k^T) diag(exp(g)) S + beta (m*k) v^T
o = S^T q
""",
    "gdn2_atk": """mixer gdn2_atk
decay diagonal g
gain channelwise b in [0, 1], w in [0, 1]
precond diagonal atk(g_atk, beta_atk, x = 1.5, center = -0.2)
normalize q, k
""",
    "retnet": """mixer retnet
decay constant 1 - 2^(-5 - h)
gain none
""",
    "beta3": """mixer beta3
input q[K], k[K] l2norm, v[V], g log, beta in (0, 3)
S = exp(g) (I - beta k k^T) S + beta k v^T
o = S^T q
""",
    "neg_diag": """mixer neg_diag
input q[K], k[K] l2norm, v[V], d[K] in (-1, 0), beta in (0, 1)
S = (I - beta k k^T) diag(d) S + beta k v^T
o = S^T q
""",
    "mixed_diag": """mixer mixed_diag
input q[K], k[K] l2norm, v[V], d[K] in (-1, 1), b[K] in [0, 1]
S = (I - k (b*k)^T) diag(d) S + k v^T
o = S^T q
""",
    "diag_minus_rank1": """mixer diag_minus_rank1
input q[K], k[K] l2norm, v[V], g[K] log, beta in (0, 1)
S = (diag(exp(g)) - beta k k^T) S + beta k v^T
o = S^T q
""",
    "sqrt_sandwich": """mixer sqrt_sandwich
input q[K], k[K] l2norm, v[V], d[K] in (0, 1), beta in (0, 1)
S = diag(sqrt(d)) (I - beta k k^T) diag(sqrt(d)) S + beta k v^T
o = S^T q
""",
    "signed_diag_minus_rank1": """mixer signed_diag_minus_rank1
input q[K], k[K] l2norm, v[V], e[K] in (-1, 1), beta in (0, 1)
S = (diag(e) - beta k k^T) S + beta k v^T
o = S^T q
""",
    "not_unit": """mixer not_unit
input q[K], k[K], v[V], beta in (0, 1)
S = (I - beta k k^T) S + beta k v^T
o = S^T q
""",
}

_checked = {}


def result(name):
    if name not in _checked:
        m = spec_to_ir(SPECS[name])
        _checked[name] = (m, check(m))
    return _checked[name]


# ---- an independent evaluator of M -------------------------------------------------------------
def my_squash(p, x, center):
    r = math.log(p + 1e-6) - center
    return math.exp(-math.log(x) * r / (1 + abs(r)))


_compiled = {}


def value(expr, env, i):
    """expr at key channel i; env maps names to floats (per head) or lists (per channel)."""
    syms = sorted(expr.free_symbols, key=str)
    if expr not in _compiled:
        _compiled[expr] = sp.lambdify(syms, expr, [{"squash": my_squash}, "math"])
    f = _compiled[expr]
    return float(f(*[env[str(s)][i] if isinstance(env[str(s)], list) else env[str(s)] for s in syms]))


def vec(expr, env, K):
    return np.array([value(expr, env, i) for i in range(K)])


def with_lets(mixer, env, K):
    env = dict(env)
    for let in mixer.lets:
        v = [value(let.expr, env, i) for i in range(K)]
        env[let.name] = v if let.kind != "scalar" else v[0]
    return env


def build_M(mixer, env, K):
    env = with_lets(mixer, env, K)
    D = np.diag(vec(mixer.decay.value, env, K))
    if mixer.delta is None:
        return D
    A = np.eye(K) - np.outer(vec(mixer.delta.a, env, K), vec(mixer.delta.c, env, K))
    return A @ D if mixer.delta.order == "left" else D @ A


def draw(inp, rng, K, edge):
    """One token's value of an input: unit vectors where unit, else inside its declared range."""
    n = K if inp.kind != "scalar" else 1
    if inp.unit:
        x = rng.normal(size=n) * (rng.random(n) < 0.6)
        x = x if np.any(x) else np.eye(n)[0]
        return (x / np.linalg.norm(x)).tolist()
    lo, hi = float(inp.lo), float(inp.hi)
    if lo == -math.inf and hi == math.inf:
        lo, hi = -3.0, 3.0
    lo, hi = (hi - 6 if lo == -math.inf else lo), (lo + 6 if hi == math.inf else hi)
    eps = 1e-6 * (hi - lo)
    lo, hi = lo + eps * inp.lo_open, hi - eps * inp.hi_open
    x = np.where(rng.random(n) < 0.5, rng.choice([lo, hi], n), rng.uniform(lo, hi, n)) if edge \
        else rng.uniform(lo, hi, n)
    return x.tolist() if inp.kind != "scalar" else float(x[0])


def sample_env(mixer, rng, K, edge):
    """Inputs of the current token, with aux states run over a short random history of tokens."""
    aux = {a.name: [0.0] * K for a in mixer.aux}
    for _ in range(int(rng.integers(0, 4)) + 1):
        env = {i.name: draw(i, rng, K, edge) for i in mixer.inputs}
        env["h"] = int(rng.integers(0, 8))
        env.update({n: list(v) for n, v in aux.items()})
        env = with_lets(mixer, env, K)
        for a in mixer.aux:
            aux[a.name] = [value(a.decay, env, i) * env[a.name][i] + value(a.write, env, i) for i in range(K)]
    env.update(aux)
    return env


# ---- the facts -------------------------------------------------------------------------------
def test_deltanet():
    _, r = result("deltanet")
    assert r["eigenvalues"] == {"min": 0.0, "max": 1.0, "proved": True}
    assert r["spectral_norm_le_1"] == "proved" and r["contraction"]
    assert not r["negative_eigenvalues"] and r["stable"] and r["counterexample"] is None


def test_gdn_negeig():
    _, r = result("gdn_negeig")
    assert r["eigenvalues"] == {"min": -1.0, "max": 1.0, "proved": True}
    assert r["negative_eigenvalues"] and r["stable"]
    assert r["spectral_norm_le_1"] == "proved" and r["contraction"]


def test_gdn2_norm_disproved_with_real_counterexample():
    m, r = result("gdn2")
    assert r["eigenvalues"] == {"min": 0.0, "max": 1.0, "proved": True}
    assert r["stable"] and not r["negative_eigenvalues"]
    assert r["spectral_norm_le_1"] == "disproved" and not r["contraction"]
    ce = r["counterexample"]
    assert ce["spectral_norm"] > 1
    K, x = ce["K"], ce["inputs"]
    k, b, g = (np.broadcast_to(np.asarray(x[n], dtype=float), (K,)) for n in ("k", "b", "g"))
    assert abs(np.linalg.norm(k) - 1) < 1e-9 and np.all((0 <= b) & (b <= 1)) and np.all(g <= 0)
    M = (np.eye(K) - np.outer(k, b * k)) @ np.diag(np.exp(g))
    assert np.linalg.norm(M, 2) > 1 + 1e-6
    assert np.linalg.norm(M, 2) == pytest.approx(ce["spectral_norm"], rel=1e-9)


def test_gdn2_known_counterexample():  # the one in the docs: k = (1, 1)/sqrt 2, b = (1, 0), g = 0
    k, b = np.array([1.0, 1.0]) / np.sqrt(2), np.array([1.0, 0.0])
    assert np.linalg.norm(np.eye(2) - np.outer(k, b * k), 2) == pytest.approx(1.144, abs=1e-3)


def test_precond_deltanet():
    m, r = result("precond_deltanet")
    assert r["eigenvalues"] == {"min": -0.5, "max": 1.0, "proved": True}
    assert r["negative_eigenvalues"] and r["stable"]
    # a = beta m k is not parallel to c = k: the norm does exceed 1 (P is free per channel, e.g. one
    # channel's P built up by earlier tokens while another's is near zero)
    assert r["spectral_norm_le_1"] == "disproved" and not r["contraction"]
    ce = r["counterexample"]
    K, x = ce["K"], ce["inputs"]
    k, p = np.asarray(x["k"]), np.asarray(x["aux:p_atk"])
    assert abs(np.linalg.norm(k) - 1) < 1e-9 and np.all(p >= 0) and 0 < x["beta"] < 1 and x["g"] <= 0
    r_ = np.log(p + 1e-6) + 0.2
    mk = np.exp(-np.log(1.5) * r_ / (1 + np.abs(r_)))
    assert mk == pytest.approx(x["let:m_atk"], rel=1e-9)
    M = np.exp(x["g"]) * (np.eye(K) - x["beta"] * np.outer(mk * k, k))
    assert np.linalg.norm(M, 2) > 1 + 1e-6
    assert np.linalg.norm(M, 2) == pytest.approx(ce["spectral_norm"], rel=1e-9)


def test_wide_beta_unstable_unless_allowed():
    m, r = result("beta3")
    assert r["eigenvalues"]["proved"] and r["eigenvalues"]["min"] == -2.0
    assert not r["stable"] and r["spectral_norm_le_1"] == "disproved"
    msg = stability_error(m, r)
    assert msg and "beta" in msg and "allow unstable" in msg
    allowed = spec_to_ir(SPECS["beta3"] + "allow unstable\n")
    assert allowed.allow_unstable and stability_error(allowed, check(allowed)) is None


def test_sign_of_diagonal_decay():
    _, r = result("neg_diag")  # -|D|^1/2 (I - beta k k^T) |D|^1/2 up to similarity: real, in [-1, 0]
    assert r["eigenvalues"] == {"min": -1.0, "max": 0.0, "proved": True}
    assert r["negative_eigenvalues"] and r["stable"] and r["spectral_norm_le_1"] == "proved"
    m, r = result("mixed_diag")  # mixed signs and a non-normal erase: complex eigenvalues possible
    assert not r["eigenvalues"]["proved"] and not r["stable"]
    assert r["negative_eigenvalues"] is not False  # nothing excludes them: found, or unknown (null)
    assert stability_error(m, r) is not None


def test_symmetric_forms_have_their_norm_proved():
    """diag(d) - beta k k^T and D^1/2 (I - beta k k^T) D^1/2 are symmetric: with d in [0, 1] and
    beta in [0, 1] their eigenvalues lie in [-1, 1] (resp. [0, 1]), so the norm is at most 1."""
    for name, lo in (("diag_minus_rank1", -1.0), ("sqrt_sandwich", 0.0)):
        _, r = result(name)
        assert r["eigenvalues"]["proved"] and lo - 1e-9 <= r["eigenvalues"]["min"]
        assert r["facts"]["spectral_norm_le_1"] == "proved" and r["facts"]["bounded_state"] == "proved"
    # d = 0, beta -> 1, k = e_1: the eigenvalue -1 is approached; D^1/2 (...) D^1/2 is semi-definite
    assert result("diag_minus_rank1")[1]["negative_eigenvalues"] is True
    assert result("sqrt_sandwich")[1]["negative_eigenvalues"] is False
    # with d in (-1, 1) the eigenvalue d - beta reaches -2: refused, with a witness
    m, r = result("signed_diag_minus_rank1")
    assert r["facts"]["stable"] == "disproved" and r["witnesses"]["stable"]["value"] > 1.5
    assert "allow unstable" in stability_error(m, r)


def test_not_unit_key_is_unknown():
    m, r = result("not_unit")
    assert r["eigenvalues"] == {"min": None, "max": None, "proved": False}
    assert r["facts"]["stable"] == "disproved" and r["stable"] is False  # k = (4, 4): 1 - 32 beta
    assert r["negative_eigenvalues"] is not False
    assert r["spectral_norm_le_1"] == "disproved"  # k = (4, 4) already breaks it
    msg = stability_error(m, r)
    assert msg and "unit" in msg and "l2norm" in msg


def test_stable_specs_have_no_error_and_results_are_json():
    for name in SPECS:
        m, r = result(name)
        assert json.loads(json.dumps(r)) == r
        assert set(r) == {"eigenvalues", "spectral_norm_le_1", "counterexample", "negative_eigenvalues",
                          "stable", "contraction", "notes", "facts", "witnesses", "bounded_state"}
        assert set(r["facts"].values()) <= {"proved", "disproved", "unknown"}
        for old, new in (("stable", "stable"), ("negative_eigenvalues", "negative_eigenvalues"),
                         ("contraction", "spectral_norm_le_1")):  # the old booleans: null where unknown
            assert r[old] == {"proved": True, "disproved": False, "unknown": None}[r["facts"][new]]
        assert r["notes"] and all(isinstance(n, str) for n in r["notes"])
        assert (stability_error(m, r) is None) == (r["stable"] is True)
        text = explain(r)
        assert "eigenvalues" in text and "spectral norm" in text


def test_deterministic():
    m = spec_to_ir(SPECS["gdn2"])
    assert check(m) == check(m)


# ---- the numeric cross-check -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPECS))
def test_claims_hold_numerically(name):
    m, r = result(name)
    e = r["eigenvalues"]
    lo = -math.inf if e["min"] is None else e["min"]
    hi = math.inf if e["max"] is None else e["max"]
    rng = np.random.default_rng(1234)
    most_negative = math.inf
    for t in range(300):
        K = int(rng.integers(2, 7))
        env = sample_env(m, rng, K, edge=t % 2 == 1)
        M = build_M(m, env, K)
        assert np.all(np.isfinite(M))
        ev = np.linalg.eigvals(M)
        if e["proved"]:
            assert np.max(np.abs(ev.imag)) <= 1e-7, (env, ev)
            assert np.all(ev.real >= lo - 1e-9) and np.all(ev.real <= hi + 1e-9), (env, ev)
        most_negative = min(most_negative, float(np.min(ev.real)))
        if r["spectral_norm_le_1"] == "proved":
            assert np.linalg.norm(M, 2) <= 1 + 1e-9, env
    if r["negative_eigenvalues"] is False:
        assert most_negative >= -1e-9
    if e["proved"] and e["min"] is not None and e["min"] >= 0:
        assert most_negative >= -1e-9


GAINS = [("sigmoid(b)", "", False), ("b/(1+b)", "in (0, inf)", False), ("4*b*(1-b)", "in [0, 1]", False),
         ("1-(1-b)^2", "in [0, 1]", False), ("2*sigmoid(b)", "", True)]


@pytest.mark.parametrize("gain,rng,negative", GAINS, ids=[g for g, _, _ in GAINS])
def test_gains_built_from_one_input_get_their_true_range(gain, rng, negative):
    """Interval arithmetic forgets that both b of b/(1+b) are one number and refused these gains
    (eigenvalues 'reaching -inf'); each lies in [0, 1] (or (0, 2)), so the spec is stable."""
    text = (f"mixer s\ninput q[K], k[K] l2norm, v[V], g log, b {rng}\nlet beta = {gain}\n"
            "S = (I - (beta*k) k^T) exp(g) S + (beta*k) v^T\no = S^T q\n")
    facts = check(spec_to_ir(text))
    assert facts["stable"] and facts["negative_eigenvalues"] is negative
    lo, hi = facts["eigenvalues"]["min"], facts["eigenvalues"]["max"]
    # the sampled eigenvalue 1 - beta (a unit key) stays inside what was proved
    b = np.random.default_rng(0).uniform(-30, 30, 10000)
    if rng:
        b = np.abs(b) if "inf" in rng else np.random.default_rng(0).uniform(0, 1, 10000)
    beta = eval(gain.replace("^", "**"), {"sigmoid": lambda x: 1 / (1 + np.exp(-x)), "b": b})  # noqa: S307
    assert lo - 1e-9 <= (1 - beta).min() and (1 - beta).max() <= hi + 1e-9


# ---- refusal messages --------------------------------------------------------------------------
def refusal(text):
    m = spec_to_ir(text)
    return stability_error(m, check(m))


def test_refusal_names_the_expression_and_the_range_found():
    msg = refusal(SPECS["beta3"])
    assert "beta ranges over [0, 3]" in msg and "narrow the declared range of beta" in msg
    msg = refusal(SPECS["signed_diag_minus_rank1"])  # the decay's sign is the culprit as much as beta
    assert "e ranges over [-1, 1]" in msg and "narrow the declared range of beta, e" in msg
    msg = refusal("mixer m\ndecay constant 1.1\ngain none\n")  # no input to narrow
    assert "1.1" in msg and "narrow" not in msg and "magnitude at most 1" in msg


def test_refusal_advice_is_not_wrong_when_the_range_is_only_an_enclosure():
    """b c / (b + c) with b, c in (0, 1) lies in (0, 1/2): interval arithmetic says [0, inf], and no
    token breaks the bound, so telling the user to narrow b or c would be wrong advice."""
    text = ("mixer m\ninput q[K], k[K] l2norm, v[V], b in (0, 1), c in (0, 1)\nlet beta = b*c/(b+c)\n"
            "S = (I - beta k k^T) S + beta k v^T\no = S^T q\n")
    m = spec_to_ir(text)
    r = check(m)
    msg = stability_error(m, r)
    if r["facts"]["stable"] != "proved":  # (a better range analysis would prove it and accept the spec)
        assert r["facts"]["stable"] == "unknown" and "narrow the declared range" not in msg
        assert "possibly wider than the truth" in msg and "b*c/(b + c)" in msg
