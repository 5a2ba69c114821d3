"""IR -> the source of its standalone module (same IR -> same bytes)."""
from __future__ import annotations

from lrdsl._version import __version__
from lrdsl.codegen.plan import plan
from lrdsl.codegen.render import render, render_solve
from lrdsl.codegen.solve import solve_plan
from lrdsl.frontend import ir


def generate(m: ir.Mixer) -> str:
    """The standalone module for a mixer."""
    if m.solve_lam is not None:  # the offline solve (Mesa) has kernels of its own
        return render_solve(solve_plan(m), __version__)
    return render(plan(m), __version__)
