"""Context parallelism (mixer.chunk(..., cp_group=group)) on CPU: world sizes 2 and 4, spawned
processes talking over gloo, kernels in Triton's interpreter.

Each rank holds a contiguous slice of the tokens (a batch, or packed sequences some of which straddle
ranks, one over three ranks, with empty ones at and beside rank boundaries). The parent runs the
single-process chunk and the float64 reference over the whole sequence; it compares the ranks'
outputs, the final states of the sequences that end on each rank, and the gradients of
loss = (o * do).sum() + sum over the parts of the final state of (part * weight).sum()
with respect to every input, param and part of the initial state (the ranks' gradients of the
initial state and params summed, as any replicated tensor's) with both: rms ratio < 1e-4 for o, the
state and dq, dk, dv, dh0, < 1e-3 for the other inputs (tests/test_backward.py's tolerances).
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from specgen import kernel_examples

import lrdsl
from lrdsl.errors import InputError
from lrdsl.frontend import spec_to_ir
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

# a value-side spec (oja) refuses cp_group (tests/test_oja.py checks that it does)
EXAMPLES = {p.stem: p for p in kernel_examples() if spec_to_ir(p.read_text()).side == "left"}
ROOT = Path(__file__).resolve().parent.parent
FALLBACK = "cp_fallback_test_only"  # its write's value does not vanish with v (lrdsl.runtime.cp.widens)
SPECS = {**EXAMPLES, FALLBACK: ROOT / "tests" / "specs" / f"{FALLBACK}.lr"}
TOL_GATE = 1e-3


@dataclass(frozen=True)
class Split:
    """A case split over ranks: the global Case and each rank's number of tokens."""
    case: Case
    lengths: tuple


SPLITS = {
    "w2-varlen": Split(Case(B=1, T=105, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 30, 75, 75, 105),
                            initial_state=True, seed=11), (55, 50)),
    "w2-batched": Split(Case(B=2, T=97, H=1, HV=2, K=16, V=16, initial_state=True, seed=12), (45, 52)),
    "w2-varlen-boundary": Split(Case(B=1, T=105, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 55, 55, 105),
                                     initial_state=True, seed=13), (55, 50)),
    "w2-batched-K16-V8": Split(Case(B=1, T=90, H=1, HV=1, K=16, V=8, initial_state=True, seed=14), (41, 49)),
    "w4-varlen": Split(Case(B=1, T=190, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 140, 140, 160, 190),
                            initial_state=True, seed=15), (45, 50, 40, 55)),
    "w4-batched": Split(Case(B=2, T=186, H=1, HV=2, K=16, V=16, initial_state=True, seed=16), (41, 47, 48, 50)),
}
DEFAULT = ("gated_deltanet", "w2-varlen")


# ---- one call's inputs, loss and gradients (the same function in the parent and in each rank) ------
def inputs(mixer, case: Case):
    """(x, initial state, cu_seqlens): drawn from the case's seed; a whole initial state (with random
    non-negative auxiliary states) for a mixer with auxiliary states."""
    x, opts = draw_inputs(mixer, case)
    for i in mixer.ir.inputs:  # weak decays: a rank's map L must not vanish over its ~50 tokens
        if i.log:
            x[i.name] = x[i.name] * 0.02
    if "A_log" in x:
        x["A_log"] = x["A_log"] - 4.0
    h0 = opts["initial_state"]
    if mixer.ir.aux:
        g = torch.Generator().manual_seed(case.seed + 100)
        h0 = lrdsl.MixerState(h0, {a.name: torch.rand(case.N, case.HV, case.K if a.kind == "K" else case.V,
                                                         generator=g) for a in mixer.ir.aux})
    return x, h0, opts["cu_seqlens"]


def parts(state) -> dict:
    return {"S": state.S, **state.aux} if isinstance(state, lrdsl.MixerState) else {"S": state}


def weights(case: Case, o_shape, state) -> tuple:
    """Upstream gradients: of o and of each part of the final state (global shapes)."""
    g = torch.Generator().manual_seed(case.seed + 200)
    do = torch.randn(o_shape, generator=g)
    return do, {n: torch.randn(t.shape, generator=g) for n, t in sorted(parts(state).items())}


