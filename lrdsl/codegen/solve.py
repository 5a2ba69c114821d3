"""IR -> plan of the offline solve's kernels (the Mesa readout), on top of the general plan.

The offline solve reads o_t = S_t^T x_t with (G_t + diag(lam_t)) x_t = r_t, where the Gram state
G_t = d_t G_{t-1} + u_t k_t^T shares S's decay d_t and write key u_t. The kernels take x_t by a
fixed number of conjugate-gradient steps from the Jacobi start r_t / (diag G_t + lam_t) (the
reference solves exactly). Everything the templates need beyond the general plan is here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from lrdsl.codegen.chain import chain
from lrdsl.codegen.plan import Plan, plan
from lrdsl.codegen.texpr import code, var
from lrdsl.errors import LrdslError
from lrdsl.frontend import ir


@dataclass(frozen=True)
class SolvePlan:
    base: Plan  # loads, per-token expressions, decay and tiles of the general plan; its chain is the
    # backward's generated chain rule (None for specs with auxiliary states: PyTorch's)
    lam: str  # Triton text of the regulariser lam_t (one per key channel, or a broadcast scalar)
    gram_key: str  # block variable of k, the Gram state's other side (G = D G + u k^T)
    steps: int  # conjugate-gradient steps, the spec's `steps` (Mesa's 30 by default)
    chunk: int = 64  # BT of the chunked kernels (tokens solved together in one program)
    # BT when K > 64: with bf16 operands the CG's blocks fit at 64 tokens too (fp32 inputs spill more)
    chunk_wide_k: int = 64
    bw: int = 64  # value tile of the state passes and the readout
    recurrent_bv: int = 64  # value tile of the decode kernel (each tile repeats the K x K solve)
    recurrent_warps: int = 4
    chunk_warps: int = 4
    # the CG keeps x and G p in fp32, r and p in the products' dtype ([BT, K] each): with 4 warps each
    # warp owns whole rows, so the row sums need no barrier and every product runs once (at 8 the
    # two warp groups repeat the Gram products and trade halves through shared memory)
    solve_warps: int = 4
    state_stages: int = 2  # the state passes prefetch the next chunk's keys and values
    # the backward's pair kernel holds six [BT, K] fp32 blocks besides its value tiles: at BT = 64,
    # K = 128 (fp32 state gradients) 32-wide value tiles and 8 warps fit in shared memory unspilled
    pair_bw: int = 32
    pair_warps: int = 8
    decay_grad_rows: int = 1024  # tokens per step of the log-decay gradient's reverse sums (in sequence)
    # tl.dot precision of the CG products on the GPU (the interpreter computes fp32 exactly): tf32
    # keeps about 1e-3 of each product, which bounds how far CG gets; "tf32x3" or "ieee" cost more
    cg_precision: str = "tf32"

    @property
    def decays(self) -> bool:
        return self.base.decay_kind != "identity"

    @property
    def decay_grad(self) -> bool:
        """Whether the backward computes the per-token log-decay's gradient (a decay read from the
        inputs; a constant one has none to pass on)."""
        return self.base.decay_kind == "scalar"


def solve_plan(m: ir.Mixer) -> SolvePlan:
    if m.solve_lam is None:
        raise ValueError("solve_plan takes a mixer with an offline solve")
    if m.decay.kind == "diagonal":
        # D G with a per-channel D is not symmetric: conjugate gradients need a symmetric matrix
        raise LrdslError(f"mixer '{m.name}': the offline solve's kernels take a decay with one number per "
                         "head (scalar or constant); with a decay per key channel the Gram state D G + u k^T "
                         "is not symmetric, so conjugate gradients do not apply (the reference still "
                         "solves it exactly)")
    return SolvePlan(base=replace(plan(m), chain=chain(m)), lam=code(m.solve_lam), gram_key=var("k"),
                     steps=m.solve_steps)
