"""GPU suite (run on the device machine: LRDSL_TEST_DEVICE=cuda pytest -m gpu tests/test_gpu.py).

Every example, bf16 inputs, B=2, T=2048, H=4, K=V=128: chunk and recurrent against the float64
reference. Kernels must compile for Hopper; results are compared, never trusted.
"""
import glob
import os

import pytest
import torch
import torch.nn.functional as F
from specgen import kernel_examples

import lrdsl
from lrdsl.frontend.params import sample

EXAMPLES = [str(p) for p in kernel_examples()]  # every example but the offline solve
RESULTS = []

pytestmark = pytest.mark.gpu


def rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def state_error(s, ref):
    """rms ratio of a final state: the worst of S and, for a whole state, its auxiliary states."""
    if isinstance(ref, lrdsl.MixerState):
        return max([rms_ratio(s.S, ref.S)] + [rms_ratio(s.aux[n], t) for n, t in ref.aux.items()])
    return rms_ratio(s, ref)


def event_ms(step, reps: int) -> float:
    """ms per call of step() over reps calls, between two CUDA events (the caller has compiled it)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def loss_grads(fn, x, dtype, h0, do, dht, **kw):
    """o, the final state S and the gradients of (o . do) + (S . dht) with respect to every input and
    h0, for fn (a mixer's chunk or reference) on x cast to dtype. The leaves are fresh copies, never
    x's own tensors: t.to(dtype) of a tensor already in dtype is t itself, and a second call would
    add its gradients to the first's."""
    leaves = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
    h = h0.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
    o, s = fn(**leaves, initial_state=h, output_final_state=True, **kw)
    ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
    return {"o": o.detach(), "S": s.detach(), **{n: t.grad for n, t in leaves.items()}, "h0": h.grad}


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
        elif i.lo != -float("inf") and i.hi == float("inf"):  # e.g. a regulariser lamb in (0, inf)
            x = float(i.lo) + 0.25 + F.softplus(x)
        elif i.hi != float("inf") and i.lo == -float("inf"):
            x = float(i.hi) - 0.25 - F.softplus(x)
        elif i.unit and not i.l2norm:
            x = F.normalize(x, dim=-1)
        out[i.name] = x.to(dtype)
    for p in mixer.ir.params:  # drawn by their init (as lrdsl.nn.Layer does), one per head
        shape = (HV,) if p.kind == "scalar" else (HV, K)
        # rounded to the dtype here, so that the reference sees the values the kernels see
        out[p.name] = sample(p.init, shape, torch.Generator().manual_seed(len(out))).to(device, dtype)
    return out


@pytest.fixture(scope="session", autouse=True)  # not module: conftest would put the file on one xdist worker
def table():
    """The rms ratios of this process's tests, printed at its end (seen with -n 0 or -s)."""
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
        eo, es = rms_ratio(o, ref_o), state_error(s, ref_s)
        RESULTS.append((mixer.name, which, eo, es))
        assert eo < 5e-3 and es < 5e-3, (which, eo, es)


GATE_TOL, QKV_TOL = 2e-2, 8e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.basename(p)[:-3])
def test_backward_bf16(path):
    _check_backward_bf16(lrdsl.compile(path), "chunk bwd")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "precond_deltanet", "kda_decay_after_erase"])
def test_backward_bf16_keeping_intermediates(name):
    """keep_intermediates=True: the staged backward reads the forward's chunk states and WY stage
    (the split's too) instead of making them again; the same tolerances."""
    _check_backward_bf16(lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.lr"),
                                       keep_intermediates=True),
                         "chunk bwd kept")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "delta_product2"])
def test_backward_bf16_in_segments(name):
    """chunk(..., segments=4) on bf16 inputs: the wide run's output finished on strided views
    (affine._Finish, bf16 only) and the maps composed piece by piece (affine.incoming); the same
    tolerances against float64 as one pass."""
    _check_backward_bf16(lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.lr")),
                         "chunk bwd, 4 segments", segments=4)


