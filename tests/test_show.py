"""`lrdsl show`, the explicit printer and the canonical IR: printing and re-parsing is lossless, the
axis form desugars to the explicit form, and algebraic rewrites of one transition lower alike."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lrdsl
import lrdsl.cli
from lrdsl.frontend import printer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.lr"))
NAMES = [p.stem for p in EXAMPLES]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "lrdsl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def spec(*lines):
    return "\n".join(lines) + "\n"


def ir_of(text):
    return lrdsl.compile(text=text, check_stability=False).ir


def example_ir(name):
    return lrdsl.compile(ROOT / "examples" / f"{name}.lr", check_stability=False).ir


def test_there_are_examples():
    assert len(EXAMPLES) >= 10


# ---- lrdsl show -----------------------------------------------------------------------------------
SUBPROCESS = ["gated_deltanet", "gdn2", "precond_kda"]  # through a real `python -m lrdsl.cli` (slow)


@pytest.fixture(scope="module")
def shown():
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        return dict(zip(SUBPROCESS, ex.map(lambda n: cli("show", str(ROOT / "examples" / f"{n}.lr")),
                                           SUBPROCESS)))


def show_in_process(name, capsys):
    from lrdsl.cli import main
    rc = main(["show", str(ROOT / "examples" / f"{name}.lr")])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["lrdsl", "show"], rc, out, err)


@pytest.mark.parametrize("name", NAMES)
def test_show_every_example(shown, capsys, name):
    r = shown[name] if name in shown else show_in_process(name, capsys)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stderr == ""
    m = lrdsl.compile(ROOT / "examples" / f"{name}.lr", check_stability=False)
    explicit, rest = r.stdout.split("\n# canonical form\n")
    canonical, kernels = rest.split("\n# kernels\n")
    assert explicit == "# explicit form\n" + printer.explicit(m.ir)
    assert canonical == printer.canonical(m.ir)
    assert kernels.startswith("chunk      ") and "\nrecurrent  token by token" in kernels
    assert f"mixer {name}\n" in explicit
    # what show prints is itself a spec of the same mixer
    assert ir_of(explicit) == m.ir


VNORM = """mixer vnorm
input q[K] l2norm, k[K] l2norm, v[V] l2norm, beta in (0, 1)
S = (I - beta k k^T) S + beta k v^T
o = S^T q
"""

TWO_SIDED = """mixer two_sided
input q[K], k[K] l2norm, v[V] l2norm, g[K] log, gv[V] log, beta in (0, 1)
S = (I - beta k k^T) diag(exp(g)) S diag(exp(gv)) (I - beta v v^T) + beta k v^T
o = S^T q
"""


@pytest.mark.parametrize("name, first", [
    ("gated_deltanet", "the staged kernels (a decay per token and head)"),
    ("gla", "the staged kernels (a decay per key channel: 16-token blocks on tensor cores)"),
    ("kda_decay_after_erase", "split (lrdsl/codegen/split.py): the staged kernels on two tokens per token"),
    ("mesa", "the offline solve's kernels"),
    ("vnorm", "the general kernels (templates/chunk.py.jinja): an L2 norm over the value channels"),
    ("two_sided", "the two-sided token loop (templates/recurrent_value.py.jinja)"),
    ("oja", "forward on the key side's staged kernels, run on S^T (lrdsl/codegen/value_key.py)"),
])
def test_show_says_which_kernels_chunk_runs(name, first, tmp_path, capsys):
    from lrdsl.cli import main
    path = ROOT / "examples" / f"{name}.lr"
    if name in ("vnorm", "two_sided"):
        path = tmp_path / f"{name}.lr"
        path.write_text(VNORM if name == "vnorm" else TWO_SIDED)
    assert main(["show", str(path)]) == 0
    kernels = capsys.readouterr().out.split("\n# kernels\n")[1]
    assert kernels.startswith("chunk      " + first), kernels
    if name == "kda_decay_after_erase":  # the split spec's own update, phase and gate included
        assert "diag(exp(gate(phase, g)))" in kernels.splitlines()[1]


def test_show_bad_spec_is_an_error(tmp_path):
    p = tmp_path / "bad.lr"
    p.write_text(spec("mixer m", "decay sometimes"))
    r = cli("show", str(p))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"{p}:2:7: error: ")


def test_show_missing_file(tmp_path):
    r = cli("show", str(tmp_path / "absent.lr"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "absent.lr" in r.stderr.splitlines()[0] and "cannot read" in r.stderr


# ---- printing and re-parsing ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_explicit_form_round_trips(name):
    m = example_ir(name)
    text = printer.explicit(m)
    m2 = ir_of(text)
    assert m2 == m and hash(m2) == hash(m)
    assert printer.explicit(m2) == text  # a fixed point
    assert printer.canonical(m2) == printer.canonical(m)


# the lowering writes sigmoid and clamp out (1/(1 + exp(-x)), min(max(x, lo), hi)); show names them again
@pytest.mark.parametrize("written,shown", [
    ("sigmoid(b + c)", "sigmoid(b + c)"), ("sigmoid(-c)", "sigmoid(-c)"), ("log(sigmoid(a))", "log(sigmoid(a))"),
    ("sigmoid(sigmoid(a) - 1)", "sigmoid(sigmoid(a) - 1)"), ("1/(1 + exp(a))", "sigmoid(-a)"),
    ("clamp(a, -1, 1)", "clamp(a, -1, 1)"), ("clamp(sigmoid(a), 0.25, 0.5)", "clamp(sigmoid(a), 1/4, 1/2)"),
    ("2*sigmoid(b)*softplus(c)", "2*sigmoid(b)*softplus(c)"), ("min(a, 1)", "min(1, a)")])
def test_show_names_sigmoid_and_clamp(written, shown, capsys, tmp_path):
    text = spec("mixer m", "input a, b, c", f"let beta = {written}", "decay none", "gain scalar beta",
                "normalize q, k")
    m = ir_of(text)
    printed = printer.explicit(m)
    assert f"let beta = {shown}\n" in printed
    assert ir_of(printed) == m  # re-parses to the same IR
    path = tmp_path / "m.lr"
    path.write_text(text)
    assert lrdsl.cli.main(["show", str(path)]) == 0
    assert f"let beta = {shown}\n" in capsys.readouterr().out


def test_examples_are_pairwise_different():
    """The round trip would be vacuous if distinct specs compared equal."""
    irs = [example_ir(n) for n in NAMES]
    for i in range(len(irs)):
        for j in range(i + 1, len(irs)):
            assert irs[i] != irs[j], (NAMES[i], NAMES[j])


def test_ir_equality_ignores_spans_but_not_content():
    a = ir_of(spec("mixer lin", "input q[K], k[K], v[V]", "S = S + k v^T", "o = S^T q"))
    b = ir_of(spec("# moved down a line", "mixer lin", "input   q[K],k[K],   v[V]", "S = S + k v^T",
                   "o = S^T q"))
    c = ir_of(spec("mixer lin", "input q[K], k[K], v[V]", "S = S + 2 k v^T", "o = S^T q"))
    assert a == b and hash(a) == hash(b)
    assert a != c


# ---- axis form == hand-written explicit form --------------------------------------------------------------
PAIRS = {
    "gated_deltanet": spec(
        "mixer gated_deltanet",
        "input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1)",
        "S = exp(g) (I - beta k k^T) S + beta k v^T",
        "o = S^T q"),
    "deltanet": spec(
        "mixer deltanet",
        "input q[K] l2norm, k[K] l2norm, v[V], beta in (0, 1)",
        "S = (I - beta k k^T) S + beta k v^T",
        "o = S^T q"),
    "mamba2": spec(
        "mixer mamba2",
        "input q[K], k[K], v[V], g log",
        "S = exp(g) S + k v^T",
        "o = S^T q"),
    "retnet": spec(
        "mixer retnet",
        "input q[K], k[K], v[V]",
        "S = (1 - 2^(-5 - h)) S + k v^T",
        "o = S^T q"),
    "linear_attention": spec(
        "mixer linear_attention",
        "input q[K], k[K], v[V]",
        "S = S + k v^T",
        "o = S^T q"),
    "channel_gates_scalar_decay": spec(
        "mixer channel_gates_scalar_decay",
        "input q[K] l2norm, k[K] l2norm, v[V], g log, b[K] in [0, 1], w[V] in [0, 1]",
        "S = exp(g) (I - k (b*k)^T) S + k (w*v)^T",
        "o = S^T q"),
    "precond_deltanet": spec(
        "mixer precond_deltanet",
        "input q[K] l2norm, k[K] l2norm, v[V], g log",
        "input g_atk log shared, beta_atk in (0, 1) shared, beta in (0, 1)",
        "state p_atk[K] = exp(g_atk) * p_atk + beta_atk * k * k",
        "let m_atk = squash(p_atk, x = 1.5, center = -0.2)",
        "S = exp(g) (I - beta (m_atk*k) k^T) S + beta (m_atk*k) v^T",
        "o = S^T q"),
    "gdn2_atk": spec(
        "mixer gdn2_atk",
        "input q[K] l2norm, k[K] l2norm, v[V], g[K] log, g_atk log shared, beta_atk in (0, 1) shared",
        "input b[K] in [0, 1], w[V] in [0, 1]",
        "state p_atk[K] = exp(g_atk) * p_atk + beta_atk * k * k",
        "let m_atk = squash(p_atk, x = 3/2, center = -1/5)",
        "S = (I - (m_atk*k) (b*k)^T) diag(exp(g)) S + (m_atk*k) (w*v)^T",
        "o = S^T q"),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_axis_form_equals_hand_written_explicit_form(name):
    axis = (ROOT / "examples" / f"{name}.lr").read_text()
    assert any(line.startswith(("decay ", "gain ")) for line in axis.splitlines())  # really the axis form
    a, b = example_ir(name), ir_of(PAIRS[name])
    assert a == b and hash(a) == hash(b)


def test_axis_form_differs_when_the_model_differs():
    assert example_ir("gated_deltanet") != ir_of(PAIRS["gated_deltanet"].replace("(0, 1)", "(0, 2)"))
    assert example_ir("gated_deltanet") != ir_of(PAIRS["deltanet"].replace("deltanet", "gated_deltanet"))
    assert example_ir("retnet") != ir_of(PAIRS["retnet"].replace("-5 - h", "-6 - h"))
    assert example_ir("precond_deltanet") != ir_of(PAIRS["precond_deltanet"].replace("x = 1.5", "x = 2"))


# ---- one transition, different algebra ---------------------------------------------------------------
GDN_HEAD = ["mixer gated_deltanet", "input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1)"]
KDA_HEAD = ["input q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 1)"]
GDN2_HEAD = ["mixer gdn2", "input q[K] l2norm, k[K] l2norm, v[V]", "input g[K] log",
             "input b[K] in [0, 1]", "input w[V] in [0, 1]"]
REWRITES = [
    ("gated_deltanet", GDN_HEAD, "S = exp(g) S - exp(g) beta k k^T S + beta k v^T"),
    ("gated_deltanet", GDN_HEAD, "S = (I - beta k k^T) exp(g) S + beta k v^T"),
    ("gated_deltanet", GDN_HEAD, "S = beta k v^T + exp(g) (I - beta k k^T) S"),
    ("gated_deltanet", GDN_HEAD, "S = exp(g) (I - k (beta*k)^T) S + k (beta*v)^T"),
    ("gated_deltanet", GDN_HEAD, "S = exp(g) (I - (2 k) (beta k / 2)^T) S + (beta/2) k v^T + k (beta v / 2)^T"),
    ("gated_deltanet", GDN_HEAD, "S = exp(g) S - beta exp(g) k k^T S + k (v*beta)^T"),
    ("kda", ["mixer kda", *KDA_HEAD], "S = diag(exp(g)) S - beta k (k*exp(g))^T S + beta k v^T"),
    ("kda", ["mixer kda", *KDA_HEAD], "S = (diag(exp(g)) - beta k (exp(g)*k)^T) S + k (beta*v)^T"),
    ("kda_decay_after_erase", ["mixer kda_decay_after_erase", *KDA_HEAD],
     "S = diag(exp(g)) S - (beta*exp(g)*k) k^T S + beta k v^T"),
    ("gdn2", GDN2_HEAD, "S = diag(exp(g)) S - k (b*k*exp(g))^T S + k (v*w)^T"),
    ("linear_attention", ["mixer linear_attention", "input q[K], k[K], v[V]"],
     "S = (3 - 2) I S + 1/2 k v^T + k (v/2)^T"),
    ("mamba2", ["mixer mamba2", "input q[K], k[K], v[V], g log"], "S = diag(exp(g)) S + k v^T"),
]


@pytest.mark.parametrize("i", range(len(REWRITES)), ids=[f"{r[0]}-{r[2]}" for r in REWRITES])
def test_algebraic_rewrites_lower_alike(i):
    name, head, update = REWRITES[i]
    a, b = example_ir(name), ir_of(spec(*head, update, "o = S^T q"))
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("update", [
    "S = exp(g) (I - k (-beta*k)^T) S + beta k v^T",  # I + beta k k^T
    "S = (I - beta k k^T) S + beta k v^T",  # no decay
    "S = exp(g) (I - beta k k^T) S + k v^T",  # write without beta
    "S = exp(g) (I - beta k k^T) S + beta k (2 v)^T",
])
def test_different_transitions_lower_differently(update):
    assert example_ir("gated_deltanet") != ir_of(spec(*GDN_HEAD, update, "o = S^T q"))


def test_kda_orders_are_different_mixers():
    assert example_ir("kda") != example_ir("kda_decay_after_erase")
    assert example_ir("kda").delta.order != example_ir("kda_decay_after_erase").delta.order


# ---- help -------------------------------------------------------------------------------------------
def test_help():
    r = cli("--help")
    assert r.returncode == 0 and r.stderr == ""
    for word in ("show", "check", "usage: lrdsl"):
        assert word in r.stdout


@pytest.mark.parametrize("sub,words", [("check", ["spec", "--json"]), ("show", ["spec"])])
def test_subcommand_help(sub, words):
    r = cli(sub, "--help")
    assert r.returncode == 0 and r.stderr == ""
    assert f"usage: lrdsl {sub}" in r.stdout
    for w in words:
        assert w in r.stdout


def test_no_command_prints_help():
    r = cli()
    assert r.returncode == 2
    assert "show" in r.stdout and "check" in r.stdout


def test_every_command_says_what_it_does_in_its_help(capsys):
    """`lrdsl COMMAND --help` has a paragraph of its own between the usage and the arguments, not
    only the one-line summary of the top-level help."""
    from lrdsl.cli import main
    for command in ("show", "check", "compile", "fuzz", "bench", "mqar"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--help"])
        assert stop.value.code == 0
        text = capsys.readouterr().out
        head = text.split("positional arguments:")[0]
        paragraph = head.split("\n\n", 1)[1] if "\n\n" in head else ""
        assert len(paragraph.split()) >= 12, f"lrdsl {command} --help has no description:\n{text}"
