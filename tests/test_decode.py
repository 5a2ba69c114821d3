"""Decoding for speculative decoding and CUDA graphs (issue 43): a multi-token step that returns the
state after every token (step(..., return_states=True)) and rolls back to any of them (accept), into
buffers the caller owns (out=, states_out=); and no host synchronisation in step or in chunk's
forward and backward (a read back of a tensor here would be a wait for the GPU there)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from specgen import kernel_examples
from test_recurrent import DEVICE, state_parts
from torch.utils._python_dispatch import TorchDispatchMode

import lrdsl
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

# an erase and a decay per token; a decay per key channel; auxiliary states (the ATK preconditioner's
# P, K-wide); a readout of the state before the update (rwkv6: runtime/decode.step_before); a product of two
# rank-1 steps per token (runtime/product.step)
STEPPED = ["gated_deltanet", "kda", "precond_deltanet", "rwkv6", "delta_product2"]
CASE = Case(B=3, T=5, H=1, HV=2, K=16, V=12, initial_state=True, seed=11)


def _start(mixer, case, seed):
    """A whole state to decode from: S drawn, auxiliary states drawn non-negative (P is a running
    sum of squares)."""
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(case.B, case.HV, case.K, case.V, generator=gen).to(DEVICE)
    if not mixer.ir.aux:
        return S
    aux = mixer.zero_state(case.B, case.HV, case.K, case.V, device=DEVICE).aux
    return lrdsl.MixerState(S, {n: torch.rand(a.shape, generator=gen).to(DEVICE) for n, a in aux.items()})


def _clone(state):
    if isinstance(state, lrdsl.MixerState):
        return lrdsl.MixerState(state.S.clone(), {n: a.clone() for n, a in state.aux.items()})
    return state.clone()


def _tokens(x, a, b):
    return {n: (t[:, a:b] if t.dim() >= 3 else t) for n, t in x.items()}  # params stay whole


def _single_steps(mixer, x, state, scale, T):
    """o of T one-token steps, and the whole state after each token, {name: [B, T, ...]}."""
    outs, after = [], []
    for t in range(T):
        outs.append(mixer.step(**_tokens(x, t, t + 1), state=state, scale=scale))
        after.append({n: p.clone() for n, p in state_parts(state).items()})
    return torch.cat(outs, 1), {n: torch.stack([a[n] for a in after], 1) for n in after[0]}


@pytest.mark.parametrize("name", [n if n in ("gated_deltanet", "delta_product2") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in STEPPED])
def test_multi_token_step_equals_single_steps(name, compiled):
    """The states after every token and the outputs of one T-token step are those of T one-token
    steps (the same kernel, so to rounding), written into poisoned buffers the caller passed, and the
    state is left at the last token's."""
    mixer = compiled(f"examples/{name}.lr")
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    start = _start(mixer, CASE, 1)
    with torch.no_grad():
        want_o, want = _single_steps(mixer, x, _clone(start), opts["scale"], CASE.T)
        many = _clone(start)
        out = torch.full_like(want_o, math.nan)
        buf = {n: torch.full_like(t, math.nan) for n, t in want.items()}
        states_out = lrdsl.MixerState(buf["S"], {n: t for n, t in buf.items() if n != "S"}) if mixer.ir.aux \
            else buf["S"]
        o, every = mixer.step(**x, state=many, scale=opts["scale"], out=out, return_states=True,
                              states_out=states_out)
    assert o.data_ptr() == out.data_ptr() and every is states_out
    assert rms_ratio(o, want_o) < TOL, name
    for n, t in state_parts(every).items():
        assert rms_ratio(t, want[n]) < TOL, (name, n)
        assert rms_ratio(state_parts(many)[n], want[n][:, -1]) < TOL, (name, n)