def _check_backward_bf16(mixer, label, segments=None):
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    h0 = torch.randn(B, HV, K, V, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda")
    dht = torch.randn(B, HV, K, V, generator=gen, device="cuda")
    weights = {}

    def daux(name, t):  # one random weight tensor per auxiliary final state, the same for both runs
        if name not in weights:
            weights[name] = torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64)
        return weights[name]

    def grads(fn, dtype):
        leaves = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
        h = h0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        o, s = fn(**leaves, initial_state=h, output_final_state=True)
        loss = (o.double() * do.double()).sum()
        if isinstance(s, lrdsl.MixerState):  # every part of a whole final state (the ATK's P too)
            loss = loss + sum((t.double() * daux(n, t)).sum() for n, t in s.aux.items())
            s = s.S
        (loss + (s.double() * dht.double()).sum()).backward()
        return {**{n: t.grad for n, t in leaves.items()}, "h0": h.grad}

    ref = grads(mixer.reference, torch.float64)
    got = grads(mixer.chunk if segments is None else lambda **a: mixer.chunk(**a, segments=segments), torch.bfloat16)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref}
    print(mixer.name, " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    RESULTS.append((mixer.name, label, max(errs[n] for n in ("q", "k", "v")),
                    max([errs[n] for n in errs if n not in ("q", "k", "v", "h0")] or [0.0])))
    for n, e in errs.items():
        assert e < (QKV_TOL if n in ("q", "k", "v", "h0") else GATE_TOL), (n, e)