def leaves_of(x, h0, dtype, device="cpu"):
    leaves = {n: t.detach().to(device, dtype).requires_grad_() for n, t in x.items()}
    if isinstance(h0, lrdsl.MixerState):
        S = h0.S.detach().to(device, dtype).requires_grad_()
        aux = {n: t.detach().to(device, dtype).requires_grad_() for n, t in h0.aux.items()}
        leaves.update({"h0." + n: t for n, t in aux.items()}, **{"h0.S": S})
        return leaves, lrdsl.MixerState(S, aux)
    leaves["h0.S"] = h0.detach().to(device, dtype).requires_grad_()
    return leaves, leaves["h0.S"]


def whole(fn, mixer, case, x, h0, cu, dtype, device="cpu"):
    """o, final parts and gradients of the single-process call fn (chunk or reference)."""
    leaves, init = leaves_of(x, h0, dtype, device)
    cu = None if cu is None else cu.to(device)
    o, fin = fn(**{n: leaves[n] for n in x}, initial_state=init, cu_seqlens=cu, output_final_state=True)
    do, dfin = weights(case, o.shape, fin)
    loss = (o * do.to(device, dtype)).sum() + sum((parts(fin)[n] * w.to(device, dtype)).sum()
                                                  for n, w in dfin.items())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    return cpu(o), {n: cpu(t) for n, t in parts(fin).items()}, {n: cpu(g) for n, g in zip(leaves, grads)}


