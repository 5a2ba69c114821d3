"""Text -> IR: the front end as one pure function."""
from __future__ import annotations

import dataclasses

from lrdsl.errors import SpecError
from lrdsl.frontend.desugar import solve_steps
from lrdsl.frontend.ir import Mixer
from lrdsl.frontend.lower import lower
from lrdsl.frontend.syntax import MAX_BYTES, parse


def spec_to_ir(text, filename: str = "<spec>") -> Mixer:
    if isinstance(text, (bytes, bytearray)) and len(text) <= MAX_BYTES:
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            pass  # parse() reports where the bad byte is
    source = text if isinstance(text, str) else ""
    try:
        spec, steps, span = solve_steps(parse(text, filename))
        m = lower(spec)
        if steps is None:
            return m
        if m.solve_lam is None:
            raise SpecError("`steps` counts the conjugate-gradient steps of the offline solve, which this "
                            "spec does not read through (o = S^T (G + diag(lamb))^-1 q)", span)
        return dataclasses.replace(m, solve_steps=steps)
    except SpecError as e:
        raise e.located(source, filename) from None
