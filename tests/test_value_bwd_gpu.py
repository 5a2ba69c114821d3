"""GPU checks of the value side's backward kernel (templates/chunk_value_bwd.py.jinja; run on the
device machine: LRDSL_TEST_DEVICE=cuda pytest -m gpu -s tests/test_value_bwd_gpu.py).

bf16 inputs of examples/oja.lr, packed sequences and grouped value heads, with a -inf block of
log-decays: chunk's gradients against the float64 reference (test_gpu.py's tolerances); and at the
benchmark's shape (B=4 T=4096 H=16 K=V=128) the backward's time and extra memory, printed, with a
bound on the memory (the PyTorch backward it replaced took 21 GiB there on an H100).
"""
from pathlib import Path

import pytest
import torch
from test_gpu import GATE_TOL, QKV_TOL, draw, event_ms, loss_grads, rms_ratio

import lrdsl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (device machine)")]
OJA = Path(__file__).resolve().parent.parent / "examples" / "oja.lr"


@pytest.mark.parametrize("block_inf", [False, True])
def test_oja_backward_packed_grouped_bf16(block_inf):
    mixer = lrdsl.compile(OJA)
    B, T, H, HV, K, V = 1, 3000, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    if block_inf:
        x["gv"][:, 1000:1064] = -float("inf")  # a whole checkpoint interval, and a chunk of the forward
    cu = torch.tensor([0, 700, 700, 2100, 3000], device="cuda")
    h0 = torch.randn(4, HV, K, V, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    dht = torch.randn(4, HV, K, V, generator=gen, device="cuda")

    ref = loss_grads(mixer.reference, x, torch.float64, h0, do, dht, cu_seqlens=cu)
    got = loss_grads(mixer.chunk, x, torch.bfloat16, h0, do, dht, cu_seqlens=cu)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref if n not in ("o", "S")}
    print("oja value bwd", "block-inf" if block_inf else "", " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < (QKV_TOL if n in ("q", "k", "v", "h0") else GATE_TOL), (n, e)


@pytest.mark.parametrize("BT", [16, 64])
@pytest.mark.parametrize("BK", [32, 64, 128])
def test_oja_backward_time_and_memory(BK, BT, monkeypatch):
    """Forward and backward at the benchmark's shape for each key tile (VALUE_BWD_BK: more programs
    against more partial sums) and checkpoint spacing (VALUE_BWD_BT: the scratch, BT x 4 MiB over
    all programs here, fits in L2 at small BT, against checkpoints of 16 GiB / BT), time and extra
    memory printed for choosing the defaults."""
    mixer = lrdsl.compile(OJA)
    monkeypatch.setattr(mixer.kernels, "VALUE_BWD_BK", BK)
    monkeypatch.setattr(mixer.kernels, "VALUE_BWD_BT", BT)
    ms, extra = time_fwd_bwd(mixer)
    print(f"oja chunk fwd+bwd B=4 T=4096 H=16 K=V=128 bf16, BK={BK} BT={BT}: {ms:.1f} ms, "
          f"{extra:.2f} GiB extra ({torch.cuda.get_device_name()})")
    # estimate at BK=32 BT=16: per-tile partials 2.1 GiB, the vectors and their graph ~1.5, checkpoints 1
    assert extra < 6.0


@pytest.mark.parametrize("BK", [32, 64, 128])
def test_oja_forward_key_tiles(BK, monkeypatch):
    """The chunked forward over key tiles (VALUE_FWD_BK; 128: one program holds all of K, as before
    2026-12-06) at the benchmark's shape: bf16 o against the float64 reference on the first of
    the four sequences, and the time, printed for choosing the default. The token loop forward is
    pinned (LRDSL_VALUE_STAGED=0): oja's chunk takes the staged one (test_value_staged_gpu.py)."""
    monkeypatch.setenv("LRDSL_VALUE_STAGED", "0")
    mixer = lrdsl.compile(OJA)
    assert mixer.value_route is None
    monkeypatch.setattr(mixer.kernels, "VALUE_FWD_BK", BK)
    B, T, H, K, V = 4, 4096, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    with torch.no_grad():
        o, _ = mixer.chunk(**x)
        ref, _ = mixer.reference(**{n: t[:1].double() for n, t in x.items()})
        err = rms_ratio(o[:1], ref)
        ms = event_ms(lambda: mixer.chunk(**x), 5)
    print(f"oja chunk fwd B=4 T=4096 H=16 K=V=128 bf16, VALUE_FWD_BK={BK}: {ms:.2f} ms, "
          f"o rms ratio {err:.1e} ({torch.cuda.get_device_name()})")
    assert err < 5e-3


def time_fwd_bwd(mixer, B=4, T=4096, H=16, K=128, V=128):
    """GPU ms of one chunk forward + backward (the mean of three after a compiling one) and the peak
    memory above what was allocated before, GiB, bf16 inputs of bench's draw."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = {n: t.requires_grad_() for n, t in draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen).items()}
    do = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=torch.bfloat16)

    def step():
        o, _ = mixer.chunk(**x)
        o.backward(do)

    step()  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = event_ms(step, 3)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 30
