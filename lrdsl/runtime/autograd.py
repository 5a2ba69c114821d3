"""Differentiable chunked kernels: torch.autograd around the generated forward and backward.

The generated backward returns the gradients of the per-token vectors the kernels consume (erase
directions a and c, write key u and value z, scaled query r, log-decay gl) and of the initial
state. After the staged backward, a generated kernel applies the chain rule to the spec's inputs
(codegen/chain.py); with key-channel auxiliary states twice, around a Triton reverse scan of the
states' gradients (aux_chain_rule). Otherwise the chain rule (elementwise, plus the auxiliary scans and in-mixer
L2 norms) runs through PyTorch autograd on the same expressions the reference evaluates, so every
expression a spec can write is differentiated the same way; on CUDA tensors the auxiliary scans
and their gradients are Triton kernels there (lrdsl/scan.py), elsewhere PyTorch doubling scans. The auxiliary states at the ends of
the sequences (part of the final whole state) are outputs of that PyTorch function too, so their
gradients join the vectors' there.
"""
import dataclasses

import torch

from lrdsl.codegen.plan import Plan
from lrdsl.codegen.readouts import fused
from lrdsl.frontend import ir
from lrdsl.runtime import nonfinite
from lrdsl.runtime.reference import prepare_inputs, to_torch
from lrdsl.runtime.scan import first_order_scan_triton, scan_backward
from lrdsl.runtime.tensors import Batch


def _full(x, shape, dtype, device):
    """x as a [shape] tensor: a broadcast view of a tensor with dims; a number (or a host tensor of
    none) filled on the device, with no host-to-device copy and no .item() (each waits for the GPU)."""
    if isinstance(x, torch.Tensor) and (x.dim() or x.device.type != "cpu"):
        t = x.to(dtype=dtype, device=device)
        return t.expand(shape) if t.dim() else t.expand(shape).contiguous()
    return torch.full(shape, float(x), dtype=dtype, device=device)


def first_order_scan(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """P_t = alpha_t P_{t-1} + beta_t along dim 1, P_{-1} = 0: log2(T) vectorised doubling steps
    (Hillis-Steele) instead of a Python loop over T; differentiable, and |products| <= 1 when
    |alpha| <= 1, so no rescaling is needed."""
    a, p = alpha, beta
    d = 1
    while d < p.shape[1]:
        p = torch.cat([p[:, :d], p[:, d:] + a[:, d:] * p[:, :-d]], 1)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], 1)
        d *= 2
    return p


# the auxiliary scans of the chain rule in Triton (lrdsl/scan.py): None for CUDA tensors only,
# True / False always / never (tests run the Triton kernels in the interpreter)
TRITON_SCAN = None


# specs with key-channel auxiliary states: the generated chain rule (aux_chain_rule) after the staged
# backward; False: the PyTorch one (vector_chain_rule), as before (benchmarks/time_aux_scan.py)
GENERATED_AUX_CHAIN = True


