"""Weights of flash-linear-attention's layers loaded into the lrdsl.nn.Layer that computes the same thing.

FLA's GatedDeltaNet (fla/layers/gated_deltanet.py) -> Layer(examples/gated_deltanet.lr, ...) with
head_v_dim = head_dim * expand_v (gated_deltanet_negeig.lr for allow_neg_eigval=True): both compute
q, k, v = SiLU(causal conv(proj(x))), q and k L2-normalised in the kernel, scale K^-1/2, the decay
g = -exp(A_log) * softplus(a_proj(x) + dt_bias), beta = sigmoid(b_proj(x)) (2 sigmoid with
negative eigenvalues), o = RMSNorm(o) * weight * SiLU(g_proj(x)), o_proj. The names move
(a_proj -> g_proj, b_proj -> beta_proj, A_log -> g_A_log, dt_bias [HV] -> g_dt_bias [HV, 1],
q_conv1d -> q_conv, g_proj -> o_gate_proj, o_norm.weight -> o_norm_weight).

GLA (fla/layers/gla.py) -> Layer(examples/gla.lr, ..., use_short_conv=False by FLA's default): FLA's
key-channel decay logsigmoid(W1 W0 x + b1) / n (a rank-r gate, n = gate_logit_normalizer, 16) is
-softplus(-(W1 W0 x) - b1) / n, which is the layer's -exp(A_log) * softplus(g_proj(x) + dt_bias)
with g_proj.weight = -W1 W0, dt_bias = -b1 and A_log = -log n, exactly (the rank-r gate becomes
one full-width matrix).

KDA (fla/layers/kda.py, lower_bound=None) -> Layer(examples/kda.lr, ..., output_gate="sigmoid",
output_gate_bias=True): the rank-r f_proj and g_proj become full matrices (W1 W0, and g_proj's
bias), A_log [HV] and dt_bias [HV * K] -> [HV, K].
"""
from __future__ import annotations

import math

import torch

from lrdsl.errors import InputError

KINDS = {"a_proj.weight": "gated_deltanet", "gk_proj.0.weight": "gla", "f_proj.0.weight": "kda"}


def _kind(fla: dict) -> str:
    for key, kind in KINDS.items():
        if key in fla:
            return kind
    raise InputError("this state_dict is not of an FLA GatedDeltaNet (a_proj), GatedLinearAttention (gk_proj) or "
                     "KimiDeltaAttention (f_proj) layer; give the layer's own state_dict, without a model's prefix")


def _product(w1: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """A rank-r pair of projections (x -> W1 W0 x) as one matrix, multiplied in float64."""
    return (w1.double() @ w0.double()).to(w0.dtype)


def fla_state_dict(fla: dict, layer, gate_logit_normalizer: float = 16.0) -> dict:
    """FLA's layer state_dict -> a state_dict for `layer` (an lrdsl.nn.Layer built to match; the
    module docstring says how). gate_logit_normalizer: GLA's (not in its state_dict; FLA's default)."""
    fla = dict(fla)
    kind, out = _kind(fla), {}

    def take(src, dst):
        if src in fla:
            out[dst] = fla.pop(src)

    for n in ("q", "k", "v", "o"):
        take(f"{n}_proj.weight", f"{n}_proj.weight")
    for n in ("q", "k", "v"):
        take(f"{n}_conv1d.weight", f"{n}_conv.weight")
    take("o_norm.weight", "o_norm_weight")
    heads = layer.num_v_heads
    if kind == "gated_deltanet":
        take("a_proj.weight", "g_proj.weight")
        take("b_proj.weight", "beta_proj.weight")
        take("A_log", "g_A_log")
        take("g_proj.weight", "o_gate_proj.weight")
        if "dt_bias" in fla:
            out["g_dt_bias"] = fla.pop("dt_bias").reshape(heads, -1)
    elif kind == "gla":
        w0, w1, b1 = (fla.pop(f"gk_proj.{n}", None) for n in ("0.weight", "1.weight", "1.bias"))
        if b1 is None:
            raise InputError("FLA's GLA gate gk_proj has no bias (gk_proj.1.bias): not the layout this mapping knows")
        out["g_proj.weight"] = -_product(w1, w0)
        out["g_dt_bias"] = -b1.reshape(heads, -1)
        out["g_A_log"] = torch.full((heads,), -math.log(gate_logit_normalizer), dtype=b1.dtype)
        take("g_proj.weight", "o_gate_proj.weight")
        take("g_norm_swish_gate.weight", "o_norm_weight")
        take("g_norm.weight", "o_norm_weight")
    else:
        out["g_proj.weight"] = _product(fla.pop("f_proj.1.weight"), fla.pop("f_proj.0.weight"))
        take("b_proj.weight", "beta_proj.weight")
        take("A_log", "g_A_log")
        if "dt_bias" in fla:
            out["g_dt_bias"] = fla.pop("dt_bias").reshape(heads, -1)
        if "g_proj.0.weight" in fla:
            out["o_gate_proj.weight"] = _product(fla.pop("g_proj.1.weight"), fla.pop("g_proj.0.weight"))
            take("g_proj.1.bias", "o_gate_proj.bias")
    if fla:
        hint = " (lrdsl's short convolutions have no bias)" if any("conv1d.bias" in k for k in fla) else ""
        raise InputError(f"FLA's {sorted(fla)[0]} has no place in an lrdsl.nn.Layer{hint}")
    return out


def load_fla_state_dict(layer, fla: dict, gate_logit_normalizer: float = 16.0) -> None:
    """Load an FLA GatedDeltaNet, GLA or KDA layer's state_dict into `layer` (lrdsl.nn.Layer), checking
    that every weight has its place and shape: one sentence naming the first that does not."""
    mapped = fla_state_dict(fla, layer, gate_logit_normalizer)
    own = layer.state_dict()
    missing = sorted(set(own) - set(mapped))
    if missing:
        hint = (" (build the layer with use_short_conv=False)" if missing[0].endswith("_conv.weight") else
                {"o_gate_proj.weight": " (build the layer with use_output_gate=False)",
                 "o_gate_proj.bias": " (build the layer with output_gate_bias=False)"}.get(missing[0], ""))
        raise InputError(f"the FLA checkpoint has nothing for the layer's {missing[0]}{hint}")
    extra = sorted(set(mapped) - set(own))
    if extra:
        raise InputError(f"the FLA checkpoint has {extra[0]} but the layer has none: build it to match (see "
                         "lrdsl/hf/fla.py: use_short_conv, output_gate, output_gate_bias)")
    for name, t in mapped.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise InputError(f"{name}: the FLA checkpoint's is {list(t.shape)}, the layer's {list(own[name].shape)}; "
                             "build the layer with FLA's num_heads, head_dim, num_v_heads and head_v_dim")
    layer.load_state_dict(mapped)
