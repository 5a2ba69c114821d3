"""Plan -> the kernels a module defines and the launches its host functions make, in order.

Python decides here; the templates it names are straight kernels with named holes. The module
template renders `kernel_templates(plan)` one after another (each may import the shared macros of
common.jinja, nothing deeper), and the host functions are rendered from `forward(plan)` and
`backward(plan)`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import Plan


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a host function."""
    role: str  # what it makes: "solve", "wy", "state", "output", "dstate", "dk", ...
    variant: str  # which form of that role this plan takes ("" where there is one)
    template: str  # the template file that defines the kernel
    kernel: str  # the kernel's name in the generated module


def _general(plan: Plan) -> tuple:
    """The token loop, the general chunked forward and backward (every spec has them)."""
    return ("recurrent.py.jinja", "prologue.py.jinja", "chunk.py.jinja", "chunk_bwd.py.jinja")


def _staged_forward(plan: Plan) -> tuple:
    """Templates of the staged forward's kernels (plan.staged), in the module's order."""
    return ("chunk_staged.py.jinja",)


def _staged_backward(plan: Plan) -> tuple:
    """Templates of the staged backward's kernels (plan.staged_backward), in the module's order.

    Rendered by chunk_staged.py.jinja for now (before staged_host.py.jinja, whose autotuned
    wrappers name these kernels), so none is listed here yet: _bwd_templates lists them."""
    return ()


def _bwd_templates(plan: Plan) -> tuple:
    """The staged backward's templates: stage 1 (staged_dq), 2 (staged_dstate), 3 (staged_dk, after
    staged_de where plan.split_dk and staged_dr where plan.split_dr), with a decay per key channel 4
    (staged_pair), then the host function. A form of a kernel other than the decay-per-head one
    is a template that fills the blocks of that kernel's file (the `_key` and `_split` ones)."""
    if not plan.staged_backward:
        return ()
    if plan.decay_kind == "diagonal":
        return ("staged_bwd_dq_key.py.jinja", "staged_bwd_dstate.py.jinja", "staged_bwd_dk_key.py.jinja",
                "staged_bwd_pair.py.jinja", "staged_bwd_host_key.py.jinja")
    stage3 = ("staged_bwd_dk.py.jinja",)
    if plan.split_dr:
        stage3 = ("staged_bwd_de.py.jinja", "staged_bwd_dr.py.jinja", "staged_bwd_dk_split.py.jinja")
    elif plan.split_dk:
        stage3 = ("staged_bwd_de.py.jinja", "staged_bwd_dk_de.py.jinja")
    return ("staged_bwd_dq.py.jinja", "staged_bwd_dstate.py.jinja", *stage3, "staged_bwd_host.py.jinja")


def kernel_templates(plan: Plan) -> tuple:
    """Every template the module renders, in order, each once."""
    out = list(_general(plan))
    if plan.staged:
        out += _staged_forward(plan) + _staged_backward(plan)
        if plan.chain is not None:
            out.append("chain_rule.py.jinja")
    elif plan.rank2:
        out.append("staged_rank2.py.jinja")
    return tuple(dict.fromkeys(out))