def triton_scan(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether token_vectors scans with the Triton kernels (fp32 only; fp64 is the reference's)."""
    want = device.type == "cuda" if TRITON_SCAN is None else TRITON_SCAN
    return want and dtype == torch.float32


def _at_ends(P: torch.Tensor, b: Batch, j: int) -> torch.Tensor:
    """An auxiliary state [B, T, HV, D] at the end of each sequence, [N, HV, D]; an empty sequence
    keeps its initial state (b.initial_aux[j], or zero)."""
    seqs = b.sequences()
    start = P.new_zeros(len(seqs), *P.shape[2:]) if b.initial_aux is None else b.initial_aux[j].to(P.dtype)
    if not b.T:
        return start
    rows, last, empty = (torch.tensor(c, device=P.device) for c in zip(*((bi, max(e - 1, 0), e == s)
                                                                           for bi, s, e in seqs)))
    return torch.where(empty.view(-1, 1, 1), start, P[rows, last])


# Per-call index tensors are made on the device from cu_seqlens: a Python list (of
# b.sequences()) as an index or torch.tensor(..., device=cuda) is a blocking host-to-device copy,
# which waits for every kernel queued before it, and cu_seqlens.tolist() waits too.
_FRAMES = {}  # (what, B, T, device) -> its read-only tensor, where the sequences are whole rows


def _frame(what: str, b: Batch, dev, make) -> torch.Tensor:
    """make(), kept for the next call with the same B, T and device outside torch.compile,
    torch.func transforms and Python dispatch modes (no wrapped or fake tensor is kept): a few
    small launches fewer per backward."""
    if not _plain_mode():
        return make()
    key = (what, b.B, b.T, torch.device(dev))
    if key not in _FRAMES:
        if len(_FRAMES) >= 64:
            _FRAMES.clear()
        _FRAMES[key] = make()
    return _FRAMES[key]


def _starts(b: Batch, dev) -> torch.Tensor:
    """[T] bool: True at the tokens where a sequence starts (read only)."""
    if b.cu_seqlens is None:
        def make():
            starts = torch.zeros(b.T, dtype=torch.bool, device=dev)
            starts[:1] = True
            return starts
        return _frame("starts", b, dev, make)
    starts = torch.zeros(b.T + 1, dtype=torch.bool, device=dev)  # an empty last sequence starts at T
    starts.index_fill_(0, b.cu_seqlens[:-1].to(device=dev, dtype=torch.int64), True)
    return starts[:b.T]


def _start_rows(b: Batch, dev) -> torch.Tensor:
    """[B * T] int32: the sequence whose first token each row is, -1 elsewhere (empty sequences
    have none; read only)."""
    if b.cu_seqlens is None:
        def make():
            rows = torch.full((b.B, b.T), -1, dtype=torch.int32, device=dev)
            if b.T:
                rows[:, 0] = torch.arange(b.B, dtype=torch.int32, device=dev)
            return rows.view(-1)
        return _frame("start rows", b, dev, make)
    cu = b.cu_seqlens.to(device=dev, dtype=torch.int64)
    rows = torch.full((b.T + 1,), -1, dtype=torch.int32, device=dev)
    # an empty sequence shares its start with the next one: it writes the spare row T instead
    at = torch.where(cu[1:] > cu[:-1], cu[:-1], b.T)
    rows[at] = torch.arange(cu.numel() - 1, dtype=torch.int32, device=dev)
    return rows[:b.T]


def _scan_frame(b: Batch, env: dict, dtype):
    """(the vectors' shapes by kind, the sequence starts [T] bool, (batch row, token, sequence) of
    each non-empty sequence's first token where the batch has initial auxiliary states, else [])."""
    dev = b.tensors["q"].device
    env["h"] = torch.arange(b.HV, device=dev, dtype=dtype).view(1, 1, b.HV, 1)
    shp = {"K": (b.B, b.T, b.HV, b.K), "V": (b.B, b.T, b.HV, b.V), "scalar": (b.B, b.T, b.HV, 1)}
    starts = _starts(b, dev)
    firsts = [] if b.initial_aux is None else [
        torch.tensor(c, device=dev) for c in zip(*((bi, s, n) for n, (bi, s, e) in enumerate(b.sequences()) if e > s))]
    return shp, starts, firsts


def _scan_operands(a, j, env, b, shp, starts, firsts, dtype, per_head):
    """(the decay a_t, the scan's coefficient (0 at sequence starts), its input) of auxiliary
    state j: P_t = alpha_t P_{t-1} + beta_t, the initial state folded into a first token's beta.
    With per_head, a decay that is one number per head stays [B, T, HV, 1]."""
    dev = starts.device
    decay = to_torch(a.decay)(env)  # a tensor, or a number for a constant decay
    per_head = per_head and (not isinstance(decay, torch.Tensor) or decay.dim() == 0 or decay.shape[-1] == 1)
    decay = _full(decay, shp["scalar"] if per_head else shp[a.kind], dtype, dev)
    beta = _full(to_torch(a.write)(env), shp[a.kind], dtype, dev)
    if firsts:  # the first token of a sequence decays its initial state
        rows, cols, seqs = firsts
        beta = beta.index_put((rows, cols), decay[rows, cols] * b.initial_aux[j].to(dtype)[seqs], accumulate=True)
    # a sequence starts from its initial state (or zero), not from what came before
    return decay, decay * (~starts).view(1, -1, 1, 1).to(dtype), beta


def token_vectors(m: ir.Mixer, b: Batch, dtype=torch.float32, finals: bool = False) -> dict:
    """The per-token vectors of the chunked kernels, as differentiable tensors [B, T, HV, K|V];
    with finals=True also each auxiliary state at the end of each sequence, [N, HV, K|V], under
    the key "final <name>" (the kernels' scans give them forward; this differentiates them)."""
    env = prepare_inputs(m, b, dtype)
    shp, starts, firsts = _scan_frame(b, env, dtype)
    dev = starts.device
    ends = {}
    per_head = triton_scan(dev, dtype)  # the Triton scan keeps a decay that is one number per head so
    scan = first_order_scan_triton if per_head else first_order_scan
    for j, a in enumerate(m.aux):
        _, alpha, beta = _scan_operands(a, j, env, b, shp, starts, firsts, dtype, per_head)
        env[a.name] = scan(alpha, beta)
        if finals:
            ends["final " + a.name] = _at_ends(env[a.name], b, j)
    for lt in m.lets:
        env[lt.name] = to_torch(lt.expr)(env)
    before = fused(m)  # the kernels read S_prev^T r, c the bonus's key vector (codegen/readouts.py)
    out = {"u": _full(to_torch(m.write.key)(env), shp["K"], dtype, dev),
           "z": _full(to_torch(m.write.value)(env), shp["V"], dtype, dev),
           "r": _full(to_torch(before.query if before else m.query)(env), shp["K"], dtype, dev) * b.scale}
    if before is not None and before.bonus_key is not None:
        out["c"] = _full(to_torch(before.bonus_key)(env), shp["K"], dtype, dev)
    out.update(ends)
    if m.solve_lam is not None:  # the offline solve: its Gram state's other side k, and lam
        out["kk"] = _full(env["k"], shp["K"], dtype, dev)
        out["lam"] = _full(to_torch(m.solve_lam)(env), shp["K"], dtype, dev)
    if m.delta is not None:
        out["a"] = _full(to_torch(m.delta.a)(env), shp["K"], dtype, dev)
        out["c"] = _full(to_torch(m.delta.c)(env), shp["K"], dtype, dev)
    if m.decay.kind != "identity":
        gl = to_torch(m.log_decay())(env)
        if m.decay.kind in ("scalar", "diagonal"):  # the kernels' floor (codegen.plan._floored)
            floor = Plan.log_decay_floor
            gl = torch.where(gl < floor, torch.full_like(gl, floor), gl)
        out["gl"] = _full(gl, shp["K"], dtype, dev) if m.decay.kind == "diagonal" else \
            _full(gl, shp["scalar"], dtype, dev)[..., 0]
    return out


def host_args(names, tensors, h0, cu_seqlens):
    """What the generated host functions take: contiguous inputs by name, an fp32 initial state,
    int64 cu_seqlens."""
    inputs = {n: t.contiguous() for n, t in zip(names, tensors)}
    cu = cu_seqlens.to(torch.int64).contiguous() if cu_seqlens is not None else None
    h0c = h0.to(torch.float32).contiguous() if h0 is not None else None
    return inputs, h0c, cu


def _batch_like(batch: Batch, tensors: dict) -> Batch:
    return Batch(tensors, batch.B, batch.T, batch.H, batch.HV, batch.K, batch.V, batch.scale, None,
                 False, batch.cu_seqlens)


def input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs, saved=None, residual=None,
                initial_aux=None, dfinal_aux=(), residual_owned=False):
    """(gradients of every input (None where not needed), of h0, of each auxiliary initial state)
    for the chunked kernels. `saved` / `residual`: what the forward kept for the backward (or None);
    initial_aux: the auxiliary states the forward started from (fp32; None for zeros, then the third
    part is empty); dfinal_aux: the gradients of the auxiliary final states (None for zero).
    Inputs with non-finite entries: the backward of their finite copies (runtime/nonfinite.py), nan
    at those entries. residual_owned: no one but this backward reads `residual` (ChunkFunction's; the
    custom op's is an output of its forward), so it may be changed in place."""
    if nonfinite.MODE == "device" and reads_inputs(mixer_ir, module, batch.K, saved):
        if residual is not None and not (residual_owned and residual.is_contiguous()):
            residual = residual.contiguous().clone()
        inputs, h0c, cu = host_args(names, tensors, h0, batch.cu_seqlens)
        st, bad = finite_states(mixer_ir, module, inputs, names, batch.scale, h0c, cu, saved, residual)
        if st is None:  # the forward's own stages, on the inputs as they are
            st = nonfinite.finite_kept(saved, [tensors[names.index(n)] for n in module.INPUTS])
        grads, dh0, daux = _input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs, st, residual,
                                        initial_aux, dfinal_aux)
        return nonfinite.device_nan_at(mixer_ir, names, tensors, grads, bad), dh0, daux
    if nonfinite.MODE == "device":  # no wait for the device (runtime/nonfinite.py)
        finite, bad = nonfinite.device_copies(mixer_ir, names, tensors)
        by_name = dict(zip(names, finite))
        order = getattr(module, "INPUTS", ())
        kept = nonfinite.finite_kept(saved, [by_name[n] for n in order] if all(n in by_name for n in order) else None)
        flag = nonfinite.any_flag(bad)
        if residual_owned and residual is not None and residual.is_contiguous() and flag is not None:
            residual = nonfinite.zero_nonfinite_(residual, flag)
        else:
            residual = nonfinite.finite_kept(residual)
        grads, dh0, daux = _input_grads(mixer_ir, module, batch, names, finite, h0, do, dht, needs,
                                        kept, residual, initial_aux, dfinal_aux)
        return nonfinite.device_nan_at(mixer_ir, names, tensors, grads, bad), dh0, daux
    masks = nonfinite.bad_entries(mixer_ir, names, tensors)
    if masks is None:
        return _input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs, saved, residual,
                            initial_aux, dfinal_aux)
    # what the forward kept carries the bad values: the backward recomputes it from the copies
    finite = nonfinite.finite_copies(mixer_ir, names, tensors, masks)
    grads, dh0, daux = _input_grads(mixer_ir, module, batch, names, finite, h0, do, dht, needs, None, None,
                                    initial_aux, dfinal_aux)
    return nonfinite.nan_at(grads, masks), dh0, daux