def worker(rank, world, jobs, out_dir, backend="gloo"):
    """One rank: every job (spec, split) in turn in one process group, each result to out_dir/j.rank.pt."""
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    if os.environ.get("TRITON_INTERPRET") == "1":
        import interpreter_calls
        import interpreter_scan
        interpreter_scan.install()
        interpreter_calls.install()
    import datetime

    import torch.distributed as dist
    # a file store in out_dir: no port to pick (a free port picked beforehand can be taken meanwhile)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for j, (spec, split) in enumerate(jobs):
            torch.save(job(rank, world, spec, split, device), os.path.join(out_dir, f"{j}.{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown():
    """A rank's process ends here once its results are saved (an exception before this still reaches
    mp.spawn): gloo's threads can abort a process during the interpreter's teardown ("terminate
    called without an active exception"; one run in eight of the disagreement test on 2026-12-07,
    and benchmarks/cp_scaling.py's ranks in CI before), which mp.spawn reports as a failed rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def job(rank, world, spec, split: Split, device) -> dict:
    """This rank's o, final states of the sequences ending on it, gradients and local chunk calls."""
    import torch.distributed as dist

    from lrdsl.runtime.cp import pieces
    case = split.case
    mixer = lrdsl.compile(spec, check_stability=False)  # the parent checked it
    # a product of steps makes its calls on its sub-mixer (n sub-tokens per token)
    local = mixer.product or mixer
    calls, plain = [], local.chunk

    def counted(*a, cp_group=None, **kw):  # the local chunk calls that cp makes: [batch, T, V]
        if cp_group is None:
            calls.append(list(kw["v"].shape[:2]) + [kw["v"].shape[-1]])
        return plain(*a, cp_group=cp_group, **kw)
    local.chunk = counted
    x, h0, cu = inputs(mixer, case)
    t0 = sum(split.lengths[:rank])
    t1 = t0 + split.lengths[rank]
    per_token = {"q", "k", "v", *mixer.inputs}
    leaves, init = leaves_of(x, h0, torch.float32, device)
    cu = None if cu is None else cu.to(device)
    local = {n: (leaves[n][:, t0:t1] if n in per_token else leaves[n]) for n in x}
    o, fin = mixer.chunk(**local, initial_state=init, cu_seqlens=cu, output_final_state=True,
                         cp_group=dist.group.WORLD)
    me = pieces(None if cu is None else cu.tolist(), case.B, list(split.lengths))[rank]
    # the rows of the sequences whose last token is on this rank (a batch: all, on the last rank)
    if cu is None:
        ending = list(range(case.B)) if rank == world - 1 else []
    else:
        c = cu.tolist()
        ending = [j for j in range(me.first, me.last + 1) if c[j + 1] <= t1]
    do, dfin = weights(case, (case.B, case.T, case.HV, case.V), h0 if h0 is not None else fin)
    loss = (o * do[:, t0:t1].to(device)).sum()
    for n, w in dfin.items():
        rows = [j - me.first for j in ending]
        loss = loss + (parts(fin)[n][rows] * w[ending].to(device)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    g = {n: (t[:, t0:t1] if n in per_token else t).cpu() for n, t in zip(leaves, grads)}
    return {"o": o.detach().cpu(), "ending": ending,
            "fin": {n: t.detach()[[j - me.first for j in ending]].cpu() for n, t in parts(fin).items()},
            "grads": g, "calls": calls}


def run_cp(jobs: list, backend="gloo") -> list:
    """Every job (spec, split), all splits over the same number of ranks, in one spawn of the ranks
    (their start-up, imports and process group once): for each job, the results of every rank."""
    import torch.multiprocessing as mp
    world = len(jobs[0][1].lengths)
    assert all(len(s.lengths) == world for _, s in jobs)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, [(str(p), s) for p, s in jobs], d, backend),
                 nprocs=world, join=True)
        return [[torch.load(os.path.join(d, f"{j}.{r}.pt")) for r in range(world)] for j in range(len(jobs))]


def check(name, split, compiled, backend="gloo", ranks=None):
    """The ranks' results (run here unless given) against the single-process chunk and the reference."""
    spec, case = SPECS[name], split.case
    mixer = compiled(spec)
    x, h0, cu = inputs(mixer, case)
    dev = "cuda" if backend == "nccl" else "cpu"  # the reference's token loop too: ~10x faster there
    single = whole(mixer.chunk, mixer, case, x, h0, cu, torch.float32, dev)
    ref = whole(mixer.reference, mixer, case, x, h0, cu, torch.float64, dev)
    ranks = run_cp([(spec, split)], backend)[0] if ranks is None else ranks
    per_token = {"q", "k", "v", *mixer.inputs}
    o = torch.cat([r["o"] for r in ranks], 1)
    fin = {n: torch.zeros_like(t) for n, t in single[1].items()}
    seen = []
    for r in ranks:
        seen += r["ending"]
        for n, t in r["fin"].items():
            fin[n][r["ending"]] = t
    assert sorted(seen) == list(range(case.N)), f"every sequence ends on one rank: {seen}"
    check_calls(mixer, split, [r["calls"] for r in ranks])
    grads = {n: (torch.cat([r["grads"][n] for r in ranks], 1) if n in per_token
                 else sum(r["grads"][n] for r in ranks)) for n in single[2]}
    errors = {}
    for what, (o_b, fin_b, g_b) in (("chunk", single), ("reference", ref)):
        errors[what, "o"] = rms_ratio(o, o_b)
        errors.update({(what, n): rms_ratio(t, fin_b[n]) for n, t in fin.items()})
        errors.update({(what, "d" + n): rms_ratio(t, g_b[n]) for n, t in grads.items()})
    # the interpreter's fp32 products are exact: test_backward's tolerances; a GPU's are tf32:
    # test_gpu's (o and states 5e-3, dq, dk, dv and dh0 8e-3, the other inputs 2e-2)
    tight, mid, loose = (TOL, TOL, TOL_GATE) if backend == "gloo" else (5e-3, 8e-3, 2e-2)
    tol = {k: (tight if k[1] == "o" or k[1] in fin else mid if k[1] in ("dq", "dk", "dv") or
               k[1].startswith("dh0") else loose) for k in errors}
    bad = {k: f"{e:.3g}" for k, e in errors.items() if not e < tol[k]}
    assert not bad, f"{name} {split}: {bad}"


def check_calls(mixer, split, calls):
    """Each rank runs its tokens once: its head (the sequence continuing from the left, with K more
    value columns that carry its map where lrdsl.runtime.cp.widens) and the rest; a rank whose state is
    carried on runs one more call for the auxiliary maps (two starts, one value channel) and, where
    the head does not widen, one for the state's maps (batched starts)."""
    from lrdsl.runtime.cp import pieces, widens
    mixer = mixer.product or mixer  # a product's calls are its sub-mixer's
    case = split.case
    every = pieces(None if case.cu_seqlens is None else list(case.cu_seqlens), case.B, list(split.lengths))
    for r, p in enumerate(every):
        through = p.through and r + 1 < len(every) and every[r + 1].from_left
        rows = p.last + 1 - p.first
        n_head = (case.B if case.cu_seqlens is None else 1) if p.from_left else 0
        want = int(p.from_left) + int(rows > n_head)
        want += int(through) * (int(bool(mixer.ir.aux)) + int(not widens(mixer.ir)))
        assert len(calls[r]) == want, f"rank {r} made the chunk calls {calls[r]}, expected {want}"
        wide = [c for c in calls[r] if c[2] == case.V + case.K]
        assert len(wide) == int(p.from_left and widens(mixer.ir)), f"rank {r}: {calls[r]}"


# -m slow: every example once, on two ranks (packed) or on four (SMALL_W4: a sequence over all four,
# an empty one, a packed batch): every third example in name order on four, the others on two (four
# ranks on two cores cost about twice as much). Two specs that span the canonical forms (a scalar
# delta rule, an auxiliary state) on every split of SPLITS, and the fallback spec (its head does not
# widen) on w2, w4 and w4 with V < K. The cases of one world size run in one spawn of the ranks
# (cp_runs): every example on every split would take CI about 50 minutes, on both w2 and SMALL_W4
# about 9.
SPREAD = ("gated_deltanet", "gdn2_atk")
SMALL_W4 = "w4-varlen-small"
EXTRA = {
    SMALL_W4: Split(Case(B=1, T=100, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 12, 80, 80, 90, 100),
                         initial_state=True, seed=17), (25, 25, 25, 25)),
    "w4-batched-K16-V8": Split(Case(B=1, T=76, H=1, HV=1, K=16, V=8, initial_state=True, seed=18),
                               (19, 18, 20, 19)),
}
ALL_SPLITS = {**SPLITS, **EXTRA}
SLOW = sorted({(n, s) for s in SPLITS for n in SPREAD}
              | {(n, ("w2-varlen", SMALL_W4, "w2-varlen")[i % 3]) for i, n in enumerate(sorted(EXAMPLES))}
              | {(FALLBACK, s) for s in ("w2-varlen", SMALL_W4, "w4-batched-K16-V8")})