@pytest.mark.parametrize("name", ["gated_deltanet", "precond_deltanet"])
def test_accept_rolls_each_sequence_back_to_its_own_count(name, compiled):
    """accept(state, states, n) with one count per sequence (a device tensor) leaves each sequence's
    state as n_b one-token steps leave it; an int count for all of them too."""
    mixer = compiled(f"examples/{name}.lr")
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    start = _start(mixer, CASE, 2)
    n = torch.tensor([2, 5, 1], device=DEVICE)
    with torch.no_grad():
        _, want = _single_steps(mixer, x, _clone(start), opts["scale"], CASE.T)
        state = _clone(start)
        _, every = mixer.step(**x, state=state, scale=opts["scale"], return_states=True)
        mixer.accept(state, every, n)
        for name_, t in state_parts(state).items():
            for b in range(CASE.B):
                assert rms_ratio(t[b], want[name_][b, n[b] - 1]) < TOL, (name_, b)
        mixer.accept(state, every, 3)
        for name_, t in state_parts(state).items():
            assert rms_ratio(t, want[name_][:, 2]) < TOL, name_


def test_step_and_accept_refuse_bad_buffers_and_counts(compiled):
    mixer = compiled("examples/gated_deltanet.lr")
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    state = _start(mixer, CASE, 3)
    with torch.no_grad():
        with pytest.raises(lrdsl.InputError, match=r"out must be a contiguous .* \[B, T, HV, V\] = \[3, 5, 2, 12\]"):
            mixer.step(**x, state=state, out=torch.empty(3, 5, 2, 11, device=DEVICE))
        with pytest.raises(lrdsl.InputError, match=r"states_out must be a tensor \[B, T, HV, K, V\]"):
            mixer.step(**x, state=state, return_states=True, states_out=torch.empty(3, 5, 2, 16, 12, 1))
        _, every = mixer.step(**x, state=state, return_states=True)
        with pytest.raises(lrdsl.InputError, match="from 1 to 5; got n=0"):
            mixer.accept(state, every, 0)
        with pytest.raises(lrdsl.InputError, match=r"\[B\] = \[3\] integer tensor"):
            mixer.accept(state, every, torch.ones(2, dtype=torch.int64))
    mesa = compiled("examples/mesa.lr")
    with pytest.raises(lrdsl.InputError, match="offline solve, whose step takes no out="):
        mesa.step(**x, state=None, return_states=True)


@contextlib.contextmanager
def no_host_reads():
    """Every way a Python call reads a tensor's value back to the host raises inside (on a GPU each
    would wait for the kernels queued before it, and break a CUDA graph's capture)."""
    saved = {}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"a host read of a tensor (Tensor.{name})")
        return read
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


class _NoHostWrites(TorchDispatchMode):
    """Refuses a tensor made from host values (aten.lift_fresh: torch.tensor(...), x[i] = 3): on a
    GPU that is a host-to-device copy, which a CUDA graph's capture refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            raise AssertionError("a tensor made from host values (a host-to-device copy on a GPU)")
        return func(*args, **(kwargs or {}))


NO_READS = ["gated_deltanet", "kda"]  # pytest -q; every other example (gdn2_atk: the auxiliary chain rule) with -m slow


# every other example under -m slow (in name order), gdn2_atk always (the auxiliary chain rule)
@pytest.mark.parametrize("name", NO_READS + [pytest.param(p.stem, marks=pytest.mark.slow) for i, p in
                                             enumerate(sorted(kernel_examples())) if p.stem not in NO_READS
                                             and (i % 2 == 0 or p.stem == "gdn2_atk")])
def test_chunk_forward_and_backward_read_nothing_back(name, compiled):
    """The default batched path of chunk (no cu_seqlens, keep_intermediates off), forward and
    backward of every input and the initial state, with nothing read back; the non-finite guard
    of the backward runs on the device (runtime/nonfinite.py's MODE "device")."""
    mixer = compiled(f"examples/{name}.lr")
    x, opts = draw_inputs(mixer, Case(B=2, T=70, H=1, HV=2, K=16, V=16, initial_state=True, seed=5), DEVICE)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0 = opts["initial_state"].clone().requires_grad_()
    with no_host_reads():
        o, _ = mixer.chunk(**leaves, **dict(opts, initial_state=h0))
        (o * torch.randn_like(o)).sum().backward()
    assert all(t.grad is not None for t in leaves.values()) and h0.grad is not None


@pytest.mark.parametrize("name", ["gated_deltanet", "precond_deltanet", "rwkv6"])
def test_step_reads_and_writes_nothing_on_the_host(name, compiled):
    """Nothing read back, and no tensor made from host values (rwkv6's multi-token step once set
    an index from the host in readouts.shift_next, and failed in test_decode_gpu's capture)."""
    mixer = compiled(f"examples/{name}.lr")
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    state = _start(mixer, CASE, 4)
    n = torch.tensor([1, 4, 5], device=DEVICE)
    with torch.no_grad(), no_host_reads(), _NoHostWrites():
        mixer.step(**_tokens(x, 0, 1), state=state)
        _, every = mixer.step(**x, state=state, return_states=True)
        mixer.accept(state, every, n)


def test_the_host_read_check_catches_the_host_mode(compiled, monkeypatch):
    """The guard above is not vacuous: the non-finite check read back once per backward ("host")
    is caught."""
    from lrdsl.runtime import nonfinite
    monkeypatch.setattr(nonfinite, "MODE", "host")
    mixer = compiled("examples/gated_deltanet.lr")
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=1, K=16, V=16, seed=6), DEVICE)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        mixer.chunk(**leaves, **opts)[0].sum().backward()