def reads_inputs(mixer_ir, module, K, saved) -> bool:
    """Whether this backward runs the staged kernels whose loads make the inputs finite themselves
    (codegen/finite.py: the module's FINITE_LOADS) and the generated chain rule, with no auxiliary
    state (their PyTorch scans would read the inputs): no finite copies for them."""
    return (nonfinite.FINITE_AT_LOAD and getattr(module, "FINITE_LOADS", False) and module.HAS_CHAIN_RULE
            and not mixer_ir.aux and K <= module.STAGED_MAX_K and (saved is None or "staged" in saved))


def finite_states(mixer_ir, module, inputs, checked, scale, h0, cu_seqlens, saved, residual=None):
    """(the staged forward's stages 1 to 3 that the backward reads, made again by the kernels' twins
    whose loads make the inputs finite (the module's _staged_states_finite) from `inputs` (as the
    host functions take them: host_args'); None where the forward kept them (`saved`), the inputs'
    flags (nonfinite.device_flags': no copy). checked: each input's name for the rule, in `inputs`'
    order; residual (the forward's solve, or None) is zeroed in place where a flag is set, and the
    stages made from it."""
    bad = nonfinite.device_flags(mixer_ir, checked, list(inputs.values()))
    flag = nonfinite.any_flag(bad)
    if residual is not None and flag is not None:  # (in place: the caller's own)
        nonfinite.zero_nonfinite_(residual, flag)
    if saved is not None:
        return None, bad
    st = module._staged_states(inputs, scale, h0, False, cu_seqlens, residual, None, keep_aux=bool(module.CHAIN_AUX),
                               finite=True)
    st["staged"] = True
    return st, bad


