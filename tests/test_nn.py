"""lrdsl.nn.Layer on the CPU (Triton's interpreter), tiny sizes: it trains, prefill-then-decode
equals one pass, every parameter gets a gradient, state_dict round trips, bf16 autocast runs, gates
start inside their declared ranges, and mistakes are one clear sentence. Three specs: Gated DeltaNet
(scalar decay, delta rule), GLA (a decay per key channel, no erase) and Gated DeltaNet with FLA's
gates written in the spec (learned per-head params A_log and dt_bias read inside the kernels)."""
from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lrdsl
from lrdsl.nn import Cache, Layer, short_conv

ROOT = Path(__file__).resolve().parent.parent
SPECS = ["gated_deltanet", "gla", "gated_deltanet_gates"]  # the last: FLA's gates from spec params
D, H, K = 32, 2, 16


def spec(name):
    return ROOT / "examples" / f"{name}.lr"


def rms_ratio(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def layer(compiled, name, seed=0, **kw):
    torch.manual_seed(seed)
    return Layer(compiled(spec(name)), D, H, K, **kw)


@pytest.mark.parametrize("name", SPECS)
def test_prefill_then_decode_equals_one_pass(compiled, name):
    L = layer(compiled, name, num_v_heads=2 * H)  # and grouped value heads
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = L(x)
        parts, cache = L(x[:, :13], use_cache=True)
        state = cache.state
        outs = [parts]
        for a, b in ((13, 14), (14, 17), (17, 24)):  # one token, then several at once
            y, cache = L(x[:, a:b], cache)
            outs.append(y)
    assert cache.state is state, "decoding under no_grad updates the cache in place"
    err = rms_ratio(torch.cat(outs, 1), whole)
    assert err < 1e-5, f"{name}: prefill 13 + decode 1, 3, 7 tokens vs one pass: rms ratio {err:.3g}"


# mesa_retention (the Gram state G) in pytest -q; gdn2_atk and precond_deltanet (the ATK's P) under
# -m slow (tests/test_state.py takes gdn2_atk's prefill and decode in pytest -q)
@pytest.mark.parametrize("name", [pytest.param("precond_deltanet", marks=pytest.mark.slow),
                                  pytest.param("gdn2_atk", marks=pytest.mark.slow),
                                  "mesa_retention"])
def test_prefill_then_decode_with_auxiliary_states(compiled, name):
    """Mixers with auxiliary states (the ATK preconditioner's P, an offline solve's Gram state G):
    the Cache holds the whole state (an lrdsl.MixerState), decoding updates all of it in place,
    and prefill + decode equals one pass; a packed prefill decodes each sequence as if alone."""
    L = layer(compiled, name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 21, D, generator=gen)
    with torch.no_grad():
        whole, _ = L(x)
        parts, cache = L(x[:, :11], use_cache=True)
        assert isinstance(cache.state, lrdsl.MixerState) and cache.state.aux
        aux_before = {n: t.clone() for n, t in cache.state.aux.items()}
        outs = [parts]
        for a, b in ((11, 12), (12, 21)):
            y, cache = L(x[:, a:b], cache)
            outs.append(y)
        assert all(not torch.equal(aux_before[n], t) for n, t in cache.state.aux.items()), "aux not updated"
        err = rms_ratio(torch.cat(outs, 1), whole)
        assert err < 1e-5, f"{name}: prefill 11 + decode 1, 9 tokens vs one pass: rms ratio {err:.3g}"
        packed = torch.cat([x[:1, :6], x[1:, :11]], 1)
        y, cache = L(packed, use_cache=True, cu_seqlens=torch.tensor([0, 6, 17]))
        y_next, _ = L(x[:, 11:13], cache)
        for i, n in enumerate((6, 11)):
            alone, c = L(x[i:i + 1, :n], use_cache=True)
            assert rms_ratio(y[:, (0, 6)[i]:(6, 17)[i]], alone) < 1e-5, f"sequence {i} of the packed prefill"
            assert rms_ratio(y_next[i:i + 1], L(x[i:i + 1, 11:13], c)[0]) < 1e-5, f"sequence {i} decoded"


def test_packed_prefill_then_decode(compiled):
    """cu_seqlens: each packed sequence is its own (conv and recurrent state), and the cache it
    returns decodes each sequence as if it had been prefilled alone."""
    L = layer(compiled, "gated_deltanet")
    gen = torch.Generator().manual_seed(2)
    x, nxt = torch.randn(1, 20, D, generator=gen), torch.randn(2, 3, D, generator=gen)
    with torch.no_grad():
        y, cache = L(x, use_cache=True, cu_seqlens=torch.tensor([0, 7, 20]))
        y_next, _ = L(nxt, cache)
        for i, (s, e) in enumerate(((0, 7), (7, 20))):
            alone, c = L(x[:, s:e], use_cache=True)
            assert rms_ratio(y[:, s:e], alone) < 1e-5, f"sequence {i} of the packed prefill"
            assert rms_ratio(y_next[i:i + 1], L(nxt[i:i + 1], c)[0]) < 1e-5, f"sequence {i} decoded"


def test_short_conv_packed_equals_per_sequence():
    gen = torch.Generator().manual_seed(3)
    w, x, prev = torch.randn(5, 1, 4, generator=gen), torch.randn(1, 11, 5, generator=gen), \
        torch.randn(3, 5, 3, generator=gen)
    cu = torch.tensor([0, 2, 7, 11])  # the first sequence is shorter than the kernel's history
    y, state = short_conv(x, w, prev, cu)
    for i in range(3):
        s, e = cu[i].item(), cu[i + 1].item()
        yi, si = short_conv(x[:, s:e], w, prev[i:i + 1])
        torch.testing.assert_close(y[:, s:e], yi)
        torch.testing.assert_close(state[i:i + 1], si)
    # causal: the first output sees only the first input and the history
    ref = F.silu((torch.cat([prev[0], x[0, :1].T], -1) * w[:, 0]).sum(-1))
    torch.testing.assert_close(y[0, 0], ref)


@pytest.mark.parametrize("name", SPECS)
def test_gradients_reach_every_parameter(compiled, name):
    L = layer(compiled, name)
    x = torch.randn(1, 20, D, generator=torch.Generator().manual_seed(4))
    y, cache = L(x[:, :12], use_cache=True)
    y2, _ = L(x[:, 12:], cache)  # with grad enabled, decoding goes through chunk (differentiable)
    (y.pow(2).sum() + y2.pow(2).sum()).backward()
    missing = [n for n, p in L.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"{name}: no gradient reached {missing}"
    assert all(torch.isfinite(p.grad).all() for p in L.parameters())


def test_state_dict_round_trip(compiled):
    a, b = layer(compiled, "gated_deltanet", seed=0), layer(compiled, "gated_deltanet", seed=1)
    keys = set(a.state_dict())
    assert {"q_proj.weight", "g_A_log", "g_dt_bias", "beta_proj.weight", "q_conv.weight", "o_gate_proj.weight",
            "o_norm_weight", "o_proj.weight"} <= keys, sorted(keys)
    x = torch.randn(1, 10, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rms_ratio(b(x)[0], a(x)[0]) > 1e-2  # different seeds, different layers
        b.load_state_dict(a.state_dict())
        torch.testing.assert_close(b(x)[0], a(x)[0])


def test_mixer_copies_and_pickles(compiled):
    """copy.deepcopy and pickle of a Mixer carry its spec and options, not its loaded module: the
    copy computes what the original does, from a file and from text=, and keeps its options."""
    gen = torch.Generator().manual_seed(8)
    q, k = (F.normalize(torch.randn(1, 12, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, 12, H, K, generator=gen)
    g = -torch.rand(1, 12, H, generator=gen)
    beta = torch.rand(1, 12, H, generator=gen)
    text = spec("gated_deltanet").read_text()
    for m in (compiled(spec("gated_deltanet")), lrdsl.compile(text=text, keep_intermediates=True, check_ranges=True)):
        want, _ = m.chunk(q, k, v, g=g, beta=beta)
        for copied in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert copied is not m and copied.canonical() == m.canonical()
            assert (copied.keep_intermediates, copied.check_ranges) == (m.keep_intermediates, m.check_ranges)
            got, _ = copied.chunk(q, k, v, g=g, beta=beta)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_model_with_a_layer_copies_and_saves(compiled, tmp_path):
    """A model holding a Layer: an EMA copy (AveragedModel deep-copies it) and torch.save of the
    whole model (unpickled by torch.load) compute what the model does."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    torch.manual_seed(9)
    model = Tiny(compiled(spec("gated_deltanet")), 16)
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(10))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(ema(tokens), want)
        torch.testing.assert_close(loaded(tokens), want)


def test_bf16_autocast(compiled):
    L = layer(compiled, "gated_deltanet")
    x = torch.randn(1, 16, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref, _ = L(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, cache = L(x, use_cache=True)
    assert y.dtype == torch.bfloat16 and cache.state.dtype == torch.float32
    assert rms_ratio(y.float(), ref) < 3e-2  # bf16 projections: about 1e-2
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in L.parameters())


def test_inputs_start_inside_their_ranges(compiled):
    """Mamba-2's initialisation, and every gate mapped into its declared range (no clamping)."""
    for name in ("gated_deltanet_negeig", "gdn2", "kda"):
        L = Layer(lrdsl.compile(spec(name), load_kernels=False), D, H, K)
        x = 10 * torch.randn(2, 7, D, generator=torch.Generator().manual_seed(7))
        for inp in L.mixer.ir.inputs:
            t = L._map(inp, getattr(L, f"{inp.name}_proj")(x))
            lo, hi = float(inp.lo), float(inp.hi)
            if inp.l2norm:
                continue
            assert ((t >= lo) & (t <= hi)).all(), f"{name}.{inp.name} leaves [{lo}, {hi}]"
            if inp.log:
                A = getattr(L, f"{inp.name}_A_log").exp()
                dt = F.softplus(getattr(L, f"{inp.name}_dt_bias"))
                assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 - 1e-9) & (dt <= 0.1 + 1e-9)).all()
                assert (t < 0).all()
        if name == "gated_deltanet_negeig":  # beta in (0, 2): 2 sigmoid, values above 1 reachable
            assert L._map(L.mixer.ir.input("beta"), torch.full((1, 1, H), 5.0)).min() > 1.9


def test_spec_params_are_layer_parameters(compiled):
    """`param A_log, dt_bias`: nn.Parameters [num_v_heads] drawn by their init (Mamba-2's), kept out of
    weight decay, in the state_dict, and the plain projections a and b feed the spec's gates."""
    L = layer(compiled, "gated_deltanet_gates", num_v_heads=2 * H)
    params = dict(L.named_parameters())
    assert params["A_log"].shape == (2 * H,) and params["dt_bias"].shape == (2 * H,)
    assert {"A_log", "dt_bias", "a_proj.weight", "b_proj.weight"} <= set(L.state_dict())
    A, dt = L.A_log.exp(), F.softplus(L.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5))).all()
    assert L.A_log._no_weight_decay and L.dt_bias._no_weight_decay
    assert len({round(x, 6) for x in L.A_log.tolist()}) == 2 * H  # drawn, not one value
    assert L.kinds["a"] == L.kinds["b"] == "raw"  # the spec maps them into range itself
    clash = lrdsl.compile(text="mixer m\ninput a\nparam a_proj\nlet g = -softplus(a + a_proj)\ndecay scalar g\n",
                          load_kernels=False)
    with pytest.raises(lrdsl.LrdslError, match="'a_proj' clashes"):
        Layer(clash, D, H, K)


def test_clear_errors(compiled):
    L = layer(compiled, "gated_deltanet")
    cases = [
        (lambda: L(torch.randn(1, 3, D + 1)), "hidden_size=32"),
        (lambda: L(torch.randn(3, D)), "[B, T, hidden_size]"),
        (lambda: L(torch.randn(1, 3, D), Layer(L.mixer, D, H, 8).new_cache(1)), "another layer's cache"),
        (lambda: L(torch.randn(2, 3, D), L.new_cache(1)), "another batch"),
        (lambda: L(torch.randn(1, 3, D), cache=torch.zeros(1, H, K, K)), "lrdsl.nn.Cache"),
        (lambda: Layer(L.mixer, D, H, K, num_v_heads=3), "multiple of num_heads"),
        (lambda: Layer(L.mixer, D, 0, K), "num_heads must be a positive integer"),
        (lambda: Layer(42, D, H, K), "spec path or an lrdsl.Mixer"),
        (lambda: L(torch.randn(2, 3, D), cu_seqlens=torch.tensor([0, 1, 3])), "B = 1"),
    ]
    for call, words in cases:
        with pytest.raises(lrdsl.LrdslError) as e:
            call()
        assert words in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    precond = Layer(lrdsl.compile(spec("precond_deltanet")), D, H, K)
    with torch.no_grad():
        _, whole_cache = precond(torch.randn(1, 3, D), use_cache=True)
    y, _ = precond(torch.randn(1, 3, D), whole_cache)  # with gradients: through chunk from the whole state
    y.sum().backward()
    assert all(p.grad is not None for p in precond.parameters() if p.requires_grad)
    with pytest.raises(lrdsl.LrdslError, match="whole state"):
        precond(torch.randn(1, 3, D), Cache(whole_cache.state.S, whole_cache.conv))
    assert isinstance(L.new_cache(2), Cache)


@pytest.mark.parametrize("cu", [[0, 6, 4, 10], [2, 6, 10], [0, 6, 9], [0, 6, 11], "meta"])
def test_bad_cu_seqlens_are_one_clear_error_before_the_convolution(compiled, cu):
    """Offsets that decrease, start above 0 or miss the last tokens, or hold no data (meta): the
    layer's own error, raised before its short convolution could fail on them."""
    L = layer(compiled, "gated_deltanet")
    cu = torch.tensor([0, 6, 10], device="meta") if cu == "meta" else torch.tensor(cu)
    with pytest.raises(lrdsl.InputError, match="cu_seqlens") as e:
        L(torch.randn(1, 10, D), cu_seqlens=cu)
    assert "\n" not in str(e.value)


class Tiny(nn.Module):
    """embedding -> x + Layer(RMSNorm(x)) -> x + MLP -> logits: enough to learn recall."""

    def __init__(self, mixer, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.mix = Layer(mixer, D, 1, K)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.mix(F.rms_norm(x, (D,)))[0]
        x = x + self.mlp(F.rms_norm(x, (D,)))
        return self.head(F.rms_norm(x, (D,)))


def recall(batch, pairs, queries, gen):
    """Keys 0..7, values 8..15: `pairs` (key, value) pairs, then `queries` (key, value) of them;
    the target at each query key is its value (-100 elsewhere)."""
    keys = torch.stack([torch.randperm(8, generator=gen)[:pairs] for _ in range(batch)])
    vals = torch.randint(8, 16, (batch, pairs), generator=gen)
    which = torch.randint(0, pairs, (batch, queries), generator=gen)
    ctx = torch.stack([keys, vals], -1).flatten(1)
    qry = torch.stack([keys.gather(1, which), vals.gather(1, which)], -1).flatten(1)
    tokens = torch.cat([ctx, qry], 1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * pairs::2] = vals.gather(1, which)
    return tokens, targets


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in SPECS])  # CPU training runs: 7-17 s each
def test_layer_trains(compiled, name):
    """20 full-batch Adam steps on two fixed recall sequences (T = 32): the loss falls steadily
    through the projections, convolutions, gates, the chunked kernels' backward and the output
    norm. (Generalising recall takes hundreds of steps: tests/test_training.py and lrdsl mqar.)"""
    torch.manual_seed(0)
    model = Tiny(compiled(spec(name), keep_intermediates=True), 16)  # kept: half the backward's cost
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens, targets = recall(2, 2, 14, torch.Generator().manual_seed(8))
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert math.isfinite(last) and last < 0.2 * first, f"{name}: loss {first:.3f} -> {last:.3f}: {losses}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", SPECS)
def test_layer_on_the_gpu_bf16_and_inductor(name):
    """On the GPU (bf16 kernels): prefill then decode against one pass under bf16 autocast, a few
    training steps, and torch.compile with inductor equal to eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    L = Layer(spec(name), 256, 4, 64).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        whole, _ = L(x)
        y, cache = L(x[:, :200], use_cache=True)
        outs = [y]
        for a, b in ((200, 201), (201, 240), (240, 300)):
            outs.append(L(x[:, a:b], cache)[0])
    assert rms_ratio(torch.cat(outs, 1).float(), whole.float()) < 1e-2  # bf16: about 3e-3
    opt, target, losses = torch.optim.Adam(L.parameters(), 1e-3), torch.randn_like(x), []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(L(x)[0].float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    compiled_layer = torch.compile(lambda t: L(t)[0])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = compiled_layer(x[:, :128])
        y.float().sum().backward()
        assert rms_ratio(y.float(), L(x[:, :128])[0].float()) < 1e-2


def test_float64_layer_computes_in_float64(compiled):
    """A float64 layer runs the mixer's float64 reference scan (the kernels accumulate in float32):
    gradcheck passes (float32 inside would fail it), prefill-then-decode equals one pass to float64
    rounding, and the cache stays float64."""
    torch.manual_seed(0)
    L = Layer(compiled(spec("gated_deltanet")), 16, 1, 8).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: L(t)[0], (x,))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        whole, _ = L(x)
        a, cache = L(x[:, :4], use_cache=True)
        b, cache = L(x[:, 4:5], cache)
        c, cache = L(x[:, 5:], cache)
    assert whole.dtype == cache.state.dtype == torch.float64
    assert rms_ratio(torch.cat([a, b, c], 1), whole) < 1e-12


def test_attention_mask_packs_each_row(compiled):
    """attention_mask: each row's tokens (left padding, right padding, a hole) are one sequence, as if
    given alone; zeros at padding; the returned cache goes on from each row's last token."""
    L = layer(compiled, "gated_deltanet")
    gen = torch.Generator().manual_seed(12)
    x, nxt = torch.randn(3, 8, D, generator=gen), torch.randn(3, 2, D, generator=gen)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        y, cache = L(x, use_cache=True, attention_mask=mask)
        y_next, _ = L(nxt, cache)
        assert (y[mask == 0] == 0).all()
        for i in range(3):
            alone, c = L(x[i:i + 1, mask[i] == 1], use_cache=True)
            assert rms_ratio(y[i, mask[i] == 1], alone[0]) < 1e-5, f"row {i}"
            assert rms_ratio(y_next[i:i + 1], L(nxt[i:i + 1], c)[0]) < 1e-5, f"row {i} decoded"
        assert torch.equal(L(x, attention_mask=torch.ones(3, 8))[0], L(x)[0])  # no padding: the batched path
    with pytest.raises(lrdsl.InputError, match=r"attention_mask must be a tensor \[B, T\]"):
        L(x, attention_mask=mask[:, :5])