# every case under -m slow (10 s of one worker: pytest -q keeps the ranks' disagreement test below,
# which spawns a world of gloo ranks too)
CASES = [pytest.param(n, s, marks=pytest.mark.slow) for n, s in sorted({DEFAULT, *SLOW})]


@pytest.fixture(scope="module")
def cp_runs(request):
    """get(name, split_name): the ranks' results of that case. The first get of a world size runs
    every selected case of that world size in one spawn of the ranks."""
    selected = [it.callspec.params for it in request.session.items
                if getattr(it, "originalname", None) == "test_cp_matches_single_process_and_reference"]
    done = {}

    def get(name, split_name):
        world = len(ALL_SPLITS[split_name].lengths)
        if world not in done:
            cases = [(c["name"], c["split_name"]) for c in selected
                     if len(ALL_SPLITS[c["split_name"]].lengths) == world]
            try:
                runs = run_cp([(SPECS[n], ALL_SPLITS[s]) for n, s in cases])
                done[world] = dict(zip(cases, runs))
            except Exception as e:  # every case of this world size reports it
                done[world] = e
        if isinstance(done[world], Exception):
            raise done[world]
        return done[world][name, split_name]
    return get


@pytest.mark.parametrize("name,split_name", CASES)
def test_cp_matches_single_process_and_reference(name, split_name, compiled, cp_runs):
    check(name, ALL_SPLITS[split_name], compiled, ranks=cp_runs(name, split_name))


