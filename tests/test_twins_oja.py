"""The gated Oja rule's FLA twin (issue 40): examples/oja.lr against flash-linear-attention's
fused_recurrent_gated_oja_rule (a test-only oracle; fla-core 0.6.0 has no naive loop for it), run on
the arguments `lrdsl bench` gives FLA's chunk op (lrdsl/bench.py TWINS["oja"]). So the float64
reference checks the mapping (the decay before the erase, beta on both the erase and the write, v
normalised for FLA, scale), and lrdsl's chunk and recurrent check against code written by others.

FLA's loop computes in float32, hence 1e-5 against the reference. On the CPU it runs in Triton's
interpreter (conftest sets TRITON_INTERPRET=1); FLA's chunk op needs a GPU (the -m gpu test)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_recurrent import DEVICE

import lrdsl
from lrdsl.bench import TWINS
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

pytest.importorskip("fla")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAIVE_TOL = 1e-5


@pytest.fixture(scope="module")
def oja(compiled):
    return compiled(EXAMPLES / "oja.lr")


def fla_recurrent(x: dict, opts: dict):
    """FLA's fused recurrent gated Oja rule on bench's arguments: o [B, T, HV, V], S [N, HV, K, V]."""
    from fla.ops.gated_oja_rule import fused_recurrent_gated_oja_rule
    op, args = TWINS["oja"]
    assert op == "gated_oja_rule.chunk_gated_oja_rule"
    kw = args(dict(x))
    if opts.get("scale") is not None:
        kw["scale"] = opts["scale"]
    h0 = opts["initial_state"]
    return fused_recurrent_gated_oja_rule(**kw, initial_state=None if h0 is None else h0.float(),
                                          output_final_state=True, cu_seqlens=opts.get("cu_seqlens"))


CASES = {
    "B2-HV2": Case(B=2, T=13, H=2, HV=2, K=8, V=6, initial_state=True, seed=3),
    "grouped-HV4-H2": Case(B=1, T=21, H=2, HV=4, K=8, V=8, initial_state=True, scale=0.6, seed=4),
    "packed": Case(B=1, T=30, H=1, HV=2, K=8, V=8, cu_seqlens=(0, 7, 7, 30), initial_state=True, seed=5),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_reference_equals_fla_recurrent(oja, case_id):
    x, opts = draw_inputs(oja, CASES[case_id])
    o, S = oja.reference(**{n: t.double() for n, t in x.items()}, **dict(opts, initial_state=opts["initial_state"].double()))
    o_fla, S_fla = fla_recurrent(x, opts)
    eo, eS = rms_ratio(o_fla, o), rms_ratio(S_fla, S)
    assert eo < NAIVE_TOL and eS < NAIVE_TOL, (eo, eS)


def test_grouped_values_reach_fla_with_one_head_count(oja):
    """FLA's chunk op (fla-core 0.6.0, GPU only) gives o q's heads and groups q heads over k's: at
    HV = 2H bench's arguments repeat q and k to HV heads (the -m gpu test below once got o of H
    heads); test_reference_equals_fla_recurrent[grouped-HV4-H2] runs FLA's loop on them."""
    x, opts = draw_inputs(oja, CASES["grouped-HV4-H2"])
    kw = TWINS["oja"][1](dict(x))
    assert [kw[n].shape[2] for n in ("q", "k", "v", "gv", "beta")] == [4] * 5
    assert torch.equal(kw["q"][:, :, 2:4], x["q"][:, :, 1:2].expand(-1, -1, 2, -1))