def test_cache_select_reorders_sequences(compiled):
    """Cache.select (beam search's reorder): the selected cache decodes as the chosen sequences do."""
    L = layer(compiled, "gated_deltanet")
    gen = torch.Generator().manual_seed(13)
    x, nxt = torch.randn(3, 6, D, generator=gen), torch.randn(4, 1, D, generator=gen)
    index = torch.tensor([2, 0, 2, 1])
    with torch.no_grad():
        _, cache = L(x, use_cache=True)
        picked = cache.select(index)
        y, _ = L(nxt, picked)
        for j, i in enumerate(index.tolist()):
            _, c = L(x[i:i + 1], use_cache=True)
            assert rms_ratio(y[j:j + 1], L(nxt[j:j + 1], c)[0]) < 1e-5, f"beam {j} <- sequence {i}"


@pytest.mark.slow  # CPU: Dynamo tracing the interpreter's launches, 10-20 s
def test_packed_sequences_compile_without_a_graph_break(compiled):
    """cu_seqlens_cpu (host-side offsets): torch.compile(fullgraph=True) traces a packed call, equal to
    eager; without it the offsets would be read from the device (a data-dependent guard)."""
    L = layer(compiled, "gated_deltanet")
    x = torch.randn(1, 10, D, generator=torch.Generator().manual_seed(14))
    cu = torch.tensor([0, 4, 10])
    torch._dynamo.reset()
    f = torch.compile(lambda t, c: L(t, cu_seqlens=c, cu_seqlens_cpu=[0, 4, 10])[0], backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(f(x, cu), L(x, cu_seqlens=cu)[0])
    with pytest.raises(lrdsl.InputError, match="cu_seqlens_cpu has 2 offsets"):
        L(x, cu_seqlens=cu, cu_seqlens_cpu=[0, 10])
