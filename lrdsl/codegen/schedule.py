"""Plan -> the kernels a module defines and the launches its host functions make, in order.

Python decides here; the templates it names are straight kernels with named holes. The module
template renders `kernel_templates(plan)` one after another (each may import the shared macros of
common.jinja, nothing deeper), and the host functions are rendered from `forward(plan)` and
`backward(plan)`.
"""
from __future__ import annotations

from dataclasses import dataclass

from lrdsl.codegen.plan import Plan
from lrdsl.codegen.raw import wy_one_tile


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a host function."""
    role: str  # what it makes: "solve", "wy", "state", "output", "dstate", "dk", ...
    variant: str  # which form of that role this plan takes ("" where there is one)
    template: str  # the template the module renders for it (a variant's fills the blocks of the kernel's file)
    kernel: str  # the kernel's name in the generated module
    # the autotuned wrapper the host function calls ("": it launches the kernel itself), its
    # configs (Python text of _space calls, staged_host.py.jinja), the pointer arguments its timed
    # launches put back (it updates them in place), and whether it keys on sequences x heads too
    wrapper: str = ""
    space: str = ""
    restores: tuple = ()
    seq_keyed: bool = False
    # the staged_host_launches.jinja macro that makes it ("": the host function writes it out)
    launcher: str = ""

    @property
    def autotune_args(self) -> str:
        """triton.autotune's keyword arguments besides the configs, as Python text."""
        keys = "**_SEQ_KEYED" if self.seq_keyed else "**_AUTOTUNE"
        if self.restores:
            keys += ", **_restoring(" + ", ".join(f'"{n}"' for n in self.restores) + ")"
        return keys


def _general(plan: Plan) -> tuple:
    """The token loop, the general chunked forward and backward (every spec has them)."""
    return ("recurrent.py.jinja", "prologue.py.jinja", "chunk.py.jinja", "chunk_bwd.py.jinja", "chunk_host.py.jinja")


def _staged_forward(plan: Plan) -> tuple:
    """Templates of the staged forward's kernels (plan.staged), in the module's order: the per-token
    vectors and the helpers on raw tiles the plan takes, then one template per stage (1 the solve,
    or with plan.solve_wy_fused the solve and WY stages in one; 1b the inverse with
    plan.split_solve; 2 WY with an erase; 3 the state pass; 4 the output). Each is a straight
    kernel; where a role has forms, _fwd_holes names the plan's (docs/kernels/forward.md).

    With plan.rank2 and no staged forward: the native rank-2 forward and its helpers."""
    if not plan.staged:
        return _fwd_rank2_parts(plan) + ("staged_rank2.py.jinja",) if plan.rank2 else ()
    diag = plan.decay_kind == "diagonal"
    out = list(_fwd_vectors(plan))
    if plan.raw_value:
        out.append("staged_fwd_raw_value.py.jinja")
    if _fwd_factors(plan):
        out.append("staged_fwd_factors.py.jinja")
    if plan.raw or plan.raw_qk_output:
        out.append("staged_fwd_raw_output.py.jinja")
    if plan.raw:
        out.append("staged_fwd_raw_write.py.jinja")
    if plan.decay_prefix:
        out.append("staged_fwd_prefix.py.jinja")
    if plan.solve_wy_fused:
        out.append("staged_solve_wy.py.jinja")
    elif diag:
        blocks = "staged_solve_blocks_before.py.jinja" if plan.readout_before else "staged_solve_blocks.py.jinja"
        out += [blocks, "staged_fwd_solve.py.jinja"]
    elif plan.delta:
        out += ["staged_fwd_lower_inverse.py.jinja", "staged_fwd_solve.py.jinja"]
    if plan.split_solve:
        out.append("staged_fwd_inverse.py.jinja")
    if plan.delta:
        out.append("staged_wy.py.jinja")
    out += ["staged_fwd_state.py.jinja", "staged_fwd_output.py.jinja"]
    return tuple(out)


def _fwd_vectors(plan: Plan) -> tuple:
    """The per-token vectors of the staged kernels (the staged forward's and the native rank-2
    forward's), with a decay per key channel the log-decays' sums on tensor cores."""
    sums = ("staged_fwd_token_sums.py.jinja",) if plan.decay_kind == "diagonal" else ()
    return ("staged_vectors.py.jinja",) + sums


def _fwd_rank2_parts(plan: Plan) -> tuple:
    """The native rank-2 forward's helpers: the vectors and, with a decay per key channel, its
    diagonal blocks."""
    blocks = ("staged_fwd_rank2_diagonal.py.jinja",) if plan.decay_kind == "diagonal" else ()
    return _fwd_vectors(plan) + blocks


@dataclass(frozen=True)
class _FwdFactor:
    """One per-token number of an input that is a tile times a number (staged_fwd_factors)."""
    name: str  # the helper's name
    raw: object  # the input (plan.Raw)
    what: str  # what the number is, for the helper's comment
    with_norm: bool  # the helper applies the input's normaliser 1/||x|| itself


