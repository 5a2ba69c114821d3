"""`lrdsl bench`: time a mixer's chunked kernels on the GPU, beside its FLA twin in the same run.

The twin is flash-linear-attention's op for the same model when the spec is one of the examples,
else the FLA op of the same canonical shape (erase or not; no, scalar or per-channel decay). Both
read the same tensors. Two times per call: the median wall clock of triton.testing.do_bench, and the
GPU time (the summed durations of the call's kernels under torch.profiler), which does not move with
the host's speed where short forwards are launch-bound. Memory is the peak allocated above what the
inputs hold, during one call; with the backward also what the forward leaves allocated for it
(held_mem, in the log: more with keep_intermediates, `lrdsl bench --keep-intermediates`).
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lrdsl.options import comma_ints


@dataclass(frozen=True)
class Shape:
    B: int = 4
    T: int = 4096
    H: int = 16
    K: int = 128
    V: int = 128


def parse_shape(text: str) -> Shape:
    try:
        return Shape(*comma_ints(text, count=5))
    except ValueError:
        raise ValueError(f"--shape takes five positive integers B,T,H,K,V, got {text!r}") from None


def draw(mixer, s: Shape, dtype=torch.bfloat16, device="cuda", seed=0) -> dict:
    """Inputs inside their declared ranges; log-decays in fp32 (as FLA takes them); params in fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for i in mixer.ir.inputs:
        shape = (s.B, s.T, s.H) + (() if i.kind == "scalar" else ((s.K,) if i.kind == "K" else (s.V,)))
        x = torch.randn(shape, generator=gen, device=device)
        if i.log:
            out[i.name] = F.logsigmoid(x + 3)
            continue
        if i.unit and not i.l2norm:
            x = F.normalize(x, dim=-1)
        elif math.isfinite(float(i.lo)) and math.isfinite(float(i.hi)):
            x = float(i.lo) + (float(i.hi) - float(i.lo)) * torch.sigmoid(x)
        elif math.isfinite(float(i.lo)):  # (lo, inf), e.g. Mesa's lamb: kept off lo, as the GPU suite draws it
            x = float(i.lo) + 0.25 + F.softplus(x)
        elif math.isfinite(float(i.hi)):
            x = float(i.hi) - 0.25 - F.softplus(x)
        out[i.name] = x.to(dtype)
    from lrdsl.frontend.params import param_shape, sample
    for p in mixer.ir.params:  # fp32 per head, drawn as lrdsl.nn.Layer initialises them
        out[p.name] = sample(p.init, param_shape(p, s.H, s.K, s.V)).to(device)
    return out


