"""IR -> kernel plan: every decision the templates need, as data. Templates never decide.

A plan holds the Triton text of each per-token quantity (the named holes), the loads, the
feature flags and the tile sizes. Features that are off leave no trace in the rendered source.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import sympy as sp

from lrdsl.frontend import ir, printer
from lrdsl.codegen.split import not_staged as _not_staged
from lrdsl.codegen.split import split_ir
from lrdsl.frontend.symbolic import simplified

from lrdsl.codegen.chain import Chain, chain
from lrdsl.codegen.texpr import code, number, var


@dataclass(frozen=True)
class Load:
    """One input tensor the kernel reads per token."""
    name: str  # validated identifier from the spec
    var: str  # block variable in the kernel
    kind: str  # "scalar" | "K" | "V"
    shared: bool  # indexed by key head (H) instead of value head (HV)
    l2norm: bool
    lo: str = ""  # declared range as Triton literals ("" where unbounded): values outside are
    hi: str = ""  # clamped into it, on every path (the reference too)
    per_head: bool = False  # a param: [HV], [HV, K] or [HV, V], loaded once per head, the same at every token


@dataclass(frozen=True)
class Step:
    """An assignment `var = expr` evaluated per token, in order."""
    var: str
    expr: str
    kind: str


@dataclass(frozen=True)
class Raw:
    """A product operand that is one input's tile as stored, times a per-token number."""
    ptr: str  # the input's pointer argument
    heads: str  # "H" (one per key head) or "HV"
    head: str  # "i_h" or "i_hv"
    factor: str  # Triton text of the per-token factor, "1.0" when none
    norm: bool = False  # the input is L2-normalised in the kernels (one more per-token number, 1/||x||)


