"""Cheaper calls of @triton.jit helper functions inside a kernel in Triton's CPU interpreter,
installed by conftest.py for the tests.

Every call of a helper (_chunk_of, _staged_k, _finite_rows, ...) from a kernel makes the interpreter
patch triton.language again (_patch_lang: inspect.getmembers over tl, tl.tensor, tl.math, ...), a
fifth of the tests' kernel time. Within one launch, that repeat patches nothing new: the launch (or
the first helper seen with the same language modules in its globals, e.g. triton.language.core for
Triton's own helpers) has already replaced every builtin, and the rest it sets again are the same
stateless closures. So inside a launch a helper is patched for once per set of language modules it
sees; the launch's own restore still undoes the launch's patches as before. Outside a launch, and
for anything unexpected, the interpreter's own call runs. tests/test_interpreter_calls.py checks
that generated kernels give the same bits either way.
"""
from __future__ import annotations

import functools
import inspect

import triton.language.core as core

_LAUNCHES: list = []  # per launch in progress: the sets of language modules patched in it
_KEYS: dict = {}  # id(fn) -> (fn, the language modules visible from fn's globals)
SKIPPED = [0]  # helper calls that skipped the repeated patching (for the test)


def _languages(fn):
    hit = _KEYS.get(id(fn))
    if hit is None or hit[0] is not fn:
        import triton.language as tl
        key = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        hit = _KEYS[id(fn)] = (fn, key)
    return hit[1]


def install():
    """Wrap the interpreter's launch and helper call (idempotent); False for another Triton."""
    from triton.runtime import interpreter as I
    grid, fn_cls = getattr(I, "GridExecutor", None), getattr(I, "InterpretedFunction", None)
    if grid is None or fn_cls is None or not hasattr(I, "_patch_lang") or not hasattr(fn_cls, "rewrite"):
        return False
    if getattr(fn_cls.__call__, "_lrdsl_tests", False):
        return True
    launch_call, helper_call = grid.__call__, fn_cls.__call__

    def launch(self, *args, **kwargs):
        _LAUNCHES.append({_languages(self.fn)})  # GridExecutor.__call__ patches for the kernel's own
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _LAUNCHES.pop()

    def helper(self, *args, **kwargs):
        if _LAUNCHES:
            key = _languages(self.fn)
            if key in _LAUNCHES[-1]:
                SKIPPED[0] += 1
                fn = self.rewrite()  # the interpreter's own call, less the repeated _patch_lang
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    raise I.InterpreterError(repr(e)) from e
            _LAUNCHES[-1].add(key)
        return helper_call(self, *args, **kwargs)

    helper._lrdsl_tests = True
    grid.original_call, fn_cls.original_call = launch_call, helper_call
    grid.__call__, fn_cls.__call__ = launch, helper
    _install_types(I)
    return True


def _tuple_type_init(self, types, fields=None):
    self.types = types
    self.fields = fields or [""] * len(types)


def _tuple_type_name(self):
    return "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]"


def _block_type_init(self, element_ty, shape):
    self.element_ty = element_ty
    assert isinstance(shape, (list, core.tuple))
    self.shape = core.tuple(core._unwrap_shape(shape))  # triton.language.core.tuple, as its own init
    if not self.shape:
        raise TypeError("0d block_type is forbidden")
    self.numel = core.validate_block_shape(self.shape)


def _block_type_name(self):
    return f"<{self.shape}, {self.element_ty}>"


def _tuple_init(self, args, type=None):
    self.values = [i for i in args]
    if isinstance(type, core.tuple_type):
        self.type = type
    elif type is not None:
        self.type = core.tuple_type(type)


def _tuple_type(self):
    return core._type_for_tuple_values(self.values)


def _lazy_types():
    """(class, its init without the attribute, the attribute, what makes it) for the Triton these
    inits mirror (3.6's, which constraints-cpu.txt pins), else none."""
    import triton
    if not triton.__version__.startswith("3.6."):
        return ()
    return ((core.tuple_type, _tuple_type_init, "name", _tuple_type_name),
            (core.block_type, _block_type_init, "name", _block_type_name),
            (core.tuple, _tuple_init, "type", _tuple_type))


def _install_types(I):
    """Two more costs of the interpreter's Python that repeat the same answer. Every tensor it makes
    builds a tl.tuple of its shape and a block_type; the tuple's type and the types' names
    (tuple_type's, block_type's) are made at once, and most are never read: about a third of a
    segmented test's time under cProfile. They become functools.cached_property, made at the first
    read. And _get_np_dtype builds its dict of types at every call: a dict filled once per Triton
    type."""
    for cls, init, attr, make in _lazy_types():
        if "original_init" not in cls.__dict__:
            lazy = functools.cached_property(make)
            lazy.__set_name__(cls, attr)
            cls.original_init, cls.__init__ = cls.__init__, init
            setattr(cls, attr, lazy)
    if not getattr(I._get_np_dtype, "_lrdsl_tests", False):
        plain, seen = I._get_np_dtype, {}

        def np_dtype(tt_dtype):
            try:
                return seen[tt_dtype]
            except KeyError:
                seen[tt_dtype] = plain(tt_dtype)
                return seen[tt_dtype]
            except TypeError:  # not hashable: as the interpreter does
                return plain(tt_dtype)
        np_dtype._lrdsl_tests, np_dtype.original = True, plain
        I._get_np_dtype = np_dtype


def uninstall():
    """Back to the interpreter's own launch and helper call (for the test comparing the two)."""
    from triton.runtime import interpreter as I
    if getattr(I.InterpretedFunction.__call__, "_lrdsl_tests", False):
        I.GridExecutor.__call__ = I.GridExecutor.original_call
        I.InterpretedFunction.__call__ = I.InterpretedFunction.original_call
    for cls, _, attr, _ in _lazy_types():
        if "original_init" in cls.__dict__:
            cls.__init__ = cls.original_init
            delattr(cls, attr)
            del cls.original_init
    if getattr(I._get_np_dtype, "_lrdsl_tests", False):
        I._get_np_dtype = I._get_np_dtype.original
