"""The auxiliary states' first-order scan P_t = a_t P_{t-1} + b_t (P_{-1} = 0) along the tokens of
[B, T, HV, D] tensors, as a differentiable op whose forward and backward are Triton kernels.

The backward is the same scan run in reverse: with dP the gradient of P,
  dP~_t = dP_t + a_{t+1} dP~_{t+1},   db_t = dP~_t,   da_t = dP~_t P_{t-1}.
A decay that is one number per head (a of shape [B, T, HV, 1]) stays one per head: the kernels
broadcast it over the channels and its gradient is summed over them, so no [B, T, HV, D] copy of
it is made or kept. One program per (batch row, head, channel block) walks the chunks of BT
tokens in order, scanning each chunk with tl.associative_scan and carrying the last state over;
the loads of a chunk do not wait on the carry, so they overlap the previous chunk's scan.
"""
import torch
import triton
import triton.language as tl

BT = 64  # tokens per step of a program
BD = 32  # channels per program: more programs than batch rows x heads alone give


@triton.jit
def _compose(a1, b1, a2, b2):
    # x -> a1 x + b1, then x -> a2 x + b2
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _program(HV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, PER_HEAD: tl.constexpr):
    """(batch row, head, channel offsets, their mask, the offsets a is read at) of this program;
    a per head: every channel reads the head's one number."""
    i_bh = tl.program_id(1)
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    o_da = o_d * 0 if PER_HEAD else o_d
    return i_bh // HV, i_bh % HV, o_d, o_d < D, o_da


@triton.jit
def scan_fwd_kernel(a_ptr, b_ptr, p_ptr, T, HV: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, PER_HEAD: tl.constexpr):
    i_b, i_h, o_d, m_d, o_da = _program(HV, D, BD, PER_HEAD)
    o_t = tl.arange(0, BT)
    DA: tl.constexpr = 1 if PER_HEAD else D
    b_carry = tl.zeros([BD], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(T, BT)):
        rows = (i_b * T + i_t * BT + o_t).to(tl.int64)
        m_td = ((i_t * BT + o_t) < T)[:, None] & m_d[None, :]
        # past the end: a = 1, b = 0, so the last row of the scan is the chunk's last state
        p_td = (rows[:, None] * HV + i_h) * D + o_d[None, :]
        b_a = tl.load(a_ptr + (rows[:, None] * HV + i_h) * DA + o_da[None, :], mask=m_td, other=1)
        b_b = tl.load(b_ptr + p_td, mask=m_td, other=0)
        s_a, s_b = tl.associative_scan((b_a, b_b), 0, _compose)
        b_p = s_b + s_a * b_carry[None, :]
        tl.store(p_ptr + p_td, b_p, mask=m_td)
        b_carry = tl.sum(tl.where(o_t[:, None] == BT - 1, b_p, 0.0), 0)


@triton.jit
def scan_bwd_kernel(a_ptr, p_ptr, dp_ptr, da_ptr, db_ptr, T, n_bth, HV: tl.constexpr, D: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr, PER_HEAD: tl.constexpr, STORE_DA: tl.constexpr):
    # The reverse scan: chunks from the last, each chunk's rows from its last (row j of a tile is
    # token end - 1 - j). Per head, da goes to da_ptr[i_d] (one partial sum per channel block).
    i_d = tl.program_id(0)
    i_b, i_h, o_d, m_d, o_da = _program(HV, D, BD, PER_HEAD)
    o_t = tl.arange(0, BT)
    DA: tl.constexpr = 1 if PER_HEAD else D
    n_t = tl.cdiv(T, BT)
    b_carry = tl.zeros([BD], dtype=tl.float32)
    for i_r in range(0, n_t):
        t = (n_t - 1 - i_r) * BT + (BT - 1 - o_t)  # tokens, last first
        m_t = t < T
        m_td = m_t[:, None] & m_d[None, :]
        rows = (i_b * T + t).to(tl.int64)
        # the coefficient of token t in the reverse scan is a_{t+1} (none after the last token)
        m_next = (t + 1 < T)[:, None] & m_d[None, :]
        p_td = (rows[:, None] * HV + i_h) * D + o_d[None, :]
        b_a = tl.load(a_ptr + ((rows[:, None] + 1) * HV + i_h) * DA + o_da[None, :], mask=m_next, other=1)
        b_dp = tl.load(dp_ptr + p_td, mask=m_td, other=0)
        s_a, s_b = tl.associative_scan((b_a, b_dp), 0, _compose)
        b_dpt = s_b + s_a * b_carry[None, :]
        tl.store(db_ptr + p_td, b_dpt, mask=m_td)
        if STORE_DA:
            m_prev = (m_t & (t >= 1))[:, None] & m_d[None, :]
            b_prev = tl.load(p_ptr + p_td - HV * D, mask=m_prev, other=0)  # P_{t-1}, zero before the first
            b_da = b_dpt * b_prev
            if PER_HEAD:
                tl.store(da_ptr + i_d * n_bth + rows * HV + i_h, tl.sum(b_da, 1), mask=m_t)
            else:
                tl.store(da_ptr + p_td, b_da, mask=m_td)
        b_carry = tl.sum(tl.where(o_t[:, None] == BT - 1, b_dpt, 0.0), 0)


