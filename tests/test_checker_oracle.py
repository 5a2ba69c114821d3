"""A numeric oracle for every fact `check` states, over the examples and over generated specs.

Each spec here comes with its own numpy model of M_t, written from the recurrence it stands for
(decay x erase x ATK preconditioner, or decay +- a rank-1 term, the additive DPLR form), not from
lrdsl's IR: tokens are drawn inside the declared ranges (ATK states built by running their
recurrence over a random history), and
- a proved claim must hold on every sample (eigenvalues, norm, products of 2 and 3 steps);
- a witness must be admissible (its inputs inside the declared ranges, unit keys of norm 1, aux
  states equal to those the recurrence reaches from zero) and must show what it claims when the
  model replays it; a bounded-state witness is also replayed in lrdsl's float64 reference scan.
"""
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrdsl.checks.checker import check
from lrdsl.frontend import spec_to_ir

ROOT = Path(__file__).resolve().parent.parent
sigmoid = lambda x: 0.5 * (1 + np.tanh(x / 2))  # noqa: E731  (no overflow at b = -1e3)
INF = math.inf
# gain expressions of one input b: (spec text, numpy function, range of b)
GAINS = {"beta": ("b", lambda b: b, None), "sigmoid": ("sigmoid(b)", sigmoid, (-INF, INF, True, True)),
         "2sigmoid": ("2*sigmoid(b)", lambda b: 2 * sigmoid(b), (-INF, INF, True, True)),
         "ratio": ("b/(1 + b)", lambda b: b / (1 + b), (0, INF, True, True)),
         "parabola": ("4*b*(1 - b)", lambda b: 4 * b * (1 - b), (0, 1, False, False)),
         "square": ("1 - (1 - b)^2", lambda b: 1 - (1 - b) ** 2, (0, 1, False, False))}


