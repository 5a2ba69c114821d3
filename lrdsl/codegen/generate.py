"""IR -> the source of its standalone module (same IR -> same bytes)."""
from __future__ import annotations

from lrdsl._version import __version__
from lrdsl.codegen import finite
from lrdsl.codegen.plan import plan
from lrdsl.codegen.render import render, render_solve
from lrdsl.codegen.solve import solve_plan
from lrdsl.frontend import ir


def generate(m: ir.Mixer) -> str:
    """The standalone module for a mixer."""
    if m.steps:  # a product runs on its sub-mixer's module (codegen/product.py), never on one of its own
        raise ValueError(f"mixer {m.name} has {m.n_steps} steps per token: generate its sub-mixer's module")
    if m.solve_lam is not None:  # the offline solve (Mesa) has kernels of its own
        return render_solve(solve_plan(m), __version__)
    return render(plan(m), __version__, finite.rules(m))
