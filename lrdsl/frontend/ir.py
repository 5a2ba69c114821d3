"""The IR: one frozen, hashable dataclass per mixer, in canonical form.

The transition is M_t = (I - a c^T) D (order "left") or D (I - a c^T) (order "right"), with D a
diagonal given by its per-key-channel value d (identity, constant in the head index h, one
data-dependent number per head, or one per key channel), followed by the rank-1 write
key value^T. Every per-token quantity is a sympy expression over symbols that stand for one
channel of an input, of an auxiliary vector state or of a let: elementwise algebra is plain
scalar algebra on those symbols, and their kinds ("scalar", "K", "V") say how they broadcast.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import sympy as sp

from lrdsl.errors import Span

HEAD = sp.Symbol("h", integer=True, nonnegative=True)  # the (value) head index
SQUASH_EPS = sp.Rational(1, 10**6)


class squash(sp.Function):
    """ATK squash: m = exp(-log(x) * s), s = r / (1 + |r|), r = log(P + 1e-6) - center; m in (1/x, x)."""
    nargs = 3

    def definition(self) -> sp.Expr:
        p, x, center = self.args
        r = sp.log(p + SQUASH_EPS) - center
        return sp.exp(-sp.log(x) * r / (1 + sp.Abs(r)))


def symbol(name: str) -> sp.Symbol:
    return sp.Symbol(name, real=True)


def log_of(decay: sp.Expr) -> sp.Expr:
    """log d as the kernels compute it: expanded, so exp(g) gives g and products give sums."""
    return sp.expand_log(sp.log(decay), force=True)


@dataclass(frozen=True)
class Input:
    name: str
    kind: str  # "scalar" (one number per head and token), "K" or "V" (one per channel)
    shared: bool  # one value per key head (H) instead of per value head (HV)
    l2norm: bool  # L2-normalised inside the mixer
    unit: bool  # declared to have unit L2 norm already (or normalised: l2norm implies unit)
    log: bool  # a log-decay: <= 0
    lo: sp.Expr  # range; -oo / oo when open-ended
    hi: sp.Expr
    lo_open: bool
    hi_open: bool
    span: Span | None = field(default=None, compare=False, hash=False)

    @property
    def symbol(self) -> sp.Symbol:
        return symbol(self.name)

    @property
    def clamped(self) -> bool:
        return _clamped(self)


def _clamped(i) -> bool:
    """The kernels clamp the input into its declared range (and check_ranges checks it there): it
    has a finite bound and is neither normalised nor declared unit."""
    return not (i.l2norm or i.unit) and (i.lo.is_finite or i.hi.is_finite)


@dataclass(frozen=True)
class Param:
    """A learned parameter: one number per value head (kind "scalar"), per head and key channel
    ("K") or per head and value channel ("V"), the same for every token. Where ranges and witnesses treat it like an input it reads as
    one that is never shared, normalised or a log-decay."""
    name: str
    kind: str  # "scalar" | "K"
    lo: sp.Expr
    hi: sp.Expr
    lo_open: bool
    hi_open: bool
    init: tuple  # how lrdsl.nn.Layer draws it: ("number", c), ("uniform", lo, hi), ("log", init), ...
    span: Span | None = field(default=None, compare=False, hash=False)
    shared = l2norm = unit = log = False  # class constants, not fields: what an Input would say

    @property
    def symbol(self) -> sp.Symbol:
        return symbol(self.name)

    @property
    def clamped(self) -> bool:
        return _clamped(self)


@dataclass(frozen=True)
class Aux:
    """An auxiliary vector state: P_t = decay * P_{t-1} + write (elementwise), starting at zero."""
    name: str
    kind: str  # "K" or "V"
    decay: sp.Expr
    write: sp.Expr
    span: Span | None = field(default=None, compare=False, hash=False)

    def width(self, K: int, V: int) -> int:
        """Its length per head: K for a key-channel state, V for a value-channel one."""
        return K if self.kind == "K" else V


@dataclass(frozen=True)
class Let:
    name: str
    kind: str
    expr: sp.Expr
    span: Span | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Decay:
    kind: str  # "identity" | "constant" | "scalar" | "diagonal"
    value: sp.Expr  # d, the per-channel (or per-head) multiplier


@dataclass(frozen=True)
class Delta:
    a: sp.Expr  # write direction of the erase (K)
    c: sp.Expr  # read direction of the erase (K)
    # "left": (I - a c^T) D;  "right": D (I - a c^T);  "sum": D - a c^T (the additive DPLR form:
    # written as (I - a c'^T) D its c' would be D^-1 c, which overflows where the decay underflows)
    order: str


@dataclass(frozen=True)
class Write:
    key: sp.Expr  # K (scalar factors live here)
    value: sp.Expr  # V


@dataclass(frozen=True)
class Step:
    """One more rank-1 step of a token's update, after the first: S = (I - a c^T) S + key value^T
    (delta None: S + key value^T). A product of n such factors per token is DeltaProduct's transition;
    the decay belongs to the first step alone."""
    delta: Delta | None
    write: Write


@dataclass(frozen=True)
class Bonus:
    """A readout term (x^T y) z: the sum over the channels of `kind` of `summand` (x*y), times the
    [V] vector `value`."""
    kind: str  # "K" or "V": the channels summed over
    summand: sp.Expr
    value: sp.Expr


@dataclass(frozen=True)
class Mixer:
    name: str
    inputs: tuple  # Input, ...
    aux: tuple  # Aux, ...
    lets: tuple  # Let, ...
    decay: Decay
    delta: Delta | None
    write: Write
    query: sp.Expr  # o = S^T (scale * query)
    allow_unstable: bool = False
    # offline solve (Mesa): o = S^T (G + diag(solve_lam))^-1 (scale * query), G_t = D G_{t-1} + key k^T
    solve_lam: sp.Expr | None = None
    solve_steps: int = 30  # conjugate-gradient steps of the kernels' solve (the reference is exact)
    params: tuple = ()  # Param, ...: learned per-head numbers the per-token expressions may read
    # `allow ill_conditioned`: accept an offline solve whose condition number the declared ranges
    # leave unbounded (the kernels' fixed number of CG steps may then be far from the exact solve)
    allow_ill_conditioned: bool = False
    update_span: Span | None = field(default=None, compare=False, hash=False)
    readout_span: Span | None = field(default=None, compare=False, hash=False)
    # the readout's other terms: o = S^T (scale * query) + S_prev^T (scale * query_prev)
    # + scale * sum of (x^T y) z over bonus, S_prev being the state before this token's update
    query_prev: sp.Expr = sp.Integer(0)
    bonus: tuple = ()  # Bonus, ...
    # "left": S = M S + write, M over key channels; "right": S = S N + write, the value side (the
    # gated Oja rule): N = (I - a c^T) D, D (I - a c^T) or D - a c^T over value channels, so the
    # decay, a and c are [V] (or per-head) quantities
    side: str = "left"
    # side "both": S = M S N + write, M in decay and delta (over key channels), N in these (over value
    # channels)
    n_decay: Decay | None = None
    n_delta: Delta | None = None

    def left_part(self) -> "Mixer":
        """M S + write alone (a two-sided mixer's M): what the checker states M's facts of."""
        return dataclasses.replace(self, side="left", n_decay=None, n_delta=None)

    def right_part(self) -> "Mixer":
        """S N + write alone (a two-sided mixer's N, in decay and delta)."""
        return dataclasses.replace(self, side="right", decay=self.n_decay, delta=self.n_delta,
                                   n_decay=None, n_delta=None)
    # the steps after the first (decay, delta, write) of each token's update, in order: the token's
    # transition is the product of n = 1 + len(steps) rank-1 factors, each followed by its write
    steps: tuple = ()  # Step, ...
    # a product's direct sub-mixer (codegen/product.py): its staged chunk kernels may read the n
    # sub-tokens of each token from the spec's own tensors (plan.sub_tokens); 0 elsewhere
    sub_tokens: int = 0
    # the split's mixer (codegen/split.py): its phase input's name; its staged chunk kernels may read
    # both sub-tokens of each token from the spec's own tensors (plan.sub_tokens = 2); "" elsewhere
    split_phase: str = ""

    @property
    def n_steps(self) -> int:
        return 1 + len(self.steps)

    @property
    def reads_before(self) -> bool:
        """The readout has terms beside S^T x (S_prev^T y, dot products): lrdsl.Mixer runs them
        around the kernels of core (runtime/readouts.py); the kernels read S^T x alone."""
        return self.query_prev != 0 or bool(self.bonus)

    def error_span(self, facts: dict) -> Span | None:
        """Where a checker's error points: the readout for an ill-posed or ill-conditioned solve,
        else the update."""
        cg = facts.get("cg") or {}
        ill = cg.get("bounded") is False and cg.get("argument") != "not symmetric" and not self.allow_ill_conditioned
        return self.readout_span if facts.get("solve_well_posed") is False or ill else self.update_span

    def expressions(self) -> tuple:
        """(expression, span) of every per-token expression: the lets, the auxiliary states' decays
        and writes (at their lines), then the decay, write, query and erase (at the update)."""
        out = [(lt.expr, lt.span) for lt in self.lets]
        out += [(e, a.span) for a in self.aux for e in (a.decay, a.write)]
        body = [self.decay.value, self.write.key, self.write.value]
        body += [self.delta.a, self.delta.c] if self.delta is not None else []
        body += [self.n_decay.value] if self.n_decay is not None else []
        body += [self.n_delta.a, self.n_delta.c] if self.n_delta is not None else []
        for st in self.steps:
            body += [st.write.key, st.write.value] + ([st.delta.a, st.delta.c] if st.delta is not None else [])
        readout = [self.query, self.query_prev, *(e for b in self.bonus for e in (b.summand, b.value))]
        return tuple(out + [(e, self.update_span) for e in body] + [(e, self.readout_span) for e in readout])

    @functools.cached_property
    def _inlined_lets(self) -> dict:
        """Each let's symbol -> its expression with the lets it uses substituted, built once in
        order (a let reads only earlier ones): inline_lets is then one substitution, and a chain
        of n lets costs O(n) instead of O(n^2) per call (the witness search inlines every let)."""
        out = {}
        for lt in self.lets:
            out[symbol(lt.name)] = lt.expr.xreplace(out) if out else lt.expr
        return out

    def inline_lets(self, e: sp.Expr) -> sp.Expr:
        """e with every let replaced by its expression (and the lets that uses, all the way down)."""
        sub = self._inlined_lets
        return sp.sympify(e).xreplace(sub) if sub else e

    def log_decay(self) -> sp.Expr:
        """log d: the chunked kernels cumulate decays in log space."""
        return log_of(self.decay.value)

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)

    @property
    def tensor_names(self) -> tuple:
        """The tensors a call takes by name, in this order: every input, then every param."""
        return tuple(i.name for i in (*self.inputs, *self.params))

    def kinds(self) -> dict:
        """Kind of every symbol a per-token expression may use."""
        out = {i.name: i.kind for i in (*self.inputs, *self.params)}
        out.update({a.name: a.kind for a in self.aux})
        out.update({l.name: l.kind for l in self.lets})
        out["h"] = "scalar"
        return out