@dataclass(frozen=True)
class Plan:
    mixer: str
    summary: tuple  # comment lines for the header of the generated module
    loads: tuple  # Load, ...
    aux: tuple  # (var, kind, decay expr, write expr), ...
    lets: tuple  # Step, ...
    decay_kind: str  # identity | constant | scalar | diagonal
    decay: str  # Triton text of d_t
    uses_head: bool  # some expression uses the head index h
    delta: bool
    order: str  # "left" | "right" ("" without delta)
    erase_a: str
    erase_c: str
    write_key: str
    write_value: str
    query: str
    log_decay: str  # Triton text of log d_t (chunked kernels cumulate decays in log space)
    # tuning (per spec and per GPU; the templates read these, never hard-code them)
    recurrent_bv: int = 32
    recurrent_warps: int = 1
    chunk_size: int = 64  # BT; 16 for per-channel decays, whose pairwise terms are built elementwise
    chunk_size_wide_k: int = 16  # BT when K > wide_k: [BT, K] fp32 dot operands must fit in shared memory
    wide_k: int = 128
    chunk_bv: int = 32
    chunk_bkt: int = 32  # key tile of the elementwise pairwise sums
    chunk_warps: int = 4
    chunk_stages: int = 1  # the state pass is sequential: deep software pipelining only costs shared memory
    # the staged forward (chunk_staged.py.jinja): WY stage, state pass, output stage
    staged: bool = False  # this spec has the staged forward (see staged_reason)
    staged_reason: str = ""  # why not, for the generated module's header
    staged_backward: bool = False  # the backward takes the staged kernels too
    staged_max_k: int = 128  # wider keys take the general kernels
    # the native staged forward of a decay after the erase (staged_rank2.py.jinja): order "right",
    # the erase along the write key, a decay per token or per key channel, no auxiliary states.
    # Its forward (no gradient) takes the transition on BT-token chunks, where the split ran two
    # tokens per token; the backward keeps the split (lrdsl/split.py)
    rank2: bool = False
    # the inputs that are the log-decay itself (a reset, -inf, is floored there as everywhere): the
    # native forward takes -inf in them, where any other non-finite input takes the split
    rank2_resets: tuple = ()
    staged_chunk: int = 64  # BT of the staged forward
    # the staged state pass may split the state's rows (key channels) over programs: no erase and
    # no expression that mixes key channels (an L2 norm of a key-side input)
    state_split_k: bool = False
    staged_sub: int = 16  # sub-blocks of the triangular solve (the smallest tensor-core tile)
    log_decay_floor: float = -20.0  # see _floored
    # a non-finite input reaches no earlier token in the chunked forward (common.jinja's
    # nonfinite_helpers); off: plain products, which spread its nan over its whole chunk
    causal_nonfinite: bool = True
    # a 16-token block whose decay stays above exp(-SPAN) in every key channel takes tensor cores
    # through the block's start (factors up to exp(SPAN), far from fp32's and bf16's exp(88))
    diagonal_block_span: float = 60.0
    # the per-channel staged backward's pairwise stage: key channels and warps per program, and a
    # register cap (ptxas' maxnreg; 0: none). Timed on the H200 (kda, B=4 T=4096 H=16): 4 warps
    # uncapped 2.11 ms (245 registers), 8 warps capped at 128 registers 2.23 ms. Since G comes
    # from memory (session 10): 4 warps uncapped 166 registers (3 programs per SM), capped at 128
    # (4 per SM) without spills for kda, gdn2 and gla; on the H200 (session 11, GPU time per
    # forward + backward) the cap took the stage from 1262 to 1125 us for kda, 1258 to 1123 for gdn2
    staged_pair_keys: int = 32
    staged_pair_warps: int = 4
    staged_pair_regs: int = 128
    chain: Chain | None = None  # the staged backward's generated chain rule (codegen/chain.py)
    chain_rows: int = 32  # tokens per program of the chain-rule kernel
    # (write key, write value, query) as Raw where each is an input's tile times a per-token
    # number, with no erase and no decay per key channel; else (). The staged state pass and output
    # stage then give tl.dot those tiles as loaded (keys transposed by their pointers), so wgmma
    # reads them from the pipelined shared-memory buffers; the per-token numbers (factors, decays)
    # go to the other operand or to the products' rows and columns (staged_vectors.py.jinja)
    raw: tuple = ()
    raw_output_bk: int = 64  # key channels per step of plan.raw's output stage (its products' loop)
    # the write value as Raw where the state pass and output stage may give its tile to tl.dot as
    # loaded (no erase; a factor only with plan.raw, which moves it to the key side), else None
    raw_value: Raw | None = None
    # the write key as Raw (its input may be normalised: Raw.norm) for an erase without a decay per
    # key channel and without auxiliary states, else None. The WY stage then stores one number per
    # token (the factor, 1/||k||, exp(G_end - G)) instead of the decayed keys u * exp(G_end - G)
    # ([T, K] in the operand dtype), and the state passes (forward and reverse) give tl.dot the key
    # tile as loaded, the number going to the value side of the product (to its rows in reverse)
    raw_key: Raw | None = None
    # (erase read c, write value z) as Raw where plan.raw_key is set, c is the same input's tile
    # times per-token numbers and z an input's tile as stored, else (). The WY stage then gives tl.dot
    # both tiles as loaded: c's numbers (1/||k||, exp(G)) scale the columns of X, a [BT, BT] tile,
    # instead of the [BT, K] tile's rows (staged_wy_raw.py.jinja)
    raw_wy: tuple = ()
    # the query as Raw (its input may be normalised) where the decay is not per key channel and
    # there are no auxiliary states, else None. The staged backward's dq stage then stores one number
    # per token (the factor, 1/||q||, the scale, exp(G)) instead of the decayed queries r * exp(G)
    # ([T, K] in the operand dtype), and the reverse state pass reads the query's tile (one
    # shared-memory buffer, not one per pipeline stage) and scales its tokens in registers
    raw_query: Raw | None = None
    # lets that read an auxiliary state and that the kernels' expressions read: (var, kind, pointer).
    # The aux pass makes them once per token, where the states are final, in the staged kernels'
    # operand dtype; the staged kernels load them instead of the states (one [BT, K] tile in the
    # operand dtype instead of an fp32 one, no elementwise math, fewer live tiles)
    stored_lets: tuple = ()
    aux_lets: tuple = ()  # block variables of the lets that read an auxiliary state (directly or not)
    # the staged kernels (or the aux pass itself: a later state, or a stored let of an earlier one)
    # read the auxiliary states per token; if not, the staged path does not store them (the final
    # states come from the carry between chunks)
    staged_reads_aux: bool = True
    # warps of the aux pass's launches. Its fix-up with stored lets holds several [BT, K] fp32 tiles
    # (ptxas, precond_deltanet K=128: 255 registers at 4 warps, 128 at 8), yet 4 warps ran faster on
    # the H200: both launches 226 us against 308 at 8 (B=4 T=4096 H=16, ninth session)
    aux_warps: int = 4
    # per auxiliary state, the Triton text of its floored log-decay (log alpha_t) where that decay
    # is one number per head and token, else "" (see aux_chunked)
    aux_log_decay: tuple = ()

    @property
    def aux_chunked(self) -> tuple:
        """Per auxiliary state: its decay alpha_t is one number per head and token, so the aux pass
        takes the chunked form instead of the pair scan over a [BT, D] tile of (alpha, beta) pairs:
        with G the cumulated log alpha of the chunk's rows, the chunk's map is a = exp(G_last),
        b = sum_s exp(G_last - G_s) beta_s (a weighted sum of rows, no scan), and its states
        P_t = exp(G_t) P_in + the pair scan of (alpha, beta) from zero. That fix-up as one [BT, BT] x
        [BT, D] product instead, in tf32x3 (ieee fp32 spilled 16 KB), took 2.2x the scan's time on the
        H200 (gdn2_atk: 340 against 153 us for both launches; eighteenth session). A decay per
        channel keeps the pair scan."""
        return tuple(bool(t) for t in self.aux_log_decay)

    @property
    def dstate_split_k(self) -> bool:
        """The reverse state pass splits the state's rows as the forward's does, but not with a
        decay per key channel (that backward, chunk_staged_bwd_diag.py.jinja, launches it whole)."""
        return self.state_split_k and self.decay_kind != "diagonal"

    @property
    def split_solve(self) -> bool:
        """The staged solve inverts I + A in a launch of its own (staged_inverse_kernel, one warp),
        A passing through global memory in fp32: an erase with a decay per key channel. Its pairwise
        stage needs four warps for its [16, K] tiles, and there every 16 x 16 tile (the forward
        substitution, the merging products) ran four times over, once per warp, in a 255-register
        program that held all ten blocks of A to its end."""
        return self.delta and self.decay_kind == "diagonal"

    @property
    def split_dk(self) -> bool:
        """The staged backward's last stage takes two launches (an erase, a decay per token and head
        at most: chunk_staged_bwd_dk.py.jinja): staged_de_kernel the gradients through the erase
        (from dE: z's, c's, dA and the log-decays' share through Cg and A), then staged_dk_kernel
        those through Rg, P and Kg (from dO and dS) and u's. In one launch (ptxas, sm_90a,
        gated_deltanet K = V = 128, eight warps) it held 255 registers and spilled 336 / 460 B at
        BV 64, one program per SM; on the H200 (B=4 T=4096 H=16) it took 810 us of 1.74 ms forward
        + backward. Split, neither spills in its value loop (staged_host.py.jinja's spaces). The
        second launch reads S0 and E again, and dA ([BT, BT] per chunk) and the log-decays' share
        from the first. Off, every example generates the one-launch kernel of session 13.
        Measured there (session 14, the H200, short shape): gated_deltanet's two took 217 + 558 us
        against 804 in one; deltanet's (no decay: its one launch spilled only 32 / 40 B) 177 + 382
        against 486, so without a decay per token the one launch stays.
        (plan.split_dr splits the second launch again.)"""
        return self.staged_backward and self.delta and self.decay_kind == "scalar"

    @property
    def split_dr(self) -> bool:
        """With plan.split_dk and the chain rule in staged_dk (plan.chain_in_dk), the second launch
        is two (chunk_staged_bwd_dk_split.py.jinja): staged_dr_kernel the gradients from dO (through
        Rg and P: r's, or the input's made from it, and dP for the next), then staged_dk_kernel those
        from dS (through Kg: u's) and the chain rule. In one, dRg, dP and dKg lived to the end beside
        the key tiles and the chain rule: 254 registers at eight warps, one program per SM, whose
        epilogue nothing overlapped (ptxas, sm_90a, gated_deltanet K = V = 128); apart, each runs
        at four warps, two programs per SM. On the H200 (session 23) gated_deltanet's one took 1158
        us at B=1 T=16384 H=32, the two 468 + 604 (237 + 287 at B=4 T=4096 H=16, against 558);
        forward + backward 3.70 -> 3.63 ms there. Without the chain rule in the kernel (its epilogue
        is short: precond_deltanet, channel_gates_scalar_decay) the two were slower: forward +
        backward 6.18-6.25 -> 6.40 ms and 4.25 -> 4.36 at the long shape, so those keep one."""
        return self.split_dk and self.chain_in_dk

    @property
    def solve_wy_fused(self) -> bool:
        """The staged forward's solve and WY stages are one kernel (staged_solve_wy_kernel,
        staged_solve_wy.py.jinja): where the WY stage takes raw tiles (plan.raw_wy: an erase, a decay
        per token and head at most, no auxiliary states). X = (I + A)^-1 goes from registers to W and
        U, and to memory only for the backward, which recomputes W and U from it with staged_wy_kernel
        (as does that kernel's REDO launch for the chunks the fused one flags). Two launches took
        100 + 93 us of gated_deltanet's 0.44 ms forward (H200, B=4 T=4096 H=16 K=V=128)."""
        return bool(self.raw_wy)

    @property
    def dr_factor(self) -> str:
        """What the staged kernel that makes r's gradient (staged_dk; staged_dq with a decay per key
        channel) multiplies it by: the scale where the chain rule is direct (Chain.direct: it is
        then q's gradient, and no chain kernel runs), else nothing."""
        return " * scale" if self.chain is not None and self.chain.direct else ""

    @property
    def chain_in_dk(self) -> bool:
        """staged_dk ends in the generated chain rule itself (chain_rule.py.jinja: _chain_tokens)
        and stores the inputs' gradients, so no chain kernel is generated: an erase and a decay per
        token and head at most (staged_dk then holds whole key rows of u's, c's and r's gradients
        and the log-decay's per token), and every input's gradient made from those (Chain.v_loop
        off: a value-channel input's is dz itself), with no auxiliary state, no offline solve and a
        chain rule that is not direct. The chain kernel read du, dc, dr and the keys and queries
        back (gated_deltanet, H200, B=4 T=4096 H=16: 123 us of 1.78 ms forward + backward)."""
        ch = self.chain
        return (ch is not None and not ch.direct and not ch.aux and not ch.extra and not ch.solve
                and not ch.v_loop and self.delta and self.decay_kind != "diagonal" and not self.stored_lets)

    @property
    def chain_at_dr(self) -> Load | None:
        """With plan.chain_in_dk, the key-channel input whose gradient is r's alone times a number
        (gated_deltanet's q: r = q * scale, through q's L2 norm), where no other input's gradient
        reads r's or that input: staged_dk makes it where it makes r's gradient (_chain_at_dr: the
        input's tile loaded again, its norm from it), so r's gradient is neither stored nor read
        back (nor rounded to the vector gradients' dtype on the way) and _chain_tokens does not load
        that input. Stored per value head as before (the host sums an input shared by grouped value
        heads). Else None. ptxas (sm_90a, gated_deltanet K = V = 128): staged_dk 255 -> 244
        registers, no spills either way; deltanet's one launch spills 16 / 24 B instead of 24 / 32."""
        ch = self.chain
        if not self.chain_in_dk:
            return None
        pairs = list(zip(self.loads, ch.grads))
        for l, g in pairs:
            if (l.kind == "K" and len(g.k_terms) == 1 and g.k_terms[0][0] == "r" and _is_number(g.k_terms[0][1])
                    and not g.g_term and not g.v_terms):
                break
        else:
            return None
        others = [h for m, h in pairs if m is not l]
        if any(v == "r" for h in others for v, _ in h.k_terms):
            return None
        texts = [t for _, t in ch.k_temps] + [ch.log_decay] + [h.g_term for h in others]
        texts += [t for h in others for _, t in (*h.k_terms, *h.v_terms)]
        if any(re.search(rf"\b{l.var}\b", t) for t in texts):  # _chain_tokens would still load it
            return None
        return l

    @property
    def value_tile(self) -> str:
        """The helper that makes the backward's write-value tiles (their only use there: a product's
        operand): _raw_v where the value is an input's tile as stored (plan.raw_value without a
        factor), so that tl.dot reads it from the shared-memory buffer it is loaded into, else
        _staged_v (the spec's expression, evaluated in registers)."""
        return "_raw_v" if self.raw_value is not None and self.raw_value.factor == "1.0" else "_staged_v"

    @property
    def decay_prefix(self) -> bool:
        """plan.raw with a log-decay per token and head (mamba2): a parallel launch before the state
        pass (staged_prefix_kernel) stores each chunk's cumulative log-decay G per token, and the
        state pass loads it (through its pipeline) and G_end a chunk ahead, to scale k^T's columns
        by exp(G_end - G). The pass made both from the raw numbers in its sequential loop, a
        cumulative sum and a sum across warps (shared memory, barriers) per chunk: on the H200 (B=1
        T=16384 H=32, session 15) it took 240 us where FLA's chunk_fwd_kernel_h, which loads G from
        its cumsum kernel, took 171 at the same tile (BK = BV = 64, four warps, four stages); with
        the prefix 193 + 11 us, the forward 470 -> 429 us against FLA's 460. (The value rows'
        pairwise form, G_end per state row, ran 12% slower than k^T's columns.)"""
        return bool(self.raw) and self.decay_kind == "scalar"

    @property
    def decay_grad(self) -> bool:
        """The staged backward makes the log-decay's gradient: a decay per token. A constant decay
        (a number per head, from the head index alone: retnet) has none, and staged_dk then skips
        what only that gradient reads (an S0 * dS sum per value tile, the per-token sums of dKg * Kg
        and of M = dP * P or r.dr - u.du, the reverse cumsum)."""
        return self.decay_kind in ("scalar", "diagonal")

    @property
    def decay_grad_from_vectors(self) -> bool:
        """staged_dk (a decay per token and head) takes the log-decay's gradient per token from the
        vectors' own gradients, r.dr - u.du (FLA's dqkwg: dq.q - dk.k), rather than from the row and
        column sums of M = dP * P, whose r u^T product is a dot of its own: without an erase. With
        one (c.dc joins in) ptxas (sm_90a, gated_deltanet K = V = 128) had spills rise from 324 to
        584 bytes at BV 64, from 244 to 560 at BV 32."""
        return self.decay_kind == "scalar" and not self.delta

    @property
    def raw_qk_output(self) -> bool:
        """The output stage of an erase gives tl.dot the query and key tiles as loaded, as plan.raw's
        does (_raw_output's key loop, the tiles going to shared memory by async copies): where both
        are an input's tile times per-token numbers (plan.raw_query and plan.raw_key). The numbers
        (1/||q|| and the scale, beta/||k||) scale the products' rows and P's columns: beta/||k||
        as the WY stage stored it (plan.output_factors); ||q||^2 the diagonal of a third product
        in the loop, q q^T, whose operands are the loop's own q tile, so that tl.dot alone reads
        the loop's tiles. Norms summed there by registers (a register read of the ring slots
        beside the async wgmma) made Triton 3.6 give q and k two shared-memory slots for three
        stages, the next copy overwriting the slot a pending wgmma read (wrong on the H200, session
        15); loads of their own before the loop read q and k twice (145 us against 140); 1/||q||
        stored by the solve stage too cost it a q load (+21 us). Before, the stage normalised both
        tiles in fp32 registers and stored them again for tl.dot. H200, gated_deltanet B=4 T=4096
        H=16 K=V=128: 139 us in two launches -> 117 in one (session 16)."""
        return self.raw_key is not None and self.raw_query is not None

    @property
    def output_factors(self) -> tuple:
        """The per-token numbers (fp32, [B, T, HV] each) that the WY stage (staged_solve_wy_kernel,
        or staged_wy_kernel) stores for the output stage with plan.raw_qk_output, which scales P's
        columns with them: the write key's number with its normaliser (beta/||k||, before the
        decay: "key"), made there anyway. () without plan.raw_qk_output."""
        return ("key",) if self.raw_qk_output else ()

    @property
    def output_dirty_branch(self) -> bool:
        """The output stage takes the chunks flagged dirty (common.jinja's _flag_dirty_chunks) in its
        one launch, a branch on each chunk's flag choosing the causal product (_dirty_dot), instead
        of a second launch (CAUSAL) over the flags whose programs nearly all return at once: with
        plan.raw_qk_output (and plan.causal_nonfinite). ptxas, sm_90a, gated_deltanet K = V = 128,
        three stages: BV 128 255 registers, no spills, 96 KB, two programs per SM as without the
        branch (228); BV 64 172 registers, two per SM (three without: 140)."""
        return self.raw_qk_output and self.causal_nonfinite

    @property
    def raw_write_factor(self) -> bool:
        """plan.raw's write key or value carries a per-token factor."""
        return any(r.factor != "1.0" for r in self.raw[:2])

    @property
    def vector_args(self) -> str:
        """The pointer arguments a per-token-vector helper takes: every input, every aux state, then
        every stored let."""
        return ", ".join([f"in_{l.name}" for l in self.loads] + [aux_ptr(a[0]) for a in self.aux]
                         + [s[2] for s in self.stored_lets])

    @property
    def kernel_lets(self) -> tuple:
        """The lets the staged kernels evaluate themselves: those that read no auxiliary state (the
        others are stored, or feed only stored ones)."""
        return tuple(s for s in self.lets if s.var not in self.aux_lets)

    @property
    def aux_ptrs(self) -> tuple:
        """(block variable, kind, pointer name) of every auxiliary state."""
        return tuple((a[0], a[1], aux_ptr(a[0])) for a in self.aux)

    @property
    def aux_io(self) -> tuple:
        """(block variable, kind, initial-state pointer, final-state pointer) of every auxiliary
        state ("auxin_"/"auxout_" cannot meet "aux_" names, nor each other)."""
        return tuple((a[0], a[1], "auxin_" + a[0][2:] + "_ptr", "auxout_" + a[0][2:] + "_ptr")
                     for a in self.aux)

    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _bounds(i: ir.Input) -> tuple:
    """The declared range of an input as literals; none where the kernels do not clamp it."""
    if not i.clamped:
        return "", ""
    return tuple(number(b) if b.is_finite else "" for b in (i.lo, i.hi))