class Launches:
    """Wraps a Triton kernel (kernel[grid](...)): records the named keyword arguments of each launch,
    a tuple per launch (the value alone for one name), then launches it."""

    def __init__(self, kernel, *names):
        self.kernel, self.names, self.seen = kernel, names, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            got = tuple(kw[n] for n in self.names)
            self.seen.append(got[0] if len(got) == 1 else got)
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_decoding_many_sequences_takes_wide_value_tiles(name, compiled, monkeypatch):
    """One token for many sequences (the state's traffic bounds the call) runs RECURRENT_WIDE's value
    tile and warps, and gives what T single steps at the module's own tile give; several tokens, or
    fewer programs than the threshold, keep RECURRENT_BV and RECURRENT_WARPS. (The threshold is
    lowered here: 8192 programs are too many for Triton's interpreter.)"""
    mixer = compiled(f"examples/{name}.lr")
    mod = mixer.kernels
    case = Case(B=4, T=2, H=1, HV=2, K=16, V=64, initial_state=True, seed=5)
    x, opts = draw_inputs(mixer, case, DEVICE)
    launches = Launches(mod.recurrent_fwd_kernel, "BV", "num_warps")
    monkeypatch.setattr(mod, "recurrent_fwd_kernel", launches)
    monkeypatch.setattr(mod, "RECURRENT_MIN_PROGRAMS", 0)  # no narrowing for few sequences
    narrow = (min(64, mod.RECURRENT_BV), mod.RECURRENT_WARPS)
    programs = 4 * 2 * (64 // narrow[0])  # N * HV * value tiles at RECURRENT_BV
    with torch.no_grad():
        monkeypatch.setattr(mod, "RECURRENT_WIDE", (programs + 1, 64, 4))
        want_o, want = _single_steps(mixer, x, _clone(_start(mixer, case, 3)), opts["scale"], case.T)
        assert launches.seen == [narrow, narrow]
        monkeypatch.setattr(mod, "RECURRENT_WIDE", (programs, 64, 4))
        launches.seen.clear()
        o, got = _single_steps(mixer, x, _clone(_start(mixer, case, 3)), opts["scale"], case.T)
        assert launches.seen == [(64, 4), (64, 4)]
        launches.seen.clear()
        mixer.step(**x, state=_clone(_start(mixer, case, 3)), scale=opts["scale"])  # two tokens at once
        assert launches.seen == [narrow]
    assert rms_ratio(o, want_o) < TOL
    assert rms_ratio(got["S"], want["S"]) < TOL
