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


def enabled() -> bool:
    """Whether kernels compile on the pool (LRDSL_COMPILE_THREADS=0 turns it off; the interpreter
    compiles nothing)."""
    return os.environ.get("LRDSL_COMPILE_THREADS", "1") != "0" and not os.environ.get("TRITON_INTERPRET")


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max(1, min(16, (os.cpu_count() or 2) - 1)), thread_name_prefix="lrdsl-compile"))
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


def remember_choices(module) -> int:
    """Give each autotuned kernel of a generated module a memo of its choices: Triton's
    Autotuner.run makes its key from every argument on every launch (dicts of all of them, each
    tensor's dtype as a string), some 15 us of host time per launch, a tenth of a millisecond per
    forward + backward of a delta rule, where the host time is what stands between wall and GPU time
    (issue 43; benchmarks/host_overhead.py). The memo's key is finer than Triton's (the tuning keys'
    values, and each argument's dtype or type in order), so a hit takes the config Triton chose for
    that key; a miss, a config with a pre_hook or a changed space (use_first_configs) goes through
    Triton's run as before. Returns how many kernels got one. The loader applies it unless
    LRDSL_REMEMBER_CHOICES=0 (measured in docs/kernels/host.md)."""
    tuners = [t for t in _autotuners(module) if not getattr(t.run, "_lrdsl_memo", False)]
    for t in tuners:
        _remember(t)
    return len(tuners)


def _autotuners(module) -> list:
    from triton.runtime.autotuner import Autotuner
    return [k for k in _kernels(module) if isinstance(k, Autotuner)]


def _remember(tuner) -> None:
    import torch
    slow, fn = tuner.run, tuner.fn
    where = {name: i for i, name in enumerate(tuner.arg_names)}
    keys = tuple(k for k in tuner.keys if k in where)  # (Triton skips a key that is no argument)
    chosen: dict = {}
    space = [tuner.configs]
    tensor = torch.Tensor

    def run(*args, **kwargs):
        if tuner.configs is not space[0]:  # use_first_configs (or a caller) changed the space
            chosen.clear()
            space[0] = tuner.configs
        key = (tuple([kwargs[k] if k in kwargs else args[where[k]] if where[k] < len(args) else None for k in keys]),
               tuple([getattr(a, "dtype", a.__class__) for a in args]),  # (Triton's rule: what has a dtype)
               tuple([(k, v.dtype) for k, v in kwargs.items() if isinstance(v, tensor)]))
        config = chosen.get(key)
        if config is not None:
            return fn.run(*args, **kwargs, **config)
        tuner.best_config = None  # (set by Triton's run; a stand-in that sets none is not remembered)
        out = slow(*args, **kwargs)
        best = tuner.best_config
        if best is not None and best.pre_hook is None and not kwargs.get("warmup"):
            chosen[key] = best.all_kwargs()
        return out

    run._lrdsl_memo, run._lrdsl_slow = True, slow
    tuner.run = run


def forget_choices(module) -> int:
    """Undo remember_choices (benchmarks/host_overhead.py --ab-memo times both in one process)."""
    tuners = [t for t in _autotuners(module) if getattr(t.run, "_lrdsl_memo", False)]
    for t in tuners:
        t.run = t.run._lrdsl_slow
    return len(tuners)


def _wrap(tuner) -> int:
    if getattr(tuner.run, "_lrdsl_at_once", False):  # a kernel imported by several modules
        return 0
    run, check = tuner.run, tuner.check_disk_cache
    tuner._lrdsl_check = check  # the record on disk, for compile_ahead
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

    run_._lrdsl_at_once = True
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


# ---------------------------------------------------------------------------------------------
# Compile ahead: a call's launches go one after the other, and each kernel compiles (its whole
# space, at once) only when the call reaches it, so a cold first call still pays one compilation
# per kernel in sequence. Before an entry point's first call, compile_ahead runs it once dry: each
# kernel of the module is not launched but submitted for compilation with the launch's own
# arguments (every config of its space where no record is on disk, else the recorded one), all on
# the pool at once; then the call runs for real and finds them compiled. The dry pass computes on
# uninitialised buffers and its result is dropped, so it is used only on entry points that write
# none of their arguments (chunk_fwd, chunk_bwd); anything it cannot do (an exception) just ends it.


class _NoRecord(Exception):
    pass


def compile_ahead(module, entries=("chunk_fwd", "chunk_bwd")) -> None:
    """Make each named entry point of a generated module run dry once before its first call."""
    for name in entries:
        fn = getattr(module, name, None)
        if fn is not None:
            setattr(module, name, _once_dry(module, name, fn))


