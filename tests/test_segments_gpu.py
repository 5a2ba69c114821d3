"""Segmented chunk passes on the GPU: tests/test_segments.py's check at longer sequences and
K = V = 64 (fp32 inputs, tf32 products: test_gpu's tolerances against the one-pass call and the
float64 reference, both on the GPU: o and states 5e-3; dq, dk, dv, dh0 8e-3; other inputs 2e-2),
and the schedule's own choice at a long sequence with few heads (it must cut, and agree). Run on
the device machine with
    LRDSL_TEST_DEVICE=cuda python3 -m pytest -m gpu tests/test_segments_gpu.py -q -n 0
"""
from __future__ import annotations

import functools

import pytest
import torch
from test_cp import ROOT, SPECS, inputs, whole

from lrdsl.runtime import segments as seg
from lrdsl.testing import Case, rms_ratio

pytestmark = pytest.mark.gpu

GPU_CASES = {
    "packed": (Case(B=1, T=3000, H=2, HV=4, K=64, V=64, cu_seqlens=(0, 700, 2100, 2100, 3000),
                    initial_state=True, seed=31), 5),
    "batched": (Case(B=2, T=2048, H=2, HV=4, K=64, V=64, initial_state=True, seed=32), 4),
}
NAMES = ("gated_deltanet", "kda", "gla", "deltanet", "gdn2_atk", "rwkv7", "rwkv6", "delta_product2")


@pytest.mark.parametrize("case_name", list(GPU_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_segments_cuda(name, case_name, compiled):
    case, n = GPU_CASES[case_name]
    mixer = compiled(SPECS[name])
    x, h0, cu = inputs(mixer, case)
    one = whole(functools.partial(mixer.chunk, segments=1), mixer, case, x, h0, cu, torch.float32, "cuda")
    ref = whole(mixer.reference, mixer, case, x, h0, cu, torch.float64, "cuda")
    offsets = None if case.cu_seqlens is None else list(case.cu_seqlens)  # cu_seqlens is on the GPU
    got = whole(functools.partial(mixer.chunk, segments=n, cu_seqlens_cpu=offsets), mixer, case, x, h0, cu,
                torch.float32, "cuda")
    errors = {}
    for what, (o_b, fin_b, g_b) in (("one pass", one), ("reference", ref)):
        errors[what, "o"] = rms_ratio(got[0], o_b)
        errors.update({(what, p): rms_ratio(t, fin_b[p]) for p, t in got[1].items()})
        errors.update({(what, "d" + p): rms_ratio(t, g_b[p]) for p, t in got[2].items()})
    tol = {k: (5e-3 if k[1] == "o" or k[1] in got[1] else
               8e-3 if k[1] in ("dq", "dk", "dv") or k[1].startswith("dh0") else 2e-2) for k in errors}
    bad = {k: f"{e:.3g}" for k, e in errors.items() if not e < tol[k]}
    assert not bad, f"{name} {case_name}: {bad}"


def test_schedule_cuts_a_long_sequence_with_few_heads(compiled):
    """B=1, H=1, T=16384 at K=V=128 (bf16): the schedule cuts it (SM count of this GPU) and the
    result matches one pass."""
    mixer = compiled(SPECS["gated_deltanet"])
    case = Case(B=1, T=16384, H=1, HV=1, K=128, V=128, initial_state=True, seed=33)
    x, h0, _ = inputs(mixer, case)
    x = {n: t.cuda().bfloat16() if n in ("q", "k", "v") else t.cuda() for n, t in x.items()}
    t = dict(x)
    batch = mixer._validate(t.pop("q"), t.pop("k"), t.pop("v"), t, None, h0.cuda(), True, None)
    cut = seg.plan(mixer, batch, None, None)
    assert cut is not None and len(cut.bounds) > 1
    o1, s1 = mixer.chunk(**x, initial_state=h0.cuda(), output_final_state=True, segments=1)
    o2, s2 = mixer.chunk(**x, initial_state=h0.cuda(), output_final_state=True)
    assert rms_ratio(o2, o1) < 1e-2 and rms_ratio(s2, s1) < 1e-2


@pytest.mark.parametrize("name", ["rwkv6", "oja", "delta_product2"])
def test_schedule_cuts_only_where_the_maps_ride_in_one_run(name, compiled):
    """At the shape the schedule cuts for gated_deltanet, it leaves the fallback's specs (rwkv6: a
    bonus term; oja: a value-side transition) in one pass, and cuts a product of steps."""
    path = ROOT / "examples" / f"{name}.lr"
    mixer = compiled(path)
    case = Case(B=1, T=16384, H=1, HV=1, K=128, V=128, seed=34)
    x, _, _ = inputs(mixer, case)
    x = {n: t.cuda() for n, t in x.items()}
    t = dict(x)
    batch = mixer._validate(t.pop("q"), t.pop("k"), t.pop("v"), t, None, None, False, None)
    cut = seg.plan(mixer, batch, None, None)
    assert (cut is not None) == (name == "delta_product2"), cut