def _input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs, saved, residual, initial_aux,
                 dfinal_aux):
    inputs, h0, cu = host_args(names, tensors, h0, batch.cu_seqlens)
    if do is None:
        do = torch.zeros(batch.B, batch.T, batch.HV, batch.V, device=tensors[0].device)
    vgrads, dh0 = module.chunk_bwd(inputs, batch.scale, h0, do, dht, cu, saved, residual, initial_aux)
    # the staged backward's auxiliary states of every token (its scans made them anyway), if any
    states = [vgrads.pop("aux " + n, None) for n in getattr(module, "CHAIN_AUX", ())]
    # the staged backward ran: its generated chain rule too
    if module.HAS_CHAIN_RULE and "a" not in vgrads and (GENERATED_AUX_CHAIN or not mixer_ir.aux):
        if mixer_ir.aux:
            grads, daux = aux_chain_rule(mixer_ir, module, batch, inputs, tensors, vgrads, initial_aux, dfinal_aux,
                                         states)
            return [g if need else None for g, need in zip(grads, needs)], dh0, daux
        g = module.chain_rule(inputs, batch.scale, vgrads)
        return [g[n] if need else None for n, need in zip(names, needs)], dh0, []
    grads, daux = vector_chain_rule(mixer_ir, batch, names, tensors, needs, vgrads, initial_aux, dfinal_aux)
    return grads, dh0, daux


