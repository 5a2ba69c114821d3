"""Facts about a mixer's transition M_t = (I - a c^T) D (or D (I - a c^T)), each one proved,
disproved or unknown, never a guess:
- stable: every eigenvalue of every admissible M_t lies in [-1, 1] (what the literature calls a
  stable linear RNN; the compile-time refusal rests on it);
- negative_eigenvalues: some admissible M_t has a negative eigenvalue (what state tracking needs);
- spectral_norm_le_1: ||M_t||_2 <= 1 for every admissible token;
- bounded_state: no admissible input sequence amplifies the state (every product of transitions
  stays bounded); for non-normal M_t eigenvalues in [-1, 1] do not imply it.
Proofs are symbolic (lrdsl.checks.ranges over the IR, and the structure of M). Whatever is settled by an
example (a disproof, or negative eigenvalues being reachable) comes with a witness from
lrdsl.checks.witness: admissible inputs, aux states reached by their own recurrences, replayed.
"""
from __future__ import annotations

import dataclasses
import math

import sympy as sp

from lrdsl.checks import witness
from lrdsl.checks.ranges import FULL, INF, TOL, Ranges, _meet, _mul
from lrdsl.frontend import ir, printer
from lrdsl.frontend.symbolic import simplified

PROVED, DISPROVED, UNKNOWN = "proved", "disproved", "unknown"


def domain_error(mixer: ir.Mixer):
    """(message, span) for a log, square root or fractional power whose argument's range, from the
    declared input ranges, reaches below 0 (nan for some admissible inputs); None if there is none."""
    ranges = Ranges(mixer)
    for e, span in mixer.expressions():
        for node in sp.preorder_traversal(sp.sympify(e)):
            if isinstance(node, sp.log):
                arg, what = node.args[0], "log"
            elif node.is_Pow and node.exp.is_number and not node.exp.is_integer:
                arg, what = node.base, "sqrt" if node.exp == sp.Rational(1, 2) else "a fractional power"
            else:
                continue
            lo, hi = ranges.of(arg)
            if lo < 0:
                return (f"{what} of {printer.expr(arg)} is nan for some "
                        f"admissible inputs: its argument ranges over {_iv((lo, hi))}; narrow the declared "
                        "ranges so that it stays >= 0", span)
    return None


# ---- the symbolic analysis -----------------------------------------------------------------------
def _per_channel(mixer, e) -> bool:
    kinds = mixer.kinds()
    return any(kinds.get(str(s)) in ("K", "V") for s in e.free_symbols)


def _iv(r) -> str:
    lo, hi = (-INF if r[0] is None else r[0]), (INF if r[1] is None else r[1])
    return f"[{lo:.4g}, {hi:.4g}]"


