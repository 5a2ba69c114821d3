"""`lrdsl compile` and the module cache: standalone modules, determinism, no spec text in generated
code, refused names, and the on-disk cache under concurrent writers."""
from __future__ import annotations

import ast
import contextlib
import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from specgen import kernel_examples

import lrdsl
from lrdsl import cli
from lrdsl.runtime import loader as runtime
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

ROOT = Path(__file__).resolve().parent.parent
# every example but the offline solve (reference only) and those whose readout reads before the update
# (rwkv6: S_prev^T and dot products run in lrdsl.Mixer; `lrdsl compile` refuses them, test_readouts.py)
# a readout around the kernels and a product of steps per token run inside lrdsl.Mixer: no module alone
EXAMPLES = tuple(p for p in kernel_examples() if not (lambda m: m.reads_before or m.steps)(
    lrdsl.compile(p, load_kernels=False).ir))
IDS = [p.stem for p in EXAMPLES]


def run_cli(*argv) -> tuple:
    """lrdsl's main() in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LRDSL_", "PYTHON", "TRITON_"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    """Every example compiled by `lrdsl compile -o DIR`: {stem: (mixer, path)}."""
    out = tmp_path_factory.mktemp("compiled")
    result = {}
    for spec in EXAMPLES:
        rc, stdout, stderr = run_cli("compile", spec, "-o", out)
        assert rc == 0, stderr
        mixer = lrdsl.compile(spec)
        path = out / f"{mixer.name}.py"
        assert stdout.strip() == str(path)
        result[spec.stem] = (mixer, path)
    return result


# ---- the written module runs alone ----------------------------------------------------------
RUNNER = textwrap.dedent('''
    import ast, importlib, importlib.abc, sys
    import torch

    class Block(importlib.abc.MetaPathFinder):  # lrdsl is installed in this venv: make sure it is unused
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lrdsl", "jinja2", "lark"):
                raise ImportError(f"a generated module imported {name}")
            return None

    sys.meta_path.insert(0, Block())
    cases = torch.load(sys.argv[1])
    results = {}
    for stem, (module, x, opts) in cases.items():
        mod = importlib.import_module(module)
        o, s = mod.recurrent(**x, **opts)
        results[stem] = (o, s)
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("lrdsl", "jinja2", "lark", "sympy"))
    torch.save({"results": results, "loaded": bad}, sys.argv[2])
''')

ALONE_CASE = Case(B=1, T=19, H=1, HV=2, K=20, V=12, initial_state=True, scale=0.5, seed=7)


# pytest -q runs these alone (a scalar and a per-channel decay, an auxiliary state, a value-side and a
# two-phase spec); every example under -m slow
ALONE_DEFAULT = {"gated_deltanet", "kda", "gdn2_atk", "oja", "rwkv7"}
ALONE_PARAMS = [pytest.param(s, marks=() if s in ALONE_DEFAULT else pytest.mark.slow) for s in IDS]


@pytest.fixture(scope="module")
def standalone_results(compiled_dir, tmp_path_factory, request):
    """Run the selected compiled modules' recurrent(...) in one fresh interpreter that sees only the
    output directory, torch and triton (cwd: an empty temporary directory)."""
    selected = {it.callspec.params["stem"] for it in request.session.items
                if getattr(it, "originalname", None) == "test_compiled_module_runs_alone"}
    work = tmp_path_factory.mktemp("standalone")
    cases, refs = {}, {}
    for stem, (mixer, path) in compiled_dir.items():
        if stem not in selected:
            continue
        x, opts = draw_inputs(mixer, ALONE_CASE)
        cases[stem] = (path.stem, x, opts)
        refs[stem] = mixer.reference(**{n: t.double() for n, t in x.items()},
                                     **dict(opts, initial_state=opts["initial_state"].double()))
    torch.save(cases, work / "inputs.pt")
    (work / "runner.py").write_text(RUNNER)
    out_dir = next(iter(compiled_dir.values()))[1].parent
    env = clean_env(PYTHONPATH=str(out_dir), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(work / "runner.py"), "inputs.pt", "outputs.pt"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = torch.load(work / "outputs.pt")
    return saved, refs


@pytest.mark.parametrize("stem", ALONE_PARAMS)
def test_compiled_module_runs_alone(stem, compiled_dir, standalone_results):
    saved, refs = standalone_results
    assert saved["loaded"] == [], f"the standalone run loaded {saved['loaded']}"
    o, s = saved["results"][stem]
    ref_o, ref_s = refs[stem]
    ref_s = ref_s.S if isinstance(ref_s, lrdsl.MixerState) else ref_s  # the standalone module hands out S
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{stem}: rms ratio o {e_o:.3g}, state {e_s:.3g}"


@pytest.mark.parametrize("stem", IDS)
def test_compiled_module_imports_only_torch_and_triton(stem, compiled_dir):
    _, path = compiled_dir[stem]
    tree = ast.parse(path.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in a generated module"
            roots.add(node.module.split(".")[0])
    assert roots <= {"torch", "triton", "math", "dataclasses"}, roots  # (two of the standard library)


# ---- determinism -----------------------------------------------------------------------------
# a fresh process per hash seed (each a Python start-up compiling every example): seed 1 differs
# from this process's random one in pytest -q, seed 2 under -m slow
@pytest.mark.parametrize("seeds", [("1",), pytest.param(("2",), marks=pytest.mark.slow)], ids=["1", "2"])
def test_same_spec_same_bytes(compiled_dir, tmp_path, seeds):
    """Compile again in this process and in fresh processes with other hash seeds."""
    again = tmp_path / "again"
    for stem, (mixer, path) in compiled_dir.items():
        rc, _, err = run_cli("compile", ROOT / "examples" / f"{stem}.lr", "-o", again)
        assert rc == 0, err
        assert (again / path.name).read_bytes() == path.read_bytes(), stem
    script = "import sys; from lrdsl.cli import main; sys.exit(max(main(['compile', p, '-o', sys.argv[1]]) " \
             "for p in sys.argv[2:]))"
    for seed in seeds:
        out = tmp_path / f"seed{seed}"
        proc = subprocess.run([sys.executable, "-c", script, str(out), *map(str, EXAMPLES)], cwd=tmp_path,
                              env=clean_env(PYTHONHASHSEED=seed), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for stem, (mixer, path) in compiled_dir.items():
            assert (out / path.name).read_bytes() == path.read_bytes(), f"{stem} (PYTHONHASHSEED={seed})"


def test_generated_source_matches_runtime_generate(compiled_dir):
    for stem, (mixer, path) in compiled_dir.items():
        assert path.read_text() == runtime.generate(mixer.ir) + cli.FORWARD_ONLY
        compile(path.read_text(), str(path), "exec")


def _import_written(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("stem", ["gated_deltanet", "mesa_retention"])  # mesa: its states are tuples
def test_written_module_is_forward_only_and_says_so(stem, tmp_path):
    """The written chunk and recurrent run outside autograd: an input or initial state that
    requires grad is refused under grad mode (else q, k, v would silently get no gradient inside a
    larger loss); without gradients they match the float64 reference."""
    rc, stdout, err = run_cli("compile", ROOT / "examples" / f"{stem}.lr", "-o", tmp_path)
    assert rc == 0, err
    mixer = lrdsl.compile(ROOT / "examples" / f"{stem}.lr", load_kernels=False)
    mod = _import_written(Path(stdout.strip()), f"written_{stem}_forward_only")
    x, opts = draw_inputs(mixer, Case(B=1, T=9, H=1, HV=1, K=16, V=16, seed=11))
    ref_o, _ = mixer.reference(**{n: t.double() for n, t in x.items()}, **opts)
    S0 = torch.zeros(1, 1, 16, 16, requires_grad=True)
    state = S0 if mixer.ir.solve_lam is None else (S0, torch.zeros(1, 1, 16, 16), [])
    for fn in ("chunk", "recurrent"):
        o, _ = getattr(mod, fn)(**x, **opts)
        assert rms_ratio(o, ref_o) < TOL, fn
        y = dict(x, q=x["q"].clone().requires_grad_())
        with pytest.raises(RuntimeError, match="forward only"):
            getattr(mod, fn)(**y, **opts)
        with pytest.raises(RuntimeError, match="forward only"):
            getattr(mod, fn)(**dict(opts, initial_state=state), **x)
        with torch.no_grad():
            o, _ = getattr(mod, fn)(**y, **opts)
        assert rms_ratio(o, ref_o) < TOL, fn


# ---- errors of the command -------------------------------------------------------------------
def test_compile_errors_are_one_line(tmp_path):
    spec = EXAMPLES[0]
    afile = tmp_path / "a_file"
    afile.write_text("")
    bad_spec = tmp_path / "bad.lr"
    bad_spec.write_text("mixer bad\ndecay scalar g\ngain scalar beta in (0, 3)\nnormalize q, k\n")
    syntax = tmp_path / "syntax.lr"
    syntax.write_text("mixer syntax\ndecay scalar g\ngain scalar beta in (0, 1\n")
    cases = [(spec, afile), (spec, afile / "sub"), (tmp_path / "missing.lr", tmp_path),
             (bad_spec, tmp_path), (syntax, tmp_path)]
    for src, out in cases:
        rc, stdout, stderr = run_cli("compile", src, "-o", out)
        assert rc == 1 and stdout == "", (src, out, stdout)
        first = stderr.splitlines()[0]
        assert "error" in first and "Traceback" not in stderr, stderr
    assert afile.read_text() == ""  # nothing was written over the file


def test_compile_cli_subprocess_error_exit_code(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    proc = subprocess.run([sys.executable, "-m", "lrdsl.cli", "compile", str(EXAMPLES[0]), "-o", str(afile)],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- nothing from the spec but validated names reaches generated code ------------------------
PAYLOADS = ['"); import os; os.system("zz_payload_1")', "__import__('os').system('zz_payload_2')",
            "'''zz_payload_3'''", '"""zz_payload_4"""', "\\ zz_payload_5", "lambda: zz_payload_6"]


def test_spec_comments_do_not_reach_generated_source(tmp_path):
    text = "".join(f"# {p}\n" for p in PAYLOADS)
    text += ("mixer injected   # \"); import os  zz_payload_7\n"
             "decay scalar g   # __import__('os') zz_payload_8\n"
             "gain scalar beta in (0, 1)  # ''' zz_payload_9\n"
             "precond diagonal atk(g_atk, beta_atk, x = 1.5, center = -0.2)   # \"\"\" zz_payload_10\n"
             "normalize q, k   # \\ zz_payload_11\n")
    source = runtime.generate(lrdsl.compile(text=text).ir)
    assert "zz_payload" not in source and "import os" not in source and "__import__" not in source
    compile(source, "injected.py", "exec")
    spec = tmp_path / "injected.lr"
    spec.write_text(text)
    rc, _, err = run_cli("compile", spec, "-o", tmp_path)
    assert rc == 0, err
    assert (tmp_path / "injected.py").read_text() == source + cli.FORWARD_ONLY


BAD_NAMES = [
    # mixer names
    "mixer __init__\ndecay none\ngain none\n",
    "mixer lambda\ndecay none\ngain none\n",
    "mixer class\ndecay none\ngain none\n",
    'mixer x"y\ndecay none\ngain none\n',
    "mixer x'); import os; ('\ndecay none\ngain none\n",
    "mixer _hidden\ndecay none\ngain none\n",
    # axis-form inputs
    "mixer ok\ndecay scalar lambda\ngain none\n",
    "mixer ok\ndecay scalar class\ngain none\n",
    "mixer ok\ndecay scalar __g\ngain none\n",
    "mixer ok\ndecay scalar __class__\ngain none\n",
    'mixer ok\ndecay scalar g"\ngain none\n',
    "mixer ok\ndecay scalar g\\\nimport os\ngain none\n",
    "mixer ok\ngain scalar def in (0, 1)\n",
    "mixer ok\ngain channelwise b, return\n",
    "mixer ok\ndecay none\ngain none\nprecond diagonal atk(import, beta_atk)\n",
    "mixer ok\ndecay none\ngain none\nprecond diagonal atk(g_atk, __builtins__)\n",
    # explicit-form inputs, states, lets
    "mixer ok\ninput q[K], k[K], v[V], None log\nS = exp(None) S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], True log\nS = exp(True) S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], yield log\nS = exp(yield) S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], g log\nstate class[K] = exp(g) * class + k\nS = S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], g log\nlet await = exp(g)\nS = await S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], \u0123 log\nS = exp(\u0123) S + k v^T\no = S^T q\n",
    "mixer ok\ninput q[K], k[K], v[V], g\nlog\nS = exp(g) S + k v^T\no = S^T q\n",
]


@pytest.mark.parametrize("text", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_injecting_names_are_refused(text):
    with pytest.raises(lrdsl.SpecError):
        lrdsl.compile(text=text)


def test_refused_name_error_is_one_line_in_cli(tmp_path):
    spec = tmp_path / "lam.lr"
    spec.write_text("mixer ok\ndecay scalar lambda\ngain none\n")
    rc, stdout, stderr = run_cli("compile", spec, "-o", tmp_path)
    assert rc == 1 and "reserved" in stderr.splitlines()[0] and not list(tmp_path.glob("*.py"))


# ---- the cache -------------------------------------------------------------------------------
def test_load_twice_reuses_the_cached_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(tmp_path / "cache"))
    text = (ROOT / "examples" / "gla.lr").read_text().replace("mixer gla", "mixer gla_cache_probe")
    first = lrdsl.compile(text=text).kernels
    path = Path(first.__file__)
    assert path.parent == tmp_path / "cache"
    before = path.stat()
    time.sleep(0.01)
    second = lrdsl.compile(text=text).kernels  # a new Mixer, same spec
    assert second is first
    sys.modules.pop(first.__name__)  # force a fresh import: the file is found, not rewritten
    try:
        third = runtime.load(lrdsl.compile(text=text).ir)
    finally:
        sys.modules[first.__name__] = first
    after = path.stat()
    assert third is not first and Path(third.__file__) == path
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in path.parent.iterdir() if p.name not in ("__pycache__", ".locks")) == [path.name]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_compiled_module_has_the_umasks_mode(tmp_path, umask):
    """`lrdsl compile -o` writes the module as open() would (0666 less the umask): readable by the
    others a shared build folder is meant for, not 0600 as a bare mkstemp leaves it."""
    old = os.umask(umask)
    try:
        assert cli.main(["compile", str(ROOT / "examples" / "gla.lr"), "-o", str(tmp_path)]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "gla.py").stat().st_mode & 0o777 == 0o666 & ~umask


def test_cache_folder_is_the_platforms_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LRDSL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.cache_dir() == tmp_path / "xdg" / "lrdsl"
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(tmp_path / "mine"))
    assert runtime.cache_dir() == tmp_path / "mine"


def test_a_writer_waits_for_the_lock_and_finds_the_module_written(tmp_path):
    """A second writer of a module that is being written waits, then finds it whole and leaves it."""
    from filelock import FileLock
    source, path, found = "X = 1\n", tmp_path / "m.py", []
    (tmp_path / ".locks").mkdir()
    with FileLock(tmp_path / ".locks" / "m.py.lock"):
        writer = threading.Thread(target=lambda: found.append(runtime._cached(tmp_path, "m.py", source)))
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and not path.exists()  # waiting for the lock
        runtime.write_atomic(path, source)
        written = path.stat().st_ino
    writer.join(30)
    assert found == [path] and path.stat().st_ino == written and path.read_text() == source


WRITER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    import lrdsl
    from lrdsl.runtime import loader as runtime
    barrier, me, n, spec = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    m = lrdsl.compile(spec)
    source = runtime.generate(m.ir)
    (barrier / me).touch()  # start together once every writer has imported torch and compiled the spec
    deadline = time.time() + 120
    while len(list(barrier.iterdir())) < n and time.time() < deadline:
        time.sleep(0.001)
    mod = runtime.load(m.ir)  # the real path: generate, write if absent, import
    path = Path(mod.__file__)
    for i in range(40):  # then hammer the same file, reading it back between writes
        runtime.write_atomic(path, source)
        text = path.read_text()
        assert text == source, f"partial file seen after {i} writes"
        compile(text, str(path), "exec")
    assert callable(mod.recurrent)
    print(path)
''')


# each writer is a Python start-up importing torch: two and four race under -m slow
@pytest.mark.parametrize("writers", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_concurrent_writers_leave_a_whole_module(tmp_path, writers):
    cache = tmp_path / "shared-cache"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = clean_env(LRDSL_CACHE_DIR=str(cache), TRITON_INTERPRET="1")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(barrier), f"w{i}", str(writers),
                               str(ROOT / "examples" / "kda.lr")],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(writers)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
    paths = {stdout.strip() for stdout, _ in outs}
    assert len(paths) == 1
    path = Path(paths.pop())
    files = sorted(p for p in cache.iterdir() if p.name not in ("__pycache__", ".locks"))
    assert files == [path], f"left over: {files}"  # no temporary files
    text = path.read_text()
    compile(text, str(path), "exec")
    assert text == runtime.generate(lrdsl.compile(ROOT / "examples" / "kda.lr").ir)


AUX_NAMES = """
mixer aux_names
input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1), a1 log shared, a2 log shared
state xb_y[K] = exp(a1) * xb_y + k * k
state xaux_y[K] = exp(a2) * xaux_y + xb_y * k * k
S = (I - beta (xaux_y * k) k^T) exp(g) S + beta (xaux_y * k) v^T
o = S^T q
"""


def test_auxiliary_state_names_do_not_collide_in_generated_code():
    """`xb_y` and `xaux_y` once mapped to the same pointer name; forward and gradients now match."""
    mixer = lrdsl.compile(text=AUX_NAMES, check_stability=False)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=16, seed=13), "cpu")
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = mixer.chunk(**leaves, **opts)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, _ = mixer.reference(**ref, **opts)
    (ref_o * do.double()).sum().backward()
    assert rms_ratio(o, ref_o) < TOL
    assert all(rms_ratio(leaves[n].grad, ref[n].grad) < 10 * TOL for n in x)


def test_a_module_that_fails_to_load_leaves_no_trace(monkeypatch):
    mixer = lrdsl.compile(ROOT / "examples" / "mamba2.lr", load_kernels=False)
    good = runtime.generate(mixer.ir)
    monkeypatch.setattr(runtime, "generate", lambda m: good + "\nraise RuntimeError('broken on import')\n")
    before = set(sys.modules)
    with pytest.raises(RuntimeError, match="broken on import"):
        runtime.load(mixer.ir)
    assert set(sys.modules) == before
    monkeypatch.setattr(runtime, "generate", lambda m: good)
    assert hasattr(runtime.load(mixer.ir), "chunk")


def test_written_module_refuses_tensors_that_do_not_fit(compiled_dir):
    """The module of `lrdsl compile -o` checks its inputs itself: wrong shapes once read past the
    end of tensors and returned finite garbage."""
    import importlib.util
    _, path = compiled_dir["gated_deltanet"]
    spec = importlib.util.spec_from_file_location("standalone_gated_deltanet", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    B, T, H, K, V = 2, 20, 2, 16, 16
    good = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H), beta=torch.rand(B, T, H))
    o, _ = mod.chunk(**good)
    assert o.shape == (B, T, H, V) and torch.isfinite(o).all()
    bad_cases = [
        (dict(good, g=-torch.rand(B, T)), "g must be"),
        (dict(good, beta=torch.rand(B, T, H, K)), "beta must be"),
        (dict(good, v=torch.randn(B, T + 1, H, V)), "q must be"),
        (dict(good, k=torch.randn(B, T, H, K).to(torch.int32)), "floating-point"),
    ]
    for kwargs, message in bad_cases:
        for fn in (mod.chunk, mod.recurrent):
            with pytest.raises((ValueError, TypeError), match=message):
                fn(**kwargs)
    with pytest.raises(ValueError, match="initial_state"):
        mod.chunk(**good, initial_state=torch.zeros(B, H, K, V + 1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        mod.chunk(**{n: t[:1] for n, t in good.items()}, cu_seqlens=torch.tensor([0, 5, T + 3]))
    with pytest.raises(ValueError, match="scale"):
        mod.chunk(**good, scale=float("nan"))