EDGE = [("deltanet", 256, 256, torch.bfloat16), ("gla", 256, 256, torch.bfloat16),
        ("precond_kda", 100, 100, torch.float16), ("gdn2", 64, 200, torch.float32),
        ("gated_deltanet", 128, 128, torch.float32), ("kda_decay_after_erase", 128, 64, torch.bfloat16)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name,K,V,dtype", EDGE, ids=[f"{n}-K{k}-V{v}" for n, k, v, _ in EDGE])
def test_edge_sizes(name, K, V, dtype):
    """K and V up to 256 and not powers of two, T not a multiple of the chunk, varlen, fp16/fp32."""
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path)
    T, H = 300, 2
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = draw(mixer, 1, T, H, H, K, V, dtype, "cuda", gen)
    cu = torch.tensor([0, 1, 130, 300], device="cuda")
    h0 = torch.randn(3, H, K, V, generator=gen, device="cuda")
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    do = torch.randn(1, T, H, V, generator=gen, device="cuda")
    ref_o, ref_s = mixer.reference(**ref_leaves, initial_state=h0.double(), output_final_state=True,
                                   cu_seqlens=cu)
    (ref_o * do.double()).sum().backward()
    o, s = mixer.chunk(**leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    (o.double() * do.double()).sum().backward()
    with torch.no_grad():
        o2, s2 = mixer.recurrent(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    errs = {"o": rms_ratio(o, ref_o), "S": state_error(s, ref_s), "o rec": rms_ratio(o2, ref_o),
            **{"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x}}
    RESULTS.append((f"{name} K{K} V{V}", str(dtype)[6:], errs["o"], max(errs.values())))
    for n, e in errs.items():
        assert e < (5e-3 if n in ("o", "S", "o rec") else QKV_TOL if n in ("dq", "dk", "dv") else GATE_TOL), (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("strength,varlen", [(1.0, False), (20.0, False), (3.0, True)],
                         ids=["drawn-decays", "exact-blocks", "varlen-mixed"])
def test_native_forward_of_a_decay_after_the_erase(strength, varlen, monkeypatch):
    """kda_decay_after_erase's own staged forward (plan.rank2, LRDSL_NATIVE_RANK2=1; no gradient asked for), bf16: decays
    as drawn, per-token log-decays down to -20 (16-token blocks past exp(-60): the exact path) and a
    mix over varlen sequences, against the float64 reference."""
    monkeypatch.setenv("LRDSL_NATIVE_RANK2", "1")  # opt-in
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", "kda_decay_after_erase.lr"))
    calls, fwd = [], mixer.kernels.rank2_fwd
    monkeypatch.setattr(mixer.kernels, "rank2_fwd", lambda *a, **k: calls.append(1) or fwd(*a, **k))
    B, T, H, K, V = (1, 1500, 4, 128, 128) if varlen else (2, 1000, 4, 128, 128)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    if strength != 1.0:
        x["g"] = (-strength * torch.rand(x["g"].shape, generator=gen, device="cuda")).to(x["g"].dtype)
    cu = torch.tensor([0, 1, 700, 1500], device="cuda") if varlen else None
    h0 = torch.randn(3 if varlen else B, H, K, V, generator=gen, device="cuda")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0.double(),
                                   output_final_state=True, cu_seqlens=cu)
    o, s = mixer.chunk(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    eo, es = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    RESULTS.append((mixer.name, "native fwd", eo, es))
    assert calls == [1] and eo < 5e-3 and es < 5e-3, (calls, eo, es)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["novel_test_only", "erase_other", "right_scalar"])
def test_novel_spec_written_for_the_tests_gpu(name):
    """tests/specs/<name>.lr (not in examples/; all three run split, lrdsl/codegen/split.py): bf16, chunk
    forward and backward and recurrent forward against the float64 reference, same limits as the
    examples."""
    path = os.path.join(os.path.dirname(__file__), "specs", f"{name}.lr")
    B, T, H, K, V = 2, 2048, 4, 128, 128
    mixer = lrdsl.compile(path)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    do = torch.randn(B, T, H, V, generator=gen, device="cuda")
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, _ = mixer.reference(**ref_leaves)
    (ref_o * do.double()).sum().backward()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = mixer.chunk(**leaves)
    (o.double() * do.double()).sum().backward()
    with torch.no_grad():
        o2, _ = mixer.recurrent(**x)
    errs = {"o": rms_ratio(o, ref_o), "o rec": rms_ratio(o2, ref_o),
            **{"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x}}
    RESULTS.append((name, "all", errs["o"], max(errs.values())))
    for n, e in errs.items():
        assert e < (5e-3 if n.startswith("o") else QKV_TOL if n in ("dq", "dk", "dv") else GATE_TOL), (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["rwkv7", "dplr", "iplr", "kda_decay_after_erase"])
def test_split_in_place_bf16_gpu(name, monkeypatch):
    """The split's in-place route (runtime/split.py, 2026-12-07: no [B, 2T, ...] copy, so
    codegen/split.py's interleave refuses here): bf16, packed sequences from an initial state, chunk
    forward and backward beside the float64 reference, the examples' limits."""
    from lrdsl.codegen import split as codegen_split
    monkeypatch.setattr(codegen_split, "interleave", lambda t: pytest.fail("the split interleaved its inputs"))
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path)
    T, H, K, V = 2048, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = draw(mixer, 1, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    cu = torch.tensor([0, 701, 702, T], device="cuda", dtype=torch.int64)
    h0 = torch.randn(3, H, K, V, generator=gen, device="cuda")
    do = torch.randn(1, T, H, V, generator=gen, device="cuda")
    ds = torch.randn(3, H, K, V, generator=gen, device="cuda")
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    ref["initial_state"] = h0.double().requires_grad_()
    ref_o, ref_s = mixer.reference(**ref, cu_seqlens=cu, output_final_state=True)
    ((ref_o * do.double()).sum() + (ref_s * ds.double()).sum()).backward()
    got = {n: t.clone().requires_grad_() for n, t in x.items()}
    got["initial_state"] = h0.clone().requires_grad_()
    o, s = mixer.chunk(**got, cu_seqlens=cu, output_final_state=True)
    ((o.double() * do.double()).sum() + (s.double() * ds.double()).sum()).backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s),
            **{"d" + n: rms_ratio(got[n].grad, ref[n].grad) for n in got}}
    RESULTS.append((name, "in place", errs["o"], max(errs.values())))
    for n, e in errs.items():
        limit = 5e-3 if n in ("o", "S") else QKV_TOL if n in ("dq", "dk", "dv", "dinitial_state") else GATE_TOL
        assert e < limit, (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "mamba2", "retnet", "kda", "gla", "rwkv6"])
def test_every_staged_config(name):
    """Each config the autotuner of a staged kernel may pick, one kernel at a time (the others at
    their first config), against the float64 reference, bf16, varlen: the outputs for a forward
    kernel, the gradients for a backward one. Triton on Hopper has miscompiled some (kernel,
    config) pairs of this shape (FLA #640, #984): none is trusted."""
    from triton.runtime.autotuner import Autotuner
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path)
    T, H, K, V = 2000, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = draw(mixer, 1, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    cu = torch.tensor([0, 300, 1000, 1937, 2000], device="cuda")
    h0 = torch.randn(4, H, K, V, generator=gen, device="cuda")
    do = torch.randn(1, T, H, V, generator=gen, device="cuda")
    # a random final-state gradient, as flash-linear-attention's tests draw it (|S|^2 as the loss,
    # our first choice, weights the state far above the outputs: there FLA's own k gradient is
    # 1.1e-2 from float64 and ours 8.4e-3, both above the limit made for o.do)
    dht = torch.randn(4, H, K, V, generator=gen, device="cuda")

    def run(fn, dtype, backward):
        # fresh leaves each run: .to() of a tensor already in dtype would return x's own tensor,
        # and its .grad would add up from run to run
        leaves = {n: t.detach().to(dtype).clone().requires_grad_(backward) for n, t in x.items()}
        h = h0.to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_(backward)
        o, s = fn(**leaves, initial_state=h, output_final_state=True, cu_seqlens=cu)
        if not backward:
            return {"o": o, "S": s}
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        return {**{n: t.grad for n, t in leaves.items()}, "h0": h.grad}

    ref = {b: run(mixer.reference, torch.float64, b) for b in (False, True)}
    space = mixer.kernels.TUNING_SPACE  # every config, also when LRDSL_AUTOTUNE=0 tunes over one
    # bf16 inputs: the kernels for fp32 intermediates run in test_edge_sizes (fp16 and fp32 inputs)
    tuners = {n: getattr(mixer.kernels, n) for n in space if not n.endswith("_fp32")}
    assert tuners and all(isinstance(t, Autotuner) for t in tuners.values())
    assert "staged_output" in tuners
    assert {"staged_dq", "staged_dstate", "staged_dk"} <= set(tuners)
    saved = {n: (t.configs, dict(t.cache)) for n, t in tuners.items()}
    try:
        for n, tuner in tuners.items():
            # where the forward makes W and U in staged_solve_wy (plan.solve_wy_fused), staged_wy
            # runs in the backward (it recomputes them there from the stored X)
            backward = n.startswith("staged_d") or (n == "staged_wy" and "staged_solve_wy" in tuners)
            for cfg in space[n]:
                for m, other in tuners.items():
                    other.configs = [cfg] if m == n else space[m][:1]
                    other.cache.clear()
                got = run(mixer.chunk, torch.bfloat16, backward)
                errs = {k: rms_ratio(got[k], ref[backward][k]) for k in got}
                label = f"{n[7:13]} {cfg.num_warps}w{cfg.num_stages}s" + "".join(f"{k}{v}" for k, v in sorted(cfg.kwargs.items()))
                if backward:
                    RESULTS.append((name, label, max(errs[k] for k in ("q", "k", "v")),
                                    max([e for k, e in errs.items() if k not in ("q", "k", "v", "h0")] or [0.0])))
                    for k, e in errs.items():
                        assert e < (QKV_TOL if k in ("q", "k", "v", "h0") else GATE_TOL), (n, str(cfg), k, e)
                else:
                    RESULTS.append((name, label, errs["o"], errs["S"]))
                    assert errs["o"] < 5e-3 and errs["S"] < 5e-3, (n, str(cfg), errs)
    finally:
        for n, t in tuners.items():
            t.configs, t.cache = saved[n][0], saved[n][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "mamba2", "kda", "rwkv6"])
def test_strong_decays_gpu(name):
    """Log-decays of -1e8 and -inf at single tokens (bf16 inputs, fp32 gates): chunk forward and
    backward against the float64 reference, same limits as the examples. (rwkv6: the readout of the
    state before the token inside the staged kernels, plan.readout_before.)"""
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path)
    B, T, H, K, V = 1, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    g = next(i.name for i in mixer.ir.inputs if i.log)  # the log-decay input (rwkv6's w)
    x[g] = x[g].float()
    x[g][0, 100] = -1e8
    x[g][0, 555] = float("-inf")
    x[g][0, 706:710] = -30.0  # one 16-token block decaying past exp(-60): kda's exact diagonal block
    do = torch.randn(B, T, H, V, generator=gen, device="cuda")
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = mixer.reference(**ref_leaves, output_final_state=True)
    (ref_o * do.double()).sum().backward()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, output_final_state=True)
    (o.double() * do.double()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s),
            **{"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x}}
    RESULTS.append((name, "g=-1e8,-inf", errs["o"], max(errs.values())))
    for n, e in errs.items():
        assert e < (5e-3 if n in ("o", "S") else QKV_TOL if n in ("dq", "dk", "dv") else GATE_TOL), (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gdn2_atk", "precond_kda"])
def test_prefill_then_decode_whole_state_gpu(name):
    """Mixers with an auxiliary state, bf16 inputs: prefill with chunk (packed sequences, from a
    whole initial state), then decode 1 and 7 tokens with step, which updates the whole state in
    place; outputs and the final whole state against one float64 reference pass."""
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path)
    N, T, pre, H, K, V = 3, 700, 692, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = draw(mixer, N, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    first = mixer.reference(**{n: t[:, :50].double() for n, t in x.items()}, output_final_state=True)[1]
    h0 = lrdsl.MixerState(first.S.float(), {n: t.float() for n, t in first.aux.items()})
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=first,
                                   output_final_state=True)
    # prefill: the N sequences packed into one row
    packed = {n: t[:, :pre].reshape(1, N * pre, *t.shape[2:]) for n, t in x.items()}
    cu = torch.arange(N + 1, device="cuda") * pre
    with torch.no_grad():
        o_pre, state = mixer.chunk(**packed, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        outs = [o_pre.reshape(N, pre, H, V)]
        for lo, hi in ((pre, pre + 1), (pre + 1, T)):
            outs.append(mixer.step(**{n: t[:, lo:hi].contiguous() for n, t in x.items()}, state=state))
    e_o = rms_ratio(torch.cat(outs, 1), ref_o)
    e_s = state_error(state, ref_s)
    RESULTS.append((name, "prefill+step", e_o, e_s))
    assert e_o < 5e-3 and e_s < 5e-3, (e_o, e_s)


OFFLINE = [str(p) for p in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "mesa*.lr")))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("path,K", [(p, 64) for p in OFFLINE] + [(p, 128) for p in OFFLINE if p.endswith("/mesa.lr")],
                         ids=lambda x: os.path.basename(x)[:-3] if isinstance(x, str) else f"K{x}")
