"""The Python API: `lrdsl.compile(path)` or `lrdsl.compile(text=...)` -> a Mixer."""
from __future__ import annotations

import os
from functools import cached_property

import torch

from . import ir, printer
from .errors import SpecError
from .frontend import spec_to_ir
from .tensors import validate


class Mixer:
    """A compiled spec. `reference` is the exact token loop; `check` the eigenvalue facts."""

    def __init__(self, mixer_ir: ir.Mixer, source: str = "", filename: str = "<spec>"):
        self.ir = mixer_ir
        self.source = source
        self.filename = filename

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def inputs(self) -> tuple:
        return tuple(i.name for i in self.ir.inputs)

    def __repr__(self) -> str:
        return f"<lrdsl.Mixer {self.name}: {printer.transition(self.ir)} S + write>"

    def explicit(self) -> str:
        return printer.explicit(self.ir)

    def canonical(self) -> str:
        return printer.canonical(self.ir)

    @cached_property
    def _facts(self) -> dict:
        from .checker import check
        return check(self.ir)

    def check(self) -> dict:
        """The dict that `lrdsl check --json` prints (a fresh copy)."""
        import copy
        return copy.deepcopy(self._facts)

    @cached_property
    def kernels(self):
        """The generated module (kernels and host wrappers), loaded from the on-disk cache."""
        from .runtime import load
        return load(self.ir)

    def recurrent(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **inputs):
        """The fused recurrent (token by token) kernel; same signature and results as reference."""
        batch = validate(self.ir, q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens)
        return self.kernels.recurrent(q, k, v, scale=batch.scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                      **inputs)

    def chunk(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, **inputs):
        """The chunk-parallel kernels; same signature and results as reference."""
        batch = validate(self.ir, q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens)
        tensors = [batch.tensors[i.name] for i in self.ir.inputs]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors + [initial_state]
                                           if t is not None):
            from .autograd import ChunkFunction
            names = tuple(i.name for i in self.ir.inputs)
            return ChunkFunction.apply(self.ir, self.kernels, batch, names, initial_state, *tensors)
        return self.kernels.chunk(q, k, v, scale=batch.scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  **inputs)

    def reference(self, q, k, v, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **inputs):
        """o [B, T, HV, V] and the final state [N, HV, K, V] (None unless output_final_state)."""
        from .reference import scan
        batch = validate(self.ir, q, k, v, inputs, scale, initial_state, output_final_state, cu_seqlens)
        return scan(self.ir, batch)


def compile(path: str | os.PathLike | None = None, *, text: str | bytes | None = None,
            check_stability: bool = True) -> Mixer:
    """Parse, lower and check a spec. Raises SpecError (with line and column) for any mistake."""
    if (path is None) == (text is None):
        raise TypeError("lrdsl.compile takes a path or text=..., not both")
    filename = "<spec>"
    if path is not None:
        filename = os.fspath(path)
        try:
            with open(filename, "rb") as f:
                text = f.read()
        except OSError as e:
            raise SpecError(f"cannot read the spec: {e.strerror}", None, None, filename) from None
    source = text if isinstance(text, str) else ""
    m = spec_to_ir(text, filename)
    if isinstance(text, bytes):
        source = text.decode("utf-8")  # spec_to_ir succeeded, so it is UTF-8
    mixer = Mixer(m, source, filename)
    if check_stability:
        from .checker import stability_error
        msg = stability_error(m, mixer._facts)
        if msg:
            raise SpecError(msg, m.update_span, source, filename)
    return mixer