def test_a_wrong_mapping_is_caught(oja):
    """The comparison sees the other order: the erase reading the rows before the decay,
    S (I - beta v v^T) diag(exp(gv)), is far from FLA's loop on the same inputs."""
    other = lrdsl.compile(text=(EXAMPLES / "oja.lr").read_text().replace(
        "diag(exp(gv)) (I - beta v v^T)", "(I - beta v v^T) diag(exp(gv))"))
    assert other.ir.delta.order == "left"
    x, opts = draw_inputs(oja, CASES["B2-HV2"])
    o, _ = other.reference(**{n: t.double() for n, t in x.items()}, **dict(opts, initial_state=opts["initial_state"].double()))
    o_fla, _ = fla_recurrent(x, opts)
    assert rms_ratio(o_fla, o) > 100 * NAIVE_TOL


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_paths_equal_fla_recurrent(oja, impl):
    """lrdsl's chunk (two chunks and a bit) and recurrent, fp32, against FLA's loop."""
    x, opts = draw_inputs(oja, Case(B=1, T=37, H=2, HV=4, K=8, V=8, cu_seqlens=(0, 5, 37), initial_state=True,
                                    seed=6), DEVICE)
    with torch.no_grad():
        o, S = getattr(oja, impl)(**x, **opts)
    o_fla, S_fla = fla_recurrent(x, opts)
    eo, eS = rms_ratio(o, o_fla), rms_ratio(S, S_fla)
    assert eo < TOL and eS < TOL, (eo, eS)


# ---- GPU: lrdsl's chunk beside FLA's chunk op, bf16, K = V = 128 ---------------------------------
# (LRDSL_TEST_DEVICE=cuda pytest -m gpu tests/test_twins_oja.py, on the device machine)
FWD_TOL, QKV_TOL, GATE_TOL, TWIN_TOL = 5e-3, 8e-3, 2e-2, 1e-2  # test_gpu.py's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_chunk_beside_fla_chunk_gpu(oja):
    """bf16 inputs (gv fp32) at B=1 T=1000 H=2 HV=4 K=V=128, gv at -1e4 and -inf on single tokens
    and -inf on a 16-token block: lrdsl's chunk forward and the gradients of every input, and
    recurrent, against the float64 reference; FLA's chunk op against it too (forward), on the same
    inputs without the strong decays."""
    from fla.ops.gated_oja_rule import chunk_gated_oja_rule
    B, T, H, HV, K, V = 1, 1000, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = {"q": torch.randn(B, T, H, K, generator=gen, device="cuda").bfloat16(),
         "k": torch.randn(B, T, H, K, generator=gen, device="cuda").bfloat16(),
         "v": torch.randn(B, T, HV, V, generator=gen, device="cuda").bfloat16(),
         "gv": torch.nn.functional.logsigmoid(torch.randn(B, T, HV, V, generator=gen, device="cuda") + 3),
         "beta": torch.rand(B, T, HV, generator=gen, device="cuda").bfloat16()}
    plain = dict(x)  # FLA's domain: its chunk op gave nan on the strong decays below (H100, 2026-12-06)
    x["gv"] = x["gv"].clone()
    x["gv"][0, 100] = -1e4
    x["gv"][0, 555] = float("-inf")
    x["gv"][0, 704:720] = float("-inf")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = oja.reference(**ref_leaves, output_final_state=True)
    (ref_o * do.double()).sum().backward()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = oja.chunk(**leaves, output_final_state=True)
    (o.double() * do.double()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s),
            **{"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x}}
    with torch.no_grad():
        o_r, s_r = oja.recurrent(**x, output_final_state=True)
        o_f, _ = chunk_gated_oja_rule(**TWINS["oja"][1](plain), output_final_state=True)
        ref_plain, _ = oja.reference(**{n: t.double() for n, t in plain.items()})
    errs.update({"recurrent o": rms_ratio(o_r, ref_o), "recurrent S": rms_ratio(s_r, ref_s),
                 "fla o": rms_ratio(o_f, ref_plain)})
    limit = lambda n: (TWIN_TOL if n.startswith("fla") else FWD_TOL if n in ("o", "S") or " " in n
                       else QKV_TOL if n in ("dq", "dk", "dv") else GATE_TOL)
    bad = {n: e for n, e in errs.items() if not e < limit(n)}
    assert not bad, (bad, errs)