def aux_ptr(block_var: str) -> str:
    """Pointer name of an auxiliary state's buffer, from its block variable b_<name>."""
    return "aux_" + block_var[2:] + "_ptr"


def plan(m: ir.Mixer) -> Plan:
    loads = tuple(Load(i.name, var(i.name), i.kind, i.shared, i.l2norm, *_bounds(i)) for i in m.inputs)
    loads += tuple(Load(p.name, var(p.name), p.kind, False, False, *_bounds(p), per_head=True) for p in m.params)
    not_staged = _not_staged(m)
    rank2 = _rank2(m)
    raw = _raw_operands(m) if not not_staged else ()
    aux_lets = _aux_lets(m)
    summary = (f"mixer {m.name}",
               *("  " + line for line in printer.explicit(m).splitlines()[1:]))
    return Plan(
        mixer=m.name,
        summary=summary,
        loads=loads,
        aux=tuple((var(a.name), a.kind, code(a.decay), code(a.write)) for a in m.aux),
        lets=tuple(Step(var(lt.name), code(lt.expr), lt.kind) for lt in m.lets),
        decay_kind=m.decay.kind,
        decay=code(m.decay.value),
        uses_head=any(e.has(ir.HEAD) for e, _ in m.expressions()),
        delta=m.delta is not None,
        order=m.delta.order if m.delta else "",
        erase_a=code(m.delta.a) if m.delta else "",
        erase_c=code(m.delta.c) if m.delta else "",
        write_key=code(m.write.key),
        write_value=code(m.write.value),
        query=code(m.query),
        log_decay=_floored(m),
        chunk_size=16 if m.decay.kind == "diagonal" else 64,
        staged=not not_staged,
        staged_reason=not_staged + (SPLIT_NOTE if not_staged and split_ir(m) is not None else ""),
        staged_backward=not not_staged,
        rank2=rank2,
        rank2_resets=_log_decay_inputs(m) if rank2 else (),
        state_split_k=m.delta is None and not any(i.l2norm and i.kind == "K" for i in m.inputs),
        chain=chain(m) if not not_staged else None,
        chain_rows=8 if m.aux else 32,  # aux specs: 16 rows took 255 registers (ptxas), 32 spilled
        raw=raw,
        raw_value=_raw_value(m, raw) if not not_staged else None,
        raw_key=_raw_key(m) if not not_staged else None,
        raw_wy=_raw_wy(m) if not not_staged else (),
        raw_query=_raw_query(m) if not not_staged else None,
        stored_lets=tuple((var(lt.name), lt.kind, "let_" + lt.name + "_ptr") for lt in _stored_lets(m, aux_lets)),
        aux_lets=tuple(var(lt.name) for lt in aux_lets),
        staged_reads_aux=len(m.aux) > 1 or bool(_body_symbols(m) & {a.name for a in m.aux}),
        aux_log_decay=tuple(_aux_log_decay(m, a) for a in m.aux),
    )


