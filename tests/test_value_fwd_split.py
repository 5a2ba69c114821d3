"""The value side's chunked forward over key tiles (templates/chunk_value.py.jinja, VALUE_K_SPLIT):
each program a tile of the key channels, the partial outputs added on the host; against the float64
reference, forward and (through the backward kernel) every gradient: packed sequences with an
empty one, grouped value heads, h0, a tile that K does not fill, a -inf block of log-decays; and a
spec whose query is L2-normalised over K keeps all of K in one program."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dplr import against_reference, failing
from test_recurrent import DEVICE, PoisonTorch

import lrdsl
from lrdsl.codegen import value_key
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CASE = Case(B=1, T=45, H=1, HV=2, K=40, V=16, cu_seqlens=(0, 13, 13, 45), initial_state=True, seed=12)


@pytest.fixture(scope="module")
def oja():
    """examples/oja.lr on the token loop forward (its chunked forward is otherwise the staged one:
    test_value_staged.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(value_key.SWITCH, "0")
        m = lrdsl.compile(EXAMPLES / "oja.lr")
    assert m.value_route is None
    return m


# block_inf and the gradients under -m slow: the token loop forward is oja's no longer by default
@pytest.mark.parametrize("block_inf", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_key_tiles_match_the_reference(oja, block_inf, monkeypatch):
    """Three key tiles of 16 (the last one half full), every output element written (poisoned
    buffers), o and the final state against the reference."""
    assert oja.kernels.VALUE_K_SPLIT
    x, opts = draw_inputs(oja, CASE, DEVICE)
    if block_inf:
        x["gv"] = x["gv"].clone()
        x["gv"][:, 17:33] = -float("inf")
    poison = PoisonTorch()
    monkeypatch.setattr(oja.kernels, "torch", poison)
    monkeypatch.setattr(oja.kernels, "VALUE_FWD_BK", 16)
    with torch.no_grad():
        o, s = oja.chunk(**x, **dict(opts, output_final_state=True))
    assert poison.poisoned >= 3  # o, its partial sums and the final state
    ref_o, ref_s = oja.reference(**{n: t.double() for n, t in x.items()},
                                 **dict(opts, initial_state=opts["initial_state"].double(), output_final_state=True))
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.slow
def test_key_tiles_gradients(oja, monkeypatch):
    """The same forward under the backward kernel: every input's gradient and h0's."""
    monkeypatch.setattr(oja.kernels, "VALUE_FWD_BK", 16)
    x, opts = draw_inputs(oja, CASE, DEVICE)
    bad = failing(against_reference(oja, x, dict(opts, output_final_state=True), impls=("chunk",)))
    assert not bad, bad


def test_a_key_norm_keeps_all_of_k(monkeypatch):
    """q L2-normalised over K: one program holds all of K (VALUE_FWD_BK is not used), and the
    output is the reference's."""
    m = lrdsl.compile(text="mixer knorm\ninput q[K] l2norm, k[K], v[V] l2norm, beta in (0, 1), w[V] log\n"
                           "S = S diag(exp(w)) (I - beta v v^T) + beta k v^T\no = S^T q\n")
    assert not m.kernels.VALUE_K_SPLIT
    monkeypatch.setattr(m.kernels, "VALUE_FWD_BK", 16)
    x, opts = draw_inputs(m, CASE, DEVICE)
    with torch.no_grad():
        o, s = m.chunk(**x, **dict(opts, output_final_state=True))
    ref_o, ref_s = m.reference(**{n: t.double() for n, t in x.items()},
                               **dict(opts, initial_state=opts["initial_state"].double(), output_final_state=True))
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL
