"""A tuning space compiled at once: the cold start of a spec is mostly compilation.

Triton's autotuner, on a key it has no record of, times each config of a kernel's space in turn,
and each config compiles on its first launch: a space of six configs of a backward kernel costs six
compilations one after the other (1-3 s each on the H200's host). Compilation runs mostly outside
the GIL (MLIR, LLVM, ptxas), so here the whole space is compiled on a thread pool first, through
Triton's own asynchronous compile mode (the same cache entries a launch would make); the autotuner
then finds every config compiled and only times them. Nothing changes where the autotuner has a
record on disk (it compiles the chosen config alone) or where a space has one config.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

_POOL: list = []


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) - 1)), thread_name_prefix="lrdsl-compile"))
    return _POOL[0]


def compile_spaces_at_once(module) -> None:
    """Make each autotuned kernel of a generated module (the names in its TUNING_SPACE) compile its
    configs on the thread pool before it times them."""
    for name in getattr(module, "TUNING_SPACE", {}):
        _wrap(getattr(module, name))


def compile_loaded_autotuners(package: str) -> int:
    """Wrap as above every Triton autotuner defined at the top level of the loaded modules of
    `package` (also under heuristics), once; returns how many are wrapped. `lrdsl bench` uses it
    on FLA's modules: their spaces are large and their configs, their timing and so their choices
    stay FLA's; only the compilation moves onto the pool."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == package or name.startswith(package + ".")):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # heuristics over an autotuner over a jit function, or the reverse
                if isinstance(obj, Autotuner):
                    n += _wrap(obj)
                obj = getattr(obj, "fn", None) if isinstance(obj, KernelInterface) else None
    return n


def _wrap(tuner) -> int:
    if getattr(tuner, "_lrdsl_compiles_at_once", False):  # a kernel imported by several modules
        return 0
    tuner._lrdsl_compiles_at_once = True
    run, check = tuner.run, tuner.check_disk_cache
    call: dict = {}

    def run_(*args, **kwargs):  # the launch's arguments, for the configs' compilation
        call.update(args=args, kwargs=kwargs)
        try:
            return run(*args, **kwargs)
        finally:
            call.clear()

    def check_(tuning_key, configs, bench):  # bench runs only where no record is on disk
        def compiled_then_bench():
            if call and len(configs) > 1:
                _compile(tuner.fn, configs, call["args"], call["kwargs"])
            return bench()
        return check(tuning_key, configs, compiled_then_bench)

    tuner.run, tuner.check_disk_cache = run_, check_
    return 1


def _compile(fn, configs, args, kwargs) -> None:
    from triton.runtime._async_compile import AsyncCompileMode
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}  # the launch's, not the kernel's
    # ignore_errors: a config that cannot compile (shared memory, registers) fails again when the
    # autotuner launches it, which times it as infinitely slow, as without this
    with AsyncCompileMode(_pool(), ignore_errors=True):
        for c in configs:
            try:
                fn.warmup(*args, grid=(1,), **kwargs, **c.all_kwargs())
            except Exception:  # noqa: BLE001 (the autotuner's own launch raises it again, or skips it)
                pass