def _fwd_factors(plan: Plan) -> tuple:
    """The per-token numbers the staged kernels take from helpers of their own: the write key's
    (plan.raw_key; with plan.raw_wy two, the key's and the erase read's, without the normaliser,
    which the WY stage makes from the tile it holds, the key's with it where the erase reads
    another input) and, for the backward, the query's."""
    out = []
    if plan.raw_wy:
        own_norm = plan.raw_key.norm and not wy_one_tile(plan.raw_key, plan.raw_wy)
        out += [_FwdFactor("_wy_key_number", plan.raw_key, "plan.raw_key's write key u", own_norm),
                _FwdFactor("_wy_erase_number", plan.raw_wy[0], "plan.raw_wy's erase read c", False)]
    elif plan.raw_key:
        out.append(_FwdFactor("_key_factor", plan.raw_key, "plan.raw_key's write key u", plan.raw_key.norm))
    if plan.raw_query and plan.staged_backward:
        out.append(_FwdFactor("_query_factor", plan.raw_query, "plan.raw_query's query r (before the scale)",
                              plan.raw_query.norm))
    return tuple(out)


def _fwd_holes(plan: Plan) -> dict:
    """The staged forward templates' named holes, decided once per plan: Triton text (argument
    lists, a statement where the plan has it, "" where not), numbers, and the names of the
    staged_fwd_macros.jinja macros (one per form of a kernel's part) the plan takes."""
    diag = plan.decay_kind == "diagonal"
    decays = plan.decay_kind != "identity"
    keys_in_solve = diag and not plan.delta
    nb = plan.staged_chunk // plan.staged_sub  # 16-token blocks per chunk
    va = plan.vector_args
    nonfinite = plan.causal_nonfinite
    value_tile = "_raw_v" if plan.raw_value else "_staged_v"
    fo = "fo_ptr, " if plan.output_factors else ""
    if plan.raw:
        raw_key, raw_query = plan.raw[0], plan.raw[2]
        write_factor = f"{plan.raw[0].factor} * {plan.raw[1].factor}"
    else:
        raw_key, raw_query = plan.raw_key, plan.raw_query
        write_factor = plan.raw_key.factor if plan.raw_key else ""
    if (plan.delta and decays) or plan.decay_prefix:  # the state pass loads G_end a chunk ahead
        if diag:
            g_first = "g_next = tl.load(g_ptr + (c0 * HV + i_hv) * K + o_k, mask=m_k & (n_t > 0), other=0)"
            g_next = "g_next = tl.load(g_ptr + ((c0 + tl.minimum(i_t + 1, n_t - 1)) * HV + i_hv) * K + o_k, mask=m_k, other=0)"
        else:
            g_first = "g_next = tl.load(g_ptr + (tl.minimum(bos + BT, eos) - 1) * HV + i_hv, mask=n_t > 0, other=0)"
            g_next = "g_next = tl.load(g_ptr + (tl.minimum(bos + i_t * BT + 2 * BT, eos) - 1) * HV + i_hv)"
        state_g_first, state_g_next = "    " + g_first, "        g_end = g_next\n        " + g_next
    else:
        state_g_first = state_g_next = ""
    if plan.delta:
        state_write = "state_erase_raw_key" if plan.raw_key else "state_erase_keys"
    else:
        state_write = "state_raw" if plan.raw else "state_own_keys"
    split_k = plan.state_split_k
    if diag:
        own_keys_decayed = ("        g_end = tl.sum(b_gl, 0)\n"
                            "        b_kg = (b_u * tl.exp(g_end[None, :] - tl.cumsum(b_gl, 0))).to(DT)")
    elif decays:
        own_keys_decayed = ("        g_end = tl.sum(b_gl, 0)\n"
                            "        b_kg = (b_u * tl.exp(g_end - tl.cumsum(b_gl, 0))[:, None]).to(DT)")
    else:
        own_keys_decayed = "        b_kg = b_u.to(DT)"
    # _raw_write: k^T's columns scaled by exp(G_end - G) (plan.decay_prefix), or the value rows by
    # a constant decay's and the write's per-token factors
    raw_write_factor = raw_write_rows = ""
    if plan.decay_prefix:
        raw_write_decay = (f"    f_w, _, _ = _raw_scalars({va}, rows, m_t, i_h, i_hv, H, HV)\n"
                           "    b_kt = (b_kt * (f_w * tl.exp(g_end - b_G))[None, :]).to(DT)")
    else:
        rows_scale = []
        raw_write_decay = "    g_end = 0.0  # no decay (the only other kind here)"
        if plan.decay_kind == "constant":
            raw_write_decay = "\n".join(filter(None, [
                "    # one log-decay per head: G_end - G_t = (n_t - 1 - t) log d",
                f"    {plan.head_index}" if plan.head_index else "",
                f"    lg = {plan.log_decay}",
                "    b_d = tl.exp(lg * tl.maximum(n_t - 1 - o_t, 0).to(tl.float32))",
                "    g_end = lg * n_t.to(tl.float32)"]))
            rows_scale.append("b_d")
        if plan.raw and plan.raw_write_factor:
            raw_write_factor = ("    # the write's factor moved from a [1, BT] row to the value tile's rows, within a warp\n"
                                f"    f_w = _raw_token_row({va}, rows[None, :], m_t[None, :], i_h, i_hv, H, HV)\n"
                                "    f_t = tl.sum(tl.where(o_t[None, :] == o_t[:, None], f_w, 0.0), 1)")
            rows_scale.append("f_t")
        if rows_scale:
            raw_write_rows = f"    b_v = (b_v * ({' * '.join(rows_scale)})[:, None]).to(DT)"
    query_norm = bool(plan.raw_qk_output and raw_query.norm)  # its squared norms: q q^T's diagonal
    if plan.raw_qk_output:
        output_products = "output_raw_qk"
    elif plan.raw:
        output_products = "output_raw"
    else:
        output_products = "output_diagonal" if diag else "output_dense"
    if diag:
        wy_keys = "wy_keys_diagonal"
    elif decays:
        wy_keys = "wy_keys_decay_raw_key" if plan.raw_key else "wy_keys_decay"
    else:
        wy_keys = "wy_keys_raw_key" if plan.raw_key else "wy_keys_plain"
    flag = ('    if not (tl.abs(chk) < float("inf")):\n'
            "        tl.store(dirty_ptr + i_all * HV + i_hv, 1)")
    output_factor = "  # the output stage's (plan.output_factors)"
    # the erase reads the state before the token's decay (order "sum"): c's exponent in the chunk
    # frame is G - gl, where G is u's and r's (the token's own log-decay gl, never its negation alone)
    c_gx = plan.erase_read_shift
    # the readout of the state before the token (plan.readout_before): r's exponent is Gx, the
    # decay cumulated before the token (_cumsum_before: never an exponent of -gl), P strictly
    # causal, the bonus r . c on its diagonal (_diagonal_blocks_before)
    r_gx = plan.readout_before
    # the WY stages' normalisers from the tile x_c they hold: c's, and u's where it is the same tile
    one_tile = wy_one_tile(plan.raw_key, plan.raw_wy)
    wy_norm = ""
    if plan.raw_wy and plan.raw_wy[0].norm:
        wy_norm = ("    f_n = tl.rsqrt(n2 + 1e-6)\n    f_u, f_c = f_u * f_n, f_c * f_n" if one_tile
                   else "    f_c = f_c * tl.rsqrt(n2 + 1e-6)")
    return dict(
        query_decay="_cumsum_before(b_gl, o_t)" if r_gx else "tl.cumsum(b_gl, 0)",
        r_dec="tl.exp(_cumsum_before(b_gl, o_s))" if r_gx else "b_dec",  # Gx - ref_i: the block's own sums
        diagonal_blocks="_diagonal_blocks_before" if r_gx else "_diagonal_blocks",
        decays=decays,
        keys_in_solve=keys_in_solve,
        c_gx=c_gx,
        # c decayed to the 16-token block's start ref_i (solve_diagonal): b_dec's, or its own factor
        c_dec="tl.exp(b_G - b_gl - b_ref{i}[None, :])" if c_gx else "b_dec",
        # c's rows' G in the exact diagonal block (r's, for the readout before the token)
        c_G="b_ref{i}[None, :] + _cumsum_before(b_gl, o_s)" if r_gx else "b_G - b_gl" if c_gx else "b_G",
        c_row="b_Gc" if c_gx else "b_G",  # A's rows' G per block (solve_scalar)
        blocks=nb,
        # the solve's diagonal blocks: X's and A's (arguments), the inverses a helper returns
        diagonal_x=", ".join(f"b_X{i}{i}" for i in range(nb)),
        diagonal_a="".join(f"b_A{i}{i}, " for i in range(nb)),
        block_inverses=", ".join(f"b_X{i} + eye" for i in range(nb)),
        erase_c=plan.erase_c if plan.delta else plan.bonus_key or "0.0",
        log_decays=(f"tl.where(m_tk, {plan.log_decay}, 0.0)" if diag else
                    f"tl.sum(tl.where(m_t[:, None], {plan.log_decay if decays else '0.0'}, 0.0), 1)"),
        token_log_decay=plan.log_decay if decays else "0.0",
        value_tile=value_tile,
        # raw tiles (plan.raw, plan.raw_qk_output)
        raw_key=raw_key,
        raw_query=raw_query,
        write_factor=write_factor,
        output_factor_arg=fo,
        output_factor_load="    f_w = tl.load(fo_ptr + rows * HV + i_hv, mask=m_t, other=0)" if plan.raw_qk_output else "",
        query_norm_init="    b_Q = tl.zeros([BT, BT], dtype=tl.float32)" if query_norm else "",
        query_norm_dot='        b_Q = tl.dot(b_q, tl.trans(b_q), b_Q, input_precision="tf32")' if query_norm else "",
        query_norm_scale=("    f_q = f_q * tl.rsqrt(tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_Q, 0.0), 1) + 1e-6)"
                          if query_norm else ""),
        output_scalars="_, f_q, gl" if plan.raw_qk_output else "f_w, f_q, gl",
        output_decays=("    b_G = tl.cumsum(gl, 0)\n"
                       "    b_o = b_o * (f_q * tl.exp(b_G))[:, None]\n"
                       "    b_P *= tl.exp(tl.minimum(b_G[:, None] - b_G[None, :], 0.0))") if decays
        else "    b_o = b_o * f_q[:, None]",
        prefix_args="b_G, g_end, " if plan.decay_prefix else "",
        raw_write_decay=raw_write_decay,
        raw_write_factor=raw_write_factor,
        raw_write_rows=raw_write_rows,
        # stage 1
        solve_args=(f"{va}, {'a_ptr' if plan.split_solve else 'ai_ptr'}, p_ptr, "
                    f"{'kg_ptr, g_ptr, ' if keys_in_solve else ''}exact_ptr, chunk_indices_ptr, "
                    "chunk_offsets_ptr, cu_seqlens_ptr, scale, T"),
        solve_body="solve_diagonal" if diag else "solve_scalar",
        solve_pairs=(("A", "b_cd"), ("P", "b_rd")) if plan.delta else (("P", "b_rd"),),
        solve_keys_chunk="solve_keys_chunk" if keys_in_solve else "nothing",
        solve_keys_block="solve_keys_block" if keys_in_solve else "nothing",
        solve_a_block="solve_a_block" if plan.split_solve else "nothing",
        solve_g_init="    g_before = 0.0" if decays else "",
        solve_block_decays="solve_block_decays" if decays else "nothing",
        solve_pair_decays="solve_pair_decays" if decays else "nothing",
        first_bad_min="    first_bad = tl.min(first_bad)" if nonfinite else "",
        # stage 2
        wy_form="raw" if plan.raw_wy else "dense",
        wy_keys=wy_keys,
        wy_redo_keys="wy_redo_keys_diagonal" if diag else "wy_redo_keys",
        wy_redo_decay=f"    b_ck = b_ck * tl.exp(tl.cumsum(b_gl, 0){c_gx})[:, None]" if decays else "",
        wy_output_factor=f"    tl.store(fo_ptr + rows * HV + i_hv, b_f, mask=m_t){output_factor}" if fo else "",
        wy_check_early="        chk = tl.sum(b_ai.to(tl.float32)) + tl.sum(b_z0)" if nonfinite else "",
        wy_check_late="        chk = tl.sum(b_ai.to(tl.float32))" if nonfinite else "",
        wy_check_c=("    chk += tl.sum(b_c)  # not finite where c or G is (a log-decay, or past fp16's range in "
                    "_token_sums)") if nonfinite else "",
        wy_check_z="        chk += tl.sum(b_z)" if nonfinite else "",
        wy_flag=flag if nonfinite else "",
        wy_norm=wy_norm,
        wy_raw_decays="wy_raw_decays" if decays else "nothing",
        fused_decays="fused_decays" if decays else "fused_keys",
        # A = c u^T from the tile x of c (and of u, where they are one input's), else from u's own
        fused_key_tile="nothing" if one_tile else "fused_key_tile",
        fused_key_operand="b_x" if one_tile else "b_xu",
        fused_output_factor=f"    tl.store(fo_ptr + rows * HV + i_hv, f_u, mask=m_t){output_factor}" if fo else "",
        fused_x_blocks="    b_X = tl.where(o_t[None, :] // BS > o_t[:, None] // BS, 0.0, b_X)" if nonfinite else "",
        # stage 3
        state_params=" KEYS_GIVEN: tl.constexpr," * keys_in_solve + " BKS: tl.constexpr," * split_k,
        state_programs=("i_v, i_nh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)" if split_k
                        else "i_v, i_nh = tl.program_id(0), tl.program_id(1)"),
        state_keys="i_k * BKS + tl.arange(0, BKS)" if split_k else "tl.arange(0, BK)",
        state_rows="BKS" if split_k else "BK",
        state_g_first=state_g_first,
        state_g_next=state_g_next,
        state_write=state_write,
        state_decay="        b_h *= tl.exp(g_end)[:, None]" if diag else "        b_h *= tl.exp(g_end)" if decays else "",
        state_key_operand="b_kt" if plan.raw or plan.raw_key else "tl.trans(b_kg)",
        prefix_call_args="tl.load(g_ptr + rows * HV + i_hv, mask=m_t, other=0), g_end, " if plan.decay_prefix else "",
        own_keys_indent=4 if keys_in_solve else 0,
        own_keys_call=(f"_staged_k_at({va}, rows, m_t, i_h, i_hv, scale, i_k * BKS, H, HV, K, BKS)" if split_k
                       else f"_staged_k({va}, rows, m_t, i_h, i_hv, scale, H, HV, K, BK)"),
        own_keys_decayed=own_keys_decayed,
        # the backward reuses the forward's solve and makes the keys here; the forward's solve gave them
        own_keys_given=("        if KEYS_GIVEN:  # by the solve (the backward makes them here)\n"
                        "            b_kg = tl.load(kg_ptr + p_tk, mask=m_t[:, None] & m_k[None, :], other=0)\n"
                        "            g_end = tl.load(g_ptr + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0)\n"
                        "        else:") if keys_in_solve else "",
        # stage 4
        output_args=(f"{va}, e_ptr, hs_ptr, p_ptr, {fo}o_ptr, chunk_indices_ptr, chunk_offsets_ptr, "
                     "cu_seqlens_ptr, scale, T"),
        output_dirty_arg=" dirty_ptr," if plan.output_dirty_branch else "",
        output_products=output_products,
        output_dense_decays=("    b_G = tl.cumsum(b_gl, 0)\n"
                             "    b_o = tl.dot(b_r, b_h) * tl.exp(b_G)[:, None]\n"
                             "    b_P *= tl.exp(tl.minimum(b_G[:, None] - b_G[None, :], 0.0))") if decays
        else "    b_o = tl.dot(b_r, b_h)",
        output_values=("    b_e = tl.load(e_ptr + p_tv, mask=m_tv, other=0)" if plan.delta else
                       f"    b_e = {value_tile}({va}, rows, m_t, o_v, m_v, i_h, i_hv, H, HV, V).to(DT)"),
        # the native rank-2 forward's pairwise sums
        rank2_pairs="pairs_by_blocks" if diag else "pairs_whole",
        output_pairs_dot=("_dirty_dot(b_P.to(DT), b_e, o_t, dirty_ptr + i_all * HV + i_hv)" if plan.output_dirty_branch
                          else "_token_dot(b_P.to(DT), b_e, o_t, CAUSAL)"),
    )


