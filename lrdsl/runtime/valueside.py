"""Value-side transitions (S = S N + u z^T, N [V, V]: the gated Oja rule) on the chunked path.

The forward is the generated kernel (templates/chunk_value.py.jinja), the backward another
(templates/chunk_value_bwd.py.jinja, since 2026-12-06): it takes per_token's vectors (below) and
gives their gradients, and autograd through per_token carries them to the inputs. `torch_chunk` is
a differentiable PyTorch implementation of the chunked UT form (below), kept as a second oracle for
tests; the token loop of runtime/reference.py stays the float64 one.

The math. T = S^T [V, K] follows T_t = N_t^T T_{t-1} + z_t u_t^T, a key-side transition on T whose
readout contracts T's second axis: o_t = T_t q_t. Every order of N has N^T T = D T - g (alpha^T T)
for a read direction alpha and a write direction g ([V]): D (I - a c^T) gives alpha = d a, g = c;
(I - a c^T) D gives alpha = a, g = d c; D - a c^T gives alpha = a, g = c. Within a chunk, with
E(t, s) = prod_{s < j <= t} d_j (a [V] vector, <= 1), the rows r_t = alpha_t^T T_{t-1} solve the unit
lower-triangular (I + A) R = P T_0 + B U, A_ts = sum_v alpha_t E(t-1, s) g_s, B_ts likewise with z_s,
P_t = alpha_t E(t-1, start); and o_t = E(t, start) T_0 q_t + sum_{s <= t} E(t, s) (z_s u_s.q_t - g_s r_s.q_t).
E is built from in-chunk cumulative sums over (s, t] only (a masked [C+1, C+1, V] cumsum), never
from differences of prefix sums nor exp(-g) of an input: a log-decay of -inf (one token or a whole
chunk) gives exact zeros, not inf - inf."""
from __future__ import annotations

import dataclasses

import torch

from lrdsl.frontend import ir
from lrdsl.runtime import nonfinite
from lrdsl.runtime.reference import prepare_inputs, to_torch
from lrdsl.runtime.tensors import Batch, compute_dtype

CHUNK = 16  # tokens per chunk: the [C + 1, C + 1, V] decay tensor grows with its square


def _tensor(val, like: torch.Tensor, shape) -> torch.Tensor:
    """A per-token quantity as a tensor of the batch's shape (a number broadcasts)."""
    return torch.as_tensor(val, dtype=like.dtype, device=like.device).expand(*shape)


def token_env(m: ir.Mixer, b: Batch, dtype: torch.dtype) -> dict:
    """The inputs, the head index h and every let at every token at once ([B, T, HV, width])."""
    env = dict(prepare_inputs(m, b, dtype))
    env["h"] = torch.arange(b.HV, device=env["q"].device, dtype=dtype).view(1, 1, b.HV, 1)
    for lt in m.lets:
        env[lt.name] = to_torch(lt.expr)(env)
    return env


def factor(log_decay, delta, env: dict, shape) -> tuple:
    """One diagonal-plus-rank-1 factor as D - x y^T (D = diag(exp(g)), over the channels of shape's
    width): its log-decay g, x and y. D (I - a c^T) gives x = d a, y = c; (I - a c^T) D gives x = a,
    y = d c; D - a c^T gives x = a, y = c; no erase gives zeros."""
    ref = env["q"]
    g = _tensor(to_torch(log_decay)(env), ref, shape)
    if delta is None:
        zero = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        return g, zero, zero
    d = torch.exp(g)
    a, c = _tensor(to_torch(delta.a)(env), ref, shape), _tensor(to_torch(delta.c)(env), ref, shape)
    return g, d * a if delta.order == "right" else a, d * c if delta.order == "left" else c