def test_cp_layout_of_straddling_and_empty_sequences():
    from lrdsl.runtime.cp import pieces
    got = pieces([0, 20, 140, 140, 160, 190], 1, [45, 50, 40, 55])
    assert [(p.first, p.last, p.cu, p.from_left, p.through) for p in got] == [
        (0, 1, (0, 20, 45), False, False), (1, 1, (0, 50), True, True), (1, 1, (0, 40), True, True),
        (1, 4, (0, 5, 5, 25, 55), True, False)]
    # an empty sequence at a rank boundary belongs to the rank that starts there
    got = pieces([0, 55, 55, 105], 1, [55, 50])
    assert [(p.first, p.last, p.from_left) for p in got] == [(0, 0, False), (1, 2, False)]


def test_cp_refuses_the_offline_solve():
    mixer = lrdsl.compile(ROOT / "examples" / "mesa.lr", load_kernels=False)
    x, opts = draw_inputs(mixer, Case(B=1, T=8, H=1, HV=1, K=4, V=4))
    with pytest.raises(InputError, match="offline solve"):
        mixer.chunk(**x, cp_group=object())


# ---- ranks that disagree: the same clear error on every rank -------------------------------------
def disagreeing_args(rank, what, gen):
    """Rank `rank`'s arguments of gated_deltanet (20 tokens a rank) where the ranks disagree on `what`."""
    B = 2 if what == "batch" and rank == 1 else 1
    K = 32 if what == "K" and rank == 1 else 16
    shape = (B, 20, 1)
    x = dict(q=torch.nn.functional.normalize(torch.randn(*shape, K, generator=gen), dim=-1),
             k=torch.nn.functional.normalize(torch.randn(*shape, K, generator=gen), dim=-1),
             v=torch.randn(*shape, 16, generator=gen), g=-0.1 * torch.rand(*shape, generator=gen),
             beta=torch.rand(*shape, generator=gen))
    cu = None
    if what == "cu_seqlens":
        cu = torch.tensor([0, 15 + 10 * rank, 40])
    N = 2 if cu is not None else B
    h0 = torch.randn(N, 1, K, 16, generator=torch.Generator().manual_seed(5))  # the same on every rank...
    if what == "initial_state" and rank == 1:
        h0[0, 0, 3, 4] += 1e-3  # ...but for one entry
    if what == "missing input" and rank == 1:
        del x["g"]
    return x, h0, cu


DISAGREE = {"cu_seqlens": "cu_seqlens", "K": "key size K", "batch": "batch size B",
            "initial_state": "values of initial_state"}


def disagree_worker(rank, world, out_dir):
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    # the ranks stop before any kernel runs: no kernels to load
    mixer = lrdsl.compile(EXAMPLES["gated_deltanet"], check_stability=False, load_kernels=False)
    said = {}
    try:
        for what in [*DISAGREE, "missing input"]:
            x, h0, cu = disagreeing_args(rank, what, torch.Generator().manual_seed(10 + rank))
            try:
                mixer.chunk(**x, initial_state=h0, cu_seqlens=cu, cp_group=dist.group.WORLD)
                said[what] = "no error"
            except InputError as e:
                said[what] = "InputError: " + str(e)
    finally:
        dist.barrier()  # both ranks done with the group before either tears it down
        dist.destroy_process_group()
    torch.save(said, os.path.join(out_dir, f"said.{rank}.pt"))
    exit_without_teardown()


def test_cp_ranks_that_disagree_all_raise_the_same_clear_error():
    """Different cu_seqlens, K, batch size or initial state on two ranks: one InputError naming
    what differs, the same on both ranks (not results without a word, nor an abort inside gloo);
    an input missing on one rank: its own error there, and the other rank stops too."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(disagree_worker, args=(2, d), nprocs=2, join=True)
        said = [torch.load(os.path.join(d, f"said.{r}.pt")) for r in range(2)]
    # a rank with a mistake of its own says what it is; the others that it stopped them
    assert "needs the input 'g'" in said[1]["missing input"], said[1]["missing input"]
    assert "rank 1 refused its arguments" in said[0]["missing input"], said[0]["missing input"]
    for what, words in DISAGREE.items():
        assert said[0][what] == said[1][what], f"{what}: {said[0][what]!r} vs {said[1][what]!r}"
        assert said[0][what].startswith("InputError: ") and "disagree" in said[0][what], said[0][what]
        assert words in said[0][what] and "\n" not in said[0][what], said[0][what]