def test_offline_solve_bf16(path, K):
    """The offline solve (Mesa) in bf16 against the exact float64 reference: chunk and recurrent
    outputs and whole final states (S and G) from a whole initial state, and the chunk's gradients
    of every input and of S0. K = V = 64 with the spec's CG steps (30, or 20 for mesa_retention),
    and mesa at K = V = 128, the benchmark's size."""
    B, T, H, V = 2, 1024, 4, K
    mixer = lrdsl.compile(path)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    warm = mixer.reference(**{n: t[:, :64].double() for n, t in x.items()}, output_final_state=True)[1]
    h0 = lrdsl.MixerState(warm.S.float(), {n: t.float() for n, t in warm.aux.items()})
    do = torch.randn(B, T, H, V, generator=gen, device="cuda")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=warm,
                                   output_final_state=True)
    for which in ("chunk", "recurrent"):
        with torch.no_grad():
            o, s = getattr(mixer, which)(**x, initial_state=h0, output_final_state=True)
        eo, es = rms_ratio(o, ref_o), state_error(s, ref_s)
        RESULTS.append((mixer.name, which, eo, es))
        assert eo < 1e-2 and es < 1e-2, (which, eo, es)

    def grads(fn, dtype):
        leaves = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in x.items()}
        S0 = (warm.S if dtype == torch.float64 else h0.S).clone().requires_grad_()
        start = lrdsl.MixerState(S0, warm.aux if dtype == torch.float64 else h0.aux)
        o, _ = fn(**leaves, initial_state=start)
        (o.double() * do.double()).sum().backward()
        return {**{n: t.grad for n, t in leaves.items()}, "h0": S0.grad}

    ref, got = grads(mixer.reference, torch.float64), grads(mixer.chunk, torch.bfloat16)
    errs = {n: rms_ratio(got[n], ref[n]) for n in ref}
    RESULTS.append((mixer.name, "chunk bwd", max(errs[n] for n in ("q", "k", "v")),
                    max([errs[n] for n in errs if n not in ("q", "k", "v", "h0")] or [0.0])))
    for n, e in errs.items():
        assert e < 2e-2, (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "gla", "mamba2", "gdn2_atk", "kda_decay_after_erase"])