_SCANS = {}  # id(mixer IR) -> (that IR, _scans_ir's answer): made once per mixer


def _scans_ir(mixer_ir):
    """The IR with only the inputs and params the auxiliary decays read: one number per head
    where a decay is (the reverse scan's coefficients); the writes, the L2 norms and the states are
    the kernels'."""
    hit = _SCANS.get(id(mixer_ir))
    if hit is None or hit[0] is not mixer_ir:
        used = {s.name for a in mixer_ir.aux for s in a.decay.free_symbols}
        hit = _SCANS[id(mixer_ir)] = (mixer_ir, dataclasses.replace(
            mixer_ir, inputs=tuple(i for i in mixer_ir.inputs if i.name in used),
            params=tuple(p for p in mixer_ir.params if p.name in used)))
    return hit[1]


def aux_chain_rule(mixer_ir, module, batch, inputs, tensors, vgrads, initial_aux=None, dfinal_aux=(), states=()):
    """(every input's gradient, each auxiliary initial state's (empty when initial_aux is None))
    through the generated chain-rule kernel, for a spec with auxiliary states (codegen/chain.py):
    the states P as the staged backward's scans made them (`states`), else by the same kernels (the
    module's _aux_states, from the raw inputs);
    a first launch gives each P's local gradient (the vectors' derivatives in P), to which each
    sequence's final-state gradient is added at its last token; the reverse scan turns it into the
    gradient of the scan's write; a second launch gives the inputs' gradients with their
    derivatives, the decay's gradient made there from the write's and P (one kernel: AUX_LOCAL
    picks its part). On the host only per-head decays and per-sequence rows: no [B, T, HV, K] pass."""
    b = _batch_like(batch, dict(zip(inputs, tensors)))
    if initial_aux is not None:
        b = dataclasses.replace(b, initial_aux=tuple(initial_aux))
    dev = tensors[0].device
    cu = None if batch.cu_seqlens is None else batch.cu_seqlens.to(torch.int64).contiguous()
    p0 = None if initial_aux is None else [a.float().contiguous() for a in initial_aux]
    scans_ir = _scans_ir(mixer_ir)
    with torch.no_grad():
        BT = module.STAGED_CHUNK
        if not states or any(P is None for P in states):
            states, _ = module._aux_states(inputs, cu, module._chunks(cu, b.B, b.T, BT), BT, p0)
        env = prepare_inputs(scans_ir, b, torch.float32)
        shp, starts, firsts = _scan_frame(b, env, torch.float32)
        decays = []
        for a in mixer_ir.aux:
            d = to_torch(a.decay)(env)  # a tensor, or a number for a constant decay
            per_head = not isinstance(d, torch.Tensor) or d.dim() == 0 or d.shape[-1] == 1
            decays.append(_full(d, shp["scalar"] if per_head else shp[a.kind], torch.float32, dev))
        # the sequence whose first token each row is (-1: none): there the kernel's state before
        # the token is the initial one (or zero), not the previous row's
        start_seq = _start_rows(b, dev)
        extra = {"aw_" + n: P for n, P in zip(module.CHAIN_AUX, states)}  # unread by the first launch
        local = module.chain_rule(inputs, batch.scale, {**vgrads, **extra}, states, local=True, start_seq=start_seq)
        # (sequence, row, last token) of each non-empty sequence: host lists, only where the final
        # states' gradients flow (a host-to-device copy)
        live = None if all(d is None for d in dfinal_aux) else \
            [(n, bi, e - 1) for n, (bi, s, e) in enumerate(b.sequences()) if e > s]
        daux = []
        for j, (a, decay) in enumerate(zip(mixer_ir.aux, decays)):
            dp = local["aux " + a.name]
            d_end = dfinal_aux[j] if j < len(dfinal_aux) else None
            if d_end is not None and live:  # the final state is P at the sequence's last token
                n, rows, cols = (torch.tensor(c, device=dp.device) for c in zip(*live))
                dp.index_put_((rows, cols), d_end.float()[n], accumulate=True)
            # a sequence's first token does not carry the gradient back into the one before
            _, dbeta = scan_backward(decay * (~starts).view(1, -1, 1, 1).float(), None, dp, decay_grad=False)
            if initial_aux is not None:
                # the initial state enters as decay_first * P0: an empty sequence hands it over as is
                d0 = torch.zeros_like(initial_aux[j], dtype=torch.float32)
                if d_end is not None:
                    d0 += d_end.float()
                if firsts:
                    rows, cols, n = firsts
                    d0[n] = dbeta[rows, cols] * decay[rows, cols]
                daux.append(d0)
            extra["aw_" + a.name] = dbeta
        g = module.chain_rule(inputs, batch.scale, {**vgrads, **extra}, states, start_seq=start_seq, initial_aux=p0)
    return [g[n] for n in inputs], daux


