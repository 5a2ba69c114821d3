"""lrdsl.census: each kernel's FLOPs and bytes counted in Triton's interpreter, and their
extrapolation from two short calls to a shape."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import lrdsl
from lrdsl import census
from lrdsl.bench import Shape
from lrdsl.runtime import loader


@triton.jit
def _known(a_ptr, b_ptr, x_ptr, c_ptr, n_x, n_rows):
    # one [16, 32] x [32, 16] product of fp16 tiles, a masked fp32 vector, a masked fp32 store
    r16, r32 = tl.arange(0, 16), tl.arange(0, 32)
    a = tl.load(a_ptr + r16[:, None] * 32 + r32[None, :])
    b = tl.load(b_ptr + r32[:, None] * 16 + r16[None, :])
    x = tl.load(x_ptr + r16, mask=r16 < n_x, other=0.0)
    c = tl.dot(a, b) + x[None, :]
    tl.store(c_ptr + r16[:, None] * 16 + r16[None, :], c, mask=(r16 < n_rows)[:, None])


def test_the_counts_of_a_kernel_written_by_hand():
    """Three programs of one product each (2 x 16 x 32 x 16 FLOPs), two full fp16 tiles (2 x 512 x 2
    bytes), 10 of 16 fp32 entries loaded and 12 of 16 fp32 rows stored, all at the same addresses:
    the least bytes moved are one program's."""
    a, b = torch.randn(16, 32, dtype=torch.float16), torch.randn(32, 16, dtype=torch.float16)
    x, c = torch.randn(16), torch.full((16, 16), float("nan"))
    found = census.counted(lambda: _known[(3,)](a, b, x, c, 10, 12))
    assert set(found) == {"_known"}
    got = found["_known"]
    assert got.launches == 1
    assert got.flop == 3 * 2 * 16 * 32 * 16
    assert got.load_bytes == 3 * (2 * 512 * 2 + 10 * 4)
    assert got.store_bytes == 3 * 12 * 16 * 4
    assert got.unique_bytes == 2 * 512 * 2 + 10 * 4 + 12 * 16 * 4  # every program reads and writes the same places
    assert torch.isnan(c[12:]).all() and torch.isfinite(c[:12]).all()  # the kernel ran as counted


def test_the_census_counts_a_bf16_calls_intermediates_at_two_bytes(monkeypatch):
    """On the GPU a bf16 call keeps its chunk states and per-token vectors in bf16. The census runs
    fp16 inputs (the interpreter's bf16), whose intermediates a module keeps in fp32 by its own rule:
    the state stage stores nothing else (no final state asked), so counted by that rule its stores
    are twice the census's. The module keeps its own rule outside the census."""
    mixer = lrdsl.compile("examples/gated_deltanet.lr")
    step = census._steps(mixer, Shape(1, 128, 2, 32, 32), False)
    narrow = census.counted(step)["staged_state_kernel"]
    fp16 = torch.zeros(1, dtype=torch.float16)
    assert mixer.kernels._store_dtype(fp16) == torch.float32
    monkeypatch.setattr(loader, "narrow", lambda dtypes: contextlib.nullcontext())
    wide = census.counted(step)["staged_state_kernel"]
    assert wide.store_bytes == 2 * narrow.store_bytes > 0
    assert wide.unique_bytes > narrow.unique_bytes


def test_narrow_gives_every_module_its_own_rule_back():
    """loader.narrow reaches a module loaded before it and one loaded within it, and leaves both as
    they were: a census in a test process must not change later calls' intermediates."""
    before = lrdsl.compile("examples/gated_deltanet.lr").kernels
    fp16, bf16 = torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.bfloat16)
    with loader.narrow((torch.bfloat16, torch.float16)):
        within = lrdsl.compile("examples/retnet.lr").kernels
        assert before._store_dtype(fp16) == within._store_dtype(fp16) == torch.float16
    for mod in (before, within):
        assert mod._store_dtype(fp16) == torch.float32 and mod._store_dtype(bf16) == torch.bfloat16


@pytest.mark.parametrize("name,backward", [pytest.param("rwkv6", True, marks=pytest.mark.slow),
                                           pytest.param("rwkv6", False, marks=pytest.mark.slow),
                                           ("gated_deltanet", False),
                                           pytest.param("gated_deltanet", True, marks=pytest.mark.slow),
                                           pytest.param("linear_attention", True, marks=pytest.mark.slow),
                                           pytest.param("gla", True, marks=pytest.mark.slow)])