def analyse(mixer: ir.Mixer) -> dict:
    """The symbolic part of the check, with the pieces stability_error needs to name a culprit."""
    rg = Ranges(mixer)
    d = mixer.inline_lets(mixer.decay.value)
    D = rg.of(d)
    per_channel_d = mixer.decay.kind == "diagonal"
    out = {"D": D, "d": d, "W": None, "w": None, "factor": None, "symmetric": False, "sym_eig": None, "notes": []}
    notes = out["notes"]
    chan = "value" if mixer.side == "right" else "key"
    dname = f"per {chan} channel" if per_channel_d else "one number per head"
    if mixer.delta is None:
        notes.append(f"M = D with D = {d} ({dname}); no erase term.")
        notes.append(f"M is diagonal: its eigenvalues are the values of D, in {_iv(D)}.")
        out.update(eig=D, proved=True)
        return out
    a, c = (mixer.inline_lets(x) for x in (mixer.delta.a, mixer.delta.c))
    shape = {"left": "(I - a c^T) D", "right": "D (I - a c^T)", "sum": "D - a c^T"}[mixer.delta.order]
    notes.append(f"M = {shape} with a = {mixer.delta.a}, c = {mixer.delta.c}, D = {d} ({dname}).")
    if mixer.delta.order == "sum":  # the same M as (I - a (c/d)^T) D: the proofs below read that form
        c = c / d
        notes.append(f"That is (I - a c'^T) D with c' = {c}; the kernels compute D - a c^T as written.")
    out.update(a=a, c=c)
    out["symmetric"] = not _per_channel(mixer, simplified(a / c))
    # c^T a = sum_i w_i u_i^2 with |u| = 1 is a convex combination of the w_i: the whole trick
    for u in (i for i in mixer.inputs if i.unit):
        w = simplified(c * a / u.symbol ** 2)
        if not w.has(u.symbol):
            # the product as written is ranged too: simplify may lose what the ranges see (it turns
            # 1/(1 + exp(-b)) into exp(b)/(exp(b) + 1), two b for interval arithmetic)
            W = _meet(rg.of(w), rg.of(c * a / u.symbol ** 2))
            F = (min(1.0, 1 - W[1]), max(1.0, 1 - W[0]))
            out.update(w=w, W=W, factor=F)
            notes.append(f"{u.name} has unit norm and c*a = ({w}) {u.name}^2, so c^T a is a convex combination "
                         f"of values in {_iv(W)}: I - a c^T has eigenvalues 1 ({'V' if mixer.side == 'right' else 'K'}-1 times) and 1 - c^T a, "
                         f"all in {_iv(F)}.")
            break
    else:
        why = ("no input is declared unit or l2norm" if not any(i.unit for i in mixer.inputs)
               else "c*a is not a per-channel factor times the square of a unit input")
        notes.append(f"The eigenvalue 1 - c^T a cannot be bounded: {why}.")
        out.update(eig=FULL, proved=False)
        return out
    eig = _mul(F, D)
    if d == 1:
        notes.append("D = I, so the eigenvalues are those of I - a c^T.")
        proved = True
    elif not per_channel_d:
        notes.append(f"D is one number per head in {_iv(D)}, so the eigenvalues are exactly D and "
                     f"D (1 - c^T a): in {_iv(eig)}.")
        proved = True
    elif (D[0] >= 0 or D[1] <= 0) and (W[0] >= 0 or W[1] <= 0):
        # d_i and a_i c_i each of one sign: diag(sqrt(c_i d_i / a_i)) makes M symmetric, equal to
        # +-|D|^1/2 (I -+ y y^T) |D|^1/2 with y_i^2 = |a_i c_i|; its Rayleigh quotients split as a product
        notes.append(f"D and every a_i c_i each keep one sign, so M is similar to the symmetric "
                     f"|D|^1/2 (I - a c^T)_sym |D|^1/2 (times the sign of D): its eigenvalues are real and "
                     f"lie in {_iv(F)} x {_iv(D)} = {_iv(eig)}.")
        proved = True
    else:
        notes.append(f"D varies per channel and D or a_i c_i may change sign: {_iv(eig)} is a guess, "
                     "not a proof (the eigenvalues may even be complex).")
        proved = False
    sym = _symmetric_form(mixer, rg, d, a, c, D, u.symbol)
    if sym is not None:
        out["xy"], out["sym_is_symmetric"], sym = sym[3], sym[2], sym[:2]
        xy = {"left": "x = a, y = D c", "right": "x = D a, y = c", "sum": "x = a, y = c"}[mixer.delta.order]
        how = ("x a per-head multiple of y ({xy}), so M is symmetric" if out["sym_is_symmetric"] else
               "every x_i y_i of one sign ({xy}), so M is similar (by diag(sqrt(|y_i / x_i|))) to the symmetric "
               "D - z z^T with z_i^2 = x_i y_i").format(xy=xy)
        notes.append(f"M = D - x y^T with {how}, and by its "
                     f"Rayleigh quotients its eigenvalues lie in {_iv(sym)} (min D - max(0, x^T y) to "
                     f"max D - min(0, x^T y), x^T y a convex combination of the values of D*c*a/{u.name}^2).")
        eig, proved = ((max(eig[0], sym[0]), min(eig[1], sym[1])) if proved else sym), True
    out.update(eig=eig, proved=proved, sym_eig=sym)
    return out


def _symmetric_form(mixer, rg, d, a, c, D, u):
    """Eigenvalue bounds of M = D - x y^T when it is symmetric (x = lam y, lam one number per head),
    as diag(d) - beta k k^T and D^1/2 (I - beta k k^T) D^1/2 are; None otherwise. For a unit z,
    z^T M z = z^T D z - lam (y^T z)^2, and lam (y^T z)^2 lies between 0 and lam |y|^2 = x^T y =
    sum_i d_i a_i c_i, a convex combination of the values of d a c / u^2 (u the unit input)."""
    x, y = (d * a, c) if mixer.delta.order == "right" else (a, d * c)  # "sum": c is c'/d here
    lam = simplified(x / y)
    if lam.has(sp.nan, sp.zoo):
        return None
    dw = simplified(d * a * c / u ** 2)
    if dw.has(u):
        return None
    lo, hi = _meet(rg.of(dw), rg.of(d * a * c / u ** 2))  # as written, and simplified
    # x_i y_i = dw u_i^2: where it keeps one sign, diag(sqrt(|y_i / x_i|)) makes M symmetric
    # (RWKV-7's diag(exp(w)) - (a*kk) kk^T with a >= 0), whatever x / y is per channel
    per_head = not _per_channel(mixer, lam)
    if not per_head and not (lo >= 0 or hi <= 0):
        return None
    return D[0] - max(0.0, hi), D[1] - min(0.0, lo), per_head, dw