def test_nonfinite_causal_gpu(name):
    """bf16 inputs with a nan log-decay at one token of sequence 0 (inside a chunk) and an inf in
    one value entry of sequence 1 (at a chunk start): chunk's o and final state are finite exactly
    where the float64 reference's are, and match it there (tests/test_nonfinite.py on the CPU)."""
    path = next(p for p in EXAMPLES if os.path.basename(p) == name + ".lr")
    mixer = lrdsl.compile(path, check_ranges=False)
    B, T, H, K, V = 2, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    x["g"][0, 421] = float("nan")
    x["v"][1, 512, 1, 7] = float("inf")
    h0 = torch.randn(B, H, K, V, generator=gen, device="cuda")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0.double(),
                                   output_final_state=True)
    with torch.no_grad():
        o, s = mixer.chunk(**x, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o[0, :421]).all() and torch.isfinite(o[1, :512]).all()
    parts = [("o", o, ref_o)]
    if isinstance(ref_s, lrdsl.MixerState):  # a whole state: S and each auxiliary state
        parts += [("S", s.S, ref_s.S)] + [(n, s.aux[n], t) for n, t in ref_s.aux.items()]
    else:
        parts.append(("S", s, ref_s))
    for part, got, ref in parts:
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), fin), (part, (torch.isfinite(got) != fin).nonzero()[:4].tolist())
        err = rms_ratio(got[fin], ref[fin])
        RESULTS.append((name, "nonfinite " + part, err, 0.0))
        assert err < 5e-3, (part, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["comba", "gated_deltanet", "kda", "delta_product2"])