def test_the_census_at_a_shape_is_the_count_at_that_shape(name, backward):
    """census() counts at one sequence and head for two lengths, at two sequences and at two heads,
    and extrapolates; a direct count at another length, batch and head count must agree kernel by
    kernel (launches, FLOPs, bytes asked and least bytes: rwkv6's parameter u is read per head,
    the flag-gated kernels' flags once per call)."""
    mixer = lrdsl.compile(f"examples/{name}.lr")
    t1, t2 = census.lengths(mixer)
    s = Shape(2, 2 * t2 - t1 // 2, 3, 32, 32)  # neither length (7 chunks of 64 tokens)
    want = census.counted(census._steps(mixer, s, backward))
    got = census.census(mixer, s, backward)
    assert set(got) == set(want) and want
    for k in want:
        for f in ("launches", "flop", "load_bytes", "store_bytes", "unique_bytes"):
            assert getattr(got[k], f) == pytest.approx(getattr(want[k], f), rel=1e-9), (k, f)
    assert sum(c.flop for c in want.values()) > 0 and sum(c.store_bytes for c in want.values()) > 0


@pytest.mark.slow  # two processes; the spec-error case below runs the command in the default tier
def test_the_census_command_prints_its_table_and_says_what_is_wrong():
    ok = subprocess.run([sys.executable, "-m", "lrdsl.census", "examples/retnet.lr", "--shape", "1,256,2,32,32"],
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert "| staged_state_kernel |" in ok.stdout and "| (all) |" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "lrdsl.census", "examples/retnet.lr", "--shape", "1,256"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "B,T,H,K,V" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # three processes of their own; tuning.force's part is tested below
def test_the_census_counts_with_the_tiles_it_is_given():
    """--configs (tuning.force): gated_deltanet's state pass at value tiles of 128 instead of its
    first config's 32 loads the key-side tiles once per program instead of four times, with the
    same products; a kernel the JSON does not name keeps its first config."""
    import json
    shape = "1,256,1,128,128"

    def counts(configs=None):
        args = [sys.executable, "-m", "lrdsl.census", "examples/gated_deltanet.lr", "--shape", shape, "--json"]
        out = subprocess.run(args + (["--configs", json.dumps(configs)] if configs else []),
                             capture_output=True, text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["fwd"]
    first, wide = counts(), counts({"staged_state_kernel": {"BV": 128}})
    assert first["staged_state_kernel"]["launches"] == wide["staged_state_kernel"]["launches"] == 1
    assert wide["staged_state_kernel"]["flop"] == first["staged_state_kernel"]["flop"]
    assert wide["staged_state_kernel"]["load_bytes"] < first["staged_state_kernel"]["load_bytes"]
    assert wide["staged_output_kernel"] == first["staged_output_kernel"]
    bad = subprocess.run([sys.executable, "-m", "lrdsl.census", "examples/gated_deltanet.lr", "--configs", "[1]"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--configs" in bad.stderr and "Traceback" not in bad.stderr


def test_the_census_sets_and_reads_the_tiles_of_the_kernels_chunk_runs(capsys):
    """rwkv7's chunk runs the staged kernels of its split spec (two tokens per token), whose module is
    not rwkv7's own: --configs reaches them there, `lrdsl bench --per-kernel` reads the autotuners'
    choices there (census.chosen), and a name no kernel has is an error that lists the names."""
    import triton
    mixer = lrdsl.compile("examples/rwkv7.lr")
    split = mixer.split.kernels
    assert split in census.modules(mixer) and mixer.kernels in census.modules(mixer)
    tuner = split.staged_state
    saved = tuner.configs, dict(tuner.cache)
    try:
        census.force(mixer, {"staged_state_kernel": {"BV": 32}})
        assert [c.kwargs for c in tuner.configs] == [{"BV": 32}]
        tuner.cache.clear()
        tuner.cache[("a key",)] = triton.Config({"BV": 64})
        assert census.chosen(mixer)["staged_state_kernel"] == {"BV": 64}
    finally:
        tuner.configs = saved[0]
        tuner.cache.clear()
        tuner.cache.update(saved[1])
    assert census.main(["examples/rwkv7.lr", "--shape", "1,128,1,32,32", "--configs", '{"staged_nope": {}}']) == 2
    err = capsys.readouterr().err
    assert "staged_nope" in err and "staged_state_kernel" in err and "Traceback" not in err


def test_chosen_takes_an_autotuners_one_choice_and_force_gives_it_back():
    """tuning.chosen reads each autotuner's choice (one config for every key it met, else none), by
    the kernel's function name; tuning.force makes that the kernel's only config."""
    import types

    from lrdsl.runtime import tuning

    @triton.jit
    def some_kernel(x, K: tl.constexpr, BV: tl.constexpr):
        pass

    @triton.jit
    def other_kernel(x, K: tl.constexpr, BV: tl.constexpr):
        pass
    configs = [triton.Config({"BV": 32}), triton.Config({"BV": 64})]
    one, two = (triton.autotune(list(configs), key=["K"])(k) for k in (some_kernel, other_kernel))
    one.cache[(16, "torch.float32")] = configs[1]
    one.cache[(32, "torch.float32")] = configs[1]
    two.cache[(16, "torch.float32")] = configs[0]
    two.cache[(32, "torch.float32")] = configs[1]  # two choices: none reported
    module = types.SimpleNamespace(a=one, b=two)
    assert tuning.chosen(module) == {"some_kernel": {"BV": 64}}
    assert tuning.force(module, {"other_kernel": {"BV": 128}}) == 1
    assert [c.kwargs for c in two.configs] == [{"BV": 128}] and not two.cache
    assert len(one.configs) == 2 and one.cache


def test_the_per_kernel_table_puts_each_kernels_counts_over_its_time():
    """bench.kernel_tables with census counts: TFLOP/s, GB/s of the least bytes moved and GB/s asked
    of each kernel's own counts at its GPU time (worked by hand here), matched by function name with
    or without its "_kernel" suffix; a kernel without counts gets dashes; the call's row sums what
    was counted over the whole time."""
    from lrdsl import bench
    from lrdsl.roofline import peak_of
    kernels = [("staged_state_kernel", 0.5, 1), ("staged_dk", 0.25, 1), ("aten_copy", 0.25, 3)]
    counts = {"both": {"staged_state_kernel": census.Counts(1, 1e9, 1e9, 0.5e9, 0.5e9),
                       "staged_dk_kernel": census.Counts(1, 2e9, 0.25e9, 0.25e9, 0.25e9)}}
    row = {"mixer": "m", "lrdsl": {"both_kernels": kernels}}
    text = bench.kernel_tables(row, counts, peak_of("NVIDIA H100 80GB HBM3"))
    lines = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
             if ln.startswith("| ") and not ln.startswith("| kernel")}
    # 1e9 FLOPs / 0.5 ms; 0.5e9 B at least / 0.5 ms (29.9% of 3.35 TB/s); 1.5e9 B asked / 0.5 ms
    assert lines["staged_state_kernel"][3:] == ["2.0", "1000", "0.2%", "29.9%", "3000"]
    assert lines["staged_dk"][3:5] == ["8.0", "1000"] and lines["staged_dk"][7] == "2000"
    assert lines["aten_copy"][3:] == ["-"] * 5
    assert lines["(all)"][3:5] == ["3.0", "750"] and lines["(all)"][7] == "2000"  # over the whole 1 ms


def test_the_census_command_shows_a_spec_error_as_lrdsl_does(tmp_path):
    """A mistake in the spec: the file, line and column, the fix, the line and a caret, no traceback."""
    spec = tmp_path / "bad.lr"
    spec.write_text("mixer x\ninput q[K], k[K], v[V]\nS = S + k w^T\no = S^T q\n")
    out = subprocess.run([sys.executable, "-m", "lrdsl.census", str(spec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{spec}:3:11: error: unknown name 'w'" in out.stderr and "\n            ^" in out.stderr


def test_the_census_says_when_numpy_is_too_new_for_the_interpreter(monkeypatch, capsys):
    """From numpy 2.4 on Triton's interpreter fails on loops over a tensor's count (triton#9171; a GPU
    machine's image had it): the command and `lrdsl bench --per-kernel` say so and what fixes it."""
    import numpy

    from lrdsl import census
    assert census.numpy_problem() is None  # the CPU constraints' numpy
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    assert census.main(["examples/retnet.lr"]) == 2
    err = capsys.readouterr().err
    assert "numpy 2.4.1" in err and "numpy<2.4" in err
    assert census.for_bench("examples/retnet.lr", None, True, None) is None
    assert "no census" in capsys.readouterr().err
