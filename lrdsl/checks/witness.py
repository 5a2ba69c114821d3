"""Numeric witnesses: concrete admissible token sequences that settle what the symbolic analysis
could not, found by random search and local refinement at a small K (2 to 4), and replayed before
they are reported.

A witness is a prefix (one token repeated a few times, which builds up the auxiliary states, such
as the ATK preconditioner's P, through their own recurrences from zero: only reachable states are
ever used) followed by the tokens that matter: one step (its spectral norm, its spectral radius, a
negative eigenvalue) or a cycle of 1 to 4 steps whose product has spectral radius above 1, so that
repeating it grows the state geometrically.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import sympy as sp

from lrdsl.checks.ranges import INF
from lrdsl.frontend import ir, primitives

PREFIXES = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34])  # prefix lengths drawn when there are aux states
REPLAY_GROWTH = 1e4  # a cycle's replay must grow the state this much ...
REPLAY_TOKENS = 6000  # ... within this many tokens


@dataclass(frozen=True)
class Numeric:
    """numpy functions of one token: the transition's d, a, c and the aux states' decay and write."""
    mixer: ir.Mixer
    args: tuple  # names of the symbols every function takes, in this order
    inputs: tuple  # the declared inputs among them
    d: object
    a: object
    c: object
    aux: tuple  # (name, decay, write), in the reference's order
    lets: tuple  # (name, kind, expression): reported with a witness (let_functions)
    aux_free: bool  # no aux state's decay or write reads an aux state (they batch over tokens)
    uses_h: bool  # the head index appears: a witness names its h
    # a product's later steps: (a, c) of each, (None, None) for one without erase; M is their
    # factors (I - a c^T), last leftmost, times the first step's transition
    more: tuple = ()


def _fn(args, e):
    return sp.lambdify(args, primitives.expanded(e), [primitives.NUMPY, "numpy"])


def numeric(mixer: ir.Mixer) -> Numeric:
    m = mixer
    exprs = [m.decay.value] + ([m.delta.a, m.delta.c] if m.delta else [])
    exprs = [m.inline_lets(e) for e in exprs]
    more = [tuple(m.inline_lets(e) for e in (st.delta.a, st.delta.c)) for st in m.steps if st.delta is not None]
    aux = [(x.name, m.inline_lets(x.decay), m.inline_lets(x.write)) for x in m.aux]
    syms = set().union(*(sp.sympify(e).free_symbols for e in exprs + [e for _, *p in aux for e in p]
                         + [e for ac in more for e in ac]))
    syms |= {ir.symbol(x.name) for x in m.aux} | {ir.HEAD}
    args = tuple(sorted(syms, key=str))
    lets = [(lt.name, lt.kind, m.inline_lets(lt.expr)) for lt in m.lets]
    return Numeric(m, tuple(map(str, args)), tuple(i for i in (*m.inputs, *m.params) if i.symbol in syms),
                   *[_fn(args, e) for e in exprs] + [None] * (3 - len(exprs)),
                   tuple((n, _fn(args, dc), _fn(args, w)) for n, dc, w in aux),
                   tuple((n, k, e) for n, k, e in lets if sp.sympify(e).free_symbols <= syms),
                   not any(sp.sympify(e).has(ir.symbol(x.name)) for _, *p in aux for e in p for x in m.aux),
                   any(sp.sympify(e).has(ir.HEAD) for e in exprs + [e for _, *p in aux for e in p]),
                   tuple((_fn(args, a), _fn(args, c)) for a, c in more))


@functools.lru_cache(maxsize=8)
def let_functions(num: Numeric) -> tuple:
    """The lets' numpy functions, made when a witness first reports them: lambdify costs
    milliseconds a let, which a spec of a thousand lets should not pay on every check."""
    args = tuple(ir.HEAD if a == str(ir.HEAD) else ir.symbol(a) for a in num.args)  # as numeric() sorted them
    return tuple(_fn(args, e) for _, _, e in num.lets)


# ---- admissible values ---------------------------------------------------------------------------
def box(inp: ir.Input):
    """(lo, hi, notable points) to draw a declared range from: open ends nudged inside, infinite
    ends replaced by a finite stretch plus one far point (extremes live at the ends)."""
    lo, hi, far = float(inp.lo), float(inp.hi), []
    if lo == -INF and hi == INF:
        lo, hi, far = -4.0, 4.0, [-1e3, 1e3]
    elif lo == -INF:
        lo, far = hi - 8, [hi - 1e3]
    elif hi == INF:
        hi, far = lo + 8, [lo + 1e3]
    eps = 1e-6 * max(1.0, hi - lo)
    lo, hi = lo + eps * inp.lo_open, hi - eps * inp.hi_open
    return lo, hi, [lo, hi, (lo + hi) / 2, lo + 1e-3 * (hi - lo), hi - 1e-3 * (hi - lo)] + far


def _unit(rng, n, K):
    if K == 2:  # a grid of angles: the worst directions for K = 2 are easy to miss at random
        t = rng.choice(np.linspace(0, np.pi, 49), n)
        return np.stack([np.cos(t), np.sin(t)], axis=1)
    x = rng.normal(size=(n, K)) * (rng.random((n, K)) < 0.7)  # some sparse directions too
    x[np.abs(x).sum(axis=1) == 0, 0] = 1.0
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _vector(inp) -> bool:
    return inp.kind != "scalar"


def _draw(rng, inp, n, K):
    if inp.unit and _vector(inp):
        return _unit(rng, n, K)
    lo, hi, points = box(inp)
    shape = (n, K if _vector(inp) else 1)
    x = rng.uniform(lo, hi, shape)
    x = np.where(rng.random(shape) < 0.4, rng.choice(points, shape), x)  # entries at notable points
    whole = rng.random((n, 1)) < 0.3  # whole rows at one notable point: e.g. no decay on any channel
    return np.where(whole, rng.choice(points, (n, 1)), x)


def _nudge(rng, inp, x, scale):
    if inp.unit and _vector(inp):
        y = x + scale * rng.normal(size=x.shape)
        return y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-300)
    lo, hi, points = box(inp)
    y = x + scale * (hi - lo) * rng.normal(size=x.shape) * (rng.random(x.shape) < 0.5)
    y = np.where(rng.random(x.shape) < 0.1, rng.choice(points[:2], x.shape), y)  # or snap to an end
    return np.clip(y, min(points), max(points))


@dataclass(frozen=True)
class Seqs:
    """n candidate sequences: h, the prefix token repeated reps times, then the steps."""
    h: np.ndarray  # (n, 1)
    reps: np.ndarray  # (n,)
    prefix: dict  # input name -> (n, K) or (n, 1)
    steps: tuple  # of dicts like prefix

    def take(self, idx) -> Seqs:
        pick = lambda tok: {k: v[idx] for k, v in tok.items()}
        return Seqs(self.h[idx], self.reps[idx], pick(self.prefix), tuple(pick(t) for t in self.steps))


def _sample(rng, num: Numeric, n, K, steps) -> Seqs:
    token = lambda: {i.name: _draw(rng, i, n, K) for i in num.inputs}
    reps = rng.choice(PREFIXES, n) if num.aux else np.zeros(n, dtype=int)
    cycle = [token() for _ in range(steps)]
    for tok in cycle[1:]:  # gates and decays repeated from the first step half the time
        for i in num.inputs:
            if not i.unit:
                tok[i.name] = np.where(rng.random((n, 1)) < 0.5, cycle[0][i.name], tok[i.name])
    h = rng.integers(0, 8, (n, 1)) if num.uses_h else np.zeros((n, 1))
    return _tie(num, Seqs(h.astype(float), reps, token(), tuple(cycle)))


def _perturb(rng, num: Numeric, s: Seqs, scale) -> Seqs:
    move = lambda tok: {i.name: _nudge(rng, i, tok[i.name], scale) for i in num.inputs}
    return _tie(num, Seqs(s.h, s.reps, move(s.prefix) if num.aux else s.prefix, tuple(move(t) for t in s.steps)))


def _tie(num: Numeric, s: Seqs) -> Seqs:
    """A param holds one value for the whole sequence: every token takes the first step's."""
    same = {i.name: s.steps[0][i.name] for i in num.inputs if isinstance(i, ir.Param)}
    if not same:
        return s
    return Seqs(s.h, s.reps, {**s.prefix, **same}, tuple({**t, **same} for t in s.steps))