def vector_chain_rule(mixer_ir, batch, names, tensors, needs, vgrads, initial_aux=None, dfinal_aux=()):
    """(the gradients of the inputs (None where not needed), those of the auxiliary initial states
    initial_aux (empty when None)) from those of the per-token vectors, and from dfinal_aux, those
    of the auxiliary final states (None for zero), through PyTorch on the expressions the reference
    evaluates (where no generated chain-rule kernel runs). torch.func.vjp rather than
    torch.autograd.grad: it also runs inside the custom op, where the autograd dispatch key is
    switched off."""
    wanted = [i for i, need in enumerate(needs) if need]
    n_aux = 0 if initial_aux is None else len(initial_aux)
    cotangents = {n: t.float() for n, t in vgrads.items()}  # the staged backward's may be bf16
    finals = any(d is not None for d in dfinal_aux)
    if finals:  # the final states as outputs of the vector function, with zero for those not used
        for a, d in zip(mixer_ir.aux, dfinal_aux):
            shape = (batch.N, batch.HV, a.width(batch.K, batch.V))
            cotangents["final " + a.name] = torch.zeros(shape, device=tensors[0].device) if d is None else d.float()
    present = sorted(cotangents)

    def vectors(*xs):
        live = list(tensors)
        for i, x in zip(wanted, xs):
            live[i] = x
        b = _batch_like(batch, dict(zip(names, live)))
        if n_aux:
            b = dataclasses.replace(b, initial_aux=tuple(xs[len(wanted):]))
        vecs = token_vectors(mixer_ir, b, torch.float32, finals)
        return tuple(vecs[k] for k in present)

    found = [None] * len(tensors)
    daux = []
    if wanted or n_aux:
        leaves = [tensors[i].detach() for i in wanted] + [a.detach() for a in (initial_aux or ())]
        _, pullback = torch.func.vjp(vectors, *leaves)
        pulled = pullback(tuple(cotangents[k] for k in present))
        daux = list(pulled[len(wanted):])
        storages = set()
        for i, g in zip(wanted, pulled[:len(wanted)]):
            g = g.to(tensors[i].dtype)
            if g.untyped_storage().data_ptr() in storages:  # a + dt_bias: one gradient for both, and
                g = g.clone()  # the custom op's outputs may not alias one another
            storages.add(g.untyped_storage().data_ptr())
            found[i] = g
    return found, daux


def chunk_forward(module, batch, names, keep, tensors, h0, aux0):
    """The forward kernels on the call's tensors: (their ChunkResult, the initial state and the
    auxiliary initial states as the kernels took them: fp32, contiguous; None where not given)."""
    inputs, h0c, cu = host_args(names, tensors, h0, batch.cu_seqlens)
    aux0c = [a.to(torch.float32).contiguous() for a in aux0] if aux0 else None
    r = module.chunk_fwd(inputs, batch.scale, h0c, batch.output_final_state, cu, keep=keep, initial_aux=aux0c)
    return r, h0c, aux0c