# ---- the facts -----------------------------------------------------------------------------------
def _inside(r, lo=-1.0, hi=1.0) -> bool:
    return r[0] >= lo - TOL and r[1] <= hi + TOL


def _norm_proof(mixer: ir.Mixer, an: dict) -> str | None:
    """Why ||M|| <= 1 for every admissible token, or None where no argument applies."""
    D = an["D"]
    if mixer.delta is None and _inside(D):
        return "M is diagonal with |D| <= 1, so ||M|| <= 1."
    if an["symmetric"] and an["factor"] is not None and _inside(an["factor"]) and _inside(D):
        return ("a is a per-head multiple of c, so I - a c^T is symmetric with eigenvalues in [-1, 1], "
                "and |D| <= 1: ||M|| <= ||I - a c^T|| ||D|| <= 1.")
    if an["sym_eig"] is not None and an.get("sym_is_symmetric") and _inside(an["sym_eig"]):
        return "M is symmetric with eigenvalues in [-1, 1], so ||M|| <= 1."
    return None


def _num(v) -> str:
    # 7 digits: 1.999998 in (0, 2) must not print as the excluded end 2
    return f"[{', '.join(_num(x) for x in v)}]" if isinstance(v, list) else f"{v:.7g}"


def _describe(w: dict) -> str:
    """A witness in one line: K, the prefix (if any) and the tokens that matter."""
    tok = lambda t: ", ".join(f"{k}={_num(v)}" for k, v in t.items())
    head = f"K={w['K']}" + (f", h={w['h']}" if "h" in w else "")
    pre = w["prefix"]
    pre = f"; after {pre['repeat']} x ({tok(pre['inputs'])})" if pre else ""
    steps = "; then ".join(f"({tok(t)})" for t in w["steps"] if t)
    aux = ", ".join(f"{k}={_num(v)}" for k, v in w.get("at_last_step", {}).items() if k.startswith("aux:"))
    return f"{head}{pre}" + (f"; {steps}" if steps else "") + (f" [{aux}]" if aux else "")


def _legacy_counterexample(w: dict | None) -> dict | None:
    """The norm witness in the shape `counterexample` always had: the last token's inputs, aux
    states and lets flat, and its spectral norm (plus the prefix that reaches the aux states)."""
    if w is None:
        return None
    return {"K": w["K"], "inputs": {**w["steps"][-1], **w["at_last_step"]}, "spectral_norm": w["value"],
            "prefix": w["prefix"]}


def _as_bool(status: str, yes: str = PROVED):
    """A fact for the old boolean keys: True, False, or None (null) where nothing is known."""
    return None if status == UNKNOWN else status == yes


def _report(eigenvalues: dict, facts: dict, wits: dict, notes: list) -> dict:
    """check's result: the facts, the witnesses found, and the older flat keys derived from them."""
    return {
        "eigenvalues": eigenvalues,
        "facts": facts,
        "witnesses": {k: v for k, v in wits.items() if v is not None},
        "spectral_norm_le_1": facts["spectral_norm_le_1"],
        "bounded_state": facts["bounded_state"],
        "counterexample": _legacy_counterexample(wits.get("spectral_norm_le_1")),
        "negative_eigenvalues": _as_bool(facts["negative_eigenvalues"]),
        "stable": _as_bool(facts["stable"]),
        "contraction": _as_bool(facts["spectral_norm_le_1"]),
        "notes": notes,
    }


def factors(mixer: ir.Mixer) -> tuple:
    """The one-step mixers of a product's factors: the first step (with the decay), then each later
    step's I - a c^T (identity decay); (mixer,) for a one-step spec."""
    if not mixer.steps:
        return (mixer,)
    first = dataclasses.replace(mixer, steps=())
    one = ir.Decay("identity", sp.Integer(1))
    return (first, *(dataclasses.replace(first, decay=one, delta=st.delta, write=st.write) for st in mixer.steps))