def test_finite_loads_gpu(name, monkeypatch):
    """bf16 inputs with a nan key row at token 421 of sequence 0, an inf value entry at token 512 of
    sequence 1 and a -inf log-decay (a reset) at token 300 of sequence 1: the staged backward that
    reads the inputs itself (codegen/finite.py) makes no finite copy and gives the copy path's
    gradients (nonfinite.FINITE_AT_LOAD = False), nan at the same entries
    (tests/test_nonfinite_loads.py on the CPU)."""
    from lrdsl.runtime import nonfinite
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", name + ".lr"), check_ranges=False)
    B, T, H, K, V = 2, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    x["k"][0, 421] = float("nan")
    x["v"][1, 512, 1, 7] = float("inf")
    x["g"][1, 300] = -float("inf")
    do = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=torch.float32)

    def grads(at_load):
        monkeypatch.setattr(nonfinite, "FINITE_AT_LOAD", at_load)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, _ = mixer.chunk(**leaves)
        (torch.nan_to_num(o.float(), nan=0.0, posinf=0.0, neginf=0.0) * do).sum().backward()
        return {n: t.grad for n, t in leaves.items()}

    old = grads(False)
    copies = nonfinite.device_copies
    monkeypatch.setattr(nonfinite, "device_copies", lambda *a: pytest.fail("a finite copy was made"))
    new = grads(True)
    monkeypatch.setattr(nonfinite, "device_copies", copies)
    errs = {}
    for n in old:
        assert torch.equal(torch.isnan(new[n]), torch.isnan(old[n])), (n, "nan at other entries")
        f = torch.isfinite(old[n])
        assert torch.equal(f, torch.isfinite(new[n])) and f.any(), (n, "inf at other entries")
        errs[n] = rms_ratio(new[n][f].float(), old[n][f].float())
    assert torch.isnan(new["k"][0, 421]).all() and torch.isnan(new["v"][1, 512, 1, 7])
    RESULTS.append((name, "finite loads", max(errs[n] for n in ("q", "k", "v")),
                    max(e for n, e in errs.items() if n not in ("q", "k", "v"))))
    for n, e in errs.items():
        assert e < 1e-3, (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "gdn2_atk", "kda_decay_after_erase", "gated_deltanet-general",
                                  "mesa"])
