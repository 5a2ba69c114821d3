"""The Python API: `lrdsl.compile(path)` or `lrdsl.compile(text=...)` -> a Mixer."""
from __future__ import annotations

import os
from functools import cached_property

from lrdsl.errors import InputError, SpecError
from lrdsl.frontend import ir, printer, spec_to_ir
from lrdsl.runtime.tensors import assert_in_ranges, validate


class Mixer:
    """A compiled spec. `reference` is the exact token loop; `check` the eigenvalue facts."""

    def __init__(self, mixer_ir: ir.Mixer, source: str = "", filename: str = "<spec>",
                 keep_intermediates: bool = False, check_ranges: bool | None = None):
        self.ir = mixer_ir
        # the chunked backward recomputes the forward's intermediates unless asked to keep them
        self.keep_intermediates = keep_intermediates
        # inputs outside their declared ranges are clamped into them on every path; a call also
        # asserts they are inside (device-side on a GPU) where check_ranges is True, in the
        # reference only where it is None (the default), nowhere where it is False
        self.check_ranges = check_ranges
        self._kernels = None
        self._op = None
        self._split = None
        self._product = None
        self._product_plan = None
        self._value_route = None
        self._parts_cache = None
        self._fused_cache = None
        self.source = source
        self.filename = filename

    # A Mixer holds its generated module (a loaded Python module) and torch.library ops, which
    # cannot be pickled; copies and pickles carry the spec text and the options instead, and the
    # kernels come back from the on-disk cache (copy.deepcopy, EMA copies, torch.save of a model).
    def __getstate__(self) -> dict:
        return {"source": self.source, "filename": self.filename,
                # a mixer made from an IR, not from spec text (the split mixer), carries its IR
                "ir": None if self.source else self.ir,
                "keep_intermediates": self.keep_intermediates, "check_ranges": self.check_ranges,
                "loaded": self._kernels is not None}

    def __setstate__(self, state: dict) -> None:
        mixer_ir = state["ir"]
        if mixer_ir is None:
            mixer_ir = spec_to_ir(state["source"], state["filename"])
        self.__init__(mixer_ir, state["source"], state["filename"], state["keep_intermediates"],
                      state["check_ranges"])
        if state["loaded"]:
            self._load_kernels()

    def _load_kernels(self) -> None:
        """Generate (or find in the cache), load and register the kernels now, not at the first
        call: keeps code generation out of torch.compile's tracing. Nothing without triton."""
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return
        if self.ir.side != "left":  # the value side's module: its token loop (and chunked forward)
            self.kernels  # noqa: B018
            if self.value_route is not None:  # and the transposed sub-mixer's staged kernels
                self.value_transposed._load_kernels()
            return
        if self.ir.steps:  # a product of steps runs on its sub-mixer's kernels, its inputs made by the plan
            self.product_plan  # noqa: B018 (made here: sympy must not run under torch.compile's tracing)
            self.product._load_kernels()
        elif self.ir.reads_before:  # the parts' kernels: this readout runs around them
            for part in self._parts[:2]:
                if part is not None:
                    part._load_kernels()
            if self._fused:  # and chunk's own, which read it in one pass
                self.chunk_op  # noqa: B018
        elif self.ir.solve_lam is None:
            self.chunk_op  # noqa: B018 (generates, caches and registers the kernels)
            if self.split is not None:  # and the split spec's, which chunk runs where it can
                self.split.chunk_op  # noqa: B018
        elif self.ir.decay.kind != "diagonal":
            self.chunk_op  # noqa: B018 (the offline solve's module and op: generated, cached, registered)

    def _validate(self, *args, reference: bool = False, offsets=None):
        """validate(...) for this mixer, and the range assertion where it is on."""
        batch = validate(self.ir, *args, offsets=offsets)
        if self.check_ranges or (self.check_ranges is None and reference):
            assert_in_ranges(self.ir, batch)
        return batch

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def inputs(self) -> tuple:
        return tuple(i.name for i in self.ir.inputs)

    @property
    def params(self) -> tuple:
        """The names of the spec's learned params (tensors [HV], [HV, K] or [HV, V], passed like inputs)."""
        return tuple(p.name for p in self.ir.params)

    def __repr__(self) -> str:
        return f"<lrdsl.Mixer {self.name}: {printer.product(self.ir)} S + write>"

    def explicit(self) -> str:
        return printer.explicit(self.ir)

    def canonical(self) -> str:
        return printer.canonical(self.ir)

    @cached_property
    def _facts(self) -> dict:
        from lrdsl.checks.checker import check
        return check(self.ir)

    def check(self) -> dict:
        """The dict that `lrdsl check --json` prints (a fresh copy)."""
        import copy
        return copy.deepcopy(self._facts)

    @property
    def _parts(self) -> tuple:
        """(the mixer reading S^T x, the one whose shifted readout gives S_prev^T y, {shifted input:
        input}) of a spec whose readout reads before the update (codegen/readouts.py)."""
        if self._parts_cache is None:
            from lrdsl.codegen.readouts import core_ir, prev_ir
            prev, shifted = prev_ir(self.ir)
            self._parts_cache = tuple(None if m is None else Mixer(m, keep_intermediates=self.keep_intermediates,
                                                                   check_ranges=False)
                                      for m in (core_ir(self.ir), prev)) + (shifted,)
        return self._parts_cache

    @property
    def _fused(self) -> bool:
        """The staged kernels read this spec's readout of the state before the update themselves
        (codegen/readouts.py's fused): chunk takes them where the keys fit them."""
        if self._fused_cache is None:
            from lrdsl.codegen.readouts import fused
            self._fused_cache = self.ir.reads_before and fused(self.ir) is not None
        return self._fused_cache

    @property
    def kernels(self):
        """The generated module (kernels and host wrappers), loaded from the on-disk cache. For a
        readout with S_prev or dot-product terms: the module of its first part (lrdsl.Mixer runs
        the readout around the parts' kernels), unless the staged kernels read it themselves
        (Mixer._fused): then its own, whose chunk alone reads it (its general kernels read S^T y).
        For a product of steps: its sub-token mixer's."""
        if self.ir.steps:
            return self.product.kernels
        if self.ir.reads_before and not self._fused:
            return next(p for p in self._parts[:2] if p is not None).kernels
        if self._kernels is None:  # not a cached_property: its lock breaks torch.compile graphs
            from lrdsl.runtime.loader import load
            self._kernels = load(self.ir)
        return self._kernels

    @property
    def chunk_op(self):
        """The chunked kernels as one torch.library op (forward, backward, fake implementation)."""
        if self.ir.side != "left":
            raise InputError(f"mixer '{self.name}' has a value-side transition (S N or M S N), whose chunk "
                             "is not a kernel op yet (runtime/valueside.py): call mixer.chunk")
        if self.ir.steps:
            return self.product.chunk_op
        if self._op is None:
            key = self.kernels.__name__.rsplit("_", 1)[-1]
            if self.ir.solve_lam is not None:  # the offline solve's (taken under torch.compile)
                from lrdsl.runtime.offline_op import offline_op
                self._op = offline_op(self, key)
            else:
                from lrdsl.runtime.autograd import chunk_op
                self._op = chunk_op(self.ir, self.kernels, key)
        return self._op

    def recurrent(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **inputs):
        """The fused recurrent (token by token) kernel; same signature and results as reference.
        Forward only: it is the decode path; train through `chunk`."""
        import torch
        batch = self._validate(q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in [*batch.tensors.values(), batch.initial_state,
                                                     *(batch.initial_aux or ())]):
            raise InputError("mixer.recurrent is forward-only (the decode path): call it under "
                             "torch.no_grad() or on tensors without requires_grad, and train "
                             "through mixer.chunk, which has the chunked backward")
        if self.ir.solve_lam is not None:
            from lrdsl.runtime import offline
            return offline.recurrent(self, batch)
        if self.ir.steps:
            from lrdsl.runtime import product
            return product.run(self, "recurrent", batch)
        if self.ir.reads_before:
            return self._with_before("recurrent", batch, initial_state)
        if self._whole_state(batch):
            from lrdsl.runtime.autograd import host_args
            names = list(self.ir.tensor_names)
            tensors, h0, cu = host_args(names, [batch.tensors[n] for n in names], batch.initial_state, cu_seqlens)
            o, ht, aux = self.kernels.recurrent_fwd(tensors, batch.scale, h0, output_final_state, cu,
                                                    initial_aux=self._aux_in(batch), final_aux=True)
            return o, (self._state_out(ht, aux) if output_final_state else None)
        return self.kernels.recurrent(q, k, v, scale=batch.scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                      **inputs)

    # ---- the whole state of mixers with auxiliary states ---------------------------------------
    def zero_state(self, N, HV, K, V, device=None):
        """A zero state to start from (decoding with step, or any initial_state): the float32
        [N, HV, K, V] tensor S, or, for a mixer with auxiliary states, a MixerState holding S and
        every auxiliary state ([N, HV, K] or [N, HV, V])."""
        import torch

        from lrdsl.runtime.tensors import MixerState
        if self.ir.solve_lam is not None:
            from lrdsl.runtime import offline
            return offline.zero_state(self.ir, N, HV, K, V, device)
        S = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
        if not self.ir.aux:
            return S
        return MixerState(S, {a.name: torch.zeros(N, HV, a.width(K, V), dtype=torch.float32,
                                                  device=device) for a in self.ir.aux})

    def _whole_state(self, batch) -> bool:
        return bool(self.ir.aux) and (batch.initial_aux is not None or batch.output_final_state)

    @staticmethod
    def _aux_in(batch):
        if batch.initial_aux is None:
            return None
        import torch
        return [a.to(torch.float32).contiguous() for a in batch.initial_aux]

    def _state_out(self, S, aux):
        from lrdsl.runtime.tensors import MixerState
        return MixerState(S, {a.name: t for a, t in zip(self.ir.aux, aux)})

    def step(self, q, k, v, state, scale=None, out=None, return_states=False, states_out=None, **inputs):
        """Decode: run the recurrent kernel over the given tokens and update `state` in place.

        state is the float32 [B, HV, K, V] state (contiguous); returns o [B, T, HV, V]. Each program
        reads its tile of the state before it writes it back, so no copy is made. out: o's buffer
        (written, no new tensor). return_states=True also returns the state after every token, for a
        verifier of speculative decoding to roll back to (accept): (o, states), states float32
        [B, T, HV, K, V], or a MixerState of such per-token tensors ([B, T, HV, K|V] for each auxiliary
        state); states_out: a buffer of that form to write them into. No host synchronisation and, with
        out and states_out, no new tensors (but a mixer with auxiliary states): capturable in a CUDA graph."""
        from lrdsl.runtime import decode
        return decode.step(self, q, k, v, state, scale, out, return_states, states_out, **inputs)

    def accept(self, state, states, n) -> None:
        """Roll a multi-token step back: `state` (updated in place) becomes the state after the first
        n tokens of that step, from `states` (what step(..., return_states=True) returned). n is an int
        or a [B] integer tensor on the state's device (one count per sequence, read on the device: no
        host synchronisation), each from 1 to T (a verifier's first token, the last one accepted, is
        always kept)."""
        from lrdsl.runtime import decode
        decode.accept(state, states, n)

    def chunk(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, cp_group=None, cu_seqlens_cpu=None, segments=None, **inputs):
        """The chunk-parallel kernels; same signature and results as reference.

        cu_seqlens_cpu: the offsets of cu_seqlens as a list of ints, checked instead of reading
        cu_seqlens back from the device (under torch.compile such a read is a graph break).

        segments: cut the longest sequence into this many segments (64-token multiples) that run
        side by side and compose their maps of the state (lrdsl/runtime/segments.py); 1 runs one
        pass; None takes LRDSL_SEGMENTS, else the schedule's choice on a GPU (one pass on the CPU and
        under torch.compile).

        cp_group (a torch.distributed process group): context parallelism. Each rank passes its
        contiguous slice of the tokens and the global initial_state and cu_seqlens; see lrdsl/cp.py."""
        if _bf16_on_cpu(q, k, v, initial_state, *inputs.values()):
            # Triton's interpreter computes tl.dot on bf16 operands wrongly and silently
            # (triton#11584), so on the CPU the kernels run on fp32 copies; o comes back in v's dtype
            o, final = self.chunk(*map(_fp32_if_bf16, (q, k, v)), scale, _fp32_if_bf16(initial_state),
                                  output_final_state, cu_seqlens, cp_group, cu_seqlens_cpu, segments,
                                  **{n: _fp32_if_bf16(t) for n, t in inputs.items()})
            return o.to(v.dtype), final
        if cp_group is not None and self.ir.side != "left":
            raise InputError(f"mixer '{self.name}' has a value-side transition (S N or M S N), which context "
                             "parallelism does not support yet: call chunk without cp_group")
        if self.ir.steps:
            from lrdsl.runtime import product
            # with cp_group the slice is this rank's, cu_seqlens and initial_state the global ones:
            # the per-step vectors are elementwise in the tokens, the sub-mixer's chunk does the rest
            batch = self._validate(q, k, v, inputs, scale, None if cp_group else initial_state, output_final_state,
                                   None if cp_group else cu_seqlens, offsets=None if cp_group else cu_seqlens_cpu)
            if cp_group is not None:
                import dataclasses
                batch = dataclasses.replace(batch, initial_state=initial_state, cu_seqlens=cu_seqlens)
            if cp_group is None:
                segmented = self._segmented(batch, segments, cu_seqlens_cpu)
                if segmented is not None:
                    return segmented
            return product.run(self, "chunk", batch, cp_group, None if cp_group else cu_seqlens_cpu)
        if cp_group is not None:
            from lrdsl.runtime import cp
            return cp.chunk(self, q, k, v, scale, initial_state, output_final_state, cu_seqlens, inputs,
                            cp_group)
        batch = self._validate(q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens,
                               offsets=cu_seqlens_cpu)
        segmented = self._segmented(batch, segments, cu_seqlens_cpu)  # (segments.plan refuses M S N)
        if segmented is not None:
            return segmented
        if self.ir.side == "right":  # the chunked forward and backward kernels (valueside.py)
            from lrdsl.runtime import valueside
            return valueside.chunk(self.ir, self.kernels, batch, self._value_route_for(batch))
        if self.ir.side == "both":  # M S N: the token loop forward, a reverse token loop backward (two_sided.py)
            from lrdsl.runtime import two_sided
            return two_sided.chunk(self.ir, self.kernels, batch)
        if self.ir.solve_lam is not None:
            from lrdsl.runtime import offline
            return offline.chunk(self, batch)
        if self.ir.reads_before and not (self._fused and batch.K <= self.kernels.STAGED_MAX_K):
            return self._with_before("chunk", batch, initial_state, cu_seqlens_cpu)
        from lrdsl.runtime import dispatch
        if dispatch.native_rank2(self, batch):
            return dispatch.chunk_rank2(self, batch)
        # the split's staged kernels, keeping their intermediates too with keep_intermediates (the split
        # mixer has this mixer's); wider keys take the original spec's general kernels
        if self.split is not None and batch.K <= self.split.kernels.STAGED_MAX_K:
            return dispatch.chunk_split(self, batch)
        tensors = [batch.tensors[n] for n in self.ir.tensor_names]
        from lrdsl.runtime.autograd import eager
        if batch.initial_aux is not None or self.keep_intermediates or eager(tensors):
            return dispatch.chunk_eager(self, batch, tensors)
        return dispatch.chunk_tensors(self, batch, tensors)

    def _segmented(self, batch, segments, offsets):
        """chunk over the segments that runtime/segments.py cuts for this call, or None for one pass."""
        if type(segments) is int and segments == 1:  # 1 (not True): one pass without a look
            return None
        from lrdsl.runtime import segments as seg
        cut = seg.plan(self, batch, segments, offsets)
        return None if cut is None else seg.chunk(self, batch, cut)

    def _with_before(self, method: str, batch, initial_state, offsets=None):
        """chunk or recurrent of a readout with S_prev or dot-product terms: the parts' kernels, the
        S_prev part moved one token later, the dot products beside (runtime/readouts.py)."""
        import torch

        from lrdsl.runtime import readouts
        from lrdsl.runtime.tensors import compute_dtype
        core, prev, shifted = self._parts
        t, cu = dict(batch.tensors), batch.cu_seqlens
        opts = dict(scale=batch.scale, initial_state=initial_state, cu_seqlens=cu)
        if method == "chunk":  # the segments, if any, were cut before the parts
            opts["segments"] = 1
        if offsets is not None:  # chunk's host-side offsets, read by each part instead of cu_seqlens
            opts["cu_seqlens_cpu"] = offsets
        o = final = None
        if core is not None:
            o, final = getattr(core, method)(**t, output_final_state=batch.output_final_state, **opts)
        if prev is not None:
            tp = dict(t, **{new: readouts.shift_next(t[old], cu) for new, old in shifted.items()})
            o_p, f_p = getattr(prev, method)(**tp, output_final_state=batch.output_final_state and final is None,
                                             **opts)
            first = self._first(batch, t, batch.initial_state, cu)
            o_p = readouts.shift_back(o_p, first, cu)
            o, final = (o_p if o is None else o + o_p), (f_p if final is None else final)
        extra = readouts.before_terms(self.ir, t, batch.H, batch.HV, batch.scale, compute_dtype(batch))
        if isinstance(extra, torch.Tensor):
            o = (o.to(extra.dtype) + extra).to(o.dtype)
        return o, final

    def _first(self, batch, t, S0, cu):
        """S0^T (scale * y) at each sequence's first token, [B or N, HV, V]."""
        import torch

        from lrdsl.runtime import readouts
        from lrdsl.runtime.tensors import compute_dtype
        if S0 is None:
            return torch.zeros(batch.N, batch.HV, batch.V, device=t["q"].device, dtype=compute_dtype(batch))
        return readouts.first_readout(self.ir, t, batch.H, batch.HV, batch.scale, S0, cu, compute_dtype(batch))

    @property
    def product(self):
        """The one-step mixer whose n sub-tokens per token are this product's n steps
        (lrdsl/codegen/product.py), or None for a one-step spec."""
        if not self.ir.steps:
            return None
        if self._product is None:
            from lrdsl.codegen.product import sub_ir
            self._product = Mixer(sub_ir(self.ir), keep_intermediates=self.keep_intermediates, check_ranges=False)
        return self._product

    @property
    def product_plan(self):
        """The sub-mixer's inputs as plain functions of this product's (runtime/product.py), made once."""
        if self._product_plan is None:
            from lrdsl.runtime.product import plan_of
            self._product_plan = plan_of(self.ir, self.product.ir)
        return self._product_plan

    @property
    def value_route(self):
        """A value side's chunked forward on the key side's staged kernels (runtime/value_key.py) where
        codegen/value_key.py takes its transition, else None (the token loop kernel)."""
        if self._value_route is None:
            from lrdsl.codegen import value_key
            self._value_route = False
            if value_key.enabled(self.ir):
                from lrdsl.runtime.value_key import route
                self._value_route = route(self.ir, Mixer(value_key.sub_ir(self.ir), check_ranges=False))
        return self._value_route or None

    @property
    def value_transposed(self):
        """The key-side mixer on S^T whose staged kernels value_route runs, or None."""
        r = self.value_route
        return None if r is None else r.forward.keywords["sub"]

    def _value_route_for(self, batch):
        """value_route where the values fit the staged kernels' keys (T's keys are S's values)."""
        if self.value_route is None or batch.V > self.value_transposed.kernels.STAGED_MAX_K:
            return None
        return self.value_route

    @property
    def split(self):
        """The mixer whose staged kernels chunk runs on two tokens per token (lrdsl/codegen/split.py), or
        None: this spec's erase is along its write key already, or the split has no staged kernels."""
        if self._split is None:
            from lrdsl.codegen.split import split_ir
            s = split_ir(self.ir)
            self._split = False if s is None else Mixer(s, keep_intermediates=self.keep_intermediates, check_ranges=False)
            if s is not None:
                self._split._split = False  # its erase is along its write key: staged kernels
        return self._split or None

    def reference(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **inputs):
        """o [B, T, HV, V] and the final state [N, HV, K, V] (None unless output_final_state)."""
        from lrdsl.runtime.reference import scan
        batch = self._validate(q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens,
                               reference=True)
        return scan(self.ir, batch)