# ---- evaluation, batched over candidates --------------------------------------------------------
def _call(num, f, env, n, K):
    with np.errstate(all="ignore"):  # exp(1e3) at a far point is inf: such candidates are dropped
        out = f(*[env[a] for a in num.args])
    return np.broadcast_to(np.asarray(out, dtype=float), (n, K))


def _advance(num, env, n, K):
    """Update the aux states in env with the token in env, in the reference's order."""
    for name, decay, write in num.aux:
        env[name] = _call(num, decay, env, n, K) * env[name] + _call(num, write, env, n, K)


def _matrix(num, env, n, K):
    with np.errstate(all="ignore"):  # c = k/d at d = 0 is inf: such candidates are dropped
        return _transition(num, env, n, K)


def _transition(num, env, n, K):
    M = _first(num, env, n, K)
    for fa, fc in num.more:  # a product's later factors (I - a c^T), each on the left
        a, c = _call(num, fa, env, n, K), _call(num, fc, env, n, K)
        M = M - a[:, :, None] * np.einsum("nk,nkj->nj", c, M)[:, None, :]
    return M


def _first(num, env, n, K):
    d = _call(num, num.d, env, n, K)
    M = d[:, :, None] * np.eye(K)
    if num.a is None:
        return M
    a, c = _call(num, num.a, env, n, K), _call(num, num.c, env, n, K)
    if num.mixer.delta.order == "left":  # (I - a c^T) D
        return M - a[:, :, None] * (c * d)[:, None, :]
    if num.mixer.delta.order == "sum":  # D - a c^T
        return M - a[:, :, None] * c[:, None, :]
    return M - (d * a)[:, :, None] * c[:, None, :]  # D (I - a c^T)