def _rank2(m: ir.Mixer) -> bool:
    """plan.rank2: S_t = D_t (I - a_t c_t^T) S_{t-1} + u_t z_t^T with a = u, D one number or one per
    key channel per token, and nothing the staged forward leaves out (auxiliary states, the offline
    solve, an L2 norm over the value channels)."""
    return (m.delta is not None and m.delta.order == "right" and simplified(m.delta.a - m.write.key) == 0
            and m.decay.kind in ("scalar", "diagonal") and not m.aux and m.solve_lam is None
            and not any(i.l2norm and i.kind == "V" for i in m.inputs))


def _log_decay_inputs(m: ir.Mixer) -> tuple:
    """The inputs that are the log-decay itself (plan.rank2_resets)."""
    return tuple(i.name for i in m.inputs if i.log and simplified(m.log_decay() - i.symbol) == 0)


def _raw_operands(m: ir.Mixer) -> tuple:
    """plan.raw: the write key, write value and query as Raw, or () unless all three are."""
    if m.delta is not None or m.decay.kind == "diagonal":
        return ()
    parts = tuple(_raw(m, e, kind) for e, kind in ((m.write.key, "K"), (m.write.value, "V"), (m.query, "K")))
    return parts if all(parts) else ()


def _raw_key(m: ir.Mixer) -> Raw | None:
    """plan.raw_key."""
    if m.delta is None or m.decay.kind == "diagonal" or m.aux:
        return None
    return _raw(m, m.write.key, "K", normalised=True)


