"""conftest.py's cheaper helper calls and type bookkeeping for Triton's interpreter
(tests/interpreter_calls.py) give the same bits as the interpreter's own: generated kernels forward
and backward (staged scalar and per-channel decays, an auxiliary state, the general kernels), the
recurrent kernel, and triton.language is left as the interpreter's own launch leaves it."""
from __future__ import annotations

import functools
from pathlib import Path

import interpreter_calls
import pytest
import torch
import triton.language as tl

import lrdsl
from lrdsl.testing import Case, draw_inputs

ROOT = Path(__file__).resolve().parent.parent
CASE = Case(B=1, T=21, H=1, HV=1, K=16, V=12, initial_state=True, seed=5)  # one program per launch: runs twice


def outputs(mixer):
    """o, the final state and every gradient of chunk, and recurrent's o and state, in one list."""
    x, opts = draw_inputs(mixer, CASE, "cpu")
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts.pop("initial_state").clone().requires_grad_()
    o, s = mixer.chunk(**leaves, initial_state=h0, **opts)
    s = s.S if isinstance(s, lrdsl.MixerState) else s
    (o.square().sum() + s.sum()).backward()
    with torch.no_grad():
        o_r, s_r = mixer.recurrent(**x, initial_state=h0.detach(), **opts)
    s_r = s_r.S if isinstance(s_r, lrdsl.MixerState) else s_r
    return [o, s, h0.grad, *(t.grad for t in leaves.values()), o_r, s_r]


@pytest.mark.parametrize("name", ["gated_deltanet", "precond_kda", "kda_decay_after_erase"])
def test_cheaper_helper_calls_give_the_interpreters_bits(name, compiled):
    mixer = compiled(ROOT / "examples" / f"{name}.lr")
    assert interpreter_calls.install()
    skipped = interpreter_calls.SKIPPED[0]
    fast = outputs(mixer)
    assert interpreter_calls.SKIPPED[0] > skipped  # the cheaper calls were taken
    assert isinstance(tl.core.block_type.__dict__.get("name"), functools.cached_property)  # lazy type names
    interpreter_calls.uninstall()
    assert not {"name", "type"} & {*tl.core.block_type.__dict__, *tl.core.tuple_type.__dict__, *tl.core.tuple.__dict__}
    try:
        slow = outputs(mixer)
    finally:
        assert interpreter_calls.install()
    for i, (f, s) in enumerate(zip(fast, slow)):
        assert f.shape == s.shape and torch.equal(f, s), f"output {i} differs"
    assert not any(t.isnan().any() for t in fast)


def test_a_launch_restores_the_language_as_before(compiled):
    before = {n: getattr(tl, n) for n in ("sum", "dot", "where", "exp", "range")}
    before["index"] = tl.tensor.__dict__.get("__index__")
    outputs(compiled(ROOT / "examples" / "gated_deltanet.lr"))
    after = {n: getattr(tl, n) for n in ("sum", "dot", "where", "exp", "range")}
    after["index"] = tl.tensor.__dict__.get("__index__")
    assert after == before