def products(num: Numeric, s: Seqs, K, passes=(0,)):
    """Product of the steps' transitions (last step leftmost) after the prefix, at each of the
    given passes over the steps (the aux states move on between passes); and the env at the last
    step of the first pass."""
    n = len(s.reps)
    env = {"h": s.h, **{name: np.zeros((n, K)) for name, _, _ in num.aux}}
    for t in range(int(s.reps.max(initial=0))):
        step_env = {**env, **s.prefix}
        _advance(num, step_env, n, K)
        for name, _, _ in num.aux:
            env[name] = np.where((t < s.reps)[:, None], step_env[name], env[name])
    out, last = [], None
    for r in range(max(passes) + 1):
        P = np.broadcast_to(np.eye(K), (n, K, K))
        for tok in s.steps:
            step_env = {**env, **tok}
            _advance(num, step_env, n, K)
            env.update({name: step_env[name] for name, _, _ in num.aux})
            if r in passes:
                with np.errstate(invalid="ignore", over="ignore"):  # a candidate may overflow: nan, ranked last
                    P = _matrix(num, step_env, n, K) @ P
        last = step_env if last is None else last
        if r in passes:
            out.append(P)
    return out, last


def _radius(P):
    return np.abs(np.linalg.eigvals(P)).max(axis=-1)


def _negative(P):
    ev = np.linalg.eigvals(P)
    real = np.abs(ev.imag) <= 1e-9 * np.maximum(1.0, np.abs(ev))  # a real eigenvalue, up to rounding
    return -np.where(real, ev.real, INF).min(axis=-1)


# what a witness maximises: the spectral norm, the spectral radius, minus the least real eigenvalue
QUANTITY = {"norm": lambda P: np.linalg.norm(P, 2, axis=(-2, -1)), "radius": _radius, "negative": _negative}


