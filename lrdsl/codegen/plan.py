"""IR -> kernel plan: every decision the templates need, as data. Templates never decide.

A plan holds the Triton text of each per-token quantity (the named holes), the loads, the
feature flags and the tile sizes. Features that are off leave no trace in the rendered source.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from lrdsl.codegen import chain_order, product, split
from lrdsl.codegen import raw as operands
from lrdsl.codegen.chain import Chain, chain
from lrdsl.codegen.raw import Raw
from lrdsl.codegen.raw import bounds as _bounds
from lrdsl.codegen.readouts import fused
from lrdsl.codegen.split import not_staged as _not_staged
from lrdsl.codegen.split import split_ir
from lrdsl.codegen.sub_tokens import SubTokenRows
from lrdsl.codegen.texpr import code, var
from lrdsl.frontend import ir, printer
from lrdsl.frontend.symbolic import simplified


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
class Aux:
    """One auxiliary state of the spec (P_t = alpha_t P_{t-1} + beta_t) and the names the kernels
    give it, all made from its validated name: the pointer prefixes ("aux_", "auxin_", "auxout_", "auxall_")
    differ in their fourth letter, so no two names of two states meet."""
    name: str  # the spec's name of the state
    kind: str  # "K" | "V"
    decay: str  # Triton text of alpha_t
    write: str  # Triton text of beta_t
    # Triton text of the floored log alpha_t where alpha_t is one number per head and token, else ""
    log_decay: str = ""

    @property
    def var(self) -> str:
        """Its block variable in the kernels."""
        return var(self.name)

    @property
    def ptr(self) -> str:
        """Its per-token buffer (the aux pass's output, the staged kernels' input)."""
        return f"aux_{self.name}_ptr"

    @property
    def init_ptr(self) -> str:
        return f"auxin_{self.name}_ptr"

    @property
    def final_ptr(self) -> str:
        return f"auxout_{self.name}_ptr"

    @property
    def all_ptr(self) -> str:
        """Its value after every token (the recurrent kernel's, for a multi-token step)."""
        return f"auxall_{self.name}_ptr"

    @property
    def chunked(self) -> bool:
        """The aux pass takes the chunked form (a weighted sum of rows per chunk) instead of the pair
        scan: its decay is one number per head and token (docs/kernels/host.md)."""
        return bool(self.log_decay)


@dataclass(frozen=True)
class Tuning:
    """Tile sizes, warps and launch shapes (per spec and per GPU; the templates read these, never
    hard-code them). Measurements behind the defaults: docs/kernels/host.md."""
    recurrent_bv: int = 32
    recurrent_warps: int = 1
    # few sequences (decoding at small B): value tiles halve down to recurrent_min_bv while the launch
    # has fewer than recurrent_min_programs programs (not measured yet: benchmarks/device/decode.sh)
    recurrent_min_bv: int = 8
    recurrent_min_programs: int = 256
    # decoding (T = 1) with at least recurrent_wide_programs programs at recurrent_bv: value tiles of
    # recurrent_wide_bv with recurrent_wide_warps (the state's traffic bounds the call: docs/kernels/host.md)
    recurrent_wide_programs: int = 8192
    recurrent_wide_bv: int = 64
    recurrent_wide_warps: int = 4
    chunk_size: int = 64  # BT; 16 for per-channel decays, whose pairwise terms are built elementwise
    chunk_size_wide_k: int = 16  # BT when K > wide_k: [BT, K] fp32 dot operands must fit in shared memory
    wide_k: int = 128
    chunk_bv: int = 32
    chunk_bkt: int = 32  # key tile of the elementwise pairwise sums
    chunk_warps: int = 4
    chunk_stages: int = 1  # the state pass is sequential: deep software pipelining only costs shared memory
    staged_max_k: int = 128  # wider keys take the general kernels
    staged_chunk: int = 64  # BT of the staged forward
    staged_sub: int = 16  # sub-blocks of the triangular solve (the smallest tensor-core tile)
    # the per-channel staged backward's pairwise stage: key channels and warps per program, and a
    # register cap (ptxas' maxnreg; 0: none)
    staged_pair_keys: int = 64
    staged_pair_warps: int = 4
    staged_pair_regs: int = 0
    staged_pair_sub: int = 32  # its row and column blocks: a power of two from 16 to staged_chunk
    chain_rows: int = 32  # tokens per program of the chain-rule kernel
    raw_output_bk: int = 64  # key channels per step of plan.raw's output stage (its products' loop)
    aux_warps: int = 4  # warps of the aux pass's launches


@dataclass(frozen=True)
class Route:
    """Which kernels a plan takes, each decision a plain flag (made by route() alone). Tests and
    experiments choose another with dataclasses.replace(plan, route=dataclasses.replace(plan.route, ...))."""
    staged: bool  # the staged forward (else staged_reason says why not)
    staged_reason: str
    staged_backward: bool  # the backward takes the staged kernels too
    rank2: bool  # the native staged forward of a decay after the erase (staged_rank2.py.jinja)
    state_split_k: bool  # the staged state pass splits the state's rows (key channels) over programs
    dstate_split_k: bool  # the reverse state pass does too
    staged_reads_aux: bool  # the staged kernels read the auxiliary states per token (else not stored)
    split_solve: bool  # the staged solve inverts I + A in a launch of its own (staged_inverse_kernel)
    solve_wy_fused: bool  # the solve and WY stages are one kernel (staged_solve_wy_kernel)
    decay_prefix: bool  # a launch before the state pass stores each chunk's cumulative log-decay
    raw_qk_output: bool  # the output stage gives tl.dot the query and key tiles as loaded
    output_dirty_branch: bool  # that stage takes the dirty chunks by a branch, not a second launch
    split_dk: bool  # the staged backward's last stage takes two launches (staged_de, staged_dk)
    split_dr: bool  # and its second launch two (staged_dr, staged_dk)
    chain_in_dk: bool  # staged_dk ends in the generated chain rule (no chain kernel)
    decay_grad: bool  # the staged backward makes the log-decay's gradient
    decay_grad_from_vectors: bool  # from r.dr - u.du rather than from M = dP * P's sums

    def __post_init__(self):
        if self.split_dr and not self.split_dk:
            raise ValueError("Route: split_dr splits split_dk's second launch; it needs split_dk")
        if self.output_dirty_branch and not self.raw_qk_output:
            raise ValueError("Route: output_dirty_branch is a branch of the raw_qk_output stage")


def route(*, staged_reason: str, rank2: bool, delta: bool, decay_kind: str, key_norm: bool,
          reads_aux: bool, chain: Chain | None, stored_lets: tuple, raw: tuple, raw_key, raw_query,
          raw_wy: tuple) -> Route:
    """The route of a spec, from the facts its plan reads (the reasons: docs/kernels/host.md)."""
    staged = not staged_reason
    per_head_decay = decay_kind != "diagonal"  # at most one number per token and head
    state_split_k = not delta and not key_norm  # nothing mixes key channels
    chain_in_dk = (chain is not None and not chain.direct and not chain.aux and not chain.extra
                   and not chain.solve and not chain.v_loop and delta and per_head_decay and not stored_lets)
    split_dk = staged and delta and decay_kind == "scalar"
    raw_qk_output = raw_key is not None and raw_query is not None
    return Route(
        staged=staged,
        staged_reason=staged_reason,
        staged_backward=staged,
        rank2=rank2,
        state_split_k=state_split_k,
        dstate_split_k=state_split_k and per_head_decay,
        staged_reads_aux=reads_aux,
        split_solve=delta and not per_head_decay,
        solve_wy_fused=bool(raw_wy),
        decay_prefix=bool(raw) and decay_kind == "scalar",
        raw_qk_output=raw_qk_output,
        output_dirty_branch=raw_qk_output,
        split_dk=split_dk,
        split_dr=split_dk and chain_in_dk,
        chain_in_dk=chain_in_dk,
        decay_grad=decay_kind in ("scalar", "diagonal"),
        decay_grad_from_vectors=decay_kind == "scalar" and not delta,
    )


def _route_flag(name: str) -> property:
    return property(lambda self: getattr(self.route, name), doc=f"plan.route.{name}")


def _tuning(name: str) -> property:
    return property(lambda self: getattr(self.tuning, name), doc=f"plan.tuning.{name}")


@dataclass(frozen=True)
class Plan(SubTokenRows):
    """Everything the templates read: the spec's holes (Triton text), the operands the staged
    kernels take as loaded, the route and the tuning."""
    # the spec's holes
    mixer: str
    summary: tuple  # comment lines for the header of the generated module
    loads: tuple  # Load, ...
    aux: tuple  # Aux, ...
    lets: tuple  # Step, ...
    decay_kind: str  # identity | constant | scalar | diagonal
    decay: str  # Triton text of d_t
    uses_head: bool  # some expression uses the head index h
    delta: bool
    order: str  # "left" | "right" | "sum" ("" without delta)
    erase_a: str
    erase_c: str
    write_key: str
    write_value: str
    query: str
    log_decay: str  # Triton text of log d_t (chunked kernels cumulate decays in log space)
    route: Route
    tuning: Tuning = Tuning()
    # the inputs that are the log-decay itself (a reset, -inf, is floored there as everywhere): the
    # native forward of plan.rank2 takes -inf in them, where any other non-finite input takes the split
    rank2_resets: tuple = ()
    # "right": the transition multiplies the state's rows from the right (S N, the value side): d_t,
    # e_a and e_c are [V] vectors, and the module has the value-side kernels alone
    side: str = "left"
    # side "both" (M S N): N's decay kind, decay, order and erase directions (M's are the fields above)
    n_decay_kind: str = ""
    n_decay: str = ""
    n_order: str = ""
    n_erase_a: str = ""
    n_erase_c: str = ""
    log_decay_floor: float = -20.0  # see _floored
    # a non-finite input reaches no earlier token in the chunked forward (common.jinja's
    # nonfinite_helpers); off: plain products, which spread its nan over its whole chunk
    causal_nonfinite: bool = True
    # a 16-token block whose decay stays above exp(-SPAN) in every key channel takes tensor cores
    # through the block's start (factors up to exp(SPAN), far from fp32's and bf16's exp(88))
    diagonal_block_span: float = 60.0
    chain: Chain | None = None  # the staged backward's generated chain rule (codegen/chain.py)
    # (write key, write value, query) as Raw where each is an input's tile times a per-token
    # number, with no erase and no decay per key channel; else (). The staged state pass and output
    # stage then give tl.dot those tiles as loaded, the per-token numbers going to the other operand
    # or to the products' rows and columns (staged_vectors.py.jinja)
    raw: tuple = ()
    # the write value as Raw where the state pass and output stage may give its tile to tl.dot as
    # loaded (no erase; a factor only with plan.raw, which moves it to the key side), else None
    raw_value: Raw | None = None
    # the write key as Raw (its input may be normalised) for an erase without a decay per key channel
    # and without auxiliary states, else None: the WY stage stores one number per token instead of
    # the decayed keys, and the state passes give tl.dot the key tile as loaded
    raw_key: Raw | None = None
    # (erase read c, write value z) as Raw where plan.raw_key is set, c is the same input's tile
    # times per-token numbers and z an input's tile as stored, else (): the WY stage gives tl.dot
    # both tiles as loaded (staged_wy.py.jinja, its raw form)
    raw_wy: tuple = ()
    # the query as Raw (its input may be normalised) where the decay is not per key channel and
    # there are no auxiliary states, else None: the dq stage stores one number per token instead of
    # the decayed queries, and the reverse state pass scales the query tile's tokens in registers
    raw_query: Raw | None = None
    # lets that read an auxiliary state and that the kernels' expressions read: (var, kind, pointer).
    # The aux pass makes them once per token, where the states are final; the staged kernels load
    # them instead of the states
    stored_lets: tuple = ()
    aux_lets: tuple = ()  # block variables of the lets that read an auxiliary state (directly or not)
    # the staged kernels read the state before each token's update, S_prev^T r (codegen/readouts.py's
    # fused): P strictly causal, the query decayed by G - g; plus, where bonus_key is not "", the
    # bonus (r . c) z on P's diagonal, c (the erase read, unused without an erase) its key vector
    readout_before: bool = False
    bonus_key: str = ""
    # a product's direct sub-mixer (codegen/product.py) with n = sub_tokens > 0 steps per token: the
    # staged kernels read row r of an input of sub_steps (the keys, the values) at row r // n of the
    # tensor of step r % n, element offset off_<name>_<j> from step 0's (the host's _sub_args), and
    # row r of sub_query (the query) at row r // n of the spec's one tensor. Their argument sub_n is
    # n there, and 1 where the host is given the interleaved [B, n T, ...] tensors instead
    sub_tokens: int = 0
    sub_steps: tuple = ()  # (the erase and write key, the write value: dz is its gradient)
    sub_query: str = ""
    # the split's mixer (codegen/split.py, sub_tokens = 2): the inputs read at row r // 2 of their
    # one tensor, as sub_query (every input but the phase, sub_steps' one)
    sub_reads: tuple = ()
    # (input, phase) of those whose gradient is zero in the other phase (codegen/split.py's
    # grad_phases): stored at their token from that phase's rows alone; the others' at every row
    sub_once: tuple = ()

    # the route's decisions and the tuning, under the names the templates read
    staged = _route_flag("staged")
    staged_reason = _route_flag("staged_reason")
    staged_backward = _route_flag("staged_backward")
    rank2 = _route_flag("rank2")
    state_split_k = _route_flag("state_split_k")
    dstate_split_k = _route_flag("dstate_split_k")
    staged_reads_aux = _route_flag("staged_reads_aux")
    split_solve = _route_flag("split_solve")
    solve_wy_fused = _route_flag("solve_wy_fused")
    decay_prefix = _route_flag("decay_prefix")
    raw_qk_output = _route_flag("raw_qk_output")
    split_dk = _route_flag("split_dk")
    split_dr = _route_flag("split_dr")
    chain_in_dk = _route_flag("chain_in_dk")
    decay_grad = _route_flag("decay_grad")
    decay_grad_from_vectors = _route_flag("decay_grad_from_vectors")
    recurrent_bv = _tuning("recurrent_bv")
    recurrent_warps = _tuning("recurrent_warps")
    recurrent_min_bv = _tuning("recurrent_min_bv")
    recurrent_min_programs = _tuning("recurrent_min_programs")
    recurrent_wide_programs = _tuning("recurrent_wide_programs")
    recurrent_wide_bv = _tuning("recurrent_wide_bv")
    recurrent_wide_warps = _tuning("recurrent_wide_warps")
    chunk_size = _tuning("chunk_size")
    chunk_size_wide_k = _tuning("chunk_size_wide_k")
    wide_k = _tuning("wide_k")
    chunk_bv = _tuning("chunk_bv")
    chunk_bkt = _tuning("chunk_bkt")
    chunk_warps = _tuning("chunk_warps")
    chunk_stages = _tuning("chunk_stages")
    staged_max_k = _tuning("staged_max_k")
    staged_chunk = _tuning("staged_chunk")
    staged_sub = _tuning("staged_sub")
    staged_pair_keys = _tuning("staged_pair_keys")
    staged_pair_warps = _tuning("staged_pair_warps")
    staged_pair_regs = _tuning("staged_pair_regs")
    staged_pair_sub = _tuning("staged_pair_sub")
    chain_rows = _tuning("chain_rows")
    raw_output_bk = _tuning("raw_output_bk")
    aux_warps = _tuning("aux_warps")

    @property
    def output_dirty_branch(self) -> bool:
        """The route's dirty-chunk branch, where there are dirty chunks to take (causal_nonfinite)."""
        return self.route.output_dirty_branch and self.causal_nonfinite

    @property
    def erase_read_exclusive(self) -> bool:
        """The erase reads the state before this token's decay (orders "right" and "sum"): in the
        chunk's decayed frame its read direction c carries the decay cumulated before the token,
        G - g ("Gx"), where "left" has G."""
        return self.order in ("right", "sum")

    @property
    def erase_read_shift(self) -> str:
        """Triton text that takes G (a block variable b_G, cumulated log-decays) to c's exponent in
        the staged kernels: " - b_gl", the token's own log-decay, where the erase reads before the
        decay (plan.erase_read_exclusive), else "". Never an exponent of -gl alone."""
        return " - b_gl" if self.erase_read_exclusive else ""

    @property
    def erase_write_exclusive(self) -> bool:
        """The erase's direction a is decayed by this token's decay after it is written (order
        "right": D (I - a c^T)): a carries Gx too; in "left" and "sum" a is written after the decay
        and carries G."""
        return self.order == "right"

    @property
    def head_index(self) -> str:
        """The kernels' statement that makes h_f, the head index as a number, where an expression
        reads it ("" where none does)."""
        return "h_f = i_hv.to(tl.float32)" if self.uses_head else ""

    @property
    def dr_factor(self) -> str:
        """What the staged kernel that makes r's gradient (staged_dk; staged_dq with a decay per key
        channel) multiplies it by: the scale where the chain rule is direct (Chain.direct: it is
        then q's gradient, and no chain kernel runs), else nothing."""
        return " * scale" if self.chain is not None and self.chain.direct else ""

    @property
    def chain_at_dr(self) -> Load | None:
        """With plan.chain_in_dk, the key-channel input whose gradient is r's alone times a number
        (gated_deltanet's q: r = q * scale, through q's L2 norm), where no other input's gradient
        reads r's or that input: staged_dk makes it where it makes r's gradient (_chain_at_dr), so
        r's gradient is neither stored nor read back. Else None."""
        return self.chain.made_from(self.loads, "r") if self.chain_in_dk else None

    @property
    def chain_at_dc(self) -> Load | None:
        """With plan.split_dr (staged_de makes c's whole gradient), the key-channel input whose
        gradient is c's alone times a number (comba's p: c = p through its L2 norm), where no
        other input's gradient reads c's or that input: staged_de makes it where it makes c's
        gradient (_chain_at_dc), so c's gradient is neither stored nor read back (nor that input
        loaded in staged_dk's epilogue). Not with sub-token rows. Else None."""
        if not self.split_dr or self.sub_steps:
            return None
        at = self.chain.made_from(self.loads, "c")
        return None if at is not None and at == self.chain_at_dr else at

    @property
    def chain_ats(self) -> tuple:
        """(vector, input, first lines) of each vector gradient that the kernel making it takes on
        to its input's (plan.chain_at_dr, plan.chain_at_dc): one _chain_at_d<vector> each, whose
        first lines move a sub-token input's pointers and scale r's gradient."""
        out = []
        if self.chain_at_dr:
            out.append(("r", self.chain_at_dr, (*self.chain_at_start, "b_dr = b_dr * scale")))
        if self.chain_at_dc:
            out.append(("c", self.chain_at_dc, ()))
        return tuple(out)

    @property
    def chain_stored(self) -> tuple:
        """The vector gradients _chain_tokens reads from memory ("c", "r"), but those taken on to
        their input's where they are made (plan.chain_ats)."""
        return tuple(v for v in ("c", "r") if v not in {a[0] for a in self.chain_ats})

    @property
    def chain_steps(self) -> tuple:
        """_chain_tokens' statements (plan.chain_in_dk), in the order that keeps the fewest tiles
        live (codegen/chain_order.py)."""
        return chain_order.order(chain_order.statements(self)) if self.chain_in_dk else ()

    @property
    def chain_start(self) -> tuple:
        """_chain_tokens' lines that move the pointers of its inputs read by sub-token to row0's
        token (SubTokenRows.sub_chunk_start), after its masks (made before them, delta_product2's
        staged_dk spilled as much as without the move: ptxas, 2026-12-06); () without."""
        return self.sub_chunk_start((l.name, "K") for l in self.loads if l.kind == "K" and l != self.chain_at_dr)

    @property
    def chain_at_start(self) -> tuple:
        """_chain_at_dr's lines likewise, for plan.chain_at_dr's input."""
        return self.sub_chunk_start([(self.chain_at_dr.name, "K")]) if self.chain_at_dr else ()

    @property
    def value_tile(self) -> str:
        """The helper that makes the backward's write-value tiles (their only use there: a product's
        operand): _raw_v where the value is an input's tile as stored (plan.raw_value without a
        factor), so that tl.dot reads it from the shared-memory buffer it is loaded into, else
        _staged_v (the spec's expression, evaluated in registers)."""
        return "_raw_v" if self.raw_value is not None and self.raw_value.factor == "1.0" else "_staged_v"

    @property
    def output_factors(self) -> tuple:
        """The per-token numbers (fp32, [B, T, HV] each) that the WY stage stores for the output
        stage with plan.raw_qk_output, which scales P's columns with them: the write key's number
        with its normaliser (beta/||k||, before the decay: "key"). () without plan.raw_qk_output."""
        return ("key",) if self.raw_qk_output else ()

    @property
    def raw_write_factor(self) -> bool:
        """plan.raw's write key or value carries a per-token factor."""
        return any(r.factor != "1.0" for r in self.raw[:2])

    @property
    def vector_args(self) -> str:
        """The pointer arguments a per-token-vector helper takes: every input, every aux state, then
        every stored let."""
        return ", ".join([f"in_{l.name}" for l in self.loads] + ([self.sub_args] if self.sub_tokens else [])
                         + [a.ptr for a in self.aux] + [s[2] for s in self.stored_lets])

    @property
    def kernel_lets(self) -> tuple:
        """The lets the staged kernels evaluate themselves: those that read no auxiliary state (the
        others are stored, or feed only stored ones)."""
        return tuple(s for s in self.lets if s.var not in self.aux_lets)

    @property
    def aux_ptrs(self) -> tuple:
        """(block variable, kind, pointer name) of every auxiliary state (staged_vectors.py.jinja's
        view of plan.aux)."""
        return tuple((a.var, a.kind, a.ptr) for a in self.aux)

    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def plan(m: ir.Mixer) -> Plan:
    if m.steps:  # its kernels are its one-step sub-mixer's (codegen/product.py), planned on their own
        raise ValueError(f"mixer '{m.name}' is a product of steps: plan its sub-mixer, codegen.product.sub_ir(m)")
    loads = tuple(Load(i.name, var(i.name), i.kind, i.shared, i.l2norm, *_bounds(i)) for i in m.inputs)
    loads += tuple(Load(p.name, var(p.name), p.kind, False, False, *_bounds(p), per_head=True) for p in m.params)
    not_staged = _not_staged(m)
    rank2 = _rank2(m)
    raw = operands.raw_operands(m) if not not_staged else ()
    aux_lets = _aux_lets(m)
    summary = (f"mixer {m.name}",
               *("  " + line for line in printer.explicit(m).splitlines()[1:]))
    staged_reason = not_staged + (SPLIT_NOTE if not_staged and split_ir(m) is not None else "")
    the_chain = chain(m) if not not_staged else None
    stored_lets = tuple((var(lt.name), lt.kind, "let_" + lt.name + "_ptr") for lt in _stored_lets(m, aux_lets))
    raw_key = operands.raw_key(m) if not not_staged else None
    raw_query = operands.raw_query(m) if not not_staged else None
    raw_wy = operands.raw_wy(m) if not not_staged else ()
    before = fused(m)
    p = Plan(
        mixer=m.name,
        summary=summary,
        loads=loads,
        aux=tuple(Aux(a.name, a.kind, code(a.decay), code(a.write), _aux_log_decay(m, a)) for a in m.aux),
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
        query=code(before.query if before else m.query),
        log_decay=_floored(m),
        route=route(staged_reason=staged_reason, rank2=rank2, delta=m.delta is not None, decay_kind=m.decay.kind,
                    key_norm=any(i.l2norm and i.kind == "K" for i in m.inputs),
                    reads_aux=len(m.aux) > 1 or bool(_body_symbols(m) & {a.name for a in m.aux}),
                    chain=the_chain, stored_lets=stored_lets, raw=raw, raw_key=raw_key, raw_query=raw_query,
                    raw_wy=raw_wy),
        # per-channel decays build their pairwise terms elementwise; chain_rows: docs/kernels/host.md
        tuning=Tuning(chunk_size=16 if m.decay.kind == "diagonal" else 64, chain_rows=8 if m.aux else 32),
        rank2_resets=_log_decay_inputs(m) if rank2 else (),
        chain=the_chain,
        raw=raw,
        raw_value=operands.raw_value(m, raw) if not not_staged else None,
        raw_key=raw_key,
        raw_wy=raw_wy,
        raw_query=raw_query,
        stored_lets=stored_lets,
        aux_lets=tuple(var(lt.name) for lt in aux_lets),
        side=m.side,
        **_n_fields(m),
        readout_before=before is not None,
        bonus_key=code(before.bonus_key) if before is not None and before.bonus_key is not None else "",
    )
    return split.with_sub_tokens(m, product.with_sub_tokens(m, p))


def _n_fields(m: ir.Mixer) -> dict:
    """Plan fields of a two-sided mixer's N (none for the others)."""
    if m.side != "both":
        return {}
    n = m.right_part()
    return dict(n_decay_kind=n.decay.kind, n_decay=code(n.decay.value), n_order=n.delta.order if n.delta else "",
                n_erase_a=code(n.delta.a) if n.delta else "", n_erase_c=code(n.delta.c) if n.delta else "")


def _rank2(m: ir.Mixer) -> bool:
    """plan.rank2: S_t = D_t (I - a_t c_t^T) S_{t-1} + u_t z_t^T with a = u, D one number or one per
    key channel per token, and nothing the staged forward leaves out (auxiliary states, the offline
    solve, an L2 norm over the value channels)."""
    return (m.side == "left" and m.delta is not None and m.delta.order == "right" and simplified(m.delta.a - m.write.key) == 0
            and m.decay.kind in ("scalar", "diagonal") and not m.aux and m.solve_lam is None
            and not any(i.l2norm and i.kind == "V" for i in m.inputs))


def _log_decay_inputs(m: ir.Mixer) -> tuple:
    """The inputs that are the log-decay itself (plan.rank2_resets)."""
    return tuple(i.name for i in m.inputs if i.log and simplified(m.log_decay() - i.symbol) == 0)


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
              " lrdsl/codegen/split.py) where K <= the staged limit")