def _staged_backward(plan: Plan) -> tuple:
    """Templates of the staged backward's kernels (plan.staged_backward), in the module's order:
    stage 1 (staged_dq), 2 (staged_dstate), 3 (staged_dk, after staged_de where plan.split_dk and
    staged_dr where plan.split_dr), with a decay per key channel 4 (staged_pair), then the host
    function staged_bwd. A kernel's file is its form for a decay per head without an erase; each
    other form is a template that fills that file's blocks (`_erase`, `_de`, `_split`, `_key`), so
    no template chooses between forms (docs/kernels/backward.md has the table)."""
    if not plan.staged_backward:
        return ()
    if plan.split_dk and (plan.decay_kind != "scalar" or not plan.delta):
        raise ValueError("staged_de and its staged_dk take an erase and a scalar decay (plan.split_dk)")
    dstate = "staged_bwd_dstate_erase.py.jinja" if plan.delta else "staged_bwd_dstate.py.jinja"
    if plan.decay_kind == "diagonal":
        pair = ("staged_bwd_pair_erase.py.jinja" if plan.delta else
                "staged_bwd_pair_before.py.jinja" if plan.readout_before else "staged_bwd_pair.py.jinja")
        return ("staged_bwd_dq_key.py.jinja", dstate,
                "staged_bwd_dk_key_erase.py.jinja" if plan.delta else "staged_bwd_dk_key.py.jinja",
                pair, "staged_bwd_host_key.py.jinja")
    stage3 = ("staged_bwd_dk_erase.py.jinja" if plan.delta else "staged_bwd_dk.py.jinja",)
    host = "staged_bwd_host.py.jinja"
    # c's shares on G - g moved to the token before (order "sum", a decay per token and head)
    helpers = ("staged_bwd_read_before.py.jinja",) if plan.erase_read_shift and plan.decay_kind != "identity" else ()
    if plan.split_dr:
        stage3 = ("staged_bwd_de.py.jinja", "staged_bwd_dr.py.jinja", "staged_bwd_dk_split.py.jinja")
        host = "staged_bwd_host_split.py.jinja"
    elif plan.split_dk:
        stage3 = ("staged_bwd_de.py.jinja", "staged_bwd_dk_de.py.jinja")
        host = "staged_bwd_host_de.py.jinja"
    return (*helpers, "staged_bwd_dq.py.jinja", dstate, *stage3, host)


def _before_holes(plan: Plan) -> dict:
    """The staged backward's holes for the readout of the state before the token
    (plan.readout_before, a decay per key channel): r's exponent G - gl in Rg (stage 1) and in the
    pairs (staged_bwd_pair_before.py.jinja), dP strictly causal, and with a bonus (plan.bonus_key)
    its gradients from dP's diagonal dd = dO_t . z_t: dc = dd r (stored by stage 1, final) and
    dd c, which stage 4 adds to r's after the log-decays' sums (the bonus reads no decay). "" where
    the plan has none of it."""
    bonus = bool(plan.bonus_key)
    mask = ">" if plan.readout_before else ">="
    dp_causal = f"    b_dp = tl.where(o_t[:, None] {mask} o_t[None, :], b_dp, 0.0)"
    if bonus:
        dp_causal = ("    b_dd = tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_dp, 0.0), 1)  # the bonus's (r . c)\n"
                     + dp_causal)
    return dict(
        dp_causal=dp_causal,
        query_decay="_cumsum_before(b_gl, o_t)" if plan.readout_before else "tl.cumsum(b_gl, 0)",
        dq_args=" dc_ptr, drb_ptr," if bonus else "",
        dq_call="dc, drb, " if bonus else "",
        dq_bonus=("    tl.store(dc_ptr + p_tk, (b_dd[:, None] * b_r).to(dc_ptr.dtype.element_ty), mask=m_tk)\n"
                  "    tl.store(drb_ptr + p_tk, (b_dd[:, None] * b_c).to(drb_ptr.dtype.element_ty), mask=m_tk)")
        if bonus else "",
        dq_vectors="_, b_c, b_r, b_gl" if bonus else "_, _, b_r, b_gl",
        host_buffers=("\n    dc, drb = torch.empty(B, T, HV, K, **vg), torch.empty(B, T, HV, K, **vg)  # the bonus's "
                      "shares (plan.bonus_key)") if bonus else "",
        no_erase="(dc, None, None)" if bonus else "(None,) * 3",  # dc, dA, c: the bonus's dc (stage 1's)
        pair_call="drb, " if bonus else "None, " if plan.readout_before else "",
        dr_bonus=(" + tl.load(drb_ptr + (t0 * HV + i_hv) * K + i_ks * BKP + p_i, mask=m_ik, other=0).to(tl.float32)"
                  if bonus else ""),
    )