def _raw_wy(m: ir.Mixer) -> tuple:
    """plan.raw_wy."""
    key = _raw_key(m)
    if key is None:
        return ()
    c, z = _raw(m, m.delta.c, "K", normalised=True), _raw(m, m.write.value, "V")
    if c is None or z is None or z.factor != "1.0" or (c.ptr, c.heads) != (key.ptr, key.heads):
        return ()
    return c, z


def _raw_query(m: ir.Mixer) -> Raw | None:
    """plan.raw_query."""
    if m.decay.kind == "diagonal" or m.aux:
        return None
    return _raw(m, m.query, "K", normalised=True)


def _raw_value(m: ir.Mixer, raw: tuple) -> Raw | None:
    """plan.raw_value, given plan.raw."""
    v = _raw(m, m.write.value, "V") if m.delta is None else None
    return v if v is not None and (v.factor == "1.0" or raw) else None


def _raw(m: ir.Mixer, e, kind: str, normalised: bool = False) -> Raw | None:
    """e as one input of this kind (unclamped; not normalised, unless `normalised` allows it) times
    per-token numbers, or None."""
    kinds = m.kinds()
    e = m.inline_lets(e)
    tiles = [a for a in sp.Mul.make_args(e) if any(kinds[s.name] != "scalar" for s in a.free_symbols)]
    if len(tiles) != 1 or not isinstance(tiles[0], sp.Symbol):
        return None
    i = next((i for i in m.inputs if i.name == tiles[0].name), None)
    if i is None or i.kind != kind or (i.l2norm and not normalised) or _bounds(i) != ("", ""):
        return None
    return Raw(f"in_{i.name}", "H" if i.shared else "HV", "i_h" if i.shared else "i_hv", code(e / tiles[0]), i.l2norm)