def _check_product(mixer: ir.Mixer) -> dict:
    """The facts of a product of n steps per token: each factor checked as a one-step transition;
    ||M|| <= prod ||M_j|| bounds the product where each factor is a contraction (and then every
    eigenvalue of M, possibly complex, has modulus <= 1); the rest by the witness search on the
    product itself."""
    parts = [check(f) for f in factors(mixer)]
    num = witness.numeric(mixer)
    notes = [f"M is the product of {mixer.n_steps} factors, one per step, the last leftmost: "
             f"M = M_{mixer.n_steps} ... M_1 (the decay in M_1)."]
    for j, r in enumerate(parts, 1):
        notes.append(f"step {j}: ||M_{j}|| <= 1 {r['facts']['spectral_norm_le_1']}; " + " ".join(r["notes"]))
    facts, wits = {}, {}
    contractions = all(r["facts"]["spectral_norm_le_1"] == PROVED for r in parts)
    if contractions:
        facts.update(spectral_norm_le_1=PROVED, stable=PROVED, bounded_state=PROVED)
        notes.append("Every factor is a contraction, so ||M|| <= ||M_n|| ... ||M_1|| <= 1: every eigenvalue "
                     "of M has modulus <= 1 (they need not be real: a product of symmetric factors is not "
                     "symmetric), and no input sequence amplifies the state.")
    if mixer.n_steps == 2 and all(_psd(f, r) for f, r in zip(factors(mixer), parts)):
        facts["negative_eigenvalues"] = DISPROVED
        notes.append("Both factors are symmetric positive semi-definite, so M = M_2 M_1 = (M_2 M_1^1/2) M_1^1/2 has "
                     "the eigenvalues of M_1^1/2 M_2 M_1^1/2 (XY and YX share them), a symmetric positive "
                     "semi-definite matrix: real and >= 0.")
    for name, kind, thr, yes, no in (("spectral_norm_le_1", "norm", 1 + 1e-9, DISPROVED, UNKNOWN),
                                     ("stable", "radius", 1 + 1e-9, DISPROVED, UNKNOWN),
                                     ("negative_eigenvalues", "negative", 1e-6, PROVED, UNKNOWN)):
        if name in facts:
            continue
        w = witness.search(num, kind, thr)
        facts[name], wits[name] = (yes, w) if w else (no, None)
        notes.append(f"{LABELS[name]}: " + ("an admissible token settles it (see the witness)." if w else
                                            "not proved, and no admissible token settling it was found."))
    if "bounded_state" not in facts:
        w = _growing_cycle(num, wits.get("stable"))
        facts["bounded_state"], wits["bounded_state"] = (DISPROVED, w) if w else (UNKNOWN, None)
        notes.append("bounded state: " + ("a cycle of tokens grows the state (see the witness)." if w else
                                          "not proved (some factor is not proved a contraction), and no short "
                                          "growing cycle was found."))
    return {
        **_report({"min": -1.0 if contractions else None, "max": 1.0 if contractions else None, "proved": False},
                  facts, wits, notes),
        "steps": [{"spectral_norm_le_1": r["facts"]["spectral_norm_le_1"], "stable": r["facts"]["stable"],
                   "eigenvalues": r["eigenvalues"]} for r in parts],
    }


def _psd(factor: ir.Mixer, result: dict) -> bool:
    """The factor is symmetric and its eigenvalues are proved >= 0."""
    e = result["eigenvalues"]
    return bool(e["proved"] and e["min"] is not None and e["min"] >= -TOL
                and (factor.delta is None or analyse(factor).get("sym_is_symmetric")))


