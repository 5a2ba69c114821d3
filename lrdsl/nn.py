"""`lrdsl.nn.Layer`: a token-mixing layer built around a compiled spec.

    x [B, T, hidden] -> one linear projection per declared input of the spec
                     -> q, k, v: causal depthwise short convolution (kernel 4) + SiLU (optional)
                     -> each input mapped into its declared range (below)
                     -> the mixer: mixer.chunk to train and prefill, mixer.step to decode
                     -> per head: RMSNorm times SiLU(output gate) (gated RMSNorm), output projection

How an input reaches its declared range (the kernels would clamp anything outside it, which would
cut its gradient off):
- `l2norm`: left alone (the mixer normalises it); `unit` without l2norm: F.normalize;
- a `log` input open below (a log-decay <= 0): Mamba-2's g = -exp(A_log) * softplus(x + dt_bias),
  with per-head A_log (A drawn in [1, 16]) and dt_bias (softplus(dt_bias) drawn log-uniformly in
  [1e-3, 1e-1]), so a fresh layer remembers for tens to thousands of tokens;
- a bounded range (lo, hi): lo + (hi - lo) * sigmoid(x) ((0, 1) -> sigmoid);
- bounded on one side: lo + softplus(x) or hi - softplus(x); unbounded: x itself.

A spec's params (`param A_log, dt_bias`) become nn.Parameters of the same names, [num_v_heads],
[num_v_heads, head_dim] or [num_v_heads, head_v_dim], drawn by their `init` (printed by `lrdsl show`; by default Mamba-2's for
A_log and dt_bias, 0 otherwise) and marked `_no_weight_decay`, as Mamba marks its A_log and dt_bias.
The mixer reads them inside its kernels, so FLA's gates, `g = -exp(A_log) * softplus(a + dt_bias)`
over a plain projection `a`, are spec text.

Layouts follow the mixer's (flash-linear-attention's): num_heads for q and k (and `shared` inputs),
num_v_heads for v and every other per-head input.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrdsl.errors import InputError, LrdslError
from lrdsl.runtime.tensors import MixerState, check_cu_seqlens, check_offsets

CONVOLVED = ("q", "k", "v")


@dataclass(frozen=True)
class Cache:
    """What a Layer needs to go on from where a sequence stopped.

    state: the mixer's recurrent state, float32 [N, num_v_heads, head_dim, head_v_dim], or for a
    mixer with auxiliary states an lrdsl.MixerState holding it and every auxiliary state;
    conv: the short convolutions' last (conv_size - 1) inputs per sequence, one [N, C, conv_size - 1]
    tensor each for q, k and v (C: their projection widths); () without short convolutions.
    N is the batch (the number of sequences with cu_seqlens). Decoding without gradients updates
    these tensors in place and returns the same Cache; always go on with the Cache a call returns."""
    state: torch.Tensor | MixerState
    conv: tuple = ()


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None):
    """Causal depthwise convolution followed by SiLU. x [B, T, C], weight [C, 1, W], state
    [N, C, W - 1] (the W - 1 inputs before x in each sequence; zeros when None). Returns
    (y [B, T, C], the new state [N, C, W - 1]: the last W - 1 inputs of each sequence)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if cu_seqlens is None:
        prev = x.new_zeros(B, C, W - 1) if state is None else state.to(x.dtype)
        xs = torch.cat([prev, x.transpose(1, 2)], -1)  # [B, C, W - 1 + T]
        return F.silu(F.conv1d(xs, weight, groups=C)).transpose(1, 2), xs[..., xs.shape[-1] - (W - 1):]
    # packed sequences: put each sequence's W - 1 previous inputs in front of it and convolve the
    # whole row at once; the outputs that straddle two sequences are never read
    N = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)
    pos = torch.arange(T, device=x.device) + (seq + 1) * (W - 1)  # token t in the widened row
    pre = cu_seqlens[:-1, None] + torch.arange(N, device=x.device)[:, None] * (W - 1) + \
        torch.arange(W - 1, device=x.device)  # [N, W - 1]: the prefix slots of each sequence
    xs = x.new_zeros(C, T + N * (W - 1))
    xs[:, pos] = x[0].transpose(0, 1)
    if state is not None:
        xs[:, pre.flatten()] = state.to(x.dtype).permute(1, 0, 2).reshape(C, -1)
    y = F.conv1d(xs[None], weight, groups=C)[0]  # output j reads xs[j : j + W]
    ends = cu_seqlens[1:, None] + torch.arange(N, device=x.device)[:, None] * (W - 1) + \
        torch.arange(W - 1, device=x.device)  # the last W - 1 slots of each widened sequence
    new_state = xs[:, ends.flatten()].reshape(C, N, W - 1).permute(1, 0, 2)
    return F.silu(y[:, pos - (W - 1)]).transpose(0, 1)[None], new_state