class ChunkFunction(torch.autograd.Function):
    """chunk outside the custom op: from a whole initial state (S and the auxiliary states), or
    keeping the forward's intermediates for the backward (keep: more memory, less time).
    Differentiable in every input, S0 and each auxiliary initial state, from every part of the
    output and the final whole state; the auxiliary final states come from the forward's own scans."""

    @staticmethod
    def forward(ctx, mixer_ir, module, batch, names, keep, h0, n_aux, *tensors_and_aux):
        n = len(tensors_and_aux) - n_aux
        tensors, aux0 = list(tensors_and_aux[:n]), list(tensors_and_aux[n:])
        r, h0c, aux0c = chunk_forward(module, batch, names, keep, tensors, h0, aux0)
        ctx.save_for_backward(*tensors, *(aux0c or ()))
        # the staged solve's residual spares the backward a solve, as in the custom op; from
        # auxiliary initial states the backward solves again, as before
        residual = r.residual if not n_aux else None
        ctx.info = (mixer_ir, module, batch, names, h0c, None if h0 is None else h0.dtype,
                    [a.dtype for a in aux0], n, residual)
        ctx.kept = r.saved
        ctx.set_materialize_grads(False)
        return (r.o, r.final_state, *r.final_aux)

    @staticmethod
    def backward(ctx, do, dht, *dfinal_aux):
        mixer_ir, module, batch, names, h0, h0_dtype, aux_dtypes, n, residual = ctx.info
        # the kept intermediates are handed over, freed with this backward rather than with the graph
        # (a second backward through a retained graph finds None and recomputes them)
        saved, ctx.kept = ctx.kept, None
        stored = ctx.saved_tensors
        tensors, aux0 = list(stored[:n]), (list(stored[n:]) if aux_dtypes else None)
        needs = ctx.needs_input_grad[7:]
        grads, dh0, daux = input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs[:n], saved,
                                       residual=residual, initial_aux=aux0, dfinal_aux=dfinal_aux, residual_owned=True)
        dh0 = dh0.to(h0_dtype) if dh0 is not None and ctx.needs_input_grad[5] else None
        daux = [g.to(d) if need else None for g, d, need in zip(daux, aux_dtypes, needs[n:])]
        out = (None, None, None, None, None, dh0, None, *grads, *daux)
        return _not_twice(out) if torch.is_grad_enabled() else out


def _not_twice(out):
    """Under create_graph: the gradients marked so that a backward through them raises (as through
    the custom op, whose backward has no formula), not a silent zero: the kernels' gradients have
    no derivative."""
    live = [i for i, g in enumerate(out) if g is not None]
    if not live:
        return out
    # what once_differentiable marks its outputs with
    err = torch._C._functions.DelayedError(b"lrdsl: the chunked kernels' backward is not differentiable "
                                           b"(no second derivatives)", len(live))
    marked = err(*[out[i].detach().requires_grad_() for i in live])
    marked = (marked,) if isinstance(marked, torch.Tensor) else marked
    out = list(out)
    for i, g in zip(live, marked):
        out[i] = g
    return tuple(out)


def eager(tensors) -> bool:
    """Whether chunk may take ChunkFunction instead of its custom op: the op's Python dispatch
    (pytree, schema defaults, the autograd wrapper, a second op for the backward) costs some
    0.1 ms of host time each way per call, more than the kernels' launches. Only outside
    torch.compile (which needs the op), torch.func transforms and Python modes, on plain tensors
    (nn.Parameter included); both run the same host functions and kernels."""
    return (_plain_mode() and not torch._C._is_torch_function_mode_enabled()
            and not torch.overrides.has_torch_function(tensors))


def _plain_mode() -> bool:
    """Outside torch.compile, torch.func transforms and Python dispatch modes: real tensors only."""
    if torch.compiler.is_compiling():  # first: dynamo traces no further
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    return torch._C._functorch.peek_interpreter_stack() is None and _get_current_dispatch_mode() is None


_OPS = {}


