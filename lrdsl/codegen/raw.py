"""The staged kernels' product operands read as stored (plan.raw, raw_key, raw_wy, raw_query,
raw_value): an operand that is one input's tile times per-token numbers is loaded as the input is,
its factor applied after the product."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from lrdsl.codegen.texpr import code, number
from lrdsl.frontend import ir


@dataclass(frozen=True)
class Raw:
    """A product operand that is one input's tile as stored, times a per-token number."""
    ptr: str  # the input's pointer argument
    heads: str  # "H" (one per key head) or "HV"
    head: str  # "i_h" or "i_hv"
    factor: str  # Triton text of the per-token factor, "1.0" when none
    norm: bool = False  # the input is L2-normalised in the kernels (one more per-token number, 1/||x||)


def bounds(i: ir.Input) -> tuple:
    """The declared range of an input as literals; none where the kernels do not clamp it."""
    if not i.clamped:
        return "", ""
    return tuple(number(b) if b.is_finite else "" for b in (i.lo, i.hi))


def raw_operands(m: ir.Mixer) -> tuple:
    """plan.raw: the write key, write value and query as Raw, or () unless all three are."""
    if m.delta is not None or m.decay.kind == "diagonal":
        return ()
    parts = tuple(_raw(m, e, kind) for e, kind in ((m.write.key, "K"), (m.write.value, "V"), (m.query, "K")))
    return parts if all(parts) else ()


def raw_key(m: ir.Mixer) -> Raw | None:
    """plan.raw_key."""
    if m.delta is None or m.decay.kind == "diagonal" or m.aux:
        return None
    return _raw(m, m.write.key, "K", normalised=True)


def raw_wy(m: ir.Mixer) -> tuple:
    """plan.raw_wy."""
    key = raw_key(m)
    if key is None:
        return ()
    c, z = _raw(m, m.delta.c, "K", normalised=True), _raw(m, m.write.value, "V")
    if c is None or z is None or z.factor != "1.0":
        return ()
    return c, z


def wy_one_tile(key: Raw | None, wy: tuple) -> bool:
    """Whether plan.raw_wy's erase read c and plan.raw_key's write key u are one input's tile (the
    delta rules' c = k): the WY stages then take A = x x^T and both normalisers from the tile they
    hold; else (comba's p beside k) the fused solve loads u's tile too, and u's number carries its
    normaliser."""
    return bool(wy) and key is not None and (wy[0].ptr, wy[0].heads) == (key.ptr, key.heads)


def raw_query(m: ir.Mixer) -> Raw | None:
    """plan.raw_query."""
    if m.decay.kind == "diagonal" or m.aux:
        return None
    return _raw(m, m.query, "K", normalised=True)


def raw_value(m: ir.Mixer, raw: tuple) -> Raw | None:
    """plan.raw_value, given plan.raw."""
    v = _raw(m, m.write.value, "V") if m.delta is None else None
    return v if v is not None and (v.factor == "1.0" or raw) else None


def _raw(m: ir.Mixer, e, kind: str, normalised: bool = False) -> Raw | None:
    """e as one input of this kind (unclamped; not normalised, unless `normalised` allows it) times
    per-token numbers, or None."""
    kinds = m.kinds()
    e = m.inline_lets(e)
    tiles = [a for a in sp.Mul.make_args(e) if any(kinds[s.name] != "scalar" for s in a.free_symbols)]
    if len(tiles) != 1 or not isinstance(tiles[0], sp.Symbol):
        return None
    i = next((i for i in m.inputs if i.name == tiles[0].name), None)
    if i is None or i.kind != kind or (i.l2norm and not normalised) or bounds(i) != ("", ""):
        return None
    return Raw(f"in_{i.name}", "H" if i.shared else "HV", "i_h" if i.shared else "i_hv", code(e / tiles[0]), i.l2norm)
