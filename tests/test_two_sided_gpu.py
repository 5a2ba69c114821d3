"""GPU checks of the two-sided transition's chunk (forward: templates/recurrent_value.py.jinja;
backward: templates/chunk_two_sided_bwd.py.jinja; run on the device machine:
LRDSL_TEST_DEVICE=cuda pytest -m gpu -s tests/test_two_sided_gpu.py).

bf16 inputs of a KDA-by-Oja spec (M = (I - beta k k^T) diag(exp(g)), N = diag(exp(gv)) (I - beta v v^T)),
packed sequences and grouped value heads, with a -inf block of either side's log-decay: chunk's
output, final state and gradients against the float64 reference (test_gpu.py's tolerances); and
at the benchmark's shape (B=4 T=4096 H=16 K=V=128) the forward and backward's time and extra
memory for each checkpoint spacing, printed, with a bound on the memory.
"""
import pytest
import torch
from test_gpu import GATE_TOL, QKV_TOL, draw, loss_grads, rms_ratio
from test_value_bwd_gpu import time_fwd_bwd

import lrdsl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (device machine)")]
SPEC = """mixer kda_oja
input q[K], k[K] l2norm, v[V] l2norm, g[K] log, gv[V] log, beta in (0, 1)
S = (I - beta k k^T) diag(exp(g)) S diag(exp(gv)) (I - beta v v^T) + beta k v^T
o = S^T q
"""


@pytest.mark.parametrize("block_inf", [None, "g", "gv"])
def test_two_sided_packed_grouped_bf16(block_inf):
    mixer = lrdsl.compile(text=SPEC)
    B, T, H, HV, K, V = 1, 3000, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    if block_inf:
        x[block_inf][:, 1000:1064] = -float("inf")  # whole checkpoint intervals
    cu = torch.tensor([0, 700, 700, 2100, 3000], device="cuda")
    h0 = torch.randn(4, HV, K, V, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    dht = torch.randn(4, HV, K, V, generator=gen, device="cuda")

    ref = loss_grads(mixer.reference, x, torch.float64, h0, do, dht, cu_seqlens=cu)
    got = loss_grads(mixer.chunk, x, torch.bfloat16, h0, do, dht, cu_seqlens=cu)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref}
    print("two-sided bwd", block_inf or "", " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < (5e-3 if n in ("o", "S") else QKV_TOL if n in ("q", "k", "v", "h0") else GATE_TOL), (n, e)


@pytest.mark.parametrize("warps", [4, 8, 16])
@pytest.mark.parametrize("BT", [16, 32, 64])
def test_two_sided_time_and_memory(BT, warps, monkeypatch):
    """Forward and backward at the benchmark's shape for each checkpoint spacing (TWO_SIDED_BWD_BT:
    checkpoints of 16 GiB / BT against a scratch of BT x 4 MiB over all programs) and number of
    warps of the backward (TWO_SIDED_BWD_WARPS), time and extra memory printed for choosing the
    defaults."""
    mixer = lrdsl.compile(text=SPEC)
    monkeypatch.setattr(mixer.kernels, "TWO_SIDED_BWD_BT", BT)
    monkeypatch.setattr(mixer.kernels, "TWO_SIDED_BWD_WARPS", warps)
    ms, extra = time_fwd_bwd(mixer)
    print(f"two-sided chunk fwd+bwd B=4 T=4096 H=16 K=V=128 bf16, BT={BT} warps={warps}: {ms:.1f} ms, "
          f"{extra:.2f} GiB extra")
    assert extra < 8, extra  # per-token vectors and their gradients (~2.3 GiB), checkpoints, scratch
