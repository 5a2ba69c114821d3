"""`lrdsl.nn.Layer`: a token-mixing layer built around a compiled spec.

    x [B, T, hidden] -> one linear projection per declared input of the spec
                     -> q, k, v: causal depthwise short convolution (kernel 4) + SiLU (optional)
                     -> each input mapped into its declared range (below)
                     -> the mixer: mixer.chunk to train and prefill, mixer.step to decode
                     -> per head: RMSNorm times SiLU(output gate) (gated RMSNorm), output projection

attention_mask [B, T] (1: a token, 0: padding) packs each row's tokens into one sequence (cu_seqlens)
and scatters the outputs back (zeros at padding). A float64 layer runs the mixer's float64 reference
scan (the kernels accumulate in float32), so float64 means float64 end to end (gradcheck works).
Packed sequences under torch.compile: pass cu_seqlens_cpu, the same offsets as a list of ints, so that
no offset is read from the device (a read is a graph break, or an error under fullgraph=True).

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
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrdsl.errors import InputError, LrdslError
from lrdsl.runtime.tensors import MixerState, check_cu_seqlens, check_offsets

try:  # the fused short convolution of Dao-AILab/causal-conv1d (CUDA only), where it is installed
    from causal_conv1d import causal_conv1d_fn
except ImportError:
    causal_conv1d_fn = None

CONVOLVED = ("q", "k", "v")
GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}  # the output gate's activation (FLA's swish, KDA's sigmoid)


@dataclass(frozen=True)
class Cache:
    """What a Layer needs to go on from where a sequence stopped.

    state: the mixer's recurrent state, float32 [N, num_v_heads, head_dim, head_v_dim], or for a
    mixer with auxiliary states an lrdsl.MixerState holding it and every auxiliary state;
    conv: the short convolutions' last (conv_size - 1) inputs per sequence, one [N, C, conv_size - 1]
    tensor each for q, k and v (C: their projection widths); () without short convolutions.
    N is the batch (the number of sequences with cu_seqlens). Decoding without gradients updates
    these tensors in place and returns the same Cache; always go on with the Cache a call returns.
    A float64 layer keeps a float64 state and returns a new Cache from every call."""
    state: torch.Tensor | MixerState
    conv: tuple = ()

    def select(self, index: torch.Tensor) -> Cache:
        """The cache of the sequences at `index` (a LongTensor [M], repeats allowed), in that order:
        beam search reorders its beams with it, and repeat_interleave'd indices widen a batch. New
        tensors: the original is left as it is."""
        state = self.state
        if isinstance(state, MixerState):
            state = MixerState(state.S[index].contiguous(), {n: a[index].contiguous() for n, a in state.aux.items()})
        else:
            state = state[index].contiguous()
        return Cache(state, tuple(c[index].contiguous() for c in self.conv))


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, offsets: list | None = None):
    """Causal depthwise convolution followed by SiLU. x [B, T, C], weight [C, 1, W], state
    [N, C, W - 1] (the W - 1 inputs before x in each sequence; zeros when None). Returns
    (y [B, T, C], the new state [N, C, W - 1]: the last W - 1 inputs of each sequence).
    offsets: cu_seqlens as a list of ints, if known on the host (no device read then)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if cu_seqlens is None:
        if state is None and _fused_conv_serves(x):
            y = causal_conv1d_fn(x.transpose(1, 2), weight[:, 0].to(x.dtype), activation="silu")
            return y.transpose(1, 2), F.pad(x.transpose(1, 2), (W - 1, 0))[..., T:]
        prev = x.new_zeros(B, C, W - 1) if state is None else state.to(x.dtype)
        xs = torch.cat([prev, x.transpose(1, 2)], -1)  # [B, C, W - 1 + T]
        return F.silu(F.conv1d(xs, weight.to(x.dtype), groups=C)).transpose(1, 2), xs[..., xs.shape[-1] - (W - 1):]
    # packed sequences: put each sequence's W - 1 previous inputs in front of it and convolve the
    # whole row at once; the outputs that straddle two sequences are never read
    N = cu_seqlens.numel() - 1
    if offsets is not None:  # index tensors from host values: nothing read back from the device
        cu_seqlens = torch.tensor(offsets, device=x.device)
        seq = torch.cat([torch.full((offsets[i + 1] - offsets[i],), i, device=x.device) for i in range(N)])
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)
    pos = torch.arange(T, device=x.device) + (seq + 1) * (W - 1)  # token t in the widened row
    slots = torch.arange(N, device=x.device)[:, None] * (W - 1) + torch.arange(W - 1, device=x.device)
    pre = cu_seqlens[:-1, None] + slots  # [N, W - 1]: the prefix slots of each sequence
    xs = x.new_zeros(C, T + N * (W - 1))
    xs[:, pos] = x[0].transpose(0, 1)
    if state is not None:
        xs[:, pre.flatten()] = state.to(x.dtype).permute(1, 0, 2).reshape(C, -1)
    y = F.conv1d(xs[None], weight.to(x.dtype), groups=C)[0]  # output j reads xs[j : j + W]
    ends = cu_seqlens[1:, None] + slots  # the last W - 1 slots of each widened sequence
    new_state = xs[:, ends.flatten()].reshape(C, N, W - 1).permute(1, 0, 2)
    return F.silu(y[:, pos - (W - 1)]).transpose(0, 1)[None], new_state


