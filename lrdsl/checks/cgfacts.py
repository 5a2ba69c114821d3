"""What `lrdsl check` says about the conjugate-gradient solve of an offline-solve spec (Mesa).

The kernels solve A_t x = r_t, A_t = G_t + diag(lam_t), by a fixed number n of CG steps. For a
symmetric positive definite A with condition number kappa, CG's error after n steps obeys
    ||x_n - x||_A <= 2 rho^n ||x_0 - x||_A,   rho = (sqrt(kappa) - 1) / (sqrt(kappa) + 1),
and in exact arithmetic CG ends at x within K steps (one per distinct eigenvalue at most). Over the
declared ranges: lambda_min(A) >= min lam (G is positive semi-definite: the well-posedness proof),
and lambda_max(A) <= ||G|| + max lam, where a write u k^T = r k k^T with |k| = 1 (normalised or
unit keys) has norm r, so from a zero state ||G_t|| <= r_max / (1 - d_max) when the decay stays
below d_max < 1, and ||G_t|| <= t r_max when it may reach 1. Sympy and floats only (no torch).
"""
from __future__ import annotations

import math

from lrdsl.checks.ranges import Ranges
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified

HORIZON = 4096  # tokens at which a growing Gram state is evaluated


def cg_fact(mixer: ir.Mixer, notes: list) -> dict:
    """The "cg" entry of lrdsl check's result (and a note with its argument)."""
    n = mixer.solve_steps
    out = {"steps": n, "exact_for_K_up_to": n, "kappa": None, "gram_norm": None, "rate": None,
           "error_bound": None, "bounded": False}
    if mixer.decay.kind == "diagonal":
        notes.append(f"CG ({n} steps): a decay per key channel makes D G + u k^T non-symmetric, so conjugate "
                     "gradients do not apply; lrdsl generates no kernels for it (the reference solves exactly).")
        out["argument"] = "not symmetric"
        return out
    rng = Ranges(mixer)
    lam_lo, lam_hi = rng.of(mixer.inline_lets(mixer.solve_lam))
    ratio = simplified(mixer.inline_lets(mixer.write.key) / ir.symbol("k"))
    r_hi = rng.of(ratio)[1]
    d_hi = rng.of(mixer.inline_lets(mixer.decay.value))[1] if mixer.decay.kind != "identity" else 1.0
    k_in = mixer.input("k")
    unit = k_in.l2norm or k_in.unit
    growth = ""
    if not unit or not math.isfinite(r_hi):
        gram = math.inf
        growth = "the write u k^T is not bounded (keys not of unit norm, or an unbounded gain)"
    elif d_hi < 1:
        gram = r_hi / (1 - d_hi)
        growth = f"||G|| <= {r_hi:.4g} / (1 - {d_hi:.4g}) = {gram:.4g} (decay <= {d_hi:.4g}, gain <= {r_hi:.4g})"
    else:
        gram = HORIZON * r_hi
        growth = (f"the decay may reach 1, so ||G_t|| <= t x {r_hi:.4g}, {gram:.4g} at t = {HORIZON} "
                  "(more for longer sequences)")
    out["gram_norm"] = gram if math.isfinite(gram) else None
    base = (f"The kernels solve (G + diag(lam)) x = q by {n} conjugate-gradient steps from the Jacobi start; "
            f"in exact arithmetic CG ends at the solution within K steps, so it is exact for K <= {n}.")
    if not lam_lo > 0 or not math.isfinite(lam_hi) or not math.isfinite(gram):
        why = [w for w, bad in ((f"lam's declared range reaches down to {lam_lo:.4g}", not lam_lo > 0),
                                ("lam has no upper bound", not math.isfinite(lam_hi)),
                                (growth, not math.isfinite(gram))) if bad]
        notes.append(base + f" For K > {n} its accuracy is not bounded by the declared ranges: "
                     + "; ".join(why) + " (declare tighter ranges to bound the condition number).")
        out["argument"] = "; ".join(why)
        return out
    kappa = (gram + lam_hi) / lam_lo
    rho = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    bound = 2 * rho ** n
    out.update(kappa=kappa, rate=rho, error_bound=bound, bounded=True)
    out["argument"] = (f"lambda_min >= {lam_lo:.4g} (min lam; G is positive semi-definite), lambda_max <= "
                       f"{gram:.4g} + {lam_hi:.4g} ({growth}; max lam), so kappa <= {kappa:.4g}")
    notes.append(base + f" For any K: {out['argument']}, and after {n} steps ||x_n - x||_A <= 2 rho^{n} "
                 f"||x_0 - x||_A = {bound:.3g} ||x_0 - x||_A with rho = {rho:.4g}.")
    return out