def _fla(name: str):
    import importlib

    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: FLA refuses its gated backward on triton 3.6 (#640)
    path, fn = name.rsplit(".", 1)
    return getattr(importlib.import_module("fla.ops." + path), fn)


def _fla_compiles_at_once() -> None:
    """FLA's autotuners compile their configs one after the other on their first launch (about two
    minutes per op on a fresh machine); as lrdsl's own kernels, they compile on a thread pool first.
    What they time and choose is unchanged. LRDSL_COMPILE_THREADS=0 leaves them alone."""
    from lrdsl.runtime import tuning
    if tuning.enabled():
        tuning.compile_loaded_autotuners("fla")


def _unit(x):
    return F.normalize(x.float(), dim=-1).to(x.dtype)


PRENORMALISED = "<q, k normalised>"  # a key no input name can be: twin() sets it for the args' functions


def _dplr_args(x: dict) -> dict:
    """chunk_dplr_delta_rule's arguments for kda_decay_after_erase's inputs (see TWINS)."""
    unit = (lambda t: t) if x.get(PRENORMALISED) else _unit
    q, k, beta, g = unit(x["q"]), unit(x["k"]), x["beta"].float()[..., None], x["g"].float()
    return dict(q=q, k=k, v=(x["v"] * beta).to(x["v"].dtype), a=k, b=(-beta * g.exp() * k).to(k.dtype), gk=g)


# example name -> (FLA op, how it reads the inputs)
TWINS = {
    "linear_attention": ("linear_attn.chunk_linear_attn", lambda x: dict(q=x["q"], k=x["k"], v=x["v"], normalize=False)),
    "retnet": ("retention.chunk_retention", lambda x: dict(q=x["q"], k=x["k"], v=x["v"])),
    "mamba2": ("simple_gla.chunk_simple_gla", lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"])),
    "gla": ("gla.chunk_gla", lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"])),
    "deltanet": ("delta_rule.chunk_delta_rule",
                 lambda x: dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], use_qk_l2norm_in_kernel=True)),
    "gated_deltanet": ("gated_delta_rule.chunk_gated_delta_rule",
                       lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                      use_qk_l2norm_in_kernel=True)),
    "kda": ("kda.chunk_kda", lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                            use_qk_l2norm_in_kernel=True)),
    "gdn2": ("gdn2.chunk_gdn2", lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], b=x["b"], w=x["w"],
                                               use_qk_l2norm_in_kernel=True)),
    "precond_deltanet": ("precond_gated_delta_rule.chunk_precond_gated_delta_rule",
                         lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g_atk=x["g_atk"], g=x["g"],
                                        beta_atk=x["beta_atk"], beta=x["beta"], use_qk_l2norm_in_kernel=True)),
    "precond_kda": ("precond_kda.chunk_precond_kda",
                    lambda x: dict(q=_unit(x["q"]), k=_unit(x["k"]), v=x["v"], g=x["g"], g_atk=x["g_atk"],
                                   beta_atk=x["beta_atk"], beta=x["beta"])),
}
TWINS["gated_deltanet_negeig"] = TWINS["gated_deltanet"]
# Mesa: FLA takes unit q, k, 30 CG steps (ours by default) and one lamb per head and key channel
# ([H, K]: the first token's here; the times do not depend on its values)
TWINS["mesa"] = ("mesa_net.chunk_mesa_net", lambda x: dict(
    q=_unit(x["q"]), k=_unit(x["k"]), v=x["v"], g=x["g"], beta=x["beta"],
    lamb=(x["lamb"][0, 0] if "lamb" in x else 0.25 + F.softplus(x["lamb_raw"][0, 0].float())).float()))
# novel examples: the closest FLA op
TWINS["channel_gates_scalar_decay"] = ("gdn2.chunk_gdn2", lambda x: dict(
    q=x["q"], k=x["k"], v=x["v"], g=x["g"][..., None].expand_as(x["k"]).contiguous().float(), b=x["b"], w=x["w"],
    use_qk_l2norm_in_kernel=True))
# FLA's gates from params: FLA's layer computes g and beta in PyTorch before its op, so they are
# inside the timed call here; lrdsl evaluates them inside its kernels
TWINS["gated_deltanet_gates"] = ("gated_delta_rule.chunk_gated_delta_rule", lambda x: dict(
    q=x["q"], k=x["k"], v=x["v"], g=-x["A_log"].exp() * F.softplus(x["a"].float() + x["dt_bias"]),
    beta=torch.sigmoid(x["b"]), use_qk_l2norm_in_kernel=True))
TWINS["gdn2_atk"] = TWINS["gdn2"]
# A decay per key channel after the erase, D (I - beta k k^T) S + beta k v^T = (D + b a^T) S + k' v'^T
# with a = k, b = -beta exp(g) k: FLA's generalized (diagonal plus low rank) delta rule computes this
# very transition (kda's erases before its decay, a different one). FLA has no in-kernel l2 norm
# there: q, k are normalised, and b, beta v made, inside the timed call (as a user of FLA would)
TWINS["kda_decay_after_erase"] = ("generalized_delta_rule.chunk_dplr_delta_rule", _dplr_args)
TWINS["mesa_retention"] = TWINS["mesa"]  # FLA's gated Mesa (fresh g), lamb from lamb_raw