@dataclass(frozen=True)
class Model:
    """One spec: its text and, independently, what its transition is."""
    decay: str  # none | const (1 - 2^(-5-h)) | exp_scalar | exp_diag | signed_scalar | signed_diag
    gain: str  # none | scalar | channel
    gain_fn: str = "beta"  # a key of GAINS (scalar gains)
    b_range: tuple = (0, 1, True, True)  # (lo, hi, lo_open, hi_open) of b (or of beta itself)
    d_range: tuple = (-1, 1, True, True)  # of d for the signed decays
    unit_key: bool = True
    atk: tuple | None = None  # (x, center, hi of beta_atk)
    order: str = "left"  # left: (erase) D, right: D (erase), sum: D +- gain x y^T (no I)
    # the erase is I +- gain x y^T with x, y named: "k" is the write key, any other name its own
    # unit input (RWKV-7's kk, Comba's p, DPLR's a and b); ATK's m multiplies x
    dirs: tuple = ("k", "k")
    sign: int = -1  # -1: I - gain x y^T (the delta rule), +1: I + gain x y^T (DPLR, IPLR)

    def ranges(self) -> dict:
        """Declared range of every input the transition reads."""
        r = {}
        if self.decay.startswith("exp"):
            r["g"] = (-INF, 0, True, False)
        if self.decay.startswith("signed"):
            r["d"] = self.d_range
        if self.gain != "none":
            r["b"] = self.b_range
        if self.gain == "scalar" and GAINS[self.gain_fn][2] is not None:
            r["b"] = GAINS[self.gain_fn][2]
        if self.atk:
            r.update(g_atk=(-INF, 0, True, False), beta_atk=(0, self.atk[2], True, True))
        return r

    def reads(self) -> set:
        """The vectors the transition reads beside the ranged inputs (ATK's P reads k)."""
        return (set(self.dirs) | ({"k"} if self.atk else set())) if self.gain != "none" else set()

    def text(self) -> str:
        fmt = lambda r: f"{'(' if r[2] else '['}{r[0]}, {r[1]}{')' if r[3] else ']'}"
        rng = self.ranges()
        decl = [f"k[K]{' l2norm' if self.unit_key else ''}", "q[K]", "v[V]"]
        decl += [f"{n}[K] l2norm" for n in sorted(self.reads() - {"k"})]
        D = {"none": "", "const": "(1 - 2^(-5 - h))", "exp_scalar": "exp(g)", "exp_diag": "diag(exp(g))",
             "signed_scalar": "d", "signed_diag": "diag(d)"}[self.decay]
        if self.decay.startswith("exp"):
            decl.append(f"g{'[K]' if self.decay == 'exp_diag' else ''} log")
        if self.decay.startswith("signed"):
            decl.append(f"d{'[K]' if self.decay == 'signed_diag' else ''} in {fmt(rng['d'])}")
        lines = []
        x, y = self.dirs
        mk = x
        if self.atk:
            decl += ["g_atk log shared", f"beta_atk shared in {fmt(rng['beta_atk'])}"]
            lines += ["state P[K] = exp(g_atk) * P + beta_atk * k * k",
                      f"let m = squash(P, x = {self.atk[0]}, center = {self.atk[1]})"]
            mk = f"(m*{x})"
        E = ""
        if self.gain == "scalar":
            decl.append(f"b in {fmt(rng['b'])}")
            lines.append(f"let beta = {GAINS[self.gain_fn][0]}")
            E = f"beta {mk} {y}^T"
        elif self.gain == "channel":
            decl.append(f"b[K] in {fmt(rng['b'])}")
            E = f"{mk} (b*{y})^T"
        pm = "-" if self.sign < 0 else "+"
        if self.order == "sum" and E:  # D +- E as written: a number per head stands beside I
            left = f"({D if self.decay.endswith('diag') else f'{D} I'.strip()} {pm} {E})"
        else:
            E = f"(I {pm} {E})" if E else ""
            left = " ".join(t for t in ((E, D) if self.order == "left" else (D, E)) if t)
        return "\n".join(["mixer oracle", "input " + ", ".join(decl), *lines,
                          f"S = {left + ' ' if left else ''}S + k v^T", "o = S^T q"]) + "\n"

    # -- the numeric side
    def m_vector(self, P):
        x, center, _ = self.atk
        r = np.log(P + 1e-6) - center
        return np.exp(-np.log(x) * r / (1 + np.abs(r)))

    def step_aux(self, tok, P):
        return np.exp(tok["g_atk"]) * P + tok["beta_atk"] * np.asarray(tok["k"]) ** 2 if self.atk else P

    def matrix(self, tok, P, K, h=0):
        D = {"none": lambda: np.ones(K), "const": lambda: np.full(K, 1 - 2.0 ** (-5 - h)),
             "exp_scalar": lambda: np.full(K, np.exp(tok["g"])), "exp_diag": lambda: np.exp(tok["g"]),
             "signed_scalar": lambda: np.full(K, tok["d"]), "signed_diag": lambda: np.asarray(tok["d"])}[self.decay]()
        x, y = (np.asarray(tok.get(n, np.zeros(K)), dtype=float) for n in self.dirs)
        mx = self.m_vector(P) * x if self.atk else x
        R = np.zeros((K, K))  # the rank-1 term gain x y^T
        if self.gain == "scalar":
            R = GAINS[self.gain_fn][1](tok["b"]) * np.outer(mx, y)
        elif self.gain == "channel":
            R = np.outer(mx, np.asarray(tok["b"]) * y)
        if self.order == "sum":
            return np.diag(D) + self.sign * R
        E = np.eye(K) + self.sign * R
        return E @ np.diag(D) if self.order == "left" else np.diag(D) @ E