def per_token(m: ir.Mixer, b: Batch, dtype: torch.dtype, env: dict | None = None) -> dict:
    """Every per-token quantity at every token at once ([B, T, HV, width]): the transition's log-decay
    g, the read and write directions alpha and gam of N^T (S N = S D - (S alpha) gam^T), the
    write's key u and value z, and the scaled query q. Value-side specs have no auxiliary states
    (the lowering refuses them), so each quantity is elementwise in its token's inputs. env:
    token_env's, where the caller has it."""
    env = token_env(m, b, dtype) if env is None else env
    ref = env["q"]
    shp = lambda w: (b.B, b.T, b.HV, w)
    out = {"u": _tensor(to_torch(m.write.key)(env), ref, shp(b.K)),
           "z": _tensor(to_torch(m.write.value)(env), ref, shp(b.V)),
           "q": _tensor(to_torch(m.query)(env), ref, shp(b.K)) * b.scale}
    out["g"], out["alpha"], out["gam"] = factor(m.log_decay(), m.delta, env, shp(b.V))
    return out


def _decays(g: torch.Tensor) -> torch.Tensor:
    """E [..., C + 1, C + 1, V]: E[t', s'] = exp(sum of g over tokens s' < j' <= t') for t' >= s', 0
    above the diagonal; token j sits at j' = j + 1 (s' = 0 stands for the chunk's start)."""
    C = g.shape[-2]
    gp = torch.cat([torch.zeros_like(g[..., :1, :]), g], dim=-2)  # [..., C + 1, V]
    idx = torch.arange(C + 1, device=g.device)
    after = (idx[None, :] > idx[:, None])[..., None]  # [s', j', 1]: j' > s'
    part = torch.where(after, gp.unsqueeze(-3), torch.zeros_like(gp).unsqueeze(-3))  # [..., s', j', V]
    sums = part.cumsum(-2).transpose(-2, -3)  # [..., t', s', V]
    keep = (idx[:, None] >= idx[None, :])[..., None]
    return torch.exp(torch.where(keep, sums, torch.full_like(sums, -float("inf"))))


