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

import inspect

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
    return True


def uninstall():
    """Back to the interpreter's own launch and helper call (for the test comparing the two)."""
    from triton.runtime import interpreter as I
    if getattr(I.InterpretedFunction.__call__, "_lrdsl_tests", False):
        I.GridExecutor.__call__ = I.GridExecutor.original_call
        I.InterpretedFunction.__call__ = I.InterpretedFunction.original_call
