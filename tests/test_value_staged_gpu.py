"""GPU checks of the value side's forward on the key side's staged kernels (codegen/value_key.py,
templates/chunk_value_out.py.jinja; run on the device machine:
LRDSL_TEST_DEVICE=cuda pytest -m gpu -s tests/test_value_staged_gpu.py).

bf16 inputs of examples/oja.lr, packed sequences with an empty one, grouped value heads, h0 and
the final state, with and without a -inf block of log-decays: o and S against the float64
reference and against the token loop forward (LRDSL_VALUE_STAGED=0); and at the benchmark's shape
(B=4 T=4096 H=16 K=V=128) both forwards' times, printed (the token loop took 32.5 ms on an H100,
FLA's chunk_gated_oja_rule 2.14 ms). Also `lrdsl bench --backward examples/oja.lr`.
And the direct form (codegen/value_key.direct) against the per-token vector path, forward + backward;
and the readout kernel's value tiles and warps, timed (a sweep for its defaults).
"""
from pathlib import Path

import pytest
import torch
from test_gpu import draw, event_ms, rms_ratio

import lrdsl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (device machine)")]
OJA = Path(__file__).resolve().parent.parent / "examples" / "oja.lr"
O_TOL = 5e-3  # bf16 inputs against float64 (test_gpu.py's forward tolerance)


def both(monkeypatch):
    """(the staged forward's mixer, the token loop's)."""
    staged = lrdsl.compile(OJA)
    assert staged.value_route is not None
    with monkeypatch.context() as mp:
        mp.setenv("LRDSL_VALUE_STAGED", "0")
        loop = lrdsl.compile(OJA)
    assert loop.value_route is None
    return staged, loop


