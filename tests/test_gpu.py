"""GPU suite (run on the device machine: LRDSL_TEST_DEVICE=cuda pytest -m gpu tests/test_gpu.py).

Every example, bf16 inputs, B=2, T=2048, H=4, K=V=128: chunk and recurrent against the float64
reference. Kernels must compile for Hopper; results are compared, never trusted.
"""
import glob
import os

import pytest
import torch
import torch.nn.functional as F

import lrdsl

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.lr")))
RESULTS = []

pytestmark = pytest.mark.gpu


def rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def draw(mixer, B, T, H, HV, K, V, dtype, device, gen):
    out = {}
    for i in mixer.ir.inputs:
        heads = H if i.shared else HV
        shape = (B, T, heads) + (() if i.kind == "scalar" else ((K,) if i.kind == "K" else (V,)))
        x = torch.randn(shape, generator=gen, device=device)
        if i.log:
            x = F.logsigmoid(x + 3)
        elif i.lo != -float("inf") and i.hi != float("inf") and not (i.unit or i.l2norm):
            lo, hi = float(i.lo), float(i.hi)
            x = lo + (hi - lo) * torch.sigmoid(x)
        elif i.unit and not i.l2norm:
            x = F.normalize(x, dim=-1)
        out[i.name] = x.to(dtype)
    return out


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    print("\nGPU results (rms ratio vs float64 reference, bf16 inputs, B=2 T=2048 H=4 K=V=128)")
    print(f"{'mixer':28s} {'path':10s} {'o | dqkv':>10s} {'S | dgate':>10s}")
    for name, path, eo, es in RESULTS:
        print(f"{name:28s} {path:10s} {eo:10.2e} {es:10.2e}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.basename(p)[:-3])
def test_forward_bf16(path):
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    mixer = lrdsl.compile(path)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    h0 = torch.randn(B, HV, K, V, generator=gen, device="cuda")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0.double(),
                                   output_final_state=True)
    for which in ("chunk", "recurrent"):
        o, s = getattr(mixer, which)(**x, initial_state=h0, output_final_state=True)
        eo, es = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
        RESULTS.append((mixer.name, which, eo, es))
        assert eo < 5e-3 and es < 5e-3, (which, eo, es)


GATE_TOL, QKV_TOL = 2e-2, 8e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.basename(p)[:-3])
def test_backward_bf16(path):
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    mixer = lrdsl.compile(path)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    h0 = torch.randn(B, HV, K, V, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    dht = torch.randn(B, HV, K, V, generator=gen, device="cuda")

    def grads(fn, dtype):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in x.items()}
        h = h0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        o, s = fn(**leaves, initial_state=h, output_final_state=True)
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        return {**{n: t.grad for n, t in leaves.items()}, "h0": h.grad}

    ref = grads(mixer.reference, torch.float64)
    got = grads(mixer.chunk, torch.bfloat16)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref}
    RESULTS.append((mixer.name, "chunk bwd", max(errs[n] for n in ("q", "k", "v")),
                    max([errs[n] for n in errs if n not in ("q", "k", "v", "h0")] or [0.0])))
    for n, e in errs.items():
        assert e < (QKV_TOL if n in ("q", "k", "v", "h0") else GATE_TOL), (n, e)