def check(mixer: ir.Mixer) -> dict:
    if mixer.side == "both":
        return _check_two_sided(mixer)
    if mixer.steps:
        return _check_product(mixer)
    an = analyse(mixer)
    notes, eig, enclosed = list(an["notes"]), an["eig"], an["proved"]
    if mixer.side == "right":  # the facts of N are those of M: ||S N|| <= ||S|| ||N|| bounds the state alike
        notes.insert(0, "The transition acts on the value side, S_t = S_{t-1} N_t + write, N_t [V, V]; the facts "
                        "below are N_t's, written M (S_t^T = N_t^T S_{t-1}^T + ... has the same eigenvalues "
                        "and norms).")
    num = witness.numeric(mixer)
    facts, wits = {}, {}

    def settle(name, found, status_if_found, status_else, note):
        facts[name], wits[name] = (status_if_found, found) if found else (status_else, None)
        if found:
            notes.append(note(found))

    why = _norm_proof(mixer, an)
    if why:
        facts["spectral_norm_le_1"] = PROVED
        notes.append(why)
    else:
        settle("spectral_norm_le_1", witness.search(num, "norm", 1 + 1e-9), DISPROVED, UNKNOWN,
               lambda w: "||M|| can exceed 1 (see the witness)" + (": M is not normal, and its eigenvalues do "
                                                                    "not bound its norm." if enclosed and _inside(eig)
                                                                    else "."))
        if facts["spectral_norm_le_1"] == UNKNOWN:
            notes.append("No proof that ||M|| <= 1, and no admissible token with ||M|| > 1 was found.")

    if enclosed and _inside(eig):
        facts["stable"] = PROVED
    elif facts["spectral_norm_le_1"] == PROVED:
        facts["stable"] = PROVED
        notes.append("Every eigenvalue is at most the spectral norm, <= 1.")
    else:
        settle("stable", witness.search(num, "radius", 1 + 1e-9), DISPROVED, UNKNOWN,
               lambda w: "An eigenvalue leaves [-1, 1] (see the witness).")
        if facts["stable"] == UNKNOWN:
            notes.append("No proof that the eigenvalues lie in [-1, 1], and no admissible token with an "
                         "eigenvalue outside was found.")

    if enclosed and eig[0] >= -TOL:
        facts["negative_eigenvalues"] = DISPROVED
    else:
        settle("negative_eigenvalues", witness.search(num, "negative", 1e-6), PROVED, UNKNOWN,
               lambda w: "A negative eigenvalue is reachable (see the witness).")
        if facts["negative_eigenvalues"] == UNKNOWN:
            notes.append("Negative eigenvalues are not excluded, and none was found by search.")

    if facts["spectral_norm_le_1"] == PROVED:
        facts["bounded_state"] = PROVED
        notes.append("||M_t|| <= 1 at every token, so every product of transitions has norm <= 1: no input "
                     "sequence amplifies the state.")
    else:
        settle("bounded_state", _growing_cycle(num, wits.get("stable")), DISPROVED, UNKNOWN,
               lambda w: f"A cycle of {len(w['steps'])} admissible tokens has a product with spectral radius "
                         f"{w['value']:.4g} > 1: repeated, it grows the state geometrically (see the witness)"
                         + (", although every single step has its eigenvalues in [-1, 1]."
                            if facts["stable"] == PROVED else "."))
        if facts["bounded_state"] == UNKNOWN:
            notes.append("Bounded state: ||M|| <= 1 is not proved, and no short cycle of admissible tokens "
                         "whose product has spectral radius > 1 was found.")

    out = _report({"min": _json(eig[0]), "max": _json(eig[1]), "proved": bool(enclosed)}, facts, wits, notes)
    if mixer.solve_lam is not None:
        from lrdsl.checks.cgfacts import cg_fact
        out["solve_well_posed"] = _solve_well_posed(mixer, notes)
        out["cg"] = cg_fact(mixer, notes)
    return out


def _check_two_sided(mixer: ir.Mixer) -> dict:
    """M S N: vec(S) moves by N^T (x) M, whose eigenvalues are the products of M's and N's and whose
    norm is ||M|| ||N||. So each fact is proved where both factors have it; a witness of one factor
    alone proves nothing of the product (the other may shrink it), so the rest stays unknown."""
    m, n = check(mixer.left_part()), check(mixer.right_part())
    both = lambda key: PROVED if m["facts"][key] == PROVED and n["facts"][key] == PROVED else UNKNOWN
    facts = {key: both(key) for key in ("stable", "spectral_norm_le_1", "bounded_state")}
    if m["eigenvalues"]["proved"] and n["eigenvalues"]["proved"]:
        lo_hi = lambda r: (-INF if r["eigenvalues"]["min"] is None else r["eigenvalues"]["min"],
                           INF if r["eigenvalues"]["max"] is None else r["eigenvalues"]["max"])
        eig = _mul(lo_hi(m), lo_hi(n))
    else:
        eig = FULL
    # a negative eigenvalue of the product needs one factor's negative eigenvalue times a positive one
    nonneg = lambda r: r["eigenvalues"]["proved"] and r["eigenvalues"]["min"] is not None and r["eigenvalues"]["min"] >= 0
    facts["negative_eigenvalues"] = DISPROVED if nonneg(m) and nonneg(n) else UNKNOWN
    notes = ["S = M S N + write: vec(S) moves by N^T (x) M, whose eigenvalues are the products of M's and N's "
             "and whose spectral norm is ||M|| ||N||; a fact is proved where M and N both have it."]
    notes += [f"M: {x}" for x in m["notes"]] + [f"N: {x}" for x in n["notes"]]
    return _report({"min": _json(eig[0]), "max": _json(eig[1]),
                    "proved": bool(m["eigenvalues"]["proved"] and n["eigenvalues"]["proved"])}, facts, {}, notes)


