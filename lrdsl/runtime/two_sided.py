"""Two-sided transitions (S = M S N + u z^T: M [K, K] over key channels, N [V, V] over value
channels, each diagonal plus rank 1) on the chunked path, since 2026-12-06.

The forward is the generated token loop (templates/recurrent_value.py.jinja, M then N), the
backward a generated reverse token loop (templates/chunk_two_sided_bwd.py.jinja) on per_token's
vectors: every order of each factor reduced to one form, M Y = E Y - ak (ck^T Y) and
X N = X D - (X alpha) gam^T (valueside.factor). The kernel gives the vectors' gradients and
autograd through per_token carries them to the inputs (valueside.ChunkFunction). Not a chunked
form: M's and N's products within a chunk are independent (S_t = L S_0 R + sum L u z^T R), which
one would use."""
from __future__ import annotations

from lrdsl.frontend import ir
from lrdsl.runtime import valueside
from lrdsl.runtime.tensors import Batch

VECTORS = ("gk", "ak", "ck", "g", "alpha", "gam", "u", "z", "q")  # as the backward kernel takes them


def per_token(m: ir.Mixer, b: Batch, dtype, env: dict | None = None) -> dict:
    """valueside.per_token's vectors of N (g, alpha, gam), the write (u, z) and the scaled query q,
    and M's log-decay gk and directions ak, ck ([B, T, HV, K]: M Y = E Y - ak (ck^T Y))."""
    env = valueside.token_env(m, b, dtype) if env is None else env
    out = valueside.per_token(m.right_part(), b, dtype, env)
    out["gk"], out["ak"], out["ck"] = valueside.factor(m.log_decay(), m.delta, env, (b.B, b.T, b.HV, b.K))
    return out


def _forward(kernels, b: Batch, names, tensors, h0):
    inputs, h0, cu = valueside.host_args(b, names, tensors, h0)
    return kernels.recurrent_fwd(inputs, b.scale, h0, bool(b.output_final_state), cu)


ROUTE = valueside.Route(_forward, per_token, VECTORS, "two_sided_chunk_bwd")


def chunk(m: ir.Mixer, kernels, b: Batch):
    """mixer.chunk of a two-sided spec: o [B, T, HV, V] in v's dtype and the final state (fp32),
    differentiable in every input and the initial state."""
    return valueside.chunk(m, kernels, b, ROUTE)