def _fused_conv_serves(x: torch.Tensor) -> bool:
    """causal-conv1d's CUDA kernel (where installed) takes this call: a CUDA tensor of a dtype it
    knows, outside torch.compile (the kernel is no torch.library op, so tracing would break there)."""
    return (causal_conv1d_fn is not None and x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not torch.compiler.is_compiling())


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
    use_output_gate: multiply the per-head RMSNorm by output_gate ("silu" or "sigmoid") of a
    projection of x (with a bias where output_gate_bias: KDA's gate)."""

    def __init__(self, spec, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, use_short_conv: bool = True, conv_size: int = 4,
                 use_output_gate: bool = True, norm_eps: float = 1e-5, output_gate: str = "silu",
                 output_gate_bias: bool = False):
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
        if output_gate not in GATES:
            raise InputError(f"output_gate must be one of {', '.join(map(repr, GATES))}, got {output_gate!r}")
        self.output_gate = output_gate
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
            self._add("o_gate_proj", nn.Linear(hidden_size, HV * V, bias=bool(output_gate_bias)))
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
        """Mamba-2's initialisation of every log-decay, the defaults of a spec's `param A_log, dt_bias`
        (lrdsl/frontend/params.py): A = exp(A_log) uniform in [1, 16] per head, softplus(dt_bias)
        log-uniform in [1e-3, 1e-1] (at most 1 - 1e-3 ... 1e-1 of the state per token at first, the
        ranges Mamba-2 found to train well)."""
        from lrdsl.frontend.params import DEFAULT_INITS, sample
        for name, kind in self.kinds.items():
            if kind != "decay":
                continue
            for part in ("A_log", "dt_bias"):
                t = getattr(self, f"{name}_{part}")
                t.copy_(sample(DEFAULT_INITS[part], tuple(t.shape)))
                t._no_weight_decay = True  # Mamba's convention for optimisers

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
                f"conv_size={self.conv_size}, use_output_gate={self.use_output_gate}"
                + (f", output_gate={self.output_gate}" if self.use_output_gate else ""))

    def new_cache(self, batch_size: int, device=None, dtype=None) -> Cache:
        """A Cache for batch_size sequences that have seen no token yet (zero states): float32, or
        float64 for a float64 layer (dtype: the layer's when None)."""
        device = self.o_proj.weight.device if device is None else device
        if dtype is None:
            dtype = torch.float64 if self.o_proj.weight.dtype == torch.float64 else torch.float32
        N = _positive_int("batch_size", batch_size)
        state = self.mixer.zero_state(N, self.num_v_heads, self.head_dim, self.head_v_dim, device=device)
        state = _state_to(state, dtype)
        conv = tuple(torch.zeros(N, getattr(self, f"{n}_conv").weight.shape[0], self.conv_size - 1, device=device,
                                 dtype=dtype) for n in CONVOLVED) if self.conv_size else ()
        return Cache(state, conv)

    def _map(self, inp, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads * width] -> the input's tensor [B, T, heads(, width)], inside its range."""
        heads, width = self._width(inp)
        x = x.view(*x.shape[:2], heads, width)
        kind, (lo, hi) = self.kinds[inp.name], _range(inp)
        if kind == "normalize":
            x = F.normalize(_up(x), dim=-1)
        elif kind == "decay":
            A = _up(getattr(self, f"{inp.name}_A_log"), x.dtype).exp()[:, None]
            x = -A * F.softplus(_up(x) + _up(getattr(self, f"{inp.name}_dt_bias"), x.dtype))
        elif kind == "box":
            x = lo + (hi - lo) * torch.sigmoid(_up(x))
        elif kind == "above":
            x = lo + F.softplus(_up(x))
        elif kind == "below":
            x = hi - F.softplus(_up(x))
        return x[..., 0] if inp.kind == "scalar" else x

    def _check_call(self, x, cache, cu_seqlens, cu_seqlens_cpu) -> int:
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
        if cu_seqlens_cpu is not None and cu_seqlens is None:
            raise InputError("cu_seqlens_cpu is the host copy of cu_seqlens: pass cu_seqlens too")
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise InputError(f"with cu_seqlens the sequences are packed along T, so x must have B = 1, "
                                 f"got B = {x.shape[0]}")
            # before the short convolution, which would fail on bad offsets with raw torch errors
            check_cu_seqlens(cu_seqlens)
            check_offsets(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, x.shape[1])
            N = cu_seqlens.numel() - 1
            if cu_seqlens_cpu is not None and len(cu_seqlens_cpu) != N + 1:
                raise InputError(f"cu_seqlens_cpu has {len(cu_seqlens_cpu)} offsets but cu_seqlens has {N + 1}: "
                                 "pass the same offsets twice (cu_seqlens_cpu=cu_seqlens.tolist())")
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
                cu_seqlens: torch.Tensor | None = None, *, attention_mask: torch.Tensor | None = None,
                cu_seqlens_cpu: list | None = None):
        """x [B, T, hidden_size] -> (y [B, T, hidden_size], Cache or None).

        Without a cache: the chunked kernels (differentiable); with use_cache=True also the Cache
        after the last token. With a cache: go on from it (one or several tokens): under
        torch.no_grad() (or with nothing requiring grad) through mixer.step, which updates the
        cache in place; else through mixer.chunk from the cache's state (differentiable).
        attention_mask [B, T]: 1 at tokens, 0 at padding (left, right or anywhere): each row's
        tokens are one sequence, as if given alone; y is 0 at padding, the Cache has B sequences.
        cu_seqlens_cpu: cu_seqlens as a list of ints (host-side offsets, read instead of the device
        tensor: no graph break under torch.compile)."""
        if attention_mask is not None:
            return self._forward_masked(x, cache, use_cache, cu_seqlens, attention_mask)
        if isinstance(cu_seqlens_cpu, torch.Tensor):
            cu_seqlens_cpu = cu_seqlens_cpu.tolist()
        self._check_call(x, cache, cu_seqlens, cu_seqlens_cpu)
        ir = self.mixer.ir
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int32)
        raw, convs = {}, []
        for inp in ir.inputs:
            h = getattr(self, f"{inp.name}_proj")(x)
            if self.conv_size and inp.name in CONVOLVED:
                prev = cache.conv[CONVOLVED.index(inp.name)] if cache is not None else None
                h, conv_state = short_conv(h, getattr(self, f"{inp.name}_conv").weight, prev, cu_seqlens,
                                           cu_seqlens_cpu)
                convs.append(conv_state)
            raw[inp.name] = self._map(inp, h)
        # the kernels accumulate in float32 whatever they are given: a float64 layer takes the float64
        # reference scan instead (differentiable, any dtype), else float64 would silently be float32
        exact = raw["v"].dtype == torch.float64
        dtype = torch.float64 if exact else torch.float32 if x.device.type == "cpu" else raw["v"].dtype
        inputs = {n: (_up(t) if ir.input(n).log else t.to(dtype)).contiguous() for n, t in raw.items()}
        q, k, v = (inputs.pop(n) for n in CONVOLVED)
        inputs.update({p.name: getattr(self, p.name) for p in ir.params})  # read inside the kernels
        decode_in_place = cache is not None and cu_seqlens is None and not exact and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values())))
        # autocast is off inside the mixer so that its PyTorch parts keep the precision of the given
        # tensors (Triton's interpreter, every CPU run, computes bf16 dots wrongly: fp32 there)
        with torch.autocast(x.device.type, enabled=False):
            if decode_in_place:
                o = self.mixer.step(q, k, v, cache.state, **inputs)
                for old, new in zip(cache.conv, convs):
                    old.copy_(new)
                new_cache = cache
            else:
                h0 = cache.state if cache is not None else None
                want_state = use_cache or cache is not None
                run = (self.mixer.reference if exact else self.mixer.chunk if cu_seqlens_cpu is None
                       else partial(self.mixer.chunk, cu_seqlens_cpu=cu_seqlens_cpu))
                o, ht = run(q, k, v, initial_state=h0, output_final_state=want_state, cu_seqlens=cu_seqlens,
                            **inputs)
                ht = _state_to(ht, torch.float64 if exact else torch.float32) if want_state else None
                new_cache = Cache(ht, tuple(c.contiguous() for c in convs)) if want_state else None
        return self._output(x, o), new_cache

    def _forward_masked(self, x, cache, use_cache, cu_seqlens, attention_mask):
        """forward with attention_mask: the rows' tokens packed into sequences (cu_seqlens) and the
        outputs scattered back, zeros at padding."""
        if cu_seqlens is not None:
            raise InputError("pass attention_mask or cu_seqlens, not both: the mask is turned into cu_seqlens")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            self._check_call(x, cache, None, None)  # its sentence for a wrong x
        B, T = x.shape[:2]
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
            got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise InputError(f"attention_mask must be a tensor [B, T] = [{B}, {T}] of 1 (token) and 0 (padding), "
                             f"got {got}")
        keep = attention_mask.to(device=x.device) != 0
        if bool(keep.all()):
            return self.forward(x, cache, use_cache)
        if not bool(keep.any()):
            raise InputError("attention_mask is 0 everywhere: there is no token to compute")
        lengths = keep.sum(1).tolist()
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        where = keep.flatten().nonzero()[:, 0]
        y, new_cache = self.forward(x.flatten(0, 1)[where][None], cache, use_cache,
                                    torch.tensor(offsets, device=x.device), cu_seqlens_cpu=offsets)
        out = y.new_zeros(B * T, y.shape[-1]).index_copy(0, where, y[0])
        return out.view(B, T, -1), new_cache

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Per head: RMSNorm over the value channels (times o_norm_weight), times the output gate of
        a projection of x; then o_proj."""
        o = _up(o)
        o = F.rms_norm(o, (self.head_v_dim,), self.o_norm_weight.to(o.dtype), self.norm_eps)
        if self.use_output_gate:
            gate = self.o_gate_proj(x).view(*x.shape[:2], self.num_v_heads, self.head_v_dim)
            o = o * GATES[self.output_gate](_up(gate))
        return self.o_proj(o.flatten(2).to(self.o_proj.weight.dtype))


def _up(t: torch.Tensor, like: torch.dtype | None = None) -> torch.Tensor:
    """t in float32 at least: float64 stays float64 (and so does anything computed with a float64 `like`)."""
    if t.dtype == torch.float64 or like == torch.float64:
        return t.to(torch.float64)
    return t.float()


def _state_to(state, dtype: torch.dtype):
    """A state (a tensor or a MixerState) in dtype, contiguous."""
    if isinstance(state, MixerState):
        return MixerState(state.S.to(dtype).contiguous(), {n: a.to(dtype).contiguous() for n, a in state.aux.items()})
    return state.to(dtype).contiguous()