def _aux_lets(m: ir.Mixer) -> tuple:
    """The lets that read an auxiliary state, directly or through an earlier let."""
    names = {a.name for a in m.aux}
    out = []
    for lt in m.lets:
        if any(s.name in names for s in lt.expr.free_symbols):
            names.add(lt.name)
            out.append(lt)
    return tuple(out)


def _body_symbols(m: ir.Mixer) -> set:
    """The names the kernels' own expressions (decay, erase, write, query) read."""
    body = [m.decay.value, m.write.key, m.write.value, m.query]
    body += [m.delta.a, m.delta.c] if m.delta is not None else []
    return {s.name for e in body for s in e.free_symbols}


def _stored_lets(m: ir.Mixer, aux_lets: tuple) -> tuple:
    """The lets of aux_lets (_aux_lets) that the kernels' own expressions read."""
    read = _body_symbols(m)
    return tuple(lt for lt in aux_lets if lt.name in read)


def _floored(m: ir.Mixer) -> str:
    """Triton text of the per-token log-decay, floored: the chunked kernels cumulate it in fp32
    within a chunk, and one token at -1e8 (or -inf, a reset) would swamp the differences of the
    tokens after it (or make them nan). What the floor changes is below fp32's resolution."""
    text = code(m.log_decay())
    if m.decay.kind in ("scalar", "diagonal"):
        return f"_floor_log({text})"
    return text


def _aux_log_decay(m: ir.Mixer, a: ir.Aux) -> str:
    """plan.aux_log_decay's entry for auxiliary state a: its log-decay floored as _floored floors
    the main one (one token at -inf, a reset, would turn the chunk's cumulated sums' differences
    into nan; nan stays nan), where every symbol of the decay is one number per head and token;
    else ""."""
    decay = m.inline_lets(a.decay)
    kinds = m.kinds()
    if any(kinds[s.name] != "scalar" for s in decay.free_symbols):
        return ""
    return f"_floor_log({code(ir.log_of(decay))})"


SPLIT_NOTE = ("; Mixer.chunk runs the staged kernels of its split spec instead (two tokens per token,"
              " lrdsl/split.py) where K <= the staged limit")
