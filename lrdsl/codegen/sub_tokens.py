"""The addresses of a product's sub-token rows (codegen/product.py), as Triton text the staged
templates paste: plan.sub_row, sub_grad, sub_out, sub_grad_mask and the kernels' sub_args.

A product's direct sub-mixer reads row r of a step input (the keys, the values) at token r // n of
step r % n's own tensor, and the query at token r // n (Plan.sub_tokens = n, sub_steps, sub_query).
The kernels' argument sub_n is n there, and 1 where the host gives them the interleaved
[B, n T, ...] tensors instead.

The split (codegen/split.py) has n = 2: every input of its mixer but the phase is read at token
r // 2 of its one tensor (Plan.sub_reads, as the query), and the phase, its one step input, from
a constant [2, H] tensor read with token stride 0 (runtime/split.py's in-place route)."""
from __future__ import annotations


class SubTokenRows:
    """Plan's sub-token holes (Plan reads sub_tokens, sub_steps and sub_query from its fields)."""

    @property
    def sub_args(self) -> str:
        """The sub-token arguments (plan.sub_tokens): sub_n, then each step input's offsets; "" without."""
        return ", ".join(["sub_n"] + [f"off_{x}_{j}" for x in self.sub_steps for j in range(1, self.sub_tokens)]
                         + [f"step_{x}" for x in self.sub_steps]
                         + [f"rs_{x}" for x in self._sub_strided] if self.sub_tokens else [])

    @property
    def _sub_strided(self) -> tuple:
        """The inputs read by sub-token, in the order of their token strides rs_<name>."""
        return tuple(x for x in (self.sub_query, *self.sub_reads, *self.sub_steps) if x)

    @property
    def sub_strides(self) -> str:
        """The host's names of those inputs (_sub_args' rs_<name>), as Python text."""
        return "(*SUB_READS, *SUB_STEPS)" if self.sub_reads else "(SUB_QUERY, *SUB_STEPS)"

    @property
    def sub_split_constants(self) -> str:
        """The split's module constants after SUB_QUERY (common.jinja's constants), "" elsewhere."""
        if not self.sub_reads:
            return ""
        reads = ", ".join(f'"{x}"' for x in self.sub_reads)
        once = "".join(f'"{x}", ' for x, _ in self.sub_once)
        return ("\n\n# the split's (codegen/split.py): both sub-tokens of token t read row t of these inputs"
                f"\nSUB_READS = ({reads},)"
                "\n# and these inputs' gradients are zero in one of the two: stored at their tokens, [B, T, ...]"
                f"\nSUB_ONCE = ({once})")

    @property
    def sub_grad_alloc(self) -> str:
        """The chain rule's host text that allocates an input's gradient (chain_rule.py.jinja's
        _chain_outputs): a step input's [n, ...] (a product's); a split's input's at its tokens
        (sub_once) or at each sub-token's row, which _chain_sums adds per token."""
        if self.sub_reads:
            return f"torch.empty(B, {self.sub_grad_rows}, *x.shape[2:], dtype=x.dtype, device=x.device)"
        if self.sub_tokens:
            return "x.new_empty(_sub_len(inputs), *x.shape).squeeze(0) if n in SUB_STEPS else torch.empty_like(x)"
        return "torch.empty_like(x)"

    @property
    def sub_grad_rows(self) -> str:
        """_chain_outputs' rows of input n's gradient: the split's tokens T0 where it lives in one
        phase (sub_once), its sub-tokens T elsewhere."""
        return "T0 if n in SUB_ONCE else T" if self.sub_reads else "T"

    def sub_pair_sums(self, v_given: tuple) -> str:
        """_chain_sums' lines that add the split's sub-tokens' gradients of each token (and dz's where
        an input's gradient is dz itself, v_given: no one reads it otherwise): one torch sum over a
        dimension of 2 each; "" elsewhere."""
        if not self.sub_reads:
            return ""
        dz = "\n    dz = dz if per == 1 else dz.view(B, T, per, *dz.shape[2:]).sum(2)" if v_given else ""
        return ("\n    per = _sub_len(inputs)  # the split's: a token's gradient is its sub-tokens' sum"
                "\n    grads = {x: g if x in PARAMS or x in SUB_ONCE or per == 1 else g.view(B, T, per, *g.shape[2:]).sum(2)"
                " for x, g in grads.items()}" + dz)

    def sub_row(self, name: str, ptr: str, rows: str, heads: str, head: str, width: str) -> str:
        """The address of row `rows` ([heads, width] rows) of input `name` at `ptr` where the plan
        reads it by sub-token (plan.sub_tokens), else "" (the caller's row-major text stands). Its
        tokens are rs_<name> elements apart (heads x width where contiguous; more for slices of one
        [B, T, n, heads, width] tensor), its heads width apart."""
        if not self.sub_tokens or name not in self._sub_strided:
            return ""
        at = f"{ptr} + {self._sub_token(rows)} * rs_{name} + {head}" + ("" if width == "1" else f" * {width}")
        if name == self.sub_query or name in self.sub_reads:
            return at
        off = "0"
        for j in range(self.sub_tokens - 1, 0, -1):
            off = f"tl.where({self._sub_step(rows)} == {j}, off_{name}_{j}, {off})"
        return f"{at} + {off}"

    def sub_grad(self, name: str, ptr: str, rows: str, width: str, tail: str) -> str:
        """Where the gradient of row `rows` of input `name` goes (its [HV, width] rows at `ptr`, plus
        `tail`) where the plan reads that input by sub-token, else "": a step input's in the step's
        slice of one [n, ...] tensor (step_<name> elements apart), the query's at its token (the last
        sub-token's alone: sub_grad_mask; the others have none, their outputs being unread); the
        split's (plan.sub_reads) at its token for an input of sub_once alone, from its phase's rows."""
        if self.sub_reads:  # the split's: an input whose gradient lives in one phase, at its token
            if name not in dict(self.sub_once):
                return ""
            at = f"{ptr} + {self._sub_token(rows)} * HV + i_hv" if width == "1" else \
                f"{ptr} + ({self._sub_token(rows)} * HV + i_hv) * {width}"
            return f"{at} + {tail}" if tail else at
        if not self.sub_tokens or (name not in self.sub_steps and name != self.sub_query):
            return ""
        at = f"{ptr} + ({self._sub_token(rows)} * HV + i_hv) * {width}"
        return f"{at} + {tail}" if name == self.sub_query else f"{at} + {self._sub_step(rows)} * step_{name} + {tail}"

    def sub_chunk_start(self, inputs) -> tuple:
        """Lines that move the pointers of those of `inputs` ((name, row width) each) read by
        sub-token to the token of row row0 (tok0), and make step0, row0's step in it: a chunk's rows
        are then rows step0 + rows from there (sub_row's and sub_grad's `rows`), 32-bit and unlike
        staged_dk's own row0 + rows, which the compiler shared with its loads and kept live into
        _chain_tokens (ptxas: delta_product2's staged_dk spilled 200/212; docs/kernels.md).
        () without sub-token reads."""
        inputs = [(x, w) for x, w in inputs if x in self.sub_steps or x == self.sub_query] if self.sub_tokens else []
        if not inputs:
            return ()
        lines = [f"tok0 = {self._sub_token('row0')}",
                 "step0 = (row0 - tok0 * sub_n).to(tl.int32)"]
        for x, width in inputs:
            lines += [f"in_{x} += tok0 * rs_{x}", f"d_{x}_ptr += tok0 * HV * {width}"]
        return tuple(lines)

    def sub_out(self, ptr: str) -> tuple:
        """(address, mask factor) of o's or dO's row `rows` (value tile o_v) at `ptr` with
        plan.sub_tokens: row r // n, the last sub-token of each token alone (the readout of a token
        is its last sub-token's), else ("", "")."""
        if not self.sub_tokens:
            return "", ""
        return (f"{ptr} + ({self._sub_token('rows[:, None]')} * HV + i_hv) * V + o_v[None, :]",
                f" & ({self._sub_step('rows[:, None]')} == sub_n - 1)")

    def sub_grad_mask(self, name: str, rows: str) -> str:
        """The mask's factor of sub_grad's store: the query's gradient at the last sub-token alone, a
        split's input of sub_once at its phase's rows."""
        once = dict(self.sub_once)
        if name in once:  # sub_n - 1 for the last step: every row where sub_n = 1 (interleaved rows)
            return f" & ({self._sub_step(rows)} == {'sub_n - 1' if once[name] == self.sub_tokens - 1 else once[name]})"
        return f" & ({self._sub_step(rows)} == sub_n - 1)" if self.sub_tokens and name == self.sub_query else ""

    # Row r's token and step: r // sub_n and r % sub_n, sub_n being 1 or n. The divisor is written as
    # the constant n, since a division by a runtime integer compiles to a long integer routine: eight
    # of them a chunk in the state pass's loop (sm_90a PTX: div.s64, rem.s64; docs/kernels.md)
    def _sub_token(self, rows: str) -> str:
        return f"tl.where(sub_n == 1, {rows}, ({rows}) // {self.sub_tokens})"

    def _sub_step(self, rows: str) -> str:
        return f"(({rows}) - {self._sub_token(rows)} * sub_n)"

