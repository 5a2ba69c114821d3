"""`lrdsl check SPEC --plot FILE`: a picture of what the checker found, three panels.

1. The eigenvalues of M_t per head: the interval the symbolic analysis encloses them in (solid
   when proved, hatched when only a guess), against the stable band [-1, 1]. Where the spec reads
   the head index h (RetNet's 1 - 2^(-5-h)), the analysis is redone with h fixed to each head.
2. The decay horizon per head: tokens until the decay D alone halves the state, |D|^n = 1/2, from
   the smallest |D| the declared ranges admit to the largest (the erase shrinks the state further
   along the keys it reads; that is not counted). 1 - 2^-5 halves it in 22 tokens; D up to 1 means
   some admissible gates never do.
3. Where `bounded_state` is disproved, the checker's witness replayed: S_0 = I through the prefix
   that builds the auxiliary states, then the growing cycle over and over with zero writes; the
   norm of S per token (the same replay the checker ran before it reported the witness).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import sympy as sp

from lrdsl.checks import witness
from lrdsl.errors import LrdslError
from lrdsl.frontend import ir

HEADS = 8  # heads drawn when the transition depends on the head index
FAR = 1e6  # horizons beyond this many tokens are drawn as "never"


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def at_head(m: ir.Mixer, h: int) -> ir.Mixer:
    """The mixer with the head index fixed to h in every per-token expression."""
    def fix(e):
        return None if e is None else sp.sympify(e).xreplace({ir.HEAD: sp.Integer(h)})
    return replace(
        m, lets=tuple(replace(lt, expr=fix(lt.expr)) for lt in m.lets),
        aux=tuple(replace(a, decay=fix(a.decay), write=fix(a.write)) for a in m.aux),
        decay=replace(m.decay, value=fix(m.decay.value)),
        delta=None if m.delta is None else replace(m.delta, a=fix(m.delta.a), c=fix(m.delta.c)),
        write=replace(m.write, key=fix(m.write.key), value=fix(m.write.value)), query=fix(m.query))


def per_head(m: ir.Mixer) -> list:
    """[(label, eigenvalue interval, proved, decay interval)], one row per head when the transition
    reads h, else one row for every head."""
    from lrdsl.checks.checker import analyse, factors
    if m.steps:  # a product: each factor's enclosure (the checker's facts for the product rest on them)
        return [(f"step {j}" + ("" if label == "every head" else f" {label}"), *rest)
                for j, f in enumerate(factors(m), 1) for label, *rest in per_head(f)]
    uses_h = any(sp.sympify(e).has(ir.HEAD) for e, _ in m.expressions())
    rows = []
    for h in (range(HEADS) if uses_h else [None]):
        an = analyse(m if h is None else at_head(m, h))
        rows.append(("every head" if h is None else f"h={h}", an["eig"], an["proved"], an["D"]))
    return rows


def half_life(x: float) -> float:
    """Tokens n with x^n = 1/2 for a decay factor of magnitude x (0 for x = 0, inf for x >= 1)."""
    x = abs(x)
    if x >= 1:
        return math.inf
    return 0.0 if x == 0 else math.log(0.5) / math.log(x)


def horizon(D: tuple) -> tuple:
    """(fewest, most) tokens to halve the state over the decay interval D."""
    lo, hi = D
    mags = [abs(lo), abs(hi)] + ([0.0] if lo <= 0 <= hi else [])
    return half_life(min(mags)), half_life(max(mags))


def growth(m: ir.Mixer, w: dict) -> tuple:
    """Replay a bounded_state witness from S_0 = I: (||S_t|| / ||S_0|| per token, from t = 0 through
    the prefix and the cycles, and the prefix's length)."""
    num = witness.numeric(m)
    steps = len(w["steps"])
    tokens = (w.get("replay") or {}).get("tokens", 200)
    pre = w["prefix"]["repeat"] if w["prefix"] else 0
    env = witness._run(num, w, max(1, math.ceil((tokens - pre) / steps)))
    d, a, c, more = witness._pieces(num, env, w["K"])
    order = m.delta.order if m.delta else None
    S, norms = np.eye(w["K"]), [1.0]
    with np.errstate(all="ignore"):
        for t in range(len(d)):
            S = witness._apply(d[t], a[t], c[t], order, S, more[t])
            norms.append(float(np.linalg.norm(S) / math.sqrt(w["K"])))
    return np.array(norms), pre


def draw(mixer, path: str) -> None:
    """Write the three panels for a compiled (or loaded) lrdsl.Mixer to path (PNG, SVG, PDF)."""
    if not available():
        raise LrdslError("--plot needs matplotlib, which is not installed: pip install matplotlib, "
                         "or leave out --plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrdsl.frontend.printer import product
    m, facts = mixer.ir, mixer.check()
    rows = per_head(m)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    _eigenvalues(ax1, rows, facts)
    _horizons(ax2, rows, m)
    _growth(ax3, m, facts)
    fig.suptitle(f"mixer {m.name}:  M_t = {product(m)}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        raise LrdslError(f"cannot write the plot {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)


def _interval(ax, x, lo, hi, lo_text, hi_text, color, solid=True) -> None:
    """A bar from lo to hi at x, its ends labelled on the right; a dot for a single value."""
    right = dict(textcoords="offset points", xytext=(3, 0), ha="left", va="center", fontsize=7)
    if math.isclose(lo, hi, rel_tol=1e-9, abs_tol=1e-12):
        ax.plot([x], [lo], "o", color=color)
        ax.annotate(hi_text, (x + 0.1, hi), **right)
        return
    ax.bar(x, hi - lo, bottom=lo, width=0.3, color=color if solid else "none", edgecolor=color,
           hatch=None if solid else "//")
    ax.annotate(hi_text, (x + 0.15, hi), **right)
    ax.annotate(lo_text, (x + 0.15, lo), **right)


def _heads_axis(ax, rows) -> None:
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xlim(-0.7, len(rows) - 0.1)


def _eigenvalues(ax, rows, facts) -> None:
    span = 2.5
    ax.axhspan(-1, 1, color="tab:green", alpha=0.12, label="[-1, 1]: stable")
    for x, (_, (lo, hi), proved, _) in enumerate(rows):
        _interval(ax, x, max(lo, -span), min(hi, span), f"{lo:.4g}", f"{hi:.4g}", "tab:blue", proved)
    _heads_axis(ax, rows)
    ax.set_ylim(-span, span)
    ax.set_ylabel("eigenvalues of M_t")
    ax.set_title(f"eigenvalue enclosure per head (stable: {facts['facts']['stable']})\n"
                 "solid: proved; hatched: not proved", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def _horizons(ax, rows, m) -> None:
    ax.set_yscale("log")
    ax.set_ylim(0.5, FAR * 2)
    if m.decay.kind == "identity":
        ax.text(0.5, 0.5, "no decay (D = I):\nthe state never halves by decay", ha="center", va="center",
                transform=ax.transAxes)
    for x, (_, _, _, D) in enumerate(rows if m.decay.kind != "identity" else []):
        fast, slow = horizon(D)
        _interval(ax, x, max(fast, 0.5), min(slow, FAR), "< 1" if fast < 1 else f"{fast:.3g}",
                  "never" if math.isinf(slow) else f"{slow:.3g}", "tab:orange")
    _heads_axis(ax, rows)
    ax.set_ylabel("tokens until the decay halves the state")
    ax.set_title("decay horizon over the declared ranges\n(fewest to most tokens; the erase not counted)",
                 fontsize=9)


def _growth(ax, m, facts) -> None:
    status = facts["facts"]["bounded_state"]
    w = facts["witnesses"].get("bounded_state")
    if status != "disproved" or w is None:
        why = {"proved": "||M_t|| <= 1 at every token:\nno input sequence amplifies the state",
               "unknown": "no proof, and no growing cycle\nof admissible tokens was found"}.get(status, "")
        ax.text(0.5, 0.5, f"bounded state: {status}\n{why}", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    norms, pre = growth(m, w)
    # measured from the end of the prefix, as the checker's replay does: a prefix that builds the
    # aux states may also decay S by many orders of magnitude first
    ax.semilogy(np.arange(len(norms) - pre), norms[pre:] / norms[pre], color="tab:red")
    ax.set_xlabel("tokens of the repeated cycle (zero writes)" +
                  (f"\nafter a {pre}-token prefix that builds the aux states" if pre else ""), fontsize=8)
    ax.set_ylabel("||S_t|| / ||S_0||" + (" (S_0: after the prefix)" if pre else ", S_0 = I"))
    n = len(w["steps"])
    ax.set_title(f"bounded state disproved: the witness replayed (K = {w['K']})\na cycle of {n} "
                 f"token{'s' if n > 1 else ''}, spectral radius {w['value']:.4g} per cycle", fontsize=9)