def _range(inp) -> tuple:
    """(lo, hi) of an input as floats (-inf / inf when open-ended)."""
    try:
        return float(inp.lo), float(inp.hi)
    except TypeError:
        raise LrdslError(f"input {inp.name!r} has a range that depends on the head index "
                         f"({inp.lo}, {inp.hi}); lrdsl.nn.Layer maps inputs into constant ranges only") from None


def _kind_of(inp) -> str:
    """How the layer maps a projection into the input's declared range (see the module docstring)."""
    lo, hi = _range(inp)
    if inp.l2norm:
        return "raw"
    if inp.unit:
        return "normalize"
    if inp.log and lo == -math.inf:
        return "decay"
    if math.isfinite(lo) and math.isfinite(hi):
        return "box"
    if math.isfinite(lo):
        return "above"
    if math.isfinite(hi):
        return "below"
    return "raw"


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise InputError(f"{name} must be a positive integer, got {x!r}")
    return x


class Layer(nn.Module):
    """A token-mixing layer around a compiled mixer (see the module docstring).

    spec: a path to a .lr file or an lrdsl.Mixer (compile it yourself for options such as
    keep_intermediates=True). hidden_size: the model width; num_heads (H): heads of q and k;
    head_dim (K): their size; num_v_heads (HV, default H) and head_v_dim (V, default K) for v and
    the output. use_short_conv: the causal convolution on q, k, v (conv_size taps, then SiLU);
    use_output_gate: multiply the per-head RMSNorm by SiLU of a projection of x."""

    def __init__(self, spec, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, use_short_conv: bool = True, conv_size: int = 4,
                 use_output_gate: bool = True, norm_eps: float = 1e-5):
        super().__init__()
        from lrdsl.api import Mixer, compile
        if isinstance(spec, (str, os.PathLike)):
            spec = compile(spec)
        if not isinstance(spec, Mixer):
            raise InputError(f"lrdsl.nn.Layer takes a spec path or an lrdsl.Mixer, not {type(spec).__name__}")
        self.mixer = spec
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.num_v_heads = _positive_int("num_v_heads", num_heads if num_v_heads is None else num_v_heads)
        self.head_v_dim = _positive_int("head_v_dim", head_dim if head_v_dim is None else head_v_dim)
        if self.num_v_heads % self.num_heads:
            raise InputError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads "
                             f"({self.num_heads}): each key head serves num_v_heads / num_heads value heads")
        self.conv_size = _positive_int("conv_size", conv_size) if use_short_conv else 0
        if use_short_conv and conv_size < 2:
            raise InputError(f"conv_size must be at least 2 (one past token), got {conv_size}; "
                             "or pass use_short_conv=False")
        self.use_output_gate = bool(use_output_gate)
        self.norm_eps = float(norm_eps)
        self.kinds = {i.name: _kind_of(i) for i in spec.ir.inputs}
        for inp in spec.ir.inputs:
            heads, width = self._width(inp)
            self._add(f"{inp.name}_proj", nn.Linear(hidden_size, heads * width, bias=False))
            if self.conv_size and inp.name in CONVOLVED:
                conv = nn.Conv1d(heads * width, heads * width, self.conv_size, groups=heads * width, bias=False)
                self._add(f"{inp.name}_conv", conv)
            if self.kinds[inp.name] == "decay":
                self._add(f"{inp.name}_A_log", nn.Parameter(torch.empty(heads)))
                self._add(f"{inp.name}_dt_bias", nn.Parameter(torch.empty(heads, width)))
        from lrdsl.frontend.params import param_shape
        for p in spec.ir.params:
            self._add(p.name, nn.Parameter(torch.empty(param_shape(p, self.num_v_heads, self.head_dim, self.head_v_dim))))
        HV, V = self.num_v_heads, self.head_v_dim
        if self.use_output_gate:
            self._add("o_gate_proj", nn.Linear(hidden_size, HV * V, bias=False))
        self._add("o_norm_weight", nn.Parameter(torch.ones(V)))
        self._add("o_proj", nn.Linear(HV * V, hidden_size, bias=False))
        self.reset_decays()
        self.reset_params()

    def _add(self, name: str, value) -> None:
        if hasattr(self, name):  # an input named o_gate or o_norm, say
            raise LrdslError(f"mixer '{self.mixer.name}': the layer's parameter '{name}' clashes with a name "
                             "the layer already uses; rename the spec's input")
        setattr(self, name, value)

    def _width(self, inp) -> tuple:
        heads = self.num_heads if inp.shared else self.num_v_heads
        return heads, {"scalar": 1, "K": self.head_dim, "V": self.head_v_dim}[inp.kind]

    @torch.no_grad()
    def reset_decays(self) -> None:
        """Mamba-2's initialisation of every log-decay: A = exp(A_log) uniform in [1, 16] per head,
        softplus(dt_bias) log-uniform in [1e-3, 1e-1] (at most 1 - 1e-3 ... 1e-1 of the state per
        token at first, the ranges Mamba-2 found to train well)."""
        for name, kind in self.kinds.items():
            if kind != "decay":
                continue
            A_log, dt_bias = getattr(self, f"{name}_A_log"), getattr(self, f"{name}_dt_bias")
            A_log.copy_(torch.empty_like(A_log).uniform_(1, 16).log())
            dt = torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_(min=1e-4)
            dt_bias.copy_(_inverse_softplus(dt))
            A_log._no_weight_decay = dt_bias._no_weight_decay = True  # Mamba's convention for optimisers

    @torch.no_grad()
    def reset_params(self) -> None:
        """Draw every param of the spec by its init (lrdsl/params.py)."""
        from lrdsl.frontend.params import sample
        for p in self.mixer.ir.params:
            t = getattr(self, p.name)
            t.copy_(sample(p.init, tuple(t.shape)))
            t._no_weight_decay = True

    def extra_repr(self) -> str:
        return (f"mixer={self.mixer.name}, hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, num_v_heads={self.num_v_heads}, head_v_dim={self.head_v_dim}, "
                f"conv_size={self.conv_size}, use_output_gate={self.use_output_gate}")

    def new_cache(self, batch_size: int, device=None) -> Cache:
        """A Cache for batch_size sequences that have seen no token yet (zero states)."""
        device = self.o_proj.weight.device if device is None else device
        N = _positive_int("batch_size", batch_size)
        state = self.mixer.zero_state(N, self.num_v_heads, self.head_dim, self.head_v_dim, device=device)
        conv = tuple(torch.zeros(N, getattr(self, f"{n}_conv").weight.shape[0], self.conv_size - 1, device=device)
                     for n in CONVOLVED) if self.conv_size else ()
        return Cache(state, conv)

    def _map(self, inp, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads * width] -> the input's tensor [B, T, heads(, width)], inside its range."""
        heads, width = self._width(inp)
        x = x.view(*x.shape[:2], heads, width)
        kind, (lo, hi) = self.kinds[inp.name], _range(inp)
        if kind == "normalize":
            x = F.normalize(x.float(), dim=-1)
        elif kind == "decay":
            A = getattr(self, f"{inp.name}_A_log").float().exp()[:, None]
            x = -A * F.softplus(x.float() + getattr(self, f"{inp.name}_dt_bias").float())
        elif kind == "box":
            x = lo + (hi - lo) * torch.sigmoid(x.float())
        elif kind == "above":
            x = lo + F.softplus(x.float())
        elif kind == "below":
            x = hi - F.softplus(x.float())
        return x[..., 0] if inp.kind == "scalar" else x

    def _check_call(self, x, cache, cu_seqlens) -> int:
        """Argument errors as one sentence each; returns N, the number of sequences."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
            got = f"shape {list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"the layer takes x as a floating-point tensor [B, T, hidden_size], got {got}")
        if x.shape[-1] != self.hidden_size:
            raise InputError(f"x has {x.shape[-1]} features but the layer was built with hidden_size="
                             f"{self.hidden_size}; project x or build the layer with hidden_size={x.shape[-1]}")
        if x.shape[1] == 0:
            raise InputError("x has no tokens (T = 0)")
        N = x.shape[0]
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise InputError(f"with cu_seqlens the sequences are packed along T, so x must have B = 1, "
                                 f"got B = {x.shape[0]}")
            # before the short convolution, which would fail on bad offsets with raw torch errors
            check_cu_seqlens(cu_seqlens)
            check_offsets(cu_seqlens, x.shape[1])
            N = cu_seqlens.numel() - 1
        if cache is None:
            return N
        if not isinstance(cache, Cache):
            raise InputError(f"cache must be an lrdsl.nn.Cache (returned by the layer or by layer.new_cache), "
                             f"not {type(cache).__name__}")
        whole = bool(self.mixer.ir.aux) or self.mixer.ir.solve_lam is not None  # a MixerState
        if isinstance(cache.state, MixerState) != whole:
            raise InputError("the cache's state is " + ("an lrdsl.MixerState" if isinstance(cache.state, MixerState)
                             else "a plain tensor") + f" but mixer '{self.mixer.name}' needs "
                             + ("its whole state (an lrdsl.MixerState)" if whole else "a tensor")
                             + ": start from layer.new_cache(batch_size) or a cache this layer returned")
        S = cache.state.S if isinstance(cache.state, MixerState) else cache.state
        want = (N, self.num_v_heads, self.head_dim, self.head_v_dim)
        if tuple(S.shape) != want:
            raise InputError(f"the cache's state has shape {list(S.shape)} but this layer and batch "
                             f"need [N, num_v_heads, head_dim, head_v_dim] = {list(want)}: is it another "
                             "layer's cache, or another batch's?")
        if len(cache.conv) != (3 if self.conv_size else 0) or any(
                tuple(c.shape) != (N, getattr(self, f"{n}_conv").weight.shape[0], self.conv_size - 1)
                for n, c in zip(CONVOLVED, cache.conv)):
            raise InputError("the cache's convolution states do not fit this layer (another layer's cache?); "
                             "start from layer.new_cache(batch_size) or a cache this layer returned")
        return N

    def forward(self, x: torch.Tensor, cache: Cache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        """x [B, T, hidden_size] -> (y [B, T, hidden_size], Cache or None).

        Without a cache: the chunked kernels (differentiable); with use_cache=True also the Cache
        after the last token. With a cache: go on from it (one or several tokens): under
        torch.no_grad() (or with nothing requiring grad) through mixer.step, which updates the
        cache in place; else through mixer.chunk from the cache's state (differentiable)."""
        self._check_call(x, cache, cu_seqlens)
        ir = self.mixer.ir
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int32)
        raw, convs = {}, []
        for inp in ir.inputs:
            h = getattr(self, f"{inp.name}_proj")(x)
            if self.conv_size and inp.name in CONVOLVED:
                prev = cache.conv[CONVOLVED.index(inp.name)] if cache is not None else None
                h, conv_state = short_conv(h, getattr(self, f"{inp.name}_conv").weight, prev, cu_seqlens)
                convs.append(conv_state)
            raw[inp.name] = self._map(inp, h)
        # Triton's interpreter (every CPU run) computes bf16 dots wrongly: fp32 there. Autocast is
        # off inside the mixer so that its PyTorch parts keep the precision of the given tensors.
        dtype = torch.float32 if x.device.type == "cpu" else raw["v"].dtype
        inputs = {n: (t.float() if ir.input(n).log else t.to(dtype)).contiguous() for n, t in raw.items()}
        q, k, v = (inputs.pop(n) for n in CONVOLVED)
        inputs.update({p.name: getattr(self, p.name) for p in ir.params})  # read inside the kernels
        decode_in_place = cache is not None and cu_seqlens is None and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values())))
        with torch.autocast(x.device.type, enabled=False):
            if decode_in_place:
                o = self.mixer.step(q, k, v, cache.state, **inputs)
                for old, new in zip(cache.conv, convs):
                    old.copy_(new)
                new_cache = cache
            else:
                h0 = cache.state if cache is not None else None
                want_state = use_cache or cache is not None
                o, ht = self.mixer.chunk(q, k, v, initial_state=h0, output_final_state=want_state,
                                         cu_seqlens=cu_seqlens, **inputs)
                if isinstance(ht, MixerState):
                    ht = MixerState(ht.S.float().contiguous(), {n: a.float().contiguous() for n, a in ht.aux.items()})
                else:
                    ht = ht.float().contiguous() if want_state else None
                new_cache = Cache(ht, tuple(c.contiguous() for c in convs)) if want_state else None
        return self._output(x, o), new_cache

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Per head: RMSNorm over the value channels, times SiLU of the output gate; then o_proj."""
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.float()
        if self.use_output_gate:
            gate = self.o_gate_proj(x).view(*x.shape[:2], self.num_v_heads, self.head_v_dim)
            o = o * F.silu(gate.float())
        return self.o_proj(o.flatten(2).to(self.o_proj.weight.dtype))
