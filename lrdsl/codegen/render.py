"""Plan -> Python source of a standalone module (kernels, host wrappers). Deterministic."""
from __future__ import annotations

import functools
import re
from importlib import resources

import jinja2

from lrdsl.codegen import finite, schedule, value_side
from lrdsl.codegen.plan import Plan


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    root = resources.files("lrdsl.codegen.templates")

    def load(name):
        return root.joinpath(name).read_text()

    return jinja2.Environment(loader=jinja2.FunctionLoader(load), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                              autoescape=False)


def render(plan: Plan, version: str, finite_rules: dict | None = None) -> str:
    """The module; with finite_rules (codegen/finite.py's rules) the staged backward's loads of the
    inputs made finite (finite.sanitise) where it can."""
    text = _render("module.py.jinja", plan=plan, schedule=schedule, value_side=value_side, version=version)
    if finite_rules is None or not plan.staged_backward:
        return text
    backward = backward_functions(plan, version)
    ptrs = {"in_" + n: rule for n, rule in finite_rules.items()}
    for alias, raw in (("rq_ptr", plan.raw_query), ("rk_ptr", plan.raw_key)):
        if raw is not None:
            ptrs[alias] = finite_rules[raw.ptr[3:]]
    try:
        return finite.sanitise(text, backward, ptrs)
    except finite.Unsupported:
        return text


def backward_functions(plan: Plan, version: str) -> set:
    """The names of the functions the staged backward's templates define (codegen/finite.py)."""
    out = set()
    for t in schedule.backward_templates(plan):
        part = _render(t, plan=plan, schedule=schedule, value_side=value_side, version=version)
        out |= set(re.findall(r"^def (\w+)\(", part, re.M))
    return out


def render_solve(solve, version: str) -> str:
    """The module of an offline-solve mixer (codegen/solve.py's SolvePlan)."""
    return _render("mesa_module.py.jinja", solve=solve, plan=solve.base, version=version)


def render_value_out(chunk: int, block: int, version: str) -> str:
    """The readout kernel of a value side on the key side's staged kernels (codegen/value_key.py):
    the same for every spec, for chunks of `chunk` tokens cut into blocks of `block`."""
    return _render("chunk_value_out.py.jinja", chunk=chunk, block=block, span=Plan.diagonal_block_span,
                   version=version)


def _render(template: str, **context) -> str:
    try:
        text = _env().get_template(template).render(**context)
    except jinja2.TemplateSyntaxError as e:  # a bug in a template, not in the user's spec
        raise RuntimeError(f"template {e.name}:{e.lineno}: {e.message}") from None
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text