def _bwd_decay(plan: Plan) -> str:
    """The macros file of the backward's decay terms for this plan's decay (imported as `decay`)."""
    return {"identity": "staged_bwd_decay_none.jinja", "constant": "staged_bwd_decay_const.jinja",
            "scalar": "staged_bwd_decay_scalar.jinja", "diagonal": "staged_bwd_decay_key.jinja"}[plan.decay_kind]


def _bwd_out(plan: Plan) -> str:
    """The macros file of where staged_dk's vector gradients go (imported as `out`): stored for the
    host's chain rule, through the chain rule in its epilogue (plan.chain_in_dk), and with r's
    straight to its input's (plan.chain_at_dr)."""
    if plan.chain_at_dr:
        return "staged_bwd_out_chain_at.jinja"
    return "staged_bwd_out_chain.jinja" if plan.chain_in_dk else "staged_bwd_out_store.jinja"


def _bwd_dc(plan: Plan) -> str:
    """The macros file of where c's gradient goes in the split stage 3 (imported as `dc`): stored by
    staged_de for staged_dk's chain rule, or on to its input's in staged_de (plan.chain_at_dc)."""
    return "staged_bwd_dc_at.jinja" if plan.chain_at_dc else "staged_bwd_dc_store.jinja"


def kernel_templates(plan: Plan) -> tuple:
    """Every template the module renders, in order, each once."""
    if plan.side == "right":  # the value side's token loop, chunked forward and backward (host: runtime/valueside.py)
        return ("recurrent_value.py.jinja", "chunk_value.py.jinja", "chunk_value_bwd.py.jinja")
    if plan.side == "both":  # M S N: its token loop (chunk's forward too) and backward (host: runtime/two_sided.py)
        return ("recurrent_value.py.jinja", "chunk_two_sided_bwd.py.jinja")
    out = list(_general(plan))
    if plan.staged:
        out += _staged_forward(plan) + _staged_backward(plan)
        if plan.chain is not None:
            out.append("chain_rule.py.jinja")
        out.append("staged_host.py.jinja")  # last: its autotuned wrappers wrap the kernels above
    elif plan.rank2:
        out += _staged_forward(plan)
    return tuple(dict.fromkeys(out))