def _sequence(p: dict, T0: torch.Tensor) -> tuple:
    """One batch of equally long sequences: p's tensors [B, T, HV, w], T0 [B, HV, V, K]. Returns o
    [B, T, HV, V] and the final T [B, HV, V, K]."""
    B, T, HV, V = p["z"].shape
    C = CHUNK
    NC = -(-T // C)
    pad = NC * C - T

    def chunks(t):  # [B, T, HV, w] -> [B, HV, NC, C, w], the padding an identity step without write
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t
        return t.permute(0, 2, 1, 3).reshape(B, HV, NC, C, t.shape[-1])

    g, al, ga, u, z, q = (chunks(p[n]) for n in ("g", "alpha", "gam", "u", "z", "q"))
    E = _decays(g)
    e_in, e_ex = E[..., 1:, 1:, :], E[..., :-1, 1:, :]  # E(t, s) and E(t - 1, s)
    gam_in, gam_ex = E[..., 1:, 0, :], E[..., :-1, 0, :]  # E(t, start) and E(t - 1, start)
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    strict = lower.tril(-1)
    A = torch.einsum("...tv,...tsv,...sv->...ts", al, e_ex, ga) * strict
    Bm = torch.einsum("...tv,...tsv,...sv->...ts", al, e_ex, z) * strict
    eye = torch.eye(C, dtype=g.dtype, device=g.device)
    X = eye + A
    P = al * gam_ex
    Wr = torch.linalg.solve_triangular(X, P, upper=False, unitriangular=True)  # r = Wr T_0 + Ur
    Ur = torch.linalg.solve_triangular(X, Bm @ u, upper=False, unitriangular=True)
    qu = (q @ u.transpose(-1, -2)) * lower
    qur = (q @ Ur.transpose(-1, -2)) * lower
    o_intra = (torch.einsum("...tsv,...sv,...ts->...tv", e_in, z, qu)
               - torch.einsum("...tsv,...sv,...ts->...tv", e_in, ga, qur))
    last = e_in[..., -1, :, :]  # E(C - 1, s) [..., C, V]
    outs = []
    Tc = T0
    for n in range(NC):  # the state pass: the only sequential part
        qt0 = q[:, :, n] @ Tc.transpose(-1, -2)  # T_0 q_t, [B, HV, C, V]
        qr = (qt0 @ Wr[:, :, n].transpose(-1, -2)) * lower
        o = gam_in[:, :, n] * qt0 + o_intra[:, :, n] - torch.einsum("...tsv,...sv,...ts->...tv",
                                                                    e_in[:, :, n], ga[:, :, n], qr)
        outs.append(o)
        R = Wr[:, :, n] @ Tc + Ur[:, :, n]
        Tc = (gam_in[:, :, n, -1, :, None] * Tc
              + (last[:, :, n] * z[:, :, n]).transpose(-1, -2) @ u[:, :, n]
              - (last[:, :, n] * ga[:, :, n]).transpose(-1, -2) @ R)
    o = torch.stack(outs, dim=2).reshape(B, HV, NC * C, V)[:, :, :T]
    return o.permute(0, 2, 1, 3), Tc


def torch_chunk(m: ir.Mixer, b: Batch):
    """o [B, T, HV, V] (in v's dtype) and the final state [N, HV, K, V] (fp32, fp64 for fp64 inputs),
    like reference.scan, through the chunked UT form in PyTorch (autograd gives the backward)."""
    dtype = compute_dtype(b)
    p = per_token(m, b, dtype)
    dev = p["q"].device
    zeros = lambda n: torch.zeros(n, b.HV, b.V, b.K, dtype=dtype, device=dev)
    h0 = None if b.initial_state is None else b.initial_state.to(dtype).transpose(-1, -2)
    if b.cu_seqlens is None:
        o, Tf = _sequence(p, zeros(b.B) if h0 is None else h0)
    else:
        outs, finals = [], []
        for n, (_, bos, eos) in enumerate(b.sequences()):
            part = {k: t[:, bos:eos] for k, t in p.items()}
            T0 = zeros(1) if h0 is None else h0[n:n + 1]
            if eos > bos:
                o_n, T_n = _sequence(part, T0)
            else:
                o_n, T_n = part["z"], T0  # an empty sequence: o [1, 0, HV, V]
            outs.append(o_n)
            finals.append(T_n)
        o, Tf = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    final = Tf.transpose(-1, -2) if b.output_final_state else None
    return o.to(b.tensors["v"].dtype), final


@dataclasses.dataclass(frozen=True)
class Route:
    """What ChunkFunction runs for one kind of transition: the forward (kernels, b, names, tensors,
    h0) -> (o, final state), the per-token vectors (per_token's signature), their names in the
    backward kernel's order, and the name of the backward's host function in the generated module
    (its signature value_chunk_bwd's); or `grads` (m, b, names, leaves, h0, do, dht) -> (the leaves'
    gradients, dh0), which then replaces the per-token vectors and that kernel."""
    forward: object
    per_token: object
    vectors: tuple
    backward: str
    grads: object = None


def chunk(m: ir.Mixer, kernels, b: Batch, route: "Route | None" = None):
    """mixer.chunk of a value-side spec (another transition's with route): the generated forward,
    differentiable in every input and the initial state (through ChunkFunction where something
    requires grad)."""
    route = route or VALUE
    names = list(m.tensor_names)
    tensors = [b.tensors[n] for n in names]
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*tensors, b.initial_state)):
        o, ht = ChunkFunction.apply(m, kernels, b, names, route, b.initial_state, *tensors)
        return o, (ht if b.output_final_state else None)
    return route.forward(kernels, b, names, tensors, b.initial_state)


def host_args(b: Batch, names, tensors, h0) -> tuple:
    """The kernels' inputs by name (contiguous), the initial state in fp32 and cu_seqlens in int64."""
    inputs = {n: t.contiguous() for n, t in zip(names, tensors)}
    h0 = None if h0 is None else h0.to(torch.float32).contiguous()
    cu = None if b.cu_seqlens is None else b.cu_seqlens.to(torch.int64).contiguous()
    return inputs, h0, cu