@dataclass(frozen=True)
class Product:
    """A product of steps per token (DeltaProduct): factor j is a Model reading the inputs it names
    as the spec names them (names: model's name -> spec's), M = M_n ... M_1."""
    factors: tuple  # (Model, {model name: spec name}), the first step first
    atk = None
    unit_key = True

    def ranges(self) -> dict:
        return {names.get(n, n): r for m, names in self.factors for n, r in m.ranges().items()}

    def reads(self) -> set:
        return {names.get(n, n) for m, names in self.factors for n in m.reads()}

    def token(self, rng, K, edge) -> dict:
        out = {}
        for m, names in self.factors:
            out.update({names.get(n, n): v for n, v in token(m, rng, K, edge).items()})
        return out

    def step_aux(self, tok, P):
        return P

    def matrix(self, tok, P, K, h=0):
        M = np.eye(K)
        for m, names in self.factors:
            M = m.matrix({n: tok[names.get(n, n)] for n in {*m.ranges(), *m.reads()}}, P, K, h) @ M
        return M


def _delta_product(n: int, b_range: tuple) -> Product:
    first = (Model("exp_scalar", "scalar", b_range=b_range), {"b": "b1"})
    return Product((first, *((Model("none", "scalar", b_range=b_range), {"k": f"k{j}", "b": f"b{j}"})
                             for j in range(2, n + 1))))


EXAMPLES = {
    "delta_product2": _delta_product(2, (0, 1, True, True)),
    "delta_product3": _delta_product(3, (0, 2, True, True)),
    "linear_attention": Model("none", "none"), "retnet": Model("const", "none"),
    "mamba2": Model("exp_scalar", "none"), "mesa": Model("exp_scalar", "none"), "gla": Model("exp_diag", "none"),
    "mesa_retention": Model("const", "none"),
    "deltanet": Model("none", "scalar"), "gated_deltanet": Model("exp_scalar", "scalar"),
    # g = -exp(A_log) softplus(a + dt_bias) spans g <= 0 (open at 0), beta = sigmoid(b) spans (0, 1)
    "gated_deltanet_gates": Model("exp_scalar", "scalar", gain_fn="sigmoid"),
    "gated_deltanet_negeig": Model("exp_scalar", "scalar", b_range=(0, 2, True, True)),
    "kda": Model("exp_diag", "scalar"), "kda_decay_after_erase": Model("exp_diag", "scalar", order="right"),
    # the value side: N = diag(exp(gv)) (I - beta v v^T) is kda_decay_after_erase's matrix over V channels
    "oja": Model("exp_diag", "scalar", order="right"),
    "gdn2": Model("exp_diag", "channel", b_range=(0, 1, False, False)),
    "channel_gates_scalar_decay": Model("exp_scalar", "channel", b_range=(0, 1, False, False)),
    "gdn2_atk": Model("exp_diag", "channel", b_range=(0, 1, False, False), atk=(1.5, -0.2, 1)),
    "precond_deltanet": Model("exp_scalar", "scalar", atk=(1.5, -0.2, 1)),
    "precond_kda": Model("exp_diag", "scalar", atk=(1.5, -0.2, 1)),
    "rwkv6": Model("exp_diag", "none"),
    # diag(exp(w)) - kk (a*kk)^T, a unit kk of its own and a in [0, 1]
    "rwkv7": Model("exp_diag", "channel", b_range=(0, 1, False, False), dirs=("e", "e"), order="sum"),
    # diag(exp(gk)) + (beta*b) a^T and I + (beta*b) a^T, with unit a and b and beta in [0, 1]
    "dplr": Model("exp_diag", "scalar", b_range=(0, 1, False, False), dirs=("x", "y"), sign=1, order="sum"),
    "iplr": Model("none", "channel", b_range=(0, 1, False, False), dirs=("e", "e"), order="sum"),
    # (I - beta k p^T) exp(g), beta in (0, 1), unit k and p
    "comba": Model("exp_scalar", "scalar", dirs=("k", "p")),
}
# names of the examples' inputs that differ from the models' (the models call them g, b, g_atk, ...)
RENAME = {"precond_deltanet": {"beta": "b"}, "precond_kda": {"beta": "b"}, "kda": {"beta": "b"},
          "kda_decay_after_erase": {"beta": "b"}, "deltanet": {"beta": "b"}, "gated_deltanet": {"beta": "b"},
          "gated_deltanet_negeig": {"beta": "b"}, "rwkv6": {"w": "g"}, "rwkv7": {"w": "g", "kk": "e", "a": "b"},
          "dplr": {"gk": "g", "beta": "b", "b": "x", "a": "y"}, "iplr": {"kk": "e", "a": "b"},
          "comba": {"beta": "b"}}


