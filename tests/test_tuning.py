"""lrdsl/tuning.py's plumbing, without a GPU: which configs are compiled before the autotuner times
them, with which arguments, and when not at all (the compilation itself is tested on the GPU,
tests/test_gpu.py::test_a_tuning_space_is_compiled_at_once_then_timed)."""
from __future__ import annotations

import pytest

from lrdsl.runtime import tuning


class FakeConfig:
    def __init__(self, bv):
        self.bv = bv

    def all_kwargs(self):
        return {"BV": self.bv, "num_warps": 4}


class FakeKernel:
    def __init__(self):
        self.warmups = []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((args, grid, kwargs))


class FakeTuner:
    """The part of triton's Autotuner that tuning.py wraps: run, then check_disk_cache, which
    calls bench only where it has no record."""

    def __init__(self, configs, recorded):
        self.fn, self.configs, self.recorded, self.benched = FakeKernel(), configs, recorded, 0

    def run(self, *args, **kwargs):
        self.check_disk_cache(("key",), self.configs, self.bench)
        return "launched"

    def check_disk_cache(self, key, configs, bench):
        if not self.recorded:
            bench()
        return self.recorded

    def bench(self):
        self.benched += 1


def test_every_config_is_compiled_with_the_launchs_arguments_before_it_is_timed():
    tuner = FakeTuner([FakeConfig(32), FakeConfig(64)], recorded=False)
    tuning._wrap(tuner)
    assert tuner.run(1, "x", grid=(3,), warmup=False, H=4) == "launched"
    assert tuner.benched == 1
    assert [w[2] for w in tuner.fn.warmups] == [{"H": 4, "BV": 32, "num_warps": 4}, {"H": 4, "BV": 64, "num_warps": 4}]
    assert all(w[0] == (1, "x") and w[1] == (1,) for w in tuner.fn.warmups)


def test_nothing_is_compiled_ahead_with_a_record_on_disk_or_a_single_config():
    for tuner in (FakeTuner([FakeConfig(32), FakeConfig(64)], recorded=True), FakeTuner([FakeConfig(32)], recorded=False)):
        tuning._wrap(tuner)
        tuner.run(1, grid=(1,), warmup=False)
        assert tuner.fn.warmups == []


def test_a_config_that_does_not_compile_is_left_to_the_autotuner():
    tuner = FakeTuner([FakeConfig(32), FakeConfig(64)], recorded=False)

    def warmup(*args, grid, **kwargs):
        if kwargs["BV"] == 32:
            raise RuntimeError("out of resources")
        tuner.fn.warmups.append(kwargs["BV"])
    tuner.fn.warmup = warmup
    tuning._wrap(tuner)
    tuner.run(grid=(1,), warmup=False)
    assert tuner.fn.warmups == [64] and tuner.benched == 1


