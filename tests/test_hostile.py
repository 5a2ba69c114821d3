"""A careless or hostile user: huge spec files, non-text specs, cache faults. Each gets a clear
error or a correct result, never a traceback or a hang."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lrdsl
from lrdsl.runtime import loader as runtime

ROOT = Path(__file__).resolve().parent.parent


def spec(name: str) -> str:
    return f"mixer {name}\ndecay scalar g\ngain none\n"


def test_check_of_an_endless_file_stops_at_the_size_limit():
    proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "check", "/dev/zero"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "bytes" in proc.stderr and "at most" in proc.stderr, proc.stderr


def test_check_of_a_fifo_is_refused_at_once(tmp_path):
    """Opening a FIFO to read waits for a writer, here forever: it is refused in one line instead."""
    fifo = tmp_path / "spec.lr"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "check", str(fifo)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "FIFO" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("text", [123, ["mixer x"], 4.5])
def test_compile_of_something_that_is_not_text(text):
    with pytest.raises(TypeError, match="str or bytes"):
        lrdsl.compile(text=text)


def _load_fresh(name, monkeypatch, cache):
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(cache))
    monkeypatch.setattr(runtime, "_FALLBACK", [])
    m = lrdsl.compile(text=spec(name), load_kernels=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = runtime.load(m.ir)
    return m, mod, [w for w in caught if "kernel cache" in str(w.message)]


def test_cache_dir_that_is_a_file_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    _, mod, warned = _load_fresh("cache_fault_file", monkeypatch, blocker)
    assert hasattr(mod, "chunk") and len(warned) == 1
    assert blocker.read_text() == "x"


def test_cached_module_that_is_not_utf8_is_rewritten(tmp_path, monkeypatch):
    m = lrdsl.compile(text=spec("cache_fault_bytes"), load_kernels=False)
    source = runtime.generate(m.ir)
    path = tmp_path / f"{m.name}_{runtime.module_key(m.ir, source)}.py"
    path.write_bytes(b"\xff\xfe garbage")
    _, mod, warned = _load_fresh("cache_fault_bytes", monkeypatch, tmp_path)
    assert hasattr(mod, "chunk") and not warned
    assert path.read_text() == source


def test_a_folder_where_the_module_goes_falls_back(tmp_path, monkeypatch):
    m = lrdsl.compile(text=spec("cache_fault_dir"), load_kernels=False)
    source = runtime.generate(m.ir)
    (tmp_path / f"{m.name}_{runtime.module_key(m.ir, source)}.py").mkdir()
    _, mod, warned = _load_fresh("cache_fault_dir", monkeypatch, tmp_path)
    assert hasattr(mod, "chunk") and len(warned) == 1


# one Python start-up each: the same refusal for the other installed modules under -m slow
@pytest.mark.parametrize("name", ["mpmath", *(pytest.param(n, marks=pytest.mark.slow)
                                             for n in ("typing_extensions", "hypothesis"))])
def test_compile_refuses_a_name_that_would_shadow_an_installed_module(name, tmp_path):
    path = tmp_path / "s.lr"
    path.write_text(spec(name))
    proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "compile", str(path), "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "shadow" in proc.stderr, proc.stderr
    assert not (tmp_path / f"{name}.py").exists()


def test_compile_again_into_the_same_folder_is_not_shadowing(tmp_path):
    """A module written earlier by `lrdsl compile` may be importable (the folder on sys.path)."""
    path = tmp_path / "s.lr"
    path.write_text(spec("written_twice"))
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "compile", str(path), "-o", "."],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def gdn():
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("LRDSL_TEST_DEVICE") == "cuda"
    return lrdsl.compile(ROOT / "examples" / "gated_deltanet.lr")


def _inputs(B=1, T=8, H=1, K=16, V=16):
    import torch
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H), beta=torch.rand(B, T, H))


@pytest.mark.parametrize("path", ["reference", "chunk", "recurrent"])
@pytest.mark.parametrize("case", ["scale nan", "scale inf", "meta", "empty batch"])
def test_bad_tensors_get_one_clear_error(gdn, path, case):
    from lrdsl.errors import InputError
    x, kw = _inputs(), {}
    if case.startswith("scale"):
        kw["scale"] = float(case.split()[1])
    elif case == "meta":
        x = {n: t.to("meta") for n, t in x.items()}
    else:
        x = {n: t[:0] for n, t in x.items()}
    with pytest.raises(InputError):
        getattr(gdn, path)(**x, **kw)


@pytest.mark.parametrize("path", ["reference", "chunk", "recurrent"])
def test_meta_cu_seqlens_gets_one_clear_error(gdn, path):
    import torch

    from lrdsl.errors import InputError
    x = _inputs()
    with pytest.raises(InputError, match="cu_seqlens is a meta tensor"):
        getattr(gdn, path)(**x, cu_seqlens=torch.tensor([0, 3, 8], device="meta"))


@pytest.mark.parametrize("group", [0, "gloo", object()])
def test_a_cp_group_that_is_not_a_process_group(gdn, group):
    from lrdsl.errors import InputError
    with pytest.raises(InputError, match="cp_group must be a torch.distributed process group") as e:
        gdn.chunk(**_inputs(), cp_group=group)
    assert "\n" not in str(e.value)


def test_step_without_a_state(gdn):
    from lrdsl.errors import InputError
    with pytest.raises(InputError, match="state"):
        gdn.step(**_inputs(T=1), state=None)


@pytest.mark.parametrize("text,where", [
    ("mixer ovf\\ninput q[K], k[K], v[V]\\nS = S + (1e39*k) v^T\\no = S^T q\\n", ":3:"),
    ("mixer ovf\\ndecay constant 1e300*1e300\\ngain none\\n", ""),
])
def test_constants_beyond_float32_are_spec_errors(text, where):
    from lrdsl.errors import SpecError
    with pytest.raises(SpecError, match="float32") as e:
        lrdsl.compile(text=text.encode().decode("unicode_escape"), load_kernels=False)
    assert where in str(e.value)


def _chain(n, step):
    lines = ["mixer chain", "input q[K], k[K] l2norm, v[V], b in (0, 1)", "let x0 = b"]
    lines += [f"let x{i} = " + step.format(p=f"x{i - 1}") for i in range(1, n)]
    return "\n".join(lines + [f"S = (I - (0.5*x{n - 1}*k) k^T) S + k v^T", "o = S^T q"]) + "\n"


@pytest.mark.parametrize("step", ["{p}*b + 0.5", "sigmoid({p})"])
def test_a_let_chain_too_deep_to_analyse_is_refused_where_it_gets_too_deep(step):
    from lrdsl.errors import SpecError
    with pytest.raises(SpecError, match="levels deep") as e:
        lrdsl.compile(text=_chain(2000, step), load_kernels=False)
    line = int(str(e.value).split(":")[1])
    assert 10 < line < 100  # the let where the depth passed the cap, not the end of the file


@pytest.mark.parametrize("into", ["write", "erase"])
def test_compile_work_grows_linearly_in_a_let_chain(into, monkeypatch):
    """Substitutions (sympy xreplace) and lambdify calls of compile + check, counted (not timed) at
    40 and 80 lets into the write or the erase: the lets are inlined once, in order, so doubling
    the chain at most doubles the substitutions (inlining every let again for each one was
    quadratic: 4x), and no let is lambdified unless a witness reports it."""
    import sympy as sp
    calls = {"xreplace": 0, "lambdify": 0}
    real_x, real_l = sp.Basic.xreplace, sp.lambdify

    def xreplace(self, *a, **k):
        calls["xreplace"] += 1
        return real_x(self, *a, **k)

    def lambdify(*a, **k):
        calls["lambdify"] += 1
        return real_l(*a, **k)
    monkeypatch.setattr(sp.Basic, "xreplace", xreplace)
    monkeypatch.setattr(sp, "lambdify", lambdify)
    counts = []
    for n in (40, 80):
        calls.update(xreplace=0, lambdify=0)
        text = _chain(n, "{p}*0.5 + 0.25")
        if into == "write":
            text = text.replace(f"S = (I - (0.5*x{n - 1}*k) k^T) S + k v^T",
                                f"S = (I - 0.5 k k^T) S + (x{n - 1}*k) v^T")
        lrdsl.compile(text=text, load_kernels=False).check()
        counts.append(dict(calls))
    assert counts[1]["xreplace"] <= 2 * counts[0]["xreplace"], counts
    assert counts[1]["lambdify"] == counts[0]["lambdify"], counts


@pytest.mark.slow
def test_a_long_chain_that_folds_compiles():
    m = lrdsl.compile(text=_chain(2000, "{p}*0.5 + 0.25"), load_kernels=False)
    assert m.check()["stable"]


def test_simplify_never_sees_deeply_nested_functions(monkeypatch):
    """sympy.simplify takes time exponential in nested functions (8 nested sigmoids: 30 s);
    the front end, checker and plan call it only on shallow expressions."""
    import sympy as sp

    from lrdsl.frontend import symbolic
    real, seen = sp.simplify, []

    def spy(e, *a, **k):
        seen.append(symbolic.nesting(sp.sympify(e)))
        return real(e, *a, **k)
    monkeypatch.setattr(sp, "simplify", spy)
    e = "b"
    for _ in range(8):
        e = f"sigmoid({e})"
    text = f"mixer deep\ninput q[K], k[K] l2norm, v[V], b in (0, 1)\nS = (I - (0.5*{e}*k) k^T) S + k v^T\no = S^T q\n"
    from lrdsl.codegen.plan import plan
    m = lrdsl.compile(text=text, load_kernels=False)
    plan(m.ir)
    assert seen and max(seen) <= symbolic.MAX_SIMPLIFY_NESTING


@pytest.mark.parametrize("expr,line", [("-0.1*log(beta)", 3), ("0.5*r", 3)])
def test_primitives_outside_their_domain_are_spec_errors(expr, line):
    """log(beta) or sqrt(beta) with beta declared in [-1, 1] can only give nan for half the range."""
    from lrdsl.errors import SpecError
    let = "let r = sqrt(beta)\n" if "r" in expr.split("*")[-1] else ""
    text = (f"mixer dom\ninput q[K], k[K] l2norm, v[V], beta in [-1, 1]\n{let}"
            f"S = (I - ({expr}*k) k^T) S + k v^T\no = S^T q\nallow unstable\n")
    with pytest.raises(SpecError, match="nan for some admissible inputs") as e:
        lrdsl.compile(text=text, load_kernels=False)
    assert f":{line}:" in str(e.value)
    lrdsl.compile(text=text.replace("beta in [-1, 1]", "beta in (0, 1)"), load_kernels=False)


# through cli.main in this process in pytest -q; a real `python -m lrdsl.cli` (a Python start-up
# importing torch) under -m slow
@pytest.mark.parametrize("process", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["in-process", "subprocess"])
@pytest.mark.parametrize("args,message", [(["--shape", "4,4096"], "five positive integers"),
                                          ([], "CUDA")])
def test_bench_misuse_is_one_clear_error(args, message, process):
    import contextlib
    import io

    import torch
    if message == "CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU error cannot occur")
    argv = ["bench", *args, str(ROOT / "examples" / "mamba2.lr")]
    if process:
        proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", *argv], capture_output=True, text=True, timeout=120)
        rc, stderr = proc.returncode, proc.stderr
    else:
        from lrdsl import cli
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(argv)
        stderr = err.getvalue()
    assert rc == 1 and "Traceback" not in stderr and message in stderr, stderr


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_bench_prints_the_specs_it_finished(how, monkeypatch, capsys):
    """`timeout` (SIGTERM) or Ctrl-C during the second of three specs: the first spec's row is
    printed in the table, the stop is said in one line, and the exit status is 130."""
    import os
    import signal

    import torch

    from lrdsl import bench, cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test device")
    calls = []

    def fake_bench(mixer, s, backward, with_twin, log):
        calls.append(mixer.name)
        if len(calls) == 2:
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        return {"mixer": mixer.name, "shape": s, "flop": 1e12,
                "lrdsl": {"fwd_ms": 0.5 + len(calls), "fwd_mem": 2 ** 30}}
    monkeypatch.setattr(bench, "bench", fake_bench)
    def guard(signum, frame):  # bench left SIGTERM alone: fail here rather than end pytest
        raise RuntimeError("SIGTERM reached the handler bench should have replaced")
    previous = signal.signal(signal.SIGTERM, guard)
    specs = [str(ROOT / "examples" / f"{n}.lr") for n in ("mamba2", "retnet", "linear_attention")]
    try:
        rc = cli.main(["bench", *specs])
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    assert rc == 130
    assert "| mamba2 | 4,4096,16,128,128 | 1.500 |" in out and "retnet |" not in out
    assert "stopped during" in err and "retnet.lr" in err and "1 of 3" in err and "Traceback" not in err
    assert restored is guard  # the caller's handler is put back


def test_bench_keep_intermediates_adds_a_kept_row(monkeypatch, capsys):
    """--keep-intermediates: under each spec's row (timed with its backward, as --backward) a row of
    the spec compiled with keep_intermediates=True, forward + backward, lrdsl alone."""
    import torch

    from lrdsl import bench, cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test device")
    calls = []

    def fake_bench(mixer, s, backward, with_twin, log):
        calls.append((mixer.name, mixer.keep_intermediates, backward, with_twin))
        return {"mixer": mixer.name, "shape": s, "flop": 1e12,
                "lrdsl": {"fwd_ms": 1.0, "both_ms": 3.0 - mixer.keep_intermediates, "bwd_mem": 2 ** 30}}
    monkeypatch.setattr(bench, "bench", fake_bench)
    specs = [str(ROOT / "examples" / f"{n}.lr") for n in ("mamba2", "kda")]
    assert cli.main(["bench", "--keep-intermediates", *specs]) == 0
    out = capsys.readouterr().out
    assert calls == [("mamba2", False, True, True), ("mamba2", True, True, False),
                     ("kda", False, True, True), ("kda", True, True, False)]
    rows = [line for line in out.splitlines() if line.startswith("| mamba2") or line.startswith("| kda")]
    assert [r.split(" | ")[0] for r in rows] == ["| mamba2", "| mamba2 (keep_intermediates)", "| kda",
                                                 "| kda (keep_intermediates)"]
    assert " 3.000 | " in rows[0] and " 2.000 | " in rows[1]


def test_a_killed_bench_leaves_the_rows_it_finished(tmp_path):
    """A bench killed outright (SIGKILL: no handler runs) during its second spec has already
    printed the first spec's row, since each row is printed as its spec finishes."""
    script = tmp_path / "killed_bench.py"
    script.write_text(
        "import os, signal, sys\n"
        "import torch\n"
        "from lrdsl import bench, cli\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.get_device_name = lambda: 'test device'\n"
        "calls = []\n"
        "def fake_bench(mixer, s, backward, with_twin, log):\n"
        "    calls.append(mixer.name)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return {'mixer': mixer.name, 'shape': s, 'flop': 1e12, 'lrdsl': {'fwd_ms': 1.25, 'fwd_mem': 2 ** 30}}\n"
        "bench.bench = fake_bench\n"
        "sys.exit(cli.main(['bench', *sys.argv[1:]]))\n")
    specs = [str(ROOT / "examples" / f"{n}.lr") for n in ("mamba2", "retnet")]
    proc = subprocess.run([sys.executable, str(script), *specs], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == -9, proc.stderr
    assert "| mamba2 | 4,4096,16,128,128 | 1.250 |" in proc.stdout and "| retnet |" not in proc.stdout