def _scores(num, s: Seqs, K, kind, passes):
    Ps, _ = products(num, s, K, passes)
    out = np.full(len(s.reps), INF)
    for P in Ps:  # the least over the passes: a cycle must keep its growth while the aux states move
        ok = np.isfinite(P).all(axis=(1, 2)) & (np.abs(P).max(axis=(1, 2), initial=0) < 1e100)
        v = np.full(len(P), -INF)
        if ok.any():
            with np.errstate(all="ignore"):
                v[ok] = QUANTITY[kind](P[ok])
        out = np.minimum(out, v)
    return out


def _join(a: Seqs, b: Seqs) -> Seqs:
    cat = lambda x, y: {k: np.concatenate([x[k], y[k]]) for k in x}
    return Seqs(np.concatenate([a.h, b.h]), np.concatenate([a.reps, b.reps]), cat(a.prefix, b.prefix),
                tuple(cat(x, y) for x, y in zip(a.steps, b.steps)))


def search(num: Numeric, kind: str, threshold: float, steps: int = 1, Ks=(2, 3, 4), n: int = 768,
           seed: int = 0, keep: int = 6, refine: int = 8):
    """A replayed witness whose `kind` quantity (of the product of `steps` transitions) exceeds
    threshold, at the smallest K in Ks that has one; None if none was found."""
    rng = np.random.default_rng(seed)
    # a cycle must keep growing while the aux states settle into their own cycle
    passes = (0, 3, 47) if num.aux and steps > 1 else (0,)
    for K in Ks:
        s = _sample(rng, num, n, K, steps)
        sc = _scores(num, s, K, kind, passes)
        top = np.argsort(-sc)[:keep]
        s, sc = s.take(top), sc[top]
        scale = 0.2
        for _ in range(refine):  # local refinement: perturb the best few, keep the best few
            cand = _perturb(rng, num, s.take(np.repeat(np.arange(len(sc)), 24)), scale)
            both, bsc = _join(s, cand), np.concatenate([sc, _scores(num, cand, K, kind, passes)])
            top = np.argsort(-bsc)[:keep]
            s, sc, scale = both.take(top), bsc[top], scale * 0.6
        for j in np.flatnonzero(sc > threshold)[:3]:  # replays are slow: the best three
            w = _witness(num, s.take([j]), K, kind, threshold, steps)
            if w is not None:
                return w
    return None


# ---- one witness, replayed token by token -------------------------------------------------------
def _value(x):
    v = np.asarray(x, dtype=float).ravel().tolist()
    return v if len(v) > 1 else v[0]


def _inputs(tok) -> dict:
    return {k: _value(v) for k, v in tok.items()}


def _witness(num, s: Seqs, K, kind, threshold, steps):
    reps = int(s.reps[0])
    w = {"K": K, **({"h": int(s.h[0, 0])} if num.uses_h else {}),
         "prefix": {"repeat": reps, "inputs": _inputs(s.prefix)} if reps else None,
         "steps": [_inputs(t) for t in s.steps]}
    if steps == 1:
        M, last = replay_step(num, w)
        value = float(QUANTITY[kind](M))
        if not (math.isfinite(value) and value > threshold):
            return None
        w["value"] = -value if kind == "negative" else value
    else:
        P = products(num, s, K)[0][0][0]
        w["value"] = float(_radius(P))
        grown = replay_cycle(num, w)
        if grown is None:
            return None
        w["replay"], last = grown, replay_step(num, w)[1]
    w["at_last_step"] = last
    return w