# without the constexpr_function wrapper of Triton 3.5+ (~2 us a host call)
_cdiv = getattr(triton.cdiv, "fn", triton.cdiv)
_pow2 = getattr(triton.next_power_of_2, "fn", triton.next_power_of_2)


def _blocks(D):
    bd = min(BD, max(16, _pow2(D)))
    return bd, _cdiv(D, bd)


def scan_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """P [B, T, HV, D] fp32 from a ([B, T, HV, 1] or [B, T, HV, D]) and b [B, T, HV, D]."""
    B, T, HV, D = b.shape
    a, b = a.float().contiguous(), b.float().contiguous()
    p = torch.empty(B, T, HV, D, dtype=torch.float32, device=b.device)
    bd, nd = _blocks(D)
    if B * T * HV * D:
        scan_fwd_kernel[(nd, B * HV)](a, b, p, T, HV=HV, D=D, BT=BT, BD=bd, PER_HEAD=a.shape[-1] == 1, num_warps=4)
    return p


def scan_backward(a: torch.Tensor, p: torch.Tensor, dp: torch.Tensor, decay_grad: bool = True):
    """(da in a's shape, db) from a, the forward's P and P's gradient dp; without decay_grad,
    (None, db): da = db_t P_{t-1} is left to the caller (p is then not read)."""
    B, T, HV, D = dp.shape
    a, dp = a.float().contiguous(), dp.float().contiguous()
    per_head = a.shape[-1] == 1
    bd, nd = _blocks(D)
    db = torch.empty_like(dp)
    da = None
    if decay_grad:
        da = torch.empty(nd, B, T, HV, dtype=torch.float32, device=dp.device) if per_head else torch.empty_like(dp)
    if B * T * HV * D:
        scan_bwd_kernel[(nd, B * HV)](a, p, dp, da, db, T, B * T * HV, HV=HV, D=D, BT=BT, BD=bd, PER_HEAD=per_head,
                                      STORE_DA=decay_grad, num_warps=4)
    else:
        db.zero_()
        if da is not None:
            da.zero_()
    if not decay_grad:
        return None, db
    return (da.sum(0).unsqueeze(-1) if per_head else da), db


# custom ops called by an autograd.Function: under torch.func.vjp (vector_chain_rule) a Function's
# backward gets functorch-wrapped tensors, which a kernel launch cannot read; the dispatcher
# unwraps them for a custom op. (A custom op's own autograd formula is refused by functorch.)
@torch.library.custom_op("lrdsl::aux_scan_fwd", mutates_args=())
def _scan_fwd_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return scan_forward(a, b)


@_scan_fwd_op.register_fake
def _(a, b):
    return b.new_empty(b.shape, dtype=torch.float32)


@torch.library.custom_op("lrdsl::aux_scan_bwd", mutates_args=())
def _scan_bwd_op(a: torch.Tensor, p: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scan_backward(a, p, dp)


@_scan_bwd_op.register_fake
def _(a, p, dp):
    return a.new_empty(a.shape, dtype=torch.float32), torch.empty_like(p)


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(a, b):
        return _scan_fwd_op(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)
        ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)

    @staticmethod
    def backward(ctx, dp):
        a, p = ctx.saved_tensors
        da, db = _scan_bwd_op(a, p, dp)
        return da.to(ctx.dtypes[0]), db.to(ctx.dtypes[1])


def first_order_scan_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """P_t = a_t P_{t-1} + b_t along dim 1, P_{-1} = 0, fp32; a is [B, T, HV, 1] (one decay per
    head, broadcast over the channels) or b's shape [B, T, HV, D]."""
    return _Scan.apply(a, b)