# The RWKV side. lrdsl's scale (K^-0.5 by default) is passed on: chunk_rwkv7 would take 1.0. FLA's
# generalized delta rule is S = (D + b a^T) S + k v^T: a reads the state, b writes (its naive loop
# adds b (a^T S)); where the spec normalises a direction inside, FLA gets it normalised in the call.


def _scale(x: dict) -> float:
    return x["q"].shape[-1] ** -0.5


def _l2norm(x):
    """x rsqrt(|x|^2 + 1e-6): the spec's l2norm, and FLA's own l2norm_fwd (F.normalize differs by
    1e-6 / |x|^2 relative, visible at tiny K)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _rwkv6_args(x: dict) -> dict:
    """chunk_rwkv6: o = S_prev^T (scale q) + (scale q)^T (u*k) v, w the log-decay, u [H, K]."""
    return dict(r=x["q"], k=x["k"], v=x["v"], w=x["w"], u=x["u"], scale=_scale(x))


def _rwkv7_args(x: dict) -> dict:
    """chunk_rwkv7 as RWKV-7 calls it: diag(exp(w)) - (a*kk) kk^T is D + b a^T with a = -kk, b = kk*a."""
    kk = _l2norm(x["kk"])
    return dict(r=x["q"], w=x["w"], k=x["k"], v=x["v"], a=-kk,
                b=(kk.float() * x["a"].float()).to(kk.dtype), scale=_scale(x))


def _gated_b(x: dict):
    """beta*b with b normalised: the write direction of examples/dplr.lr."""
    b = _l2norm(x["b"])
    return (b.float() * x["beta"].float()[..., None]).to(b.dtype)


TWINS["rwkv6"] = ("rwkv6.chunk_rwkv6", _rwkv6_args)
TWINS["rwkv7"] = ("rwkv7.chunk_rwkv7", _rwkv7_args)
TWINS["dplr"] = ("generalized_delta_rule.chunk_dplr_delta_rule", lambda x: dict(
    q=x["q"], k=x["k"], v=x["v"], a=_l2norm(x["a"]), b=_gated_b(x), gk=x["gk"], scale=_scale(x)))
TWINS["iplr"] = ("generalized_delta_rule.chunk_iplr_delta_rule", lambda x: {
    ("q" if n == "r" else n): t for n, t in _rwkv7_args(dict(x, w=None)).items() if n != "w"})


def _comba_args(x: dict) -> dict:
    """chunk_comba's arguments for examples/comba.lr's inputs (see TWINS)."""
    unit = (lambda t: t) if x.get(PRENORMALISED) else _l2norm
    p = (unit(x["p"]).float() * x["g"].float().exp()[..., None]).to(x["p"].dtype)
    return dict(q=unit(x["q"]), k=unit(x["k"]), v=x["v"], p=p, g=x["g"], beta=x["beta"], scale=_scale(x),
                use_qk_l2norm_in_kernel=False)


# Comba, (I - beta k p^T) exp(g) S + beta k v^T: FLA's kernels (fla-core 0.6.0 chunk_comba and
# fused_recurrent_comba, and its naive_chunk_comba) read p against the state before the token's
# decay, (exp(g) I - beta k p^T) S + beta k v^T (only its naive_recurrent_comba decays first), so
# FLA gets p exp(g); its in-kernel norm would undo that scaling: q, k and p are normalised outside
TWINS["comba"] = ("comba.chunk_comba", _comba_args)


def _oja_args(x: dict) -> dict:
    """chunk_gated_oja_rule's arguments for examples/oja.lr's inputs (see TWINS)."""
    group = x["v"].shape[2] // x["q"].shape[2]
    q, k = (t.repeat_interleave(group, 2) if group > 1 else t for t in (x["q"], x["k"]))
    return dict(q=q, k=k, v=_l2norm(x["v"]), gv=x["gv"], beta=x["beta"], scale=_scale(x))


# The gated Oja rule, the value side: S diag(exp(gv)) (I - beta v v^T) + beta k v^T is FLA's
# recurrence (the state decayed per value channel, then k - S v, times beta, written along v); FLA
# does not normalise v, so it gets the spec's unit v in the call. Its chunk op (fla-core 0.6.0) gives
# o q's heads and groups q heads over k's, not value heads over q and k: those are repeated to HV
TWINS["oja"] = ("gated_oja_rule.chunk_gated_oja_rule", _oja_args)


def _steps(x: dict, names: tuple):
    """[B, T, ...] tensors of one token's steps -> [B, n T, ...], step j at n t + j: FLA's layout."""
    xs = [x[n] for n in names]
    return torch.stack(xs, 2).reshape(xs[0].shape[0], len(xs) * xs[0].shape[1], *xs[0].shape[2:])


def _delta_product_args(n: int):
    """chunk_gated_delta_product for examples/delta_product<n>.lr: the keys, values and gains of the
    n steps interleaved, the log-decay once per token; its in-kernel norm normalises q and every key."""
    keys, values, gains = ("k", "k2", "k3")[:n], ("v", "v2", "v3")[:n], ("b1", "b2", "b3")[:n]
    return lambda x: dict(q=x["q"], k=_steps(x, keys), v=_steps(x, values), g=x["g"], beta=_steps(x, gains),
                          num_householder=n, scale=_scale(x), use_qk_l2norm_in_kernel=True)


# DeltaProduct: n steps (I - b_j k_j k_j^T) S + b_j k_j v_j^T per token, the decay before the first
TWINS["delta_product2"] = ("gated_delta_product.chunk_gated_delta_product", _delta_product_args(2))
TWINS["delta_product3"] = ("gated_delta_product.chunk_gated_delta_product", _delta_product_args(3))


def twin(mixer):
    """(FLA op name, a function of the inputs giving its output) or None."""
    if mixer.name in TWINS:
        name, args = TWINS[mixer.name]
    elif mixer.ir.side == "right":  # a value-side spec other than oja: no FLA op of its shape
        return None
    else:  # same canonical shape; fresh gates where the spec has none of FLA's names
        m, s = mixer.ir, {"identity": "none", "constant": "scalar", "scalar": "scalar", "diagonal": "channel"}
        key = ("delta" if m.delta else "plain", s[m.decay.kind])
        name, args = {
            ("plain", "none"): TWINS["linear_attention"], ("plain", "scalar"): TWINS["mamba2"],
            ("plain", "channel"): TWINS["gla"], ("delta", "none"): TWINS["deltanet"],
            ("delta", "scalar"): TWINS["gated_deltanet"], ("delta", "channel"): TWINS["kda"]}[key]
    try:
        op = _fla(name)
    except Exception:  # fla-core not installed, or an older one without this op
        return None
    name += fla_backend(name)

    fresh = {}  # gates the spec lacks, drawn at the first call: not in the timed ones after it

    def run(x, prenormalised=False):
        full = dict(x, **{PRENORMALISED: prenormalised})
        q = x["q"]
        for n in ("g", "beta"):
            if n not in full:
                key = (n, tuple(q.shape[:3]), q.device)
                if key not in fresh:
                    fresh[key] = (torch.rand(q.shape[:3], device=q.device) if n == "beta" else
                                  F.logsigmoid(torch.randn(q.shape[:3], device=q.device) + 3))
                full[n] = fresh[key]
        if name.startswith(("kda", "gla")) and full["g"].dim() == 3:
            full["g"] = full["g"][..., None].expand_as(q).contiguous()
        kw = args(full)
        if prenormalised and "use_qk_l2norm_in_kernel" in kw:
            kw["use_qk_l2norm_in_kernel"] = False
        return op(**kw)[0]
    return name, run


# FLA ops that fla-core hands to another library where it imports and its switch is not "0"
# (fla-core 0.6's backend registry): the op's label says so, for a column marked FLA that is not
# FLA's own Triton kernels
FLA_BACKENDS = {"gated_delta_rule.chunk_gated_delta_rule": ("flash_qla", "FLA_FLASH_QLA", "FlashQLA")}


def fla_backend(name: str) -> str:
    """A note for op `name`'s label where FLA would hand it to another library here (FlashQLA), else ""."""
    if name not in FLA_BACKENDS:
        return ""
    package, switch, label = FLA_BACKENDS[name]
    if os.environ.get(switch, "1") == "0" or importlib.util.find_spec(package) is None:
        return ""
    return f" ({label} via FLA; {switch}=0 for FLA's Triton kernels)"