def _forward(kernels, b: Batch, names, tensors, h0):
    inputs, h0, cu = host_args(b, names, tensors, h0)
    return kernels.value_chunk_fwd(inputs, b.scale, h0, bool(b.output_final_state), cu)


VECTORS = ("g", "alpha", "gam", "u", "z", "q")  # per_token's, as the backward kernel takes them
VALUE = Route(_forward, per_token, VECTORS, "value_chunk_bwd")


class ChunkFunction(torch.autograd.Function):
    """The generated forward and backward (templates/chunk_value_bwd.py.jinja for the value side,
    route's otherwise). The kernel gives the gradients of the per-token vectors; autograd through
    per_token, recomputed from the saved inputs, carries them to the inputs (the spec's
    expressions, norms and clamps), as autograd.vector_chain_rule does for the key side."""

    @staticmethod
    def forward(ctx, m, kernels, b, names, route, h0, *tensors):
        o, ht = route.forward(kernels, b, names, tensors, h0)
        ctx.m, ctx.kernels, ctx.b, ctx.names, ctx.route, ctx.has_h0 = m, kernels, b, names, route, h0 is not None
        ctx.save_for_backward(*tensors, *([h0] if h0 is not None else []))
        return o, (ht if ht is not None else o.new_zeros(0))

    @staticmethod
    def backward(ctx, do, dht):
        saved = list(ctx.saved_tensors)
        h0 = saved.pop() if ctx.has_h0 else None
        b, route = ctx.b, ctx.route
        # finite copies of the inputs (runtime/nonfinite.py): a bad entry's nan would reach every
        # earlier token through the reverse pass's products; its own gradient is nan
        flags = masks = None
        if nonfinite.MODE == "device":
            finite, flags = nonfinite.device_copies(ctx.m, ctx.names, saved)
        else:
            masks = nonfinite.bad_entries(ctx.m, ctx.names, saved)
            finite = saved if masks is None else nonfinite.finite_copies(ctx.m, ctx.names, saved, masks)
        if route.grads is not None:
            leaves = [f.detach().requires_grad_(t.requires_grad) for f, t in zip(finite, saved)]
            grads, dh0 = route.grads(ctx.m, b, ctx.names, leaves, h0, do, dht if b.output_final_state else None)
            return (None, None, None, None, None, dh0, *_nan_back(ctx.m, ctx.names, saved, grads, flags, masks))
        with torch.enable_grad():
            leaves = [f.detach().requires_grad_(t.requires_grad) for f, t in zip(finite, saved)]
            p = route.per_token(ctx.m, dataclasses.replace(b, tensors=dict(zip(ctx.names, leaves))),
                                compute_dtype(b))
        vec = {n: p[n].detach().to(torch.float32).contiguous() for n in route.vectors}
        h0f = None if h0 is None else h0.detach().to(torch.float32).contiguous()
        cu = None if b.cu_seqlens is None else b.cu_seqlens.to(torch.int64).contiguous()
        dvec, dh0 = getattr(ctx.kernels, route.backward)(vec, do, h0f, dht if b.output_final_state else None, cu)
        outs = [(p[n], dvec[n].to(p[n].dtype)) for n in route.vectors if p[n].requires_grad]
        want = [t for t in leaves if t.requires_grad]
        dx = iter(torch.autograd.grad([o for o, _ in outs], want, [g for _, g in outs], allow_unused=True)
                  if outs and want else [None] * len(want))
        grads = [next(dx) if t.requires_grad else None for t in leaves]
        dh0 = dh0.to(h0.dtype) if h0 is not None and h0.requires_grad else None
        return (None, None, None, None, None, dh0, *_nan_back(ctx.m, ctx.names, saved, grads, flags, masks))


def _nan_back(m, names, saved, grads, flags, masks) -> list:
    """nan at the bad entries' own gradients (the backward ran on finite copies)."""
    if nonfinite.MODE == "device":
        return nonfinite.device_nan_at(m, names, saved, grads, flags)
    return grads if masks is None else nonfinite.nan_at(grads, masks)