def backward_templates(plan: Plan) -> tuple:
    """The templates of the staged backward's kernels and chain rule (codegen/finite.py makes their
    loads of the inputs finite)."""
    return _staged_backward(plan) + (("chain_rule.py.jinja",) if plan.staged and plan.chain is not None else ())


def forward(plan: Plan) -> tuple:
    """The staged forward's launches (plan.staged), in the order its host functions make them:
    the solve (with plan.solve_wy_fused the solve and WY stages in one), the inverse
    (plan.split_solve), WY (an erase), the log-decay prefix (plan.decay_prefix), the state pass and
    the output stage. Why each tuning space: docs/kernels/host.md."""
    if not plan.staged:
        return ()
    diag = plan.decay_kind == "diagonal"
    out = []
    if plan.solve_wy_fused:
        out.append(Launch("solve", "wy fused", "staged_solve_wy.py.jinja", "staged_solve_wy_kernel", "staged_solve_wy",
                          "_space([128], [4], [1], maxnreg=168) + _space([128], [4], [1]) "
                          "+ _space([64], [4], [2], maxnreg=168)", ("dirty_ptr",), launcher="solve_wy"))
    elif plan.delta or diag:
        out.append(Launch("solve", "key" if diag else "", "staged_fwd_solve.py.jinja", "staged_solve_kernel",
                          "staged_solve", f"_space(None, {'[4, 8]' if diag else '[1]'}, [1])", ("exact_ptr",),
                          launcher="solve"))
    if plan.split_solve:
        out.append(Launch("inverse", "", "staged_fwd_inverse.py.jinja", "staged_inverse_kernel", "staged_inverse",
                          "_space(None, [1], [1]) + _space(None, [1], [1], maxnreg=128)", launcher="inverse"))
    if plan.delta:
        if diag:
            variant, space = "key", ('_space(None, [8], [2], tiles=[{"BV": 128, "EARLY": True}], maxnreg=128) '
                                     '+ _space(None, [8], [2], tiles=[{"BV": 128, "EARLY": True}])')
        elif plan.raw_wy:
            variant, space = "raw", "_space([128], [8], [2], maxnreg=80) + _space([32], [4], [2])"
        else:
            variant, space = "", ('_space(None, [4], [2], tiles=[{"BV": 64, "EARLY": False}]) '
                                  '+ _space(None, [8], [2], tiles=[{"BV": 128, "EARLY": True}], maxnreg=128)')
        out.append(Launch("wy", variant, "staged_wy.py.jinja", "staged_wy_kernel", "staged_wy", space, ("dirty_ptr",),
                          launcher="wy_raw" if plan.raw_wy else "wy"))
    if plan.decay_prefix:
        out.append(Launch("prefix", "", "staged_fwd_prefix.py.jinja", "staged_prefix_kernel", launcher="prefix"))
    if plan.state_split_k:
        state = ("split k", '_space(None, [4], [3, 4], tiles=[{"BV": 64, "BKS": 64}, {"BV": 32, "BKS": 64}, '
                            '{"BV": 128, "BKS": 64}, {"BV": 64, "BKS": 32}])')
    else:
        state = ("", "_space([32], [4], [2, 3, 4]) + _space([64], [4], [3, 4])")
    out.append(Launch("state", state[0], "staged_fwd_state.py.jinja", "staged_state_kernel", "staged_state", state[1],
                      seq_keyed=True))
    raw = bool(plan.raw or plan.raw_qk_output)
    out.append(Launch("output", "raw" if raw else "", "staged_fwd_output.py.jinja", "staged_output_kernel",
                      "staged_output", f"_space([64, 128], [4], [{3 if raw else 2}])"))
    return tuple(out)