def renamed(tok: dict, names: dict) -> dict:
    return {names.get(k, k): v for k, v in tok.items()}


# ---- sampling admissible sequences --------------------------------------------------------------
def draw(rng, r, n, edge):
    lo, hi, lo_open, hi_open = r
    if lo == -INF:
        lo = hi - 8.0 if hi < INF else -8.0
    if hi == INF:
        hi = lo + 16.0
    eps = 1e-9 * max(1.0, hi - lo)
    lo, hi = lo + eps * lo_open, hi - eps * hi_open
    x = rng.uniform(lo, hi, n)
    if edge:  # entries at the ends, or the whole vector at one end (no decay on any channel)
        x = np.where(rng.random(n) < 0.5, rng.choice([lo, hi], n), x)
        x = np.full(n, rng.choice([lo, hi])) if rng.random() < 0.4 else x
    return x


def sparse_vector(rng, K):
    u = rng.normal(size=K) * (rng.random(K) < 0.7)
    return u if u.any() else np.eye(K)[0]


def token(model: Model, rng, K, edge):
    k = sparse_vector(rng, K)
    tok = {"k": k / np.linalg.norm(k) if model.unit_key else k * rng.choice([0.3, 1.0, 3.0])}
    for n in sorted(model.reads() - {"k"}):
        u = sparse_vector(rng, K)
        tok[n] = u / np.linalg.norm(u)
    x, y = model.dirs
    if edge and x != y and rng.random() < 0.5:  # y = +-x: the extremes of a two-direction erase
        tok[y] = rng.choice([-1.0, 1.0]) * tok[x] / np.linalg.norm(tok[x])
    per_channel = {"g": model.decay == "exp_diag", "d": model.decay == "signed_diag", "b": model.gain == "channel",
                   "g_atk": False, "beta_atk": False}
    for name, r in model.ranges().items():
        v = draw(rng, r, K if per_channel[name] else 1, edge)
        tok[name] = v if per_channel[name] else float(v[0])
    return tok


def samples(model: Model, rng, count, steps=1):
    """(K, h, [M_1, ..., M_steps]) for admissible sequences: a random history, then the steps."""
    for t in range(count):
        K, h, edge = int(rng.integers(2, 5)), int(rng.integers(0, 8)), t % 2 == 1
        P = np.zeros(K)
        for _ in range(int(rng.integers(0, 6)) if model.atk else 0):
            P = model.step_aux(token(model, rng, K, edge), P)
        Ms = []
        for _ in range(steps):
            tok = model.token(rng, K, edge) if isinstance(model, Product) else token(model, rng, K, edge)
            P = model.step_aux(tok, P)
            Ms.append(model.matrix(tok, P, K, h))
        yield K, h, Ms


def real_eigs(M):
    ev = np.linalg.eigvals(M)
    return ev[np.abs(ev.imag) <= 1e-9 * np.maximum(1, np.abs(ev))].real, ev


