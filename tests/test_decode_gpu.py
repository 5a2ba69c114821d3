"""CUDA graphs (issue 43), on the device machine: LRDSL_TEST_DEVICE=cuda pytest -m gpu tests/test_decode_gpu.py

A training step (chunk's forward and backward) and decoding (step, a multi-token step with its
rollback) captured in a CUDA graph, replayed on fresh inputs copied into the static ones, against
the same calls run eagerly on those inputs; and no synchronising CUDA call in either
(torch.cuda.set_sync_debug_mode("error")).
"""
import os

import pytest
import torch
import torch.nn.functional as F

import lrdsl
from lrdsl.bench import capture
from lrdsl.testing import rms_ratio

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def draw(mixer, B, T, H, K, V, seed):
    """bf16 inputs inside their ranges (log-decays fp32, as lrdsl bench draws them)."""
    from lrdsl.bench import Shape
    from lrdsl.bench import draw as bench_draw
    return bench_draw(mixer, Shape(B, T, H, K, V), seed=seed)


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_forward_and_backward_in_a_cuda_graph(name):
    """chunk's forward and backward of every input, captured once, replayed on new inputs: o and
    every gradient as an eager call on those inputs gives them (the same kernels: within 1e-3)."""
    mixer = lrdsl.compile(os.path.join(EXAMPLES, name + ".lr"))
    B, T, H, K, V = 2, 1024, 4, 128, 128
    static = {n: t.clone().requires_grad_() for n, t in draw(mixer, B, T, H, K, V, seed=1).items()}
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in static.values():
            t.grad = None
        o, _ = mixer.chunk(**static)
        o.backward(do)
        return o

    graph, o_static = capture(step)
    fresh = draw(mixer, B, T, H, K, V, seed=2)
    with torch.no_grad():
        for n, t in static.items():
            t.copy_(fresh[n])
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    got = {"o": o_static.clone(), **{n: t.grad.clone() for n, t in static.items()}}
    eager = {n: t.clone().requires_grad_() for n, t in fresh.items()}
    o, _ = mixer.chunk(**eager)
    o.backward(do)
    want = {"o": o, **{n: t.grad for n, t in eager.items()}}
    errs = {n: rms_ratio(got[n], want[n]) for n in want}
    assert all(e < 1e-3 for e in errs.values()), errs


def test_eager_forward_and_backward_make_no_synchronising_call():
    """The default path, outside a graph: torch.cuda.set_sync_debug_mode("error") raises at any
    .item(), pageable host-to-device copy, nonzero, ... (the wall time waits for none)."""
    mixer = lrdsl.compile(os.path.join(EXAMPLES, "gated_deltanet.lr"))
    x = {n: t.requires_grad_() for n, t in draw(mixer, 2, 512, 4, 128, 128, seed=3).items()}
    o, _ = mixer.chunk(**x)  # the first call tunes and compiles (it may synchronise)
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, _ = mixer.chunk(**x)
        o.backward(torch.ones_like(o))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "precond_deltanet", "rwkv6", "delta_product2"])
def test_step_in_a_cuda_graph(name):
    """Decoding captured once: a one-token step, then a four-token verification step that keeps the
    states after each token and rolls each sequence back to its own accepted count. Replayed from a
    state set between replays, as an eager run from the same state."""
    mixer = lrdsl.compile(os.path.join(EXAMPLES, name + ".lr"))
    B, H, K, V = 8, 4, 128, 128
    one = draw(mixer, B, 1, H, K, V, seed=4)
    four = draw(mixer, B, 4, H, K, V, seed=5)
    start = mixer.zero_state(B, H, K, V, device="cuda")
    parts = [start.S, *start.aux.values()] if isinstance(start, lrdsl.MixerState) else [start]
    gen = torch.Generator(device="cuda").manual_seed(6)
    for p in parts:
        p.copy_(F.normalize(torch.rand(p.shape, generator=gen, device="cuda"), dim=-1))
    initial = [p.clone() for p in parts]
    accepted = torch.tensor([1, 2, 3, 4, 4, 3, 2, 1], device="cuda")
    o1 = torch.empty(B, 1, H, V, device="cuda", dtype=torch.bfloat16)
    o4 = torch.empty(B, 4, H, V, device="cuda", dtype=torch.bfloat16)

    def decode(state):
        mixer.step(**one, state=state, out=o1)
        _, every = mixer.step(**four, state=state, out=o4, return_states=True)
        mixer.accept(state, every, accepted)
        return every

    with torch.no_grad():
        graph, _ = capture(lambda: decode(start))
        for p, p0 in zip(parts, initial):
            p.copy_(p0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        got = [o1.clone(), o4.clone(), *[p.clone() for p in parts]]
        state = mixer.zero_state(B, H, K, V, device="cuda")
        for p, p0 in zip([state.S, *state.aux.values()] if isinstance(state, lrdsl.MixerState) else [state], initial):
            p.copy_(p0)
        decode(state)
        want = [o1, o4, *([state.S, *state.aux.values()] if isinstance(state, lrdsl.MixerState) else [state])]
    errs = [rms_ratio(g, w) for g, w in zip(got, want)]
    assert all(e < 1e-3 for e in errs), errs


def test_decode_bench_row_times_both():
    """`lrdsl bench --decode`'s row: lrdsl's step and FLA's fused recurrent twin, graph and eager."""
    from lrdsl.bench import decode_row
    mixer = lrdsl.compile(os.path.join(EXAMPLES, "gated_deltanet.lr"))
    r = decode_row(mixer, 8, 4, 64, 64)
    assert 0 < r["lrdsl_ms"] and 0 < r["lrdsl_eager_ms"] and 0 < r["lrdsl_verify_ms"]
    assert "fla_error" in r or (0 < r["fla_ms"] and 0 < r["fla_eager_ms"])


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_wide_decode_matches_the_reference(name):
    """One token for 256 sequences of 16 heads (RECURRENT_WIDE's value tile and warps: 16384
    programs at BV 32) inside a CUDA graph: o and the state against the float64 reference step."""
    mixer = lrdsl.compile(os.path.join(EXAMPLES, name + ".lr"))
    mod = mixer.kernels
    B, H, K, V = 256, 16, 128, 128
    assert (V // mod.RECURRENT_BV) * B * H >= mod.RECURRENT_WIDE[0]
    x = draw(mixer, B, 1, H, K, V, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    start = F.normalize(torch.rand(B, H, K, V, generator=gen, device="cuda"), dim=-1)
    state = start.clone()
    out = torch.full((B, 1, H, V), float("nan"), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, _ = capture(lambda: mixer.step(**x, state=state, out=out))
        state.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=start.double(),
                                       output_final_state=True)
    assert rms_ratio(out, ref_o) < 1e-2 and rms_ratio(state, ref_s) < 1e-4, (rms_ratio(out, ref_o), rms_ratio(state, ref_s))