def test_nonfinite_backward_gpu(name, monkeypatch):
    """bf16 inputs with a nan log-decay at token 421 of sequence 0 and an inf in one value entry at
    token 512 of sequence 1: every input's gradient at the tokens before the bad one of its sequence
    against the float64 reference on the clean inputs, the loss (nan_to_num(o) * do) masked to the
    outputs the reference leaves finite on the spoiled ones (tests/test_nonfinite_backward.py on the
    CPU); the bad entries' own gradients are nan. "-general": the general kernels."""
    stem = name.removesuffix("-general")
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", stem + ".lr"), check_ranges=False)
    if name.endswith("-general"):  # (the module is shared with the suite's other tests)
        monkeypatch.setattr(mixer.kernels, "STAGED_MAX_K", 0)
    B, T, H, K, V = 2, 1000, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    spoiled = {n: t.clone() for n, t in x.items()}
    spoiled["g"][0, 421] = float("nan")
    spoiled["v"][1, 512, 1, 7] = float("inf")
    with torch.no_grad():
        fin = torch.isfinite(mixer.reference(**{n: t.double() for n, t in spoiled.items()})[0])
    assert fin[0, :421].all() and fin[1, :512].all() and not fin[0, 421:].all() and not fin[1, 512:].all()
    do = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=torch.float64)

    def grads(fn, inputs, dtype, d):
        leaves = {n: t.detach().to(dtype).clone().requires_grad_() for n, t in inputs.items()}
        o, _ = fn(**leaves)
        (torch.nan_to_num(o.double(), nan=0.0, posinf=0.0, neginf=0.0) * d).sum().backward()
        return {n: t.grad for n, t in leaves.items()}

    ref, got = grads(mixer.reference, x, torch.float64, do * fin), grads(mixer.chunk, spoiled, torch.bfloat16, do)
    assert torch.isnan(got["g"][0, 421]).all() and torch.isnan(got["v"][1, 512, 1, 7])
    errs = {}
    for n in ref:
        a, b = (torch.cat([g[0, :421], g[1, :512]]) for g in (got[n], ref[n]))
        assert torch.isfinite(a).all(), (n, "not finite before the bad token")
        errs[n] = rms_ratio(a, b)
    RESULTS.append((name, "nonfinite bwd", max(errs[n] for n in ("q", "k", "v")),
                    max(e for n, e in errs.items() if n not in ("q", "k", "v"))))
    for n, e in errs.items():
        assert e < 2e-2, (n, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_overflowing_gain_dirty_chunk_of_staged_dr_gpu():
    """tests/test_nonfinite_backward.py's spec whose gain b exp(a) overflows fp32 at one token: its
    chunk is flagged dirty, and staged_dr's dirty branch (which makes u again from the inputs,
    2026-12-06) keeps q's gradient before that token exact. bf16 inputs, a = 0 but at token 421 of
    sequence 0 (inside a chunk), where it is 100: q's gradient at the tokens before it, the loss
    masked to them, against the float64 reference."""
    from test_nonfinite_backward import OVERFLOWING_GAIN

    from lrdsl.codegen.plan import plan
    mixer = lrdsl.compile(text=OVERFLOWING_GAIN, check_ranges=False)
    assert plan(mixer.ir).split_dr and hasattr(mixer.kernels, "staged_dr_kernel")
    B, T, H, K, V, row = 1, 1000, 2, 128, 128, 421
    gen = torch.Generator(device="cuda").manual_seed(10)
    x = draw(mixer, B, T, H, H, K, V, torch.bfloat16, "cuda", gen)
    x["a"].zero_()  # b exp(a) = b in [0, 1]: a stable erase elsewhere
    x["a"][0, row] = 100.0
    do = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=torch.float64)
    do[:, row:] = 0

    def dq(fn, dtype):
        q = x["q"].detach().to(dtype).clone().requires_grad_()
        o, _ = fn(**{n: t.to(dtype) for n, t in x.items() if n != "q"}, q=q)
        (torch.nan_to_num(o.double(), nan=0.0, posinf=0.0, neginf=0.0) * do).sum().backward()
        return q.grad[0, :row]

    ref, got = dq(mixer.reference, torch.float64), dq(mixer.chunk, torch.bfloat16)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(got).all(), "dq not finite before the overflowing token"
    err = rms_ratio(got, ref)
    RESULTS.append((mixer.name, "overflowing gain dq", err, 0.0))
    assert err < 2e-2, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_bench_gpu_time_counts_the_calls_kernels():
    """`lrdsl bench`'s GPU time sums the kernels a call launches: none for a host-only call, some for
    a forward, and the forward + backward's includes the forward's kernels."""
    from lrdsl.bench import Shape, bench, gpu_ms
    assert gpu_ms(lambda: None) == 0.0
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", "mamba2.lr"))
    row = bench(mixer, Shape(1, 256, 2, 64, 64), backward=True, with_twin=False, log=lambda s: None)
    ll = row["lrdsl"]
    assert 0 < ll["fwd_gpu_ms"] < ll["both_gpu_ms"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_bench_twin_of_the_decay_after_erase_computes_the_spec():
    """`lrdsl bench` times kda_decay_after_erase beside FLA's chunk_dplr_delta_rule on arguments made
    from the spec's inputs: FLA's kernel on them is the spec's float64 reference, as ours is (bf16,
    within 1e-2: a transition erasing before its decay, as kda's, is off by orders more; FLA's
    kernel's own precision is not what is tested here)."""
    from lrdsl.bench import twin
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", "kda_decay_after_erase.lr"))
    name, run = twin(mixer)
    assert name == "generalized_delta_rule.chunk_dplr_delta_rule"
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = draw(mixer, 2, 1000, 4, 4, 128, 128, torch.bfloat16, "cuda", gen)
    ref, _ = mixer.reference(**{n: t.double() for n, t in x.items()})
    for prenormalised in (False, True):
        given = dict(x, q=F.normalize(x["q"].float(), dim=-1).bfloat16(),
                     k=F.normalize(x["k"].float(), dim=-1).bfloat16()) if prenormalised else x
        err = rms_ratio(run(given, prenormalised=prenormalised), ref)
        RESULTS.append((mixer.name, "FLA twin", err, 0.0))
        assert err < 1e-2, (prenormalised, err)
    assert rms_ratio(mixer.chunk(**x)[0], ref) < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_autotuning_on_the_calls_tensors_leaves_gradients_alone(name):
    """The suite runs each kernel's first config (LRDSL_AUTOTUNE=0); here staged_dk tunes over its
    whole space on the call's own tensors, as a fresh process does, and the gradients must match
    the first config's (staged_dk adds to what staged_dq stored: without its restoring hooks each
    timed launch would add again)."""
    import triton
    mixer, grads = _gradients_of(name, seed=7)
    mod = mixer.kernels
    first = grads()
    tuner = mod.staged_dk
    saved = tuner.configs, tuner.cache_results
    space = list(mod.TUNING_SPACE["staged_dk"])
    if len(space) == 1:  # one config is never timed: time a copy beside it
        c = space[0]
        space.append(triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg))
    tuner.configs, tuner.cache_results = space, False
    tuner.cache.clear()
    try:
        tuned = grads()
    finally:  # the module is shared with the suite's other tests
        tuner.configs, tuner.cache_results = saved
        tuner.cache.clear()
    for n in first:
        assert rms_ratio(tuned[n], first[n]) < 1e-2, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_a_tuning_space_is_compiled_at_once_then_timed(tmp_path, monkeypatch):
    """lrdsl/tuning.py: where the autotuner has no record on disk, staged_dk's whole space is
    compiled on the thread pool first (one batch of every config), then timed; the gradients are the
    first config's (as in the test above)."""
    import triton

    from lrdsl.runtime import tuning
    mixer, grads = _gradients_of("gated_deltanet", seed=8)
    mod = mixer.kernels
    first = grads()
    tuner = mod.staged_dk
    saved = tuner.configs, tuner.cache_results, tuner.run, tuner.check_disk_cache
    space = list(mod.TUNING_SPACE["staged_dk"])
    assert len(space) > 1
    batches = []  # kernels the pool compiled, per batch
    compile_all = tuning._compile
    kernels = tuner.fn.device_caches[torch.cuda.current_device()][0]

    def counted(fn, configs, a, k):
        before = len(kernels)
        compile_all(fn, configs, a, k)
        batches.append(len(kernels) - before)
    monkeypatch.setattr(tuning, "_compile", counted)
    # no record on disk and nothing compiled: the space is compiled, then timed
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    kernels.clear()
    tuner.configs, tuner.cache_results = space, True
    tuner.cache.clear()
    tuning._wrap(tuner)
    try:
        tuned = grads()
    finally:  # the module is shared with the suite's other tests
        tuner.configs, tuner.cache_results, tuner.run, tuner.check_disk_cache = saved
        tuner.cache.clear()
    assert batches == [len(space)]
    for n in first:
        assert rms_ratio(tuned[n], first[n]) < 1e-2, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_a_first_call_compiles_its_kernels_ahead_then_tunes(tmp_path, monkeypatch):
    """lrdsl/tuning.py compile_ahead on kda's forward: with no record on disk, the dry pass
    compiles every config of the tuned kernels the forward launches, launching none of them, and
    the call that follows tunes them and gives the first configs' output."""
    import triton

    from lrdsl.runtime import tuning
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", "kda.lr"))
    mod = mixer.kernels
    x = draw(mixer, 2, 1024, 4, 4, 128, 128, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(11))
    with torch.no_grad():
        first = mixer.chunk(**x)[0]
    dev = torch.cuda.current_device()
    names = list(mod.TUNING_SPACE)
    saved = {n: (getattr(mod, n).configs, getattr(mod, n).cache_results) for n in names}
    launches, compiled = [], {}
    dry = tuning.dry_run

    def counted(module, fn, args, kwargs):
        def hook(*_):
            launches.append(fn)
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            dry(module, fn, args, kwargs)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
        compiled.update((n, len(getattr(mod, n).fn.device_caches[dev][0])) for n in names)
    monkeypatch.setattr(tuning, "dry_run", counted)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no record on disk
    try:
        for n in names:
            t = getattr(mod, n)
            t.configs, t.cache_results = list(mod.TUNING_SPACE[n]), True
            t.cache.clear()
            t.fn.device_caches[dev][0].clear()
        tuning.compile_ahead(mod, entries=("chunk_fwd",))
        with torch.no_grad():
            tuned = mixer.chunk(**x)[0]
    finally:  # the module is shared with the suite's other tests
        for n in names:
            t = getattr(mod, n)
            t.configs, t.cache_results = saved[n]
            t.cache.clear()
    assert compiled and launches == []
    for n in ("staged_solve", "staged_wy", "staged_state", "staged_output"):
        assert compiled[n] >= len(mod.TUNING_SPACE[n]) > 1, (n, compiled)
    assert compiled["staged_dq"] == 0  # a backward kernel: not in the forward
    assert rms_ratio(tuned, first) < 1e-2


def _gradients_of(name, seed):
    """An example's mixer, and a function giving the gradients of sum(o) in every input for one
    fixed draw (B=2 T=1024 H=4 K=V=128, bf16)."""
    mixer = lrdsl.compile(os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.lr"))
    x = draw(mixer, 2, 1024, 4, 4, 128, 128, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(seed))

    def grads():
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o = mixer.chunk(**leaves)[0]
        o.backward(torch.ones_like(o))
        return {n: t.grad for n, t in leaves.items()}
    return mixer, grads