def _growing_cycle(num, step: dict | None):
    """A witness that the state can grow without bound: the step that leaves [-1, 1] repeated, or a
    cycle of 2 to 4 tokens found by search, each replayed from S_0 = I with zero writes."""
    if step is not None:
        grown = witness.replay_cycle(num, step)
        if grown is not None:
            return {**step, "replay": grown}
    for steps in (2, 3, 4):
        # the product must grow the state REPLAY_GROWTH times within half the replay's tokens
        need = witness.REPLAY_GROWTH ** (2 * steps / witness.REPLAY_TOKENS)
        found = witness.search(num, "radius", need, steps, Ks=(2, 3), refine=12)
        if found is not None:
            return found
    return None


def _json(x):
    return None if math.isinf(x) else float(x)


def _solve_well_posed(mixer: ir.Mixer, notes: list) -> bool:
    """The offline solve reads (G + diag(lam))^-1 q with G_t = D G_{t-1} + u k^T: G is positive
    semi-definite when D >= 0 is one number per head (a decay per key channel makes D G
    non-symmetric) and u is a non-negative per-head multiple of k, and then lam > 0 makes the matrix
    positive definite."""
    rng = Ranges(mixer)
    lam_lo = rng.of(mixer.inline_lets(mixer.solve_lam))[0]
    ratio = simplified(mixer.inline_lets(mixer.write.key) / ir.symbol("k"))
    per_head = not _per_channel(mixer, ratio)
    psd = bool(per_head and rng.of(ratio)[0] >= 0 and rng.of(mixer.decay.value)[0] >= 0
               and mixer.decay.kind != "diagonal")
    lam_in = next((i for i in mixer.inputs if i.symbol == mixer.solve_lam), None)
    positive = bool(lam_lo > 0 or (lam_in is not None and bool(lam_in.lo >= 0) and lam_in.lo_open))
    ok = psd and positive
    if ok:
        notes.append(f"The readout solves (G + diag(lam)) x = q: G = D G + ({ratio}) k k^T is positive "
                     f"semi-definite and lam > 0, so the solve is well posed.")
    else:
        notes.append("The readout's solve is not proved well posed: it needs D >= 0 with one number per head, "
                     "a write key that is a non-negative multiple of k, and lam > 0.")
    return ok