def _once_dry(module, name, fn):
    def first_call(*args, **kwargs):
        setattr(module, name, fn)  # from now on the entry point itself
        dry_run(module, fn, args, kwargs)
        return fn(*args, **kwargs)
    first_call.__doc__ = fn.__doc__
    return first_call


def dry_run(module, fn, args, kwargs) -> None:
    """fn(*args, **kwargs) with the module's kernels compiled, on the pool, instead of launched."""
    from triton.runtime._async_compile import AsyncCompileMode
    kernels = _kernels(module)
    saved = {id(k): k.__dict__.get("run") for k in kernels}
    try:
        with AsyncCompileMode(_pool(), ignore_errors=True):
            for k in kernels:
                k.run = _dry_launch(k)
            try:  # (Mesa's backward pops what its forward saved: a copy of each dict and list)
                fn(*map(_shallow, args), **{n: _shallow(a) for n, a in kwargs.items()})
            except Exception:  # noqa: BLE001 (what the dry pass missed compiles on its launch, as before)
                pass
            finally:
                for k in kernels:
                    if saved[id(k)] is None:
                        del k.run
                    else:
                        k.run = saved[id(k)]
    except Exception:  # noqa: BLE001 (a compilation that failed fails again on its launch, and says why)
        pass


def _shallow(a):
    return dict(a) if isinstance(a, dict) else list(a) if isinstance(a, list) else a


def _kernels(module) -> list:
    from triton.runtime.jit import KernelInterface
    return [k for k in vars(module).values() if isinstance(k, KernelInterface)]


def _dry_launch(kernel):
    from triton.runtime.autotuner import Autotuner

    def launch(*args, grid=None, warmup=False, **kwargs):
        if isinstance(kernel, Autotuner):
            for c in _configs_to_compile(kernel, args, kwargs):
                _submit(kernel.fn, args, {**kwargs, **c.all_kwargs()})
        else:
            _submit(kernel, args, kwargs)
    return launch


def _submit(fn, args, kwargs) -> None:
    """One compilation on the active pool (Triton's asynchronous mode), with the launch's own
    tensors: the same specialisation, so the same cache entry, as the launch that follows (through
    the class's run: the instance's is the dry launch)."""
    try:
        type(fn).run(fn, *args, grid=(1,), warmup=True, **kwargs)
    except Exception:  # noqa: BLE001 (left to the launch)
        pass


def _configs_to_compile(tuner, args, kwargs) -> list:
    """What the autotuner would compile for this launch: its recorded choice (in memory or on
    disk) for the launch's key, else every config of its space that its pruning keeps."""
    if len(tuner.configs) <= 1:
        return tuner.configs[:1]
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:  # the key as Autotuner.run makes it (triton 3.6)
        given = {k: v for k, v in {**tuner.nargs, **kwargs}.items() if k in tuner.arg_names}
        key = tuple([given[k] for k in tuner.keys if k in given]
                    + [str(v.dtype) for v in given.values() if hasattr(v, "dtype")])
        if key in tuner.cache:
            return [tuner.cache[key]]
        configs = tuner.prune_configs(kwargs)
        if tuner.cache_results:
            def no_record():
                raise _NoRecord
            try:
                getattr(tuner, "_lrdsl_check", tuner.check_disk_cache)(key, configs, no_record)
            except _NoRecord:
                return configs
            if key in tuner.cache:
                return [tuner.cache[key]]
        return configs
    finally:
        tuner.nargs = None


def kernel_name(kernel) -> str:
    """The name of the function under an autotuner or heuristics (the name profilers show)."""
    from triton.runtime.jit import KernelInterface
    while isinstance(kernel, KernelInterface) and hasattr(kernel, "fn") and isinstance(kernel.fn, KernelInterface):
        kernel = kernel.fn
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(fn))


def chosen(module) -> dict:
    """kernel name -> the meta-parameters its autotuner chose, for each autotuned kernel of a module
    that chose one config for every key it met (lrdsl.census counts with them)."""
    out = {}
    for tuner in _autotuners(module):
        picks = {tuple(sorted(c.kwargs.items())) for c in tuner.cache.values()}
        if len(picks) == 1:
            out[kernel_name(tuner)] = dict(picks.pop())
    return out


def force(module, configs: dict) -> int:
    """Give each autotuned kernel of a module that configs names (kernel name -> meta-parameters)
    that one config; returns how many took one."""
    import triton
    n = 0
    for tuner in _autotuners(module):
        meta = configs.get(kernel_name(tuner))
        if meta is not None:
            tuner.configs = [triton.Config(dict(meta))]
            tuner.cache.clear()
            n += 1
    return n