def chunk_op(mixer_ir, module, key: str):
    """The chunked kernels as a torch.library custom op with a fake (meta) implementation and an
    autograd formula, so torch.compile sees one opaque op and no graph break. One op per module."""
    if key in _OPS:
        return _OPS[key]
    names = mixer_ir.tensor_names  # the inputs, then the params
    lib = f"lrdsl::{mixer_ir.name}_{key}"

    def sizes(tensors, cu_seqlens):
        q, v = tensors[names.index("q")], tensors[names.index("v")]
        B, T, H, K = q.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return B, T, H, v.shape[2], K, v.shape[3], N

    def batch_of(tensors, scale, cu_seqlens, output_final_state):
        B, T, H, HV, K, V, _ = sizes(tensors, cu_seqlens)
        return Batch(dict(zip(names, tensors)), B, T, H, HV, K, V, scale, None, output_final_state,
                     cu_seqlens)

    @torch.library.custom_op(lib + "_fwd", mutates_args=())
    def fwd(tensors: list[torch.Tensor], h0: torch.Tensor | None, scale: float,
            cu_seqlens: torch.Tensor | None, output_final_state: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # the third output is what the backward reuses (the staged forward's WY inverse), or empty;
        # the fourth the auxiliary final states side by side [N, HV, K|V + ...], or empty
        inputs, h0c, cu = host_args(names, tensors, h0, cu_seqlens)
        r = module.chunk_fwd(inputs, scale, h0c, output_final_state, cu)
        return (r.o, r.final_state if r.final_state is not None else r.o.new_empty(0, dtype=torch.float32),
                r.residual if r.residual is not None else r.o.new_empty(0),
                torch.cat(r.final_aux, -1) if r.final_aux else r.o.new_empty(0, dtype=torch.float32))

    @fwd.register_fake
    def _(tensors, h0, scale, cu_seqlens, output_final_state):
        B, T, H, HV, K, V, N = sizes(tensors, cu_seqlens)
        v = tensors[names.index("v")]
        o = v.new_empty(B, T, HV, V)
        ht = v.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=torch.float32)
        res = v.new_empty(0)
        if module.keeps_residual(K):
            res = v.new_empty(module.RESIDUAL_PARTS, B, T, HV, module.STAGED_CHUNK,
                              dtype=module._store_dtype(v))
        width = sum(K if kind == "K" else V for kind in module.AUX_KINDS)
        aux = v.new_empty((N, HV, width) if output_final_state and width else (0,), dtype=torch.float32)
        return o, ht, res, aux

    def aux_widths(tensors):
        K, V = tensors[names.index("q")].shape[-1], tensors[names.index("v")].shape[-1]
        return [K if kind == "K" else V for kind in module.AUX_KINDS]

    @torch.library.custom_op(lib + "_bwd", mutates_args=())
    def bwd(tensors: list[torch.Tensor], h0: torch.Tensor | None, scale: float,
            cu_seqlens: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None,
            daux: torch.Tensor | None, needs: list[bool], residual: torch.Tensor) -> list[torch.Tensor]:
        # daux: the gradient of the fourth output of fwd (the auxiliary final states), or None
        batch = batch_of(tensors, scale, cu_seqlens, False)
        dfinal = torch.split(daux, aux_widths(tensors), dim=-1) if daux is not None else ()
        grads, dh0, _ = input_grads(mixer_ir, module, batch, names, tensors, h0, do, dht, needs,
                                    residual=residual if residual.numel() else None, dfinal_aux=dfinal)
        out = [g if g is not None else t.new_empty(0) for g, t in zip(grads, tensors)]
        return out + [dh0.to(h0.dtype) if dh0 is not None else do.new_empty(0)]

    @bwd.register_fake
    def _(tensors, h0, scale, cu_seqlens, do, dht, daux, needs, residual):
        out = [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(tensors, needs)]
        return out + [torch.empty_like(h0) if h0 is not None else do.new_empty(0)]

    def setup_context(ctx, inputs, output):
        tensors, h0, scale, cu_seqlens, output_final_state = inputs
        ctx.save_for_backward(*tensors, output[2], *([h0] if h0 is not None else []))
        ctx.meta = (len(tensors), h0 is not None, scale, cu_seqlens, output_final_state)
        # None, not zeros, for the gradients of outputs the loss does not use: the residual's
        # (always unused) was a [parts, B, T, HV, chunk] fill per backward
        ctx.set_materialize_grads(False)

    def backward(ctx, do, dht, _dres, daux):
        n, has_h0, scale, cu_seqlens, output_final_state = ctx.meta
        saved = ctx.saved_tensors
        tensors, residual, h0 = list(saved[:n]), saved[n], (saved[n + 1] if has_h0 else None)
        needs = [t.requires_grad for t in tensors]
        if do is None:
            do = torch.zeros_like(fwd_out_like(tensors))
        dht = dht if (output_final_state and dht is not None and dht.numel()) else None
        daux = daux if (output_final_state and daux is not None and daux.numel()) else None
        res = bwd(tensors, h0, scale, cu_seqlens, do, dht, daux, needs, residual)
        grads = [g if need else None for g, need in zip(res[:n], needs)]
        return grads, (res[n] if has_h0 else None), None, None, None

    def fwd_out_like(tensors):
        B, T, H, HV, K, V, N = sizes(tensors, None)
        return tensors[names.index("v")].new_empty(B, T, HV, V)

    fwd.register_autograd(backward, setup_context=setup_context)
    _OPS[key] = fwd
    return fwd