def assert_claims_hold(model: Model, r: dict, count=300, seed=0):
    rng, f, e = np.random.default_rng(seed), r["facts"], r["eigenvalues"]
    lo = -INF if e["min"] is None else e["min"]
    hi = INF if e["max"] is None else e["max"]
    for K, h, (M,) in samples(model, rng, count):
        real, ev = real_eigs(M)
        if e["proved"]:
            assert len(real) == K and np.all(real >= lo - 1e-9) and np.all(real <= hi + 1e-9), (ev, e)
        if f["stable"] == "proved":
            assert np.abs(ev).max() <= 1 + 1e-9, ev
        if f["negative_eigenvalues"] == "disproved":
            assert np.all(real >= -1e-9), ev
        if f["spectral_norm_le_1"] == "proved":
            assert np.linalg.norm(M, 2) <= 1 + 1e-9
    if f["bounded_state"] == "proved":
        for steps in (2, 3):
            for K, h, Ms in samples(model, rng, count // 2, steps):
                P = np.linalg.multi_dot(Ms[::-1])
                assert np.abs(np.linalg.eigvals(P)).max() <= 1 + 1e-9 and np.linalg.norm(P, 2) <= 1 + 1e-9


# ---- witnesses -----------------------------------------------------------------------------------
def assert_admissible(model: Model, tok: dict, K):
    # a witness holds exactly the inputs the transition reads
    assert set(tok) == set(model.ranges()) | model.reads(), tok
    for n in model.reads():
        u = np.asarray(tok[n], dtype=float)
        assert u.shape == (K,) and (n == "k" and not model.unit_key or abs(np.linalg.norm(u) - 1) < 1e-9), (n, u)
    for name, (lo, hi, lo_open, hi_open) in model.ranges().items():
        x = np.asarray(tok[name], dtype=float)
        assert np.all(x > lo if lo_open else x >= lo) and np.all(x < hi if hi_open else x <= hi), (name, x)


def replay(model: Model, w: dict, names: dict):
    """The transitions of the witness's steps under the model, checking admissibility and the aux
    states the checker reported on the way."""
    K, h = w["K"], w.get("h", 0)
    P = np.zeros(K)
    pre = w["prefix"]
    for _ in range(pre["repeat"] if pre else 0):
        tok = renamed(pre["inputs"], names)
        assert_admissible(model, tok, K)
        P = model.step_aux(tok, P)
    Ms = []
    for i, raw in enumerate(w["steps"]):
        tok = renamed(raw, names)
        assert_admissible(model, tok, K)
        P = model.step_aux(tok, P)
        Ms.append(model.matrix(tok, P, K, h))
        if model.atk and i == len(w["steps"]) - 1:
            aux = [v for k, v in w["at_last_step"].items() if k.startswith("aux:")]
            assert np.allclose(aux[0], P, rtol=1e-9, atol=1e-12), (aux, P)  # reached, not made up
    return Ms


def assert_witnesses_replay(model: Model, r: dict, names: dict):
    for fact, w in r["witnesses"].items():
        Ms = replay(model, w, names)
        P = np.linalg.multi_dot(Ms[::-1]) if len(Ms) > 1 else Ms[0]
        real, ev = real_eigs(P)
        if fact == "stable":
            assert r["facts"][fact] == "disproved" and np.abs(ev).max() > 1 + 1e-9
        elif fact == "negative_eigenvalues":
            assert r["facts"][fact] == "proved" and real.min() < -1e-7
        elif fact == "spectral_norm_le_1":
            assert r["facts"][fact] == "disproved" and np.linalg.norm(P, 2) > 1 + 1e-9
        else:
            assert fact == "bounded_state" and r["facts"][fact] == "disproved"
            assert np.abs(ev).max() > 1 + 1e-6 and w["replay"]["growth"] >= 1e4
    for fact, status in r["facts"].items():  # a verdict settled by an example always has one
        assert (fact in r["witnesses"]) == (status == ("proved" if fact == "negative_eigenvalues" else "disproved"))


# ---- the examples --------------------------------------------------------------------------------
_facts = {}


def example(name):
    if name not in _facts:
        _facts[name] = check(spec_to_ir((ROOT / "examples" / f"{name}.lr").read_text()))
    return _facts[name]


def test_every_example_has_a_model():
    assert set(EXAMPLES) == {p.stem for p in (ROOT / "examples").glob("*.lr")}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_claims_against_the_oracle(name):
    r = example(name)
    assert_claims_hold(EXAMPLES[name], r)
    assert_witnesses_replay(EXAMPLES[name], r, RENAME.get(name, {}))


@pytest.mark.parametrize("name,bounded", [("gated_deltanet", "proved"), ("deltanet", "proved"), ("kda", "proved"),
                                          ("gdn2", "disproved"), ("gdn2_atk", "disproved"),
                                          ("channel_gates_scalar_decay", "disproved")])
def test_bounded_state_of_the_delta_rule_family(name, bounded):
    """What the issue established by hand: (I - beta k k^T) with beta in (0, 1) is a contraction;
    GDN-2's channel-wise erase is not normal, and two alternating tokens grow the state."""
    assert example(name)["facts"]["bounded_state"] == bounded


def test_gdn2_two_token_cycle_from_the_issue_grows():  # independent of the checker: the oracle itself
    model = EXAMPLES["gdn2"]
    best = 0.0
    rng = np.random.default_rng(3)
    for _ in range(4000):
        toks = [token(model, rng, 2, True) for _ in range(2)]
        for t in toks:
            t["g"] = np.zeros(2)
        P = model.matrix(toks[1], None, 2) @ model.matrix(toks[0], None, 2)
        best = max(best, np.abs(np.linalg.eigvals(P)).max())
    assert best > 1.1


@pytest.mark.parametrize("name", ["gdn2", "channel_gates_scalar_decay", "gdn2_atk", "rwkv7", "dplr", "iplr", "comba"])
def test_bounded_state_witness_grows_in_the_reference_scan(name):
    """Replay the cycle in lrdsl's float64 reference (torch), from S_0 = I with v = 0."""
    import torch

    import lrdsl
    w = example(name)["witnesses"]["bounded_state"]
    mixer = lrdsl.compile(ROOT / "examples" / f"{name}.lr", load_kernels=False)
    K, pre = w["K"], w["prefix"]
    prefix = [pre["inputs"]] * pre["repeat"] if pre else []
    cycles = 1 + (w["replay"]["tokens"] - len(prefix)) // len(w["steps"])
    tokens = prefix + w["steps"] * cycles

    def run(toks):  # B = 1, H = HV = 1; inputs the transition does not read (the write gate) are zero
        T = len(toks)
        args = {}
        for i in mixer.ir.inputs:
            shape = (1, T, 1) if i.kind == "scalar" else (1, T, 1, K)
            vals = [np.broadcast_to(np.asarray(t.get(i.name, 0.0), dtype=float), shape[3:]) for t in toks]
            args[i.name] = torch.tensor(np.array(vals), dtype=torch.float64).reshape(shape)
        args.pop("q"), args.pop("v")
        q = torch.zeros(1, T, 1, K, dtype=torch.float64)
        v = torch.zeros(1, T, 1, K, dtype=torch.float64)
        S0 = torch.eye(K, dtype=torch.float64).reshape(1, 1, K, K)
        _, S = mixer.reference(q, args.pop("k"), v, **args, initial_state=S0, output_final_state=True)
        S = S.S if isinstance(S, lrdsl.MixerState) else S  # the whole state of an ATK spec: S alone grows
        return S.norm().item()

    start = run(prefix) if prefix else math.sqrt(K)
    assert run(tokens) / start > 1e3


def test_the_oracle_catches_false_claims():
    """The oracle is not vacuous: claims that are false for gdn2 and for beta in (0, 2) fail it."""
    r = example("gdn2")
    with pytest.raises(AssertionError):
        assert_claims_hold(EXAMPLES["gdn2"], {**r, "facts": {**r["facts"], "spectral_norm_le_1": "proved"}})
    with pytest.raises(AssertionError):
        assert_claims_hold(EXAMPLES["gdn2"], {**r, "facts": {**r["facts"], "bounded_state": "proved"}})
    r = example("gated_deltanet_negeig")
    with pytest.raises(AssertionError):
        assert_claims_hold(EXAMPLES["gated_deltanet_negeig"],
                           {**r, "facts": {**r["facts"], "negative_eigenvalues": "disproved"}})


ADDITIVE_FALSE_CLAIMS = {  # each false for its example: the oracle must reject it
    "rwkv7-norm": ("rwkv7", {"spectral_norm_le_1": "proved"}), "rwkv7-bounded": ("rwkv7", {"bounded_state": "proved"}),
    "rwkv7-negeig": ("rwkv7", {"negative_eigenvalues": "disproved"}),
    "rwkv7-eig": ("rwkv7", {"eigenvalues": {"min": -0.99, "max": 1, "proved": True}}),
    "dplr-stable": ("dplr", {"stable": "proved"}), "iplr-bounded": ("iplr", {"bounded_state": "proved"}),
    "comba-stable": ("comba", {"stable": "proved"})}


@pytest.mark.parametrize("case", sorted(ADDITIVE_FALSE_CLAIMS))
def test_the_oracle_catches_false_claims_of_the_new_forms(case):
    """The oracle is not vacuous for erases along their own directions and the additive form either:
    RWKV-7's eigenvalues reach -1 and its norm exceeds 1; DPLR's, IPLR's and Comba's leave [-1, 1]."""
    name, claim = ADDITIVE_FALSE_CLAIMS[case]
    r = example(name)
    facts = {**r["facts"], **{k: v for k, v in claim.items() if k != "eigenvalues"}}
    with pytest.raises(AssertionError):
        assert_claims_hold(EXAMPLES[name], {**r, "facts": facts, "eigenvalues": claim.get("eigenvalues", r["eigenvalues"])})


# ---- generated specs -----------------------------------------------------------------------------
@st.composite
def models(draw):
    """Gains built from monotone functions of one input, signed decays, unnormalised keys, ATK with
    various options, channel-wise gates with strong decays, all three orders, erases along their own
    unit directions (x = y as RWKV-7's, x != y as Comba's) and with either sign."""
    decay = draw(st.sampled_from(["none", "const", "exp_scalar", "exp_diag", "signed_scalar", "signed_diag"]))
    gain = draw(st.sampled_from(["none", "scalar", "channel"]))
    hi = draw(st.sampled_from([1, 2, 3]))
    d_range = draw(st.sampled_from([(-1, 1, True, True), (0, 1, False, False), (-1, 0, True, False),
                                    (-0.5, 1, False, True), (0, 2, True, True)]))
    atk = draw(st.sampled_from([None, (1.5, -0.2, 1), (2, 0.5, 1), (1.25, -0.2, 0.5)])) if gain != "none" else None
    return Model(decay, gain, gain_fn=draw(st.sampled_from(sorted(GAINS))),
                 b_range=(0, hi, draw(st.booleans()), True), d_range=d_range,
                 unit_key=draw(st.sampled_from([True, True, True, False])) if gain != "none" else True,
                 atk=atk, order=draw(st.sampled_from(["left", "right", "sum"])),
                 dirs=draw(st.sampled_from([("k", "k"), ("k", "k"), ("e", "e"), ("k", "p")])),
                 sign=draw(st.sampled_from([-1, -1, -1, 1])))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(models())  # 10 in pytest -q; 100 more (random) below under -m slow
def test_generated_specs_against_the_oracle(model):
    r = check(spec_to_ir(model.text()))
    assert_claims_hold(model, r, count=120)
    assert_witnesses_replay(model, r, {})


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_many_generated_specs_against_the_oracle(model):
    r = check(spec_to_ir(model.text()))
    assert_claims_hold(model, r, count=300)
    assert_witnesses_replay(model, r, {})