@pytest.mark.parametrize("block_inf", [False, True])
def test_oja_staged_forward_packed_grouped_bf16(block_inf, monkeypatch):
    staged, loop = both(monkeypatch)
    B, T, H, HV, K, V = 1, 3000, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = draw(staged, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    if block_inf:
        x["gv"][:, 1000:1064] = -float("inf")  # a whole chunk of the staged forward
        x["gv"][:, 2000:2016] = -float("inf")  # a whole 16-token block of the readout
    cu = torch.tensor([0, 700, 700, 2100, 3000], device="cuda")
    h0 = torch.randn(4, HV, K, V, generator=gen, device="cuda")
    with torch.no_grad():
        o, s = staged.chunk(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        o0, s0 = loop.chunk(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        ref_o, ref_s = staged.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0.double(),
                                        output_final_state=True, cu_seqlens=cu)
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s), "o vs loop": rms_ratio(o, o0),
            "S vs loop": rms_ratio(s, s0), "loop o": rms_ratio(o0, ref_o)}
    print("oja staged fwd", "block-inf" if block_inf else "", " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for n, e in errs.items():
        assert e < O_TOL, (n, e)


def test_oja_staged_forward_time(monkeypatch):
    """Both forwards at the benchmark's shape, bf16: ms printed; o of the first sequence against the
    float64 reference."""
    staged, loop = both(monkeypatch)
    B, T, H, K, V = 4, 4096, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = draw(staged, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    times = {}
    with torch.no_grad():
        for name, m in (("staged", staged), ("token loop", loop)):
            o, _ = m.chunk(**x)  # compile, tune
            times[name] = event_ms(lambda m=m: m.chunk(**x), 5)
        ref, _ = staged.reference(**{n: t[:1].double() for n, t in x.items()})
        err = rms_ratio(staged.chunk(**x)[0][:1], ref)
    print(f"oja chunk fwd B=4 T=4096 H=16 K=V=128 bf16: staged {times['staged']:.2f} ms, token loop "
          f"{times['token loop']:.2f} ms, o rms ratio {err:.1e} ({torch.cuda.get_device_name()})")
    assert err < O_TOL


def _vector_path(monkeypatch):
    """oja compiled with codegen/value_key.direct refused: the sub-mixer on the per-token vectors."""
    from lrdsl.codegen import value_key
    with monkeypatch.context() as mp:
        mp.setattr(value_key, "direct", lambda m: None)
        m = lrdsl.compile(OJA)
        assert m.value_route is not None and m.value_route.forward.func.__name__ == "forward"
    return m


def test_oja_direct_form_bf16(monkeypatch):
    """The direct form (the sub-mixer KDA on the raw inputs, 2026-12-06) against the float64
    reference and the vector path, forward and every gradient, bf16, packed with an empty sequence,
    grouped value heads, h0 and the final state (test_gpu.py's tolerances); then forward + backward
    of both at the benchmark's shape, ms printed (the vector path took 15.9 on an H100, FLA 7.8)."""
    from test_gpu import GATE_TOL, QKV_TOL, loss_grads
    direct, vectors = lrdsl.compile(OJA), _vector_path(monkeypatch)
    assert direct.value_route.forward.func.__name__ == "direct_forward"
    B, T, H, HV, K, V = 1, 3000, 2, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = draw(direct, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    x["gv"][:, 2000:2016] = -float("inf")
    cu = torch.tensor([0, 700, 700, 2100, 3000], device="cuda")
    h0 = torch.randn(4, HV, K, V, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    dht = torch.randn(4, HV, K, V, generator=gen, device="cuda")

    ref = loss_grads(direct.reference, x, torch.float64, h0, do, dht, cu_seqlens=cu)
    got = loss_grads(direct.chunk, x, torch.bfloat16, h0, do, dht, cu_seqlens=cu)
    old = loss_grads(vectors.chunk, x, torch.bfloat16, h0, do, dht, cu_seqlens=cu)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref}
    errs.update({f"{n} vs vectors": rms_ratio(got[n], old[n]) for n in ref})
    print("oja direct", " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        name = n.split()[0]
        assert e < (O_TOL if name in ("o", "S") else QKV_TOL if name in ("q", "k", "v", "h0") else GATE_TOL), (n, e)

    B, T, H = 4, 4096, 16
    x = draw(direct, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    times = {}
    for name, m in (("direct", direct), ("vectors", vectors)):
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        dy = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

        def step(m=m, leaves=leaves, dy=dy):
            o, _ = m.chunk(**leaves)
            o.backward(dy)
        step()  # compiles and tunes
        times[name] = event_ms(step, 5)
    print(f"oja chunk fwd + bwd B=4 T=4096 H=16 K=V=128 bf16: direct {times['direct']:.2f} ms, vectors "
          f"{times['vectors']:.2f} ms ({torch.cuda.get_device_name()})")


@pytest.mark.parametrize("max_bv", [16, 32, 64])
@pytest.mark.parametrize("warps", [2, 4, 8])
def test_oja_readout_tiles_time(warps, max_bv, monkeypatch):
    """The readout kernel (templates/chunk_value_out.py.jinja) at each of its value tiles (MAX_BV)
    and warps (WARPS), oja's forward at the benchmark's shape (B=4 T=4096 H=16 K=V=128 bf16): ms
    printed for choosing the defaults (the readout took about 2.3 of the forward's 3.4 ms on an H100
    at 32a3cad as a [16, 16, BV] tile, 0.63 of 1.71 on tensor cores at 140e797), o against the
    defaults' o."""
    from lrdsl.runtime import value_key
    m = lrdsl.compile(OJA)
    B, T, H, K, V = 4, 4096, 16, 128, 128
    x = draw(m, B, T, H, H, K, V, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(9))
    with torch.no_grad():
        base, _ = m.chunk(**x)
        out = value_key.out_module(m.value_route.forward.keywords["sub"].kernels.STAGED_CHUNK)
        monkeypatch.setattr(out, "WARPS", warps)
        monkeypatch.setattr(out, "MAX_BV", max_bv)
        o, _ = m.chunk(**x)  # compiles this variant
        ms = event_ms(lambda: m.chunk(**x), 10)
    err = rms_ratio(o, base)
    print(f"oja fwd, readout WARPS={warps} MAX_BV={max_bv}: {ms:.3f} ms, o vs the "
          f"defaults' {err:.1e} ({torch.cuda.get_device_name()})")
    assert err < 1e-2