def _run(num: Numeric, w: dict, cycles: int = 1):
    """The env of every token of the witness's sequence (the prefix, then the steps `cycles`
    times): inputs, h and the aux states after the token, rows in token order; the aux recurrences
    run token by token from zero, as in the reference."""
    K, pre = w["K"], w["prefix"]
    uniq = ([pre["inputs"]] if pre else []) + w["steps"]
    first = len(uniq) - len(w["steps"])  # index of the first step among the distinct tokens
    order = np.array([0] * (pre["repeat"] if pre else 0) + list(range(first, len(uniq))) * cycles)
    T = len(order)
    env = {i.name: np.array([np.broadcast_to(np.asarray(t[i.name], dtype=float), (K if _vector(i) else 1,))
                             for t in uniq])[order] for i in num.inputs}
    env["h"] = np.full((T, 1), float(w.get("h", 0)))
    state = {name: np.zeros(K) for name, _, _ in num.aux}
    env.update({name: np.zeros((T, K)) for name in state})
    if num.aux_free:  # the common case: every decay and write from the inputs alone, in one batch
        for name, decay, write in num.aux:
            dv, wv, P = _call(num, decay, env, T, K), _call(num, write, env, T, K), state[name]
            for t in range(T):
                P = env[name][t] = dv[t] * P + wv[t]
        return env
    for t in range(T):  # one row at a time: a later aux state may read an earlier one's new value
        row = {k: v[t:t + 1] for k, v in env.items()}
        row.update({name: v[None] for name, v in state.items()})
        _advance(num, row, 1, K)
        for name in state:
            state[name] = env[name][t] = row[name][0]
    return env


def _apply(d, a, c, order, S, more=()):
    """One token of the update on S with zero writes, written as the reference scan does it (a
    product's later steps (a, c) in `more`)."""
    if a is None:
        S = d[:, None] * S
    elif order == "left":
        S = d[:, None] * S
        S = S - np.outer(a, c @ S)
    elif order == "sum":
        S = d[:, None] * S - np.outer(a, c @ S)
    else:
        S = d[:, None] * (S - np.outer(a, c @ S))
    for a2, c2 in more:
        S = S - np.outer(a2, c2 @ S)
    return S


def _pieces(num, env, K):
    """d, a, c of every token, and the (a, c) of a product's later steps at every token."""
    T = len(env["h"])
    d = _call(num, num.d, env, T, K)
    more = [(_call(num, fa, env, T, K), _call(num, fc, env, T, K)) for fa, fc in num.more]
    more = [[(a[t], c[t]) for a, c in more] for t in range(T)]
    if num.a is None:
        return d, [None] * T, [None] * T, more
    return d, _call(num, num.a, env, T, K), _call(num, num.c, env, T, K), more


def replay_step(num: Numeric, w: dict):
    """The transition at the witness's last token (the update applied to I), and the aux states
    and lets there."""
    K = w["K"]
    env = _run(num, w)
    last = {f"aux:{name}": _value(env[name][-1]) for name, _, _ in num.aux}
    for (name, kind, _), f in zip(num.lets, let_functions(num)):
        last[f"let:{name}"] = _value(_call(num, f, env, len(env["h"]), K)[-1, :1 if kind == "scalar" else K])
    d, a, c, more = _pieces(num, {k: v[-1:] for k, v in env.items()}, K)
    order = num.mixer.delta.order if num.mixer.delta else None
    return _apply(d[0], a[0], c[0], order, np.eye(K), more[0]), last


def replay_cycle(num: Numeric, w: dict):
    """Run S_0 = I through the prefix, then the cycle over and over with zero writes: {tokens,
    growth} once ||S|| has grown REPLAY_GROWTH times past its size after the prefix; None if it
    does not within REPLAY_TOKENS tokens."""
    K, steps = w["K"], len(w["steps"])
    env = _run(num, w, REPLAY_TOKENS // steps)
    d, a, c, more = _pieces(num, env, K)
    order = num.mixer.delta.order if num.mixer.delta else None
    S, start = np.eye(K), None
    first = len(d) - steps * (REPLAY_TOKENS // steps)
    for t in range(len(d)):
        if t == first:
            start = np.linalg.norm(S)
            if not (np.isfinite(start) and start > 1e-200):
                return None
        with np.errstate(all="ignore"):
            S = _apply(d[t], a[t], c[t], order, S, more[t])
        if t >= first and (t - first + 1) % steps == 0:
            grown = np.linalg.norm(S) / start
            if not np.isfinite(grown):
                return None
            if grown >= REPLAY_GROWTH:
                return {"tokens": t + 1, "growth": float(grown)}
    return None