def backward(plan: Plan) -> tuple:
    """The staged backward's launches (plan.staged_backward), in order: stage 1 (staged_dq), 2
    (staged_dstate; staged_dstate_fp32 is its autotuner for fp32 intermediates), 3 (staged_dk, after
    staged_de with plan.split_dk and staged_dr with plan.split_dr) and, with a decay per key
    channel, 4 (staged_pair, launched as it is). Why each tuning space: docs/kernels/host.md."""
    if not plan.staged_backward:
        return ()
    diag = plan.decay_kind == "diagonal"
    key = "_key" if diag else ""
    erase = "_erase" if plan.delta else ""  # the template of a kernel's form with an erase (_staged_backward's)
    dstate_tiles = '{"BV": 32, "BKS": 64}, {"BV": 64, "BKS": 64}' if plan.dstate_split_k else ""
    out = [
        Launch("dq", "key" if diag else "", f"staged_bwd_dq{key}.py.jinja", "staged_dq_kernel", "staged_dq",
               "_space([64], [8], [1, 2])" if diag else "_space([64], [4], [2])"),
        Launch("dstate", "split k" if dstate_tiles else "", f"staged_bwd_dstate{erase}.py.jinja", "staged_dstate_kernel",
               "staged_dstate", f"_space(None, [4], [2], tiles=[{dstate_tiles}])" if dstate_tiles
               else "_space([32], [4], [2, 3])", seq_keyed=True),
        Launch("dstate", "fp32", f"staged_bwd_dstate{erase}.py.jinja", "staged_dstate_kernel", "staged_dstate_fp32",
               '_space(None, [4], [1], tiles=[{"BV": 32' + (', "BKS": 64' if plan.dstate_split_k else "") + "}])",
               seq_keyed=True),
    ]
    if diag:
        out.append(Launch("dk", "key", f"staged_bwd_dk_key{erase}.py.jinja", "staged_dk_kernel", "staged_dk",
                          f"_space({'[64, 128]' if plan.delta else '[64]'}, [8], [2])", ("du_ptr", "dgl_ptr")))
        pair = erase or ("_before" if plan.readout_before else "")
        out.append(Launch("pair", "key", f"staged_bwd_pair{pair}.py.jinja", "staged_pair_kernel"))
        return tuple(out)
    if plan.split_dk:
        out.append(Launch("de", "", "staged_bwd_de.py.jinja", "staged_de_kernel", "staged_de",
                          "_space([64], [4], [2]) + _space([64, 32], [8], [2])"))
    if plan.split_dr:
        out.append(Launch("dr", "", "staged_bwd_dr.py.jinja", "staged_dr_kernel", "staged_dr",
                          "_space([64], [4], [2]) + _space([32], [4], [2, 3])"))
        out.append(Launch("dk", "split dr", "staged_bwd_dk_split.py.jinja", "staged_dk_kernel", "staged_dk",
                          "_space([64, 32], [4], [2])"))
    elif plan.split_dk:
        out.append(Launch("dk", "split", "staged_bwd_dk_de.py.jinja", "staged_dk_kernel", "staged_dk",
                          "_space([64], [8], [2, 3]) + _space([32], [8], [2])"))
    else:
        out.append(Launch("dk", "" if plan.delta else "no erase", f"staged_bwd_dk{erase}.py.jinja", "staged_dk_kernel",
                          "staged_dk", "_space([64, 32], [8], [2])" if plan.delta
                          else "_space([32, 64, 128], [8], [2])"))
    return tuple(out)