def nominal_flop(mixer, s: Shape, bt: int = 64) -> float:
    """Forward FLOP of the chunked algorithm (lrdsl/roofline.py's count)."""
    from lrdsl.roofline import flop
    return flop(mixer, s, bt=bt)


def kernel_times(step, reps: int = 5, between=lambda: None) -> list:
    """(kernel name, GPU ms per step, launches per step) of every kernel one step() launches, under
    torch.profiler (the same sum as gpu_ms, kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            step()
            between()
        torch.cuda.synchronize()
    return [(e.key, e.self_device_time_total / reps / 1000.0, e.count / reps)
            for e in p.key_averages() if e.self_device_time_total > 0]


def gpu_ms(step, reps: int = 5, between=lambda: None) -> float:
    """Summed device time of the kernels one step() launches (ms), averaged over reps steps."""
    return sum(ms for _, ms, _ in kernel_times(step, reps, between))


def measure(f, x: dict, s: Shape, backward: bool, per_kernel: bool = False) -> dict:
    """Median ms of f(x) (and of forward + backward) and the peak memory above the inputs; with
    per_kernel also kernel_times' rows of the forward ("fwd_kernels") and forward + backward."""
    from triton.testing import do_bench
    out = {}
    with torch.no_grad():
        f(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        f(x)
        torch.cuda.synchronize()
        out["fwd_mem"] = torch.cuda.max_memory_allocated() - base
        out["fwd_ms"] = do_bench(lambda: f(x), warmup=25, rep=100, return_mode="median")
        out["fwd_gpu_ms"] = gpu_ms(lambda: f(x))
        if per_kernel:
            out["fwd_kernels"] = kernel_times(lambda: f(x))
    if backward:
        leaves = [t.requires_grad_() for t in x.values() if t.is_floating_point()]
        do = torch.randn_like(f(x))

        def step():
            f(x).backward(do)
        step()
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = f(x)  # what the forward leaves for the backward (its output included)
        torch.cuda.synchronize()
        out["held_mem"] = torch.cuda.memory_allocated() - base
        y.backward(do)
        del y
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        out["bwd_mem"] = torch.cuda.max_memory_allocated() - base
        out["both_ms"] = do_bench(step, warmup=10, rep=50, return_mode="median", grad_to_none=leaves)

        def clear():  # else the next step accumulates into .grad: an add kernel the call does not run
            for t in leaves:
                t.grad = None
        clear()
        out["both_gpu_ms"] = gpu_ms(step, between=clear)
        if per_kernel:
            out["both_kernels"] = kernel_times(step, between=clear)
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
    return out


def bench(mixer, s: Shape, backward: bool = False, with_twin: bool = True, log=print,
          per_kernel: bool = False) -> dict:
    """One row: lrdsl's figures and, when fla-core is importable, its twin's."""
    from lrdsl import roofline
    x = draw(mixer, s)
    row = {"mixer": mixer.name, "shape": s, "flop": roofline.flop(mixer, s), "bytes": roofline.nbytes(mixer, s),
           "flop_both": roofline.flop(mixer, s, True), "bytes_both": roofline.nbytes(mixer, s, True)}
    row["lrdsl"] = measure(lambda x: mixer.chunk(**x)[0], x, s, backward, per_kernel)
    log(f"  {mixer.name}: lrdsl {row['lrdsl']}")
    tw = twin(mixer) if with_twin else None
    if tw is not None:
        row["twin"] = tw[0]
        try:
            _fla_compiles_at_once()
            row["fla"] = measure(tw[1], x, s, backward)
            log(f"  {mixer.name}: fla {tw[0]} {row['fla']}")
            if _prenormalisable(mixer):
                # FLA's separate l2-norm launches can cost more than the op: the anchor is the faster
                # of FLA with its in-kernel norm and FLA on q, k normalised outside the timed call
                # (and every other input the spec normalises: comba's p, which FLA's norm takes too)
                xn = dict(x, **{i.name: _unit(x[i.name]) for i in mixer.ir.inputs if i.l2norm})
                pre = measure(lambda x: tw[1](x, prenormalised=True), xn, s, backward)
                log(f"  {mixer.name}: fla {tw[0]} on pre-normalised q, k {pre}")
                for key in ("fwd_ms", "both_ms", "fwd_gpu_ms", "both_gpu_ms"):
                    if key in pre and pre[key] < row["fla"][key]:
                        row["fla"][key] = pre[key]
                        row["fla"]["pre_" + key] = True
        except Exception as e:  # report and go on: one op's failure must not hide the others
            row["fla_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            log(f"  {mixer.name}: fla failed: {row['fla_error']}")
    return row


def _prenormalisable(mixer) -> bool:
    names = {i.name: i for i in mixer.ir.inputs}
    return all(n in names and names[n].l2norm for n in ("q", "k"))


_HEAD = ("| mixer | shape | lrdsl fwd ms (GPU) | FLA fwd ms (GPU) | FLA/lrdsl fwd (GPU) | lrdsl TFLOP/s (GPU) "
         "| lrdsl f+b ms (GPU) | FLA f+b ms (GPU) | FLA/lrdsl f+b (GPU) | lrdsl / FLA f+b extra GiB | FLA op "
         "| fwd TFLOP/s | fwd GB/s | fwd % bf16 peak | fwd % bandwidth "
         "| f+b TFLOP/s | f+b GB/s | f+b % bf16 peak | f+b % bandwidth |")


def table_head() -> str:
    """The bench table's header: wall clock (ms) and, in brackets, GPU time (ms). A * marks an FLA
    time taken on q, k normalised outside the call. The last eight columns are lrdsl's roofline on
    GPU time (lrdsl/roofline.py: nominal FLOPs and bytes; percentages of the peak that table_row
    is given)."""
    return _HEAD + "\n|" + "---|" * (_HEAD.count("|") - 1)


def table_row(r: dict, peak=None) -> str:
    """One bench row of the markdown table; peak: a roofline.Peak (None: no percentages)."""
    from lrdsl import roofline
    gib = 2.0 ** 30
    s, ll, ff = r["shape"], r["lrdsl"], r.get("fla", {})

    def ms(d, k):
        if k not in d:
            return "-"
        return f"{d[k]:.3f} ({d[k[:-3] + '_gpu_ms']:.3f})" if k[:-3] + "_gpu_ms" in d else f"{d[k]:.3f}"

    def one(k):
        return f"{ff[k] / ll[k]:.2f}{'*' if ff.get('pre_' + k) else ''}" if k in ff and k in ll else "-"

    def ratio(k):
        g = k[:-3] + "_gpu_ms"
        return f"{one(k)} ({one(g)})" if g in ll else one(k)
    mem = (f"{ll['bwd_mem'] / gib:.2f} / {ff['bwd_mem'] / gib:.2f}" if "bwd_mem" in ll and "bwd_mem" in ff
           else (f"{ll['bwd_mem'] / gib:.2f} / -" if "bwd_mem" in ll else "-"))
    tflops = f"{r['flop'] / (ll['fwd_ms'] * 1e-3) / 1e12:.0f}"
    if "fwd_gpu_ms" in ll:
        tflops += f" ({r['flop'] / (ll['fwd_gpu_ms'] * 1e-3) / 1e12:.0f})"
    roof = []
    for key, f_key, b_key in (("fwd_gpu_ms", "flop", "bytes"), ("both_gpu_ms", "flop_both", "bytes_both")):
        if key in ll and f_key in r:
            roof += roofline.cells(roofline.rates(r[f_key], r[b_key], ll[key], peak))
        else:
            roof += ["-"] * 4
    return (f"| {r['mixer']} | {s.B},{s.T},{s.H},{s.K},{s.V} | {ms(ll, 'fwd_ms')} | {ms(ff, 'fwd_ms')} | "
            f"{ratio('fwd_ms')} | {tflops} | {ms(ll, 'both_ms')} | {ms(ff, 'both_ms')} | "
            f"{ratio('both_ms')} | {mem} | {r.get('twin', '-')} | " + " | ".join(roof) + " |")


def kernel_tables(r: dict, counts: dict | None = None, peak=None) -> str:
    """lrdsl's per-kernel tables of one row (measure(..., per_kernel=True)): each kernel's GPU time
    and share of the call's, forward and forward + backward; with counts (census.of's) each
    kernel's roofline too."""
    from lrdsl import roofline
    out = []
    for key, what in (("fwd", "forward"), ("both", "forward + backward")):
        if key + "_kernels" in r["lrdsl"]:
            c = None if counts is None else counts.get(key)
            out.append(f"{r['mixer']} {what}, per kernel (GPU time per call"
                       + ("; FLOPs and bytes counted by lrdsl.census):" if c is not None else "):"))
            kernels = r["lrdsl"][key + "_kernels"]  # shares of their own sum: one profiled run
            out.append(roofline.kernel_table(kernels, sum(k[1] for k in kernels), _by_kernel_name(kernels, c), peak))
    return "\n".join(out)


def _by_kernel_name(kernels: list, counts: dict | None) -> dict | None:
    """The census' counts under the names the profiler gave the kernels (the same function names;
    one without its "_kernel" suffix also matches)."""
    if counts is None:
        return None
    return {k[0]: counts.get(k[0], counts.get(k[0] + "_kernel")) for k in kernels
            if k[0] in counts or k[0] + "_kernel" in counts}


# ---- decode: one token per sequence through step, inside a CUDA graph ----------------------------
DECODE_BATCHES = (1, 8, 64, 256)
VERIFY_T = 4  # tokens of the verification step decode_row also times
# example name -> (FLA's fused recurrent op, its arguments from the inputs); each gets the state as
# initial_state and returns the new one (output_final_state=True), as a decoder calls it
_QKV = ("q", "k", "v")
DECODE_TWINS = {
    "gated_deltanet": ("gated_delta_rule.fused_recurrent_gated_delta_rule", lambda x: dict(
        **{n: x[n] for n in _QKV}, g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)),
    "kda": ("kda.fused_recurrent_kda", lambda x: dict(
        **{n: x[n] for n in _QKV}, g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)),
    "deltanet": ("delta_rule.fused_recurrent_delta_rule", lambda x: dict(
        **{n: x[n] for n in _QKV}, beta=x["beta"], use_qk_l2norm_in_kernel=True)),
    "gla": ("gla.fused_recurrent_gla", lambda x: dict(**{n: x[n] for n in _QKV}, gk=x["g"])),
    "mamba2": ("simple_gla.fused_recurrent_simple_gla", lambda x: dict(**{n: x[n] for n in _QKV}, g=x["g"])),
    "retnet": ("retention.fused_recurrent_retention", lambda x: {n: x[n] for n in _QKV}),
    "linear_attention": ("linear_attn.fused_recurrent_linear_attn", lambda x: {n: x[n] for n in _QKV}),
}
DECODE_TWINS["gated_deltanet_negeig"] = DECODE_TWINS["gated_deltanet"]


def capture(f, warmup: int = 3):
    """f captured in a CUDA graph (after warm-up launches on a side stream: compilation, tuning);
    returns the graph and what the captured call returned (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    return graph, out


def graphed(f, warmup: int = 3):
    """The replay of f captured in a CUDA graph (capture)."""
    return capture(f, warmup)[0].replay


def decode_row(mixer, B: int, H: int = 16, K: int = 128, V: int = 128, with_twin: bool = True,
               device: str = "cuda") -> dict:
    """ms per decoded token (one step of B sequences at T = 1, bf16 inputs, the fp32 state updated in
    place, o into a buffer) of lrdsl's step and of FLA's fused recurrent twin: do_bench's median of a
    CUDA graph's replay, and of the eager call (wall clock, host time included)."""
    from triton.testing import do_bench
    s = Shape(B, 1, H, K, V)
    x = draw(mixer, s, device=device, seed=B)
    row = {"mixer": mixer.name, "B": B, "H": H, "K": K, "V": V}
    state = mixer.zero_state(B, H, K, V, device=device)
    out = torch.empty(B, 1, H, V, dtype=x["v"].dtype, device=device)
    with torch.no_grad():
        def step():
            mixer.step(**x, state=state, out=out)
        row["lrdsl_eager_ms"] = do_bench(step, warmup=25, rep=100, return_mode="median")
        row["lrdsl_ms"] = do_bench(graphed(step), warmup=25, rep=100, return_mode="median")
        # speculative decoding's verification: VERIFY_T tokens keeping every state, then a rollback
        # of each sequence to half of them
        xv = draw(mixer, Shape(B, VERIFY_T, H, K, V), device=device, seed=B + 1)
        out_v = torch.empty(B, VERIFY_T, H, V, dtype=x["v"].dtype, device=device)
        keep = torch.full((B,), VERIFY_T // 2, dtype=torch.int64, device=device)

        def verify():
            _, every = mixer.step(**xv, state=state, out=out_v, return_states=True)
            mixer.accept(state, every, keep)
        row["lrdsl_verify_ms"] = do_bench(graphed(verify), warmup=25, rep=100, return_mode="median")
        if with_twin and mixer.name in DECODE_TWINS:
            name, args = DECODE_TWINS[mixer.name]
            row["twin"] = name
            try:
                op, h = _fla(name), torch.zeros(B, H, K, V, dtype=torch.float32, device=device)

                def fla_step():
                    op(**args(x), initial_state=h, output_final_state=True)
                row["fla_eager_ms"] = do_bench(fla_step, warmup=25, rep=100, return_mode="median")
                row["fla_ms"] = do_bench(graphed(fla_step), warmup=25, rep=100, return_mode="median")
            except Exception as e:  # report and go on
                row["fla_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return row


_DECODE_HEAD = ("| mixer | B | H,K,V | lrdsl us/token (graph) | FLA us/token (graph) | FLA/lrdsl (graph) "
                "| lrdsl us (eager) | FLA us (eager) | lrdsl T=4 verify + accept us (graph) | FLA op |")


def decode_table_head() -> str:
    """The decode table's header: microseconds per step of B sequences at T = 1; a ratio above 1 is
    lrdsl faster."""
    return _DECODE_HEAD + "\n|" + "---|" * (_DECODE_HEAD.count("|") - 1)


def decode_table_row(r: dict) -> str:
    def us(k):
        return f"{r[k] * 1e3:.1f}" if k in r else "-"
    ratio = f"{r['fla_ms'] / r['lrdsl_ms']:.2f}" if "fla_ms" in r else "-"
    return (f"| {r['mixer']} | {r['B']} | {r['H']},{r['K']},{r['V']} | {us('lrdsl_ms')} | {us('fla_ms')} | {ratio} "
            f"| {us('lrdsl_eager_ms')} | {us('fla_eager_ms')} | {us('lrdsl_verify_ms')} | {r.get('twin', '-')}"
            + (f" ({r['fla_error']})" if "fla_error" in r else "") + " |")
