"""`lrdsl fuzz` and lrdsl.fuzz: input draws inside the declared ranges, the command's summary, and a
deliberately broken reference that must be caught, shrunk and printed as a runnable snippet."""
from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specgen import kernel_examples

import lrdsl
import lrdsl.api
from lrdsl import cli
from lrdsl.fuzz import run_fuzz
from lrdsl.testing import Case, draw_inputs, rms_ratio, snippet

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = kernel_examples()  # every example but the offline solve (reference only)
GDN = ROOT / "examples" / "gated_deltanet.lr"


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON_"))}
    env.update(extra)
    return env


def test_rms_ratio():
    b = torch.tensor([3.0, 4.0])
    assert rms_ratio(b, b) == 0.0
    assert rms_ratio(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rms_ratio(torch.ones(2), torch.zeros(2)) == math.inf
    assert math.isclose(rms_ratio(b.double() * 1.1, b.double()), 0.1, rel_tol=1e-9)
    assert math.isnan(rms_ratio(torch.tensor([math.nan, 4.0]), b))


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_draws_stay_inside_declared_ranges(spec):
    mixer = lrdsl.compile(spec)
    case = Case(B=2, T=33, H=2, HV=4, K=20, V=17, initial_state=True, seed=5)
    x, opts = draw_inputs(mixer, case)
    again, _ = draw_inputs(mixer, case)
    for inp in mixer.ir.inputs:
        t = x[inp.name]
        assert torch.equal(t, again[inp.name]), "draws are not reproducible"
        heads = case.H if inp.shared else case.HV
        width = {"scalar": (), "K": (case.K,), "V": (case.V,)}[inp.kind]
        assert t.shape == (case.B, case.T, heads, *width) and t.dtype == torch.float32
        if inp.unit and not inp.l2norm:
            assert torch.allclose(t.norm(dim=-1), torch.ones(()), atol=1e-5)
            continue
        if inp.l2norm:
            continue
        if inp.lo.is_finite:
            assert (t > float(inp.lo)).all() if inp.lo_open else (t >= float(inp.lo)).all(), inp.name
        if inp.hi.is_finite:
            assert (t < float(inp.hi)).all() if inp.hi_open else (t <= float(inp.hi)).all(), inp.name
    assert opts["initial_state"].shape == (case.N, case.HV, case.K, case.V)


def test_draws_do_not_disturb_the_global_rng():
    mixer = lrdsl.compile(GDN)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    draw_inputs(mixer, Case(B=1, T=4, H=1, HV=1, K=16, V=16, seed=9))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow  # a whole `lrdsl fuzz` run in a subprocess (~13 s); the fuzz logic is tested in-process too
def test_fuzz_command_passes_on_gated_deltanet(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "fuzz", str(GDN), "--examples", "5",
                           "--seed", "0", "--device", "cpu"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuzz gated_deltanet: 5 examples passed"), proc.stdout
    assert "5/5" in proc.stderr  # the progress bar
    assert "Traceback" not in proc.stderr


@pytest.fixture
def broken_reference(monkeypatch):
    """The reference adds 1.0 to o: every case must fail."""
    real = lrdsl.api.Mixer.reference

    def off_by_one(self, *args, **kwargs):
        o, s = real(self, *args, **kwargs)
        return o + 1.0, s

    monkeypatch.setattr(lrdsl.api.Mixer, "reference", off_by_one)


def test_run_fuzz_reports_a_broken_comparison_with_a_runnable_snippet(broken_reference):
    mixer = lrdsl.compile(GDN)
    seen = []
    result = run_fuzz(mixer, examples=5, device="cpu", seed=1, progress=lambda *a: seen.append(a))
    assert not result.ok and result.failure is not None
    assert "FAILED" in result.summary() and "rms ratio o" in result.failure.message
    assert seen and seen[-1][2] is True  # progress saw the failure
    code = result.failure.snippet
    compile(code, "<snippet>", "exec")
    assert "lrdsl.compile(" in code and f"torch.manual_seed({result.failure.case.seed})" in code
    # Run it: with the reference still broken it must fail its own assertion (the same case).
    with pytest.raises(AssertionError), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})  # noqa: S102


def test_snippet_passes_with_the_real_reference():
    mixer = lrdsl.compile(GDN)
    case = Case(B=1, T=21, H=1, HV=2, K=20, V=16, cu_seqlens=(0, 4, 21), initial_state=True, scale=0.3, seed=4)
    code = snippet(mixer, case, "recurrent", "cpu")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})  # noqa: S102
    assert out.getvalue().startswith("rms ratio: o ")


def test_snippet_from_text_spec_compiles():
    mixer = lrdsl.compile(text=GDN.read_text())
    code = snippet(mixer, Case(B=1, T=2, H=1, HV=1, K=16, V=16), "recurrent", "cpu")
    compile(code, "<snippet>", "exec")
    assert "lrdsl.compile(text=" in code


def test_fuzz_command_failure_prints_snippet_and_exits_1(broken_reference, capsys):
    rc = cli.main(["fuzz", str(GDN), "--examples", "3", "--seed", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAILED" in captured.err and "Traceback" not in captured.err
    compile(captured.out, "<snippet>", "exec")
    assert "assert err_o <" in captured.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_fuzz_command_cuda_without_gpu_is_one_line(capsys):
    rc = cli.main(["fuzz", str(GDN), "--examples", "1", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) >= 1 and "cuda" in err[-1].lower() and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("spec", sorted(str(p) for p in (Path(__file__).resolve().parent.parent / "examples").glob("*.lr")))
def test_bench_draws_stay_inside_declared_ranges(spec):
    """`lrdsl bench` times kernels on inputs the spec allows (a negative Mesa lamb would time an
    indefinite system), half-infinite ranges included."""
    from lrdsl.bench import Shape, draw
    mixer = lrdsl.compile(spec, load_kernels=False)
    x = draw(mixer, Shape(B=1, T=8, H=2, K=4, V=4), dtype=torch.float32, device="cpu")
    for i in mixer.ir.inputs:
        if not i.log:
            lo, hi = float(i.lo), float(i.hi)
            assert bool(((x[i.name] > lo) & (x[i.name] < hi)).all()), (spec, i.name)