def autotuned(plan: Plan) -> tuple:
    """The launches of the staged forward and backward that go through an autotuned wrapper, each
    wrapper once, in the order of the module's TUNING_SPACE."""
    return tuple(l for l in forward(plan) + backward(plan) if l.wrapper)


def host_holes(plan: Plan) -> dict:
    """The staged host functions' holes (staged_host.py.jinja): the Python lines this plan has,
    "" where it has none."""
    keys_in_solve = plan.decay_kind == "diagonal" and not plan.delta
    wy_constants = ""
    if plan.raw_wy:
        wy_constants = ("# the WY stage's launches (plan.raw_wy): products over every chunk, then the chunks whose\n"
                        "# operands are not all finite made again, WY_FLAGS (chunk, head) pairs per program\n"
                        f"WY_PASSES = {'(False, True)' if plan.causal_nonfinite else '(False,)'}\n"
                        "WY_FLAGS = 16")
    return dict(
        # the output stage's launches: a causal one over the dirty chunks unless its branch takes them
        causal_passes="(False, True)" if plan.causal_nonfinite and not plan.output_dirty_branch else "(False,)",
        # the solve's: its exact path over the chunks that need it, with a decay per key channel
        exact_passes="(False, True)" if plan.decay_kind == "diagonal" else "(False,)",
        # the state pass makes the decayed keys itself in the backward (the forward's solve made them)
        state_keys_given=" KEYS_GIVEN=solved is None," if keys_in_solve else "",
        wy_constants=wy_constants,
        decayed_keys=("kg = torch.empty(B, T, HV, dtype=torch.float32, device=dev)  # one number per token (plan.raw_key)"
                      if plan.raw_key else "kg = torch.empty(B, T, HV, K, dtype=dt, device=dev)"),
        output_factors=("fo = torch.empty(B, T, HV, dtype=torch.float32, device=dev)  # plan.output_factors, stored "
                        "by the WY stage for the output stage" if plan.output_factors else ""),
        # staged_host_launches.jinja's: the solve's output (A, for the inverse's launch, where that
        # has one) and its decayed keys (a decay per key channel without an erase), the output
        # stage's factors as the WY stage's argument, the WY passes the fused solve leaves to it
        inverse_buffer=("a = torch.empty(B, T, HV, BT, dtype=torch.float32, device=dev)  # A, for the inverse's launch"
                        if plan.split_solve else ""),
        solve_output="a" if plan.split_solve else "ai",
        solve_keys="kg, g, " if keys_in_solve else "",
        output_factor_arg="fo, " if plan.output_factors else "",
        wy_passes_from="[1 if solved is None else 0:]" if plan.solve_wy_fused else "",
        solve_keys_dropped=('saved["kg"] = None  # the solve\'s decayed keys, for this state pass only (no erase: '
                            "staged_bwd reads none)" if keys_in_solve else ""),
    )