def test_the_autotuners_of_a_package_are_found_under_heuristics_and_wrapped_once(monkeypatch):
    """lrdsl bench's FLA kernels: autotuners at the top level of a package's loaded modules, bare or
    under triton.heuristics, each wrapped once however many modules import it; nothing else."""
    import sys
    import types

    import triton

    def kernel(x, BV: triton.language.constexpr):
        pass
    space = [triton.Config({"BV": 32}), triton.Config({"BV": 64})]
    bare = triton.autotune(space, key=[])(triton.jit(kernel))
    under = triton.heuristics({"H": lambda a: 1})(triton.autotune(space, key=[])(triton.jit(kernel)))
    plain = triton.jit(kernel)
    a, b, other = (types.ModuleType(n) for n in ("pkg.ops.a", "pkg.ops.b", "pkgx.c"))
    a.k1, a.k2, a.f, a.n = bare, under, plain, 3
    b.k1 = bare  # imported again
    other.k = triton.autotune(space, key=[])(triton.jit(kernel))
    for m in (a, b, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    run = bare.run
    assert tuning.compile_loaded_autotuners("pkg") == 2
    assert bare.run is not run
    assert getattr(under.fn.run, "_lrdsl_at_once", False) and not hasattr(other.k.run, "_lrdsl_at_once")
    assert tuning.compile_loaded_autotuners("pkg") == 0


def _module_with_kernels(monkeypatch):
    """A generated module's shape for compile_ahead: two autotuned kernels (one with a recorded
    choice for the call's key), a plain one, and an entry point that launches all three and pops
    what it was given (as the backward pops the forward's saved dict). Launches are recorded,
    compilations too (tuning._submit)."""
    import types

    import torch
    import triton

    def kernel(x, H, BV: triton.language.constexpr):
        pass
    space = [triton.Config({"BV": 32}), triton.Config({"BV": 64})]
    mod = types.ModuleType("lrdsl_generated_test")
    mod.t1 = triton.autotune(space, key=["H"])(triton.jit(kernel))
    mod.t2 = triton.autotune(space, key=["H"])(triton.jit(kernel))
    mod.p = triton.jit(kernel)
    x = torch.ones(3)
    mod.t2.cache[(4, str(x.dtype))] = space[1]
    log = []
    for name in ("t1", "t2", "p"):  # the launches (as lrdsl.runtime.tuning._wrap's instance attribute)
        getattr(mod, name).run = lambda *a, _n=name, **k: log.append(("launch", _n))
    monkeypatch.setattr(tuning, "_submit", lambda fn, args, kwargs: log.append(
        ("compile", fn.fn.__name__, kwargs.get("BV"), kwargs.get("H"))))

    def chunk_fwd(x, saved):
        mod.t1[(1,)](x, H=4)
        if mod.all_three:
            mod.t2[(1,)](x, H=4)
            mod.p[(1,)](x, H=4, BV=16)
        return saved.pop("a")
    mod.chunk_fwd, mod.all_three = chunk_fwd, True
    return mod, x, log


def test_a_first_call_compiles_every_kernel_it_launches_ahead_then_runs(monkeypatch):
    mod, x, log = _module_with_kernels(monkeypatch)
    launches = {n: getattr(mod, n).run for n in ("t1", "t2", "p")}
    tuning.compile_ahead(mod, entries=("chunk_fwd", "chunk_bwd"))
    saved = {"a": "out"}
    assert mod.chunk_fwd(x, saved) == "out" and saved == {}
    # dry: t1's whole space, t2's recorded choice, p as launched; nothing launched; then the call
    assert log == [("compile", "kernel", 32, 4), ("compile", "kernel", 64, 4), ("compile", "kernel", 64, 4),
                   ("compile", "kernel", 16, 4), ("launch", "t1"), ("launch", "t2"), ("launch", "p")]
    assert {n: getattr(mod, n).run for n in launches} == launches  # the kernels' own launches again
    log.clear()
    mod.all_three = False
    assert mod.chunk_fwd(x, {"a": 1}) == 1 and log == [("launch", "t1")]  # no dry pass after the first


def test_a_dry_pass_that_fails_leaves_the_call_alone(monkeypatch):
    mod, x, log = _module_with_kernels(monkeypatch)
    real = mod.chunk_fwd

    failed = []

    def fails_first(x, saved):  # e.g. a host read of an uninitialised buffer
        if not failed:
            failed.append(1)
            mod.t1[(1,)](x, H=4)
            raise RuntimeError("dry")
        return real(x, saved)
    mod.chunk_fwd = fails_first
    tuning.compile_ahead(mod)
    assert mod.chunk_fwd(x, {"a": 2}) == 2
    assert log[:2] == [("compile", "kernel", 32, 4), ("compile", "kernel", 64, 4)] and ("launch", "t2") in log


# kda's module without keep_intermediates under -m slow: kda's with it runs the same dry passes and more
@pytest.mark.parametrize("name, keep", [("gated_deltanet", False), pytest.param("kda", False, marks=pytest.mark.slow),
                                        ("kda", True), pytest.param("mesa", False, marks=pytest.mark.slow)])
def test_a_dry_pass_leaves_the_calls_output_and_gradients_alone(name, keep, compiled, monkeypatch):
    """compile_ahead on a real module (Triton's interpreter): the dry passes of chunk_fwd and
    chunk_bwd run their host code with no kernel launched (nor compiled, here), then the forward and
    backward run and give the output and gradients of a call without them, bit for bit: the dry
    pass wrote nothing the call reads (Mesa's backward pops what its forward saved for it: without
    the dry pass's copies of the dicts it is given, the call finds them emptied)."""
    import os

    import torch

    from lrdsl.bench import draw, parse_shape
    mixer = compiled(os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.lr"), keep_intermediates=keep)
    x = draw(mixer, parse_shape("1,100,2,16,16"), torch.float32, "cpu", seed=3)
    do = torch.randn(1, 100, 2, 16, generator=torch.Generator().manual_seed(4))

    def call():
        leaves = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}
        o = mixer.chunk(**leaves)[0]
        o.backward(do)
        return o.detach(), {n: t.grad for n, t in leaves.items() if t.grad is not None}
    o0, g0 = call()
    mod = mixer.kernels
    entries = mod.chunk_fwd, mod.chunk_bwd
    dry, ran, submitted = tuning.dry_run, [], []

    def counted(module, fn, args, kwargs):
        ran.append(fn.__name__)
        dry(module, fn, args, kwargs)
    monkeypatch.setattr(tuning, "dry_run", counted)
    monkeypatch.setattr(tuning, "_submit", lambda fn, args, kwargs: submitted.append(fn))
    tuning.compile_ahead(mod)
    o1, g1 = call()
    assert ran == ["chunk_fwd", "chunk_bwd"] and submitted
    assert (mod.chunk_fwd, mod.chunk_bwd) == entries
    assert torch.equal(o0, o1) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_a_remembered_choice_is_the_autotuners_own_for_that_key():
    """tuning.remember_choices on a real triton Autotuner (its own key: the tuning keys' values and
    each tensor's dtype; choices put in its cache, so nothing is timed): a launch takes the config
    the autotuner chose for its key, another key value or dtype its own, a repeat the remembered
    one without asking the autotuner again, and a new space (use_first_configs) is asked anew."""
    import types

    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, K: tl.constexpr, BV: tl.constexpr):
        pass

    configs = [triton.Config({"BV": 32}), triton.Config({"BV": 64})]
    tuner = triton.autotune(configs, key=["K"])(kernel)
    launched = []
    tuner.fn.run = lambda *args, **kwargs: launched.append(kwargs["BV"])
    tuner.cache[(16, "torch.float32")] = configs[1]
    tuner.cache[(16, "torch.bfloat16")] = configs[0]
    tuner.cache[(32, "torch.float32")] = configs[0]
    assert tuning.remember_choices(types.SimpleNamespace(k=tuner, other=kernel)) == 1
    assert tuning.remember_choices(types.SimpleNamespace(k=tuner)) == 0  # once
    x32, x16 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    for x, K in ((x32, 16), (x16, 16), (x32, 32)):
        tuner.run(x, grid=(1,), warmup=False, K=K)
    assert launched == [64, 32, 32]
    tuner.cache.clear()  # a remembered key no longer asks the autotuner (which would time the configs)
    tuner.run(x32, grid=(1,), warmup=False, K=16)
    tuner.run(x16, grid=(1,), warmup=False, K=16)
    assert launched[3:] == [64, 32]
    tuner.configs = configs[:1]  # a space of one: the autotuner takes it without a key
    tuner.run(x32, grid=(1,), warmup=False, K=16)
    assert launched[5:] == [32]


@pytest.mark.parametrize("env, memo", [(None, True), ("0", False)])
def test_the_loader_gives_each_autotuner_its_memo_unless_told_not_to(monkeypatch, env, memo):
    """runtime/loader.py applies remember_choices to every module it imports (measured on the GPU:
    docs/kernels/host.md), and LRDSL_REMEMBER_CHOICES=0 leaves Triton's own run."""
    import sys

    import lrdsl
    from lrdsl.runtime import loader
    if env is None:
        monkeypatch.delenv("LRDSL_REMEMBER_CHOICES", raising=False)
    else:
        monkeypatch.setenv("LRDSL_REMEMBER_CHOICES", env)
    m = lrdsl.compile("examples/gated_deltanet.lr")
    names = [n for n in sys.modules if n.startswith(f"lrdsl_generated_{m.ir.name}_")]
    for n in names:
        monkeypatch.delitem(sys.modules, n)  # imported anew here, as it was before the test
    mod = loader.load(m.ir)
    tuners = tuning._autotuners(mod)
    assert tuners and all(getattr(t.run, "_lrdsl_memo", False) == memo for t in tuners)