def _bf16_on_cpu(q, *tensors) -> bool:
    """q is on the CPU (kernels in Triton's interpreter) and some input is a bf16 tensor."""
    import torch
    return (isinstance(q, torch.Tensor) and q.device.type == "cpu"
            and any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in (q, *tensors)))


def _fp32_if_bf16(t):
    import torch
    return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t


def _read_spec(filename: str) -> bytes:
    """The bytes of a spec file, bounded (/dev/zero or a huge file must not hang). A FIFO or socket
    is refused: opening one to read waits, possibly forever, for a writer."""
    import stat

    from lrdsl.frontend.syntax import MAX_BYTES
    try:
        # non-blocking, so that opening a FIFO returns at once and fstat can tell what it is
        fd = os.open(filename, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise SpecError(f"cannot read the spec: {e.strerror}", None, None, filename) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket"
            raise SpecError(f"cannot read the spec: it is {kind}, not a file, and reading it could wait "
                            "forever; save the spec to a regular file (or pass its text to "
                            "lrdsl.compile(text=...))", None, None, filename)
        if stat.S_ISDIR(mode):
            raise SpecError("cannot read the spec: it is a directory; give the path of a .lr file",
                            None, None, filename)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a terminal or other device reads as usual
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise SpecError(f"cannot read the spec: {e.strerror}", None, None, filename) from None
    finally:
        os.close(fd)


def compile(path: str | os.PathLike | None = None, *, text: str | bytes | None = None,
            check_stability: bool = True, keep_intermediates: bool = False,
            load_kernels: bool = True, check_ranges: bool | None = None) -> Mixer:
    """Parse, lower and check a spec, then generate and load its kernels (when triton is
    installed). Raises SpecError (with line and column) for any mistake in the spec.

    Inputs outside their declared ranges are clamped into them, the same on every path. Each
    call of `reference` also asserts that they are inside (an InputError on a CPU, a device-side
    assert with no host synchronisation on a GPU); check_ranges=True asserts it on every path
    (kernels included), check_ranges=False on none.

    Loading here, not at the first call, keeps code generation out of torch.compile's tracing."""
    if (path is None) == (text is None):
        raise TypeError("lrdsl.compile takes exactly one of a path and text=...")
    if text is not None and not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"lrdsl.compile(text=...) takes the spec as str or bytes, not {type(text).__name__}")
    filename = "<spec>"
    if path is not None:
        filename = os.fspath(path)
        text = _read_spec(filename)
    source = text if isinstance(text, str) else ""
    m = spec_to_ir(text, filename)
    if isinstance(text, bytes):
        source = text.decode("utf-8")  # spec_to_ir succeeded, so it is UTF-8
    from lrdsl.checks.checker import domain_error
    bad = domain_error(m)
    if bad:
        raise SpecError(bad[0], bad[1], source, filename)
    mixer = Mixer(m, source, filename, keep_intermediates, check_ranges)
    if check_stability:
        from lrdsl.checks.checker import error_span, stability_error
        msg = stability_error(m, mixer._facts)
        if msg:
            raise SpecError(msg, error_span(m, mixer._facts), source, filename)
    if load_kernels:
        mixer._load_kernels()
    return mixer