def explain(result: dict) -> str:
    e, f = result["eigenvalues"], result["facts"]
    product = "steps" in result
    if product:  # complex in general: what is proved is a bound on their modulus
        rows = [("eigenvalues", "modulus <= 1 (proved: every step a contraction)" if e["max"] is not None
                 else "not proved")]
    else:
        rows = [("eigenvalues", f"{_iv((e['min'], e['max']))} "
                                f"({'proved: real, in this interval' if e['proved'] else 'not proved'})")]
    for key, label in LABELS.items():
        if key not in f:
            continue
        claim = CLAIMS[key]
        if product and key == "stable":
            claim = "every eigenvalue of every admissible M_t (the product of the steps) has modulus <= 1"
        rows.append((label, f"{f[key]:<9}  {claim}"))
        w = result["witnesses"].get(key)
        if w is not None:
            rows.append(("", f"witness: {WITNESS_WORDS[key](w)} at {_describe(w)}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + [f"  - {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


LABELS = {"stable": "stable", "negative_eigenvalues": "negative eigenvalues",
          "spectral_norm_le_1": "spectral norm <= 1", "bounded_state": "bounded state"}
CLAIMS = {"stable": "every eigenvalue of every admissible M_t is in [-1, 1]",
          "negative_eigenvalues": "some admissible M_t has a negative eigenvalue",
          "spectral_norm_le_1": "||M_t|| <= 1 for every admissible token",
          "bounded_state": "every product of admissible transitions stays bounded (no input sequence "
                           "amplifies the state; writes add to it)"}
WITNESS_WORDS = {
    "stable": lambda w: f"spectral radius {w['value']:.7g}",
    "negative_eigenvalues": lambda w: f"eigenvalue {w['value']:.7g}",
    "spectral_norm_le_1": lambda w: f"||M|| = {w['value']:.7g}",
    "bounded_state": lambda w: (f"{len(w['steps'])} token(s) whose product has spectral radius {w['value']:.7g}; "
                                f"repeated from S_0 = I with zero writes they grow ||S|| {w['replay']['growth']:.3g} "
                                f"times in {w['replay']['tokens']} tokens (the reference scan's update, float64)"),
}


def stability_error(mixer: ir.Mixer, result: dict) -> str | None:
    """One sentence for a spec whose stability is not proved (None when proved or allowed): the
    expression whose range is too wide, the range found, and a fix that is actually one."""
    if result.get("solve_well_posed") is False and not mixer.allow_unstable:
        return ("the readout's solve (G + diag(lamb))^-1 q is not proved well posed: declare the regulariser "
                "positive (e.g. `lamb[K] in (0, inf)`), keep the write key a non-negative multiple of k and the "
                "decay one number per head (a decay per key channel makes the Gram state non-symmetric)")
    bad_cg = cg_error(mixer, result)
    if bad_cg:
        return bad_cg
    if result["facts"]["stable"] == PROVED or mixer.allow_unstable:
        return None
    if mixer.side == "both":  # name the factor whose eigenvalues are not proved inside [-1, 1]
        for name, part in (("M", mixer.left_part()), ("N", mixer.right_part())):
            why = stability_error(part, check(part))
            if why:
                return f"in the two-sided M S N, {name}'s {why}"
        return ("the eigenvalues of the two-sided M S N could not be proved inside [-1, 1]; or add "
                "`allow unstable`")
    if mixer.steps:
        return _product_error(mixer, result)
    w = result["witnesses"].get("stable")
    seen = (f"an admissible token reaches spectral radius {w['value']:.7g} at {_describe(w)}" if w else
            "no admissible token with an eigenvalue outside [-1, 1] was found either")
    tail = "; or add `allow unstable`"
    an = analyse(mixer)
    if mixer.delta is not None and an["factor"] is None:
        if not any(i.unit for i in mixer.inputs):
            return (f"the eigenvalues of the transition cannot be bounded because no key is declared unit-norm "
                    f"({seen}); declare `k[K] unit` or `l2norm`{tail}")
        return (f"the eigenvalues of the transition cannot be bounded: c^T a is not a convex combination over a "
                f"unit key ({seen}); rewrite the erase as I - beta k k^T{tail}")
    if not an["proved"]:
        return (f"the eigenvalues of the transition could not be proved real and inside [-1, 1]: the decay "
                f"or the erase gains change sign across channels ({seen}); keep the decay and the erase gains "
                f"of one sign{tail}")
    sym, part = an["sym_eig"], _culprit(mixer, an)
    if part == "decay":
        what = [an["d"]]
        found = f"the decay {printer.expr(an['d'])} ranges over {_iv(an['D'])}, which must lie within [-1, 1]"
    elif part == "symmetric":
        what, xy = [an["d"], an["xy"]], Ranges(mixer).of(an["xy"])
        found = (f"M = D - x y^T is symmetric with least eigenvalue min D - x^T y down to {sym[0]:.4g}, where "
                 f"D = {printer.expr(an['d'])} ranges over {_iv(an['D'])} and x^T y over {_iv(xy)} "
                 f"(the values of {printer.expr(an['xy'])})")
    else:
        what = [an["w"]]
        found = (f"{printer.expr(an['w'])} ranges over {_iv(an['W'])}, which must lie within [0, 2] (the erase "
                 "eigenvalue 1 - c^T a must stay in [-1, 1])")
    inputs = {i.name for i in (*mixer.inputs, *mixer.params)}
    names = sorted({str(s) for e in what for s in sp.sympify(e).free_symbols if str(s) in inputs})
    if w:  # the range really is too wide: narrowing the inputs' declared ranges is the fix
        fix = (f"narrow the declared range of {', '.join(names)}" if names else
               "make it a number of magnitude at most 1")
        return f"eigenvalues of the transition reach outside [-1, 1]: {found}, and {seen}; {fix}{tail}"
    return (f"the eigenvalues of the transition could not be proved inside [-1, 1]: {found} as far as the "
            f"checker can tell (an enclosure, possibly wider than the truth), and {seen}; write it so that its "
            f"range is provable (e.g. through one input) or declare narrower input ranges{tail}")


def _product_error(mixer: ir.Mixer, result: dict) -> str:
    """A product whose stability is not proved: the first factor not proved a contraction, in the
    words of a one-step spec's error, and the product's witness."""
    j, f = next(((j, f) for j, f in enumerate(factors(mixer), 1)
                 if result["steps"][j - 1]["spectral_norm_le_1"] != PROVED))
    w = result["witnesses"].get("stable")
    seen = (f"an admissible token gives the product spectral radius {w['value']:.7g} at {_describe(w)}" if w else
            "no admissible token with an eigenvalue of the product outside the unit disk was found")
    why = stability_error(dataclasses.replace(f, allow_unstable=False), check(f)) or "its norm is not proved <= 1"
    why = why.removesuffix("; or add `allow unstable`")
    return (f"the product's eigenvalues are bounded when every step is a contraction, and step {j} is not proved "
            f"one ({why}); for the product, {seen}; or add `allow unstable`")


def _culprit(mixer: ir.Mixer, an: dict) -> str:
    """Which part of the transition stability_error blames: "erase" (its gains, or no bound on
    c^T a), "transition" (decay and erase together), "decay", or "symmetric" (D - x y^T)."""
    if mixer.delta is not None and an["factor"] is None:
        return "erase"
    if not an["proved"]:
        return "transition"
    F, sym = an["factor"], an["sym_eig"]
    if not _inside(an["D"]):
        return "decay"
    if sym is not None and (F is None or F[0] < sym[0] - TOL):  # the symmetric form's bound is the tighter
        return "symmetric"
    return "erase"


def error_span(mixer: ir.Mixer, result: dict):
    """Where stability_error's sentence points: at the first let that the blamed part of the
    transition reads, when it reads one (the range comes from there), else mixer.error_span (the
    update, or the readout for the solve's errors)."""
    span = mixer.error_span(result)
    if mixer.steps or (result.get("solve_well_posed") is False or cg_error(mixer, result) or mixer.allow_unstable
            or result["facts"]["stable"] == PROVED or not mixer.lets):
        return span
    part = _culprit(mixer, analyse(mixer))
    erase = (mixer.delta.a, mixer.delta.c) if mixer.delta is not None else ()
    read = set().union(*(sp.sympify(e).free_symbols for e in
                         ((mixer.decay.value,) if part != "erase" else ()) + (erase if part != "decay" else ())))
    lets = [lt for lt in mixer.lets if ir.symbol(lt.name) in read and lt.span is not None]
    inputs = {i.symbol for i in (*mixer.inputs, *mixer.params)}
    ranged = [lt for lt in lets if mixer.inline_lets(lt.expr).free_symbols & inputs]  # a constant is no culprit
    return (ranged or lets)[0].span if lets else span


def cg_error(mixer: ir.Mixer, result: dict) -> str | None:
    """One sentence for an offline solve whose declared ranges leave the condition number of
    G + diag(lam) unbounded (None when bounded, allowed, or not solved by CG): the kernels stop after
    a fixed number of CG steps, and fp32 rounding grows with the condition number too, so such a
    spec gives outputs far from the exact solve for admissible inputs (lam = 1e-8: off by 1.5)."""
    cg = result.get("cg")
    if cg is None or cg["bounded"] or cg.get("argument") == "not symmetric" or mixer.allow_ill_conditioned:
        return None
    lam = mixer.solve_lam
    name = next((i.name for i in (*mixer.inputs, *mixer.params) if i.symbol == lam), None)
    how = (f"declare a positive lower bound and a finite upper bound for {name} (e.g. `input {name}[K] in "
           f"[0.01, 100]`)" if name is not None else
           f"declare input ranges that keep the regulariser {printer.expr(lam)} between a positive lower bound "
           "and a finite upper bound")
    return (f"the kernels solve (G + diag({printer.expr(lam)})) x = q by a fixed {cg['steps']} conjugate-gradient "
            f"steps, but the declared ranges leave its condition number unbounded ({cg['argument']}), so for "
            f"admissible inputs they can return outputs far from the exact solve; {how}, or add "
            "`allow ill_conditioned` to accept it")
